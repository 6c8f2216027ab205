"""The job's workers as one group: the plan, the worker handles, their placement groups, and
every change to them (start, load, replace, re-plan, stop) in one place.

Each planned GPU is a bundle ({GPU: 1, CPU: cpus_per_worker}) of a Ray placement group, held to
its node by a label selector on `ray.io/node-id`: Ray reserves all the bundles of a group or
none (its own gang scheduling), so a job never starts half its workers and then waits on GPUs
that another job holds. A worker is started in its bundle; a replacement takes the same bundle
(same node); after a re-plan, surviving workers keep their bundles and the stages left over get
a new placement group of their own. `stop` kills every worker and removes every placement group
of the group, whatever state it is in.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import CheckpointIndex
from coordinator.planning.planner import Plan, StagePlan
from coordinator.runtime.errors import LaunchError, WorkerLostError
from coordinator.runtime.record import NAMESPACE, remove_group
from offload.errors import StageBrokenError
from worker.actor import StageActor
from worker.snapshot import StageSnapshot
from worker.spec import StageSpec

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it: a bundle's node selector
PING_TIMEOUT_S = 30.0  # one bound for the pings of all stages at once
# After a step timed out: a worker that does not answer a ping within this is hung (an idle
# one answers in milliseconds; every step of the engine has ended or was given up by then)
HUNG_PING_S = 10.0
RECONFIGURE_TIMEOUT_S = 120.0  # a survivor moves its layers in memory: no disk reads


@dataclass(frozen=True, slots=True)
class Slot:
    """A worker's reserved place: bundle `bundle` of placement group `group`, named
    `group_name` in a named load (`group` None: a named load's group that is gone)."""

    group: PlacementGroup | None
    bundle: int
    group_name: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerHandle:
    """An actor and what it was started for; `actor` is None when a named load's worker was
    not found on attach (lost), `name` its actor name in a named load."""

    actor: ray.actor.ActorHandle | None
    spec: StageSpec
    node_id: str
    hostname: str
    name: str | None = None
    slot: Slot | None = None


def stage_specs(
    config: JobConfig, index: CheckpointIndex, the_plan: Plan, envs: dict[str, tuple[dict, dict]]
) -> list[StageSpec]:
    by_name = {layer.name: layer for layer in index.layers}
    return [
        StageSpec(
            stage=s.stage,
            num_stages=len(the_plan.stages),
            checkpoint_dir=str(index.root.resolve()),
            config=index.config,
            dtype=index.dtype,
            files=index.identities,
            layers=tuple(by_name[name] for name in s.layers),
            offloaded=s.offloaded,
            offload_unit=s.offload_unit,
            prefetch_step=s.prefetch_step,
            backend=s.backend,  # the node's: "auto" resolved by its probe
            backend_reason=s.backend_reason,
            offload_dtype=the_plan.options.offload_dtype,
            expert_fetch=s.expert_fetch,  # the plan's, per stage
            expert_cache=s.expert_cache,
            host_expert_rows=s.host_expert_rows,
            resident_stored=s.resident_stored,  # the plan's, per stage
            stored_expert_capacity=s.stored_expert_capacity,
            kv_slots=config.max_batch if config.max_seq_len else 0,
            kv_blocks=config.kv_blocks(),
            reserve_bytes=the_plan.options.reserve_bytes,
            env=envs.get(s.node_id, ({}, {}))[0],
            env_origins=envs.get(s.node_id, ({}, {}))[1],
        )
        for s in the_plan.stages
    ]


@dataclass
class WorkerGroup:
    """The workers of one job. `names` gives the actor names of a named load's new workers
    (detached actors and placement groups, so they outlive the driver); None for an unnamed
    job, whose workers die with the driver."""

    config: JobConfig
    index: CheckpointIndex
    plan: Plan
    handles: list[WorkerHandle] = field(default_factory=list)
    names: Callable[[int], list[str]] | None = None
    load_name: str | None = None  # the named load this group belongs to
    placement_groups: list[tuple[str | None, PlacementGroup]] = field(default_factory=list)
    # set by whoever started it when its load is abandoned (another replica of the launch
    # failed): a worker lost from then on is not replaced, so the load's wait ends at once
    abandoned: threading.Event = field(default_factory=threading.Event)

    # starting
    def start(self, envs: dict[str, tuple[dict, dict]]) -> None:
        """Reserve every planned GPU at once, then start one worker per stage in its bundle."""
        specs = stage_specs(self.config, self.index, self.plan, envs)
        slots = self._reserve(list(self.plan.stages))
        try:
            self.handles = self._start(specs, list(self.plan.stages), slots)
        except BaseException:  # nothing started: the GPUs it reserved go back now
            self._drop(slots)
            raise

    def _drop(self, slots: Sequence[Slot]) -> None:
        """Remove the placement groups of `slots` (reserved for workers that did not start),
        and forget them."""
        groups = {id(slot.group): slot.group for slot in slots if slot.group is not None}
        for group in groups.values():
            remove_group(group)
        self.placement_groups = [(n, g) for n, g in self.placement_groups if id(g) not in groups]

    def _reserve(self, stages: Sequence[StagePlan]) -> list[Slot]:
        """A placement group with one bundle per stage on the stage's node, all or nothing,
        ready within placement_timeout_s; removed again if not (a group left waiting would
        take the GPUs later, from whoever needs them then), and the group is as it was."""
        bundle = {"GPU": 1, "CPU": self.config.cpus_per_worker}
        name, options = None, {}
        if self.load_name is not None:
            used = [int(n.rpartition("-")[2]) for n, _ in self.placement_groups if n]
            name = f"load:{self.load_name}:pg-{1 + max(used, default=-1)}"
            options = {"name": name, "lifetime": "detached"}
        group = placement_group(
            [dict(bundle) for _ in stages],
            strategy="PACK",
            bundle_label_selector=[{NODE_ID_LABEL: s.node_id} for s in stages],
            **options,
        )
        try:
            ready, _ = ray.wait([group.ready()], timeout=self.config.placement_timeout_s)
        except BaseException:
            remove_group(group)
            raise
        if not ready:
            remove_group(group)
            wanted = ", ".join(f"{s.hostname or s.node_id[:8]} GPU {s.gpu_index}" for s in stages)
            raise LaunchError(
                f"the cluster did not reserve {len(stages)} GPU(s) ({wanted}) within "
                f"{self.config.placement_timeout_s:.0f} s (placement_timeout_s): other jobs hold "
                "them, or the nodes left; nothing was started"
            )
        self.placement_groups.append((name, group))
        return [Slot(group=group, bundle=i, group_name=name) for i in range(len(stages))]

    def _start(
        self, specs: Sequence[StageSpec], stages: Sequence[StagePlan], slots: Sequence[Slot]
    ) -> list[WorkerHandle]:
        remote_cls = ray.remote(StageActor)
        names = self.names(len(specs)) if self.names is not None else [None] * len(specs)
        handles: list[WorkerHandle] = []
        try:
            for spec, stage, slot, name in zip(specs, stages, slots, names, strict=True):
                options = {
                    "num_gpus": 1,
                    "num_cpus": self.config.cpus_per_worker,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        slot.group, placement_group_bundle_index=slot.bundle
                    ),
                    "max_restarts": 0,
                }
                if spec.env:
                    options["runtime_env"] = {"env_vars": dict(spec.env)}
                if name is not None:
                    options.update(name=name, namespace=NAMESPACE, lifetime="detached")
                actor = remote_cls.options(**options).remote(
                    spec,
                    # Logical GPUs of an embedded Ray are simulated: the CPU stands in for
                    # each, even on a host with a real GPU that CUDA_VISIBLE_DEVICES may name.
                    device="cpu" if self.config.gpus else None,
                    gpu_memory_bytes=self.config.gpu_memory_bytes,
                    num_threads=self.config.cpus_per_worker,
                    attn_implementation=self.config.attn_implementation,
                    snapshot_interval_s=self.config.snapshot_interval_s,
                )
                handles.append(
                    WorkerHandle(
                        actor=actor,
                        spec=spec,
                        node_id=stage.node_id,
                        hostname=stage.hostname,
                        name=name,
                        slot=slot,
                    )
                )
        except BaseException:
            kill(handles)
            raise
        return handles

    # loading
    def load(self, progress: Callable[[int, int], None] | None = None) -> list[StageSnapshot]:
        return load_workers(self.handles, self.config.load_timeout_s, progress)

    # liveness
    def dead_stages(self) -> list[int]:
        """Stages whose worker is gone (its actor died or its node left), from one ping of
        every stage at once under one bound. A worker busy past PING_TIMEOUT_S is not dead."""
        return sorted(gone_parts(dict(enumerate(h.actor for h in self.handles)), PING_TIMEOUT_S))

    def kill_hung(self, timeout_s: float = HUNG_PING_S) -> list[int]:
        """After a step timed out: kill the stages whose worker is alive but does not answer
        a ping within `timeout_s` (hung), so that recovery replaces them as lost ones; returns
        them. A stage's calls run in order, so a stage after a hung one may be silent only
        because its step waits on the hung one's output: the first silent stage is killed,
        then the later silent ones are asked again (their wait failed with it), and so on."""
        killed: list[int] = []
        suspects = list(range(len(self.handles)))
        while suspects:
            parts = {s: self.handles[s].actor for s in suspects}
            silent = sorted(silent_parts(parts, timeout_s))
            if not silent:
                break
            first = silent[0]
            kill([self.handles[first]])
            killed.append(first)
            suspects = silent[1:]
        return killed

    # changes
    def replace(self, stages: list[int]) -> None:
        """New workers for `stages`, each in its predecessor's bundle (same node, same spec)."""
        lost = [self.handles[s] for s in stages]
        kill(lost)  # releases their names and their bundles' resources
        unknown = [h.spec.stage for h in lost if h.slot is None or h.slot.group is None]
        if unknown:
            self._reserve_again(stages)
            lost = [self.handles[s] for s in stages]
        try:
            started = self._start(
                [h.spec for h in lost],
                [self.plan.stages[s] for s in stages],
                [h.slot for h in lost],
            )
        except BaseException:
            if unknown:  # the group reserved just now for them: never used
                self._drop([h.slot for h in lost])
                for stage in stages:
                    self.handles[stage] = replace(self.handles[stage], slot=None)
            raise
        for stage, handle in zip(stages, started, strict=True):
            self.handles[stage] = handle

    def _reserve_again(self, stages: list[int]) -> None:
        slots = self._reserve([self.plan.stages[s] for s in stages])
        for stage, slot in zip(stages, slots, strict=True):
            self.handles[stage] = replace(self.handles[stage], slot=slot)

    def apply(
        self, new_plan: Plan, envs: dict[str, tuple[dict, dict]], matched: dict[int, int]
    ) -> tuple[list[int], float]:
        """Take `new_plan`: each new stage in `matched` goes to that surviving worker (index into
        the current handles), which keeps its bundle and reconfigures in memory; the other
        stages get new workers, in the bundle of a lost worker on their node where there is
        one, else in a new placement group; unmatched survivors are stopped. The GPUs are
        reserved before anything is stopped or changed: a reservation that fails
        (LaunchError) leaves the group on its old plan, as it was. Returns the stages on new
        workers and the survivors' reconfigure time."""
        specs = stage_specs(self.config, self.index, new_plan, envs)
        kept = set(matched.values())
        missing = [s for s in range(len(specs)) if s not in matched]
        spare: dict[str, list[Slot]] = {}  # bundles this group holds that no kept worker uses
        for i, h in enumerate(self.handles):
            if i not in kept and h.slot is not None and h.slot.group is not None:
                spare.setdefault(h.node_id, []).append(h.slot)
        slots: dict[int, Slot] = {}
        for s in missing:
            if spare.get(new_plan.stages[s].node_id):
                slots[s] = spare[new_plan.stages[s].node_id].pop(0)
        rest = [s for s in missing if s not in slots]
        if rest:
            slots.update(zip(rest, self._reserve([new_plan.stages[s] for s in rest]), strict=True))
        # reserved: from here on the group changes
        kill([h for i, h in enumerate(self.handles) if i not in kept])
        handles: list[WorkerHandle | None] = [None] * len(specs)
        refs = []
        for stage, i in matched.items():
            old = self.handles[i]
            handles[stage] = replace(old, spec=specs[stage])
            refs.append(old.actor.reconfigure.remote(specs[stage]))
        self.plan = new_plan
        if missing:
            started = self._start(
                [specs[s] for s in missing],
                [new_plan.stages[s] for s in missing],
                [slots[s] for s in missing],
            )
            for stage, handle in zip(missing, started, strict=True):
                handles[stage] = handle
        self.handles = list(handles)
        start = time.perf_counter()
        wait_workers(refs, RECONFIGURE_TIMEOUT_S, [self.handles[s] for s in matched])
        return missing, time.perf_counter() - start

    # stopping
    def stop(self) -> None:
        """Kill every worker and remove every placement group of the group."""
        kill(self.handles)
        self.handles = []
        for _, group in self.placement_groups:
            remove_group(group)
        self.placement_groups = []


