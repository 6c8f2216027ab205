"""The KV pool and the batch a job runs: how many tokens of keys and values each GPU keeps
beside its weights, and how many sequences run at once.

The pool is what the weights leave free: the largest pool whose plan offloads no more weight
bytes than the least pool the job asks for, up to room for every sequence at max_seq_len (more
could never be used). The least pool: a given `--max-batch` of sequences at the expected length
(the weights make room for the batch asked for), else one sequence of `max_seq_len` (the least a
job can generate with). A larger pool would pay for its
tokens by moving more weights to the host every step; whether that trade is worth it is a
throughput question (`--objective throughput`, planning/throughput.py, which sizes each batch's
pool for its sequences at the expected length). `--kv-cache-tokens` sets the pool instead.
Sequences take the pool's blocks as they grow, so `max_batch` (sequences at once, vLLM's
max_num_seqs) may exceed pool / max_seq_len; a given one is a cap, never a reason to refuse:
when even offloading cannot make room for its pool, the job gets the largest pool the budget
leaves (`capped`) and the queue and preemption do the rest. Auto, it is what the pool holds at
the expected length (`--expected-seq-len`, default a quarter of max_seq_len), capped at AUTO_MAX_BATCH (past
it, a step's activations and sampling grow while the offloaded bytes per token barely shrink).
Pure, no Ray: `launch`, `offloadctl plan` and `serve` use it.
"""

from __future__ import annotations

import dataclasses

from coordinator.planning import planner
from coordinator.planning.options import AUTO_MAX_BATCH, PlanOptions
from coordinator.planning.pool import Lengths, capped, choose_pool, largest_pool
from coordinator.planning.reserve import job_options
from coordinator.planning.snapshot import ClusterSnapshot
from offload.errors import PlanError
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for


def batch_for_pool(pool_tokens: int, options: PlanOptions, cap: int = AUTO_MAX_BATCH) -> int:
    """Sequences a pool holds at the expected length, each in whole blocks: auto max_batch
    (1..cap)."""
    return max(1, min(cap, options.sequences_held(options.expected_len, pool_tokens)))


