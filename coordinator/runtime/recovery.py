"""Recovery from lost workers and lost nodes: a policy that reads the worker group's state and
decides, and the group applies the decision.

A worker is lost when its actor dies (its process was killed or crashed) or its node leaves
the cluster. When every lost worker's node is still alive, each gets a replacement in its own
bundle (same node, same stage), and only that stage is read again. When a node is gone, the
job is re-planned on the GPUs that are left (more offloading where needed): each surviving
worker is matched to the new stage that shares the most bytes with what it holds and keeps
those layers in memory (`StageWorker.reconfigure`), new workers take the stages left over in a
new placement group, and only the layers that moved are read from disk. If what is left cannot
hold the model, a `PlanError` says so with the numbers, and the surviving workers stay as they
were: the job can still be inspected (`status`) and released (`unload`), and a later forward
tries again (a node may have come back).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import ray

from coordinator.planning.planner import Plan, PlanError, StagePlan, plan
from coordinator.planning.reserve import job_options
from coordinator.runtime.desk import Turn
from coordinator.runtime.errors import LaunchError, WorkerLostError
from coordinator.runtime.group import WorkerGroup, WorkerHandle, kill
from coordinator.runtime.probing import gpu_nodes, model_of, probe_cluster
from worker.snapshot import StageSnapshot

# Each round replaces what was lost; a worker lost during a round's load starts another.
MAX_RECOVERY_ROUNDS = 3


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do about the lost stages: replace them in place (no node gone), or take a new
    plan whose stages `matched` maps to surviving workers (indexes into the group's handles)."""

    lost: list[int]
    gone: list[str] = field(default_factory=list)  # nodes that left (hostnames)
    plan: Plan | None = None
    envs: dict = field(default_factory=dict)
    matched: dict[int, int] = field(default_factory=dict)
    probe_s: float = 0.0


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


def holdings(handles: Sequence[WorkerHandle]) -> tuple[dict[str, int], dict[str, list]]:
    """Per node, what these (surviving) workers hold that a new plan replaces rather than adds
    to: the host bytes of their arenas, and the workers themselves, each of which answers a
    probe for its own GPU with its stage's bytes counted as free (`probe_cluster`)."""
    held: dict[str, int] = defaultdict(int)
    probers: dict[str, list] = defaultdict(list)
    for h in handles:
        held[h.node_id] += sum(
            x.unit_bytes(h.spec.offload_unit) for x in h.spec.layers if x.name in h.spec.offloaded
        )
        probers[h.node_id].append(h.actor)
    return dict(held), dict(probers)


def decide(group: WorkerGroup, dead: list[int], left_out: frozenset[str] = frozenset()) -> Decision:
    """The policy: in place when every lost worker's node is alive, else a new plan on the GPU
    nodes left, their budgets crediting what the survivors already hold. Nodes in `left_out`
    (node ids whose workers keep dying: see coordinator.runtime.keeper) count as gone."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]} - left_out
    lost = [group.handles[i] for i in dead]
    gone = sorted({h.hostname or h.node_id[:8] for h in lost if h.node_id not in alive})
    if not gone:
        return Decision(lost=dead)
    if not gpu_nodes(exclude=left_out):
        raise PlanError(
            f"stages {dead} were lost with node(s) {', '.join(gone)} and no GPU node is left; "
            "add nodes and run again, or unload"
        )
    survivors = [
        (i, h) for i, h in enumerate(group.handles) if i not in dead and h.node_id not in left_out
    ]
    held, probers = holdings([h for _, h in survivors])
    start = time.perf_counter()
    # The GPUs this job may plan on: free ones, its survivors' and the bundles of its workers
    # lost on nodes still alive (apply reuses those; a task in each measures its GPU, so a
    # broken worker's process is stopped first); never another load's (a replica's `nodes` are
    # its old GPUs: the re-plan may take any free one).
    kept = [h for h in lost if h.node_id in alive and h.slot is not None and h.slot.group]
    kill(kept)
    bundles: dict[str, list] = defaultdict(list)
    for h in kept:
        bundles[h.node_id].append((h.slot.group, h.slot.bundle))
    own = [h.node_id for _, h in survivors] + [h.node_id for h in kept]
    config = dataclasses.replace(group.config, nodes="") if group.config.nodes else group.config
    snapshot, envs = probe_cluster(
        config,
        held_bytes=held,
        probers=probers,
        exclude=left_out,
        model=model_of(group.index, config),
        own=own,
        bundles=dict(bundles),
    )
    probe_s = time.perf_counter() - start
    try:
        new_plan = plan(
            group.index.layers, snapshot, job_options(group.config, group.index, snapshot)
        )
    except PlanError as exc:
        raise PlanError(
            f"stages {dead} were lost with node(s) {', '.join(gone)} ({len(dead)} GPU(s)); the "
            f"{snapshot.num_gpus} GPU(s) left cannot hold the model "
            f"({group.index.total_bytes} bytes): {exc}"
        ) from None
    layer_bytes = {layer.name: layer.nbytes for layer in group.index.layers}
    matched = match_survivors(
        [(h.node_id, frozenset(x.name for x in h.spec.layers)) for _, h in survivors],
        new_plan.stages,
        layer_bytes,
    )
    return Decision(
        lost=dead,
        gone=gone,
        plan=new_plan,
        envs=envs,
        probe_s=probe_s,
        matched={stage: survivors[i][0] for stage, i in matched.items()},
    )


def nodes_of(the_plan) -> str:
    """`JobConfig.nodes` of the GPUs a plan uses."""
    counts = Counter(s.node_id for s in the_plan.stages)
    return ",".join(f"{node}={n}" for node, n in counts.items())


def apply(group: WorkerGroup, decision: Decision) -> dict:
    """Carry out `decision` on the group (nothing is loaded yet); returns the event. A replica
    (a job with `nodes`) takes the new plan's GPUs as its own."""
    if decision.plan is None:
        hosts = sorted({group.handles[s].hostname for s in decision.lost})
        group.replace(decision.lost)
        return {"event": "replaced workers", "stages": decision.lost, "hosts": hosts}
    new_workers, reconfigure_s = group.apply(decision.plan, decision.envs, decision.matched)
    if group.config.nodes:
        group.config = dataclasses.replace(group.config, nodes=nodes_of(decision.plan))
    return {
        "probe_s": round(decision.probe_s, 3),
        "reconfigure_s": round(reconfigure_s, 3),
        "event": "re-planned",
        "lost_stages": decision.lost,
        "lost_nodes": decision.gone,
        "stages": len(decision.plan.stages),
        "stages_on_survivors": sorted(decision.matched),
        "stages_on_new_workers": new_workers,
        "offloaded_bytes": sum(s.offloaded_bytes for s in decision.plan.stages),
    }


