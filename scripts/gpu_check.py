"""Everything that needs a GPU, in one command, on a lent GPU machine (never needed by CI).

Runs with the machine's own `python3` (torch with CUDA, transformers): no Ray, no network, no
virtual environment, nothing installed. From the repository root:

    python3 scripts/gpu_check.py --out out/gpu              # the GPU check, under 9 minutes
    python3 scripts/gpu_check.py --dry-run --out /tmp/gpu   # every section on the CPU, tiny
    python3 scripts/gpu_check.py --dry-run --one-process    # the same, quicker: one process

Sections (each in its own process, so a crash or a hang costs that section only, under its own
time limit, the limits capped so that the whole run ends within TOTAL_BUDGET_S):
  env               torch, CUDA, the node probe and the pin decision
  offloaders        none / prefetch (pinned, pageable: the staged engine) / uva, in process:
                    bitwise equal to resident, detach restores; the arena really registered
  fences            prefetch under slow kernels: a sleep kernel at the start of every layer,
                    fewer slots than layers (N % K != 0 too), bitwise over many forwards, from
                    pinned and pageable memory; controls without the fence and without the wait
  uva               zero-copy views of registered memory (explicit device index, addresses in
                    the mapped range), of unpinned memory where the GPU reads it through the
                    host page tables (refused, naming the fix, where it does not)
  bandwidth         host-to-device rate from pinned, pageable, staged and pin_memory() memory,
                    against the link's peak (PCIe generation x width, from nvidia-smi)
  prefetch_timing   overlap with compute of prefetch from pinned vs pageable memory (staged,
                    and unstaged: CUDA's own blocking copies), compute matched to the copy time
  stage             a worker's stage in process (StageWorker, two stages, one layer offloaded
                    each, bf16): logits of transformers on the same device
  batched           the engine's batched steps in process (LocalPipeline, two stages, three
                    prompts at once): each prompt's greedy tokens those of transformers alone
  engine_speed      what a step costs beyond its compute: 8 concurrent requests on one stage
                    (resident; 60% offloaded) against transformers' batch of 8, the engine's
                    own time per step and per token
  step_profile      where a decode step's time goes at ~0.7B bf16, ours against transformers':
                    wall and device time per step, the kernels, under torch's profiler
  attention_graphs  a fresh engine's first pass over its shapes against a warm one, with
                    cuDNN's attention (a graph built per shape) on and off
  planner_rate      the planner's compute probe on this device against the engine's steps at
                    4 and 16 concurrent requests
  quantized_moe     MXFP4 experts offloaded in 4 bits and block FP8 dequantized after each
                    copy (against transformers and the checkpoint dequantized while read);
                    routed expert fetch against whole-layer fetch
  resident_stored   resident FP8 and MXFP4 matrices kept as stored, dequantized just in time
                    (experts in compact rows too): the logits of dequantized-at-load, fewer bytes
  compact_prefill   what a 512-token prompt and a decode pass cost with a DeepSeek-V3-shaped
                    MoE's experts in compact rows (a quarter of 256) against every expert's
  pinning           every host buffer a worker page-locks follows the node's decision: with
                    OFFLOAD_PIN_MEMORY=off nothing pinned, with =on the arena and staging
  recovery          what a re-plan budgets for a survivor's GPU with its stage still loaded
  pytest_gpu        tests/test_gpu.py, where pytest and hypothesis are installed

Writes DIR/summary.md (the table for bench/RESULTS.md), DIR/results.json, and per section
DIR/<name>.json and DIR/<name>.log; `--results-md FILE` also puts the summary into FILE between
the gpu_check markers. Exit status 1 if any section failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Sections stop early enough for the whole run to end within one 10-minute command.
TOTAL_BUDGET_S = 510.0
DRY_RUN_SECTION_LIMIT_S = 120.0
MIN_PYTEST_S = 60.0  # pytest_gpu runs only with at least this much of the budget left
RESULTS_BEGIN = "<!-- gpu_check:begin -->"
RESULTS_END = "<!-- gpu_check:end -->"


class Skip(Exception):
    """A section that does not apply here (said why in the summary)."""


class Section:
    """What one section found: named checks (pass/fail), data, notes. Saved after every check,
    so a section whose process dies still reports what it had found."""

    def __init__(self, name: str, out: Path, device, dry: bool) -> None:
        self.name = name
        self.out = out
        self.device = device
        self.dry = dry
        self.cuda = device.type == "cuda"
        self.checks: list[dict] = []
        self.data: dict = {}
        self.notes: list[str] = []
        self.status = "running"
        self.error = ""

    def check(self, name: str, ok: bool, detail: object = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        self.save()
        return bool(ok)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note {text}", flush=True)
        self.save()

    def save(self) -> None:
        record = {
            "name": self.name,
            "status": self.status,
            "checks": self.checks,
            "data": self.data,
            "notes": self.notes,
            "error": self.error,
        }
        path = self.out / f"{self.name}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record, indent=1, default=str))
        path.with_suffix(".tmp").replace(path)


# ---------------------------------------------------------------------------------- helpers


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sleep_module(cycles: int):
    import torch
    from torch import nn

    class Sleep(nn.Module):
        """Time and nothing else: on CUDA a spinning kernel, so the layer's reads of its
        weights run well after its kernels were issued (a copy that skips the compute fence
        lands first); on the CPU a short sleep that lets the copy thread run."""

        def __init__(self) -> None:
            super().__init__()
            self.cycles = cycles

        def forward(self, x):
            if self.cycles > 0:
                if x.is_cuda:
                    torch.cuda._sleep(self.cycles)
                else:
                    time.sleep(self.cycles / 1e10)
            return x

    return Sleep()


def _stack(num_layers: int, hidden: int, device, *, sleep_cycles: int = 0, dtype=None):
    """Linear/GELU/LayerNorm blocks with seeded random weights (LayerNorm's too), optionally
    each starting with a sleep."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(num_layers):
        block = [nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden)]
        with torch.no_grad():
            block[2].weight.normal_()
            block[2].bias.normal_()
        if sleep_cycles:
            block.insert(0, _sleep_module(sleep_cycles))
        layers.append(nn.Sequential(*block).to(device=device, dtype=dtype).eval())
    return layers


def _forward(layers, x):
    import torch

    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


def _pin_modes(s: Section) -> list[str]:
    """Pinned and pageable on CUDA; on the CPU nothing can be pinned: the policy's own choice."""
    return ["on", "off"] if s.cuda else ["auto"]


def _env(pin: str) -> dict[str, str]:
    return {} if pin == "auto" else {"OFFLOAD_PIN_MEMORY": pin}


def _pinned_at(ptr: int) -> bool:
    """Whether CUDA sees host address `ptr` as pinned (`Tensor.is_pinned` asks about its
    storage's first byte, so ask with a one-byte tensor that starts at `ptr`)."""
    import torch

    return torch.frombuffer((ctypes.c_uint8 * 1).from_address(ptr), dtype=torch.uint8).is_pinned()


