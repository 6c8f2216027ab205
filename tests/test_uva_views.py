"""UVA views on CUDA, checked without a GPU: the device index is always explicit (torch takes an
indexless device as a cue to ask the driver about the pointer, which pageable memory fails), the
memory behind the views is pinned or read through the host page tables, and the views own their
host memory. The CUDA calls themselves are stood in for; tests/test_gpu.py runs them for real."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import block_stack, run_stack
from test_policy import GH200, X86_H100, gpu

from offload import NodeProbe, OffloadConfig, OffloadUnavailableError, PinDecision
from offload import uva as uva_module
from offload.arena import HostArena, TensorSpec
from offload.uva import (
    UVAOffloader,
    cuda_device,
    host_memory_for_views,
    reads_pageable_memory,
    torch_views_unregistered_memory,
)

OFF = PinDecision(pin=False, reason="coherent unified memory", source="probe.unified_memory")
ON = PinDecision(pin=True, reason="discrete GPU", source="probe")


def test_the_device_index_is_made_explicit(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_device("cuda") == torch.device("cuda", 3)
    assert cuda_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cpu"):
        cuda_device("cpu")


@pytest.mark.parametrize(
    ("version", "ok"),
    [("2.9.0+cu128", True), ("2.11.0", True), ("2.10.0a0+git1234", True), ("2.8.1", False)],
)
def test_which_torch_views_unregistered_memory(version: str, ok: bool) -> None:
    assert torch_views_unregistered_memory(version) is ok


def test_host_memory_for_views_rule_by_rule() -> None:
    assert host_memory_for_views(ON, reads_pageable=False) is ON
    assert host_memory_for_views(OFF, reads_pageable=True, torch_version="2.9.0") is OFF
    registered = host_memory_for_views(OFF, reads_pageable=True, torch_version="2.8.0")
    assert registered.pin and registered.source == "torch_version"
    assert ">= 2.9" in registered.reason and "coherent unified memory" in registered.reason
    with pytest.raises(OffloadUnavailableError, match="OFFLOAD_PIN_MEMORY=on"):
        host_memory_for_views(OFF, reads_pageable=False)


def test_pageable_access_is_read_for_the_device_used() -> None:
    mixed = NodeProbe(
        cuda_available=True,
        devices=(gpu(index=0), gpu(index=1, pageable_memory_access_uses_host_page_tables=True)),
    )
    assert not reads_pageable_memory(mixed, 0) and reads_pageable_memory(mixed, 1)
    assert reads_pageable_memory(GH200, 0) and not reads_pageable_memory(X86_H100, 0)


def test_device_view_hands_torch_an_explicit_index_and_an_owner(monkeypatch) -> None:
    arena = HostArena([TensorSpec("w", (64,), torch.float32)], pin=False)
    handed = {}

    def as_tensor(obj, *, device):
        handed.update(obj=obj, device=device)
        ptr = obj.__cuda_array_interface__["data"][0]
        return types.SimpleNamespace(device=device, data_ptr=lambda: ptr)

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    monkeypatch.setattr(torch.cuda, "device", lambda device: _Nothing())
    device = torch.device("cuda", 2)
    uva_module.device_view(arena, device)
    assert handed["device"] == device and handed["device"].index == 2
    assert handed["obj"].owner is arena  # what keeps the host memory alive
    assert handed["obj"].__cuda_array_interface__["data"] == (arena.data_ptr, False)
    # torch handing back a copy (another address) is refused, never used silently
    monkeypatch.setattr(
        torch,
        "as_tensor",
        lambda obj, *, device: types.SimpleNamespace(device=device, data_ptr=int),
    )
    with pytest.raises(OffloadUnavailableError, match="copy"):
        uva_module.device_view(arena, device)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA as the offloader sees it, with views that are host tensors: records each view's
    arena and device."""
    views = []

    def device_view(arena, device):
        views.append((arena, device))
        return arena.bytes(0, arena.nbytes)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: _Nothing())
    monkeypatch.setattr(uva_module, "device_view", device_view)
    return views


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_on_a_coherent_gpu_the_views_are_of_unpinned_memory(fake_cuda, device: str) -> None:
    modules = block_stack(3)
    x = torch.randn(2, 16)
    reference = run_stack(modules, x)
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(0, 2)), device=device, env={}, probe=GH200
    )
    offloader.wrap_modules(modules)
    [(arena, viewed_on)] = fake_cuda
    assert viewed_on == torch.device("cuda", 0)
    assert not arena.pinned and not offloader.pin_decision.pin
    stats = offloader.stats()
    assert stats.pageable_bytes == stats.offloaded_bytes > 0 and stats.pinned_bytes == 0
    assert torch.equal(run_stack(modules, x), reference)
    offloader.detach(restore=False)


def test_on_a_mixed_node_only_the_coherent_gpu_views_pageable_memory(fake_cuda) -> None:
    mixed = NodeProbe(
        cuda_available=True,
        devices=(gpu(index=0), gpu(index=1, pageable_memory_access_uses_host_page_tables=True)),
    )
    config = OffloadConfig(backend="uva", layers=(0,))
    with pytest.raises(OffloadUnavailableError, match="backend='prefetch'"):
        UVAOffloader(config, device="cuda:0", env={}, probe=mixed).wrap_modules(block_stack(2))
    offloader = UVAOffloader(config, device="cuda:1", env={}, probe=mixed)
    offloader.wrap_modules(block_stack(2))
    assert [device for _, device in fake_cuda] == [torch.device("cuda", 1)]
    offloader.detach(restore=False)


def test_detach_leaves_the_arena_to_the_views_that_remain(fake_cuda) -> None:
    """detach(restore=False) keeps no reference of its own, and closes nothing under a view
    still in use: the last view releases the arena (and would unregister it)."""
    modules = block_stack(2)
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(0,)), device="cuda", env={}, probe=GH200
    )
    offloader.wrap_modules(modules)
    [(arena, _)] = fake_cuda
    closed = []
    arena.close = lambda: closed.append(True)
    offloader.detach(restore=False)
    assert offloader._arena is None and closed == []
