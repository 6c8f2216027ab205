"""Recovery from lost workers and lost nodes.

A worker is lost when its actor dies (its process was killed or crashed) or its node leaves
the cluster. When every lost worker's node is still alive, each gets a replacement on the same
node with the same stage, and only that stage is read again. When a node is gone, the job is
re-planned on the GPUs that are left (more offloading where needed): each surviving worker is
matched to the new stage that shares the most bytes with what it holds and keeps those layers
in memory (`StageWorker.reconfigure`), new workers take the stages left over, and only the
layers that moved are read from disk. If what is left cannot hold the model, a `PlanError`
says so with the numbers, and the surviving workers stay as they were: the job can still be
inspected (`status`) and released (`unload`), and a later forward tries again (a node may have
come back).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import ray

from coordinator.planning.planner import PlanError, StagePlan, plan
from coordinator.runtime.job import Job, stage_specs
from coordinator.runtime.launcher import (
    WorkerHandle,
    WorkerLostError,
    gpu_nodes,
    kill_workers,
    load_workers,
    probe_cluster,
    start_workers,
    wait_workers,
)

# Each round replaces what was lost; a worker lost during a round's load starts another.
MAX_RECOVERY_ROUNDS = 3
RECONFIGURE_TIMEOUT_S = 120.0  # a survivor moves its layers in memory: no disk reads


def match_survivors(
    survivors: Sequence[tuple[str, frozenset[str]]],
    stages: Sequence[StagePlan],
    layer_bytes: Mapping[str, int],
) -> dict[int, int]:
    """New stage -> index of the surviving worker (node id, layers it holds) that takes it.

    Only a survivor on the stage's node can take it; pairs sharing the most bytes are matched
    first. A survivor is reused even when it shares nothing with its new stage: that saves
    starting a process. Survivors left unmatched are released by the caller.
    """
    pairs = []
    for stage in stages:
        for i, (node_id, layers) in enumerate(survivors):
            if node_id == stage.node_id:
                common = sum(layer_bytes[name] for name in stage.layers if name in layers)
                pairs.append((-common, stage.stage, i))
    matched: dict[int, int] = {}
    used: set[int] = set()
    for _, stage, i in sorted(pairs):
        if stage not in matched and i not in used:
            matched[stage] = i
            used.add(i)
    return matched


def replace_lost(job: Job, dead: list[int]) -> dict:
    """Give the lost stages `dead` new workers (in place, or through a re-plan when a node is
    gone); nothing is loaded yet. Returns the event to record."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    lost = [job.workers[i] for i in dead]
    gone = sorted({h.hostname or h.node_id[:8] for h in lost if h.node_id not in alive})
    if not gone:
        return _replace_in_place(job, dead)
    return _replan(job, dead, gone)


def _replace_in_place(job: Job, dead: list[int]) -> dict:
    lost = [job.workers[i] for i in dead]
    kill_workers(lost)  # releases their names and resources
    replacements = start_workers(
        job.config,
        [h.spec for h in lost],
        [(h.node_id, h.hostname) for h in lost],
        names=job.new_worker_names(len(lost)),
    )
    for stage, handle in zip(dead, replacements, strict=True):
        job.workers[stage] = handle
    hosts = sorted({h.hostname for h in lost})
    return {"event": "replaced workers", "stages": dead, "hosts": hosts}