def _time_forwards(layers, x, device, *, iters: int, repeats: int) -> float:
    """Median seconds per forward over `repeats` runs of `iters` forwards (after a warm-up)."""
    for _ in range(2):
        _forward(layers, x)
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            _forward(layers, x)
        _sync(device)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def _floor(package: str) -> str | None:
    """The oldest release of `package` pyproject.toml's dependencies accept (`>=`), or None."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(package)}(?:\[[^]]*\])?>=([0-9.]+)', text)
    return found.group(1) if found else None


# --------------------------------------------------------------------------------- sections


def section_env(s: Section) -> None:
    import torch
    from packaging.version import Version  # transformers' own dependency

    from offload import decide_pinning, probe_node
    from offload.policy import resolve_backend
    from offload.uva import torch_views_unregistered_memory

    s.data["python"] = platform.python_version()
    s.data["torch"] = torch.__version__
    s.data["torch_cuda"] = torch.version.cuda
    with contextlib.suppress(ImportError):
        import transformers

        s.data["transformers"] = transformers.__version__
    for name, version in (
        ("torch", torch.__version__),
        ("transformers", s.data.get("transformers")),
    ):
        floor = _floor(name)
        if version and floor and Version(version).release < Version(floor).release:
            s.note(
                f"{name} {version} is older than the {floor} pyproject.toml asks for (the oldest "
                'the suite passes on): what differs there is in bench/RESULTS.md, "torch and '
                'transformers releases"; the sections here use no recurrent family'
            )
    s.data["torch_views_unregistered_memory"] = torch_views_unregistered_memory()
    probe = probe_node()
    s.data["probe"] = probe.to_dict()
    decision = decide_pinning({}, probe)
    s.data["pin_decision"] = decision.to_dict()
    s.data["auto_backend"] = resolve_backend("auto", probe, device_type=s.device.type)
    # what a pageable arena's copies would take where its bounce chunks may be pinned
    s.data["pageable_engine"] = probe.pageable_engine(may_pin=True)
    if s.cuda:
        props = torch.cuda.get_device_properties(s.device)
        s.data["device"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        )
        s.check("probe ran without errors", probe.errors == (), probe.errors)
        s.check(
            "the driver answered the ATS attributes",
            all(d.pageable_memory_access_uses_host_page_tables is not None for d in probe.devices),
        )
    else:
        s.data["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
        s.check("probe ran", probe.cpu_count > 0, probe.errors)


def section_offloaders(s: Section) -> None:
    import torch

    from offload import HostArena, OffloadConfig, TensorSpec, create_offloader
    from offload.staging import StagedCopyEngine

    hidden = 32 if s.dry else 1024
    modules = _stack(6, hidden, s.device)
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1)).to(s.device)
    reference = _forward(modules, x)
    variants = [("none", "auto")] + [("prefetch", pin) for pin in _pin_modes(s)]
    variants.append(("uva", "on" if s.cuda else "auto"))
    for backend, pin in variants:
        label = backend if pin == "auto" else f"{backend} pin={pin}"
        offloader = create_offloader(
            OffloadConfig(backend=backend, layers=(1, 2, 4), prefetch_step=2),
            device=s.device,
            env=_env(pin),
        )
        try:
            offloader.wrap_modules(modules)
            offloader.post_init()
            same = all(torch.equal(_forward(modules, x), reference) for _ in range(5))
            offloader.synchronize()
            stats = offloader.stats()
            s.data[label] = stats.to_dict()
            s.check(f"{label}: bitwise equal to resident over 5 forwards", same)
            if backend != "none":
                s.check(
                    f"{label}: weights offloaded", stats.offloaded_bytes > 0, stats.offloaded_bytes
                )
            if backend == "prefetch" and s.cuda:
                staged = isinstance(offloader._engine, StagedCopyEngine)
                s.check(f"{label}: staged engine exactly when pageable", staged == (pin == "off"))
        finally:
            offloader.detach()
        s.check(f"{label}: detach restores", torch.equal(_forward(modules, x), reference))
    if s.cuda:
        specs = [TensorSpec(f"t{i}", (1000 + 7 * i,), torch.float16) for i in range(10)]
        arena = HostArena(specs, pin=True)
        inside = [arena[k].data_ptr() for k in arena] + [arena.data_ptr + arena.nbytes - 1]
        s.check("arena: every address inside the range is pinned", all(map(_pinned_at, inside)))
        arena.close()
        s.check("arena: unregistered by close()", not any(map(_pinned_at, inside)))


def _broken_engine(device, what: str):
    """A CUDA copy engine without the compute fence, or without the wait: the controls that
    show the fence test would catch either."""
    from offload.copy_engine import CudaCopyEngine

    class Broken(CudaCopyEngine):
        def fence(self):
            return None if what == "fence" else super().fence()

        def wait(self, ticket) -> None:
            if what != "wait":
                super().wait(ticket)

    return Broken(device)


def section_fences(s: Section) -> None:
    import torch

    from offload import OffloadConfig, PrefetchOffloader

    hidden = 32 if s.dry else 2048  # 16 MiB per layer on the GPU: ~0.3 ms over PCIe 5
    cycles = 1_000_000  # ~0.5 ms on the GPU
    forwards = 3 if s.dry else 30
    modules = _stack(7, hidden, s.device, sleep_cycles=cycles)
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(2)).to(s.device)
    reference = _forward(modules, x)
    patterns = [((0, 1, 2, 3, 4, 5), 2), ((0, 1, 2, 3, 4, 5, 6), 3), ((1, 3, 4), 1), ((0, 2), 0)]
    for pin in _pin_modes(s):
        for layers, step in patterns:
            offloader = PrefetchOffloader(
                OffloadConfig(layers=layers, prefetch_step=step), device=s.device, env=_env(pin)
            )
            offloader.wrap_modules(modules)
            try:
                offloader.post_init()
                differ = sum(
                    not torch.equal(_forward(modules, x), reference) for _ in range(forwards)
                )
                offloader.synchronize()
                stats = offloader.stats()
            finally:
                offloader.detach()
            s.data[f"pin={pin} layers={layers} step={step}"] = stats.to_dict()
            s.check(
                f"pin={pin}, {len(layers)} layers, {offloader.config.prefetch_step} step: "
                f"bitwise over {forwards} forwards",
                differ == 0,
                f"{differ} differ",
            )
    if not s.cuda:
        s.note("controls without fence / wait: CUDA only (CPU compute is synchronous)")
        return
    for what in ("fence", "wait"):
        offloader = PrefetchOffloader(
            OffloadConfig(layers=tuple(range(7)), prefetch_step=3),
            device=s.device,
            env={"OFFLOAD_PIN_MEMORY": "on"},
            copy_engine=_broken_engine(s.device, what),
        )
        offloader.wrap_modules(modules)
        try:
            offloader.post_init()
            differ = sum(not torch.equal(_forward(modules, x), reference) for _ in range(forwards))
        finally:
            offloader.detach()
        s.data[f"control without the {what}"] = differ
        s.note(
            f"control without the {what}: {differ} of {forwards} forwards differ "
            "(0 would mean this test could not see that bug)"
        )


def section_uva(s: Section) -> None:
    import torch

    from offload import OffloadConfig, OffloadUnavailableError, probe_node
    from offload.probe import DECISION_STEPS
    from offload.uva import UVAOffloader, _mapped_device_pointer, reads_pageable_memory

    hidden = 32 if s.dry else 1024
    modules = _stack(4, hidden, s.device)
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(3)).to(s.device)
    reference = _forward(modules, x)

    def run(pin: str, device: str) -> None:
        offloader = UVAOffloader(
            OffloadConfig(backend="uva", layers=(1, 3)), device=device, env=_env(pin)
        )
        label = f"uva pin={pin} device={device}"
        offloader.wrap_modules(modules)
        try:
            arena = offloader._arena
            weight = modules[1][0].weight
            s.check(
                f"{label}: bitwise equal to resident", torch.equal(_forward(modules, x), reference)
            )
            stats = offloader.stats()
            s.data[label] = stats.to_dict() | {"pin": offloader.pin_decision.to_dict()}
            s.check(
                f"{label}: nothing copied, no slots", stats.copies == 0 and stats.buffer_bytes == 0
            )
            if s.cuda:
                s.check(
                    f"{label}: explicit device index",
                    weight.device.index is not None,
                    weight.device,
                )
                base = _mapped_device_pointer(arena.data_ptr) if arena.pinned else arena.data_ptr
                s.check(
                    f"{label}: a view in the arena's mapped range",
                    base <= weight.data_ptr() < base + arena.nbytes,
                )
                s.check(
                    f"{label}: arena pinned as decided", arena.pinned == offloader.pin_decision.pin
                )
        finally:
            offloader.detach()
        s.check(f"{label}: detach restores", torch.equal(_forward(modules, x), reference))

    if not s.cuda:
        run("auto", "cpu")  # the CPU stand-in: plain views of the arena
        s.note("registered and unpinned device views: CUDA only")
        return
    run("on", "cuda")  # registered memory, no index given: the offloader makes it explicit
    probe = probe_node(DECISION_STEPS)
    index = torch.cuda.current_device()
    s.data["reads pageable memory (ATS)"] = reads_pageable_memory(probe, index)
    if reads_pageable_memory(probe, index):
        run("off", f"cuda:{index}")  # unpinned memory read through the host page tables
    else:
        try:
            UVAOffloader(
                OffloadConfig(backend="uva", layers=(0,)),
                device=f"cuda:{index}",
                env={"OFFLOAD_PIN_MEMORY": "off"},
            ).wrap_modules(_stack(2, hidden, s.device))
            s.check("unpinned memory without ATS is refused", False, "no error raised")
        except OffloadUnavailableError as exc:
            s.check(
                "unpinned memory without ATS is refused, naming the fix",
                "OFFLOAD_PIN_MEMORY=on" in str(exc),
                exc,
            )
        s.note(
            "this GPU does not read pageable memory through the host page tables: the "
            "unpinned view path runs on GH200/GB200 only"
        )


_PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


def _pcie_link(device) -> dict:
    """The PCIe link of `device` from nvidia-smi (matched by PCI bus id, since
    CUDA_VISIBLE_DEVICES may renumber): generation and width, current and max, and the peak
    rate per direction at the max (payload after line encoding)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    fields = (
        "pci.bus_id,pcie.link.gen.current,pcie.link.width.current,"
        "pcie.link.gen.max,pcie.link.width.max"
    )
    rows = (
        subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    parsed = [[v.strip() for v in row.split(",")] for row in rows]
    bus = getattr(props, "pci_bus_id", None)
    wanted = [r for r in parsed if bus is not None and int(r[0].split(":")[-2], 16) == bus]
    if len(wanted) != 1:
        wanted = parsed if len(parsed) == 1 else []
    if not wanted:
        raise LookupError(f"cannot tell which of {len(parsed)} GPUs is {device} (bus {bus})")
    gen, width, gen_max, width_max = (int(v) for v in wanted[0][1:])
    return {
        "bus_id": wanted[0][0],
        "gen": gen,
        "width": width,
        "gen_max": gen_max,
        "width_max": width_max,
        "peak_bytes_per_s": _PCIE_LANE_BYTES_PER_S[gen_max] * width_max,
    }


def section_bandwidth(s: Section) -> None:
    import torch

    from offload import link
    from offload.staging import CudaStaging, StagedCopyEngine

    if not s.cuda:
        rate = link.measure_cpu_copy(num_bytes=4 * 2**20, repeats=2)
        s.data["cpu memmove GB/s"] = rate / 1e9
        s.check("CPU copy rate measured", rate > 0, f"{rate / 1e9:.1f} GB/s")
        s.note("link peak: CUDA only")
        return
    nbytes = 256 * 2**20
    rates = {
        "pinned (registered arena)": link.measure_host_to_device(
            s.device, pin=True, num_bytes=nbytes
        ),
        "pageable": link.measure_host_to_device(s.device, pin=False, num_bytes=nbytes),
    }
    # pin_memory(): torch's caching host allocator
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=s.device)
    best = float("inf")
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    rates["pin_memory()"] = nbytes / best
    del host
    # the staged engine: pageable memory through pinned chunks on a copy thread
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    engine = StagedCopyEngine(CudaStaging(s.device))
    try:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            engine.wait(engine.submit(dst, src, after=None))
            engine.synchronize()
            best = min(best, time.perf_counter() - start)
        rates["pageable, staged (copy thread + pinned chunks)"] = nbytes / best
        s.check("staged copy lands every byte", torch.equal(dst.cpu(), src))
    finally:
        engine.close()
    s.data["GB/s"] = {k: v / 1e9 for k, v in rates.items()}
    try:
        pcie = _pcie_link(s.device)
        s.data["pcie"] = pcie
        peak = pcie["peak_bytes_per_s"]
        s.data["fraction of peak"] = {k: v / peak for k, v in rates.items()}
        s.check(
            "pinned reaches half the link's peak",
            rates["pinned (registered arena)"] >= 0.5 * peak,
            f"{rates['pinned (registered arena)'] / 1e9:.1f} of {peak / 1e9:.1f} GB/s "
            f"(PCIe gen {pcie['gen_max']} x{pcie['width_max']}; now gen {pcie['gen']} x{pcie['width']})",
        )
    except Exception as exc:  # no nvidia-smi, or no PCIe link (C2C): the rates still stand
        s.note(f"link peak unknown: {type(exc).__name__}: {exc}")
    s.check(
        "pinned is faster than pageable", rates["pinned (registered arena)"] > rates["pageable"]
    )


