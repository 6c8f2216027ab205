"""Replicas as well as stages: the replica count, each replica's batch, micro-batches and
placement, equal to a brute force over the same space on small clusters. Pure Python, no Ray."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner import FAST, cluster, model
from test_throughput import brute_best, throughput_instances

from coordinator.planning.options import PlanOptions
from coordinator.planning.replicas import choose_replicas, split
from coordinator.planning.snapshot import ClusterSnapshot
from offload.errors import PlanError


def runs_of(snap: ClusterSnapshot, count: int) -> list[ClusterSnapshot]:
    """The GPUs in pipeline order in `count` equal runs, each node's host budgets shared by
    GPU count: written out here, independently of replicas.split."""
    flat = [(node, gpu) for node in snap.nodes for gpu in node.gpus]
    size = len(flat) // count
    parts = []
    for r in range(count):
        mine = flat[r * size : (r + 1) * size]
        nodes = []
        for node in snap.nodes:
            gpus = tuple(g for n, g in mine if n is node)
            if gpus:
                share = len(gpus) / len(node.gpus)
                nodes.append(
                    dataclasses.replace(
                        node,
                        gpus=gpus,
                        host_budget_bytes=int(node.host_budget_bytes * share),
                        pinned_budget_bytes=int(node.pinned_budget_bytes * share),
                    )
                )
        parts.append(ClusterSnapshot(nodes=tuple(nodes)))
    return parts


@settings(FAST, max_examples=60)
@given(throughput_instances(), st.sampled_from([0.0, 0.0, 30.0]))
def test_replicas_match_brute_force(instance, latency) -> None:
    """Every replica count dividing the GPUs, each replica brute-forced on its own GPUs: the
    most tokens/s in all; the choice reaches it."""
    layers, snap, opts, batches = instance
    gpus = snap.num_gpus
    expected = None
    for count in (r for r in range(1, gpus + 1) if gpus % r == 0):
        each = [brute_best(layers, part, opts, batches, latency) for part in runs_of(snap, count)]
        if all(e is not None for e in each):
            expected = max(expected or 0.0, sum(each))
    if expected is None:
        with pytest.raises(PlanError):
            choose_replicas(layers, snap, opts, batches=batches, max_token_latency_s=latency)
        return
    got = choose_replicas(layers, snap, opts, batches=batches, max_token_latency_s=latency)
    assert got.tokens_per_s == pytest.approx(expected, rel=1e-12)
    assert gpus % len(got.plans) == 0 and {p.options.objective for p in got.plans} == {"throughput"}
    used = [(s.node_id, s.gpu_index) for p in got.plans for s in p.stages]
    assert len(used) == len(set(used))  # replicas never share a GPU
    assert choose_replicas(layers, snap, opts, batches=batches, max_token_latency_s=latency) == got


def test_two_replicas_or_one_deeper_pipeline() -> None:
    """Two GPUs that each hold the model with a batch of 4. Batches up to 4: two replicas
    make 8 sequences' tokens per cycle of one GPU, the two-stage pipeline 4 per two half
    cycles. Batches up to 32: the pipeline's GPUs hold half the weights each, so its KV cache
    takes 30 sequences, a replica's only 5: now the deeper pipeline wins. (Each sequence takes
    one block of 16 tokens: 64 bytes of KV over the 4 layers.)"""
    layers = [dataclasses.replace(x, kv_bytes_per_token=1) for x in model([320] * 4)]
    snap = cluster({"gpus": [1600, 1600], "host": 0, "compute": 1600.0})
    opts = PlanOptions(max_seq_len=16, step_overhead_s=0.0)
    small = choose_replicas(layers, snap, opts, batches=(1, 2, 4))
    assert [len(p.stages) for p in small.plans] == [1, 1]
    assert small.tokens_per_s == 2 * 4 / 0.8
    assert {p.stages[0].gpu_index for p in small.plans} == {0, 1}
    large = choose_replicas(layers, snap, opts, batches=(1, 2, 4, 5, 30))
    assert len(large.plans) == 1 and len(large.plans[0].stages) == 2
    assert large.plans[0].options.max_batch == 30
    assert "1 replicas" not in large.summary() and "2 replicas" in small.summary()
    # each replica's pool was chosen by the cost model, and its summary says what it weighed
    assert small.summary().count("KV pool tokens weighed: 64: ") == 2


def test_a_node_shared_by_replicas_splits_its_host_budget() -> None:
    snap = cluster({"gpus": [10, 10, 10, 10], "host": 100, "pinned": 40, "pin": True})
    halves = split(snap, 2)
    assert [n.gpus[0].index for part in halves for n in part.nodes] == [0, 2]
    assert {(n.host_budget_bytes, n.pinned_budget_bytes) for p in halves for n in p.nodes} == {
        (50, 20)
    }
    with pytest.raises(PlanError, match="replicas=3 must divide the cluster's 4 GPUs"):
        split(snap, 3)
