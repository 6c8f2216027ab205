"""The placement that maximises tokens/s: the shortest decode cycle for k micro-batches.

With k micro-batches in flight, a micro-batch's decode step passes the stages in turn (stage s
takes u_s = its time max(compute, copies) + the step overhead), and a stage works on one
micro-batch at a time. So every micro-batch makes one token per

    cycle = max(sum_s u_s, k * max_s u_s)

(the first term: one micro-batch's trip through every stage; the second: the slowest stage
serving all k in turn), and the pipeline makes max_batch tokens per cycle: tokens/s =
max_batch / cycle, and the cycle is also each sequence's time between two tokens.

Why the search is exact:
- If k >= S*, the number of stages of the bottleneck-optimal placement P* (`Search.solve`),
  then P* is optimal: any placement P has cycle(P) >= k * max u(P) >= k * (T* + o), and
  cycle(P*) = k * (T* + o) because sum u(P*) <= S* * (T* + o).
- Otherwise, for a cap T on the stage time, g(T) = the least sum of u over placements whose
  stages all take <= T (a DP over the GPUs in pipeline order; within a node, the states keep
  the host bytes used, as a Pareto front, since the node's budget couples its GPUs). g falls
  as T grows and k * (T + o) rises, so over the sorted stage times T_i of every feasible range
  the optimum is min(k * (T_j + o), g(T_{j-1})) at the first T_j with g(T_j) <= k * (T_j + o):
  a bisection over the T_i. Its cost grows with gpus x layers^2, so above DP_LIMIT ranges the
  search keeps P* and reports the bound it proves instead (`Cycle.bound_s`).
No Ray; pure arithmetic on the `Search`'s sizes, budgets and rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.planning.search import LayerRange, Search

# Above this many (GPU, range) pairs the exact DP is skipped (about a second of Python).
DP_LIMIT = 200_000


def cycle_s(times: Sequence[float], micro_batches: int, overhead_s: float) -> float:
    """The decode cycle of stages taking `times` (before the overhead) with `micro_batches`."""
    if not times:
        return 0.0
    total = 0.0
    for t in times:  # in stage order: the DP adds them in the same order
        total += t + overhead_s
    return max(total, micro_batches * (max(times) + overhead_s))


@dataclass(frozen=True, slots=True)
class Cycle:
    placements: tuple[LayerRange, ...]
    cycle_s: float
    bound_s: float  # no placement has a shorter cycle (== cycle_s: proven the shortest)


def min_cycle(
    search: Search,
    micro_batches: int,
    overhead_s: float,
    best: Sequence[LayerRange] | None = None,
    dp_limit: int = DP_LIMIT,
) -> Cycle | None:
    """The placement with the shortest cycle, None when the layers do not fit at all. `best`:
    the bottleneck-optimal placement when the caller has solved for it already."""
    if best is None:
        reached, best = search.solve()
        if reached < search.num_layers:
            return None
    k, times = micro_batches, [max(search.stage_times(p)) for p in best]
    answer, bottleneck = (tuple(best), cycle_s(times, k, overhead_s)), max(times)
    if k >= len(best):
        return Cycle(*answer, bound_s=answer[1])
    gpus = sum(len(n.gpu_memory_bytes) for n in search.nodes)
    if gpus * search.num_layers * (search.num_layers + 1) // 2 > dp_limit:
        # Lower bounds: every placement has a stage of >= T*, and computes all weights at no
        # more than the fastest node's rate, in at least one stage.
        bound = max(k * (bottleneck + overhead_s), search.work[-1] / max(search.rates) + overhead_s)
        return Cycle(*answer, bound_s=min(bound, answer[1]))
    caps = sorted(_stage_times(search, bottleneck))
    lo, hi = 0, len(caps) - 1
    # The first cap whose least sum is within k * (cap + o): bisect (g falls, k * (T + o) rises).
    while lo < hi:
        mid = (lo + hi) // 2
        got = _least_sum(search, caps[mid], overhead_s)
        if got is not None and got[0] <= k * (caps[mid] + overhead_s):
            hi = mid
        else:
            lo = mid + 1
    for j in (lo - 1, lo):
        got = _least_sum(search, caps[j], overhead_s) if j >= 0 else None
        if got is not None:
            value = cycle_s([max(search.stage_times(p)) for p in got[1]], k, overhead_s)
            if value < answer[1]:
                answer = (tuple(got[1]), value)
    return Cycle(*answer, bound_s=answer[1])


def _stage_times(search: Search, floor: float) -> set[float]:
    """Every stage time >= `floor` a feasible range can take on some GPU (no smaller cap is
    feasible: `floor` is the least bottleneck)."""
    times = set()
    for n, node in enumerate(search.nodes):
        for memory in set(node.gpu_memory_bytes):
            for start in range(search.num_layers):
                for end in range(start + 1, search.num_layers + 1):
                    t = _range_time(search, n, start, end, memory)
                    if t is None:
                        break
                    if t >= floor:
                        times.add(t)
    return times


def _moved(search: Search, n: int, start: int, end: int, memory: int) -> tuple[int, int] | None:
    """(host bytes, link bytes of its transfer time) of layers [start, end) on a GPU of node
    `n` with `memory` bytes: as the node keeps them (8 bits where it packs them, their
    dequantization in link bytes), what `Search.stage_times` counts; None: they do not fit."""
    node = search.nodes[n]
    host = search.offload_bytes(start, end, memory, node.slots, node.packed)
    if host is None:
        return None
    factor = node.dequant_factor if node.packed else 0.0
    link = search.offload_bytes(start, end, memory, node.slots, node.packed, factor)
    return host, link


def _range_time(search: Search, n: int, start: int, end: int, memory: int) -> float | None:
    node = search.nodes[n]
    moved = _moved(search, n, start, end, memory)
    if moved is None or moved[0] > node.offload_budget_bytes:
        return None
    work = search.work[end] - search.work[start]
    return max(work / search.rates[n], moved[1] / node.link_bytes_per_s)


def _least_sum(
    search: Search, cap: float, overhead_s: float
) -> tuple[float, list[LayerRange]] | None:
    """g(cap): the least sum of stage times (+ overhead each) over placements whose stages all
    take <= cap, and one such placement."""
    num = search.num_layers
    # (position reached, host bytes this node used) -> (sum so far, stages so far)
    front: dict[tuple[int, int], tuple[float, tuple[LayerRange, ...]]] = {(0, 0): (0.0, ())}
    for n, node in enumerate(search.nodes):
        per_pos: dict[tuple[int, int], tuple[float, tuple[LayerRange, ...]]] = {}
        for (pos, _), value in front.items():  # a new node: its host budget is untouched
            if (pos, 0) not in per_pos or value[0] < per_pos[(pos, 0)][0]:
                per_pos[(pos, 0)] = value
        front = per_pos
        for g, memory in enumerate(node.gpu_memory_bytes):
            grown = dict(front)  # this GPU unused
            for (pos, used), (total, stages) in front.items():
                for end in range(pos + 1, num + 1):
                    moved = _moved(search, n, pos, end, memory)
                    if moved is None or used + moved[0] > node.offload_budget_bytes:
                        break  # a longer range needs at least as many bytes moved
                    offloaded = moved[0]
                    work = search.work[end] - search.work[pos]
                    t = max(work / search.rates[n], moved[1] / node.link_bytes_per_s)
                    if t > cap:
                        break  # and at least as much time
                    key, value = (end, used + offloaded), total + (t + overhead_s)
                    if key not in grown or value < grown[key][0]:
                        grown[key] = (value, (*stages, LayerRange(n, g, pos, end)))
            front = _pareto(grown)
    ends = [value for (pos, _), value in front.items() if pos == num]
    if not ends:
        return None
    total, stages = min(ends, key=lambda v: v[0])
    return total, list(stages)


def _pareto(states: dict[tuple[int, int], tuple[float, tuple[LayerRange, ...]]]):
    """Per position, only the states no other beats on both host bytes and sum."""
    kept: dict[tuple[int, int], tuple[float, tuple[LayerRange, ...]]] = {}
    least: dict[int, float] = {}
    for pos, used in sorted(states):
        value = states[(pos, used)]
        if value[0] < least.get(pos, math.inf):
            kept[(pos, used)] = value
            least[pos] = value[0]
    return kept