def section_prefetch_timing(s: Section) -> None:
    import torch

    from offload import HostArena, OffloadConfig, PrefetchOffloader, TensorSpec
    from offload.copy_engine import CudaCopyEngine
    from offload.copy_engines import make_copy_engine
    from offload.staging import CudaStaging, StagedCopyEngine

    num_layers, hidden = (4, 64) if s.dry else (8, 4096)
    dtype = torch.float16 if s.cuda else torch.float32
    iters, repeats = (2, 1) if s.dry else (10, 3)
    modules = _stack(num_layers, hidden, s.device, sleep_cycles=1, dtype=dtype)
    for module in modules:
        module[0].cycles = 0  # set below, on CUDA, to match the copy time
    x = torch.randn(16, hidden, generator=torch.Generator().manual_seed(4)).to(s.device, dtype)
    layer_bytes = sum(p.nbytes for p in modules[0].parameters())

    # The copies alone: each layer's bytes from a pinned arena, one at a time (as `sync` does).
    pin = s.cuda
    with HostArena([TensorSpec("w", (layer_bytes,), torch.uint8)], pin=pin) as arena:
        slot = torch.empty(layer_bytes, dtype=torch.uint8, device=s.device)
        engine = make_copy_engine(s.device)
        try:
            start = time.perf_counter()
            for _ in range(iters * num_layers):
                engine.wait(engine.submit(slot, arena["w"], after=engine.fence()))
            _sync(s.device)
            copy_s = (time.perf_counter() - start) / iters
        finally:
            engine.close()
    # Compute matched to the copy: a sleep per layer as long as one layer's copy.
    if s.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)
        for module in modules:
            module[0].cycles = int(copy_s / num_layers * cycles_per_s)
    reference = _forward(modules, x)
    compute_s = _time_forwards(modules, x, s.device, iters=iters, repeats=repeats)
    everything = tuple(range(num_layers))

    # name -> (prefetch_step, pin, engine): on CUDA from pinned memory; from pageable memory
    # through the direct engine (pinning off: a copy thread the driver blocks), through the
    # staged engine's pinned chunks, and through the side stream alone (the driver blocks the
    # compute thread: the engine pinning off had before issue 57 point 7)
    modes: dict[str, tuple[int, str, str]] = {"sync": (0, _pin_modes(s)[0], "default")}
    if s.cuda:
        modes["prefetch pinned"] = (2, "on", "default")
        modes["prefetch pageable, direct"] = (2, "off", "default")
        modes["prefetch pageable, staged"] = (2, "off", "staged")
        modes["prefetch pageable, compute thread"] = (2, "off", "unstaged")
    else:  # nothing to pin: one prefetch mode, the copy thread's
        modes["prefetch"] = (2, "auto", "default")
    times = {"resident": compute_s, "copy": copy_s}
    for name, (step, pin, engine_kind) in modes.items():
        engine = {
            "unstaged": lambda: CudaCopyEngine(s.device),
            "staged": lambda: StagedCopyEngine(CudaStaging(s.device)),
        }.get(engine_kind, lambda: None)()
        offloader = PrefetchOffloader(
            OffloadConfig(layers=everything, prefetch_step=step),
            device=s.device,
            env=_env(pin),
            copy_engine=engine,
        )
        offloader.wrap_modules(modules)
        try:
            offloader.post_init()
            times[name] = _time_forwards(modules, x, s.device, iters=iters, repeats=repeats)
            s.check(
                f"{name}: bitwise equal to resident", torch.equal(_forward(modules, x), reference)
            )
        finally:
            offloader.detach()
    hidden_part = min(copy_s, compute_s)
    s.data["ms per forward"] = {k: v * 1e3 for k, v in times.items()}
    s.data["overlap efficiency"] = {
        k: (times["sync"] - v) / hidden_part for k, v in times.items() if k.startswith("prefetch")
    }
    s.data["layers"] = f"{num_layers} x {layer_bytes / 2**20:.3g} MiB, all offloaded, 2 slots"
    if s.cuda:
        s.check(
            "prefetch from pinned memory hides at least half of the smaller of copy and compute",
            s.data["overlap efficiency"]["prefetch pinned"] >= 0.5,
            f"{s.data['overlap efficiency']['prefetch pinned']:.2f}",
        )
        direct, blocking = (times[f"prefetch pageable, {k}"] for k in ("direct", "compute thread"))
        s.check(
            "pageable: copies from a copy thread are no slower than the compute thread's (5%)",
            direct <= blocking * 1.05,
            f"direct / compute thread = {direct / blocking:.2f}",
        )


def _checkpoint(s: Section, tmp: Path, arch: str, dtype: str):
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

    size = (
        dict(
            num_layers=4,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=256,
        )
        if s.dry
        else dict(
            num_layers=4,
            hidden_size=256,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=512,
            vocab_size=512,
        )
    )
    return load_index(make_checkpoint(tmp / arch, CheckpointShape(arch=arch, dtype=dtype, **size)))


def _one_stage(index, **changes):
    """One stage holding every layer of `index`, its spec changed so."""
    from worker.spec import StageSpec

    return StageSpec(
        stage=0,
        num_stages=1,
        checkpoint_dir=str(index.root),
        config=index.config,
        dtype=index.dtype,
        layers=index.layers,
        **changes,
    )


def _two_stages(index, backend: str) -> list:
    """embed + layers 0-1 | layers 2-3 + head, each stage offloading one decoder layer."""
    from worker.spec import StageSpec

    names = [layer.name for layer in index.layers]
    return [
        StageSpec(
            stage=stage,
            num_stages=2,
            checkpoint_dir=str(index.root),
            config=index.config,
            dtype=index.dtype,
            layers=tuple(x for x in index.layers if x.name in group),
            offloaded=tuple(n for n in group if n in ("layers.1", "layers.3")),
            backend=backend,
        )
        for stage, group in enumerate([names[:3], names[3:]])
    ]


