"""Starting the workers of a plan on a Ray cluster, and cleaning up on every failure.

Steps: connect (embedded local Ray, or join one), probe every GPU node with a short task that
runs with the job's overrides for that node (so its pin decision is the workers' decision),
plan, then one `StageWorker` actor per stage, pinned to its node, loading its share with
progress. Any failure kills every actor started so far and stops an embedded Ray.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinator.config import ConfigError, JobConfig, node_env
from coordinator.planning.budgets import node_info
from coordinator.planning.snapshot import ClusterSnapshot, NodeInfo
from worker.spec import StageSpec
from worker.worker import StageWorker

CONNECT_TIMEOUT_S = 30.0  # a TCP connect to the head before ray.init, which retries for minutes
PROBE_TIMEOUT_S = 120.0  # one probe task per node; includes starting a Ray worker process
KILL_TIMEOUT_S = 30.0


class LaunchError(RuntimeError):
    """Starting or loading the workers failed; everything started has been released."""


class WorkerLostError(LaunchError):
    """A worker died (its process or its node) while the driver waited for it."""


@dataclass(slots=True)
class RaySession:
    """A connection to Ray; `owned` when we started an embedded local cluster."""

    owned: bool

    def close(self) -> None:
        if self.owned and ray.is_initialized():
            ray.shutdown()


def connect(config: JobConfig) -> RaySession:
    address = config.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return RaySession(owned=False)
    if address:
        if config.gpus:
            raise ConfigError(
                f"gpus={config.gpus} creates logical GPUs on an embedded Ray, but RAY_ADDRESS="
                f"{address!r} joins a cluster whose GPUs are real: unset RAY_ADDRESS, or drop "
                "--gpus"
            )
        _join(address)
        return RaySession(owned=False)
    # Embedded: logical GPUs when asked for (CPU-simulated), enough CPUs for one per worker.
    num_gpus = config.gpus or None
    cpus = max(os.cpu_count() or 1, (config.gpus or 1) * config.cpus_per_worker)
    # address="local": always a new cluster. A bare ray.init() joins a Ray that another process
    # on this machine started (/tmp/ray/ray_current_cluster), then refuses num_cpus/num_gpus.
    ray.init(address="local", num_cpus=cpus, num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    return RaySession(owned=True)


def _join(address: str) -> None:
    """ray.init(address), bounded: an address where nothing listens fails at once (Ray itself
    retries for minutes), a cluster that wants a token says so (Ray says "Failed to connect")."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(address)
    except ConnectionError as exc:  # "auto" with no cluster on this machine
        raise ConnectionError(f"no Ray cluster to join at address={address!r}: {exc}") from None
    except Exception:  # a private helper that moved: leave the address to ray.init
        resolved = None
    host, _, port = (resolved or "").rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ConnectionError(
                f"cannot reach a Ray cluster at {address} ({resolved}): {exc}; check that its "
                "head is up (ray status on it) and the address (--address or RAY_ADDRESS)"
            ) from None
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:
        chain: list[BaseException] = []
        link: BaseException | None = exc
        while link is not None and link not in chain:
            chain.append(link)
            link = link.__cause__ or link.__context__
        wants_token = any(
            isinstance(e, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(e)
            for e in chain
        )
        if not wants_token:
            raise ConnectionError(f"cannot join the Ray cluster at {address}: {exc}") from None
        raise ConnectionError(
            f"the Ray cluster at {address} refused this client's token (RAY_AUTH_MODE="
            f"{os.environ.get('RAY_AUTH_MODE', 'unset')}): it uses token authentication; set "
            "RAY_AUTH_MODE=token and give the cluster's token in ~/.ray/auth_token, "
            "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (see README: Run on a cluster)"
        ) from None


@ray.remote(num_cpus=0, max_calls=1)  # max_calls=1: a process that touched CUDA exits after
def _probe_task(planned_bytes: int = 0) -> dict:
    from worker.node import probe_here

    return probe_here(planned_bytes)


def gpu_nodes() -> list[dict]:
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 1]
    return sorted(nodes, key=lambda n: (n["NodeManagerHostname"], n["NodeID"]))


def probe_cluster(
    config: JobConfig,
    held_bytes: dict[str, int] | None = None,
    probers: dict[str, ray.actor.ActorHandle] | None = None,
) -> tuple[ClusterSnapshot, dict[str, tuple[dict, dict]]]:
    """A snapshot of every alive GPU node, and per node the env its workers get from the job
    (labels and overrides) with the origin of each variable. When re-planning: `held_bytes`,
    host memory this job's own workers already hold on a node (their arenas), counted as
    available since the new plan replaces them; `probers`, a live worker per node that answers
    for its node instead of a probe task (no process to start)."""
    nodes = gpu_nodes()
    if not nodes:
        raise LaunchError(
            "the Ray cluster has no GPU nodes; on a machine without GPUs use --gpus N with "
            "--gpu-memory to simulate them"
        )
    envs = {}
    refs = []
    for node in nodes:
        env, origins = node_env(config.overrides, node_id=node["NodeID"],
                                hostname=node["NodeManagerHostname"],
                                labels=_user_labels(node))  # fmt: skip
        envs[node["NodeID"]] = (env, origins)
        options = {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        }
        if env:
            options["runtime_env"] = {"env_vars": env}
        if node["NodeID"] in (probers or {}):
            refs.append(probers[node["NodeID"]].node_probe.remote())
        else:
            refs.append(_probe_task.options(**options).remote())
    try:
        results = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.RayActorError as exc:
        raise WorkerLostError(f"a worker died while probing its node: {exc}") from None
    infos = []
    for node, result in zip(nodes, results, strict=True):
        held = (held_bytes or {}).get(node["NodeID"], 0)
        infos.append(_node_info(config, node, result, held))
    return ClusterSnapshot(nodes=tuple(infos)), envs


