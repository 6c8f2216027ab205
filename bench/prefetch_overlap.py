"""How much of the weight copy the prefetch offloader hides behind compute.

CPU proxy (always runs): a stack of Linear+GELU layers, all offloaded. In one process, for each
batch size, the median over repeats of:
  resident  - no offloading (compute alone)
  copy      - the same layers' bytes copied by the copy engine alone, nothing computed
  sync      - offloaded, each layer copied in just before it runs (prefetch_step=0)
  prefetch  - offloaded, layer i+k copied while layer i computes (prefetch_step=--step)
  uva       - offloaded, read in place: zero-copy device views of the host arena (on the CPU,
              plain views of it, so uva/resident there is the cost of the arena's layout alone)
Overlap efficiency = (sync - prefetch) / min(copy, compute): 1.0 hides the smaller of the two
completely, 0.0 hides nothing. Target on the CPU: >= 0.5 where copy <= compute.

GPU variant (skipped without CUDA): host-to-device bandwidth from the pinned arena, from
pageable memory and from `tensor.pin_memory()`, the host bytes each costs, and the same
overlap efficiency on a CUDA side stream (target >= 0.9). Then a pageable arena (a node that
does not pin) through each engine that can copy from it, prefetch time over resident:
  cuda    - the side stream alone, as before issue 57: the driver blocks the compute thread
            for each pageable copy (the baseline)
  direct  - the copies issued from a copy thread, nothing pinned (pinning off)
  staged  - through 2 x 8 MiB pinned bounce chunks on a copy thread
with the engine the node's measured rates would choose (`NodeProbe.pageable_engine`).

    python bench/prefetch_overlap.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload import OffloadConfig, PrefetchOffloader, create_offloader
from offload.arena import HostArena, TensorSpec
from offload.copy_engines import make_copy_engine


def make_stack(num_layers: int, hidden: int, device: torch.device) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()).to(device).eval()
        for _ in range(num_layers)
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: torch.device, *, repeats: int, iters: int
) -> dict[str, float]:
    """Median seconds per call of each function, measured in turn (A B C A B C ...) so that
    drift in the machine's speed hits every mode alike."""
    for fn in fns.values():  # warm-up
        fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(values) for name, values in samples.items()}


def forward(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


def forwards(stacks: dict[str, list[nn.Module]], x: torch.Tensor) -> dict[str, Callable]:
    """Per stack, a forward of `x` through it (what `interleaved_medians` times)."""
    return {name: (lambda layers=layers: forward(layers, x)) for name, layers in stacks.items()}


def copy_alone_fn(layers: list[nn.Module], device: torch.device) -> tuple[Callable, Callable]:
    """A function that copies every layer's bytes through the copy engine as the synchronous
    mode does (one layer, wait, the next), with nothing computed; and its clean-up."""
    nbytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    arena = HostArena(
        [TensorSpec(f"l{i}", (nbytes,), torch.uint8) for i in range(len(layers))],
        pin=device.type == "cuda",
    )
    slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    engine = make_copy_engine(device)

    def run() -> None:
        for i, name in enumerate(arena):
            engine.wait(engine.submit(slots[i % 2], arena[name], after=engine.fence()))

    def close() -> None:
        engine.close()
        arena.close()

    return run, close


def offloaded_stack(
    args: argparse.Namespace, device: torch.device, step: int, env: dict, copy_engine=None
) -> tuple[list[nn.Module], PrefetchOffloader]:
    """A stack of the benchmark's layers, every one offloaded by a prefetch offloader with
    `step` slots (0: each copied just before it runs), started."""
    stack = make_stack(args.layers, args.hidden, device)
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=tuple(range(args.layers)), prefetch_step=step),
        device=device,
        env=env,
        copy_engine=copy_engine,
    )
    offloader.wrap_modules(stack)
    offloader.post_init()
    return stack, offloader


