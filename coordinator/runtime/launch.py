"""Starting a job: `launch(JobConfig(...))` indexes the checkpoint, probes the cluster, plans,
reserves the GPUs and loads every stage, releasing everything on any failure; `attach(name)`
finds a named load again from any process. Both return a `coordinator.runtime.job.Job`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from coordinator.config import ConfigError, JobConfig
from coordinator.family_check import check_family
from coordinator.planning.batch_size import plan_job, plan_replicas
from coordinator.planning.checkpoint import load_index
from coordinator.planning.context import check_max_seq_len
from coordinator.planning.planner import Plan
from coordinator.runtime import recovery, registry
from coordinator.runtime.group import WorkerGroup
from coordinator.runtime.job import Job
from coordinator.runtime.keeper import find as find_keeper
from coordinator.runtime.keeper import start as start_keeper
from coordinator.runtime.probing import model_of, probe_cluster
from coordinator.runtime.session import RaySession, connect


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
        snapshot, envs = probe_cluster(config, model=model_of(index, config))
        config, the_plan = plan_job(config, index, snapshot)
        return _start(config, index, the_plan, envs, session, name, progress, record, lease_s)
    except BaseException:
        if record is not None:
            registry.release(record)  # ours, by handle: never another load's record
        session.close()
        raise


def launch_replicas(
    config: JobConfig,
    name: str,
    *,
    progress: Callable[[int, int], None] | None = None,
    lease_s: float | None = None,
) -> list[Job]:
    """The job as `config.replicas` pipelines (0: the count with the most tokens/s), each a
    named load `{name}-{r}` on its own GPUs (`JobConfig.nodes`) with the plan the replica
    search made for it; the cluster is probed once for all. A single pipeline is the load
    `name` itself. On any failure every replica started is released. `lease_s`: each is
    leased (see `launch`)."""
    if config.replicas == 1:
        return [launch(config, progress=progress, name=name, lease_s=lease_s)]
    if lease_s is not None and not lease_s > 0:
        raise ConfigError(f"lease_s={lease_s}: a lease is a positive time")
    index = _checked_index(config)
    session = connect(config)
    jobs: list[Job] = []
    try:
        snapshot, envs = probe_cluster(config, model=model_of(index, config))
        chosen = plan_replicas(config, index, snapshot)
        many = len(chosen.plans) > 1
        for r, the_plan in enumerate(chosen.plans):
            replica = dataclasses.replace(
                config,
                replicas=1,
                max_batch=the_plan.options.max_batch,
                micro_batches=the_plan.options.micro_batches,
                nodes=recovery.nodes_of(the_plan) if many else "",
            )
            load = f"{name}-{r}" if many else name
            # the first replica owns the Ray this call connected to; the others only use it
            jobs.append(
                _start(
                    replica,
                    index,
                    the_plan,
                    envs,
                    session if not jobs else RaySession(owned=False),
                    load,
                    progress,
                    registry.claim(load),
                    lease_s,
                )
            )
        return jobs
    except BaseException:
        for job in reversed(jobs):
            registry.forget(job.name)  # a replica this call made and loaded: all of it
            job.close()
        if not jobs:
            session.close()
        raise


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
) -> Job:
    """Reserve the plan's GPUs, start and load its workers: a Job (named: detached, recorded,
    kept by a keeper). `record`: the name's record, claimed by the caller (`registry.claim`).
    On failure what this started is released: its workers, its placement groups, its keeper
    and the record; never anything found by name, which may be another load's. The session is
    the caller's to close."""
    job = None
    keeper = None
    try:
        group = WorkerGroup(config=config, index=index, plan=the_plan, load_name=name)
        job = Job(group=group, session=session, name=name)
        if name is not None:
            group.names = job.new_worker_names
        group.start(envs)
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
