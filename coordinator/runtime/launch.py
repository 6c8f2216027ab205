"""Starting a job: `launch(JobConfig(...))` indexes the checkpoint, probes the cluster, plans,
reserves the GPUs and loads every stage, releasing everything on any failure; `attach(name)`
finds a named load again from any process. Both return a `coordinator.runtime.job.Job`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from coordinator.config import ConfigError, JobConfig
from coordinator.family_check import check_family
from coordinator.planning.batch_size import plan_job, plan_replicas
from coordinator.planning.checkpoint import load_index
from coordinator.planning.context import check_max_seq_len
from coordinator.planning.planner import Plan
from coordinator.runtime import recovery, registry
from coordinator.runtime.desk import Turn, host_bytes_of
from coordinator.runtime.group import WorkerGroup
from coordinator.runtime.job import Job
from coordinator.runtime.keeper import find as find_keeper
from coordinator.runtime.keeper import start as start_keeper
from coordinator.runtime.probing import model_of, probe_cluster
from coordinator.runtime.session import RaySession, connect

REPLICA_STOP_TIMEOUT_S = 120.0  # replicas still loading at a failure: their threads, after
# their workers were killed


def launch(
    config: JobConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    name: str | None = None,
    lease_s: float | None = None,
) -> Job:
    """Index, probe, plan, reserve the GPUs, start and load. On any failure everything started
    is released. With `name`, the workers and their placement groups are detached and named,
    so they outlive this process (on a cluster) and `attach(name)` finds them again. With
    `lease_s` too, the load's keeper unloads it once no `renew()` reached it for that long."""
    if lease_s is not None and (name is None or not lease_s > 0):
        raise ConfigError(f"lease_s={lease_s}: a lease is a positive time, for a named load")
    if config.replicas != 1:
        raise ConfigError(
            f"replicas={config.replicas}: a job runs one pipeline; several are "
            "served as replicas (offloadctl serve, launch_replicas)"
        )
    if name is not None:
        registry.check_name(name)
    index = _checked_index(config)
    session = connect(config)
    record = None
    try:
        if name is not None:  # first: a second load of the name fails now, not after its wait
            record = registry.claim(name)
        # One load at a time probes, plans and reserves; its host bytes stay reserved for it
        # until its workers hold them (`coordinator.runtime.desk`)
        with Turn(f"load {name!r}" if name else "a job") as turn:
            snapshot, envs = probe_cluster(
                config, model=model_of(index, config), reserved=turn.reserved_elsewhere()
            )
            config, the_plan = plan_job(config, index, snapshot)
            return _start(
                config, index, the_plan, envs, session, name, progress, record, lease_s, turn
            )
    except BaseException:
        if record is not None:
            registry.release(record)  # ours, by handle: never another load's record
        session.close()
        raise


def replica_names(name: str, count: int) -> list[str]:
    """The loads of `count` replicas named `name`: `name` itself for one."""
    return [f"{name}-{r}" for r in range(count)] if count > 1 else [name]


def launch_replicas(
    config: JobConfig,
    name: str,
    *,
    progress: Callable[[int, int], None] | None = None,
    lease_s: float | None = None,
) -> list[Job]:
    """The job as `config.replicas` pipelines (0: the count with the most tokens/s), each a
    named load `{name}-{r}` on its own GPUs (`JobConfig.nodes`) with the plan the replica
    search made for it; the cluster is probed once for all, every name is claimed first, and
    the replicas load at once (each on its own GPUs: N replicas take about as long as one).
    A single pipeline is the load `name` itself. On any failure, or an interrupt, every
    replica is released, loaded or not. `lease_s`: each is leased (see `launch`)."""
    if config.replicas == 1:
        return [launch(config, progress=progress, name=name, lease_s=lease_s)]
    if lease_s is not None and not lease_s > 0:
        raise ConfigError(f"lease_s={lease_s}: a lease is a positive time")
    index = _checked_index(config)
    session = connect(config)
    records: dict[str, object] = {}  # load name -> its record, claimed by this call
    futures: list[Future] = []
    abandoned = threading.Event()  # set at a failure: the replicas still loading stop
    pool = None
    turn = Turn(f"replicas of {name!r}")
    try:
        # The names first, before the probe: a clash fails at once, and no other load takes a
        # name this call will use while it probes and plans. With the count left to the
        # search (replicas 0), `name` itself is held until the count is known.
        for load in replica_names(name, config.replicas):
            records[load] = registry.claim(load)
        turn.__enter__()  # left once every replica has reserved its GPUs
        snapshot, envs = probe_cluster(
            config, model=model_of(index, config), reserved=turn.reserved_elsewhere()
        )
        chosen = plan_replicas(config, index, snapshot)
        loads = replica_names(name, len(chosen.plans))
        for load in loads:  # every name before any GPU is taken
            if load not in records:
                records[load] = registry.claim(load)
        for load in [load for load in records if load not in loads]:  # held for the count
            registry.release(records.pop(load))  # ours, by handle
        turn.parts = len(loads)
        combined = _CombinedProgress(progress, len(loads)) if progress is not None else None
        # not `with`: its exit would wait for every load, also on an interrupt (Ctrl-C)
        pool = ThreadPoolExecutor(len(loads), thread_name_prefix="offload-replica")
        for r, (the_plan, load) in enumerate(zip(chosen.plans, loads, strict=True)):
            replica = dataclasses.replace(
                config,
                replicas=1,
                max_batch=the_plan.options.max_batch,
                micro_batches=the_plan.options.micro_batches,
                kv_cache_tokens=the_plan.options.pool_tokens,
                nodes=recovery.nodes_of(the_plan) if len(loads) > 1 else "",
            )
            futures.append(
                pool.submit(
                    _start,
                    replica,
                    index,
                    the_plan,
                    envs,
                    # the first replica owns the Ray this call connected to
                    session if r == 0 else RaySession(owned=False),
                    load,
                    combined.of(r) if combined is not None else None,
                    records[load],
                    lease_s,
                    turn,
                    abandoned,
                )
            )
        # the first failure as it happens, not in the replicas' order: the others still
        # loading are stopped at once (below), not after they loaded for nothing
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                future.result()  # raises it
        return [future.result() for future in futures]
    except BaseException:
        # What finished is ours to release; what still loads is stopped by name (its workers
        # killed, so its wait ends), then swept again once every replica's thread is done (a
        # keeper started meanwhile goes too). Only names this call claimed, and their records
        # kept until the last sweep: no other load can claim a name between the two sweeps
        # and lose what it made to the second.
        abandoned.set()  # a replica still loading replaces no worker killed next
        for load in records:
            registry.forget(load, keep_record=True)
        wait(futures, timeout=REPLICA_STOP_TIMEOUT_S)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().close()
        for load in records:
            registry.forget(load)
        if not (futures and futures[0].done() and futures[0].exception() is None):
            session.close()  # not closed with the first replica's job
        raise
    finally:
        turn.__exit__(None, None, None)  # left, and its reservations dropped: loaded or failed
        if pool is not None:
            pool.shutdown(wait=False)  # its threads are done, or end once their loads fail


