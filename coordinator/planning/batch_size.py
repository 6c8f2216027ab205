"""How many sequences a job can generate at once: the largest `max_batch` whose KV cache fits
beside the planned weights.

"Beside the weights" means the batch takes only memory the weights leave free: the plan for
that batch offloads no more weight bytes than the plan for a batch of one. A larger batch would
pay for its KV cache by moving more weights to the host every step; whether that trade is worth
it is a throughput question (`--objective throughput`, planning/throughput.py). Capped at
AUTO_MAX_BATCH: past it, a step's activations and sampling grow while the offloaded bytes per
token barely shrink (1/N). Pure, no Ray: `launch`, `offloadctl plan` and `serve` use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from coordinator.planning import planner
from coordinator.planning.checkpoint import LayerSpec
from coordinator.planning.options import AUTO_MAX_BATCH, PlanOptions
from coordinator.planning.planner import Plan
from coordinator.planning.reserve import job_options
from coordinator.planning.snapshot import ClusterSnapshot
from offload.errors import PlanError


def offloaded_bytes(the_plan: Plan) -> int:
    return sum(s.offloaded_bytes for s in the_plan.stages)


def largest_batch(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    cap: int = AUTO_MAX_BATCH,
) -> tuple[int, Plan]:
    """(max_batch, its plan): the largest batch up to `cap` whose plan offloads no more weight
    bytes than a batch of one does. PlanError when not even one sequence fits."""
    if options.max_seq_len < 1:
        raise PlanError(
            "sizing max_batch from memory needs max_seq_len (tokens per sequence): "
            "set --max-seq-len, or give --max-batch"
        )
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
    """(config, plan) of a job (`coordinator.config.JobConfig`) on `snapshot`, as `launch` and
    `offloadctl plan` both plan. Objective throughput: max_batch (when 0, auto) and
    micro_batches (when 0) are chosen for the most tokens/s (`coordinator.planning.throughput`)
    and set in the config returned, so that a re-plan keeps them. Objective latency: max_batch
    0 is the largest batch beside the weights."""
    if config.objective == "throughput":
        from coordinator.planning.throughput import choose

        the_plan = choose(
            index.layers, snapshot, job_options(config, index, snapshot), **_search_space(config)
        )
        chosen = the_plan.options
        return dataclasses.replace(
            config, max_batch=chosen.max_batch, micro_batches=chosen.micro_batches
        ), the_plan
    if config.max_batch:
        # through the module: tests replace the planner there
        return config, planner.plan(index.layers, snapshot, job_options(config, index, snapshot))
    batch, the_plan = largest_batch(index.layers, snapshot, job_options(config, index, snapshot))
    return dataclasses.replace(config, max_batch=batch), the_plan


def plan_replicas(config, index, snapshot: ClusterSnapshot):
    """The job's pipelines (`config.replicas`; 0: the count with the most tokens/s), each with
    its plan (`coordinator.planning.replicas.Replicas`), as `serve` launches and `offloadctl
    plan` shows them."""
    from coordinator.planning.replicas import choose_replicas

    return choose_replicas(
        index.layers,
        snapshot,
        job_options(config, index, snapshot),
        replicas=config.replicas,
        **_search_space(config),
    )


def _search_space(config) -> dict:
    """What a job gives the throughput search: its batch (every size in BATCHES when auto), its
    micro-batches (0: every count) and its latency bound."""
    from coordinator.planning.throughput import BATCHES

    return {
        "batches": [config.max_batch] if config.max_batch else BATCHES,
        "micro_batches": config.micro_batches,
        "max_token_latency_s": config.max_token_latency_s,
    }
