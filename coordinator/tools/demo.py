"""`offloadctl demo`: the node-local offloader on this machine, end to end, in a few seconds.

Builds a stack of layers, offloads all of them, and prints the pin decision with its reason,
the bytes moved and the forward time resident vs prefetch vs synchronous onload.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

from offload import OffloadConfig, create_offloader, probe_node

MIB = 2**20


def _stack(num_layers: int, hidden: int, device: torch.device) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()).to(device) for _ in range(num_layers)
    ]


def _forward(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return x


def _median_ms(stacks: dict[str, list[nn.Module]], x: torch.Tensor, repeats: int) -> dict:
    """Median forward time of each stack, run in turn so machine noise hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in stacks}
    for _ in range(repeats + 1):
        for name, layers in stacks.items():
            start = time.perf_counter()
            _forward(layers, x)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values[1:]) for name, values in samples.items()}


def run_demo(*, num_layers: int, hidden: int, batch: int, step: int, repeats: int) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # On the CPU one core plays the GPU's copy engine: leave it to the copy thread.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    probe = probe_node()
    gpus = ", ".join(d.name for d in probe.devices) or "none"
    print(
        f"node: {probe.cpu_arch}, CUDA devices: {gpus}, WSL: {probe.is_wsl}, host available "
        f"{(probe.host_available_bytes or 0) / 2**30:.1f} GiB; compute threads "
        f"{torch.get_num_threads()}"
    )
    x = torch.randn(batch, hidden, device=device)
    stacks = {"resident": _stack(num_layers, hidden, device)}
    expected = _forward(stacks["resident"], x)
    everything = tuple(range(num_layers))
    offloaders = []
    try:
        for mode, prefetch_step in (("prefetch", step), ("synchronous", 0)):
            layers = _stack(num_layers, hidden, device)
            offloader = create_offloader(
                OffloadConfig(layers=everything, prefetch_step=prefetch_step), device=device
            )
            offloaders.append((mode, offloader))
            offloader.wrap_modules(layers)
            offloader.post_init()
            if not torch.equal(_forward(layers, x), expected):
                print(f"FAIL: {mode} output differs from the resident model")
                return 1
            stacks[mode] = layers
        decision = offloaders[0][1].pin_decision
        print(f"pin decision: pin={decision.pin} (source: {decision.source}): {decision.reason}")
        print(f"backend: {offloaders[0][1].backend} ({offloaders[0][1].backend_reason})")
        timings = _median_ms(stacks, x, repeats)
        for mode, offloader in offloaders:
            stats = offloader.stats()
            print(
                f"{mode:>11}: {stats.offloaded_layers} layers, "
                f"{stats.offloaded_bytes / MIB:.1f} MiB offloaded to host memory "
                f"({stats.host_bytes / MIB:.1f} MiB allocated), {stats.buffer_bytes / MIB:.1f} MiB "
                f"of device slots, {stats.copies} copies, stalled {stats.stall_s * 1e3:.1f} ms"
            )
    finally:
        for _, offloader in offloaders:
            offloader.detach()
    print(
        f"\nforward of {num_layers} x Linear({hidden}, {hidden}), batch {batch}, on {device} "
        f"(median of {repeats}); outputs identical in all three modes:"
    )
    for mode, ms in timings.items():
        print(f"  {mode:>11}: {ms:7.2f} ms  ({ms / timings['resident']:.2f}x resident)")
    return 0
