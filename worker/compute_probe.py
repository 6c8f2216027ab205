"""How fast this node runs the model: decoder layers of the model's own class, random weights
in the job's dtype, stepped exactly as a worker steps them (a `Stage` holding them, their KV in
a KV pool of blocks, `BatchRunner.step`), timed as decode steps of 1 to 64 sequences over a short
context. A stage of one layer and a stage of two, step by step in turn: the difference is what
each further layer costs (the planner's compute rate: the weights a layer streams through per
step / that time), the rest is what a stage's step costs whatever it holds (positions, masks,
the block gathers: the plan's per-step overhead). The planner then predicts a stage's time from
what this device does with this model, not from an assumed rate.

Quick (a few dozen steps of one layer) and cached per layer shape (the config without what the
layers never read, such as the vocabulary, or the depth), dtype, device and torch version on the
node's disk (`offload.node_cache`), so a node measures a model's layer once, whatever its depth.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from offload import node_cache

# torch loads only to measure: a probe that finds the node's profile cached (a node without
# GPUs, probed again) reads it without torch's import.
if TYPE_CHECKING:
    import torch

ROWS = (1, 4, 16, 64)  # sequences per decode step
CONTEXT = 64  # tokens each sequence has cached
STEPS = 13  # timed decode steps per size and stage (the first is a warm-up)
PROBE_OWNER = ("compute-probe", 0)  # the probe's own stages: it is their only engine


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """Per number of rows: a decoder layer's time in a decode step, and what a stage's step
    costs besides its layers, on `device`."""

    family: str
    dtype: str
    device: str  # the device's name
    rows: tuple[int, ...]
    layer_s: tuple[float, ...]  # median seconds per layer per step, per entry of `rows`
    fixed_s: tuple[float, ...]  # median seconds per stage step besides its layers
    layer_bytes: int  # the layer's weight bytes

    def step_s(self, rows: int) -> float:
        """A layer's seconds per step at `rows` rows (see `_between`)."""
        return _between(self.rows, self.layer_s, rows)

    def fixed_step_s(self, rows: int) -> float:
        """A stage's seconds per step at `rows` rows besides its layers."""
        return _between(self.rows, self.fixed_s, rows)

    def bytes_per_s(self, rows: int) -> float:
        """The weight bytes per second a stage of this model computes at `rows` rows per step."""
        return self.layer_bytes / self.step_s(max(rows, 1))

    def describe(self, rows: int) -> str:
        rows = max(rows, 1)
        return (
            f"measured: a {self.family} decoder layer ({self.dtype}) takes "
            f"{self.step_s(rows) * 1e3:.2f} ms per step of {rows} sequence(s) on "
            f"{self.device}, a stage's step {self.fixed_step_s(rows) * 1e3:.2f} ms more"
        )


def _between(rows: tuple[int, ...], values: tuple[float, ...], at: int) -> float:
    """Linear between the measured sizes, the outer segments' lines beyond them (never below
    the smallest measured value)."""
    points = list(zip(rows, values, strict=True))
    if len(points) == 1:
        return points[0][1]
    for (r0, t0), (r1, t1) in itertools.pairwise(points):
        if at <= r1 or (r1, t1) == points[-1]:
            return max(min(values), t0 + (t1 - t0) * (at - r0) / (r1 - r0))
    raise AssertionError("unreachable")


def _device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name(torch.get_num_threads())


def _cpu_name(threads: int) -> str:
    return f"cpu ({threads} thread(s))"


# config.json entries a stage of decoder layers 0 and 1 never reads: the embedding and head's,
# the tokenizer's, provenance. Two checkpoints that differ only there (or in depth, see
# `_layer_key`) share one measurement.
_NOT_THE_LAYERS = frozenset(
    {
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "architectures",
        "transformers_version",
        "_name_or_path",
        "torch_dtype",
        "dtype",
    }
)


def _layer_key(config: dict) -> dict:
    """What the measurement depends on: `config` without `_NOT_THE_LAYERS`, and its depth as
    the probe builds it (layers 0 and 1: any depth >= 2 measures the same stages). A config
    with a per-layer list (`layer_types`, ...: as long as the depth) keeps its depth, since
    its first entries are not all that a list of another length may change."""
    key = {k: v for k, v in config.items() if k not in _NOT_THE_LAYERS}
    depth = key.get("num_hidden_layers")
    per_layer = any(isinstance(v, list) and len(v) == depth for v in key.values())
    if isinstance(depth, int) and depth >= 2 and not per_layer:
        key["num_hidden_layers"] = 2
    return key


def _cache_path(config: dict, dtype: str, device_name: str) -> Path:
    key = [_layer_key(config), dtype, device_name, node_cache.torch_version(), ROWS, CONTEXT]
    return node_cache.cache_file("compute", key)