def _node_info(config: JobConfig, node: dict, result: dict, held_bytes: int = 0) -> NodeInfo:
    """The budgets of the Ray node `node` (an entry of `ray.nodes()`) from its probe result."""
    return node_info(config, result, node_id=node["NodeID"], num_gpus=int(node["Resources"]["GPU"]),
                     labels=_user_labels(node), held_bytes=held_bytes)  # fmt: skip


def _user_labels(node: dict) -> dict[str, str]:
    return {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}


@dataclass(frozen=True, slots=True)
class WorkerHandle:
    """An actor and what it was started for; `actor` is None when a named load's worker was
    not found on attach (lost), `name` its actor name in a named load."""

    actor: ray.actor.ActorHandle | None
    spec: StageSpec
    node_id: str
    hostname: str
    name: str | None = None


def start_workers(
    config: JobConfig,
    specs: list[StageSpec],
    placements: list[tuple[str, str]],
    *,
    names: list[str] | None = None,
) -> list[WorkerHandle]:
    """One actor per stage; with `names` (a named load), detached actors of those names, so
    later commands can attach."""
    from coordinator.runtime.registry import NAMESPACE

    remote_cls = ray.remote(StageWorker)
    handles: list[WorkerHandle] = []
    names = names if names is not None else [None] * len(specs)
    try:
        for spec, (node_id, hostname), name in zip(specs, placements, names, strict=True):
            options = {
                "num_gpus": 1,
                "num_cpus": config.cpus_per_worker,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
                "max_restarts": 0,
            }
            if spec.env:
                options["runtime_env"] = {"env_vars": dict(spec.env)}
            if name is not None:
                options.update(name=name, namespace=NAMESPACE, lifetime="detached")
            actor = remote_cls.options(**options).remote(
                spec,
                # Logical GPUs of an embedded Ray are simulated: the CPU stands in for each,
                # even on a host with a real GPU that Ray's CUDA_VISIBLE_DEVICES may name.
                device="cpu" if config.gpus else None,
                gpu_memory_bytes=config.gpu_memory_bytes,
                num_threads=config.cpus_per_worker,
                attn_implementation=config.attn_implementation,
                snapshot_interval_s=config.snapshot_interval_s,
            )
            handles.append(WorkerHandle(actor=actor, spec=spec, node_id=node_id,
                                        hostname=hostname, name=name))  # fmt: skip
    except BaseException:
        kill_workers(handles)
        raise
    return handles


def load_workers(
    handles: list[WorkerHandle],
    timeout_s: float,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """prepare -> every chunk -> finish on all workers at once; `progress(done, total)` bytes.
    Workers that are loaded already take part at no cost (they have no chunks left), so a load
    interrupted by a lost worker is finished by calling this again with its replacement."""
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LaunchError(f"loading did not finish within {timeout_s:.0f} s (load_timeout_s)")
        return remaining

    chunk_sizes = wait_workers([h.actor.prepare.remote() for h in handles], left(), handles)
    total = sum(sum(sizes.values()) for sizes in chunk_sizes)
    pending = {}
    for handle, sizes in zip(handles, chunk_sizes, strict=True):
        for index in sizes:
            pending[handle.actor.load_chunk.remote(index)] = handle
    done = 0
    if progress:
        progress(0, total)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left())
        for ref in ready:
            handle = pending.pop(ref)
            done += wait_workers([ref], left(), [handle])[0]
            if progress:
                progress(done, total)
    return wait_workers([h.actor.finish_load.remote() for h in handles], left(), handles)


def wait_workers(refs: list, timeout_s: float, handles: list[WorkerHandle]) -> list:
    """ray.get for calls on workers, with their failures as LaunchError (WorkerLostError when
    a worker died)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"workers did not answer within {timeout_s:.0f} s") from None
    except ray.exceptions.RayError as exc:
        raise worker_failure(exc, handles) from None


def worker_failure(exc: ray.exceptions.RayError, handles: list[WorkerHandle]) -> LaunchError:
    """A Ray error from a call on workers as one line: the worker's own error (not Ray's
    remote traceback), or WorkerLostError naming the hosts when a worker died."""
    if isinstance(exc, ray.exceptions.RayActorError):
        hosts = ", ".join(sorted({h.hostname for h in handles}))
        return WorkerLostError(f"a worker died (on {hosts}): {exc}")
    cause = getattr(exc, "cause", None)
    return LaunchError(f"a worker failed: {cause if cause is not None else exc}")


def kill_workers(handles: list[WorkerHandle]) -> None:
    for handle in handles:
        if handle.actor is None:
            continue
        try:
            ray.kill(handle.actor, no_restart=True)
        except Exception as exc:  # already dead: nothing to release
            print(
                f"note: could not kill worker of stage {handle.spec.stage}: {exc}", file=sys.stderr
            )