def _reference_model(index, dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(index.root, dtype=dtype).to(device).eval()


def section_stage(s: Section) -> None:
    import torch

    from worker.worker import StageWorker

    archs = ("llama",) if s.dry else ("llama", "mixtral")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            index = _checkpoint(s, Path(tmp), arch, "bfloat16")
            vocab = index.config["vocab_size"]
            ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
            model = _reference_model(index, torch.bfloat16, s.device)
            with torch.no_grad():
                expected = model(ids.to(s.device)).logits.cpu()
            del model
            for backend in ("prefetch", "uva"):
                x = ids
                for spec in _two_stages(index, backend):
                    worker = StageWorker(
                        spec, device=str(s.device), num_threads=torch.get_num_threads()
                    )
                    try:
                        report = worker.load()
                        s.check(
                            f"{arch} {backend} stage {spec.stage}: loaded with {backend}",
                            report.backend == backend,
                            report.backend,
                        )
                        x = worker.forward(x)
                    finally:
                        worker.close()
                x = x.cpu()
                tolerance = (
                    2 * torch.finfo(torch.bfloat16).eps * float(expected.float().abs().max())
                )
                diff = float((x.float() - expected.float()).abs().max())
                s.data[f"{arch} {backend} max abs diff"] = diff
                s.check(
                    f"{arch} {backend}: logits of transformers on {s.device.type} (bf16)",
                    x.dtype == torch.bfloat16 and diff <= tolerance,
                    f"max abs diff {diff:.3e} <= {tolerance:.3e}; bitwise {torch.equal(x, expected)}",
                )


def section_batched(s: Section) -> None:
    import torch

    from coordinator.engine import Engine, EngineConfig
    from coordinator.engine.pipelines import LocalPipeline
    from worker.steps import Sampling
    from worker.worker import StageWorker

    if s.cuda:  # float32 means float32: no TF32 in either side's matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    new_tokens = 4 if s.dry else 16
    lengths = (5, 3, 7) if s.dry else (9, 4, 13)
    with tempfile.TemporaryDirectory() as tmp:
        index = _checkpoint(s, Path(tmp), "llama", "float32")
        vocab = index.config["vocab_size"]
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        model = _reference_model(index, torch.float32, s.device)
        alone = []
        for prompt in prompts:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt], device=s.device),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                )
            alone.append(out[0, len(prompt) :].tolist())
        del model
        for backend in ("prefetch", "uva"):
            workers = [
                StageWorker(spec, device=str(s.device), num_threads=torch.get_num_threads())
                for spec in _two_stages(index, backend)
            ]
            engine = None
            try:
                for worker in workers:
                    worker.load()
                engine = Engine(
                    LocalPipeline(workers),
                    EngineConfig(num_slots=len(prompts), max_seq_len=40, micro_batches=1),
                )
                requests = [
                    engine.submit([p], sampling=Sampling(), max_new_tokens=new_tokens)
                    for p in prompts
                ]
                ours = [r.result(120)[0] for r in requests]
            finally:
                if engine is not None:
                    engine.close()
                for worker in workers:
                    worker.close()
            s.data[f"{backend} tokens"] = ours
            s.check(
                f"{backend}: {len(prompts)} prompts batched = transformers alone, greedy",
                ours == alone,
                f"ours {ours} vs {alone}" if ours != alone else "",
            )


def _batch_run(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """transformers' greedy `generate` on one batch of the (equally long) prompts: tokens/s and
    each row's new tokens."""
    import torch

    from bench.workload import greedy_batch

    batch = torch.tensor(prompts, device=model.device)
    _, seconds, out = greedy_batch(model, batch, new_tokens, sync=lambda: _sync(model.device))
    return len(prompts) * new_tokens / seconds, [row[len(prompts[0]) :].tolist() for row in out]


def _engine_run(engine, worker, prompts: list[list[int]], new_tokens: int):
    """The prompts as concurrent greedy requests: tokens/s, each one's tokens, the engine's
    steps, and the seconds of the run outside the stage's timed forward."""
    from worker.steps import Sampling

    steps, forward_s = engine.stats.steps, worker.report().forward_s
    start = time.perf_counter()
    requests = [engine.submit([p], sampling=Sampling(), max_new_tokens=new_tokens) for p in prompts]
    outs = [r.result(300)[0] for r in requests]
    wall = time.perf_counter() - start
    outside = wall - (worker.report().forward_s - forward_s)
    return len(prompts) * new_tokens / wall, outs, engine.stats.steps - steps, outside


def _big_shape():
    """A ~0.7B bfloat16 llama (12 layers, hidden 2048): on a GPU a step is more than kernel
    launches."""
    from coordinator.tools.make_checkpoint import CheckpointShape

    return CheckpointShape(
        num_layers=12,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=5632,
        vocab_size=32000,
        dtype="bfloat16",
        max_shard_bytes=512 * 2**20,
    )


@contextlib.contextmanager
def _one_stage_engine(
    s: Section, shape, offload_share: float, n: int, prompt_len: int, *, burst_steps: int = 0
):
    """A checkpoint of `shape` in a temporary folder, `n` random prompts of `prompt_len` tokens,
    transformers' model of it on the device, and one in-process stage (the first
    `offload_share` of its decoder layers offloaded, prefetch) behind an engine of `n` slots
    (`burst_steps`: EngineConfig's): yields (prompts, model, worker, engine, offloaded layer names); closes all of it."""
    import torch

    from coordinator.engine import Engine, EngineConfig
    from coordinator.engine.pipelines import LocalPipeline
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import make_checkpoint
    from worker.worker import StageWorker

    tmp = tempfile.TemporaryDirectory()
    index = load_index(make_checkpoint(Path(tmp.name) / "model", shape))
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, shape.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)
    ]
    model = _reference_model(index, getattr(torch, shape.dtype), s.device)
    layers = [layer.name for layer in index.layers if layer.name.startswith("layers.")]
    offloaded = tuple(layers[: round(offload_share * len(layers))])
    spec = _one_stage(index, offloaded=offloaded, backend="prefetch")
    worker = StageWorker(spec, device=str(s.device), num_threads=torch.get_num_threads())
    engine = None
    try:
        worker.load()
        engine = Engine(
            LocalPipeline([worker]),
            EngineConfig(num_slots=n, max_seq_len=160, micro_batches=1, burst_steps=burst_steps),
        )
        yield prompts, model, worker, engine, offloaded
    finally:
        if engine is not None:
            engine.close()
        worker.close()
        tmp.cleanup()


def section_engine_speed(s: Section) -> None:
    """What a step costs beyond its compute on this device (issue 22's target, bench/engine.py
    on Ray and the CPU): 8 concurrent requests on one in-process stage against transformers'
    `generate` on one batch of the same 8 prompts, interleaved repeats, the median ratio. The
    engine's own time per step is the run's wall time per step less the stage's timed forward
    (model and token choice). float32 without TF32: every greedy text must be transformers'.
    On a GPU also a ~0.7B bfloat16 llama, all resident, where a step is more than kernel
    launches; in bf16 a batch's rounding may differ from transformers' (its texts are counted,
    not checked)."""
    import torch

    from bench.workload import bench_shape, tiny_engine_shape

    if s.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    n, prompt_len = 8, 8
    new_tokens, repeats = (8, 1) if s.dry else (64, 3)
    cases = {"tiny": (tiny_engine_shape(), 0.0)}
    if not s.dry:  # the benchmarks' 106 MiB llama, ~60% of its decoder bytes offloaded
        cases["bench"] = (bench_shape(quick=False), 0.6)
    if s.cuda:
        cases["0.7b-bf16"] = (_big_shape(), 0.0)
    for case, (shape, offload_share) in cases.items():
        with _one_stage_engine(s, shape, offload_share, n, prompt_len) as (
            prompts,
            model,
            worker,
            engine,
            offloaded,
        ):
            _engine_run(engine, worker, prompts, new_tokens)  # warm-up: kernels, buffers
            _batch_run(model, prompts, new_tokens)
            ratios, rows, mismatches = [], [], 0
            for _ in range(repeats):
                rate, outs, steps, engine_s = _engine_run(engine, worker, prompts, new_tokens)
                hf_rate, expected = _batch_run(model, prompts, new_tokens)
                ratios.append(rate / hf_rate)
                rows.append((rate, hf_rate, steps, engine_s))
                mismatches += sum(o != e for o, e in zip(outs, expected, strict=True))
        median = statistics.median
        steps = median(r[2] for r in rows)
        engine_step_ms = 1e3 * median(r[3] / r[2] for r in rows)
        s.data[case] = {
            "offloaded_layers": len(offloaded),
            "ours_tokens_per_s": round(median(r[0] for r in rows)),
            "hf_tokens_per_s": round(median(r[1] for r in rows)),
            "ratio": round(median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios],
            "steps": steps,
            "wall_per_step_ms": round(1e3 * median(n * new_tokens / r[0] / r[2] for r in rows), 3),
            "engine_per_step_ms": round(engine_step_ms, 3),
            "engine_per_token_ms": round(engine_step_ms * steps / (n * new_tokens), 4),
            "texts_equal": f"{n * repeats - mismatches}/{n * repeats}",
        }
        if shape.dtype == "float32":
            s.check(
                f"{case}: {n} concurrent requests = transformers' batch, greedy, every repeat",
                mismatches == 0,
                f"{mismatches} of {n * repeats} texts differ" if mismatches else "",
            )


