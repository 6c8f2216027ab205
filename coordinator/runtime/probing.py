"""Probing the cluster's GPU nodes: one short task per node, run with the job's environment for
that node (labels and overrides), so its pin decision is the workers' decision; the results
become the planner's `ClusterSnapshot` through the same budget function `offloadctl plan` uses.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinator.config import JobConfig, node_env
from coordinator.planning.budgets import node_info
from coordinator.planning.snapshot import ClusterSnapshot, NodeInfo
from coordinator.runtime.errors import LaunchError, WorkerLostError

PROBE_TIMEOUT_S = 120.0  # one probe task per node; includes starting a Ray worker process


@ray.remote(num_cpus=0, max_calls=1)  # max_calls=1: a process that touched CUDA exits after
def _probe_task(planned_bytes: int = 0, model: tuple[dict, str, int] | None = None) -> dict:
    from worker.node import probe_here

    return probe_here(planned_bytes, model=model)


def gpu_nodes(exclude: frozenset[str] = frozenset()) -> list[dict]:
    """Alive nodes with GPUs, but those in `exclude` (node ids)."""
    nodes = [
        n
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("GPU", 0) >= 1 and n["NodeID"] not in exclude
    ]
    return sorted(nodes, key=lambda n: (n["NodeManagerHostname"], n["NodeID"]))


def probe_cluster(
    config: JobConfig,
    held_bytes: dict[str, int] | None = None,
    probers: dict[str, ray.actor.ActorHandle] | None = None,
    exclude: frozenset[str] = frozenset(),
    model: tuple[dict, str, int] | None = None,
) -> tuple[ClusterSnapshot, dict[str, tuple[dict, dict]]]:
    """A snapshot of every alive GPU node, and per node the env its workers get from the job
    (labels and overrides) with the origin of each variable. When re-planning: `held_bytes`,
    host memory this job's own workers already hold on a node (their arenas), counted as
    available since the new plan replaces them; `probers`, a live worker per node that answers
    for its node instead of a probe task (no process to start); `exclude`, nodes left out;
    `model` (config.json, dtype, worker threads): each node also times the model's decoder
    layer on its device (`worker.compute_probe`), for the planner's compute rate."""
    nodes = gpu_nodes(exclude)
    allowed = config.node_gpus()
    if allowed:  # the job's own nodes only (a replica of a served model)
        nodes = [n for n in nodes if n["NodeID"] in allowed]
    if not nodes and allowed:
        raise LaunchError(
            f"none of the job's nodes ({', '.join(n[:8] for n in allowed)}, "
            "its `nodes`) is an alive GPU node of the cluster"
        )
    if not nodes:
        raise LaunchError(
            "the Ray cluster has no GPU nodes; on a machine without GPUs use --gpus N with "
            "--gpu-memory to simulate them"
        )
    envs = {}
    refs = []
    for node in nodes:
        env, origins = node_env(
            config.overrides,
            node_id=node["NodeID"],
            hostname=node["NodeManagerHostname"],
            labels=_user_labels(node),
        )
        envs[node["NodeID"]] = (env, origins)
        options = {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        }
        if env:
            options["runtime_env"] = {"env_vars": env}
        if node["NodeID"] in (probers or {}):
            refs.append(probers[node["NodeID"]].node_probe.remote(model))
        else:
            refs.append(_probe_task.options(**options).remote(0, model))
    try:
        results = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.RayActorError as exc:
        raise WorkerLostError(f"a worker died while probing its node: {exc}") from None
    infos = []
    for node, result in zip(nodes, results, strict=True):
        held = (held_bytes or {}).get(node["NodeID"], 0)
        infos.append(probed_node_info(config, node, result, held, envs[node["NodeID"]][1]))
    return ClusterSnapshot(nodes=tuple(infos)), envs


def model_of(index, config: JobConfig) -> tuple[dict, str, int]:
    """What a node's probe times: the checkpoint's config, its dtype, the workers' threads."""
    return index.config, index.dtype, config.cpus_per_worker


def probed_node_info(
    config: JobConfig,
    node: dict,
    result: dict,
    held_bytes: int = 0,
    origins: dict[str, str] | None = None,
) -> NodeInfo:
    """The budgets of the Ray node `node` (an entry of `ray.nodes()`) from its probe result."""
    gpus = int(node["Resources"]["GPU"])
    gpus = min(gpus, config.node_gpus().get(node["NodeID"], gpus))  # the job's share, if any
    return node_info(
        config,
        result,
        node_id=node["NodeID"],
        num_gpus=gpus,
        labels=_user_labels(node),
        held_bytes=held_bytes,
        origins=origins,
    )


def _user_labels(node: dict) -> dict[str, str]:
    return {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}
