"""The throughput objective: the placement with the shortest decode cycle for k micro-batches,
and the (max_batch, micro-batches) choice, each equal to a brute force over the same space on
small clusters (heterogeneous memory, links, compute and host budgets). Pure Python, no Ray."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner import (
    FAST,
    GiB,
    check_invariants,
    cluster,
    feasible_stage_times,
    instances,
    large_cluster,
    model,
)

from coordinator.planning.cycle import min_cycle
from coordinator.planning.planner import PlanError, PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot
from coordinator.planning.throughput import best_plans, choose, micro_batch_counts
from worker.compute_probe import ComputeProfile


def cycle(times: list[float], k: int, overhead: float) -> float:
    """One decode step of k micro-batches: max(one trip through every stage, the slowest
    stage serving all k in turn); written out here, independently of cycle.py."""
    return max(sum(t + overhead for t in times), k * max(t + overhead for t in times))


def brute_cycle(layers, snap: ClusterSnapshot, opts: PlanOptions) -> float | None:
    return min(
        (
            cycle(t, opts.micro_batches, opts.step_overhead_s)
            for t in feasible_stage_times(layers, snap, opts)
        ),
        default=None,
    )


@FAST
@given(instances(), st.integers(1, 4), st.sampled_from([0.0, 0.0, 0.5, 3.0]))
def test_shortest_cycle_matches_brute_force(instance, k, overhead) -> None:
    layers, snap, opts = instance
    opts = dataclasses.replace(
        opts, objective="throughput", micro_batches=k, step_overhead_s=overhead
    )
    expected = brute_cycle(layers, snap, opts)
    if expected is None:
        with pytest.raises(PlanError):
            plan(layers, snap, opts)
        return
    result = plan(layers, snap, opts)
    assert result.cycle_s == expected
    assert result.cycle_bound_s == result.cycle_s  # proven: small enough for the exact DP
    assert result.tokens_per_s == opts.max_batch / expected if opts.max_batch else True
    check_invariants(result, layers, snap)


def test_one_micro_batch_prefers_fewer_stages_to_a_balanced_pipeline() -> None:
    """Two GPUs that each hold everything: the bottleneck split uses both (each stage 5 s),
    but one micro-batch walks both in turn (10 s + 2 overheads): one GPU does it in 10 s + 1.
    With two micro-batches the split's two stages are both busy: 2 x (5 + 1) = 12 < 2 x 11."""
    layers = model([10, 10, 10, 10])
    snap = cluster({"gpus": [100, 100]})
    opts = PlanOptions(compute_bytes_per_s=4.0, step_overhead_s=1.0, max_batch=2)
    assert len(plan(layers, snap, opts).stages) == 2  # latency: the balanced split
    one = plan(layers, snap, dataclasses.replace(opts, objective="throughput"))
    assert (len(one.stages), one.cycle_s) == (1, 11.0)
    two = plan(layers, snap, dataclasses.replace(opts, objective="throughput", micro_batches=2))
    assert (len(two.stages), two.cycle_s) == (2, 12.0)


def test_micro_batch_counts_keep_the_fewest_per_row_count() -> None:
    assert micro_batch_counts(8, 16) == [1, 2, 3, 4, 8]  # rows 8, 4, 3, 2, 1
    assert micro_batch_counts(5, 2) == [1, 2]
    assert micro_batch_counts(1, 8) == [1]


def profile(step_ms: tuple[float, float, float], fixed_ms: float = 0.0) -> ComputeProfile:
    """A measured decoder layer of 10 bytes taking these ms per step of 1, 8 and 32 rows, and
    a stage's step `fixed_ms` more whatever its rows."""
    return ComputeProfile(
        family="llama",
        dtype="float32",
        device="cpu",
        rows=(1, 8, 32),
        layer_s=tuple(t / 1e3 for t in step_ms),
        fixed_s=(fixed_ms / 1e3,) * 3,
        layer_bytes=10,
    )