def _replan(job: Job, dead: list[int], gone: list[str]) -> dict:
    survivors = [h for i, h in enumerate(job.workers) if i not in dead]
    kill_workers([job.workers[i] for i in dead])
    lost_gpus = len(dead)
    if not gpu_nodes():
        raise PlanError(
            f"stages {dead} were lost with node(s) {', '.join(gone)} and no GPU node is left; "
            "add nodes and run again, or unload"
        )
    held: dict[str, int] = defaultdict(int)  # the survivors' arenas are replaced, not added
    for h in survivors:
        held[h.node_id] += sum(x.nbytes for x in h.spec.layers if x.name in h.spec.offloaded)
    start = time.perf_counter()
    probers = {h.node_id: h.actor for h in survivors}  # they answer for their nodes: no new process
    snapshot, envs = probe_cluster(job.config, held_bytes=held, probers=probers)
    probe_s = time.perf_counter() - start
    try:
        new_plan = plan(job.index.layers, snapshot, job.plan_options())
    except PlanError as exc:
        raise PlanError(
            f"stages {dead} were lost with node(s) {', '.join(gone)} ({lost_gpus} GPU(s)); the "
            f"{snapshot.num_gpus} GPU(s) left cannot hold the model "
            f"({job.index.total_bytes} bytes): {exc}"
        ) from None
    specs = stage_specs(job.config, job.index, new_plan, envs)
    layer_bytes = {layer.name: layer.nbytes for layer in job.index.layers}
    matched = match_survivors(
        [(h.node_id, frozenset(x.name for x in h.spec.layers)) for h in survivors],
        new_plan.stages,
        layer_bytes,
    )
    reused = set(matched.values())
    kill_workers([h for i, h in enumerate(survivors) if i not in reused])
    handles: list[WorkerHandle | None] = [None] * len(specs)
    refs = []
    for stage, i in matched.items():
        old = survivors[i]
        handles[stage] = WorkerHandle(actor=old.actor, spec=specs[stage], node_id=old.node_id,
                                      hostname=old.hostname, name=old.name)  # fmt: skip
        refs.append(old.actor.reconfigure.remote(specs[stage]))
    missing = [s for s in range(len(specs)) if handles[s] is None]
    started = start_workers(
        job.config,
        [specs[s] for s in missing],
        [(new_plan.stages[s].node_id, new_plan.stages[s].hostname) for s in missing],
        names=job.new_worker_names(len(missing)),
    )
    for stage, handle in zip(missing, started, strict=True):
        handles[stage] = handle
    job.workers, job.plan = list(handles), new_plan
    # The survivors' memory moves happen here; a survivor lost meanwhile starts another round.
    start = time.perf_counter()
    wait_workers(refs, RECONFIGURE_TIMEOUT_S, [handles[s] for s in matched])
    return {
        "probe_s": round(probe_s, 3),
        "reconfigure_s": round(time.perf_counter() - start, 3),
        "event": "re-planned",
        "lost_stages": dead,
        "lost_nodes": gone,
        "stages": len(specs),
        "stages_on_survivors": sorted(matched),
        "stages_on_new_workers": missing,
        "offloaded_bytes": sum(s.offloaded_bytes for s in new_plan.stages),
    }


def load_recovering(job: Job, progress=None) -> list[dict]:
    """Load every worker of `job`; a worker lost meanwhile is replaced (bounded rounds) and the
    load finishes where it stopped: workers that finished read nothing again."""
    for round_ in range(MAX_RECOVERY_ROUNDS + 1):
        try:
            return load_workers(job.workers, job.config.load_timeout_s, progress)
        except WorkerLostError:
            dead = job.dead_stages()
            if round_ == MAX_RECOVERY_ROUNDS or not dead:
                raise
            job.record_event(replace_lost(job, dead))
    raise AssertionError("unreachable")


def recover(job: Job) -> list[int]:
    """Find lost stages, replace them and load what moved; returns the stages that were lost."""
    start = time.perf_counter()
    dead = job.dead_stages()
    if not dead:
        return []
    try:
        event = replace_lost(job, dead)
    except PlanError as exc:
        job.record_event({"event": "re-plan failed", "lost_stages": dead, "error": str(exc)})
        raise
    loading = time.perf_counter()
    try:
        job.load_reports = load_recovering(job)
    except Exception as exc:  # the workers changed all the same: say so, with why it stopped
        job.record_event({**event, "error": str(exc)})
        raise
    now = time.perf_counter()
    job.record_event({**event, "load_s": round(now - loading, 3),
                      "recovery_s": round(now - start, 3)})  # fmt: skip
    return dead

