"""The engine: the one owner of the generation step loop. `Job.generate`, the CLI and the
server are its clients: they `submit` requests and wait on them (or stream their tokens).

One thread runs the loop: take new requests and cancellations, move waiting sequences into
free KV slots (`Scheduler`), give every micro-batch that is not running a step its next step
(`Scheduler.plan`), and apply whichever finishes first: each row's token goes to its request,
a sequence that ends frees its slot for the next one at once. So every sequence in flight moves
one token per step of its micro-batch, and each offloaded layer is brought in once per step for
all of them.

A step that fails because a worker was lost: the job recovers (`recover`), and every running
sequence feeds its prompt and its tokens so far again, so it goes on with the text an
uninterrupted run gives. A step that fails otherwise ends the requests in it with the error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from coordinator.engine.generation import KvBudget
from coordinator.engine.pipelines import Handle, Pipeline
from coordinator.engine.scheduler import Scheduler, Step
from coordinator.engine.sequences import Finish, Request, Sequence
from coordinator.engine.stats import EngineStats
from offload.errors import BusyError, ConfigError, NeverFitsError

DEFAULT_MAX_QUEUE = 1024  # sequences waiting for a slot; beyond: BusyError (HTTP 429)
DEFAULT_PREFILL_TOKENS = 512  # per prefill step (rows x width)
BURST_STEPS = 8  # decode steps per call on a one-stage job when nobody waits
IDLE_WAIT_S = 1.0
CLOSE_TIMEOUT_S = 30.0


class QueueFullError(BusyError):
    """The waiting queue is full: retry later (HTTP 429), or raise max_queue."""


class EngineClosedError(ConfigError):
    """The job was closed: no request runs any more."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    num_slots: int  # the plan's max_batch
    max_seq_len: int
    max_queue: int = DEFAULT_MAX_QUEUE
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS
    burst_steps: int = BURST_STEPS
    micro_batches: int = 0  # 0: one per pipeline stage
    step_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_seq_len", "prefill_tokens", "burst_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_queue < 0 or self.micro_batches < 0:
            raise ConfigError(
                f"max_queue={self.max_queue} and micro_batches={self.micro_batches} must be >= 0"
            )


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        config: EngineConfig,
        *,
        recover: Callable[[BaseException, int], None] | None = None,
        epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        """`recover(exc, epoch)`: after a step of `epoch` failed with `exc`, replace lost
        workers, or raise (nothing was lost: the step itself failed). `epoch()`: the workers'
        generation, which changes when they are replaced (by `recover` or anyone else)."""
        self.pipeline, self.config = pipeline, config
        self._recover, self._epoch = recover, epoch
        self.scheduler = Scheduler(
            num_slots=config.num_slots,
            max_seq_len=config.max_seq_len,
            num_groups=config.micro_batches or pipeline.num_stages,
            max_queue=config.max_queue,
            prefill_tokens=config.prefill_tokens,
        )
        self.stats = EngineStats(num_slots=config.num_slots)
        # what could never fit: the same refusals (and words) as Job.check_request's
        self._budget = KvBudget(max_batch=config.num_slots, max_seq_len=config.max_seq_len)
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._cancelled: list[Request] = []
        self._closed = False
        self._seen_epoch = epoch()
        self._in_flight: dict[Handle, tuple[Step, int]] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="offload-engine")
        self._thread.start()

    # clients
    def submit(
        self,
        prompts: list[list[int]],
        *,
        sampling,
        max_new_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        seed: int | None = None,
        on_token: Callable[[int, int], None] | None = None,
        on_finish: Callable[[], None] | None = None,
    ) -> Request:
        """Queue one request of `len(prompts)` sequences; returns at once. Raises
        QueueFullError when the queue cannot take them, NeverFitsError when they could never
        run here."""
        if not all(prompts):
            raise NeverFitsError("a prompt is empty: each sequence needs at least one token")
        self._budget.check(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
        request = Request(
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_ids=frozenset(eos_token_ids),
            on_token=on_token,
            on_finish=on_finish,
        )
        for row, prompt in enumerate(prompts):
            seq = Sequence(request=request, row=row, prompt=list(prompt))
            if sampling.do_sample:
                generator = torch.Generator()
                generator.manual_seed(seed + row) if seed is not None else generator.seed()
                seq.state = generator.get_state()
            request.sequences.append(seq)
        if max_new_tokens == 0:
            for seq in request.sequences:
                seq.finish = Finish.LENGTH
            request._end_if_done()
            return request
        with self._cond:
            if self._closed:
                raise EngineClosedError("the job is closed")
            waiting = len(self.scheduler.waiting) + sum(len(r.sequences) for r in self._incoming)
            if waiting + len(prompts) > self.config.max_queue:
                self.stats.rejected += 1
                raise QueueFullError(
                    f"{waiting} sequence(s) already wait for a KV slot (max_queue="
                    f"{self.config.max_queue}): retry later, or serve with a larger --max-queue"
                )
            self._incoming.append(request)
            self._cond.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        request.cancel()
        with self._cond:
            self._cancelled.append(request)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the loop; requests not finished end with EngineClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_TIMEOUT_S)

    # the loop
    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as exc:  # a bug here must not leave clients waiting forever
            self._fail_all(exc)
            raise
        self._fail_all(EngineClosedError("the job was closed before the request finished"))

    def _turn(self) -> bool:
        scheduler = self.scheduler
        with self._cond:
            if self._closed:
                return False
            for request in self._incoming:
                scheduler.enqueue(request.sequences)
                self.stats.requests += 1
            self._incoming.clear()
            self._take_cancellations()
            scheduler.admit()
            self._count()
            if not self._in_flight and not scheduler.idle_groups():
                self._cond.wait(IDLE_WAIT_S)
                return True
        if self._epoch() != self._seen_epoch:  # the workers were replaced: caches are gone
            self._restart()
        self._submit_idle()
        if self._in_flight:
            self._wait_one()
        return True

    def _take_cancellations(self) -> None:
        for request in self._cancelled:
            for seq in request.sequences:
                if seq.finish is None:
                    seq.finish = Finish.ABORT
                    self.scheduler.drop_waiting(seq)
            request._end_if_done()
        self._cancelled.clear()
        self._sweep()

    def _sweep(self) -> None:
        """Free the slots of ended sequences whose micro-batch has no step in flight."""
        for group in self.scheduler.groups:
            if not group.in_flight:
                for seq in [s for s in group.sequences if s.finish is not None]:
                    self.scheduler.release(seq)

    def _restart(self) -> None:
        self._in_flight.clear()
        self.scheduler.reset_caches()
        self._seen_epoch = self._epoch()
        self.stats.restarts += 1

    def _submit_idle(self) -> None:
        """Plan a step for every micro-batch with none in flight and send them: each on its
        own (the driver then keeps each one's steps in flight), or, when every micro-batch is
        decoding and nothing waits for a step boundary, all of them as one burst the first
        stage drives (`Pipeline.submit`: the driver off the per-token path)."""
        scheduler = self.scheduler
        if self._could_burst() and any(g.in_flight for g in scheduler.groups):
            return  # let the others come back: then all of them go as one burst
        steps = [step for g in scheduler.idle_groups() if (step := scheduler.plan(g))]
        if not steps:
            return
        count = self._burst(steps)
        for step in steps:
            step.count = count
        for batch in [steps] if count > 1 else [[step] for step in steps]:
            epoch = self._epoch()
            try:
                handle = self.pipeline.submit(batch)
            except Exception as exc:
                self._step_failed(batch, exc, epoch)
                continue
            self._in_flight[handle] = (batch, epoch)
            self.stats.calls += 1

    def _could_burst(self) -> bool:
        """Every running sequence decodes and nothing waits for a step boundary (a new
        sequence, a prompt chunk, a cancellation): the steps may run on the workers alone."""
        scheduler = self.scheduler
        if self.config.burst_steps == 1 or scheduler.waiting or self._incoming or self._cancelled:
            return False
        running = scheduler.running
        return bool(running) and all(s.pending == 1 for s in running if s.finish is None)

    def _burst(self, steps: list[Step]) -> int:
        """Decode steps `steps` may run on the workers without the driver: several when they
        are every running micro-batch's and `_could_burst`; never past a sequence's
        max_new_tokens."""
        scheduler = self.scheduler
        if any(step.prefill for step in steps) or not self._could_burst():
            return 1
        if len(steps) != sum(1 for g in scheduler.groups if g.sequences):
            return 1  # a micro-batch has a step in flight: keep to the driver's turns
        left = min(
            s.request.max_new_tokens - len(s.generated) for step in steps for s in step.sequences
        )
        return max(1, min(self.config.burst_steps, left))

    def _wait_one(self) -> None:
        ready = self.pipeline.wait(list(self._in_flight), self.config.step_timeout_s)
        if not ready:
            for handle, (steps, _) in list(self._in_flight.items()):
                del self._in_flight[handle]
                for step in steps:
                    self._fail_step(
                        step,
                        TimeoutError(
                            f"a generation step did not finish within "
                            f"{self.config.step_timeout_s:.0f} s (forward_timeout_s)"
                        ),
                    )
            return
        for handle in ready:
            if handle not in self._in_flight:  # dropped by a restart meanwhile
                continue
            steps, epoch = self._in_flight.pop(handle)
            self._run(handle, steps, epoch)

    def _run(self, handle: Handle, steps: list[Step], epoch: int) -> None:
        read = [0] * len(steps)  # results read, per step
        expected = sum(step.count for step in steps)
        try:
            for m, tokens, states in handle.results(self.config.step_timeout_s):
                step = steps[m]
                added = self.scheduler.apply(step, read[m], tokens, states)
                read[m] += 1
                self.stats.steps += 1  # a pass through every stage
                self.stats.step_rows += len(step.sequences)
                self._deliver(added)
                if sum(read) < expected and self._wanted_at_a_boundary():
                    handle.stop()  # a burst: end it here; the workers stop at their next step
                    self.stats.cut += 1
                    break
        except Exception as exc:
            self._step_failed(steps, exc, epoch)
            return
        ended = [seq for step in steps for seq in self.scheduler.complete(step)]
        self._count()  # before a client learns its request is done: stats it reads then hold
        for seq in ended:
            self.stats.finished(seq)
            seq.request._end_if_done()

    def _count(self) -> None:
        """The stats' sequences running and waiting, from the scheduler now."""
        self.stats.running = len(self.scheduler.running)
        self.stats.waiting = len(self.scheduler.waiting)

    def _wanted_at_a_boundary(self) -> bool:
        """A request arrived or was cancelled: the next step boundary should come now."""
        with self._cond:
            return bool(self._incoming or self._cancelled)

    def _deliver(self, added: list[tuple[Sequence, int]]) -> None:
        now = time.perf_counter()
        for seq, token in added:
            request = seq.request
            self.stats.token(seq, now)
            if request.on_token is not None:
                try:
                    request.on_token(seq.row, token)
                except Exception as exc:  # the client's callback: its request ends, not the loop
                    self._fail_request(request, exc)

    def _step_failed(self, steps: list[Step], exc: BaseException, epoch: int) -> None:
        """Steps raised: recover when a worker was lost (every sequence then starts its
        caches again), else end the steps' requests with the error. Never once the job is
        closing: its workers are going on purpose."""
        if self._recover is not None and _is_worker_failure(exc) and not self._closed:
            try:
                self._recover(exc, epoch)
            except Exception as clear:  # nothing lost (the step failed), or recovery failed
                exc = clear
            else:
                self._restart()
                return
        for step in steps:
            self._fail_step(step, exc)

    def _fail_step(self, step: Step, exc: BaseException) -> None:
        self.scheduler.groups[step.group].in_flight = False
        for request in {id(s.request): s.request for s in step.sequences}.values():
            self._fail_request(request, exc)
        self._sweep()

    def _fail_request(self, request: Request, exc: BaseException) -> None:
        if request.error is None:
            request.error = exc
        for seq in request.sequences:
            if seq.finish is None:
                seq.finish = Finish.ERROR
                self.scheduler.drop_waiting(seq)
        request._end_if_done()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            requests = list(self._incoming)
            self._incoming.clear()
        requests += [s.request for s in self.scheduler.waiting] + [
            s.request for s in self.scheduler.running
        ]
        for request in {id(r): r for r in requests}.values():
            if not request.done():
                self._fail_request(request, exc)


def _is_worker_failure(exc: BaseException) -> bool:
    # imported here, at a failure: the engine's module loads without Ray (in-process pipelines)
    import ray

    from coordinator.runtime.errors import WorkerLostError

    return isinstance(exc, ray.exceptions.RayError | WorkerLostError)
