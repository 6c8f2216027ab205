"""Probing the cluster's GPU nodes: one short task per node, run with the job's environment for
that node (labels and overrides), so its pin decision is the workers' decision; the results
become the planner's `ClusterSnapshot` through the same budget function `offloadctl plan` uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Iterable

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from coordinator.config import JobConfig, node_env
from coordinator.planning.budgets import node_info
from coordinator.planning.snapshot import ClusterSnapshot, NodeInfo
from coordinator.runtime.errors import LaunchError, WorkerLostError
from coordinator.runtime.record import load_of_group
from worker.node import probe_task, probe_unless_cuda

PROBE_TIMEOUT_S = 120.0  # one probe task per node; includes starting a Ray worker process
SETTLE_TIMEOUT_S = 15.0  # GPUs held by tasks (probes) are waited for this long before a plan
SETTLE_POLL_S = 0.2


# The task holds the GPUs it measures (num_gpus, set per node): with none, Ray leaves every GPU
# of the node visible to it, and its CUDA context and compute probe would land on GPUs that
# other loads hold. Where the node has CUDA devices, the probe runs with max_calls=1: a process
# that touched CUDA exits after, so no idle worker keeps a context (hundreds of MiB) on GPUs
# that loads then plan on.
_probe_task = ray.remote(num_cpus=0, max_calls=1)(probe_task)
# Every node is asked first by a task whose process Ray keeps for the job's next probe there:
# a node without CUDA (simulated GPUs: a laptop, CI) is probed in one process for every launch
# and re-plan of the job (without torch's import once the node measured the model: see
# `worker.node`), and a node with CUDA answers None at once and is probed by `_probe_task`.
_probe_task_reused = ray.remote(num_cpus=0)(probe_unless_cuda)
_CUDA_NODES: set[str] = set()  # node ids where CUDA has devices: `_probe_task` at once


def gpu_nodes(exclude: frozenset[str] = frozenset()) -> list[dict]:
    """Alive nodes with GPUs, but those in `exclude` (node ids)."""
    nodes = [
        n
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("GPU", 0) >= 1 and n["NodeID"] not in exclude
    ]
    return sorted(nodes, key=lambda n: (n["NodeManagerHostname"], n["NodeID"]))


def free_gpus() -> dict[str, int]:
    """The GPUs nothing holds (no placement group, no actor), per alive node id."""
    import ray._private.state as ray_state  # per-node availability: Ray has no public API

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return {
        node: int(resources.get("GPU", 0))
        for node, resources in ray_state.state.available_resources_per_node().items()
        if node in alive
    }


def settled_free_gpus(timeout_s: float = SETTLE_TIMEOUT_S) -> dict[str, int]:
    """`free_gpus`, once no GPU of an alive node is held outside a placement group, or after
    `timeout_s`. Loads hold their GPUs in placement groups; a GPU held outside one is held by a
    task, which here is a probe: another load's (which will end in seconds), or one that
    ended and that the cluster's view of free resources does not show ended yet (it lags the
    nodes, by seconds on a busy machine). A plan made meanwhile would leave those GPUs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = free_gpus()
        if not held_by_tasks(free) or time.monotonic() > deadline:
            return free
        time.sleep(SETTLE_POLL_S)


def held_by_tasks(free: dict[str, int]) -> dict[str, int]:
    """GPUs per alive node that are neither free (`free`) nor reserved by a placement group."""
    in_groups: Counter = Counter()
    for entry in ray.util.placement_group_table().values():
        # a group whose node left is RESCHEDULING: its bundles on the nodes alive still hold
        if entry.get("state") in ("CREATED", "RESCHEDULING"):
            nodes = entry.get("bundles_to_node_id", {})
            for index, bundle in entry.get("bundles", {}).items():
                in_groups[nodes.get(index)] += int(bundle.get("GPU", 0))
    held = {}
    for node in gpu_nodes():
        node_id = node["NodeID"]
        rest = int(node["Resources"]["GPU"]) - free.get(node_id, 0) - in_groups[node_id]
        if rest > 0:
            held[node_id] = rest
    return held


def usable_gpus(own: Iterable[str] = (), free: dict[str, int] | None = None) -> dict[str, int]:
    """The GPUs a plan may use, per alive node id: the free ones (`free`, else asked now) and
    the job's own (`own`: one node id per GPU the planning job holds itself, its surviving
    workers' bundles). Never another load's. The one answer for new loads, re-plans and
    replicas."""
    usable = Counter(free if free is not None else free_gpus())
    usable.update(own)
    return {node: n for node, n in usable.items() if n > 0}