@st.composite
def throughput_instances(draw):
    """Small clusters whose nodes may carry a measured profile (the rate then depends on the
    rows a step computes), decoders with KV caches, and the batch sizes to choose from."""
    layers, snap, opts = draw(instances(max_gpus=3))
    kv = draw(st.integers(1, 3))
    layers = [
        dataclasses.replace(x, kv_bytes_per_token=kv) if x.kind == "decoder" else x for x in layers
    ]
    nodes = tuple(
        dataclasses.replace(
            n,
            compute_bytes_per_s=None,
            compute=profile(
                draw(st.sampled_from([(1.0, 1.5, 4.0), (2.0, 2.0, 3.0), (1.0, 8.0, 32.0)])),
                draw(st.sampled_from([0.0, 500.0])),
            ),
        )
        if draw(st.booleans())
        else n
        for n in snap.nodes
    )
    opts = dataclasses.replace(
        opts,
        max_seq_len=draw(st.integers(1, 3)),
        step_overhead_s=draw(st.sampled_from([0.0, 0.25])),
    )
    batches = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True))
    return layers, ClusterSnapshot(nodes=nodes), opts, sorted(batches)


def brute_best(
    layers, snap: ClusterSnapshot, opts: PlanOptions, batches, latency: float
) -> float | None:
    """Every batch size x every micro-batch count x every placement: the most tokens/s
    within the latency bound (None: nothing fits it)."""
    num_gpus = sum(len(n.gpus) for n in snap.nodes)
    expected = None
    for batch in batches:
        for k in range(1, min(batch, num_gpus) + 1):
            rows = -(-batch // k)
            # the runtime's overhead and the largest fixed step time the nodes measured
            fixed = max(n.fixed_step_s(rows) for n in snap.nodes)
            o = dataclasses.replace(
                opts, max_batch=batch, micro_batches=k, step_overhead_s=opts.step_overhead_s + fixed
            )
            rated = ClusterSnapshot(
                nodes=tuple(
                    dataclasses.replace(
                        n, compute=None, compute_bytes_per_s=n.compute_rate(rows)[0]
                    )
                    for n in snap.nodes
                )
            )
            best = brute_cycle(layers, rated, o)
            if best is None or (latency and best > latency):
                continue
            expected = max(expected or 0.0, batch / best)
    return expected


@settings(FAST, max_examples=150)
@given(throughput_instances(), st.sampled_from([0.0, 0.0, 3.0, 30.0]))
def test_choice_matches_brute_force(instance, latency) -> None:
    """The choice reaches the brute force's most tokens/s within the latency bound."""
    layers, snap, opts, batches = instance
    expected = brute_best(layers, snap, opts, batches, latency)
    if expected is None:
        with pytest.raises(PlanError):
            choose(layers, snap, opts, batches=batches, max_token_latency_s=latency)
        return
    chosen = choose(layers, snap, opts, batches=batches, max_token_latency_s=latency)
    assert chosen.tokens_per_s == pytest.approx(expected, rel=1e-12)
    assert not latency or chosen.cycle_s <= latency
    assert chosen.options.objective == "throughput"
    # stable: the same inputs give the same plan
    assert choose(layers, snap, opts, batches=batches, max_token_latency_s=latency) == chosen


def test_a_larger_batch_that_pushes_weights_off_can_lose() -> None:
    """One GPU, 4 decoders of 100 bytes, KV of 1 byte per token and layer, 16 tokens (one
    block): batch 4 (256 bytes of KV) still fits beside the weights, batch 8 (512) pushes two
    layers to a slow link, 16 does not fit. The choice stops where the copies cost more than
    the rows gain."""
    layers = [
        dataclasses.replace(x, kv_bytes_per_token=1) if x.kind == "decoder" else x
        for x in model([100] * 4)
    ]
    snap = cluster({"gpus": [200 + 100 + 512], "host": 10_000, "link": 10.0, "compute": 100.0})
    opts = PlanOptions(max_seq_len=16, step_overhead_s=0.5)
    plans = best_plans(layers, snap, opts, batches=(1, 2, 4, 8, 16), prune=False)
    assert [s.offloaded_bytes for s in plans[4].stages] == [0]
    assert plans[8].stages[0].offloaded_bytes == 200 and 16 not in plans
    chosen = choose(layers, snap, opts, batches=(1, 2, 4, 8, 16))
    assert dataclasses.replace(chosen, pool_note="") == plans[4]
    assert chosen.tokens_per_s == 4 / 4.5 > plans[8].tokens_per_s
    # its pool already holds the 4 sequences to max_seq_len (one block each), at no cost
    assert "64: 4.500 s/token, 4.0 at once" in chosen.pool_note


def test_latency_bound_that_nothing_meets_names_the_shortest() -> None:
    layers = model([10, 10])
    snap = cluster({"gpus": [100]})
    opts = PlanOptions(compute_bytes_per_s=10.0, step_overhead_s=0.0)
    with pytest.raises(PlanError, match=r"max-token-latency 500.000 ms.* 2.000 s \(max_batch 1\)"):
        choose(layers, snap, opts, batches=(4, 1, 2), max_token_latency_s=0.5)


def test_thousand_layers_on_512_gpus_for_throughput() -> None:
    """The planner's large case with KV caches and MLPs to offload on their own: every (batch,
    micro-batch) pair is planned or bounded; too large for the exact DP, the plan says how far
    from optimal it can be. Its time: bench/planner.py."""
    layers = [
        dataclasses.replace(x, kv_bytes_per_token=256 * 1024) if x.kind == "decoder" else x
        for x in model([3 * GiB] * 1000, embed=4 * GiB, head=4 * GiB, mlps=[2 * GiB] * 1000)
    ]
    snap = large_cluster()
    chosen = choose(layers, snap, PlanOptions(reserve_bytes=GiB // 2, max_seq_len=64))
    check_invariants(chosen, layers, snap)
    assert chosen.cycle_bound_s <= chosen.cycle_s


def test_min_cycle_of_a_cluster_too_large_for_the_dp_reports_its_bound() -> None:
    from coordinator.planning.search import NodeLimits, Search

    search = Search(
        [10] * 6,
        [True] * 6,
        [NodeLimits((100,) * 3, 0, 1.0)],
        reserve_bytes=0,
        compute_bytes_per_s=1.0,
    )
    exact = min_cycle(search, 1, 1.0)  # one GPU: 60 s + one overhead
    bounded = min_cycle(search, 1, 1.0, dp_limit=1)  # the bottleneck split: 3 x (20 + 1)
    assert (exact.cycle_s, exact.bound_s, len(exact.placements)) == (61.0, 61.0, 1)
    assert (bounded.cycle_s, bounded.bound_s) == (63.0, 61.0)  # not proven: 61 at best


def test_simulated_gpus_share_their_node_cores() -> None:
    """Two GPUs simulated on one CPU with a core to spare for the stages: two micro-batches
    through two stages cannot compute side by side (a cycle of 2 x 4 s, not 2 x 2 s), so one
    micro-batch (4 s) is the better plan; two replicas there share that core and make no more
    than one pipeline. Real GPUs (concurrent_stages None) overlap."""
    from coordinator.planning.replicas import choose_replicas

    layers = model([10] * 4)
    real = cluster({"gpus": [100, 100], "compute": 10.0})
    shared = ClusterSnapshot(nodes=(dataclasses.replace(real.nodes[0], concurrent_stages=1.0),))
    opts = PlanOptions(max_batch=2, micro_batches=2, objective="throughput", step_overhead_s=0.0)
    assert plan(layers, real, opts).cycle_s == 4.0
    assert plan(layers, shared, opts).cycle_s == 8.0
    best = choose(layers, shared, opts, batches=(2,))
    assert (best.options.micro_batches, best.cycle_s) == (1, 4.0)
    assert choose(layers, real, opts, batches=(2,)).cycle_s == 4.0  # k=2 over 2 stages: 2 x 2
    replicas = choose_replicas(layers, shared, opts, batches=(2,))
    assert len(replicas.plans) == 1 and replicas.tokens_per_s == 0.5
    assert choose_replicas(layers, real, opts, batches=(2,)).tokens_per_s == 1.0  # 2 x 2 / 4


def test_a_given_pool_bounds_the_batch_to_what_it_holds_at_the_expected_length() -> None:
    """With --kv-cache-tokens, the throughput search sizes no batch past what the pool holds
    at the expected length (more would only be preempted): 64 tokens of max_seq_len 64 hold 4
    sequences of the expected 16."""
    layers = [
        dataclasses.replace(x, kv_bytes_per_token=1) if x.kind == "decoder" else x
        for x in model([100] * 4)
    ]
    snap = cluster({"gpus": [10_000], "host": 10_000, "link": 10.0, "compute": 100.0})
    opts = PlanOptions(max_seq_len=64, kv_tokens=64, step_overhead_s=0.5)
    plans = best_plans(layers, snap, opts, batches=(1, 2, 4, 8, 16), prune=False)
    assert sorted(plans) == [1, 2, 4]
    assert all(p.options.pool_tokens == 64 for p in plans.values())
    assert choose(layers, snap, opts, batches=(1, 2, 4, 8, 16)).options.max_batch == 4