def measure(
    config: dict,
    dtype: str,
    device: str | torch.device = "cpu",
    *,
    threads: int | None = None,
    use_cache: bool = True,
    cached_only: bool = False,
) -> ComputeProfile | None:
    """The profile of `config`'s decoder layer in `dtype` on `device`, on `threads` CPU threads
    (the workers' count; None: this process's), from the cache when this node measured it
    before. `cached_only`: None rather than measuring (a worker answering for its node must
    not allocate a layer beside its stage)."""
    if not use_cache:
        return None if cached_only else _timed(config, dtype, device, threads)
    path = _cache_path(config, dtype, _name_of(device, threads))
    profile = _read(path)
    if profile is not None or cached_only:
        return profile
    # Processes probing one host at once (its Ray nodes, simulated GPUs on a laptop or CI)
    # measure a shape once: the first holds the shape's lock while it measures, the others wait
    # and then read what it wrote (on a CPU without importing torch). Also, measurements that
    # shared the CPU would each have timed the host too slow.
    with node_cache.measuring(path):
        profile = _read(path)
        if profile is None:
            profile = _timed(config, dtype, device, threads)
            node_cache.write(path, asdict(profile))
    return profile


def _name_of(device: str | torch.device, threads: int | None) -> str:
    """The device's name in the cache's key: a CPU's is its thread count, known without
    importing torch when `threads` is given."""
    if str(device) == "cpu" and threads is not None:
        return _cpu_name(threads)
    import torch

    return _device_name(torch.device(device))


def _timed(
    config: dict, dtype: str, device: str | torch.device, threads: int | None
) -> ComputeProfile:
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(config, dtype, torch.device(device))
    finally:
        torch.set_num_threads(previous)


def _read(path: Path) -> ComputeProfile | None:
    """The profile cached at `path`; None where there is none or it does not parse (it is
    measured again and rewritten)."""
    data = node_cache.read(path)
    try:
        tuples = {name: tuple(data[name]) for name in ("rows", "layer_s", "fixed_s")}
        return ComputeProfile(**{**data, **tuples})
    except (TypeError, KeyError):
        return None


def _measure(config: dict, dtype: str, device: torch.device) -> ComputeProfile:
    import torch

    from worker.spec import torch_dtype_named
    from worker.stage import avoid_per_shape_attention_graphs
    from worker.steps import StepRows

    # attention as a worker runs it: with cuDNN's, each timed step (a new number of positions)
    # would include building its graph
    avoid_per_shape_attention_graphs(device)
    torch_dtype = torch_dtype_named(dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    two = int(config.get("num_hidden_layers", 1)) >= 2
    stages = [_stage(config, torch_dtype, device, n, generator) for n in ((1, 2) if two else (1,))]
    layer = stages[0][0].layer_modules()["layers.0"]
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    hidden = int(config["hidden_size"])
    per_layer, fixed = [], []
    for rows in ROWS:
        prefill = StepRows.in_slots(
            range(rows),
            (0,) * rows,
            (CONTEXT,) * rows,
            CONTEXT,
            num_slots=rows,
            max_seq_len=CONTEXT + STEPS,
            owner=PROBE_OWNER,
        )
        x = torch.randn(rows, CONTEXT, hidden, generator=generator, device=device).to(torch_dtype)
        for stage, runner in stages:
            runner.step(stage, prefill, x * 0.02, None)
        step, samples = prefill.advanced(), [[] for _ in stages]
        for _ in range(STEPS):  # the stages in turn, so that both see the same conditions
            token = torch.randn(rows, 1, hidden, generator=generator, device=device)
            for (stage, runner), times in zip(stages, samples, strict=True):
                _synchronize(device)
                start = time.perf_counter()
                runner.step(stage, step, token.to(torch_dtype) * 0.02, None)
                _synchronize(device)
                times.append(time.perf_counter() - start)
            step = step.advanced()
        one = statistics.median(samples[0][1:])
        each = statistics.median(samples[1][1:]) - one if two else one
        each = max(each, one / 10)  # noise must not make a layer free
        per_layer.append(each)
        fixed.append(max(one - each, 0.0))
    return ComputeProfile(
        family=config.get("model_type", "?"),
        dtype=dtype,
        device=_device_name(device),
        rows=ROWS,
        layer_s=tuple(per_layer),
        fixed_s=tuple(fixed),
        layer_bytes=layer_bytes,
    )


def _stage(config: dict, torch_dtype, device: torch.device, num_layers: int, generator):
    """A stage of the model's first `num_layers` decoder layers with random weights, and the
    runner that steps it."""
    import torch

    from worker.batched import BatchRunner
    from worker.layout import hf_config_from_dict
    from worker.stage import Stage

    stage = Stage(
        hf_config_from_dict(config, dtype=torch_dtype), [f"layers.{i}" for i in range(num_layers)]
    )
    for module in stage.layer_modules().values():
        module.to_empty(device=device)
    stage.init_buffers(device)
    with torch.no_grad():
        for param in stage.parameters():
            if param.is_floating_point() and not param.is_meta:
                param.normal_(0.0, 0.02, generator=generator)
    runner = BatchRunner(device)
    runner.claim(PROBE_OWNER)
    return stage, runner


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