def _profiled(prof) -> tuple[list, list]:
    """From a finished profiler: the device's kernels and copies, and the host's operators, each
    as (name, self seconds, count), longest first (no kernels on a CPU)."""
    import torch

    kernels, ops = [], []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            self_us = getattr(e, "self_device_time_total", None)
            if self_us is None:
                self_us = e.self_cuda_time_total
            kernels.append((e.key, self_us / 1e6, e.count))
        else:
            ops.append((e.key, e.self_cpu_time_total / 1e6, e.count))
    return sorted(kernels, key=lambda k: -k[1]), sorted(ops, key=lambda k: -k[1])


def section_step_profile(s: Section) -> None:
    """Where a decode step's time goes, ours against transformers', at ~0.7B bf16 on a GPU (the
    tiny llama on a CPU dry run). Ours: 8 concurrent requests through one in-process stage,
    one step per engine turn (no bursts), each decode step's `batch_step` call recorded; those
    calls are then run again in this thread (the profiler sees this thread's operators only,
    and a step written again writes the same keys and values). Theirs: `generate` on one batch
    of the same 8 prompts (its prefill included, one step in 32). Each under torch's profiler
    after a warm-up. Also the engine's rate on its first pass over the steps' shapes against
    a warm pass (cuDNN's attention, which a stage turns off, built a graph per new shape). Per step: wall time,
    the device's busy time (its kernels and copies), kernel launches, and the kernels and host
    operators that take the most time (all of them in step_profile.txt). A step whose device
    time is far below its wall time is bound by the host (launches, Python), not the GPU."""
    from torch.profiler import ProfilerActivity, profile

    from bench.workload import tiny_engine_shape

    n, prompt_len, new_tokens = 8, 8, (8 if s.dry else 32)
    shape = tiny_engine_shape() if s.dry else _big_shape()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    lines = []
    with _one_stage_engine(s, shape, 0.0, n, prompt_len, burst_steps=1) as (
        prompts,
        model,
        worker,
        engine,
        _,
    ):
        recorded = []
        batch_step = worker.batch_step

        def recording(rows, x, draw=None, wire=True):
            if rows.width == 1:
                recorded.append((rows, x, draw))
            return batch_step(rows, x, draw, wire=wire)

        worker.batch_step = recording
        # the first pass over each step's shapes, then warm: what kernels built per shape cost
        first, *_ = _engine_run(engine, worker, prompts, new_tokens)
        _batch_run(model, prompts, new_tokens)
        recorded.clear()
        warm, ours, engine_steps, outside = _engine_run(engine, worker, prompts, new_tokens)
        worker.batch_step = batch_step
        s.data["engine_without_bursts"] = {
            "steps": engine_steps,
            "outside_stage_per_step_ms": round(1e3 * outside / engine_steps, 3),
            "first_pass_tokens_per_s": round(first),
            "warm_tokens_per_s": round(warm),
        }
        runs = {}
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for rows, x, draw in recorded:
                worker.batch_step(rows, x, draw, wire=False)
            _sync(s.device)
            runs["ours"] = (prof, time.perf_counter() - start, len(recorded))
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            _, theirs = _batch_run(model, prompts, new_tokens)
            runs["transformers"] = (prof, time.perf_counter() - start, new_tokens)
        for side, (prof, wall, steps) in runs.items():
            kernels, ops = _profiled(prof)
            s.data[side] = {
                "steps": steps,
                "wall_per_step_ms": round(1e3 * wall / steps, 3),
                "device_per_step_ms": round(1e3 * sum(k[1] for k in kernels) / steps, 3),
                "kernels_per_step": round(sum(k[2] for k in kernels) / steps, 1),
                "top_kernels_ms_per_step": {
                    name[:60]: round(1e3 * sec / steps, 3) for name, sec, _ in kernels[:6]
                },
                "top_host_ops_ms_per_step": {
                    name[:40]: round(1e3 * sec / steps, 3) for name, sec, _ in ops[:6]
                },
            }
            lines.append(f"== {side}: {steps} steps, {wall:.3f} s")
            for what, rows in (("device kernels", kernels), ("host operators", ops)):
                lines.append(f"-- {what} (self time)")
                lines += [
                    f"{1e3 * sec / steps:9.3f} ms/step {count / steps:7.1f}/step  {name}"
                    for name, sec, count in rows[:25]
                ]
            lines.append("")
        same = sum(o == t for o, t in zip(ours, theirs, strict=True))
        s.data["texts_equal"] = f"{same}/{n}"
    (s.out / "step_profile.txt").write_text("\n".join(lines))
    s.check(
        "both sides profiled, with the device's kernels where there is one",
        len(recorded) >= new_tokens - 2
        and all(s.data[side]["wall_per_step_ms"] > 0 for side in runs)
        and (not s.cuda or all(s.data[side]["device_per_step_ms"] > 0 for side in runs)),
        f"{len(recorded)} decode steps recorded",
    )


def section_attention_graphs(s: Section) -> None:
    """Why a CUDA stage turns cuDNN's attention off (`worker.stage.
    avoid_per_shape_attention_graphs`), measured again on this machine's torch: a fresh
    engine's first pass over its steps' shapes (8 requests x 48 tokens at ~0.7B bf16; the
    tiny llama in bf16 on a dry run), then a warm pass, with cuDNN's attention on and off.
    cuDNN builds a graph for every new shape and caches it per thread; if a later torch makes
    that cheap, `on` catches up with `off` on the first pass and the switch can go."""
    from dataclasses import replace

    import torch

    from bench.workload import tiny_engine_shape

    n, prompt_len, new_tokens = 8, 8, (8 if s.dry else 48)
    shape = replace(tiny_engine_shape(), dtype="bfloat16") if s.dry else _big_shape()
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for label, cudnn in (
            ("cudnn off", False),
            ("cudnn on", True),
        ):  # on gets the warmer process
            with _one_stage_engine(s, shape, 0.0, n, prompt_len) as (p, _, worker, engine, _):
                torch.backends.cuda.enable_cudnn_sdp(cudnn)  # after the stage's worker set it
                first, *_ = _engine_run(engine, worker, p, new_tokens)
                warm, *_ = _engine_run(engine, worker, p, new_tokens)
                s.data[label] = {
                    "first_pass_tokens_per_s": round(first),
                    "warm_tokens_per_s": round(warm),
                    "first_over_warm": round(first / warm, 3),
                }
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    s.check(
        "both ways measured",
        all(s.data[k]["warm_tokens_per_s"] > 0 for k in ("cudnn on", "cudnn off")),
    )


def section_planner_rate(s: Section) -> None:
    """The planner's compute probe on this device (`worker.compute_probe.measure`, not cached)
    against the steps the engine then runs: a ~0.7B bf16 llama (the tiny llama in bf16 on a dry
    run), one resident stage, 4 and 16 concurrent greedy requests, warm. The prediction is the
    probe's stage step plus its layers (what the plan uses: no head, no token choice, no
    engine); the measured step is all of it, so a ratio a little under 1 is expected. On the
    CPU here the planner was within 18% (bench/RESULTS.md); this is its first check on a GPU."""
    from dataclasses import replace

    from bench.workload import tiny_engine_shape
    from worker.compute_probe import measure

    shape = replace(tiny_engine_shape(), dtype="bfloat16") if s.dry else _big_shape()
    sizes, new_tokens = (4, 16), (8 if s.dry else 32)
    with _one_stage_engine(s, shape, 0.0, max(sizes), 8) as (prompts, _, worker, engine, _):
        profile = measure(worker.spec.config, shape.dtype, s.device, use_cache=False)
        s.data["compute_profile"] = {
            "rows": list(profile.rows),
            "layer_ms": [round(1e3 * t, 3) for t in profile.layer_s],
            "fixed_ms": [round(1e3 * t, 3) for t in profile.fixed_s],
        }
        for rows in sizes:
            _engine_run(engine, worker, prompts[:rows], new_tokens)  # warm-up
            rate, _, steps, _ = _engine_run(engine, worker, prompts[:rows], new_tokens)
            step_ms = 1e3 * rows * new_tokens / rate / steps
            predicted_ms = 1e3 * (
                profile.fixed_step_s(rows) + shape.num_layers * profile.step_s(rows)
            )
            s.data[f"{rows} rows"] = {
                "predicted_step_ms": round(predicted_ms, 3),
                "measured_step_ms": round(step_ms, 3),
                "predicted_over_measured": round(predicted_ms / step_ms, 3),
            }
    s.check(
        "probe and engine measured at every size",
        all(s.data[f"{rows} rows"]["measured_step_ms"] > 0 for rows in sizes)
        and all(t > 0 for t in profile.layer_s),
    )