def plan_job(config, index, snapshot: ClusterSnapshot, lengths: Lengths | None = None):
    """(config, plan) of a job (`coordinator.config.JobConfig`) on `snapshot`, as `launch` and
    `offloadctl plan` both plan, with the KV pool (`kv_cache_tokens`) and max_batch resolved in
    the config returned, so that a re-plan keeps them. Objective throughput: max_batch (when
    0, auto) and micro_batches (when 0) are chosen for the most tokens/s
    (`coordinator.planning.throughput`), each batch with a pool for its sequences at the
    expected length. Objective latency: the pool is a given max_batch at the expected length
    and what the weights leave beside it (or `kv_cache_tokens`), and max_batch 0 is what the
    weights leave beside one max_seq_len sequence holds at the expected length. Either way the
    pool then grows by the cost model (`pool.choose_pool`: for `lengths` where traffic brought
    them, else to hold every sequence to max_seq_len where that costs little), unless it is
    given or is already all the budget leaves."""
    options = job_options(config, index, snapshot)
    if config.objective == "throughput":
        from coordinator.planning.throughput import choose

        try:
            the_plan = choose(
                index.layers, snapshot, options, **_search_space(config), lengths=lengths
            )
        except PlanError as exc:  # a given max_batch is a cap, never a reason to refuse
            capped_options = _capped_options(config, index, snapshot, options, exc)
            space = {**_search_space(config), "batches": [capped_options.max_batch]}
            the_plan = choose(index.layers, snapshot, capped_options, **space)
        chosen = the_plan.options
        return dataclasses.replace(
            config,
            max_batch=chosen.max_batch,
            micro_batches=chosen.micro_batches,
            kv_cache_tokens=chosen.pool_tokens,
        ), the_plan
    if not config.max_seq_len:  # no generation: no pool
        if not config.max_batch:
            raise PlanError(
                "sizing max_batch from memory needs max_seq_len (tokens per sequence): "
                "set --max-seq-len, or give --max-batch"
            )
        return config, planner.plan(index.layers, snapshot, options)
    capped_pool = bool(config.kv_cache_tokens)  # the pool given, or all the budget leaves
    if config.kv_cache_tokens:
        tokens = options.pool_tokens
    else:  # a given batch at the expected length, and what the weights leave beside it
        batch = config.max_batch or AUTO_MAX_BATCH
        cap = batch * blocks_for(config.max_seq_len) * DEFAULT_BLOCK_SIZE
        floor = options.pool_for(config.max_batch) if config.max_batch else 0
        sized = dataclasses.replace(options, max_batch=config.max_batch or 1)
        try:
            tokens, _ = largest_pool(index.layers, snapshot, sized, cap, floor)
        except PlanError:  # a given max_batch is a cap, never a reason to refuse
            if not config.max_batch:
                raise
            batch, tokens = capped(index.layers, snapshot, options, config.max_batch)
            config = dataclasses.replace(config, max_batch=batch)
            capped_pool = True
    batch = config.max_batch or batch_for_pool(tokens, options)
    while True:  # auto: fewer sequences when their recurrent states do not fit beside
        try:
            # through the module: tests replace the planner there
            the_plan = planner.plan(
                index.layers,
                snapshot,
                dataclasses.replace(options, max_batch=batch, kv_tokens=tokens),
            )
            break
        except PlanError:
            if config.max_batch or batch == 1:
                raise
            batch = max(1, batch // 2)
    if not capped_pool:
        choice = choose_pool(index.layers, snapshot, the_plan.options, tokens, lengths)
        the_plan = dataclasses.replace(choice.plan, pool_note=choice.text())
        tokens = choice.tokens
    return dataclasses.replace(config, max_batch=batch, kv_cache_tokens=tokens), the_plan


def plan_replicas(config, index, snapshot: ClusterSnapshot):
    """The job's pipelines (`config.replicas`; 0: the count with the most tokens/s), each with
    its plan (`coordinator.planning.replicas.Replicas`), as `serve` launches and `offloadctl
    plan` shows them."""
    from coordinator.planning.replicas import choose_replicas

    options = job_options(config, index, snapshot)
    try:
        return choose_replicas(
            index.layers, snapshot, options, replicas=config.replicas, **_search_space(config)
        )
    except PlanError as exc:  # a given max_batch is a cap, never a reason to refuse
        capped_options = _capped_options(config, index, snapshot, options, exc)
        space = {**_search_space(config), "batches": [capped_options.max_batch]}
        return choose_replicas(
            index.layers, snapshot, capped_options, replicas=config.replicas, **space
        )


def _capped_options(
    config, index, snapshot: ClusterSnapshot, options: PlanOptions, error: PlanError
) -> PlanOptions:
    """The options of a throughput job whose given max_batch does not fit with its pool at the
    expected length: the batch as a cap (`pool.capped`) with the largest pool the budget
    leaves on the whole cluster. Raises `error` (the search's) when the batch is not given
    (auto: nothing fits at all), a pool or a latency bound is, or generation is off; a
    PlanError of its own when not even one sequence fits."""
    if not config.max_batch or config.kv_cache_tokens or config.max_token_latency_s:
        raise error
    if not config.max_seq_len:
        raise error
    batch, tokens = capped(index.layers, snapshot, options, config.max_batch)
    return dataclasses.replace(options, max_batch=batch, kv_tokens=tokens)


def _search_space(config) -> dict:
    """What a job gives the throughput search: its batch (every size in BATCHES when auto), its
    micro-batches (0: every count) and its latency bound."""
    from coordinator.planning.throughput import BATCHES

    return {
        "batches": [config.max_batch] if config.max_batch else BATCHES,
        "micro_batches": config.micro_batches,
        "max_token_latency_s": config.max_token_latency_s,
    }
