"""UVA views on CUDA. Without a GPU, the rules: the device index is always explicit (torch takes
an indexless device as a cue to ask the driver about the pointer, which pageable memory fails),
the memory behind the views is pinned or read through the host page tables, and what the
offloader asks for and refuses, with `device_view` stood in for. On a real GPU (`gpu`-marked,
skipped cleanly without CUDA), the views themselves: kernels read the host bytes in place,
pinned or (on GPUs that read pageable memory, GH200/GB200 class) pageable, and the views own
their host memory. tests/test_gpu.py runs the pinned offloader end to end."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from helpers import block_stack, run_stack
from test_policy import GH200, X86_H100, gpu

from offload import NodeProbe, OffloadConfig, OffloadUnavailableError, PinDecision
from offload import uva as uva_module
from offload.arena import HostArena, TensorSpec
from offload.probe import DECISION_STEPS, probe_node
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
    """What `device_view` hands torch (torch stood in for), and its refusal of a copy; that
    the view works is `test_a_real_device_view_is_the_host_memory_itself`."""
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
    """CUDA as the offloader sees it, with `device_view` stood in for (host tensors, not device
    views): records each view's arena and device. For what the offloader decides and refuses
    only; the views are tested on a real GPU below."""
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
def test_on_a_coherent_gpu_the_offloader_asks_for_views_of_unpinned_memory(
    fake_cuda, device: str
) -> None:
    """The decision and the accounting only (`device_view` stood in for): on a GH200 probe the
    arena stays pageable, one view of it is asked for on the explicit device, and the stats
    say pageable. The views on such a GPU: `test_on_a_real_coherent_gpu_...` below."""
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(0, 2)), device=device, env={}, probe=GH200
    )
    offloader.wrap_modules(block_stack(3))
    [(arena, viewed_on)] = fake_cuda
    assert viewed_on == torch.device("cuda", 0)
    assert not arena.pinned and not offloader.pin_decision.pin
    stats = offloader.stats()
    assert stats.pageable_bytes == stats.offloaded_bytes > 0 and stats.pinned_bytes == 0
    offloader.detach(restore=False)


def test_on_a_mixed_node_only_the_coherent_gpu_views_pageable_memory(fake_cuda) -> None:
    """The GPU without ATS is refused; the one with it is the one a view is asked for on."""
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


def pageable_views_or_skip(probe: NodeProbe, device: torch.device) -> None:
    """Skip unless this GPU views pageable host memory: it reads it through the host page
    tables (GH200/GB200 class) and this torch takes the view's explicit index."""
    if not reads_pageable_memory(probe, device.index):
        pytest.skip(
            "this GPU does not read pageable memory through the host page tables (ATS): only "
            "registered memory is viewed here; GH200/GB200-class GPUs run this"
        )
    if not torch_views_unregistered_memory():
        pytest.skip(f"torch {torch.__version__} cannot view unregistered memory (needs >= 2.9)")


def read_on_gpu(flat: torch.Tensor) -> torch.Tensor:
    """Every byte of `flat` as a kernel on its GPU reads it (widened to int16 there), on the
    host: a kernel's loads, not a copy engine's."""
    return flat.to(torch.int16).cpu()


def typed_on_gpu(flat: torch.Tensor, arena: HostArena, name: str) -> torch.Tensor:
    """Tensor `name` read by a kernel through `flat`, as the offloader views it (its bytes at
    its offset, viewed as its dtype and shape), widened to float64 on the GPU, on the host."""
    like = arena[name]
    start = arena.offset(name)
    view = flat[start : start + like.nbytes].view(like.dtype).view(like.shape)
    assert view.device == flat.device
    return view.to(torch.float64).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_a_real_device_view_is_the_host_memory_itself(pin: bool) -> None:
    """On a real GPU, `device_view` of a real arena, registered or (where the GPU reads it
    through the host page tables) pageable: a device tensor at the arena's device address whose
    kernels read the host bytes bitwise, each tensor at its offset in its dtype; a later write
    to the host memory is what the next kernel reads, and a kernel's write lands in the host
    memory (a view, never a copy); the view keeps the arena, so its memory and registration,
    alive when every other reference is gone, and lets it go with the last view."""
    device = cuda_device("cuda")
    if not pin:
        pageable_views_or_skip(probe_node(DECISION_STEPS), device)
    g = torch.Generator().manual_seed(0)
    values = {
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "f32": torch.randn(7, 33, generator=g),
        "i8": torch.randint(-128, 128, (5,), generator=g, dtype=torch.int8),
    }
    arena = HostArena([TensorSpec(k, tuple(v.shape), v.dtype) for k, v in values.items()], pin=pin)
    assert arena.pinned is pin
    for name, value in values.items():
        arena[name].copy_(value)
    flat = uva_module.device_view(arena, device)
    assert flat.device == device and flat.dtype == torch.uint8 and flat.numel() == arena.nbytes
    mapped = uva_module._mapped_device_pointer(arena.data_ptr) if pin else arena.data_ptr
    assert flat.data_ptr() == mapped
    host = arena.bytes(0, arena.nbytes)
    assert torch.equal(read_on_gpu(flat), host.to(torch.int16))  # every byte, padding too
    for name, value in values.items():
        assert torch.equal(typed_on_gpu(flat, arena, name), value.to(torch.float64)), name

    values["f32"] = torch.randn(7, 33, generator=g)  # written through host memory
    arena["f32"].copy_(values["f32"])
    assert torch.equal(typed_on_gpu(flat, arena, "f32"), values["f32"].to(torch.float64))
    start = arena.offset("i8")
    flat[start : start + 5].fill_(0xFD)  # written by a kernel: -3 as int8
    torch.cuda.synchronize(device)
    assert torch.equal(arena["i8"], torch.full((5,), -3, dtype=torch.int8))

    expected = read_on_gpu(flat)
    owner = weakref.ref(arena)
    del arena, host
    gc.collect()
    assert owner() is not None, "the arena went while a view of it was left"
    assert torch.equal(read_on_gpu(flat), expected)
    del flat
    gc.collect()
    assert owner() is None, "the last view went, and the arena stayed"


@pytest.mark.gpu
def test_on_a_real_coherent_gpu_the_offloader_views_pageable_memory() -> None:
    """On a GPU that reads pageable memory through the host page tables (GH200/GB200 class;
    skipped elsewhere), its node's own decision: auto says off (coherent unified memory), the
    arena stays pageable, the offloaded parameters are device tensors inside it, the stack's
    output is bitwise its resident output (the same kernels, reading the same bytes in host
    memory), and after detach(restore=False) the parameters still read the arena."""
    device = cuda_device("cuda")
    probe = probe_node(DECISION_STEPS)
    pageable_views_or_skip(probe, device)
    modules = [m.to(device) for m in block_stack(3, 256)]
    x = torch.randn(8, 256, device=device)
    reference = run_stack(modules, x)
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(0, 2)), device=device, env={}, probe=probe
    )
    offloader.wrap_modules(modules)
    arena = offloader._arena
    assert arena is not None and not arena.pinned and not offloader.pin_decision.pin
    for i in (0, 2):
        weight = modules[i][0].weight
        assert weight.device == device
        assert arena.data_ptr <= weight.data_ptr() < arena.data_ptr + arena.nbytes
    stats = offloader.stats()
    assert stats.pageable_bytes == stats.offloaded_bytes > 0 and stats.pinned_bytes == 0
    assert torch.equal(run_stack(modules, x), reference)
    offloader.detach(restore=False)
    del arena
    assert torch.equal(run_stack(modules, x), reference)
