"""The exact-size arena: layout, alignment, host bytes, and misuse."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from offload import HostArena, PinningUnavailableError, TensorSpec
from offload.arena import ARENA_ALIGNMENT_BYTES

ODD_SPECS = [
    TensorSpec("a", (7,), torch.float32),
    TensorSpec("b", (3, 5), torch.bfloat16),
    TensorSpec("c", (1,), torch.int8),
    TensorSpec("d", (129, 3), torch.float16),
    TensorSpec("e", (), torch.float64),
    TensorSpec("f", (1000, 3), torch.float32),
    TensorSpec("g", (0, 4), torch.float32),
]


def test_layout_is_exact_up_to_alignment() -> None:
    arena = HostArena(ODD_SPECS, pin=False)
    payload = sum(s.nbytes for s in ODD_SPECS)
    assert payload == 7 * 4 + 15 * 2 + 1 + 387 * 2 + 8 + 3000 * 4 + 0
    assert arena.payload_bytes == payload
    assert payload <= arena.nbytes <= payload + len(ODD_SPECS) * (ARENA_ALIGNMENT_BYTES - 1)
    assert arena.host_bytes == arena.nbytes + 4096  # one page to start on a page boundary
    assert arena.data_ptr % 4096 == 0
    assert list(arena) == [s.name for s in ODD_SPECS] and len(arena) == len(ODD_SPECS)
    for spec in ODD_SPECS:
        view = arena[spec.name]
        assert (tuple(view.shape), view.dtype) == (spec.shape, spec.dtype)
        assert view.data_ptr() % ARENA_ALIGNMENT_BYTES == 0
    assert not arena.pinned


def test_views_do_not_overlap() -> None:
    arena = HostArena(ODD_SPECS, pin=False)
    for i, spec in enumerate(ODD_SPECS):
        arena[spec.name].fill_(i + 1)
    for i, spec in enumerate(ODD_SPECS):
        assert bool((arena[spec.name] == i + 1).all()), spec.name


def test_many_tensors_stay_within_slack_of_their_sum() -> None:
    specs = [TensorSpec(f"t{i}", (1 + 37 * i,), torch.float32) for i in range(500)]
    payload = sum(s.nbytes for s in specs)
    arena = HostArena(specs, pin=False)
    # The power-of-two rounding this replaces would cost up to 2x here.
    assert arena.host_bytes <= payload + 500 * ARENA_ALIGNMENT_BYTES + 4096
    assert arena.host_bytes / payload < 1.03


def test_host_memory_grows_by_the_payload_only() -> None:
    specs = [TensorSpec(f"w{i}", (1_000_003 + i * 4099,), torch.float32) for i in range(16)]
    payload = sum(s.nbytes for s in specs)  # ~64 MiB of odd-sized tensors
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    arena = HostArena(specs, pin=False)
    for name in arena:
        arena[name].fill_(1.0)  # touch every page
    grown = process.memory_info().rss - before
    assert payload * 0.95 <= grown <= payload * 1.02 + 8 * 2**20, (grown, payload)
    del arena


def test_span_of_contiguous_and_scattered_tensors() -> None:
    arena = HostArena(ODD_SPECS, pin=False)
    start, end = arena.span(["b", "c", "d"])
    assert start == arena.offset("b")
    assert end == arena.offset("d") + ODD_SPECS[3].nbytes
    assert arena.bytes(start, end).numel() == end - start
    with pytest.raises(ValueError, match="not contiguous"):
        arena.span(["a", "c"])
    with pytest.raises(ValueError, match="at least one"):
        arena.span([])


def test_duplicate_names_and_bad_alignment_are_rejected() -> None:
    with pytest.raises(ValueError, match="twice"):
        HostArena([ODD_SPECS[0], ODD_SPECS[0]], pin=False)
    with pytest.raises(ValueError, match="power of two"):
        HostArena(ODD_SPECS, pin=False, alignment=48)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_pinning_without_cuda_is_an_error() -> None:
    with pytest.raises(PinningUnavailableError, match="pin=False"):
        HostArena(ODD_SPECS, pin=True)


def test_close_is_idempotent_and_views_survive() -> None:
    arena = HostArena(ODD_SPECS, pin=False)
    arena["f"].fill_(3.0)
    view = arena["f"]
    arena.close()
    arena.close()
    assert float(view.sum()) == 9000.0


def test_empty_arena() -> None:
    arena = HostArena([], pin=False)
    assert (arena.payload_bytes, arena.nbytes, len(arena)) == (0, 0, 0)
