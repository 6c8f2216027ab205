"""The planner's exact search: which contiguous layer ranges go to which GPUs, and which layers
of each range are offloaded, so that every stage finishes within a bottleneck time T.

Pure integer and float arithmetic on layer sizes and budgets; `coordinator.planning.planner` wraps it in
the public types. Why the search is exact, in four steps:

1. Sub-ranges are never harder. If a range [a, b) fits a GPU within T with O offloaded bytes,
   any sub-range fits with at most O: drop the removed layers from the offload set, and the
   weight bytes, resident bytes, slot bytes and offloaded bytes can only shrink.
2. Per range, fewer offloaded bytes are always better: every constraint bounds them from above
   (transfer time, the node's host budget) except device memory, which only asks for a subset
   that fits. So each range has one cost, the minimal offloaded bytes `offload_bytes(a, b, gpu)`.
   That is a bounded knapsack (minimal subset sum above a target, with the largest chosen layer
   setting the slot size; a UVA node has no slots, and the same search runs with zero of them);
   equal decoder sizes, the usual case, have a closed form, and mixed sizes are enumerated by
   size class (polynomial for a fixed number of distinct sizes). Where a slot holds more than
   offloading its layer frees (resident weights kept as stored, the slot at the model's width),
   the slots are charged at the largest slot of the unit's layers that free no more than the
   largest chosen one: never less than the chosen layers need, and exact where equal freed
   sizes have equal slots and larger ones no smaller slots (equal layers, the usual case).
3. Nodes have independent host budgets, and by (1) starting later never hurts, so each node
   takes the furthest reach it can (greedy across nodes). Within a node the host budget couples
   its GPUs, so there a greedy max-prefix can be wrong (a long range that offloads can starve the
   next GPU). We first try the per-GPU greedy, which is optimal when the budget does not bind;
   otherwise a DP keeps the Pareto front of (position reached, host bytes used) GPU by GPU.
4. Feasibility is monotone in T, and a plan's stage times are the floats W / C and O / B (C
   and B the node's compute and link rates).
   `Search.solve` bisects over the bit patterns of non-negative floats, so it finds the
   smallest float T that is feasible: exactly the best bottleneck under this cost model.
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

# A byte cap beyond any real model or budget (9 PB); above it, byte counts are inexact floats.
_UNLIMITED = 1 << 53


@dataclass(frozen=True, slots=True)
class NodeLimits:
    gpu_memory_bytes: tuple[int, ...]  # the node's GPUs in pipeline order
    offload_budget_bytes: int
    link_bytes_per_s: float
    # Device slots an offloading GPU of this node holds, each the size of its largest offloaded
    # layer: the prefetch step for the prefetch backend, 0 for UVA (the GPU reads the weights
    # in host memory where they are).
    slots: int = 1
    # Weight bytes this node's GPUs compute through per second (None: the search's default):
    # nodes may differ, and a measured rate says how fast this node runs the model.
    compute_bytes_per_s: float | None = None
    # Offloaded weights are kept as stored (8 bits where `Search`'s stored sizes say so) and
    # dequantized into the slots after each copy (the prefetch backend): a copy moves the
    # stored bytes, the host holds them, and the GPU holds one staging buffer of the largest
    # offloaded layer as stored beside its slots. False: every offloaded byte at full width.
    packed: bool = False
    # Dequantizing them after each copy, in link time: seconds per full-width byte made from 8
    # bits times the link rate (link rate / dequantization rate). A stage's transfer time is
    # (stored bytes + this x full-width bytes of its 8-bit layers) / link rate; 0.0: free or
    # not measured.
    dequant_factor: float = 0.0


@dataclass(frozen=True, slots=True)
class LayerRange:
    node: int  # index into the node list
    gpu: int  # position of the GPU within its node's list
    start: int  # layer range [start, end)
    end: int


def float_bits(x: float) -> int:
    """Order-preserving integer for a non-negative float (IEEE 754 bit pattern)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def byte_cap(t_s: float, bytes_per_s: float) -> int:
    """The most bytes whose time `bytes / bytes_per_s` is <= t_s, in the same float arithmetic
    the plan reports, so that the search and the reported stage times agree exactly."""
    if math.isinf(t_s) or t_s * bytes_per_s >= _UNLIMITED:
        return _UNLIMITED
    cap = math.floor(t_s * bytes_per_s)
    while cap >= 0 and cap / bytes_per_s > t_s:
        cap -= 1
    while (cap + 1) / bytes_per_s <= t_s:
        cap += 1
    return cap