def overlap_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    # Three copies of the same stack, live at once: resident, synchronous, prefetch.
    resident = make_stack(args.layers, args.hidden, device)
    offloaders = {}
    stacks = {"resident": resident}
    for mode, step in (("sync", 0), ("prefetch", args.step)):
        stacks[mode], offloaders[mode] = offloaded_stack(args, device, step, {})
    stacks["uva"] = make_stack(args.layers, args.hidden, device)
    uva = create_offloader(
        OffloadConfig(backend="uva", layers=tuple(range(args.layers))), device=device, env={}
    )
    uva.wrap_modules(stacks["uva"])
    copy_fn, copy_close = copy_alone_fn(resident, device)
    rows = []
    try:
        for batch in args.batch:
            x = torch.randn(batch, args.hidden, device=device)
            fns = {**forwards(stacks, x), "copy": copy_fn}
            stall_before = {m: o.stats().stall_s for m, o in offloaders.items()}
            t = interleaved_medians(fns, device, repeats=args.repeats, iters=args.iters)
            passes = 1 + args.repeats * args.iters
            stall = {
                m: (o.stats().stall_s - stall_before[m]) / passes for m, o in offloaders.items()
            }
            hidden_s = min(t["copy"], t["resident"])
            rows.append(
                {
                    "device": device.type,
                    "batch": batch,
                    "resident_ms": t["resident"] * 1e3,
                    "copy_ms": t["copy"] * 1e3,
                    "sync_ms": t["sync"] * 1e3,
                    "prefetch_ms": t["prefetch"] * 1e3,
                    "prefetch_over_resident": t["prefetch"] / t["resident"],
                    "uva_ms": t["uva"] * 1e3,
                    "uva_over_resident": t["uva"] / t["resident"],
                    "overlap_efficiency": (t["sync"] - t["prefetch"]) / hidden_s,
                    "copy_le_compute": t["copy"] <= t["resident"],
                    # The offloader's own counters: time the compute side waited for copies.
                    "sync_stall_ms": stall["sync"] * 1e3,
                    "prefetch_stall_ms": stall["prefetch"] * 1e3,
                    "stall_hidden": 1 - stall["prefetch"] / stall["sync"]
                    if stall["sync"]
                    else None,
                }
            )
        rows[-1]["prefetch_sync_loads"] = offloaders["prefetch"].stats().sync_loads
    finally:
        copy_close()
        uva.detach()
        for offloader in offloaders.values():
            offloader.detach()
    return rows