def _run_stages(s: Section, index, **changes):
    """Logits of `index` over _two_stages (prefetch; an MoE offloads its experts), each spec
    changed so; the ids, the workers' copy counters after two passes, and each stage's device
    bytes once loaded (CUDA's allocated bytes, every other stage closed)."""
    import dataclasses

    import torch

    from worker.worker import StageWorker

    ids = torch.randint(
        0, index.config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0)
    )
    x, stats, held = ids, [], []
    for spec in _two_stages(index, "prefetch"):
        spec = dataclasses.replace(
            spec,
            offload_unit="experts" if any(x.experts for x in index.layers) else "layer",
            **changes,
        )
        worker = StageWorker(spec, device=str(s.device), num_threads=torch.get_num_threads())
        try:
            worker.load()
            held.append(worker.device_bytes())
            out = worker.forward(x)
            worker.forward(x)  # a second pass: its routing is predicted from the first's
            x = out
            stats.append(worker.report().stats)
        finally:
            worker.close()
    return ids, x.cpu(), stats, held


def section_quantized_moe(s: Section) -> None:
    """Issues 54 and 55 on this device: gpt-oss's MXFP4 experts offloaded in 4 bits and
    dequantized after each copy (against transformers' `Mxfp4Config(dequantize=True)` on the
    same device), block FP8 with partial blocks dequantized on the device after each copy
    (against the same checkpoint dequantized while read), and routed expert fetch (against
    whole-layer fetch: the same logits, fewer bytes)."""
    import torch

    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
    from coordinator.tools.reference import _dequantizing

    def run(index, **changes):
        return _run_stages(s, index, **changes)[:3]

    width = (
        dict(hidden_size=64, intermediate_size=96)
        if s.dry
        else dict(hidden_size=512, intermediate_size=1024)
    )
    common = dict(
        num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=256, dtype="bfloat16", tokenizer=False
    )
    with tempfile.TemporaryDirectory() as tmp:
        # MXFP4: gpt-oss's experts in 4 bits, offloaded
        index = load_index(
            make_checkpoint(
                Path(tmp) / "mxfp4",
                CheckpointShape(arch="gpt_oss", quantization="mxfp4", **common, **width),
            )
        )
        ids, ours, _ = run(index)
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(
                index.root, dtype=torch.bfloat16, **_dequantizing(str(index.root))
            )
            .to(s.device)
            .eval()
        )
        with torch.no_grad():
            expected = model(ids.to(s.device)).logits.cpu()
        del model
        diff = float((ours.float() - expected.float()).abs().max())
        tolerance = 2 * torch.finfo(torch.bfloat16).eps * float(expected.float().abs().max())
        s.data["mxfp4 max abs diff"] = diff
        s.check(
            "mxfp4 gpt-oss, experts offloaded in 4 bits: transformers' logits (bf16)",
            diff <= tolerance,
            f"max abs diff {diff:.3e} <= {tolerance:.3e}; bitwise {torch.equal(ours, expected)}",
        )
        # routed expert fetch against whole-layer fetch, MXFP4 experts
        _, routed, stats = run(index, expert_fetch="routed")
        s.check(
            "mxfp4 gpt-oss, routed experts: the whole-layer fetch's logits",
            torch.equal(routed, ours),
            f"max abs diff {float((routed.float() - ours.float()).abs().max()):.3e}",
        )
        s.data["routed misses"] = sum(x.expert_misses for x in stats)
        s.data["routed experts predicted, right, copied ahead"] = [
            sum(x.expert_predicted for x in stats),
            sum(x.expert_predicted_correct for x in stats),
            sum(x.expert_prefetched for x in stats),
        ]
        # block FP8 with partial blocks: 8-bit offloaded (dequantized on the device) against
        # dequantized while read
        fp8 = dict(
            common,
            **(
                dict(hidden_size=96, intermediate_size=160)
                if s.dry
                else dict(hidden_size=576, intermediate_size=1344)
            ),
        )
        index = load_index(
            make_checkpoint(
                Path(tmp) / "fp8",
                CheckpointShape(
                    arch="llama", quantization="fp8-block", fp8_block=64 if s.dry else 128, **fp8
                ),
            )
        )
        _, kept, _ = run(index, offload_dtype="auto")
        _, wide, _ = run(index, offload_dtype="none")
        s.check(
            "block FP8 with partial blocks: dequantized on the device after each copy = while read",
            torch.equal(kept, wide),
            f"max abs diff {float((kept.float() - wide.float()).abs().max()):.3e}",
        )


