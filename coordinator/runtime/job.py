"""The Python API: `launch(JobConfig(...))` -> a running `Job` (a context manager).

    with launch(JobConfig(checkpoint="ckpt/", gpus=3, gpu_memory_bytes=...)) as job:
        print(job.plan.summary())
        logits = job.forward(input_ids)

The pipeline passes hidden states from stage to stage as Ray object refs: the driver only
chains the calls and fetches the final logits.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from coordinator.planning.planner import Plan, PlanOptions, plan
from coordinator.runtime import registry
from coordinator.runtime.launcher import (
    LaunchError,
    RaySession,
    WorkerHandle,
    WorkerLostError,
    connect,
    kill_workers,
    probe_cluster,
    start_workers,
    worker_failure,
)
from coordinator.runtime.telemetry import MetricsExporter, collect
from worker.spec import StageSpec

TELEMETRY_TIMEOUT_S = 60.0
PING_TIMEOUT_S = 30.0  # a liveness answer; a worker mid-forward answers after it
# close() waits this long for a background tick in flight; the thread is a daemon either way.
LOOP_JOIN_TIMEOUT_S = 5.0


def check_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    vocab_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """Validate a forward's inputs before anything reaches a worker; returns them with the
    position ids a mask implies (None without a mask: the model's own 0..seq-1)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
        torch.int64, torch.int32
    ):  # fmt: skip
        shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(
            f"input_ids must be a 2-D integer tensor (batch, seq), got "
            f"{getattr(input_ids, 'dtype', '')}{shape}"
        )
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty: shape {list(input_ids.shape)}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab_size and high >= vocab_size):
        bad = low if low < 0 else high
        known = f"0..{vocab_size - 1}" if vocab_size else "ids are >= 0"
        raise ValueError(f"token id {bad} is out of the vocabulary ({known})")
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or not (
        0 <= logits_to_keep <= input_ids.shape[1]
    ):  # fmt: skip
        raise ValueError(
            f"logits_to_keep={logits_to_keep!r} must be an int in 0..{input_ids.shape[1]} "
            "(0: every position)"
        )
    if attention_mask is None:
        return input_ids, None, None, logits_to_keep
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got "
            f"{list(getattr(attention_mask, 'shape', [type(attention_mask).__name__]))}"
        )
    if attention_mask.dtype.is_floating_point or not bool(
        ((attention_mask == 0) | (attention_mask == 1)).all()
    ):  # fmt: skip
        raise ValueError("attention_mask must hold integers or booleans, 1 for tokens, 0 for padding")
    mask = attention_mask.to(torch.int64)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask rows {empty} have no tokens")
    # As generate() numbers them: padding does not count; pads get position 1 (unused).
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return input_ids, mask, positions, logits_to_keep


def stage_specs(config: JobConfig, index: CheckpointIndex, the_plan: Plan,
                envs: dict[str, tuple[dict, dict]]) -> list[StageSpec]:  # fmt: skip
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
            prefetch_step=s.prefetch_step,
            backend=config.backend,
            env=envs.get(s.node_id, ({}, {}))[0],
            env_origins=envs.get(s.node_id, ({}, {}))[1],
        )
        for s in the_plan.stages
    ]


