"""Prefetch offloading on the CPU: bitwise parity for every layer count, slot count and
offload pattern, proof that offloading happened, the copy schedule, and misuse."""

from __future__ import annotations

import pytest
import torch
from helpers import block_stack, expected_offloaded_bytes, run_stack, storage_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from offload import OffloadConfig, OffloadError, PinningUnavailableError, PrefetchOffloader
from offload.arena import ARENA_ALIGNMENT_BYTES

HIDDEN = 16


def patterns(num_layers: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.sets(st.integers(0, num_layers - 1), min_size=1).map(lambda s: tuple(sorted(s)))


def expected_copies(num_offloaded: int, step: int, forwards: int) -> int:
    """Copies after post_init and `forwards` forwards: the first K loads, then every layer
    whose slot it shares reloads its slot's next occupant once per forward."""
    slots = min(max(step, 1), num_offloaded)
    occupants = [sum(1 for j in range(num_offloaded) if j % slots == s) for s in range(slots)]
    if step == 0:  # one slot, each layer copied in by its own pre-hook (post_init: the first)
        return 1 if num_offloaded == 1 else forwards * num_offloaded
    return slots + forwards * sum(c for c in occupants if c > 1)


@pytest.mark.parametrize("num_layers", range(1, 9))
@pytest.mark.parametrize("step", range(5))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_parity_and_schedule_for_every_shape(
    num_layers: int, step: int, data: st.DataObject
) -> None:
    layers_to_offload = data.draw(patterns(num_layers), label="offloaded layers")
    modules = block_stack(num_layers, HIDDEN)
    x = torch.randn(3, HIDDEN)
    reference = run_stack(modules, x)
    footprint_before = storage_bytes(modules)
    originals = [p.detach().clone() for m in modules for p in m.parameters()]

    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=layers_to_offload, prefetch_step=step),
        device="cpu",
        env={},
    )
    assert offloader.wrap_modules(modules) == modules
    offloader.post_init()
    forwards = 3
    for _ in range(forwards):
        assert torch.equal(run_stack(modules, x), reference)

    stats = offloader.stats()
    offloaded = expected_offloaded_bytes(modules, layers_to_offload)
    assert stats.offloaded_bytes == offloaded
    assert stats.offloaded_layers == len(layers_to_offload)
    assert stats.resident_bytes == footprint_before - offloaded
    # Memory, measured from the parameters' own storages: the offloaded weights left the
    # device, only the slots came in.
    assert storage_bytes(modules) == footprint_before - offloaded + stats.buffer_bytes
    num_slots = min(max(step, 1), len(layers_to_offload))
    assert stats.buffer_bytes % num_slots == 0
    slot_bytes = stats.buffer_bytes // num_slots
    layer_bytes = offloaded // len(layers_to_offload)  # the blocks are all the same size
    assert layer_bytes <= slot_bytes <= layer_bytes + 6 * ARENA_ALIGNMENT_BYTES
    # The schedule: exactly the planned copies, and with a prefetch, never a copy on demand.
    assert stats.copies == expected_copies(len(layers_to_offload), step, forwards)
    assert stats.copied_bytes >= min(stats.copies, 1) * layer_bytes
    if step > 0:
        assert stats.sync_loads == 0
    assert stats.pinned_bytes == 0 and stats.pageable_bytes == offloaded

    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)
    assert storage_bytes(modules) == footprint_before
    restored = [p.detach() for m in modules for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(originals, restored, strict=True))
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in modules)


@pytest.mark.parametrize(
    ("group_size", "num_in_group", "step"), [(2, 1, 2), (3, 2, 3), (4, 3, 2), (4, 3, 4)]
)
def test_vllm_style_groups_with_wraparound(group_size: int, num_in_group: int, step: int) -> None:
    """Offloaded counts that are not multiples of the step (7 layers, groups of 2..4): the
    case where vLLM's wrap-around overwrites a slot whose layer has not run yet."""
    modules = block_stack(7, HIDDEN, seed=1)
    x = torch.randn(2, HIDDEN)
    reference = run_stack(modules, x)
    config = OffloadConfig(group_size=group_size, num_in_group=num_in_group, prefetch_step=step)
    num_offloaded = len(config.select_layers(7))
    assert num_offloaded % step != 0
    with PrefetchOffloader(config, device="cpu", env={}) as offloader:
        offloader.wrap_modules(modules)
        offloader.post_init()
        for _ in range(4):
            assert torch.equal(run_stack(modules, x), reference)
        assert offloader.stats().sync_loads == 0
    assert torch.equal(run_stack(modules, x), reference)