def replan(group: WorkerGroup, dead: list[int], left_out: frozenset[str] = frozenset()) -> dict:
    """`decide`, then `apply`, in the desk's turn (`coordinator.runtime.desk`): a re-plan probes
    and reserves GPUs, one at a time with the cluster's other loads. Returns the event."""
    with Turn(f"recovery of {group.load_name!r}" if group.load_name else "a job's recovery"):
        return apply(group, decide(group, dead, left_out))


Record = Callable[[dict], None]  # keeps an event (the job's record_event)


def add_event(events: list[dict], event: dict) -> None:
    """Append `event` (with its time) to `events`; the same failure again (a watcher retrying
    on an unchanged cluster) is counted on the last event instead of listed again."""
    last = events[-1] if events else {}
    if "error" in event and all(last.get(k) == v for k, v in event.items()):
        last.update(time=time.time(), repeats=last.get("repeats", 1) + 1)
    else:
        events.append({"time": time.time(), **event})


def load_recovering(group: WorkerGroup, record: Record, progress=None) -> list[StageSnapshot]:
    """Load every worker of `group`; a worker lost meanwhile is replaced (bounded rounds) and
    the load finishes where it stopped: workers that finished read nothing again. Not in an
    abandoned group: its workers were killed on purpose."""
    for round_ in range(MAX_RECOVERY_ROUNDS + 1):
        try:
            return group.load(progress)
        except WorkerLostError:
            dead = group.dead_stages()
            if round_ == MAX_RECOVERY_ROUNDS or not dead or group.abandoned.is_set():
                raise
            record(replan(group, dead))
    raise AssertionError("unreachable")


def recover(
    group: WorkerGroup,
    record: Record,
    *,
    dead: list[int] | None = None,
    left_out: frozenset[str] = frozenset(),
) -> tuple[list[int], list[StageSnapshot]]:
    """Find lost stages (or take `dead`), replace them and load what moved; returns the stages
    that were lost and the load reports (none when nothing was lost)."""
    start = time.perf_counter()
    dead = group.dead_stages() if dead is None else dead
    if not dead:
        return [], []
    try:
        event = replan(group, dead, left_out)
    except (PlanError, LaunchError) as exc:  # no plan, or its GPUs not reserved: unchanged
        record({"event": "re-plan failed", "lost_stages": dead, "error": str(exc)})
        raise
    loading = time.perf_counter()
    try:
        reports = load_recovering(group, record)
    except Exception as exc:  # the workers changed all the same: say so, with why it stopped
        record({**event, "error": str(exc)})
        raise
    now = time.perf_counter()
    record({**event, "load_s": round(now - loading, 3), "recovery_s": round(now - start, 3)})
    return dead, reports