def min_cover(
    pool: Sequence[tuple[int, int]], target: int
) -> tuple[int, int, dict[int, int]] | None:
    """Smallest (sum, count) of a sub-multiset of `pool` [(size, how many)] whose sum is >=
    target, with how many of each size it takes; None if even all of it is too little."""
    pool = sorted(pool, reverse=True)
    suffix = list(accumulate((s * c for s, c in reversed(pool)), initial=0))[::-1]
    best: list[tuple[int, int, tuple[int, ...]]] = []
    taken = [0] * len(pool)

    def visit(i: int, acc: int, num: int) -> None:
        if acc >= target:
            if not best or (acc, num) < best[0][:2]:
                best[:] = [(acc, num, tuple(taken))]
            return
        if acc + suffix[i] < target or (best and acc >= best[0][0]):
            return
        size, count = pool[i]
        if i == len(pool) - 1:  # the smallest size: take just enough of it
            need = -(-(target - acc) // size)
            taken[i] = need
            visit(i + 1, acc + need * size, num + need)
            taken[i] = 0
            return
        for q in range(count + 1):
            taken[i] = q
            visit(i + 1, acc + q * size, num + q)
            if acc + q * size >= target:
                break
        taken[i] = 0

    visit(0, 0, 0)
    if not best:
        return None
    total, num, counts = best[0]
    return total, num, {s: q for (s, _), q in zip(pool, counts, strict=True) if q}


def min_offload(
    sizes: Sequence[int], deficit: int, prefetch_step: int, extra: dict[int, int] | None = None
) -> tuple[int, dict[int, int]] | None:
    """Fewest offloaded bytes (then fewest layers) from `sizes` that free `deficit` device bytes,
    as {size: how many}; None if impossible.

    Offloading S frees sum(S) resident bytes but costs min(p, |S|) * max(S) slot bytes, so with
    deficit > 0 it needs |S| > p and sum(S) - p * max(S) >= deficit. We try each size x as the
    largest offloaded one: the rest, all of size <= x, must sum to >= deficit + (p - 1) * x.
    With p = 0 (UVA: no slots) that is sum(S) >= deficit, the same search. `extra[x]` (>= 0):
    device bytes an offload set whose largest layer is of size x needs besides p * x (the
    staging buffer of 8-bit layers; slots larger than what their layers free), so
    sum(S) >= deficit + p * x + extra[x].
    """
    if deficit <= 0:
        return 0, {}
    classes = sorted(Counter(s for s in sizes if s > 0).items())
    best: tuple[int, int, dict[int, int]] | None = None
    for j, (largest, count) in enumerate(classes):
        if best is not None and deficit + prefetch_step * largest > best[0]:
            break  # sum(S) >= deficit + p * max(S): larger maxima only cost more
        pool = [*classes[:j], (largest, count - 1)]
        besides = (extra or {}).get(largest, 0)
        got = min_cover(pool, deficit + (prefetch_step - 1) * largest + besides)
        if got is None:
            continue
        rest, num, choice = got
        choice[largest] = choice.get(largest, 0) + 1
        if best is None or (rest + largest, num + 1) < best[:2]:
            best = (rest + largest, num + 1, dict(choice))
    return None if best is None else (best[0], best[2])


@dataclass(slots=True)
class _Unit:
    """One way to offload a layer: the device bytes it frees per position (0: not movable),
    the bytes of its prefetch slot (the unit at the model's width: more than it frees where
    resident weights are kept as stored), and the bytes it keeps in host memory and copies per
    step, as stored (8 bits where so)."""

    movable: list[int]
    slot: list[int]
    stored: list[int]
    num_movable: list[int]  # prefix counts of movable positions
    uniform: int | None  # the one movable size, if there is one
    slot_of: dict[int, int]  # movable size -> the largest slot of a layer that size
    # movable size x -> the largest slot of a layer freeing at most x: what the slots of an
    # offload set whose largest layer frees x are charged (see the module doc)
    slot_upto: dict[int, int]
    stored_of: dict[int, int]  # movable size -> the most stored bytes of a layer that size
    staging_of: dict[int, int]  # movable size -> the most staging bytes of a layer that size
    staging_max: int  # the most any layer of the unit needs: what `staging` charges
    memo: dict

    @classmethod
    def of(
        cls,
        movable: list[int],
        stored: list[int] | None = None,
        staging: list[int] | None = None,
        slot: list[int] | None = None,
    ) -> _Unit:
        slot = list(movable) if slot is None else slot
        stored = list(slot) if stored is None else stored
        staging = [0] * len(movable) if staging is None else staging
        distinct = {s for s in movable if s > 0}
        slot_of: dict[int, int] = {}
        stored_of: dict[int, int] = {}
        staging_of: dict[int, int] = {}
        for size, wide, kept, piece in zip(movable, slot, stored, staging, strict=True):
            if size > 0:
                if wide < size:
                    raise ValueError(f"a slot of {wide} bytes for a layer that frees {size}")
                slot_of[size] = max(slot_of.get(size, 0), wide)
                stored_of[size] = max(stored_of.get(size, 0), kept)
                staging_of[size] = max(staging_of.get(size, 0), piece)
        order = sorted(slot_of)
        slot_upto = dict(zip(order, accumulate((slot_of[s] for s in order), max), strict=True))
        return cls(
            movable,
            slot,
            stored,
            list(accumulate((s > 0 for s in movable), initial=0)),
            distinct.pop() if len(distinct) == 1 else None,
            slot_of,
            slot_upto,
            stored_of,
            staging_of,
            max(staging_of.values(), default=0),
            {},
        )

    def staging(self, size: int, packed: bool) -> int:
        """Device bytes beside the slots for the staging buffer of 8-bit layers (one piece of
        their largest weight) when the largest offloaded layer is of `size`: the most any
        layer of the unit needs, so that it bounds the worker's buffer whichever layers go."""
        return self.staging_max if packed and size in self.staging_of else 0

    def extra(self, size: int, slots: int, packed: bool) -> int:
        """Device bytes an offload set whose largest layer frees `size` needs beside
        `slots` x `size`: the staging buffer, and the slots' excess over what they free."""
        return self.staging(size, packed) + slots * (self.slot_upto[size] - size)

    def cost(self, choice: dict[int, int], packed: bool) -> int:
        """Bytes copied per step (and held in host memory) by `choice` {size: how many}: at
        the model's width (the slot's bytes), or as stored where `packed`."""
        held = self.stored_of if packed else self.slot_of
        return sum(held[size] * num for size, num in choice.items())

    def time_cost(self, choice: dict[int, int], packed: bool, factor: float) -> int:
        """`choice`'s transfer in link bytes: what it copies, and dequantizing its 8-bit
        layers at `factor` link bytes per full-width byte (`NodeLimits.dequant_factor`)."""
        host = self.cost(choice, packed)
        if not packed or not factor:
            return host
        wide = sum(
            self.slot_of[size] * num
            for size, num in choice.items()
            if self.stored_of[size] != self.slot_of[size]
        )
        return host + math.ceil(wide * factor)


class Search:
    """LayerRange of one model on one cluster for a given bottleneck T (see the module doc)."""

    def __init__(
        self,
        sizes: Sequence[int],
        offloadable: Sequence[bool],
        nodes: Sequence[NodeLimits],
        *,
        reserve_bytes: int,
        compute_bytes_per_s: float,
        kv_sizes: Sequence[int] | None = None,
        compute_sizes: Sequence[int] | None = None,
        units: Sequence[Sequence[int]] = (),
        offload_sizes: Sequence[int] | None = None,
        stored_units: Sequence[Sequence[int]] | None = None,
        staging_units: Sequence[Sequence[int]] | None = None,
        slot_units: Sequence[Sequence[int]] | None = None,
        jit_bytes: int = 0,
    ) -> None:
        """`kv_sizes`: device bytes each layer needs besides its weights and never offloads
        (its reserved KV cache); they count against the GPU's memory wherever the layer is.
        `compute_sizes`: the weight bytes a step computes through per layer (default: all of
        them; an embedding is looked up, not multiplied), over the node's rate its time.
        `units`: smaller ways to offload a layer, each the bytes it moves per layer (a layer's
        MLP, say: the rest of it stays resident, and its prefetch slot is that size). A GPU's
        range offloads by one unit: the one moving the fewest bytes (ties: the earlier unit);
        the whole layer (`offloadable`) is the last unit, moving `offload_sizes` (default:
        `sizes`; less where a layer has buffers, which stay on the device). `slot_units`: per
        unit (the whole layer last) the bytes of each layer's prefetch slot, where that is
        more than what offloading it frees (resident weights kept as stored: the slot holds
        the unit at the model's width); default: the same. `stored_units`: likewise the bytes
        each layer keeps in host memory when offloaded so, where that differs from its slot
        (8-bit offloaded weights, on the nodes whose `NodeLimits.packed`); default: the same.
        `staging_units`: likewise the device bytes of the staging buffer such a layer needs
        beside the slots (default 0). `jit_bytes`: the buffer resident weights kept as stored
        are dequantized into just in time, charged with the reserve on every GPU that holds
        a layer."""
        self.num_layers = len(sizes)
        self.nodes = tuple(nodes)
        self.jit_bytes = jit_bytes
        self.reserve_bytes = reserve_bytes + jit_bytes  # what every used GPU keeps besides
        self.compute_bytes_per_s = compute_bytes_per_s
        self.rates = [n.compute_bytes_per_s or compute_bytes_per_s for n in self.nodes]
        self.prefix = list(accumulate(sizes, initial=0))
        self.work = list(accumulate(sizes if compute_sizes is None else compute_sizes, initial=0))
        self.kv_prefix = list(accumulate(kv_sizes or [0] * len(sizes), initial=0))
        # weights + KV per prefix: what a range needs on the device with nothing offloaded
        self.device_prefix = [w + k for w, k in zip(self.prefix, self.kv_prefix, strict=True)]
        moved = sizes if offload_sizes is None else offload_sizes
        whole = [s if ok and s > 0 else 0 for s, ok in zip(moved, offloadable, strict=True)]
        movables = [
            [max(0, b) if w else 0 for b, w in zip(unit, whole, strict=True)] for unit in units
        ] + [whole]
        slot = list(slot_units) if slot_units is not None else movables
        stored = list(stored_units) if stored_units is not None else slot
        staging = (
            list(staging_units) if staging_units is not None else [[0] * len(sizes)] * len(movables)
        )
        if not len(slot) == len(stored) == len(staging) == len(movables):
            raise ValueError(
                f"{len(slot)} slot, {len(stored)} stored and {len(staging)} staging size lists "
                f"for {len(movables)} units"
            )
        self.units = [
            _Unit.of(
                m,
                [k if b else 0 for k, b in zip(kept, m, strict=True)],
                [p if b else 0 for p, b in zip(piece, m, strict=True)],
                [w if b else 0 for w, b in zip(wide, m, strict=True)],
            )
            for m, wide, kept, piece in zip(movables, slot, stored, staging, strict=True)
        ]

    # -- one range on one GPU ------------------------------------------------------------------

    def _unit_choice(
        self, u: int, start: int, end: int, deficit: int, slots: int, packed: bool
    ) -> tuple[int, dict[int, int]] | None:
        """(bytes copied per step, {size: how many}) of the fewest bytes of unit `u` among
        [start, end) that free `deficit` device bytes beside `slots` slots; None: too few."""
        unit = self.units[u]
        if unit.uniform is not None:  # equal sizes: k * s - p * slot - staging >= deficit
            size = unit.uniform
            num = slots + -(-(deficit + unit.extra(size, slots, packed)) // size)
            if num > unit.num_movable[end] - unit.num_movable[start]:
                return None
            return unit.cost({size: num}, packed), {size: num}
        key = (start, end, deficit, slots, packed)
        if key not in unit.memo:
            extra = {size: unit.extra(size, slots, packed) for size in unit.stored_of}
            got = min_offload(unit.movable[start:end], deficit, slots, extra)
            unit.memo[key] = None if got is None else (unit.cost(got[1], packed), got[1])
        return unit.memo[key]

    def _choice(
        self, start: int, end: int, memory_bytes: int, slots: int, packed: bool = False
    ) -> tuple[int, dict[int, int], int] | None:
        """(bytes copied per step, {size: how many}, unit) of the cheapest unit; None: none
        fits."""
        deficit = (
            self.device_prefix[end] - self.device_prefix[start] + self.reserve_bytes - memory_bytes
        )
        if deficit <= 0:
            return 0, {}, len(self.units) - 1
        best = None
        for u in range(len(self.units)):
            got = self._unit_choice(u, start, end, deficit, slots, packed)
            if got is not None and (best is None or got[0] < best[0]):
                best = (*got, u)
        return best

    def offload_bytes(
        self,
        start: int,
        end: int,
        memory_bytes: int,
        slots: int,
        packed: bool = False,
        factor: float = 0.0,
    ) -> int | None:
        """Minimal bytes offloaded (as stored: what each step copies) for layers [start, end)
        on a GPU with `slots` prefetch slots when it offloads, plus their dequantization in
        link bytes (`factor`); None if they cannot fit."""
        choice = self._choice(start, end, memory_bytes, slots, packed)
        if choice is None:
            return None
        return self.units[choice[2]].time_cost(choice[1], packed, factor)

    def offloaded_positions(
        self, start: int, end: int, memory_bytes: int, slots: int, packed: bool = False
    ) -> tuple[int, list[int]]:
        """Which unit (index into `units`, the last: whole layers) and which layers to offload:
        per size class, spread evenly through the range so that compute sits between the
        copies (e.g. every other layer when half are offloaded)."""
        choice = self._choice(start, end, memory_bytes, slots, packed)
        assert choice is not None, "offloaded_positions of an infeasible range"
        movable = self.units[choice[2]].movable
        chosen: list[int] = []
        for size, num in choice[1].items():
            same = [i for i in range(start, end) if movable[i] == size]
            chosen += [same[(2 * i + 1) * len(same) // (2 * num)] for i in range(num)]
        return choice[2], sorted(chosen)

    def _fits(
        self,
        start: int,
        memory_bytes: int,
        weight_cap: int,
        offload_cap: int,
        slots: int,
        packed: bool = False,
        factor: float = 0.0,
        time_cap: int = 0,
    ) -> list[tuple[int, int]]:
        """(end, offloaded bytes) for the furthest end with nothing offloaded, then for each
        further end that still fits. Offloaded bytes never decrease with the end (step 1), so
        the scan stops at the first misfit. The hot loop of the search: equal sizes inline.
        With a dequantization `factor`, the transfer in link bytes (`_Unit.time_cost`) must
        also stay within `time_cap`."""
        work, base = self.work, self.work[start]
        device, device_base = self.device_prefix, self.device_prefix[start]
        room = memory_bytes - self.reserve_bytes
        if room < 0:
            return [(start, 0)]
        end = max(
            start,
            min(
                bisect_right(work, base + weight_cap, lo=start),
                bisect_right(device, device_base + room, lo=start),
            )
            - 1,
        )
        fits = [(end, 0)]
        units = self.units
        while end < self.num_layers and work[end + 1] - base <= weight_cap:
            deficit = device[end + 1] - device_base - room
            cost = picked = None
            for u, unit in enumerate(units):
                size = unit.uniform
                if size is not None:  # k * s - p * slot - staging >= deficit, see min_offload
                    extra = unit.extra(size, slots, packed)
                    num = slots + (deficit + extra + size - 1) // size
                    if num > unit.num_movable[end + 1] - unit.num_movable[start]:
                        continue
                    got = num * (unit.stored_of if packed else unit.slot_of)[size]
                    chosen = (unit, {size: num})
                else:
                    choice = self._unit_choice(u, start, end + 1, deficit, slots, packed)
                    if choice is None:
                        continue
                    got, chosen = choice[0], (unit, choice[1])
                if cost is None or got < cost:
                    cost, picked = got, chosen
            if cost is None or cost > offload_cap:
                break
            if factor and picked[0].time_cost(picked[1], packed, factor) > time_cap:
                break
            end += 1
            fits.append((end, cost))
        return fits

    # -- one node ------------------------------------------------------------------------------

    def _node_reach(
        self, node: NodeLimits, start: int, weight_cap: int, offload_cap: int, time_cap: int = 0
    ) -> tuple[int, list[tuple[int, int]]]:
        """Furthest layer the node's GPUs can cover from `start`, and their ranges."""
        ranges: list[tuple[int, int]] = []
        pos, used = start, 0
        factor = node.dequant_factor if node.packed else 0.0
        for memory in node.gpu_memory_bytes:  # per-GPU greedy, host budget ignored
            end, cost = self._fits(
                pos, memory, weight_cap, offload_cap, node.slots, node.packed, factor, time_cap
            )[-1]
            ranges.append((pos, end))
            pos, used = end, used + cost
        if used <= node.offload_budget_bytes:
            return pos, ranges

        # The budget binds: Pareto front {position: least host bytes}, one step per GPU.
        front = {start: 0}
        parents: list[dict[int, int]] = []
        for memory in node.gpu_memory_bytes:
            best: dict[int, tuple[int, int]] = {}  # end -> (host bytes, start)
            for begin, cost in front.items():
                cap = min(offload_cap, node.offload_budget_bytes - cost)
                fits = self._fits(
                    begin, memory, weight_cap, cap, node.slots, node.packed, factor, time_cap
                )
                for end, extra in [(begin, 0), *fits]:
                    if end not in best or cost + extra < best[end][0]:  # (begin, 0): GPU unused
                        best[end] = (cost + extra, begin)
            front, parent, least = {}, {}, None
            for end in sorted(best, reverse=True):  # keep only undominated states
                cost, begin = best[end]
                if least is None or cost < least:
                    front[end], parent[end], least = cost, begin, cost
            parents.append(parent)
        pos = end = max(front)
        ranges = []
        for parent in reversed(parents):
            ranges.append((parent[end], end))
            end = parent[end]
        return pos, ranges[::-1]

    # -- the whole pipeline --------------------------------------------------------------------

    def _caps(self, t_s: float) -> tuple[list[int], list[int]]:
        """Per node: the weight bytes a stage may compute and the bytes it may copy in t_s."""
        return [byte_cap(t_s, rate) for rate in self.rates], [
            min(byte_cap(t_s, n.link_bytes_per_s), n.offload_budget_bytes) for n in self.nodes
        ]

    def place(self, t_s: float) -> tuple[int, list[LayerRange]]:
        """Furthest layer reachable with every stage time <= t_s, and the stages that reach it."""
        weight_caps, offload_caps = self._caps(t_s)
        pos, placements = 0, []
        for n, node in enumerate(self.nodes):
            if pos == self.num_layers:
                break
            time_cap = byte_cap(t_s, node.link_bytes_per_s)
            pos, ranges = self._node_reach(node, pos, weight_caps[n], offload_caps[n], time_cap)
            placements += [LayerRange(n, g, a, b) for g, (a, b) in enumerate(ranges) if b > a]
        return pos, placements

    def _next_change(self, t_s: float) -> float:
        """The smallest time above t_s at which a byte cap grows: every time in between gives
        the same caps, hence the same answer."""
        weight_caps, offload_caps = self._caps(t_s)
        times = [(cap + 1) / rate for cap, rate in zip(weight_caps, self.rates, strict=True)]
        for node, cap in zip(self.nodes, offload_caps, strict=True):
            if cap < node.offload_budget_bytes:
                times.append((cap + 1) / node.link_bytes_per_s)
            elif node.packed and node.dequant_factor:  # the transfer cap alone still grows
                time_cap = byte_cap(t_s, node.link_bytes_per_s)
                if time_cap < _UNLIMITED:
                    times.append((time_cap + 1) / node.link_bytes_per_s)
        return min(times)

    def solve(self) -> tuple[int, list[LayerRange]]:
        """The placement with the smallest bottleneck; if even unlimited time does not place
        every layer, how far it got and the stages that got there."""
        reached, best = self.place(math.inf)  # memory and budgets only
        if reached < self.num_layers:
            return reached, best
        # Bisect over float bit patterns: below `lo` nothing fits (the largest layer's compute
        # time alone exceeds it); `hi` is the bottleneck of a plan in hand. A feasible probe
        # lowers `hi` to the bottleneck of the plan it found (<= the probe), and is followed by
        # a probe just below that: the found bottleneck is often already the optimum, which
        # this proves at once instead of creeping up to it from below. At most two such probes
        # in a row, so the number of probes stays logarithmic. An infeasible probe raises `lo`
        # to just below the next time at which a byte cap changes.
        biggest = max(b - a for a, b in pairwise(self.work))
        lo = float_bits(biggest / max(self.rates)) - 1
        hi = float_bits(self.bottleneck_s(best))
        feasible = 0  # feasible probes in a row: the 1st and 2nd are followed by a check
        while hi - lo > 1:
            mid = hi - 1 if feasible % 3 else (lo + hi) // 2
            reached, placements = self.place(bits_float(mid))
            if reached == self.num_layers:
                best, hi = placements, float_bits(self.bottleneck_s(placements))
                feasible += 1
            else:
                lo, feasible = max(mid, float_bits(self._next_change(bits_float(mid))) - 1), 0
        return self.num_layers, best

    def stage_times(self, p: LayerRange) -> tuple[float, float]:
        node = self.nodes[p.node]
        offloaded = self.offload_bytes(
            p.start,
            p.end,
            node.gpu_memory_bytes[p.gpu],
            node.slots,
            node.packed,
            node.dequant_factor if node.packed else 0.0,
        )
        assert offloaded is not None
        work = self.work[p.end] - self.work[p.start]
        return work / self.rates[p.node], offloaded / node.link_bytes_per_s

    def bottleneck_s(self, placements: Sequence[LayerRange]) -> float:
        return max((max(self.stage_times(p)) for p in placements), default=0.0)
