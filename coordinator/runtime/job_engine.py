"""A job's generation engine as the job holds it: started at the first request with the job's
settings and pipeline, its stats published every `snapshot_interval_s` (Ray metrics under
vLLM's names, and a named load's keeper, so `offloadctl status` shows them from any process),
closed with the job after a last publish."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import ray

from coordinator.engine import Engine, EngineConfig
from coordinator.engine.ray_pipeline import RayPipeline

PUBLISH_TIMEOUT_S = 60.0


class JobEngine:
    def __init__(self, job) -> None:
        self.job = job  # coordinator.runtime.job.Job (not imported: it imports this module)
        self._engine: Engine | None = None
        self._lock = threading.Lock()
        self._metrics = None

    def get(self) -> Engine:
        """The engine, started now if it is not yet."""
        job = self.job
        with self._lock:
            if self._engine is None:
                job._require_open()
                config = job.config
                self._engine = Engine(
                    RayPipeline(job),
                    EngineConfig(
                        num_slots=config.max_batch,
                        max_seq_len=max(config.max_seq_len, 1),
                        max_queue=config.max_queue,
                        prefill_tokens=config.prefill_tokens,
                        micro_batches=self.micro_batches(),
                        step_timeout_s=config.forward_timeout_s,
                    ),
                    recover=job._recover_or_raise,
                    epoch=lambda: job._gate.epoch,
                )
                if config.snapshot_interval_s > 0:
                    job._loops.every("engine", config.snapshot_interval_s, self.publish)
            return self._engine

    def micro_batches(self) -> int:
        """The config's, or by default: one when any stage offloads (each micro-batch brings
        the offloaded layers in once per step: one batch brings them in once for all), else
        one per stage (nothing to bring in: keep every stage busy)."""
        job = self.job
        if job.config.micro_batches:
            return job.config.micro_batches
        return 1 if any(s.offloaded for s in job.plan.stages) else len(job.plan.stages)

    def publish(self, *, wait_s: float = 0.0) -> None:
        """The stats as Ray metrics, and to a named load's keeper (waiting up to `wait_s` for it
        to have them: the last publish, as the job closes)."""
        engine = self._engine
        if engine is None:
            return
        if self._metrics is None:
            from coordinator.engine.stats import EngineMetrics

            self._metrics = EngineMetrics(Path(self.job.config.checkpoint).name)
        self._metrics.export(engine.stats)
        if self.job.keeper is not None:
            sent = self.job.keeper.put_engine_stats.remote(engine.stats.snapshot())
            if wait_s:
                ray.wait([sent], timeout=wait_s)

    def stats(self) -> dict | None:
        """This engine's stats; for a named load, the latest its serving process published."""
        keeper = self.job.keeper
        if keeper is None:
            return self._engine.stats.snapshot() if self._engine is not None else None
        try:
            return ray.get(keeper.engine_stats.remote(), timeout=PUBLISH_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def close(self) -> None:
        """Publish the last stats, then stop the engine (unfinished requests end with
        EngineClosedError)."""
        if self._engine is not None and self.job.workers:
            try:
                self.publish(wait_s=PUBLISH_TIMEOUT_S)
            except Exception as exc:  # metrics must not stop a close
                print(f"engine stats not published: {exc}", file=sys.stderr)
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