class _CombinedProgress:
    """The replicas' loading progress as one (bytes loaded of all, bytes of all), told once
    every replica has said its size (the total does not change under the caller's bar)."""

    def __init__(self, progress: Callable[[int, int], None], count: int) -> None:
        self._progress = progress
        self._state: list[tuple[int, int] | None] = [None] * count
        self._lock = threading.Lock()

    def of(self, r: int) -> Callable[[int, int], None]:
        def told(done: int, total: int) -> None:
            with self._lock:
                self._state[r] = (done, total)
                if any(s is None for s in self._state):
                    return
                done_all = sum(s[0] for s in self._state)
                total_all = sum(s[1] for s in self._state)
                self._progress(done_all, total_all)

        return told


def _checked_index(config: JobConfig):
    """The job's checkpoint index, once its max_seq_len fits the model's context and its family
    is known to split right. An untested family is run split and whole in this process first:
    refused here, before Ray and any worker start, when its split does not reproduce the model."""
    index = load_index(config.checkpoint, dtype=config.dtype)
    check_max_seq_len(index.config, config.max_seq_len)
    check_family(index.config, attn_implementation=config.attn_implementation)
    return index


def _start(
    config: JobConfig,
    index,
    the_plan: Plan,
    envs: dict,
    session: RaySession,
    name: str | None,
    progress: Callable[[int, int], None] | None,
    record=None,
    lease_s: float | None = None,
    turn: Turn | None = None,
    abandoned: threading.Event | None = None,
) -> Job:
    """Reserve the plan's GPUs, start and load its workers: a Job (named: detached, recorded,
    kept by a keeper). `record`: the name's record, claimed by the caller (`registry.claim`);
    `turn`: the caller's turn at the desk, left (with the plan's host bytes reserved) once the
    GPUs are. On failure what this started is released: its workers, its placement groups, its
    keeper and the record; never anything found by name, which may be another load's. The
    session is the caller's to close. `abandoned`: set by the caller when the load is no
    longer wanted (another replica failed); lost workers are then not replaced."""
    job = None
    keeper = None
    try:
        group = WorkerGroup(config=config, index=index, plan=the_plan, load_name=name)
        if abandoned is not None:
            group.abandoned = abandoned
        job = Job(group=group, session=session, name=name)
        if name is not None:
            group.names = job.new_worker_names
        try:
            group.start(envs)
        finally:  # reserved or not: the next load's turn
            if turn is not None:
                turn.leave(host_bytes_of(the_plan) if group.handles else ())
        if name is not None:  # recorded first, so `unload` finds a load interrupted midway
            registry.store(record, config, group, [], state="loading")
        job.load_reports = recovery.load_recovering(group, job.record_event, progress)
        if name is not None:  # from now on the keeper changes the load, no driver
            keeper = job.keeper = start_keeper(name, index, lease_s)
            registry.store(record, group.config, group, job.events, state="loaded")
        return job
    except BaseException:
        if keeper is not None:
            registry.release(keeper)
        if job is not None:
            job.group.stop()
        if record is not None:
            registry.release(record)
        raise


def attach(name: str, *, address: str | None = None) -> Job:
    """The named load `name` on the cluster at `address` (or RAY_ADDRESS)."""
    session = connect(JobConfig(checkpoint="-", address=address or "auto"))
    try:
        _, record = registry.load_record(name)
        config = registry.config_of(record)
        index = load_index(config.checkpoint, dtype=config.dtype)
        group = registry.group_of(record, index)
        job = Job(
            group=group,
            session=session,
            name=name,
            events=list(record["events"]),
            next_worker=registry.next_worker_number(record),
            keeper=find_keeper(name),
        )
        group.names = job.new_worker_names
        return job
    except BaseException:
        session.close()
        raise


__all__ = ["attach", "launch", "launch_replicas"]
