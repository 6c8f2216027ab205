"""Replicas as well as stages: with more GPUs than one pipeline needs, several pipelines, each
serving requests of its own, may give more tokens/s than one deeper pipeline (no stage waits
for a micro-batch of another pipeline, each has its own KV cache and batch).

The space: for each R dividing the GPU count, R replicas, replica r taking the r-th run of G/R
GPUs in pipeline order (nodes in order, each node's GPUs in order), so that every replica is
alike in size (Ray Serve's replicas of one deployment). A node whose GPUs go to several
replicas splits its host budgets between them in proportion to the GPUs each takes (and, where
its GPUs are simulated on its CPU, its cores). Each
replica is planned for throughput on its own GPUs (`coordinator.planning.throughput`): its
batch, micro-batches and placement; the cluster makes the sum of their tokens/s, and each
sequence's time between tokens is its replica's cycle (the latency bound holds per replica).
Ties go to fewer replicas. Replicas over identical GPUs are planned once. Pure, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.planning.checkpoint import LayerSpec
from coordinator.planning.formats import format_seconds
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import Plan
from coordinator.planning.snapshot import ClusterSnapshot
from coordinator.planning.throughput import BATCHES, choose
from offload.errors import PlanError


@dataclass(frozen=True, slots=True)
class Replicas:
    """R pipelines over disjoint GPUs, each with its own plan."""

    plans: tuple[Plan, ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(p.tokens_per_s for p in self.plans)

    @property
    def cycle_s(self) -> float:
        return max(p.cycle_s for p in self.plans)

    def summary(self) -> str:
        if len(self.plans) == 1:
            return self.plans[0].summary()
        head = (
            f"{len(self.plans)} replicas of {len(self.plans[0].stages)} stage(s): "
            f"{self.tokens_per_s:.1f} decode tokens/s predicted in all, at most "
            f"{format_seconds(self.cycle_s)} between a sequence's tokens"
        )
        parts = [head]
        for r, p in enumerate(self.plans):
            parts += [f"\nreplica {r}:", p.summary()] + ([p.pool_note] if p.pool_note else [])
        return "\n".join(parts)


def split(cluster: ClusterSnapshot, replicas: int) -> list[ClusterSnapshot]:
    """The cluster's GPUs in pipeline order, cut into `replicas` equal runs (see the module
    doc); PlanError when they do not divide."""
    gpus = [(n, g) for n, node in enumerate(cluster.nodes) for g in node.gpus]
    if replicas < 1 or len(gpus) % replicas:
        raise PlanError(
            f"replicas={replicas} must divide the cluster's {len(gpus)} GPUs into equal replicas"
        )
    size = len(gpus) // replicas
    parts = []
    for r in range(replicas):
        taken = gpus[r * size : (r + 1) * size]
        nodes = []
        for n in sorted({n for n, _ in taken}):
            node = cluster.nodes[n]
            mine = tuple(g for m, g in taken if m == n)
            share = len(mine) / len(node.gpus)
            nodes.append(
                dataclasses.replace(
                    node,
                    gpus=mine,
                    host_budget_bytes=int(node.host_budget_bytes * share),
                    pinned_budget_bytes=int(node.pinned_budget_bytes * share),
                    concurrent_stages=None
                    if node.concurrent_stages is None
                    else node.concurrent_stages * share,
                )
            )
        parts.append(ClusterSnapshot(nodes=tuple(nodes)))
    return parts


def _shape(part: ClusterSnapshot) -> tuple:
    """What a replica's plan depends on: its nodes but for their names and GPU indices."""
    return tuple(
        (
            tuple(g.memory_bytes for g in n.gpus),
            n.host_budget_bytes,
            n.pinned_budget_bytes,
            n.pin,
            n.link_bytes_per_s,
            n.compute,
            n.compute_bytes_per_s,
            n.backend,
            n.concurrent_stages,
            n.fp8_compute,
        )
        for n in part.nodes
    )


def _relabel(the_plan: Plan, source: ClusterSnapshot, target: ClusterSnapshot) -> Plan:
    """A plan made for `source` moved to `target`, a replica of the same shape: each stage to
    the GPU in the same place of the target's pipeline order."""
    where = {}
    for a, b in zip(source.nodes, target.nodes, strict=True):
        for ga, gb in zip(a.gpus, b.gpus, strict=True):
            where[a.node_id, ga.index] = (b, gb.index)
    stages = []
    for s in the_plan.stages:
        node, gpu = where[s.node_id, s.gpu_index]
        stages.append(
            dataclasses.replace(s, node_id=node.node_id, hostname=node.hostname, gpu_index=gpu)
        )
    return dataclasses.replace(the_plan, stages=tuple(stages))


def _could_hold(weights: int, part: ClusterSnapshot) -> bool:
    """Whether the replica's GPUs and host budgets together hold at least the `weights` bytes
    (a necessary condition, to skip hopeless counts at once)."""
    room = sum(g.memory_bytes for n in part.nodes for g in n.gpus)
    room += sum(n.offload_budget_bytes for n in part.nodes)
    return room >= weights


def choose_replicas(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    *,
    replicas: int = 0,
    batches: Sequence[int] = BATCHES,
    micro_batches: int = 0,
    max_token_latency_s: float = 0.0,
) -> Replicas:
    """The most tokens/s over the replica counts (`replicas`: that count only; 0: every count
    dividing the GPUs). PlanError when no count fits, with the one-pipeline error."""
    gpus = cluster.num_gpus
    counts = [replicas] if replicas else [r for r in range(1, gpus + 1) if gpus % r == 0]
    best: Replicas | None = None
    first_error: PlanError | None = None
    # the least the weights take: resident quantized matrices as stored, unless never so
    stored = options.resident_weights != "wide"
    weights = sum(layer.resident_bytes(stored) for layer in layers)
    for count in counts:
        parts = split(cluster, count)
        if count > 1 and not all(_could_hold(weights, p) for p in parts):
            continue
        planned: dict[tuple, tuple[ClusterSnapshot, Plan]] = {}
        plans = []
        try:
            for part in parts:
                key = _shape(part)
                if key not in planned:
                    planned[key] = (
                        part,
                        choose(
                            layers,
                            part,
                            options,
                            batches=batches,
                            micro_batches=micro_batches,
                            max_token_latency_s=max_token_latency_s,
                        ),
                    )
                source, the_plan = planned[key]
                plans.append(_relabel(the_plan, source, part))
        except PlanError as exc:
            first_error = first_error or exc
            continue
        got = Replicas(tuple(plans))
        if best is None or got.tokens_per_s > best.tokens_per_s:
            best = got
    if best is None:
        raise first_error or PlanError("no replica count fits")
    return best
