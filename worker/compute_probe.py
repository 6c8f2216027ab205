"""How fast this node runs the model: one decoder layer of the model's own class, random weights
in the job's dtype, stepped exactly as a worker steps it (a `Stage` holding that layer, its KV in
a slot pool, `BatchRunner.step`), timed as decode steps of 1, 8 and 32 sequences over a short
context. The planner then predicts a stage's time from what this device does with this model,
not from an assumed rate (the weights a layer streams through per step / the time it took).

Quick (a few dozen steps of one layer) and cached per model shape, dtype, device and torch
version on the node's disk (`OFFLOAD_COMPUTE_CACHE`, default ~/.cache/offload-coordinator), so a
node measures a model once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROWS = (1, 8, 32)  # sequences per decode step
CONTEXT = 64  # tokens each sequence has cached
STEPS = 7  # timed decode steps per size (the first is a warm-up)
CACHE_ENV = "OFFLOAD_COMPUTE_CACHE"


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """One decoder layer's decode step time for each number of rows, on `device`."""

    family: str
    dtype: str
    device: str  # the device's name
    rows: tuple[int, ...]
    layer_s: tuple[float, ...]  # median seconds per step, per entry of `rows`
    layer_bytes: int  # the layer's weight bytes

    def step_s(self, rows: int) -> float:
        """Seconds per step at `rows` rows: linear between the measured sizes, the outer
        segments' lines beyond them (never below the smallest measured time)."""
        points = list(zip(self.rows, self.layer_s, strict=True))
        if len(points) == 1:
            return points[0][1]
        for (r0, t0), (r1, t1) in itertools.pairwise(points):
            if rows <= r1 or (r1, t1) == points[-1]:
                return max(points[0][1], t0 + (t1 - t0) * (rows - r0) / (r1 - r0))
        raise AssertionError("unreachable")

    def bytes_per_s(self, rows: int) -> float:
        """The weight bytes per second a stage of this model computes at `rows` rows per step."""
        return self.layer_bytes / self.step_s(max(rows, 1))

    def describe(self, rows: int) -> str:
        return (f"measured: a {self.family} decoder layer ({self.dtype}) takes "
                f"{self.step_s(max(rows, 1)) * 1e3:.2f} ms per step of {max(rows, 1)} "
                f"sequence(s) on {self.device}")  # fmt: skip


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} thread(s))"


def _cache_path(config: dict, dtype: str, device: torch.device) -> Path:
    key = json.dumps([config, dtype, _device_name(device), torch.__version__, ROWS, CONTEXT],
                     sort_keys=True, default=repr)  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "offload-coordinator")
    return root / "compute" / f"{digest}.json"


def measure(config: dict, dtype: str, device: str | torch.device = "cpu", *,
            threads: int | None = None, use_cache: bool = True,
            cached_only: bool = False) -> ComputeProfile | None:  # fmt: skip
    """The profile of `config`'s decoder layer in `dtype` on `device`, on `threads` CPU threads
    (the workers' count; None: this process's), from the cache when this node measured it
    before. `cached_only`: None rather than measuring (a worker answering for its node must
    not allocate a layer beside its stage)."""
    device = torch.device(device)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _cached(config, dtype, device, use_cache, cached_only)
    finally:
        torch.set_num_threads(previous)


def _cached(config: dict, dtype: str, device: torch.device, use_cache: bool,
            cached_only: bool) -> ComputeProfile | None:  # fmt: skip
    path = _cache_path(config, dtype, device)
    if use_cache and path.is_file():
        try:
            data = json.loads(path.read_text())
            return ComputeProfile(**{**data, "rows": tuple(data["rows"]),
                                     "layer_s": tuple(data["layer_s"])})  # fmt: skip
        except (OSError, ValueError, TypeError):
            pass  # measured again below, and the cache rewritten
    if cached_only:
        return None
    profile = _measure(config, dtype, device)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(profile)))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measured each time, still right
    return profile


def _measure(config: dict, dtype: str, device: torch.device) -> ComputeProfile:
    from worker.batched import BatchRunner, StepRows
    from worker.layout import hf_config_from_dict
    from worker.spec import torch_dtype_named
    from worker.stage import Stage

    torch_dtype = torch_dtype_named(dtype)
    stage = Stage(hf_config_from_dict(config, dtype=torch_dtype), ["layers.0"])
    layer = stage.layer_modules()["layers.0"]
    layer.to_empty(device=device)
    stage.init_buffers(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            if param.is_floating_point():
                param.normal_(0.0, 0.02, generator=generator)
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    runner = BatchRunner(device)
    hidden = int(config["hidden_size"])
    times = []
    for rows in ROWS:
        prefill = StepRows(slots=tuple(range(rows)), starts=(0,) * rows, counts=(CONTEXT,) * rows,
                           width=CONTEXT, num_slots=rows, max_seq_len=CONTEXT + STEPS)  # fmt: skip
        x = torch.randn(rows, CONTEXT, hidden, generator=generator, device=device).to(torch_dtype)
        runner.step(stage, prefill, x * 0.02, None)
        step, samples = prefill.advanced(), []
        for _ in range(STEPS):
            token = torch.randn(rows, 1, hidden, generator=generator, device=device)
            _synchronize(device)
            start = time.perf_counter()
            runner.step(stage, step, token.to(torch_dtype) * 0.02, None)
            _synchronize(device)
            samples.append(time.perf_counter() - start)
            step = step.advanced()
        times.append(statistics.median(samples[1:]))
    return ComputeProfile(family=config.get("model_type", "?"), dtype=dtype,
                          device=_device_name(device), rows=ROWS, layer_s=tuple(times),
                          layer_bytes=layer_bytes)  # fmt: skip


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
