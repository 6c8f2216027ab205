"""The KV pool sized from memory: the largest pool whose plan offloads no more weights than a
pool of one max_seq_len sequence, checked against every pool size; max_batch auto is what it
holds at the expected length; a max_batch whose sequences could not all be max_seq_len long at
once is no longer refused."""

from __future__ import annotations

import dataclasses

import pytest
from test_planner import layer

from coordinator.config import JobConfig
from coordinator.planning.batch_size import AUTO_MAX_BATCH, plan_job
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import plan
from coordinator.planning.pool import largest_pool, offloaded_bytes
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from offload.errors import PlanError
from worker.spec import LayerSpec

BLOCK = 16
PER_TOKEN = 4 * 10  # 4 decoder layers x 10 bytes per token
# a sequence of max_seq_len 20 takes 2 blocks: 32 positions
PER_SEQUENCE = PER_TOKEN * 32


def layers(num_decoders: int = 4, decoder_bytes: int = 1000) -> list[LayerSpec]:
    """Embedding and head of 500 bytes, decoders of `decoder_bytes` whose keys and values take
    10 bytes per token."""
    out = [layer("embed", "embed", 500)]
    out += [
        dataclasses.replace(layer(f"layers.{i}", "decoder", decoder_bytes), kv_bytes_per_token=10)
        for i in range(num_decoders)
    ]
    out.append(layer("head", "head", 500))
    return out


def cluster(*memory: int) -> ClusterSnapshot:
    gpus = tuple(GpuInfo(index=i, memory_bytes=m) for i, m in enumerate(memory))
    return ClusterSnapshot(
        nodes=(
            NodeInfo(
                node_id="n",
                hostname="n",
                gpus=gpus,
                host_budget_bytes=10**9,
                pinned_budget_bytes=10**9,
            ),
        )
    )


def brute_force(specs, snapshot, options, cap_blocks: int) -> int:
    def planned(blocks):
        return plan(specs, snapshot, dataclasses.replace(options, kv_tokens=blocks * BLOCK))

    floor = offloaded_bytes(planned(2))
    best = 2
    for blocks in range(2, cap_blocks + 1):
        try:
            candidate = planned(blocks)
        except PlanError:
            continue
        if offloaded_bytes(candidate) <= floor:
            best = blocks
    return best * BLOCK