def held_elsewhere() -> str:
    """Who holds the cluster's GPUs, for an error: the named loads' placement groups."""
    counts: Counter = Counter()
    for entry in ray.util.placement_group_table().values():
        if entry.get("state") == "CREATED":
            load = load_of_group(entry.get("name", "")) or "unnamed jobs"
            counts[load] += sum(int(b.get("GPU", 0)) for b in entry.get("bundles", {}).values())
    held = [f"{load} ({n})" for load, n in sorted(counts.items()) if n]
    return ", ".join(held) or "no placement group (actors or tasks outside them)"


def probe_cluster(
    config: JobConfig,
    held_bytes: dict[str, int] | None = None,
    probers: dict[str, list[ray.actor.ActorHandle]] | None = None,
    exclude: frozenset[str] = frozenset(),
    model: tuple[dict, str, int] | None = None,
    own: Iterable[str] = (),
    bundles: dict[str, list[tuple[PlacementGroup, int]]] | None = None,
    reserved: dict[str, int] | None = None,
) -> tuple[ClusterSnapshot, dict[str, tuple[dict, dict]]]:
    """A snapshot of every alive GPU node, and per node the env its workers get from the job
    (labels and overrides) with the origin of each variable. Each node is probed by a task that
    holds its free GPUs (as long as it measures) and, when re-planning, also by each of the
    job's surviving workers there (`probers`: its own GPU, what its stage holds counted as
    free) and by a task in each bundle the job keeps there (`bundles`: placement group and
    bundle index of a lost worker's GPU); a node's answers are merged (`merge_results`), so
    every GPU a plan may take is measured, none assumed. `held_bytes`: host memory this job's
    own workers already hold on a node (their arenas), counted as available since the new plan
    replaces them; `reserved`: host memory other loads planned on a node and do not hold yet
    (`coordinator.runtime.desk`), counted as taken; `exclude`, nodes left out; `model`
    (config.json, dtype, worker threads): each node also times the model's decoder layer on
    its device (`worker.compute_probe`), for the planner's compute rate. Only the GPUs that
    are free or the job's own (`own`, see `usable_gpus`) are planned on."""
    probers, bundles = probers or {}, bundles or {}
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
    free = settled_free_gpus()
    usable = usable_gpus(own, free)
    total = sum(int(n["Resources"]["GPU"]) for n in nodes)
    # A node with nothing to probe it (its usable GPUs all bundles of lost workers that the
    # caller did not give) is left out of this plan.
    nodes = [
        n
        for n in nodes
        if usable.get(n["NodeID"], 0) > 0
        and (probers.get(n["NodeID"]) or bundles.get(n["NodeID"]) or free.get(n["NodeID"], 0))
    ]
    if not nodes:
        raise LaunchError(
            f"every GPU of the cluster's {total} is held by other loads or jobs "
            f"(held by: {held_elsewhere()}); unload one (offloadctl list, offloadctl unload "
            "NAME) or add GPUs"
        )
    envs = {}
    # per ref: its node, and its task's options (None: a surviving worker answers)
    asks: list[tuple[str, dict | None]] = []
    refs = []
    for node in nodes:
        node_id = node["NodeID"]
        envs[node_id] = _env_of(config, node)
        env = envs[node_id][0]
        runtime = {"runtime_env": {"env_vars": env}} if env else {}
        for actor in probers.get(node_id, ()):
            refs.append(actor.node_probe.remote(model))
            asks.append((node_id, None))
        tasks = [
            {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=bundle
                ),
                "num_gpus": 1,
                **runtime,
            }
            for group, bundle in bundles.get(node_id, ())
        ]
        if free.get(node_id, 0) or not (probers.get(node_id) or tasks):
            tasks.append(
                {
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
                    "num_gpus": free.get(node_id, 0),
                    **runtime,
                }
            )
        for options in tasks:
            task = _probe_task if node_id in _CUDA_NODES else _probe_task_reused
            refs.append(task.options(**options).remote(0, model))
            asks.append((node_id, options))
    try:
        results = ray.get(refs, timeout=PROBE_TIMEOUT_S)
        again = [i for i, r in enumerate(results) if r is None]
        _CUDA_NODES.update(asks[i][0] for i in again)
        refs = [_probe_task.options(**asks[i][1]).remote(0, model) for i in again]
        for i, result in zip(again, ray.get(refs, timeout=PROBE_TIMEOUT_S), strict=True):
            results[i] = result
    except ray.exceptions.RayActorError as exc:
        raise WorkerLostError(f"a worker died while probing its node: {exc}") from None
    except ray.exceptions.GetTimeoutError:
        for ref in refs:  # a task still waiting for GPUs must not get them later
            with contextlib.suppress(Exception):  # a worker's call: not cancellable by force
                ray.cancel(ref, force=True)
        raise LaunchError(
            f"the probes of {len(nodes)} node(s) did not answer within {PROBE_TIMEOUT_S:.0f} s "
            "(PROBE_TIMEOUT_S): a node is overloaded, or its free GPUs were taken meanwhile"
        ) from None
    answers: dict[str, list[dict]] = {}
    for (node_id, _), result in zip(asks, results, strict=True):
        answers.setdefault(node_id, []).append(result)
    infos = []
    for node in nodes:
        node_id = node["NodeID"]
        info = probed_node_info(
            config,
            node,
            merge_results(answers[node_id]),
            (held_bytes or {}).get(node_id, 0),
            envs[node_id][1],
            usable[node_id],
            (reserved or {}).get(node_id, 0),
        )
        infos.append(info)
    return ClusterSnapshot(nodes=tuple(infos)), envs


