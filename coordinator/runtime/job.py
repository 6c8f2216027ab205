"""The Python API: a running `Job` (a context manager), from `coordinator.runtime.launch`.

    with launch(JobConfig(checkpoint="ckpt/", gpus=3, gpu_memory_bytes=...)) as job:
        print(job.plan.summary())
        logits = job.forward(input_ids)
        tokens = job.generate(input_ids, max_new_tokens=32)

Generation goes through the job's engine (`coordinator.engine`), started at the first request.
A forward pass passes hidden states from stage to stage as Ray object refs: the driver only
chains the calls and fetches the final logits. The workers, their placement groups and every
change to them belong to the job's `WorkerGroup`; recovery (`coordinator.runtime.recovery`)
decides what a lost worker needs and the group applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch

from coordinator.config import JobConfig
from coordinator.engine import Request, generation
from coordinator.engine.host import EngineClient
from coordinator.engine.pipelines import StepTimeoutError
from coordinator.engine.ray_pipeline import by_value_or_ref
from coordinator.planning.checkpoint import CheckpointIndex
from coordinator.planning.context import beyond_context
from coordinator.planning.planner import Plan
from coordinator.runtime import recovery, registry
from coordinator.runtime.errors import LaunchError, WorkerLostError
from coordinator.runtime.gate import Gate
from coordinator.runtime.group import WorkerGroup, WorkerHandle, worker_failure
from coordinator.runtime.inputs import check_inputs
from coordinator.runtime.job_engine import JobEngine, remote_call
from coordinator.runtime.loops import Loops
from coordinator.runtime.probing import PROBE_TIMEOUT_S
from coordinator.runtime.session import RaySession
from coordinator.runtime.telemetry import MetricsExporter, Report, collect
from offload.errors import NeverFitsError
from worker.snapshot import StageSnapshot
from worker.wire import unpack

TELEMETRY_TIMEOUT_S = 60.0
CANCEL_POLL_S = 0.05  # how often a waiting generate asks its `cancelled()`


@dataclass
class Job:
    group: WorkerGroup
    session: RaySession
    load_reports: list[StageSnapshot] = field(default_factory=list)
    name: str | None = None  # a named load outlives this Job object: close() only detaches
    events: list[dict] = field(default_factory=list)  # recoveries, for telemetry
    next_worker: int = 0  # number of the next worker name of a named load
    keeper: ray.actor.ActorHandle | None = None  # a named load's keeper, once it runs
    _exporter: object | None = field(default=None, repr=False)
    loops: Loops = field(default_factory=Loops, repr=False)  # "export", "watch"
    # Passes and generation steps at once, a recovery alone (see coordinator.runtime.gate).
    _gate: Gate = field(default_factory=Gate, repr=False)
    _kv: generation.KvBudget = field(default=None, repr=False)  # type: ignore[assignment]
    _engines: JobEngine = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self._engines = JobEngine(self)
        if self._kv is None:
            config = self.group.config if self.group is not None else None
            self._kv = generation.KvBudget(
                max_batch=config.max_batch if config else 0,
                max_seq_len=config.max_seq_len if config else 0,
            )

    # what the group holds, read-only here: only the group changes it
    @property
    def config(self) -> JobConfig:
        return self.group.config

    @property
    def index(self) -> CheckpointIndex:
        return self.group.index

    @property
    def plan(self) -> Plan:
        return self.group.plan

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.group.handles

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
        inputs = check_inputs(
            input_ids, attention_mask, logits_to_keep, self.index.config.get("vocab_size")
        )
        if context := beyond_context(self.index.config, inputs[0].shape[1]):
            raise NeverFitsError(
                f"{inputs[0].shape[1]} tokens per sequence exceed the model's "
                f"context of {context}: pass shorter sequences"
            )
        with self._gate.inside() as epoch:
            try:
                return self._forward(*inputs)
            except (ray.exceptions.RayError, WorkerLostError) as exc:
                self.recover_after(exc, epoch)
            try:
                return self._forward(*inputs)
            except ray.exceptions.RayError as again:
                raise worker_failure(again, self.workers) from None

    def _forward(self, input_ids, attention_mask, position_ids, logits_to_keep) -> torch.Tensor:
        self.require_open()
        if any(h.actor is None for h in self.workers):  # attached to a load that lost workers
            raise WorkerLostError("a worker of this load was lost")
        ref, mask_ref, positions_ref = (
            by_value_or_ref(t) for t in (input_ids, attention_mask, position_ids)
        )
        for handle in self.workers:
            ref = handle.actor.step.remote(ref, mask_ref, positions_ref, logits_to_keep)
        try:
            return unpack(ray.get(ref, timeout=self.config.forward_timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise self._forward_timeout() from None

    def _forward_timeout(self) -> TimeoutError:
        return TimeoutError(
            f"forward did not finish within {self.config.forward_timeout_s:.0f} "
            "s (forward_timeout_s)"
        )

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = generation.FROM_CHECKPOINT,  # type: ignore[assignment]
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = generation.FROM_CHECKPOINT,  # type: ignore[assignment]
        pad_token_id: int | None = None,
        seed: int | None = None,
        min_new_tokens: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        bad_words_ids: list[list[int]] | None = None,
        guide: str | None = None,
        on_token: Callable[[int, int], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Token ids (batch, prompt + new), as transformers' `generate` returns its sequences:
        greedy unless `do_sample`, settings not given taken from the checkpoint's
        generation_config.json (`eos_token_id=None`: exactly `max_new_tokens` new tokens);
        rows that end early are padded with `pad_token_id`. Left-pad batches and pass their
        `attention_mask`: each row is its own sequence.

        The request joins the job's engine (`coordinator.engine`): its rows wait for KV blocks
        in a FIFO queue, then move one token per step in a batch with every other sequence in
        flight. `on_token(row, token)` sees each token as it comes (from the engine's thread:
        keep it short); `cancelled()` true ends the request at the next step (its slots freed).
        A worker lost meanwhile: the job recovers and the request goes on with the text an
        uninterrupted run gives. A seeded request draws the same tokens whatever else runs.
        `min_new_tokens`: no end token before this many new tokens (as generate's).
        `repetition_penalty`, `min_p` and `bad_words_ids` as generate's; `logit_bias` (token
        -> bias, added to its logit), `frequency_penalty` and `presence_penalty` as OpenAI's
        API and vLLM apply them (`worker.steps.Sampling`); `guide`, a regex the new text must
        match (guided decoding on the last stage, `worker.guided`: needs outlines-core and
        the checkpoint's tokenizer)."""
        options = dict(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            seed=seed,
            min_new_tokens=min_new_tokens,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            logit_bias=logit_bias,
            bad_words_ids=bad_words_ids,
            guide=guide,
        )
        ids, request, settings = self._submit(input_ids, attention_mask, on_token, None, options)
        engine = self.engine()
        try:
            while not request.wait(CANCEL_POLL_S):
                if cancelled is not None and cancelled():
                    engine.cancel(request)
                    request.wait()
        finally:
            if not request.done():  # interrupted (Ctrl-C): the slots go back
                engine.cancel(request)
        new = request.result()
        width = max(len(tokens) for tokens in new)
        tail = torch.full((len(ids), width), settings.pad_token_id, dtype=ids.dtype)
        for row, tokens in enumerate(new):
            tail[row, : len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
        return torch.cat([ids, tail], dim=-1)

    def submit(
        self,
        input_ids: torch.Tensor,
        *,
        on_token: Callable[[int, int], None] | None = None,
        on_finish: Callable[[], None] | None = None,
        on_logprobs: Callable | None = None,
        **options,
    ) -> Request:
        """Queue a request of unpadded `input_ids` (rows, n) and return at once: the engine's
        `Request`, to wait on or `cancel` (through `engine().cancel`). `on_token(row, token)`,
        `on_logprobs(row, Logprobs)` (just before on_token, those that came with the token:
        the prompt's before the first, the token's) and `on_finish()` are called from the
        client's thread (a server hands them to its event loop). Options and errors:
        `generate`'s and `logprobs` / `prompt_logprobs` (how many top tokens with each
        generated / prompt token's log-probability; None: none), checked before anything is
        queued."""
        return self._submit(input_ids, None, on_token, on_finish, options, on_logprobs)[1]

    def _submit(
        self, input_ids, attention_mask, on_token, on_finish, options: dict, on_logprobs=None
    ):
        ids, mask, _, _ = check_inputs(
            input_ids, attention_mask, 0, self.index.config.get("vocab_size")
        )
        settings = self.check_request(ids.shape[1], len(ids), **options)
        scoring = {
            "logprobs": options.get("logprobs"),
            "prompt_logprobs": options.get("prompt_logprobs"),
        }
        keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        prompts = [row[keep_row].tolist() for row, keep_row in zip(ids, keep, strict=True)]
        request = self.engine().submit(
            prompts,
            sampling=settings.sampling,
            max_new_tokens=settings.max_new_tokens,
            eos_token_ids=settings.eos_token_ids,
            seed=settings.seed,
            on_token=on_token,
            on_finish=on_finish,
            on_logprobs=on_logprobs,
            min_new_tokens=settings.min_new_tokens,
            **scoring,
        )
        return ids, request, settings

    def engine(self) -> EngineClient:
        """The client of the load's one engine: this job's own, started at the first request,
        or a named load's, which runs in its keeper for every client of the load."""
        return self._engines.get()

    def serving_stats(self) -> dict | None:
        """Generation stats of the load's engine (None: it has not started)."""
        return self._engines.stats()

    def passes(self):
        """A context inside which the workers do not change; yields their epoch (see
        coordinator.runtime.gate)."""
        return self._gate.inside()

    def check_request(
        self,
        prompt_length: int,
        sequences: int = 1,
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        **options,
    ) -> generation.Settings:
        """The settings of a request of `sequences` prompts of `prompt_length` tokens (options:
        `generate`'s, and `submit`'s logprobs and prompt_logprobs); GenerationError when it
        could never run here: a setting this loop does not apply, past the model's context,
        beyond the planned KV cache. Checked before anything runs (a server checks before it
        starts streaming)."""
        vocab = self.index.config.get("vocab_size") or 0
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= max(vocab, 1):
                raise generation.GenerationError(
                    f"{name}={value} must be None (none) or a count of top tokens in "
                    f"[0, {vocab}] (the vocabulary)"
                )
        settings = generation.resolve(self.index.root, self.index.config, prompt_length, **options)
        self._kv.check(sequences, prompt_length + settings.max_new_tokens)
        return settings

    def require_open(self) -> None:
        if not self.workers:
            raise LaunchError("the job is closed")

    def dead_stages(self) -> list[int]:
        """Stages whose worker is gone (its actor died or its node left), all pinged at once."""
        self.require_open()
        return self.group.dead_stages()

    def recover(self) -> list[int]:
        """Replace lost workers and reload only what moved; returns the stages that were lost.
        Same node when it is alive, else a new plan on the GPUs left (see
        coordinator.runtime.recovery); `PlanError` when those cannot hold the model. A named
        load's keeper does it (the one process that changes a named load), this job then
        takes the load's new state from its record."""
        with self._gate.alone():
            dead = self._recover_now()
            if dead:
                self._gate.epoch += 1
            return dead

    def rebalance(self, lengths=None) -> dict:
        """Re-balance the KV pool against the resident weights for `lengths`
        (`coordinator.planning.pool.Lengths`; by default what this job's engine observed):
        the stages stay, what each offloads and the pool change where the cost model predicts
        at least `rebalance.GAIN` more tokens/s (`coordinator.runtime.rebalance`). Requests in
        flight go on, their sequences fed again into the new pool. Returns the event ("kept"
        where nothing moved); PlanError where the lengths are unknown or the pool cannot fit.
        A named load is re-balanced by its keeper, which also does it on its own
        (`JobConfig.rebalance_interval_s`), as this job's engine does for an unnamed one."""
        from coordinator.runtime import rebalance

        self.require_open()
        if self.keeper is not None:  # the one process that changes a named load
            sequences = None if lengths is None else lengths.sequences
            timeout_s = self.config.load_timeout_s + PROBE_TIMEOUT_S
            keeper = remote_call(self.keeper, f"the keeper of load {self.name!r}", timeout_s)
            event = keeper("rebalance", sequences)
            self.refresh()  # its plan and pool as the keeper left them
            return event
        if lengths is None:
            lengths = rebalance.observed(self._engines.observed_lengths())
        event = rebalance.rebalance(self.group, self._gate, lengths, self.record_event)
        self._engines.rebalanced(event)
        return event

    def _recover_since(self, epoch: int, *, hung: bool = False) -> bool:
        """For a pass that failed in `epoch`: recover, unless another thread changed the
        workers since (then the pass just runs again). True when the workers changed.
        `hung`: the pass timed out; the workers that do not answer are killed first."""
        with self._gate.alone():
            if self._gate.epoch != epoch:
                return True
            if hung:
                self.group.kill_hung()
            dead = self._recover_now()
            if dead:
                self._gate.epoch += 1
            return bool(dead)

    def recover_after(self, exc: Exception, epoch: int) -> None:
        """After a pass of `epoch` failed with `exc`: recover the job, or raise `exc` (a Ray
        error as the clear error naming the stage) when every worker is alive: then the pass
        itself failed. A pass that timed out (`StepTimeoutError`): a hung worker is a lost
        one."""
        if not self._recover_since(epoch, hung=isinstance(exc, StepTimeoutError)):
            if isinstance(exc, ray.exceptions.RayError):
                raise worker_failure(exc, self.workers) from None
            raise exc

    def _recover_now(self) -> list[int]:
        if self.keeper is not None:
            return self._recover_by_keeper()
        dead, reports = recovery.recover(self.group, self.record_event)
        if dead:
            self.load_reports = reports
        return dead

    def _recover_by_keeper(self) -> list[int]:
        timeout_s = self.config.load_timeout_s + self.config.placement_timeout_s + PROBE_TIMEOUT_S
        dead = remote_call(self.keeper, f"the keeper of load {self.name!r}", timeout_s)("recover")
        before = [h.name for h in self.group.handles]
        self._take_record()
        # The keeper may have recovered before this job noticed: its stages changed all the same.
        changed = [
            s for s, h in enumerate(self.group.handles) if s >= len(before) or h.name != before[s]
        ]
        return dead or changed

    def refresh(self) -> None:
        """A named load changes in its keeper (which recovers it while its engine runs the
        requests of every client): take its plan, workers and events as they are now. Nothing
        to do for an unnamed job, which changes only here."""
        if self.name is not None:
            with self._gate.alone():
                self._take_record()

    def _take_record(self) -> None:
        _, record = registry.load_record(self.name)
        group = registry.group_of(record, self.index)
        group.names = self.new_worker_names
        self.group, self.events = group, list(record["events"])
        self.next_worker = registry.next_worker_number(record)

    def new_worker_names(self, count: int) -> list[str]:
        """Actor names for `count` new workers of a named load."""
        first, self.next_worker = self.next_worker, self.next_worker + count
        return [registry.worker_name(self.name, n) for n in range(first, first + count)]

    def record_event(self, event: dict) -> None:
        """Keep a recovery event; a named load also keeps it (and its new plan and workers) in
        its record, so `status` from another process shows it."""
        recovery.add_event(self.events, event)
        if self.name is not None:
            registry.update(self.name, self.group, self.events)

    def telemetry(self) -> list[Report]:
        """A fresh memory snapshot from every worker (see StageWorker.report); a stage whose
        worker is lost gets a `LostStage` instead (see telemetry.collect). A named load's
        stages as they are now (`refresh`)."""
        self.require_open()
        self.refresh()
        refs = [h.actor.report.remote() if h.actor is not None else None for h in self.workers]
        try:
            return collect(self.plan.stages, refs, TELEMETRY_TIMEOUT_S)
        except TimeoutError as exc:
            raise LaunchError(str(exc)) from None

    def export_metrics(self) -> list[Report]:
        """Snapshot every worker and publish the numbers as Ray gauges (Prometheus)."""
        if self._exporter is None:
            self._exporter = MetricsExporter()
        reports = self.telemetry()
        self._exporter.export(reports, self.events)
        return reports

    def export_metrics_every(self, interval_s: float) -> None:
        """Publish the gauges every `interval_s` seconds from a background thread, until
        close(). A failed snapshot is reported on stderr and retried at the next tick."""
        self.loops.every("export", interval_s, self.export_metrics)

    def watch(self, interval_s: float) -> None:
        """Check every stage every `interval_s` seconds from a background thread and recover a
        lost one at once, rather than at the next forward. Until close(); a recovery that fails
        (say, a PlanError) is recorded in `events` and tried again at the next tick."""
        self.loops.every("watch", interval_s, self._check)

    def _check(self) -> None:
        if self.workers:
            self.recover()

    def close(self) -> None:
        """Release the workers and their placement groups; for a named load on a cluster, only
        disconnect (use `registry.unload` to release it)."""
        self.loops.stop_all()
        self._engines.close()  # its last stats published; unfinished requests end
        with self._gate.alone():  # passes and a recovery in flight finish first
            if self.name is None or self.session.owned:
                self.group.stop()
            self.group.handles = []
        self.session.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Job", "LaunchError"]
