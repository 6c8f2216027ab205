"""How many sequences a job can generate at once: the largest `max_batch` whose KV cache fits
beside the planned weights.

"Beside the weights" means the batch takes only memory the weights leave free: the plan for
that batch offloads no more weight bytes than the plan for a batch of one. A larger batch would
pay for its KV cache by moving more weights to the host every step; whether that trade is worth
it is a throughput question (the planner of issue 17), not a sizing default. Capped at
AUTO_MAX_BATCH: past it, a step's activations and sampling grow while the offloaded bytes per
token barely shrink (1/N). Pure, no Ray: `launch`, `offloadctl plan` and `serve` use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from coordinator.planning import planner
from coordinator.planning.checkpoint import LayerSpec
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import Plan
from coordinator.planning.snapshot import ClusterSnapshot
from offload.errors import PlanError

AUTO_MAX_BATCH = 64


def offloaded_bytes(the_plan: Plan) -> int:
    return sum(s.offloaded_bytes for s in the_plan.stages)


def largest_batch(layers: Sequence[LayerSpec], cluster: ClusterSnapshot, options: PlanOptions,
                  cap: int = AUTO_MAX_BATCH) -> tuple[int, Plan]:  # fmt: skip
    """(max_batch, its plan): the largest batch up to `cap` whose plan offloads no more weight
    bytes than a batch of one does. PlanError when not even one sequence fits."""
    if options.max_seq_len < 1:
        raise PlanError("sizing max_batch from memory needs max_seq_len (tokens per sequence): "
                        "set --max-seq-len, or give --max-batch")  # fmt: skip
    if cap < 1:
        raise PlanError(f"cap={cap} must be >= 1")
    best = planner.plan(layers, cluster, dataclasses.replace(options, max_batch=1))
    floor = offloaded_bytes(best)
    low, high = 1, cap  # the answer is in [low, high]; fewer bytes free per sequence as it grows
    while low < high:
        mid = (low + high + 1) // 2
        try:
            candidate = planner.plan(layers, cluster, dataclasses.replace(options, max_batch=mid))
        except PlanError:
            high = mid - 1
            continue
        if offloaded_bytes(candidate) <= floor:
            low, best = mid, candidate
        else:
            high = mid - 1
    return low, best


def plan_job(config, index, snapshot: ClusterSnapshot):
    """(config, plan) of a job (`coordinator.config.JobConfig`) on `snapshot`: the config's
    max_batch resolved when it is 0 (auto), as `launch` and `offloadctl plan` both plan."""
    if config.max_batch:
        # through the module: tests replace the planner there
        return config, planner.plan(index.layers, snapshot, config.plan_options())
    batch, the_plan = largest_batch(index.layers, snapshot, config.plan_options())
    return dataclasses.replace(config, max_batch=batch), the_plan


CURVE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def predicted_tokens_per_s(the_plan: Plan) -> float:
    """Decode tokens per second the plan's cost model predicts with one micro-batch of
    max_batch sequences: the stages take turns on each step (each overlapping its own copies
    with its compute), so a step takes the sum of their times and yields max_batch tokens."""
    step_s = sum(s.time_s for s in the_plan.stages)
    return the_plan.options.max_batch / step_s if step_s > 0 else 0.0


def throughput_curve(layers: Sequence[LayerSpec], cluster: ClusterSnapshot, options: PlanOptions,
                     batches: Sequence[int] = CURVE_BATCHES) -> list[tuple[int, float | None]]:  # fmt: skip
    """(max_batch, predicted decode tokens/s, None where it does not fit) for each batch size:
    each planned on its own (a larger batch's KV cache may push weights off the GPU, and each
    node's measured compute rate is read at that batch)."""
    curve: list[tuple[int, float | None]] = []
    for batch in batches:
        try:
            the_plan = planner.plan(layers, cluster, dataclasses.replace(options, max_batch=batch))
        except PlanError:
            curve.append((batch, None))
            continue
        curve.append((batch, predicted_tokens_per_s(the_plan)))
    return curve


def curve_text(curve: list[tuple[int, float | None]]) -> str:
    cells = [f"{batch}: {'-' if rate is None else f'{rate:.1f}'}" for batch, rate in curve]
    return ("predicted decode tokens/s by max_batch (one micro-batch; '-': does not fit): "
            + ", ".join(cells))