def test_first_forward_without_post_init_loads_on_demand() -> None:
    modules = block_stack(4, HIDDEN)
    x = torch.randn(2, HIDDEN)
    reference = run_stack(modules, x)
    with PrefetchOffloader(
        OffloadConfig(layers=(0, 1, 2, 3), prefetch_step=2), device="cpu", env={}
    ) as offloader:
        offloader.wrap_modules(modules)
        assert torch.equal(run_stack(modules, x), reference)
        first = offloader.stats().sync_loads
        assert first == 2  # the first two layers: nothing had been prefetched yet
        assert torch.equal(run_stack(modules, x), reference)
        assert offloader.stats().sync_loads == first  # from then on, the prefetch keeps up


class Flaky(nn.Module):
    """A resident layer that fails on demand, to abort a forward half-way."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        return x * 2


def test_aborted_forward_and_out_of_order_calls_stay_correct() -> None:
    modules = block_stack(6, HIDDEN, seed=2)
    flaky = Flaky()
    modules.insert(3, flaky)
    x = torch.randn(2, HIDDEN)
    reference = run_stack(modules, x)
    per_layer = []
    h = x
    with torch.no_grad():
        for m in modules:
            per_layer.append(m(h))
            h = per_layer[-1]
    offloader = PrefetchOffloader(
        OffloadConfig(layers=(0, 1, 2, 4, 5, 6), prefetch_step=2), device="cpu", env={}
    )
    offloader.wrap_modules(modules)
    offloader.post_init()
    flaky.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        run_stack(modules, x)
    flaky.fail = False
    assert torch.equal(run_stack(modules, x), reference)
    # Call the layers in reverse, each on its own recorded input.
    inputs = [x, *per_layer[:-1]]
    with torch.no_grad():
        for i in reversed(range(len(modules))):
            assert torch.equal(modules[i](inputs[i]), per_layer[i]), i
    assert offloader.stats().sync_loads > 0  # the disorder was absorbed by loads on demand
    assert torch.equal(run_stack(modules, x), reference)
    offloader.detach()


def test_param_filter_offloads_only_matching_parameters() -> None:
    modules = block_stack(4, HIDDEN)
    x = torch.randn(2, HIDDEN)
    reference = run_stack(modules, x)
    before = storage_bytes(modules)
    config = OffloadConfig(layers=(1, 2, 3), param_filter=r"^0\.")  # the Linear only
    with PrefetchOffloader(config, device="cpu", env={}) as offloader:
        offloader.wrap_modules(modules)
        offloader.post_init()
        assert torch.equal(run_stack(modules, x), reference)
        stats = offloader.stats()
        assert stats.offloaded_bytes == expected_offloaded_bytes(modules, (1, 2, 3), r"^0\.")
        assert stats.offloaded_bytes == 3 * (HIDDEN * HIDDEN + HIDDEN) * 4
        assert storage_bytes(modules) == before - stats.offloaded_bytes + stats.buffer_bytes
        norm_weight = modules[1][2].weight
        assert norm_weight.untyped_storage().nbytes() == norm_weight.nbytes  # stayed in place


def test_wrapping_twice_or_an_offloaded_module_is_an_error() -> None:
    modules = block_stack(3, HIDDEN)
    offloader = PrefetchOffloader(OffloadConfig(layers=(1,)), device="cpu", env={})
    offloader.wrap_modules(modules)
    with pytest.raises(OffloadError, match="already called"):
        offloader.wrap_modules(modules)
    other = PrefetchOffloader(OffloadConfig(layers=(0,)), device="cpu", env={})
    with pytest.raises(OffloadError, match="already offloaded by a PrefetchOffloader"):
        other.wrap_modules([modules[1]])
    with pytest.raises(OffloadError, match="already offloaded"):  # a parent of an offloaded layer
        other.wrap_modules([nn.Sequential(*modules)])
    offloader.detach()
    other.wrap_modules([modules[1]])  # after detach, the module is free again
    other.detach()


def test_tied_weights_across_modules_are_refused() -> None:
    modules = block_stack(3, HIDDEN)
    modules[2][0].weight = modules[0][0].weight
    offloader = PrefetchOffloader(OffloadConfig(layers=(0,)), device="cpu", env={})
    with pytest.raises(OffloadError, match="tied weights"):
        offloader.wrap_modules(modules)
    assert not offloader.wrapped


def test_inputs_requiring_grad_are_refused() -> None:
    modules = block_stack(2, HIDDEN)
    with PrefetchOffloader(OffloadConfig(layers=(1,)), device="cpu", env={}) as offloader:
        offloader.wrap_modules(modules)
        x = torch.randn(2, HIDDEN, requires_grad=True)
        with pytest.raises(OffloadError, match="inference-only"):
            modules[1](x)
        with torch.no_grad():
            modules[1](x)  # fine without grad mode


@pytest.mark.parametrize(
    ("config", "env", "error", "match"),
    [
        (OffloadConfig(layers=(5,)), {}, ValueError, "only 3 modules"),
        (OffloadConfig(group_size=4, num_in_group=1), {}, ValueError, "selects no parameters"),
        (OffloadConfig(layers=(0,), param_filter="nothing"), {}, ValueError, "selects no param"),
        (OffloadConfig(layers=(0,)), {"OFFLOAD_PIN_MEMORY": "sometimes"}, ValueError, "allowed"),
        (OffloadConfig(layers=(0,)), {"OFFLOAD_PIN_MEMORY": "on"}, PinningUnavailableError, "CUDA"),
    ],
)
def test_bad_input_leaves_modules_untouched(config, env, error, match) -> None:
    modules = block_stack(3, HIDDEN)
    ptrs = [p.data_ptr() for m in modules for p in m.parameters()]
    offloader = PrefetchOffloader(config, device="cpu", env=env)
    with pytest.raises(error, match=match):
        offloader.wrap_modules(modules)
    assert [p.data_ptr() for m in modules for p in m.parameters()] == ptrs
    assert not offloader.wrapped and not any(m._forward_pre_hooks for m in modules)


def test_wrap_again_after_detach_uses_a_fresh_copy_engine() -> None:
    modules = block_stack(3, HIDDEN)
    x = torch.randn(2, HIDDEN)
    reference = run_stack(modules, x)
    offloader = PrefetchOffloader(OffloadConfig(layers=(0, 2)), device="cpu", env={})
    for _ in range(2):
        offloader.wrap_modules(modules)
        offloader.post_init()
        assert torch.equal(run_stack(modules, x), reference)
        offloader.detach()


def test_meta_layers_are_loaded_straight_into_the_arena() -> None:
    """The worker's path: layers built on the meta device, wrapped (no weights exist yet),
    then their bytes written into the arena; no full copy of the weights on the device."""
    reference = block_stack(4, HIDDEN, seed=3)
    x = torch.randn(2, HIDDEN)
    expected = run_stack(reference, x)
    with torch.device("meta"):
        modules = block_stack(4, HIDDEN, seed=3)
    for i in (0, 2):  # the resident ones get real memory and their weights
        modules[i] = modules[i].to_empty(device="cpu")
        modules[i].load_state_dict(reference[i].state_dict())
    with PrefetchOffloader(OffloadConfig(layers=(1, 3)), device="cpu", env={}) as offloader:
        offloader.wrap_modules(modules)
        assert not any(p.is_meta for m in modules for p in m.parameters())
        store = offloader.host_tensors()
        for i in (1, 3):
            for name, param in reference[i].named_parameters():
                store[f"{i}.{name}"].copy_(param.detach())
        offloader.post_init()
        assert torch.equal(run_stack(modules, x), expected)
    assert torch.equal(run_stack(modules, x), expected)  # detached: real, resident weights