def rss_growth(args: argparse.Namespace) -> dict:
    """Process RSS around wrapping (CPU): what offloading costs in host memory."""
    layers = make_stack(args.layers, args.hidden, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    process = psutil.Process()
    before = process.memory_info().rss
    offloader = PrefetchOffloader(
        OffloadConfig(layers=tuple(range(args.layers)), prefetch_step=args.step),
        device="cpu",
        env={},
    )
    offloader.wrap_modules(layers)
    offloader.post_init()  # the slots are written, so their pages count
    offloader.synchronize()
    after = process.memory_info().rss
    stats = offloader.stats()
    offloader.detach()
    return {
        "weight_bytes": weights,
        "arena_host_bytes": stats.host_bytes,
        "arena_over_payload": stats.host_bytes / stats.offloaded_bytes,
        "slot_bytes": stats.buffer_bytes,
        "rss_growth_bytes": after - before,
        # What the growth should be if every original weight was freed.
        "expected_growth_bytes": stats.host_bytes + stats.buffer_bytes - stats.offloaded_bytes,
    }


def bandwidth_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """GPU only: H2D bandwidth and host bytes for pinned arena, pageable, pin_memory()."""
    sizes = [(3 * 2**20 + 4099 * i) for i in range(args.layers)]  # odd sizes, ~3 MiB each
    payload = sum(sizes)
    dst = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    sources: dict[str, tuple[list[torch.Tensor], int]] = {}
    arena = HostArena(
        [TensorSpec(f"t{i}", (n,), torch.uint8) for i, n in enumerate(sizes)], pin=True
    )
    sources["arena (registered)"] = ([arena[k] for k in arena], arena.host_bytes)
    pageable = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    sources["pageable"] = (pageable, payload)
    stats_before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    pinned = [t.pin_memory() for t in pageable]
    stats_after = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    sources["tensor.pin_memory()"] = (pinned, stats_after - stats_before or None)

    def copier(tensors: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for t in tensors:
                dst[: t.numel()].copy_(t, non_blocking=True)

        return run

    fns = {name: copier(tensors) for name, (tensors, _) in sources.items()}
    times = interleaved_medians(fns, device, repeats=args.repeats, iters=args.iters)
    rows = []
    for name, (_, host_bytes) in sources.items():
        rows.append(
            {
                "source": name,
                "gb_per_s": payload / times[name] / 1e9,
                "host_bytes": host_bytes,
                "host_over_payload": (host_bytes / payload) if host_bytes else None,
            }
        )
    arena.close()
    return rows


def pageable_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """GPU only: a pageable arena's prefetch through each engine (module doc), against the
    resident stack, interleaved in one process."""
    from offload.copy_engine import CudaCopyEngine
    from offload.staging import CudaStaging, StagedCopyEngine

    engines = {
        "cuda": lambda: CudaCopyEngine(device),
        "direct": lambda: StagedCopyEngine(CudaStaging(device), num_chunks=0),
        "staged": lambda: StagedCopyEngine(CudaStaging(device)),
    }
    stacks = {"resident": make_stack(args.layers, args.hidden, device)}
    offloaders = {}
    for name, make in engines.items():
        stacks[name], offloaders[name] = offloaded_stack(
            args, device, args.step, {"OFFLOAD_PIN_MEMORY": "off"}, make()
        )
    rows = []
    try:
        for batch in args.batch:
            x = torch.randn(batch, args.hidden, device=device)
            fns = forwards(stacks, x)
            t = interleaved_medians(fns, device, repeats=args.repeats, iters=args.iters)
            row = {"batch": batch, "resident_ms": t["resident"] * 1e3}
            for name in engines:
                row[f"{name}_ms"] = t[name] * 1e3
                row[f"{name}_over_resident"] = t[name] / t["resident"]
            row["direct_over_cuda"] = t["direct"] / t["cuda"]
            rows.append(row)
    finally:
        for offloader in offloaders.values():
            offloader.detach()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--step", type=int, default=2, help="prefetch slots")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (CPU)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    result = {
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}",
        "args": {k: str(v) for k, v in vars(args).items()},
        # First, before other phases free buffers and glibc raises its mmap threshold (after
        # which freed weights stay in the heap and RSS no longer shows them going).
        "cpu_rss": rss_growth(args),
        "cpu_overlap": overlap_rows(args, torch.device("cpu")),
    }
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        result["gpu"] = torch.cuda.get_device_name(cuda)
        result["gpu_overlap"] = overlap_rows(args, cuda)
        result["gpu_bandwidth"] = bandwidth_rows(args, cuda)
        result["gpu_pageable"] = pageable_rows(args, cuda)
        from offload.probe import probe_node

        probe = probe_node()
        result["gpu_link_rates"] = {
            "pinned": probe.link_pinned_bytes_per_s,
            "pageable": probe.link_pageable_bytes_per_s,
            "staged": probe.link_staged_bytes_per_s,
            "chosen_where_chunks_may_pin": probe.pageable_engine(may_pin=True)[0],
        }
    else:
        result["gpu"] = "skipped: no CUDA device"

    print(f"machine: {result['machine']}; compute threads: {args.threads}")
    for key in ("cpu_overlap", "gpu_overlap"):
        if key not in result:
            continue
        print(
            f"\n{key}: {args.layers} layers x {args.hidden}^2 fp32, all offloaded, step {args.step}"
        )
        print(
            f"{'batch':>6} {'resident':>9} {'copy':>8} {'sync':>8} {'prefetch':>9} "
            f"{'pf/res':>7} {'overlap':>8} {'stall sync/prefetch':>20} {'uva':>9} "
            f"{'uva/res':>7}"
        )
        for r in result[key]:
            print(
                f"{r['batch']:>6} {r['resident_ms']:>7.2f}ms {r['copy_ms']:>6.2f}ms "
                f"{r['sync_ms']:>6.2f}ms {r['prefetch_ms']:>7.2f}ms "
                f"{r['prefetch_over_resident']:>7.2f} {r['overlap_efficiency']:>8.2f} "
                f"{r['sync_stall_ms']:>8.2f}/{r['prefetch_stall_ms']:.2f}ms "
                f"{r['uva_ms']:>7.2f}ms {r['uva_over_resident']:>7.2f}"
                + ("" if r["copy_le_compute"] else "  (copy > compute)")
            )
    rss = result["cpu_rss"]
    print(
        f"\nhost memory: arena {rss['arena_host_bytes'] / 2**20:.1f} MiB for "
        f"{rss['weight_bytes'] / 2**20:.1f} MiB of weights "
        f"({rss['arena_over_payload']:.4f}x); RSS grew {rss['rss_growth_bytes'] / 2**20:.1f} MiB "
        f"while wrapping; arena + {rss['slot_bytes'] / 2**20:.1f} MiB slots - freed originals = "
        f"{rss['expected_growth_bytes'] / 2**20:.1f} MiB"
    )
    for r in result.get("gpu_bandwidth", []):
        ratio = f"{r['host_over_payload']:.3f}x" if r["host_over_payload"] else "n/a"
        print(f"H2D {r['source']:>22}: {r['gb_per_s']:6.1f} GB/s, host bytes {ratio} of payload")
    if "gpu_pageable" in result:
        print(f"\npageable arena, prefetch step {args.step}: time over resident per engine")
        print(f"{'batch':>6} {'resident':>9} {'cuda':>7} {'direct':>7} {'staged':>7} {'d/cuda':>7}")
        for r in result["gpu_pageable"]:
            print(
                f"{r['batch']:>6} {r['resident_ms']:>7.2f}ms {r['cuda_over_resident']:>7.2f} "
                f"{r['direct_over_resident']:>7.2f} {r['staged_over_resident']:>7.2f} "
                f"{r['direct_over_cuda']:>7.2f}"
            )
        rates = result["gpu_link_rates"]
        print(
            "link rates (GB/s): "
            + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items() if isinstance(v, float))
            + f"; a pageable arena that may pin chunks takes {rates['chosen_where_chunks_may_pin']}"
        )
    if isinstance(result["gpu"], str):
        print(f"\ngpu: {result['gpu']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
