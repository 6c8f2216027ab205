"""max_batch sized from memory: the largest batch whose KV cache fits beside the planned weights
(no more weights offloaded than for one sequence), checked against every batch size."""

from __future__ import annotations

import dataclasses

import pytest
from test_planner import layer

from coordinator.planning.batch_size import AUTO_MAX_BATCH, largest_batch, offloaded_bytes, plan_job
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import plan
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from offload.errors import PlanError
from worker.spec import LayerSpec


def layers(num_decoders: int = 4, decoder_bytes: int = 1000) -> list[LayerSpec]:
    """Embedding and head of 500 bytes, decoders of `decoder_bytes` whose keys and values take
    10 bytes per sequence and token."""
    out = [layer("embed", "embed", 500)]
    out += [
        dataclasses.replace(layer(f"layers.{i}", "decoder", decoder_bytes), kv_bytes_per_token=10)
        for i in range(num_decoders)
    ]
    out.append(layer("head", "head", 500))
    return out


# 4 decoder layers x 10 bytes per token x 32 positions (20 tokens in whole blocks of 16)
PER_SEQUENCE = 4 * 10 * 32


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


def brute_force(specs, snapshot, options) -> int:
    floor = offloaded_bytes(
        plan(specs, snapshot, PlanOptions(max_seq_len=options.max_seq_len, max_batch=1))
    )
    best = 1
    for batch in range(1, AUTO_MAX_BATCH + 1):
        try:
            candidate = plan(
                specs, snapshot, PlanOptions(max_seq_len=options.max_seq_len, max_batch=batch)
            )
        except PlanError:
            continue
        if offloaded_bytes(candidate) <= floor:
            best = batch
    return best


@pytest.mark.parametrize(
    "memory",
    [
        (5000 + 40 * 20 * 4,),
        (5000 + 7 * 20 * 4 + 5,),
        (3500,),
        (2600, 2600),
        (1800, 4000),
        (9000, 9000),
    ],
)
def test_the_largest_batch_beside_the_weights(memory) -> None:
    specs, options = layers(), PlanOptions(max_seq_len=20)
    batch, sized = largest_batch(specs, cluster(*memory), options)
    assert batch == brute_force(specs, cluster(*memory), options)
    assert sized.options.max_batch == batch
    floor = offloaded_bytes(plan(specs, cluster(*memory), PlanOptions(max_seq_len=20, max_batch=1)))
    assert offloaded_bytes(sized) == floor


def test_all_resident_sizes_the_batch_from_the_free_memory() -> None:
    # 5000 bytes of weights, PER_SEQUENCE bytes of KV per sequence
    batch, _ = largest_batch(
        layers(), cluster(5000 + 7 * PER_SEQUENCE + 5), PlanOptions(max_seq_len=20)
    )
    assert batch == 7
    assert largest_batch(layers(), cluster(10**9), PlanOptions(max_seq_len=20))[0] == AUTO_MAX_BATCH


def test_auto_needs_a_sequence_length_and_one_sequence_that_fits() -> None:
    with pytest.raises(PlanError, match="needs max_seq_len"):
        largest_batch(layers(), cluster(10**6), PlanOptions())
    with pytest.raises(PlanError):
        largest_batch(layers(), cluster(600), PlanOptions(max_seq_len=20))


def test_a_job_config_of_max_batch_0_is_planned_with_the_sized_batch() -> None:
    from types import SimpleNamespace

    from coordinator.config import JobConfig

    index = SimpleNamespace(layers=layers())
    config = JobConfig(checkpoint="x", max_batch=0, max_seq_len=20)
    sized, the_plan = plan_job(config, index, cluster(5000 + 7 * PER_SEQUENCE + 5))
    assert sized.max_batch == 7 == the_plan.options.max_batch
    given = JobConfig(checkpoint="x", max_batch=3, max_seq_len=20)
    assert plan_job(given, index, cluster(10**6))[0] is given


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
