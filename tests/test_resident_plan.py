"""Resident weights kept as stored (issue 54 point 4, the planner's side): a layer offloaded
from a GPU that keeps its quantized matrices as stored frees fewer bytes than its prefetch
slot holds (the slot is at the model's width). The search against a brute force over every
offload subset, and the plans such GPUs get. Pure Python, no Ray."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.planning.search import NodeLimits, Search

FAST = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def one_gpu_search(
    resident: list[int], freed: list[int], slots: list[int], memory: int, step: int
) -> Search:
    """Decoder layers of these resident sizes on one GPU of `memory` bytes with `step` slots,
    each offloaded whole freeing `freed` bytes into a slot of `slots` bytes."""
    node = NodeLimits(gpu_memory_bytes=(memory,), offload_budget_bytes=10**9, link_bytes_per_s=1.0)
    return Search(
        resident,
        [True] * len(resident),
        [node],
        reserve_bytes=0,
        compute_bytes_per_s=1.0,
        offload_sizes=freed,
        slot_units=[slots],
    )


def least_freed(
    freed: list[int], slots: list[int], deficit: int, step: int, conservative: bool
) -> int | None:
    """The fewest bytes freed by an offload subset that makes room for `deficit` bytes beside
    min(step, its size) slots: each slot the largest of the subset's (`conservative`: the largest
    of any layer freeing no more than the subset's largest, the search's rule)."""
    best = None
    for num in range(len(freed) + 1):
        for subset in itertools.combinations(range(len(freed)), num):
            total = sum(freed[i] for i in subset)
            if subset and conservative:
                top = max(freed[i] for i in subset)
                slot = max(w for f, w in zip(freed, slots, strict=True) if f <= top)
            else:
                slot = max((slots[i] for i in subset), default=0)
            if total - min(step, num) * slot >= deficit and (best is None or total < best):
                best = total
    return best


@st.composite
def offload_cases(draw, monotone: bool):
    """Up to 7 layers, each freeing 1-20 bytes into a slot of up to twice that (`monotone`:
    the slot a nondecreasing function of the bytes freed, as for equal layers), on a GPU
    short of room for them."""
    freed = draw(st.lists(st.integers(1, 20), min_size=1, max_size=7))
    if monotone:
        widen = {f: draw(st.integers(0, f)) for f in sorted(set(freed))}
        for low, high in itertools.pairwise(sorted(widen)):  # larger freed: no smaller slot
            widen[high] = max(widen[high], widen[low] + low - high)
        slots = [f + widen[f] for f in freed]
    else:
        slots = [f + draw(st.integers(0, f)) for f in freed]
    resident = [f + draw(st.integers(0, 5)) for f in freed]  # what stays: buffers, norms
    memory = draw(st.integers(1, sum(resident)))
    return resident, freed, slots, memory, draw(st.sampled_from([0, 1, 1, 2]))


def check_against_brute_force(case, monotone: bool) -> None:
    resident, freed, slots, memory, step = case
    search = one_gpu_search(resident, freed, slots, memory, step)
    deficit = sum(resident) - memory
    expected = least_freed(freed, slots, deficit, step, conservative=True)
    if monotone:  # the conservative rule charges exactly what the subset needs
        assert expected == least_freed(freed, slots, deficit, step, conservative=False)
    if expected is None:
        assert search.offload_bytes(0, len(freed), memory, step) is None
        return
    _, moved = search.offloaded_positions(0, len(freed), memory, step)
    assert sum(freed[i] for i in moved) == expected
    # the plan fits: what the chosen layers free covers their own slots
    slot = max((slots[i] for i in moved), default=0)
    assert sum(freed[i] for i in moved) - min(step, len(moved)) * slot >= deficit


@FAST
@given(offload_cases(monotone=False))
def test_offload_choice_matches_brute_force_with_slots_larger_than_what_layers_free(case):
    """The search's least bytes freed equals the brute force's under its conservative slot
    rule, and the layers it picks fit with their own slots."""
    check_against_brute_force(case, monotone=False)


@FAST
@given(offload_cases(monotone=True))
def test_offload_choice_is_exact_where_slots_grow_with_what_layers_free(case):
    """Where equal freed sizes have equal slots and larger ones no smaller slots, the
    conservative rule is no rule: the search is the true optimum."""
    check_against_brute_force(case, monotone=True)