def merge_results(results: list[dict]) -> dict:
    """One node's probe answers (`worker.node.probe_here`, each from a process holding some of
    its GPUs) as one: the node's facts from the first (host memory, pin decision, rates), the
    GPUs of all, the first error any of them met, and the first measured compute profile."""
    first = results[0]
    if len(results) == 1:
        return first
    probe = first["probe"]
    merged = {
        **first,
        "probe": dataclasses.replace(
            probe,
            devices=tuple(d for r in results for d in r["probe"].devices),
            simulated_devices=tuple(d for r in results for d in r["probe"].simulated_devices),
        ),
        "error": next((r["error"] for r in results if r["error"]), None),
    }
    if "compute" in first:
        answered = [r["compute"] for r in results if "compute" in r]
        measured = [c for c in answered if not isinstance(c, str)]
        merged["compute"] = measured[0] if measured else first["compute"]
    return merged


def node_envs(config: JobConfig, node_ids: Iterable[str]) -> dict[str, tuple[dict, dict]]:
    """Per alive node of `node_ids`: the env the job gives its workers there (its overrides,
    the node's labels) and the origin of each variable, as `probe_cluster` gives them. What a
    named load's group, rebuilt from its record, starts its replacement workers with."""
    wanted = set(node_ids)
    return {
        n["NodeID"]: _env_of(config, n) for n in ray.nodes() if n["Alive"] and n["NodeID"] in wanted
    }


def _env_of(config: JobConfig, node: dict) -> tuple[dict, dict]:
    return node_env(
        config.overrides,
        node_id=node["NodeID"],
        hostname=node["NodeManagerHostname"],
        labels=_user_labels(node),
    )


def model_of(index, config: JobConfig) -> tuple[dict, str, int]:
    """What a node's probe times: the checkpoint's config, its dtype, the workers' threads."""
    return index.config, index.dtype, config.cpus_per_worker


def probed_node_info(
    config: JobConfig,
    node: dict,
    result: dict,
    held_bytes: int = 0,
    origins: dict[str, str] | None = None,
    usable: int | None = None,
    reserved_bytes: int = 0,
) -> NodeInfo:
    """The budgets of the Ray node `node` (an entry of `ray.nodes()`) from its probe result;
    `usable`: how many of its GPUs the job may plan on (free or its own)."""
    gpus = int(node["Resources"]["GPU"])
    gpus = min(gpus, config.node_gpus().get(node["NodeID"], gpus))  # the job's share, if any
    if usable is not None:
        gpus = min(gpus, usable)
    return node_info(
        config,
        result,
        node_id=node["NodeID"],
        num_gpus=gpus,
        labels=_user_labels(node),
        held_bytes=held_bytes,
        origins=origins,
        reserved_bytes=reserved_bytes,
    )


def _user_labels(node: dict) -> dict[str, str]:
    return {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}