def gone_parts(parts: dict, timeout_s: float) -> list:
    """Which of `parts` (key -> actor handle, None: gone) are gone: each pinged at once; one
    that does not answer within `timeout_s` is busy, not gone (a bounded, cheap check). A
    worker that answers that its stage is broken (a load or reconfigure failed:
    `StageBrokenError`) is as good as gone: it is replaced."""
    refs = {what: actor.ping.remote() for what, actor in parts.items() if actor is not None}
    dead = [what for what, actor in parts.items() if actor is None]
    if refs:
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for what, ref in refs.items():
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    dead.append(what)
                except ray.exceptions.RayTaskError as exc:
                    if not isinstance(exc.cause, StageBrokenError):
                        raise
                    dead.append(what)
    return dead


def silent_parts(parts: dict, timeout_s: float) -> list:
    """Which of `parts` (key -> actor handle) are alive but do not answer a ping within
    `timeout_s` (busy, or hung); the gone ones are not among them."""
    refs = {what: actor.ping.remote() for what, actor in parts.items() if actor is not None}
    if not refs:
        return []
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    return [what for what, ref in refs.items() if ref not in ready]


def kill(handles: Sequence[WorkerHandle]) -> None:
    for handle in handles:
        if handle.actor is None:
            continue
        try:
            ray.kill(handle.actor, no_restart=True)
        except Exception as exc:  # already dead: nothing to release
            print(
                f"note: could not kill worker of stage {handle.spec.stage}: {exc}", file=sys.stderr
            )


def load_workers(
    handles: list[WorkerHandle],
    timeout_s: float,
    progress: Callable[[int, int], None] | None = None,
) -> list[StageSnapshot]:
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