def section_resident_stored(s: Section) -> None:
    """Issue 54 point 4 on this device: resident FP8 (partial blocks) and MXFP4 matrices kept
    as stored, each layer dequantized just in time, against the same checkpoint dequantized
    at load: the same logits (same device, same numbers) and fewer device bytes; whether the
    device computes in FP8 (what `--resident-weights auto` asks of it)."""
    import time

    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
    from offload.probe import probe_node

    devices = probe_node().devices
    s.data["compute capability"] = [list(d.capability) for d in devices]
    s.data["computes in fp8"] = bool(devices) and all(d.capability >= (8, 9) for d in devices)
    common = dict(
        num_layers=6, num_heads=4, num_kv_heads=2, vocab_size=256, dtype="bfloat16", tokenizer=False
    )  # the second stage holds three resident decoder layers and offloads a fourth
    cases = {
        "block FP8, partial blocks": dict(
            arch="llama",
            quantization="fp8-block",
            fp8_block=64 if s.dry else 128,
            **(
                dict(hidden_size=96, intermediate_size=160)
                if s.dry
                else dict(hidden_size=1152, intermediate_size=3200)
            ),
        ),
        "MXFP4 gpt-oss": dict(
            arch="gpt_oss",
            quantization="mxfp4",
            num_experts=8,  # top 2 of 8: compact rows of 2 hold fewer than every expert
            **(
                dict(hidden_size=64, intermediate_size=96)
                if s.dry
                else dict(hidden_size=512, intermediate_size=1024)
            ),
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i, (case, shape) in enumerate(cases.items()):
            index = load_index(
                make_checkpoint(Path(tmp) / str(i), CheckpointShape(**common, **shape))
            )
            _, wide, _, wide_held = _run_stages(s, index)

            start = time.perf_counter()
            _, kept, _, kept_held = _run_stages(s, index, resident_stored=True)
            s.data[f"{case}: device bytes wide / stored"] = [wide_held, kept_held]
            _same_and_smaller(s, f"{case}: kept as stored", kept, wide, (kept_held, wide_held))
            s.data[f"{case}: stored run s (load + forward)"] = time.perf_counter() - start
            if any(x.experts for x in index.layers):  # the experts in compact rows
                top = max(x.experts_per_token for x in index.layers)
                _, compact, _, compact_held = _run_stages(
                    s, index, resident_stored=True, stored_expert_capacity=top
                )
                s.data[f"{case}: device bytes, experts in {top} compact rows"] = compact_held
                # (the prompt's calls split into groups of rows: kernels of other row counts)
                _same_and_smaller(
                    s, f"{case}: experts in compact rows", compact, wide, (compact_held, kept_held)
                )


def section_compact_prefill(s: Section) -> None:
    """Issue 54 point 4's open question on this device: what a prompt costs where a stage keeps
    its experts as stored in compact rows (the planner's floor at max_batch 1: a quarter of the
    experts), against every expert's rows and against the layers dequantized at load. A prompt
    routing to more experts than the rows runs in groups of rows, each dequantizing its experts
    again. A DeepSeek-V3-shaped block-FP8 MoE layer (256 experts, 8 per token, random routing:
    the worst case for grouping) behind a dense one, on one stage holding both: median seconds
    of a decode pass (1 token) and of a 512-token prefill in each mode, the calls split, and
    the prefill's logits against every expert's rows."""

    import torch

    from coordinator.planning.checkpoint import load_index
    from coordinator.planning.planner import PlanOptions, stored_expert_capacity
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
    from worker.worker import StageWorker

    size = (
        dict(hidden_size=128, intermediate_size=64, num_experts=16, fp8_block=64, vocab_size=256)
        if s.dry
        else dict(
            hidden_size=1024, intermediate_size=512, num_experts=256, fp8_block=128, vocab_size=4096
        )
    )
    prompt, repeats = (64, 1) if s.dry else (512, 5)
    shape = CheckpointShape(
        arch="deepseek_v3",
        quantization="fp8-block",
        dtype="bfloat16",
        tokenizer=False,
        num_layers=2,  # a dense layer, then the MoE one
        num_heads=8,
        num_kv_heads=8,
        experts_per_token=2 if s.dry else 8,
        **size,
    )
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        index = load_index(make_checkpoint(Path(tmp) / "ckpt", shape))
        s.data["checkpoint s"] = round(time.perf_counter() - start, 1)
        capacity = stored_expert_capacity(index.layers, PlanOptions(max_batch=1))
        s.data["experts, per token, compact rows"] = [
            shape.num_experts,
            shape.experts_per_token,
            capacity,
        ]
        vocab = index.config["vocab_size"]
        draw = torch.Generator().manual_seed(0)
        inputs = {
            "decode": torch.randint(3, vocab, (1, 1), generator=draw),
            "prefill": torch.randint(3, vocab, (1, prompt), generator=draw),
        }
        logits = {}
        for mode, stored, rows in (
            ("wide", False, 0),
            ("stored, every expert", True, 0),
            ("stored, compact", True, capacity),
        ):
            changed = _one_stage(index, resident_stored=stored, stored_expert_capacity=rows)
            worker = StageWorker(changed, device=str(s.device), num_threads=torch.get_num_threads())
            try:
                worker.load()
                s.data[f"{mode}: device bytes"] = worker.device_bytes()
                for name, ids in inputs.items():
                    residency = worker._placement.residency
                    split_before = residency.split_calls if residency else 0
                    out = worker.forward(ids)  # warm-up
                    _sync(s.device)
                    split = (residency.split_calls if residency else 0) - split_before
                    times = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        worker.forward(ids)
                        _sync(s.device)
                        times.append(time.perf_counter() - start)
                    s.data[f"{mode}: {name} s"] = statistics.median(times)
                    s.data[f"{mode}: {name} calls split"] = split
                    if name == "prefill":
                        logits[mode] = out.float().cpu()
            finally:
                worker.close()
    for name in inputs:
        every = s.data[f"stored, every expert: {name} s"]
        s.data[f"{name}: compact / every expert"] = s.data[f"stored, compact: {name} s"] / every
        s.data[f"{name}: compact / wide"] = (
            s.data[f"stored, compact: {name} s"] / s.data[f"wide: {name} s"]
        )
    s.data["prefill logits: max abs diff, compact vs every expert"] = float(
        (logits["stored, compact"] - logits["stored, every expert"]).abs().max()
    )
    s.check(
        "a decode pass fits the compact rows (no split)",
        s.data["stored, compact: decode calls split"] == 0,
        s.data["stored, compact: decode calls split"],
    )
    s.check(
        "the prompt routed past the compact rows and ran in groups",
        s.data["stored, compact: prefill calls split"] > 0,
        s.data["stored, compact: prefill calls split"],
    )
    s.check(
        "the compact rows hold fewer device bytes than every expert's",
        s.data["stored, compact: device bytes"] < s.data["stored, every expert: device bytes"],
        [s.data["stored, compact: device bytes"], s.data["stored, every expert: device bytes"]],
    )


def _same_and_smaller(s: Section, what: str, logits, wide, held: tuple[list, list]) -> None:
    """Checks: `logits` equal `wide` (the same checkpoint dequantized at load), and the last
    stage's device bytes are fewer than the other run's (`held`: theirs, the other's)."""
    import torch

    s.check(
        f"{what} = dequantized at load (logits)",
        torch.equal(logits, wide),
        f"max abs diff {float((logits.float() - wide.float()).abs().max()):.3e}",
    )
    s.check(f"{what} holds fewer device bytes", held[0][-1] < held[1][-1], f"{held[0]} < {held[1]}")


def section_pinning(s: Section) -> None:
    """Issue 57 point 4 on this device: every host buffer a worker page-locks follows its
    node's decision. Two stages of a bf16 checkpoint loaded as float32 (resident weights go
    through the loader's staging buffer) and offloading one layer each, under
    OFFLOAD_PIN_MEMORY=off and =on: with off, zero bytes pinned (arena, staging buffer, bounce
    chunks) and the copies read pageable memory; with on, the arena and the staging buffer
    pinned. On the CPU nothing can be pinned: the off case alone."""
    import dataclasses

    import torch

    import offload.arena
    from worker.worker import StageWorker

    modes = ["off", "on"] if s.cuda else ["off"]
    with tempfile.TemporaryDirectory() as tmp:
        index = _checkpoint(s, Path(tmp), "llama", "bfloat16")
        ids = torch.randint(0, index.config["vocab_size"], (2, 8))
        for mode in modes:
            previous = os.environ.get("OFFLOAD_PIN_MEMORY")
            os.environ["OFFLOAD_PIN_MEMORY"] = mode
            try:
                before = offload.arena.pinned_buffer_bytes
                arena, readers, engines = 0, [], []
                x = ids
                for spec in _two_stages(index, "prefetch"):
                    spec = dataclasses.replace(spec, dtype="float32")
                    worker = StageWorker(spec, device=str(s.device))
                    try:
                        worker.load()
                        x = worker.forward(x)
                        arena += worker.report().stats.pinned_bytes
                        readers.append(worker._reader.pin)
                        engines.append(worker.report().stats.copy_engine)
                    finally:
                        worker.close()
                buffers = offload.arena.pinned_buffer_bytes - before
            finally:
                if previous is None:
                    os.environ.pop("OFFLOAD_PIN_MEMORY", None)
                else:
                    os.environ["OFFLOAD_PIN_MEMORY"] = previous
            s.data[f"{mode}: arena / buffer bytes pinned"] = [arena, buffers]
            s.data[f"{mode}: copy engines"] = engines
            if mode == "off":
                s.check(
                    "off: nothing pinned (arena, staging buffer, bounce chunks)",
                    arena == 0 and buffers == 0 and not any(readers),
                    f"arena {arena} B, buffers {buffers} B, readers pin {readers}",
                )
                if s.cuda:
                    s.check(
                        "off: copies read pageable memory from a copy thread (direct engine)",
                        all(e == "direct" for e in engines),
                        engines,
                    )
            else:
                s.check(
                    "on: the arena and the loader's staging buffer pinned",
                    arena > 0 and buffers > 0 and all(readers),
                    f"arena {arena} B, buffers {buffers} B",
                )


def section_recovery(s: Section) -> None:
    """Issue 57 points 1 and 2 on this device: what a re-plan budgets for a survivor's GPU. A
    stage loaded here answers the probe as a surviving worker does (`StageWorker.node_probe`):
    its GPU's free memory with its own stage counted as free, since the new plan replaces it.
    That budget must be about what the GPU had free before the stage (the CUDA context aside),
    not what the stage leaves: before, survivors' budgets collapsed to about the reserve. On
    the CPU, the same on a simulated GPU with a size (`offload.simulated`: its ledger)."""
    import torch

    import worker.node as node_module
    import worker.worker as worker_module
    from coordinator.config import JobConfig
    from coordinator.planning.budgets import GPU_BUDGET_FRACTION, node_info
    from offload.simulated import DeviceLedger

    with tempfile.TemporaryDirectory() as tmp:
        index = _checkpoint(s, Path(tmp), "llama", "bfloat16")
        spec = _two_stages(index, "prefetch")[0]
        previous = os.environ.get("OFFLOAD_SIMULATED_GPU_MEMORY")
        place = worker_module.simulated_place
        if not s.cuda:  # a simulated GPU of 1 GiB, its ledger in this folder
            os.environ["OFFLOAD_SIMULATED_GPU_MEMORY"] = str(1 << 30)
            ledger = DeviceLedger("gpu-check", root=Path(tmp) / "ledger")
            worker_module.simulated_place = node_module.simulated_place = lambda: (ledger, [0])
            free_before = 1 << 30
        else:
            torch.cuda.init()
            torch.empty(1, device=s.device)  # this process's CUDA context first
            free_before = torch.cuda.mem_get_info(s.device)[0]
        worker = worker_module.StageWorker(spec, device=str(s.device))
        try:
            worker.load()
            held = worker.device_bytes()
            left = torch.cuda.mem_get_info(s.device)[0] if s.cuda else ledger.free(0, 1 << 30)
            answered = worker.node_probe()
        finally:
            worker.close()
            if not s.cuda:
                worker_module.simulated_place = node_module.simulated_place = place
                if previous is None:
                    os.environ.pop("OFFLOAD_SIMULATED_GPU_MEMORY", None)
                else:
                    os.environ["OFFLOAD_SIMULATED_GPU_MEMORY"] = previous
        probe = answered["probe"]
        devices = probe.devices if s.cuda else probe.simulated_devices
        credited = devices[0].free_memory_bytes if devices else None
        s.data["free before / left by the stage / credited (bytes)"] = [free_before, left, credited]
        s.data["the stage holds (bytes)"] = held
        s.check(
            "a survivor's GPU counts its own stage as free",
            credited is not None and credited - left >= held,
            f"credited {credited}, left {left}, stage {held}",
        )
        slack = 256 << 20 if s.cuda else 0  # cuBLAS' workspace and the like: not the stage's
        s.check(
            "the credited free memory is what the GPU had before the stage",
            credited is not None and credited >= free_before - slack,
            f"credited {credited}, before {free_before}",
        )
        info = node_info(JobConfig(checkpoint="c"), answered, node_id="survivor", num_gpus=1)
        budget = info.gpus[0].memory_bytes
        s.data["re-plan budget (bytes)"] = budget
        s.check(
            "the re-plan budgets 90% of it",
            credited is not None and budget == int(credited * GPU_BUDGET_FRACTION),
            f"budget {budget}",
        )


def section_pytest_gpu(s: Section) -> None:
    if s.dry:
        raise Skip("dry run: the suite runs tests/test_gpu.py itself (skipped without CUDA)")
    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"not installed here: {', '.join(missing)} (the sections above cover it)")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "tests/test_gpu.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    (s.out / "pytest_gpu.txt").write_text(done.stdout + done.stderr)
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    s.check("tests/test_gpu.py passed", done.returncode == 0, tail)


# name -> (function, time limit on a GPU in seconds)
SECTIONS: dict[str, tuple[Callable[[Section], None], float]] = {
    "env": (section_env, 30),
    "offloaders": (section_offloaders, 45),
    "fences": (section_fences, 70),
    "uva": (section_uva, 45),
    "bandwidth": (section_bandwidth, 45),
    "prefetch_timing": (section_prefetch_timing, 75),
    "stage": (section_stage, 75),
    "batched": (section_batched, 90),
    "engine_speed": (section_engine_speed, 120),
    "step_profile": (section_step_profile, 90),
    "attention_graphs": (section_attention_graphs, 120),
    "planner_rate": (section_planner_rate, 90),
    "quantized_moe": (section_quantized_moe, 90),
    "resident_stored": (section_resident_stored, 60),
    "compact_prefill": (section_compact_prefill, 90),
    "pinning": (section_pinning, 45),
    "recovery": (section_recovery, 45),
    "pytest_gpu": (section_pytest_gpu, 240),
}


# ---------------------------------------------------------------------------------- running


def run_section(name: str, out: Path, device_name: str, dry: bool) -> int:
    """In the section's own process: run it, save its record."""
    import torch

    if dry:
        torch.set_num_threads(1)  # the CPU dry run: quiet beside other work, deterministic
    s = Section(name, out, torch.device(device_name), dry)
    start = time.perf_counter()
    try:
        SECTIONS[name][0](s)
        s.status = "pass" if all(c["ok"] for c in s.checks) else "fail"
    except Skip as exc:
        s.status, s.error = "skip", str(exc)
    except BaseException as exc:
        s.status, s.error = "fail", f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if sys.modules.get("ray") is not None and s.status != "skip":  # (None: blocked, absent)
        s.status, s.error = "fail", (s.error + "; " if s.error else "") + "imported ray"
    s.data["seconds"] = round(time.perf_counter() - start, 2)
    s.save()
    print(f"== {name}: {s.status} {s.error}", flush=True)
    return 0 if s.status in ("pass", "skip") else 1


def _launch(name: str, out: Path, device_name: str, dry: bool, limit_s: float) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        name,
        "--out",
        str(out),
        "--device",
        device_name,
    ] + (["--dry-run"] if dry else [])
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.setdefault("OFFLOAD_COMPUTE_CACHE", str(out / "compute-cache"))
    (out / f"{name}.json").unlink(missing_ok=True)
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s
            ).returncode
            why = "" if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            rc, why = None, f"killed at its time limit of {limit_s:.0f} s"
    path = out / f"{name}.json"
    record = (
        json.loads(path.read_text())
        if path.exists()
        else {"name": name, "checks": [], "data": {}, "notes": [], "error": ""}
    )
    if rc is None or (rc != 0 and record.get("status") in (None, "running", "pass")):
        record["status"] = "fail"  # died or hung: what it had found stays in the record
        record["error"] = "; ".join(filter(None, [record.get("error"), why]))
    record.setdefault("data", {})["seconds"] = round(time.perf_counter() - start, 1)
    record["limit_s"] = round(limit_s)
    return record