@pytest.mark.parametrize(
    "memory",
    [
        (5000 + 40 * PER_SEQUENCE,),
        (5000 + 7 * PER_SEQUENCE + 5,),
        (3500,),
        (2600, 2600),
        (1800, 4000),
        (9000, 9000),
    ],
)
def test_the_largest_pool_beside_the_weights(memory) -> None:
    specs, options = layers(), PlanOptions(max_seq_len=20, max_batch=1)
    cap = 48 * 32  # 48 sequences of max_seq_len
    tokens, sized = largest_pool(specs, cluster(*memory), options, cap)
    assert tokens == brute_force(specs, cluster(*memory), options, cap // BLOCK)
    assert sized.options.pool_tokens == tokens
    floor = plan(specs, cluster(*memory), dataclasses.replace(options, kv_tokens=32))
    assert offloaded_bytes(sized) == offloaded_bytes(floor)


def test_all_resident_sizes_the_pool_from_the_free_memory() -> None:
    """5000 bytes of weights; the free bytes / 40 per token, in whole blocks, up to the cap."""
    options = PlanOptions(max_seq_len=20, max_batch=1)
    free = 7 * PER_SEQUENCE + 5
    tokens, _ = largest_pool(layers(), cluster(5000 + free), options, 10**6)
    assert tokens == free // PER_TOKEN // BLOCK * BLOCK == 7 * 32
    assert largest_pool(layers(), cluster(10**9), options, 96)[0] == 96


def test_a_pool_needs_a_sequence_length_and_one_sequence_that_fits() -> None:
    with pytest.raises(PlanError, match="needs max_seq_len"):
        largest_pool(layers(), cluster(10**6), PlanOptions(), 100)
    with pytest.raises(PlanError):
        largest_pool(layers(), cluster(600), PlanOptions(max_seq_len=20), 100)


def test_a_job_config_is_planned_with_its_pool_and_batch_resolved() -> None:
    """Auto max_batch: the sequences the pool beside all the weights holds at the expected
    length (a quarter of max_seq_len: 5, one block each); the pool then grows as far as the
    cost model finds it cheap (here, with a step overhead of 3 ms and 4 KB of weights, to all
    that fits with every decoder offloaded); a given max_batch: a pool of at most each at
    max_seq_len, and no more than the weights leave; a given pool is kept."""
    from types import SimpleNamespace

    index = SimpleNamespace(layers=layers())
    memory = cluster(5000 + 7 * PER_SEQUENCE + 5)
    auto = JobConfig(checkpoint="x", max_batch=0, max_seq_len=20)
    sized, the_plan = plan_job(auto, index, memory)
    assert sized.max_batch == 14 == the_plan.options.max_batch  # 7 * 32 tokens / 1 block
    # 13965 bytes - 1000 resident - one 1000-byte slot = 11965: 299 tokens, 18 whole blocks
    assert sized.kv_cache_tokens == 18 * BLOCK == the_plan.options.pool_tokens
    assert sum(s.kv_bytes for s in the_plan.stages) == 18 * BLOCK * PER_TOKEN
    assert offloaded_bytes(the_plan) == 4000
    assert "224: " in the_plan.pool_note and "288: " in the_plan.pool_note
    sized, _ = plan_job(auto, index, cluster(10**9))  # room for everything: capped
    assert (sized.max_batch, sized.kv_cache_tokens) == (AUTO_MAX_BATCH, AUTO_MAX_BATCH * 32)
    given = JobConfig(checkpoint="x", max_batch=3, max_seq_len=20)
    sized, the_plan = plan_job(given, index, cluster(10**6))
    assert (sized.max_batch, sized.kv_cache_tokens) == (3, 3 * 32)
    pool = JobConfig(checkpoint="x", max_batch=3, max_seq_len=20, kv_cache_tokens=40)
    sized, the_plan = plan_job(pool, index, cluster(10**6))
    assert sized.kv_cache_tokens == 48 == the_plan.options.pool_tokens  # whole blocks


def test_a_batch_whose_sequences_could_not_all_be_max_seq_len_is_planned() -> None:
    """Memory for 2 sequences of max_seq_len beside the weights and max_batch 8: planned, the
    weights making room for 8 sequences at the expected length (a pool of 8 blocks, 4 of
    max_seq_len), where slots of max_seq_len per sequence were refused; a pool that cannot hold
    one is refused with the numbers."""
    from types import SimpleNamespace

    index = SimpleNamespace(layers=layers())
    memory = cluster(5000 + 2 * PER_SEQUENCE + 5)
    config = JobConfig(checkpoint="x", max_batch=8, max_seq_len=20)
    sized, the_plan = plan_job(config, index, memory)
    assert (sized.max_batch, sized.kv_cache_tokens) == (8, 8 * BLOCK)
    assert offloaded_bytes(the_plan) > 0  # weights offloaded to make room for the batch
    assert "KV pool of 128 tokens per GPU" in the_plan.summary()
    assert "it holds 8 of the expected 5 tokens, 4 of max_seq_len" in the_plan.summary()
    with pytest.raises(PlanError):
        plan_job(config, index, cluster(600))


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_a_given_max_batch_is_a_cap_never_a_reason_to_refuse(objective: str) -> None:
    """Issue 56's serve --max-batch 32 on a budget whose pool holds a few sequences: even
    with every decoder offloaded, 32 sequences at the expected length do not fit. The job
    keeps 32 slots with the largest pool the budget leaves (as vLLM takes max_num_seqs), its
    summary says how many sequences of the expected length it holds; a budget that cannot
    hold one sequence of max_seq_len is still refused."""
    from types import SimpleNamespace

    index = SimpleNamespace(layers=layers())
    memory = cluster(5000 + 3 * PER_SEQUENCE + 5)  # 3 sequences of max_seq_len beside it all
    config = JobConfig(checkpoint="x", max_batch=32, max_seq_len=20, objective=objective)
    options = PlanOptions(max_seq_len=20, max_batch=32, micro_batches=1)
    with pytest.raises(PlanError):  # the pool for 32 at the expected length cannot fit
        plan(layers(), memory, dataclasses.replace(options, kv_tokens=options.pool_for(32)))
    sized, the_plan = plan_job(config, index, memory)
    biggest, _ = largest_pool(layers(), memory, options, 32 * 32)
    assert biggest == 3 * 32  # what the budget leaves: 6 of the expected 5 tokens
    assert (sized.max_batch, sized.kv_cache_tokens) == (32, biggest)
    assert the_plan.options.max_batch == 32 and the_plan.options.pool_tokens == biggest
    held = biggest // BLOCK
    assert f"for up to 32 sequences of up to 20 tokens: it holds {held} of the expected 5" in (
        the_plan.summary()
    )
    if objective == "throughput":  # serve's path: replicas chosen for the most tokens/s
        from coordinator.planning.batch_size import plan_replicas

        chosen = plan_replicas(config, index, memory)
        assert [p.options.max_batch for p in chosen.plans] == [32]
        assert [p.options.pool_tokens for p in chosen.plans] == [biggest]
    from coordinator.cli.text import _pool_words

    assert _pool_words(sized, the_plan).endswith(  # serve's start-up line
        f"(it holds {held} of the expected 5 tokens at once: more wait in the queue, or are "
        "preempted as they grow)"
    )
    with pytest.raises(PlanError):
        plan_job(config, index, cluster(600))


def test_the_predicted_throughput_curve() -> None:
    """Per batch size, its best micro-batch count and placement: tokens/s = max_batch / cycle;
    a batch whose KV cache does not fit is '-', and so is every larger one."""
    from coordinator.planning.throughput import best_plans, curve_text

    specs, snap = layers(), cluster(5000 + 7 * PER_SEQUENCE + 5, 5000)
    options = PlanOptions(max_seq_len=20, compute_bytes_per_s=1000.0, step_overhead_s=0.0)
    curve = best_plans(specs, snap, options, batches=(1, 4, 1000, 2000), prune=False)
    assert sorted(curve) == [1, 4]
    for batch, the_plan in curve.items():
        times = [s.time_s for s in the_plan.stages]
        k = the_plan.options.micro_batches
        assert the_plan.tokens_per_s == batch / max(sum(times), k * max(times))
    assert curve[4].tokens_per_s > curve[1].tokens_per_s  # the same weights, more rows a step
    assert curve_text(curve, (1, 4, 1000)).endswith(
        f"1: {curve[1].tokens_per_s:.1f} (k=1), 4: {curve[4].tokens_per_s:.1f} "
        f"(k={curve[4].options.micro_batches}), 1000: -"
    )
