"""A job's way to its load's one engine.

An unnamed job's engine runs in its driver: started at the first request with the job's
settings and pipeline, its stats published every `snapshot_interval_s` as Ray metrics (vLLM's
names), closed with the job. A named load's engine runs in the load's keeper
(`coordinator.runtime.keeper`), started with the load and shared by every client of it from
any process (`serve NAME`, `generate NAME`, `attach(name)`): this module gives such a job an
`EngineClient` that reaches it through Ray.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray

from coordinator.config import JobConfig
from coordinator.engine import Engine, EngineConfig
from coordinator.engine.engine import model_steps
from coordinator.engine.host import CALL_TIMEOUT_S, EngineClient, EngineHost
from coordinator.engine.ray_pipeline import RayPipeline
from coordinator.planning.checkpoint import CheckpointIndex
from coordinator.planning.planner import Plan
from coordinator.runtime.rebalance import CHECK_S, Rebalancer
from offload.errors import LaunchError

DRAIN_TIMEOUT_S = 10.0  # a closing job's client hears the engine's last words for this long


def micro_batches(config: JobConfig, plan: Plan) -> int:
    """The config's, or by default: one when any stage offloads (each micro-batch brings the
    offloaded layers in once per step: one batch brings them in once for all), else one per
    stage (nothing to bring in: keep every stage busy). Asked again after every re-plan."""
    if config.micro_batches:
        return config.micro_batches
    return 1 if any(s.offloaded for s in plan.stages) else len(plan.stages)


def build_engine(
    workers: Callable[[], list],
    config: Callable[[], JobConfig],
    plan: Callable[[], Plan],
    *,
    recover: Callable[[BaseException, int], None],
    gate,
    name: str,
    index: CheckpointIndex,
    take_over: bool = False,
    stats=None,
) -> Engine:
    """The engine of a load whose current workers, config and plan these return (they change
    with recoveries), claiming the workers at once, for the model of `index` (its step rules,
    `model_steps`, and its vocabulary, which a prompt's ids must be below). `stats`: those of
    the engine this one replaces (`EngineHost`'s restart)."""
    now = config()
    return Engine(
        RayPipeline(workers, lambda: config().forward_timeout_s),
        EngineConfig(
            num_slots=now.max_batch,
            max_seq_len=max(now.max_seq_len, 1),  # 0: every request is refused (KvBudget)
            num_blocks=now.kv_blocks(),
            prefix_caching=now.prefix_caching,
            max_queue=now.max_queue,
            prefill_tokens=now.prefill_tokens,
            batch_wait_s=now.batch_wait_s,
            micro_batches=now.micro_batches,
            step_timeout_s=now.forward_timeout_s,
            vocab_size=index.config.get("vocab_size") or 0,
            **model_steps(index),
        ),
        recover=recover,
        gate=gate,
        micro_batches=lambda: micro_batches(config(), plan()),
        num_blocks=lambda: config().kv_blocks(),  # a re-balance resizes the pool
        name=name,
        take_over=take_over,
        stats=stats,
    )


def remote_call(actor, what: str, timeout_s: float = CALL_TIMEOUT_S) -> Callable:
    """`call(method, *args, **kwargs)` on `actor` (a load's keeper) through Ray, within
    `timeout_s`, raising the actor's own error (a full queue is a BusyError here as in
    process)."""

    def call(method: str, *args, **kwargs):
        try:
            return ray.get(getattr(actor, method).remote(*args, **kwargs), timeout=timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, Exception) else LaunchError(str(exc))) from None
        except ray.exceptions.RayActorError:
            raise LaunchError(
                f"{what} is unavailable: its keeper died (Ray starts it again from the load's "
                "record, up to 3 times): retry shortly, or unload and load again"
            ) from None
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"{what} did not answer within {timeout_s:.0f} s") from None

    return call