@dataclass
class Job:
    config: JobConfig
    index: CheckpointIndex
    plan: Plan
    workers: list[WorkerHandle]
    session: RaySession
    load_reports: list[dict] = field(default_factory=list)
    name: str | None = None  # a named load outlives this Job object: close() only detaches
    events: list[dict] = field(default_factory=list)  # recoveries, for telemetry
    next_worker: int = 0  # number of the next worker name of a named load
    _exporter: object | None = field(default=None, repr=False)
    # background loops by name ("export", "watch"): (thread, stop event)
    _loops: dict[str, tuple[threading.Thread, threading.Event]] = field(
        default_factory=dict, repr=False
    )
    # One pass or one recovery at a time: a watcher must not re-plan under a running forward.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits for `input_ids` (batch, seq), computed stage by stage across the cluster:
        (batch, seq, vocab), or (batch, logits_to_keep, vocab) for the last positions only (1:
        what the next token needs, without full-sequence logits crossing Ray).

        `attention_mask` (batch, seq) of 1 for tokens and 0 for padding: each row's positions
        count its tokens only, as `generate` numbers them, so a left-padded row gets the logits
        the unpadded row gets alone. A worker lost on the way is replaced (see `recover`) and
        the pass is run once more."""
        inputs = check_inputs(input_ids, attention_mask, logits_to_keep,
                              self.index.config.get("vocab_size"))  # fmt: skip
        with self._lock:
            try:
                return self._forward(*inputs)
            except (ray.exceptions.RayError, WorkerLostError) as exc:
                if not self.recover():  # every worker alive: the pass itself failed
                    if isinstance(exc, ray.exceptions.RayError):
                        raise worker_failure(exc, self.workers) from None
                    raise
                try:
                    return self._forward(*inputs)
                except ray.exceptions.RayError as again:
                    raise worker_failure(again, self.workers) from None

    def _forward(self, input_ids, attention_mask, position_ids, logits_to_keep) -> torch.Tensor:
        self._require_open()
        if any(h.actor is None for h in self.workers):  # attached to a load that lost workers
            raise WorkerLostError("a worker of this load was lost")
        ref = ray.put(input_ids)
        mask_ref = ray.put(attention_mask) if attention_mask is not None else None
        positions_ref = ray.put(position_ids) if position_ids is not None else None
        for handle in self.workers:
            ref = handle.actor.forward.remote(ref, mask_ref, positions_ref, logits_to_keep)
        try:
            return ray.get(ref, timeout=self.config.forward_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"forward did not finish within {self.config.forward_timeout_s:.0f} s "
                "(forward_timeout_s)"
            ) from None

    def _require_open(self) -> None:
        if not self.workers:
            raise RuntimeError("the job is closed")

    def dead_stages(self) -> list[int]:
        """Stages whose worker is gone (its actor died or its node left). A worker busy past
        PING_TIMEOUT_S is not called dead."""
        self._require_open()
        refs = [h.actor.ping.remote() if h.actor is not None else None for h in self.workers]
        dead = []
        for stage, ref in enumerate(refs):
            if ref is None:  # not found on attach
                dead.append(stage)
                continue
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                dead.append(stage)
            except ray.exceptions.GetTimeoutError:
                pass
        return dead

    def recover(self) -> list[int]:
        """Replace lost workers and reload only what moved; returns the stages that were lost.
        Same node when it is alive, else a new plan on the GPUs left (see coordinator.runtime.recovery);
        `PlanError` when those cannot hold the model."""
        from coordinator.runtime.recovery import recover

        with self._lock:
            return recover(self)

    def plan_options(self) -> PlanOptions:
        return PlanOptions(
            reserve_bytes=self.config.reserve_bytes, prefetch_step=self.config.prefetch_step
        )

    def new_worker_names(self, count: int) -> list[str] | None:
        """Actor names for `count` new workers of a named load (None for an unnamed job)."""
        if self.name is None:
            return None
        first, self.next_worker = self.next_worker, self.next_worker + count
        return [registry.worker_name(self.name, n) for n in range(first, first + count)]

    def record_event(self, event: dict) -> None:
        """Keep a recovery event; a named load also keeps it (and its new plan and workers) in
        its record, so `status` from another process shows it."""
        last = self.events[-1] if self.events else {}
        if "error" in event and all(last.get(k) == v for k, v in event.items()):
            # The same failure again (a watcher retrying): count it, do not flood the list.
            last.update(time=time.time(), repeats=last.get("repeats", 1) + 1)
        else:
            self.events.append({"time": time.time(), **event})
        if self.name is not None:
            registry.update(self.name, self.plan.to_json(), [h.name for h in self.workers],
                            self.events)  # fmt: skip

    def telemetry(self) -> list[dict]:
        """A fresh memory snapshot from every worker (see StageWorker.report); a stage whose
        worker is lost gets a stub with `lost: True` instead (see telemetry.collect)."""
        self._require_open()
        refs = [h.actor.report.remote() if h.actor is not None else None for h in self.workers]
        try:
            return collect(self.plan.stages, refs, TELEMETRY_TIMEOUT_S)
        except TimeoutError as exc:
            raise LaunchError(str(exc)) from None

    def export_metrics(self) -> list[dict]:
        """Snapshot every worker and publish the numbers as Ray gauges (Prometheus)."""
        if self._exporter is None:
            self._exporter = MetricsExporter()
        reports = self.telemetry()
        self._exporter.export(reports, self.events)
        return reports

    def export_metrics_every(self, interval_s: float) -> None:
        """Publish the gauges every `interval_s` seconds from a background thread, until
        close(). A failed snapshot is reported on stderr and retried at the next tick."""
        self._every("export", interval_s, self.export_metrics)

    def watch(self, interval_s: float) -> None:
        """Check every stage every `interval_s` seconds from a background thread and recover a
        lost one at once, rather than at the next forward. Until close(); a recovery that fails
        (say, a PlanError) is recorded in `events` and tried again at the next tick."""
        self._every("watch", interval_s, self._check)

    def _check(self) -> None:
        with self._lock:
            if self.workers and self.dead_stages():
                self.recover()

    def _every(self, name: str, interval_s: float, action: Callable[[], object]) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self._stop_loop(name)  # one loop of a kind at a time
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    action()
                except Exception as exc:  # a worker may be busy or gone: say so, keep going
                    print(f"{name}: {exc}", file=sys.stderr)

        thread = threading.Thread(target=loop, name=f"offload-{name}", daemon=True)
        thread.start()
        self._loops[name] = (thread, stop)

    def _stop_loop(self, name: str) -> None:
        if name in self._loops:
            thread, stop = self._loops.pop(name)
            stop.set()
            thread.join(timeout=LOOP_JOIN_TIMEOUT_S)

    def close(self) -> None:
        """Release the workers; for a named load on a cluster, only disconnect (use
        `registry.unload` to release it)."""
        for name in list(self._loops):
            self._stop_loop(name)
        with self._lock:  # a recovery in flight finishes first: nothing it starts is left over
            if self.name is None or self.session.owned:
                kill_workers(self.workers)
            self.workers = []
        self.session.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(
    config: JobConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    name: str | None = None,
) -> Job:
    """Index, probe, plan, start and load. On any failure everything started is released.
    With `name`, the workers are detached, named actors that outlive this process (on a
    cluster) and `attach(name)` finds them again."""
    from coordinator.runtime.recovery import load_recovering

    index = load_index(config.checkpoint, dtype=config.dtype)
    session = connect(config)
    job = None
    try:
        if name is not None:
            registry.check_name(name)
        snapshot, envs = probe_cluster(config)
        job = Job(config=config, index=index, plan=None, workers=[], session=session, name=name)
        job.plan = plan(index.layers, snapshot, job.plan_options())
        specs = stage_specs(config, index, job.plan, envs)
        placements = [(s.node_id, s.hostname) for s in job.plan.stages]
        job.workers = start_workers(config, specs, placements,
                                    names=job.new_worker_names(len(specs)))  # fmt: skip
        if name is not None:  # recorded first, so `unload` finds a load interrupted midway
            registry.save(name, config, job.plan.to_json(), [h.name for h in job.workers], [])
        job.load_reports = load_recovering(job, progress)
        return job
    except BaseException:
        if job is not None:
            kill_workers(job.workers)
            if name is not None:
                registry.forget(name)
        session.close()
        raise


def attach(name: str, *, address: str | None = None) -> Job:
    """The named load `name` on the cluster at `address` (or RAY_ADDRESS)."""
    session = connect(JobConfig(checkpoint="-", address=address or "auto"))
    try:
        _, record = registry.load_record(name)
        config = registry.config_of(record)
        the_plan = Plan.from_json(record["plan"])
        index = load_index(config.checkpoint, dtype=config.dtype)
        actors = registry.worker_handles(record)
        specs = stage_specs(config, index, the_plan, {})
        rows = zip(actors, specs, the_plan.stages, record["workers"], strict=True)
        handles = [
            WorkerHandle(actor=a, spec=spec, node_id=s.node_id, hostname=s.hostname, name=n)
            for a, spec, s, n in rows
        ]
        return Job(config=config, index=index, plan=the_plan, workers=handles, session=session,
                   name=name, events=list(record["events"]),
                   next_worker=registry.next_worker_number(record))  # fmt: skip
    except BaseException:
        session.close()
        raise


__all__ = ["Job", "LaunchError", "attach", "launch"]
