"""The throughput objective: the batch size, the number of micro-batches and the placement that
give the most decode tokens/s, optionally within a per-token latency bound.

For each batch size B in `BATCHES` (up to what fits: a larger batch's KV pool may push
weights off the GPUs, or not fit at all; the pool holds B sequences of the expected length,
`PlanOptions.pool_for`, and always one of max_seq_len) and each number of micro-batches k (rows per stage
step ceil(B / k); of the k with equal rows only the fewest matter, as more only lengthen the
cycle), the placement with the shortest decode cycle (`coordinator.planning.cycle`): tokens/s
= B / cycle, and the cycle is each sequence's time between two tokens, which
`max_token_latency_s` bounds. Each node's compute rate is read at the rows a step computes,
from its probe's timing of the model's own decoder layer. A (B, k) whose upper bound (every
weight computed once at the fastest rate; a stage at least 1/G of them) cannot beat the best
so far is skipped without planning. Ties go to the smaller batch, then fewer micro-batches.
Pure, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from coordinator.planning import planner
from coordinator.planning.checkpoint import LayerSpec
from coordinator.planning.formats import format_seconds
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import Plan
from coordinator.planning.pool import Lengths, choose_pool
from coordinator.planning.snapshot import ClusterSnapshot
from offload.errors import PlanError

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def micro_batch_counts(max_batch: int, num_gpus: int) -> list[int]:
    """k = 1..min(max_batch, num_gpus), the fewest per distinct rows ceil(max_batch / k)."""
    counts, seen = [], set()
    for k in range(1, min(max_batch, num_gpus) + 1):
        rows = -(-max_batch // k)
        if rows not in seen:
            seen.add(rows)
            counts.append(k)
    return counts


def _upper_bound(work_bytes: int, cluster: ClusterSnapshot, options: PlanOptions) -> float:
    """Tokens/s no placement of these options exceeds (see the module doc); `work_bytes`: the
    weight bytes a step computes through."""
    rates = [
        node.compute_rate(options.rows_per_step)[0] or options.compute_bytes_per_s
        for node in cluster.nodes
    ]
    gpus = sum(len(node.gpus) for node in cluster.nodes)
    total = work_bytes / max(rates)
    overhead = options.step_overhead_s
    least = max(total + overhead, options.micro_batches * (total / gpus + overhead))
    return options.max_batch / least if least > 0 else float("inf")


def best_plans(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    *,
    batches: Sequence[int] = BATCHES,
    micro_batches: int = 0,
    max_token_latency_s: float = 0.0,
    prune: bool = True,
) -> dict[int, Plan]:
    """Per batch size that fits: its best plan over the micro-batch counts (or `micro_batches`
    when given) within the latency bound (0: none); every plan here has objective throughput.
    `prune`: skip what cannot beat the best so far (then a batch may be missing: for the
    choice only; a curve of every batch size plans them all)."""
    options = dataclasses.replace(options, objective="throughput")
    num_gpus = sum(len(node.gpus) for node in cluster.nodes)
    best: dict[int, Plan] = {}
    memo: dict = {}  # one bottleneck search per distinct KV cache and rates
    work = sum(planner.compute_bytes(layer) for layer in layers)
    top = 0.0  # the best tokens/s so far, for the bound
    if options.kv_tokens:  # a given pool: no more sequences than it holds at the expected length
        held = options.sequences_held(options.expected_len)
        batches = [b for b in batches if b <= held] or [min(batches)]
    for batch in sorted(set(batches)):
        counts = [micro_batches] if micro_batches else micro_batch_counts(batch, num_gpus)
        for k in counts:
            opts = dataclasses.replace(
                options, max_batch=batch, micro_batches=k, kv_tokens=options.pool_for(batch)
            )
            if prune and _upper_bound(work, cluster, opts) <= top:
                continue
            try:
                the_plan = planner.plan(layers, cluster, opts, memo=memo)
            except PlanError:
                # Whether a plan fits depends on the KV cache, not on k: neither this batch
                # nor a larger one fits.
                return best
            if max_token_latency_s and the_plan.cycle_s > max_token_latency_s:
                continue
            if batch not in best or the_plan.tokens_per_s > best[batch].tokens_per_s:
                best[batch] = the_plan
                top = max(top, the_plan.tokens_per_s)
    return best


def choose(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    *,
    batches: Sequence[int] = BATCHES,
    micro_batches: int = 0,
    max_token_latency_s: float = 0.0,
    lengths: Lengths | None = None,
) -> Plan:
    """The plan with the most predicted decode tokens/s (see the module doc), its KV pool then
    chosen by the cost model (`pool.choose_pool`, for `lengths` where traffic brought them;
    not where `options.kv_tokens` gives it). A given batch
    (`batches` of one size, no latency bound) that does not fit is taken as a cap
    (`pool.capped`: its slots with the largest pool the budget leaves). PlanError when nothing fits, or nothing meets the latency bound (naming the
    shortest cycle there is)."""
    plans = best_plans(
        layers,
        cluster,
        options,
        batches=batches,
        micro_batches=micro_batches,
        max_token_latency_s=max_token_latency_s,
    )
    if plans:
        best = max(
            plans.values(),
            key=lambda p: (p.tokens_per_s, -p.options.max_batch, -p.options.micro_batches),
        )
        if options.kv_tokens or not options.max_seq_len:  # a pool given (or none): kept
            return best
        choice = choose_pool(layers, cluster, best.options, best.options.pool_tokens, lengths)
        return dataclasses.replace(choice.plan, pool_note=choice.text())
    if max_token_latency_s:
        unbounded = best_plans(
            layers, cluster, options, batches=[min(batches)], micro_batches=micro_batches
        )
        if unbounded:
            fastest = next(iter(unbounded.values()))
            raise PlanError(
                f"no plan meets --max-token-latency {format_seconds(max_token_latency_s)}: the "
                f"shortest time between tokens is {format_seconds(fastest.cycle_s)} (max_batch "
                f"{fastest.options.max_batch}); raise the bound, or add GPUs or memory"
            )
    # Nothing fits: the smallest batch's own error says why, with the numbers.
    smallest = min(batches)
    planner.plan(
        layers,
        cluster,
        dataclasses.replace(options, max_batch=smallest, kv_tokens=options.pool_for(smallest)),
    )
    raise AssertionError("unreachable: the smallest batch was planned above")


def curve_text(plans: dict[int, Plan], batches: Sequence[int] = BATCHES) -> str:
    """Predicted tokens/s per batch size ('-': does not fit or misses the latency bound)."""
    cells = []
    for batch in batches:
        p = plans.get(batch)
        cells.append(
            f"{batch}: -"
            if p is None
            else f"{batch}: {p.tokens_per_s:.1f} (k={p.options.micro_batches})"
        )
    return (
        "predicted decode tokens/s by max_batch (k: micro-batches; '-': does not fit): "
        + ", ".join(cells)
    )