class JobEngine:
    def __init__(self, job) -> None:
        self.job = job  # coordinator.runtime.job.Job (not imported: it imports this module)
        self._client: EngineClient | None = None
        self._host: EngineHost | None = None
        self._lock = threading.Lock()
        self._metrics = None
        self._rebalancer: Rebalancer | None = None

    def get(self) -> EngineClient:
        """The client of the load's engine; an unnamed job's engine is started now if it is
        not yet."""
        job = self.job
        with self._lock:
            if self._client is None:
                job.require_open()
                if job.name is not None:
                    self._client = self._remote(job)
                else:

                    def build(stats=None, take_over=False) -> Engine:
                        return build_engine(
                            lambda: job.workers,
                            lambda: job.config,
                            lambda: job.plan,
                            recover=job.recover_after,
                            gate=job.passes,
                            name="job",
                            index=job.index,
                            take_over=take_over,
                            stats=stats,
                        )

                    # a new engine after one stopped takes its workers over from it
                    self._host = EngineHost(
                        build(), rebuild=lambda stats: build(stats, take_over=True)
                    )
                    host = self._host
                    self._client = EngineClient(
                        lambda method, *a, **kw: getattr(host, method)(*a, **kw), host=host
                    )
                    if job.config.snapshot_interval_s > 0:
                        job.loops.every("engine", job.config.snapshot_interval_s, self.publish)
                    interval_s = job.config.rebalance_interval_s
                    if interval_s > 0:
                        self._rebalancer = Rebalancer(interval_s, time.monotonic())
                        job.loops.every("rebalance", min(CHECK_S, interval_s), self.rebalance_due)
            return self._client

    @staticmethod
    def _remote(job) -> EngineClient:
        if job.keeper is None:
            raise LaunchError(
                f"load {job.name!r} has no keeper, so no engine: unload it and load it again"
            )
        return EngineClient(remote_call(job.keeper, f"the engine of load {job.name!r}"))

    def publish(self) -> None:
        """An in-process engine's stats as Ray metrics."""
        if self._host is None:
            return
        if self._metrics is None:
            from coordinator.engine.stats import EngineMetrics

            self._metrics = EngineMetrics(Path(self.job.config.checkpoint).name)
        self._metrics.export(self._host.engine.stats)

    def rebalance_due(self) -> None:
        """The loop's check (`rebalance.Rebalancer`): re-balance the pool when it is due; what
        came of it is one of the job's events."""
        host, rebalancer, job = self._host, self._rebalancer, self.job
        if host is not None and rebalancer is not None:
            rebalancer.check(
                job.plan,
                host.engine.stats,
                job.rebalance,
                lambda exc: job.record_event({"event": "re-balance failed", "error": str(exc)}),
            )

    def rebalanced(self, event: dict) -> None:
        """A re-balance check's event, for the in-process engine's stats."""
        if self._host is not None:
            self._host.engine.stats.rebalanced(event)

    def observed_lengths(self) -> tuple[tuple[int, int], ...]:
        """(prompt, generated) tokens of the sequences the in-process engine ended lately."""
        return self._host.engine.stats.observed_lengths() if self._host is not None else ()

    def stats(self) -> dict | None:
        """The engine's stats: this job's, or its load's (None: no engine answers)."""
        if self._host is not None:
            return self._host.stats()
        if self.job.name is None or self.job.keeper is None:
            return None
        try:
            return ray.get(self.job.keeper.stats.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def close(self) -> None:
        """An in-process engine: publish its last stats, then stop it (unfinished requests end
        with EngineClosedError). A named load's engine goes on: this client only cancels what
        it still had in flight."""
        if self._host is not None:
            try:
                self.publish()
            except Exception as exc:  # metrics must not stop a close
                print(f"engine stats not published: {exc}", file=sys.stderr)
        with self._lock:
            client, host, self._client, self._host = self._client, self._host, None, None
        if host is not None:
            host.close()
            if client is not None:
                client.drain(DRAIN_TIMEOUT_S)
        if client is not None:
            client.close()
