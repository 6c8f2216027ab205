"""How fast this node brings offloaded weights in: the host-to-device copy rate, measured.

The planner charges each stage `offloaded bytes / this rate`, so the rate should be the one the
offloader's copies get. On CUDA: a page-aligned host buffer, page-locked with cudaHostRegister
as the arena pins (or left pageable, as the arena is when the node does not pin), copied to the
device on a side stream as the copy engine does, timed with CUDA events. Without CUDA: memmove
between two host buffers, which is what the CPU stand-in for a GPU does to copy a layer in.

The best of a few copies is kept: the first pays for page faults, and a rate is a capacity.
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING

# torch loads where a measurement needs it: the CPU copy needs none, and a probe on a node without
# GPUs must start as light as a process that never touches a tensor (`offload.probe`).
if TYPE_CHECKING:
    import torch

CUDA_PROBE_BYTES = 64 * 2**20
# Smaller on the CPU: there the first touch of fresh pages costs far more than the copies
# (about 2 ms per 16 MiB copy on a 2-core VM, but 40-300 ms to fault in 2 x 64 MiB), and the
# probe runs before every plan. But past the shared L3: the planner prices a CPU node's copies
# as CPU work with this rate (2 x 16 MiB measured 33 GB/s on this machine's EPYC, partly in
# cache; 2 x 32 MiB 14 GB/s, as 64 and 128 MiB do, the rate of a layer's copy).
CPU_PROBE_BYTES = 32 * 2**20
PROBE_REPEATS = 4  # copies timed; the first one faults the destination's pages in


def _check(num_bytes: int, repeats: int) -> None:
    if num_bytes <= 0:
        raise ValueError(f"num_bytes={num_bytes} must be > 0")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")


def measure_cpu_copy(num_bytes: int = CPU_PROBE_BYTES, repeats: int = PROBE_REPEATS) -> float:
    """Bytes per second of a single-threaded memmove between two host buffers (the
    `ThreadCopyEngine`'s copy)."""
    _check(num_bytes, repeats)
    # Written, so really backed: untouched pages all map the one zero page, which stays cached.
    src = (ctypes.c_ubyte * num_bytes).from_buffer(bytearray(b"\x01") * num_bytes)
    dst = (ctypes.c_ubyte * num_bytes)()  # zeroed by ctypes, so backed as well
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ctypes.memmove(dst, src, num_bytes)
        best_s = min(best_s, time.perf_counter() - start)
    return num_bytes / best_s


def measure_host_to_device(
    device: torch.device,
    *,
    pin: bool,
    num_bytes: int = CUDA_PROBE_BYTES,
    repeats: int = PROBE_REPEATS,
) -> float:
    """Bytes per second of host-to-device copies into the CUDA `device` from a pinned
    (`pin=True`) or pageable host buffer. Raises on any CUDA failure (the probe records it)."""
    import torch

    from offload.arena import HostArena, TensorSpec

    _check(num_bytes, repeats)
    if device.type != "cuda":
        raise ValueError(f"device={device} is not a CUDA device; use measure_cpu_copy()")
    with torch.cuda.device(device):
        # Empty the allocator's cache afterwards only if it was empty before: the probe's
        # buffer must not stay reserved in a process that had nothing there (a worker at start).
        was_empty = torch.cuda.memory_reserved(device) == 0
        with HostArena([TensorSpec("probe", (num_bytes,), torch.uint8)], pin=pin) as arena:
            host = arena["probe"]
            host.fill_(1)
            dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            stream = torch.cuda.Stream(device=device)
            events = []
            with torch.cuda.stream(stream):
                for _ in range(repeats):
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record(stream)
                    dst.copy_(host, non_blocking=True)
                    end.record(stream)
                    events.append((start, end))
            stream.synchronize()
            best_s = min(start.elapsed_time(end) for start, end in events) / 1e3
            del dst
        if was_empty:
            torch.cuda.empty_cache()
    if best_s <= 0:
        raise RuntimeError(f"CUDA events timed a {num_bytes}-byte copy at {best_s} s")
    return num_bytes / best_s


def measure_staged(
    device: torch.device, *, num_bytes: int = CUDA_PROBE_BYTES, repeats: int = PROBE_REPEATS
) -> float:
    """Bytes per second of copies into the CUDA `device` from a pageable host buffer through the
    staged engine's pinned bounce chunks (`offload.staging`), as a pageable arena's copies would
    take them: the host's time from handing the copy to the engine until it has landed (the
    engine's copy thread does the memcpy, so events on one stream would miss it)."""
    import torch

    from offload.arena import HostArena, TensorSpec
    from offload.staging import CudaStaging, StagedCopyEngine

    _check(num_bytes, repeats)
    if device.type != "cuda":
        raise ValueError(f"device={device} is not a CUDA device; use measure_cpu_copy()")
    with torch.cuda.device(device):
        was_empty = torch.cuda.memory_reserved(device) == 0
        engine = StagedCopyEngine(CudaStaging(device))
        try:
            with HostArena([TensorSpec("probe", (num_bytes,), torch.uint8)], pin=False) as arena:
                host = arena["probe"]
                host.fill_(1)
                dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
                best_s = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    engine.wait(engine.submit(dst, host, after=None))
                    engine.synchronize()
                    best_s = min(best_s, time.perf_counter() - start)
                del dst
        finally:
            engine.close()
        if was_empty:
            torch.cuda.empty_cache()
    return num_bytes / best_s


# 16 Mi bfloat16 entries (32 MiB, beyond the caches): ~3 ms a step at the 10 GB/s of one thread
HOST_MATMUL_ENTRIES = 2**24
DEQUANT_PROBE_ENTRIES = 2**20  # one 1 Mi-entry weight: ~4 ms of float8 on a CPU thread


def measure_host_matmul(
    rows: int, *, entries: int = HOST_MATMUL_ENTRIES, repeats: int = 3
) -> float:
    """Weight bytes per second the host's CPU computes through, with this process's torch
    threads, for a step of `rows` rows: a bfloat16 linear map of `entries` weights (beyond the
    caches) applied to `rows` rows, as an MoE layer's expert computed on the host does
    (`OffloadConfig.host_expert_rows`)."""
    import torch

    _check(entries, repeats)
    cols = 4096
    weight = torch.full((max(1, entries // cols), cols), 0.5, dtype=torch.bfloat16)
    x = torch.full((rows, cols), 0.25, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, weight)  # the first call's set-up is no part of the rate
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        best_s = min(best_s, time.perf_counter() - start)
    return weight.numel() * weight.element_size() / best_s


def measure_dequantize(
    device: torch.device,
    dtype: torch.dtype,
    *,
    entries: int = DEQUANT_PROBE_ENTRIES,
    repeats: int = PROBE_REPEATS,
) -> float:
    """Bytes per second of bfloat16 weights made from 8-bit ones on `device` (the prefetch
    offloader's dequantization after each copy, `offload.quant.dequantize_into`), for 8-bit
    `dtype` (float8_e4m3fn or int8) in groups of 128 entries of a row."""
    import torch

    from offload.quant import BlockFormat, dequantize_into, quantized

    _check(entries, repeats)
    fmt = BlockFormat(dtype, (1, 128))
    cols = 4096
    weight = quantized(torch.ones(max(1, entries // cols), cols, device=device), fmt)
    out = torch.empty(weight.shape, dtype=torch.bfloat16, device=device)
    best_s = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dequantize_into(out, weight)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - start)
    return out.numel() * out.element_size() / best_s