def _run_here(name: str, out: Path, device_name: str, dry: bool) -> dict:
    """`--one-process`: the section in this process, after the ones before it (torch and
    transformers imported once: a dry run costs a third of the CPU of one process per
    section), with neither a time limit nor isolation. Its output goes to its log as
    `_launch`'s does."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OFFLOAD_COMPUTE_CACHE", str(out / "compute-cache"))
    (out / f"{name}.json").unlink(missing_ok=True)
    start = time.perf_counter()
    with (
        open(out / f"{name}.log", "w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        run_section(name, out, device_name, dry)
    record = json.loads((out / f"{name}.json").read_text())
    record["data"]["seconds"] = round(time.perf_counter() - start, 1)
    record["limit_s"] = "none"
    return record


def summarize(records: list[dict], *, device: str, dry: bool, total_s: float) -> str:
    env = next((r["data"] for r in records if r["name"] == "env"), {})
    lines = [
        f"### GPU check{' (dry run, CPU)' if dry else ''}: {time.strftime('%Y-%m-%d')}, "
        f"`python3 scripts/gpu_check.py{' --dry-run' if dry else ''}`",
        "",
        f"{env.get('device', device)}; torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda')}), "
        f"transformers {env.get('transformers', '?')}, Python {env.get('python', '?')}; "
        f"{total_s:.0f} s in all.",
        "",
        "| section | status | checks | s (limit) | notes |",
        "|---|---|---:|---:|---|",
    ]
    for r in records:
        checks = r.get("checks", [])
        passed = sum(c["ok"] for c in checks)
        failed = [c["name"] for c in checks if not c["ok"]]
        notes = "; ".join(filter(None, [r.get("error", "")] + [f"FAILED {n}" for n in failed]))
        lines.append(
            f"| {r['name']} | {r.get('status')} | {passed}/{len(checks)} | "
            f"{r['data'].get('seconds', '?')} ({r.get('limit_s', '?')}) | {notes} |"
        )
    lines.append("")
    for r in records:
        data = {k: v for k, v in r.get("data", {}).items() if k not in ("seconds", "probe")}
        if not data and not r.get("notes"):
            continue
        lines.append(f"**{r['name']}**")
        lines.append("")
        for key, value in data.items():
            lines.append(f"- {key}: {_short(value)}")
        for note in r.get("notes", []):
            lines.append(f"- note: {note}")
        lines.append("")
    return "\n".join(lines)


_STATS_SHOWN = ("offloaded_bytes", "pinned_bytes", "copies", "copy_s", "stall_s", "sync_loads")


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict) and "backend" in value:  # OffloadStats: the telling fields
        shown = {k: value[k] for k in _STATS_SHOWN if value.get(k)}
        if "pin" in value:
            shown["pinned arena"] = value["pin"]["pin"]
        return _short(shown) if shown else "nothing offloaded"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items())
    return str(value)


def write_results_md(path: Path, summary: str) -> None:
    """Put `summary` between the gpu_check markers of `path` (appended with them if absent)."""
    text = path.read_text() if path.exists() else ""
    block = f"{RESULTS_BEGIN}\n{summary}\n{RESULTS_END}"
    if RESULTS_BEGIN in text and RESULTS_END in text:
        head, rest = text.split(RESULTS_BEGIN, 1)
        text = head + block + rest.split(RESULTS_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, on the CPU by default")
    parser.add_argument("--device", help="cuda or cpu (default: cuda, or cpu for --dry-run)")
    parser.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--results-md", type=Path, help="also write the summary into this file")
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="run the sections one after another in this process: no time limits, no "
        "isolation (a quicker dry run)",
    )
    parser.add_argument("--section", help=argparse.SUPPRESS)  # one section, in its own process
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_section(args.section, args.out, device, args.dry_run)
    names = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    start = time.perf_counter()
    records = []
    for name in names:
        left = TOTAL_BUDGET_S - (time.perf_counter() - start)
        limit = min(SECTIONS[name][1], DRY_RUN_SECTION_LIMIT_S if args.dry_run else left)
        if name == "pytest_gpu" and not args.dry_run and left < MIN_PYTEST_S:
            records.append(
                {
                    "name": name,
                    "status": "skip",
                    "checks": [],
                    "notes": [],
                    "data": {},
                    "error": f"only {left:.0f} s of the budget left",
                }
            )
            continue
        if limit <= 5:
            records.append(
                {
                    "name": name,
                    "status": "fail",
                    "checks": [],
                    "notes": [],
                    "data": {},
                    "error": "the run's time budget was spent before it",
                }
            )
            continue
        if args.one_process:
            print(f"== {name}", flush=True)
            records.append(_run_here(name, args.out, device, args.dry_run))
        else:
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            records.append(_launch(name, args.out, device, args.dry_run, limit))
        r = records[-1]
        print(
            f"== {name}: {r['status']} {r.get('error', '')} ({r['data'].get('seconds')} s)",
            flush=True,
        )
    total_s = time.perf_counter() - start
    summary = summarize(records, device=device, dry=args.dry_run, total_s=total_s)
    (args.out / "summary.md").write_text(summary + "\n")
    (args.out / "results.json").write_text(json.dumps(records, indent=1, default=str))
    if args.results_md:
        write_results_md(args.results_md, summary)
    print(summary)
    return 1 if any(r["status"] == "fail" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
