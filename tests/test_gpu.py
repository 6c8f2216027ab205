"""CUDA-only checks, run on a lent GPU machine: real probes, a registered arena, prefetch on a
side stream, UVA zero-copy views. Skipped cleanly without CUDA (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import block_stack, run_stack, storage_bytes

from offload import (
    OffloadConfig,
    OffloadUnavailableError,
    PinnedArena,
    PrefetchOffloader,
    TensorSpec,
    UVAOffloader,
    decide_pinning,
    probe_node,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def cuda_stack(num_layers: int, hidden: int = 256) -> list[torch.nn.Module]:
    return [m.to(CUDA) for m in block_stack(num_layers, hidden)]


def test_probe_reads_the_driver() -> None:
    probe = probe_node()
    assert probe.cuda_available and len(probe.devices) == torch.cuda.device_count()
    device = probe.devices[0]
    assert device.capability == torch.cuda.get_device_capability(0)
    assert device.host_register_supported is True
    assert device.pageable_memory_access_uses_host_page_tables is not None
    assert probe.errors == ()
    decision = decide_pinning({}, probe)
    expected = not (probe.any_coherent_unified_memory or probe.any_integrated or probe.is_wsl)
    assert decision.pin == expected, decision


def test_arena_registers_and_unregisters() -> None:
    specs = [TensorSpec(f"t{i}", (1000 + 7 * i,), torch.float16) for i in range(10)]
    arena = PinnedArena(specs, pin=True)
    assert arena.pinned and all(arena[k].is_pinned() for k in arena)
    arena.close()
    assert not arena.pinned and not arena["t0"].is_pinned()


@pytest.mark.parametrize(("layers", "step"), [((0, 1, 2, 3, 4), 2), ((1, 3, 4), 1), ((0, 2), 0)])
def test_prefetch_on_a_side_stream_matches_resident(layers: tuple[int, ...], step: int) -> None:
    modules = cuda_stack(5)
    x = torch.randn(8, 256, device=CUDA)
    reference = run_stack(modules, x)
    before = storage_bytes(modules)
    offloader = PrefetchOffloader(
        OffloadConfig(layers=layers, prefetch_step=step), device=CUDA, env={}
    )
    offloader.wrap_modules(modules)
    offloader.post_init()
    assert offloader.pin_decision is not None
    for _ in range(3):
        assert torch.equal(run_stack(modules, x), reference)
    stats = offloader.stats()
    assert storage_bytes(modules) == before - stats.offloaded_bytes + stats.buffer_bytes
    assert stats.copies > 0 and stats.copy_s > 0
    assert stats.pinned_bytes == (stats.offloaded_bytes if offloader.pin_decision.pin else 0)
    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)


def test_uva_parameters_are_zero_copy_views_of_host_memory() -> None:
    modules = cuda_stack(4)
    x = torch.randn(8, 256, device=CUDA)
    reference = run_stack(modules, x)
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(1, 3)), device=CUDA, env={"OFFLOAD_PIN_MEMORY": "on"}
    )
    offloader.wrap_modules(modules)
    weight = modules[1][0].weight
    assert weight.device.type == "cuda"
    arena = offloader._arena
    assert arena is not None and arena.pinned
    # The device address lies inside the registered host buffer (UVA: same address space).
    assert arena.data_ptr <= weight.data_ptr() < arena.data_ptr + arena.nbytes
    assert torch.equal(run_stack(modules, x), reference)
    stats = offloader.stats()
    assert stats.copies == 0 and stats.buffer_bytes == 0 and stats.pinned_bytes > 0
    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)
    assert not (arena.data_ptr <= modules[1][0].weight.data_ptr() < arena.data_ptr + arena.nbytes)


def test_uva_refuses_pageable_memory_without_ats() -> None:
    if probe_node().any_coherent_unified_memory:
        pytest.skip("this GPU reads pageable memory (ATS): UVA without pinning is valid here")
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(0,)), device=CUDA, env={"OFFLOAD_PIN_MEMORY": "off"}
    )
    with pytest.raises(OffloadUnavailableError, match="backend='prefetch'"):
        offloader.wrap_modules(cuda_stack(2))
