"""The KV pool beside the weights: the largest pool (in whole blocks) whose plan offloads no
more weight bytes than the least pool the job asks for (`largest_pool`), and the pool a given
max_batch gets when even offloading cannot make room for its sequences (`capped`: the batch is
a cap, as vLLM takes max_num_seqs). Used by `batch_size` (a job's pool and batch) and
`throughput` (a given batch that does not fit). Pure, no Ray.
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
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for


def offloaded_bytes(the_plan: Plan) -> int:
    return sum(s.offloaded_bytes for s in the_plan.stages)


def largest_pool(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    cap_tokens: int,
    floor_tokens: int = 0,
) -> tuple[int, Plan]:
    """(pool tokens, its plan): the largest pool in whole blocks, from `floor_tokens` (at
    least one sequence of max_seq_len) up to `cap_tokens`, whose plan offloads no more weight
    bytes than the floor's. PlanError when not even the floor fits."""
    if options.max_seq_len < 1:
        raise PlanError(
            "sizing the KV pool needs max_seq_len (tokens per sequence): set --max-seq-len"
        )
    low = max(blocks_for(options.max_seq_len), blocks_for(floor_tokens))
    high = max(low, blocks_for(cap_tokens))

    def planned(blocks: int) -> Plan:
        tokens = blocks * DEFAULT_BLOCK_SIZE
        return planner.plan(layers, cluster, dataclasses.replace(options, kv_tokens=tokens))

    best = planned(low)
    floor = offloaded_bytes(best)
    while low < high:  # the answer is in [low, high]; fewer bytes free as the pool grows
        mid = (low + high + 1) // 2
        try:
            candidate = planned(mid)
        except PlanError:
            high = mid - 1
            continue
        if offloaded_bytes(candidate) <= floor:
            low, best = mid, candidate
        else:
            high = mid - 1
    return low * DEFAULT_BLOCK_SIZE, best


def capped(
    layers: Sequence[LayerSpec], cluster: ClusterSnapshot, options: PlanOptions, max_batch: int
) -> tuple[int, int]:
    """(max_batch, pool tokens) for a given max_batch taken as a cap, as vLLM takes
    max_num_seqs, when the pool for max_batch sequences at the expected length cannot fit even
    with weights offloaded: the largest pool beside the weights (`largest_pool`, from one
    sequence of max_seq_len up to max_batch of them) with max_batch slots, the queue and
    preemption doing the rest. Fewer slots only where their per-sequence state (recurrent
    layers) does not fit beside one max_seq_len sequence. PlanError when not even one fits."""
    batch = max_batch
    while True:
        sized = dataclasses.replace(
            options, max_batch=batch, micro_batches=max(options.micro_batches, 1), kv_tokens=0
        )
        cap = batch * blocks_for(options.max_seq_len) * DEFAULT_BLOCK_SIZE
        try:
            return batch, largest_pool(layers, cluster, sized, cap)[0]
        except PlanError:
            if batch == 1:
                raise
            batch = max(1, batch // 2)
