"""What the benchmarks run, without Ray: their model's shape, their prompts, and transformers'
own greedy `generate` on one batch (the baseline every ratio is taken against), timed. The
benchmarks on Ray (bench/batching.py, bench/engine.py, ...) and the GPU check
(scripts/gpu_check.py, on a machine that has no Ray) share this one definition of each."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from coordinator.tools.make_checkpoint import CheckpointShape

MIB = 2**20


def bench_shape(quick: bool) -> CheckpointShape:
    """The benchmarks' model: a 106 MiB float32 llama, or a tiny one for --quick runs."""
    shape = CheckpointShape(
        arch="llama",
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
        vocab_size=4096,
        max_positions=2048,
        max_shard_bytes=64 * MIB,
    )
    if quick:
        shape = dataclasses.replace(
            shape,
            num_layers=4,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=512,
        )
    return shape


def tiny_engine_shape() -> CheckpointShape:
    """Issue 22's tiny llama (4 layers, hidden 128), where an engine step is almost all
    overhead: bench/engine.py's "tiny" case and the GPU check's."""
    return dataclasses.replace(
        bench_shape(quick=False),
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=352,
        vocab_size=4096,
    )


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """n random prompts of `length` tokens (1 x length each), none of the first 3 ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]


def stamping_streamer():
    """A `generate` streamer that timestamps what it is given: the prompt first, then each
    step's new tokens (`.stamps[1:]`: one per new token)."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def put(self, value) -> None:
            self.stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Stamps()


def greedy_batch(
    model,
    batch: torch.Tensor,
    new_tokens: int,
    *,
    streamer=None,
    sync: Callable[[], None] | None = None,
) -> tuple[float, float, torch.Tensor]:
    """transformers' greedy `generate` on `batch` (rows of one length: no padding, no end
    token), as the baseline: (start, seconds, output ids with the prompts). `sync` waits for
    the device before the clock starts and before it stops (a GPU's queued kernels)."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            streamer=streamer,
        )
    if sync is not None:
        sync()
    return start, time.perf_counter() - start, out
