"""Starting a job: `launch(JobConfig(...))` indexes the checkpoint, probes the cluster, plans,
reserves the GPUs and loads every stage, releasing everything on any failure; `attach(name)`
finds a named load again from any process. Both return a `coordinator.runtime.job.Job`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from coordinator.config import ConfigError, JobConfig
from coordinator.family_check import check_family
from coordinator.planning.batch_size import plan_job
from coordinator.planning.checkpoint import load_index
from coordinator.planning.context import check_max_seq_len
from coordinator.planning.planner import Plan
from coordinator.runtime import recovery, registry
from coordinator.runtime.group import WorkerGroup
from coordinator.runtime.job import Job
from coordinator.runtime.keeper import find as find_keeper
from coordinator.runtime.keeper import start as start_keeper
from coordinator.runtime.probing import model_of, probe_cluster
from coordinator.runtime.session import connect


def launch(
    config: JobConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    name: str | None = None,
    plan: Plan | None = None,
) -> Job:
    """Index, probe, plan, reserve the GPUs, start and load. On any failure everything started
    is released. With `name`, the workers and their placement groups are detached and named,
    so they outlive this process (on a cluster) and `attach(name)` finds them again. `plan`:
    the plan to run (a replica's, made with the others), instead of planning here."""
    if config.replicas != 1:
        raise ConfigError(f"replicas={config.replicas}: a job runs one pipeline; several are "
                          "served as replicas (offloadctl serve, launch_replicas)")  # fmt: skip
    index = load_index(config.checkpoint, dtype=config.dtype)
    check_max_seq_len(index.config, config.max_seq_len)
    # An untested family is run split and whole in this process first: refused here, before
    # Ray and any worker start, when its split does not reproduce the model.
    check_family(index.config, attn_implementation=config.attn_implementation)
    session = connect(config)
    job = None
    claimed = False  # the name is ours to release: no load of that name existed
    try:
        if name is not None:
            registry.check_name(name)
            claimed = True
        snapshot, envs = probe_cluster(config, model=model_of(index, config))
        if plan is None:
            config, the_plan = plan_job(config, index, snapshot)
        else:
            config, the_plan = config, plan
        group = WorkerGroup(config=config, index=index, plan=the_plan, load_name=name)
        job = Job(group=group, session=session, name=name)
        if name is not None:
            group.names = job.new_worker_names
        group.start(envs)
        if name is not None:  # recorded first, so `unload` finds a load interrupted midway
            registry.save(name, config, group, [])
        job.load_reports = recovery.load_recovering(group, job.record_event, progress)
        if name is not None:  # from now on the keeper changes the load, no driver
            job.keeper = start_keeper(name, index)
        return job
    except BaseException:
        if job is not None:
            job.group.stop()
        if claimed:
            registry.forget(name)  # its record, and whatever of it has a name
        session.close()
        raise


def launch_replicas(config: JobConfig, name: str, *,
                    progress: Callable[[int, int], None] | None = None) -> list[Job]:  # fmt: skip
    """The job as `config.replicas` pipelines (0: the count with the most tokens/s), each a
    named load `{name}-{r}` on its own GPUs (`JobConfig.nodes`), launched with the plan the
    replica search made for it. A single pipeline is the load `name` itself. On any failure
    every replica started is released."""
    from coordinator.planning.replicas import choose_replicas
    from coordinator.planning.throughput import BATCHES

    if config.replicas == 1:
        return [launch(config, progress=progress, name=name)]
    index = load_index(config.checkpoint, dtype=config.dtype)
    check_max_seq_len(index.config, config.max_seq_len)
    check_family(index.config, attn_implementation=config.attn_implementation)
    session = connect(config)
    jobs: list[Job] = []
    try:
        snapshot, _ = probe_cluster(config, model=model_of(index, config))
        chosen = choose_replicas(
            index.layers, snapshot, config.plan_options(), replicas=config.replicas,
            batches=[config.max_batch] if config.max_batch else BATCHES,
            micro_batches=config.micro_batches, max_token_latency_s=config.max_token_latency_s)  # fmt: skip
        many = len(chosen.plans) > 1
        for r, the_plan in enumerate(chosen.plans):
            replica = dataclasses.replace(
                config, replicas=1, max_batch=the_plan.options.max_batch,
                micro_batches=the_plan.options.micro_batches,
                nodes=recovery.nodes_of(the_plan) if many else "")  # fmt: skip
            jobs.append(launch(replica, progress=progress, name=f"{name}-{r}" if many else name,
                               plan=the_plan))  # fmt: skip
        jobs[0].session = session  # the first replica owns the Ray this call connected to
        return jobs
    except BaseException:
        for job in reversed(jobs):
            registry.forget(job.name)
            job.close()
        session.close()
        raise


def attach(name: str, *, address: str | None = None) -> Job:
    """The named load `name` on the cluster at `address` (or RAY_ADDRESS)."""
    session = connect(JobConfig(checkpoint="-", address=address or "auto"))
    try:
        _, record = registry.load_record(name)
        config = registry.config_of(record)
        index = load_index(config.checkpoint, dtype=config.dtype)
        group = registry.group_of(record, index)
        job = Job(group=group, session=session, name=name, events=list(record["events"]),
                  next_worker=registry.next_worker_number(record),
                  keeper=find_keeper(name))  # fmt: skip
        group.names = job.new_worker_names
        return job
    except BaseException:
        session.close()
        raise


__all__ = ["attach", "launch", "launch_replicas"]
