"""The engine: the one owner of a load's generation step loop. Clients (`Job.generate`, the
CLI, the server, through `coordinator.engine.host` from any process) submit requests to it and
stream their tokens.

One thread runs the loop: take new requests and cancellations, admit waiting sequences while
the KV pool has blocks for them (`Scheduler`), give every micro-batch that is not running a
step its next step (`Scheduler.plan`: the youngest sequence is preempted when the pool runs
out), and apply whichever finishes first: each row's token goes to its request, a sequence
that ends frees its slot and blocks for the next one at once. So every sequence in flight moves
one token per step of its micro-batch, and each offloaded layer is brought in once per step for
all of them.

The engine owns its workers' KV pools: at start it claims every worker with its id, and every
step carries (engine id, epoch); a worker refuses a step of anyone else, or of an older epoch
(`worker.steps.NotOwnerError`), so two engines can never write one pool, and a step planned
before the workers changed can never read a pool that no longer holds its keys.

A step that fails because a worker was lost or changed: the job recovers (`recover`), the
engine claims the workers again under a new epoch, and every running sequence feeds its prompt
and its tokens so far again, so it goes on with the text an uninterrupted run gives; what the
old epoch's steps still return is dropped. A step that does not come back within
`step_timeout_s` is a hung worker: the same recovery finds the stage that does not answer and
replaces it. A step that fails otherwise ends the requests in it with the error. A row the
last stage cannot choose a token for ends its own request only (`Chosen.failed`). Every wait is
bounded (`step_timeout_s`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.engine.generation import KvBudget
from coordinator.engine.pipelines import Handle, Pipeline, StepTimeoutError
from coordinator.engine.requests import check_request
from coordinator.engine.scheduler import Scheduler, Step
from coordinator.engine.sequences import Finish, Request, Sequence
from coordinator.engine.stats import EngineStats
from offload.errors import BusyError, ConfigError, LaunchError
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for
from worker.steps import NotOwnerError

logger = logging.getLogger(__name__)
DEFAULT_MAX_QUEUE = 1024  # sequences waiting for a slot; beyond: BusyError (HTTP 429)
DEFAULT_PREFILL_TOKENS = 512  # per prefill step (rows x width)
IDLE_WAIT_S = 1.0
# An idle engine given a request waits this long from its arrival for others to start with it
# (EngineConfig.batch_wait_s): requests sent together (a client's concurrent calls reach it
# over ~4 ms on a 2-core host) then share their first step, and decode in step.
DEFAULT_BATCH_WAIT_S = 0.005
# A model with recurrent state runs every burst out (a step that ran updated a state, even if
# its tokens were dropped): short bursts, so a request waits at most this many decode steps.
UNIFORM_MAX_BURST = 8
CLOSE_TIMEOUT_S = 30.0
# Tests only: a file path; while that file does not exist, the loop applies no token after a
# request's first until a request is cancelled or the engine closes (at most HOLD_TOKENS_MAX_S):
# a test's client that leaves after its first token certainly leaves while its request runs,
# and the hold ends with the cancel that leaving sends (tests/test_serving.py).
HOLD_TOKENS_ENV = "OFFLOAD_TEST_HOLD_TOKENS"
HOLD_TOKENS_MAX_S = 120.0


def model_steps(index) -> dict[str, bool]:
    """The `EngineConfig` step rules the model of `index` (a `CheckpointIndex`) needs: rows of
    equal length for a model with recurrent state, and whole prompts when its code does not
    continue a recurrence over a second chunk."""
    return {
        "uniform_steps": index.recurrent,
        "whole_prompts": index.recurrent and not index.chunks_continue,
    }


class QueueFullError(BusyError):
    """The waiting queue is full: retry later (HTTP 429), or raise max_queue."""


class EngineClosedError(ConfigError):
    """The job was closed: no request runs any more."""


class EngineStoppedError(LaunchError):
    """The engine's loop ended on an error: every request it held, and every submit until a
    new engine runs the load (its host starts one), fails with this at once (HTTP 503)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    num_slots: int  # the plan's max_batch: sequences running at once
    max_seq_len: int
    # the KV pool: blocks of `block_size` positions (0: as many as num_slots sequences of
    # max_seq_len take); it must hold one sequence of max_seq_len
    num_blocks: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    # a sequence reuses the full KV blocks of an earlier one whose tokens start the same (off
    # for models with recurrent state, whose state cannot skip tokens)
    prefix_caching: bool = True
    max_queue: int = DEFAULT_MAX_QUEUE
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS
    batch_wait_s: float = DEFAULT_BATCH_WAIT_S  # an idle engine's wait for more requests
    burst_steps: int = 0  # decode steps per call when every micro-batch decodes; 0: the
    # pipeline's (Pipeline.max_burst: longer where a cut is cheap)
    micro_batches: int = 0  # 0: one per pipeline stage
    step_timeout_s: float = 600.0
    # every row of a step feeds equally many tokens: the model keeps a recurrent state per
    # sequence (mamba, linear attention), which a padded position would change
    uniform_steps: bool = False
    # each prompt in one step: the model's code does not continue its recurrence over a
    # second chunk (Jamba)
    whole_prompts: bool = False
    vocab_size: int = 0  # a prompt's ids must be below it (0: unknown, only >= 0 checked)

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_seq_len", "prefill_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        longest = blocks_for(self.max_seq_len, self.block_size)
        if self.num_blocks and self.num_blocks < longest:
            raise ConfigError(
                f"a KV pool of {self.num_blocks} blocks x {self.block_size} positions cannot "
                f"hold one sequence of max_seq_len={self.max_seq_len} ({longest} blocks): give "
                "it more tokens, or lower max_seq_len"
            )
        for name in ("micro_batches", "burst_steps", "num_blocks", "batch_wait_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.max_queue < self.num_slots:
            raise ConfigError(
                f"max_queue={self.max_queue} must be >= max_batch={self.num_slots}: a request "
                "as large as the batch must be able to wait for it"
            )


def _unchanging_workers() -> contextlib.AbstractContextManager[int]:
    """The gate of workers that nobody else replaces (in-process pipelines): epoch 0."""
    return contextlib.nullcontext(0)


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        config: EngineConfig,
        *,
        recover: Callable[[BaseException, int], None] | None = None,
        gate: Callable[[], contextlib.AbstractContextManager[int]] = _unchanging_workers,
        micro_batches: Callable[[], int] | None = None,
        num_blocks: Callable[[], int] | None = None,
        name: str = "engine",
        take_over: bool = False,
        stats: EngineStats | None = None,
    ) -> None:
        """`recover(exc, epoch)`: after a step sent in workers' `epoch` failed with `exc`,
        replace lost workers, or raise (nothing was lost: the step itself failed). `gate()`: a
        context inside which the workers do not change, yielding their epoch (which changes
        when they are replaced, by `recover` or anyone else). `micro_batches()`: how many
        micro-batches the current plan wants (asked at start and after every change);
        `num_blocks()`, the KV pool's blocks it has now (asked after every change: a
        re-balance resizes the pool; by default the config's, for good).
        `take_over`: claim workers another engine holds (that engine is being replaced);
        otherwise such workers refuse this engine and it does not start. `stats`: those of
        the engine this one replaces, counted on (its host's restart after a failure)."""
        self.pipeline, self.config = pipeline, config
        self._recover, self._gate = recover, gate
        self._micro_batches = micro_batches or (lambda: config.micro_batches or pipeline.num_stages)
        self._num_blocks = num_blocks or (lambda: config.num_blocks)
        self.id = f"{name}-{uuid.uuid4().hex[:12]}"
        self.scheduler = Scheduler(
            num_slots=config.num_slots,
            max_seq_len=config.max_seq_len,
            num_groups=self._micro_batches(),
            prefill_tokens=config.prefill_tokens,
            uniform=config.uniform_steps,
            whole_prompts=config.whole_prompts,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            prefix_caching=config.prefix_caching,
        )
        self.stats = stats or EngineStats(num_slots=config.num_slots)
        # The stats outlive an engine (a host's restart hands them to the next) and their
        # counters only grow, while this engine's scheduler counts from 0, and so does each
        # block pool it takes (a re-balance's): the stats' totals when each began are added.
        self._preemptions_base = self.stats.preemptions
        self._pool_counted: tuple[object, int, int] = (None, 0, 0)  # pool, queries, hits base
        self.stats.num_slots = config.num_slots
        self.stats.num_blocks = self.scheduler.num_blocks
        # what could never fit: the same refusals (and words) as Job.check_request's
        self._budget = KvBudget(max_batch=config.num_slots, max_seq_len=config.max_seq_len)
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._cancelled: list[Request] = []
        self._closed = False
        self._hold_path = os.environ.get(HOLD_TOKENS_ENV)  # tests only
        # why the loop ended on an error (None: it runs, or was closed), and who hears it once
        self.failure: EngineStoppedError | None = None
        self.on_stopped: Callable[[EngineStoppedError], None] | None = None
        # handle -> its steps and the workers' epoch it was sent in (a restart drops them all)
        self._in_flight: dict[Handle, tuple[list[Step], int]] = {}
        self._claim = 0  # how many times this engine claimed the workers (a step's epoch)
        with self._gate() as epoch:
            self._seen_epoch = epoch
            self._claim_workers(take=take_over)  # raises: no engine without its workers
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
        **scoring,
    ) -> Request:
        """Queue one request of `len(prompts)` sequences; returns at once. Every value is
        checked first (`coordinator.engine.requests`): RequestError (a ConfigError) names a
        bad one, and nothing of it reaches a worker. Raises QueueFullError when the queue
        cannot take them now, NeverFitsError when they could never run here. `scoring` (`Request`'s): min_new_tokens (no end token before),
        logprobs and prompt_logprobs (how many top ones; None: none) and on_logprobs(row,
        Logprobs), called before on_token with the token's, and before the first token with
        the prompt's."""
        checked = check_request(
            prompts,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
            seed=seed,
            min_new_tokens=scoring.pop("min_new_tokens", 0),
            logprobs=scoring.pop("logprobs", None),
            prompt_logprobs=scoring.pop("prompt_logprobs", None),
            vocab_size=self.config.vocab_size,
        )
        prompts, max_new_tokens, seed = checked.prompts, checked.max_new_tokens, checked.seed
        # more sequences than slots never fit (and max_queue >= num_slots: never more than
        # the queue holds), nor longer than a slot
        self._budget.check(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
        request = Request.of(
            prompts,
            sampling=checked.sampling,
            max_new_tokens=max_new_tokens,
            eos_token_ids=checked.eos_token_ids,
            on_token=on_token,
            on_finish=on_finish,
            min_new_tokens=checked.min_new_tokens,
            logprobs=checked.logprobs,
            prompt_logprobs=checked.prompt_logprobs,
            **scoring,
        )
        if checked.sampling.do_sample:  # the key of every draw of a row (worker.decode.uniform)
            for seq in request.sequences:
                seq.seed = seed + seq.row if seed is not None else secrets.randbits(63)
        if max_new_tokens == 0:
            for seq in request.sequences:
                seq.finish = Finish.LENGTH
            request.end()
            return request
        with self._cond:
            if self._closed:
                raise self.failure or EngineClosedError("the job is closed")
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
        """End the request at the next step boundary (its slots are freed then)."""
        with self._cond:
            self._cancelled.append(request)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the loop; requests not finished end with EngineClosedError; the workers are
        nobody's again (a later engine may claim them)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):  # best effort: workers may be going too
            self.pipeline.release(self.owner)

    @property
    def owner(self) -> tuple[str, int]:
        """What this engine's steps carry now: (its id, its claim's epoch)."""
        return self.id, self._claim

    # the loop
    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as exc:  # a bug here must not leave clients waiting forever
            self._stop(exc)
            return
        self._fail_all(EngineClosedError("the job was closed before the request finished"))

    def _stop(self, exc: BaseException) -> None:
        """The loop ended on `exc`: the engine takes no more requests, every one it holds
        ends now with an `EngineStoppedError` that says why, its workers are nobody's, and
        `on_stopped` hears it (the host starts a new engine). Never silent: the traceback goes
        to the log."""
        logger.error("engine %s stopped", self.id, exc_info=exc)
        stopped = EngineStoppedError(
            f"the load's engine stopped on an error ({type(exc).__name__}: {exc}); its "
            "requests ended with it, and a new engine is started for the load: retry shortly"
        )
        with self._cond:
            self.failure = stopped
            self._closed = True
            self._cond.notify_all()
        try:
            self._fail_all(stopped)
        except BaseException as again:  # the bookkeeping itself is broken: end them directly
            logger.error("engine %s: ending its requests failed", self.id, exc_info=again)
            self._end_directly(stopped)
        with contextlib.suppress(Exception):  # best effort: the next engine takes them anyway
            self.pipeline.release(self.owner)
        callback = self.on_stopped
        if callback is not None:
            callback(stopped)

    def _turn(self) -> bool:
        scheduler = self.scheduler
        with self._cond:
            if self._closed:
                return False
            self._gather()
            for request in self._incoming:
                scheduler.enqueue(request)
                self.stats.requests += 1
            self._incoming.clear()
            for request in self._cancelled:
                scheduler.finish_request(request, Finish.ABORT)
            self._cancelled.clear()
            scheduler.admit()
            idle = not self._in_flight and not scheduler.idle_groups()
            if idle and not scheduler.has_done:  # a cancel's end is told first, not after
                self._cond.wait(IDLE_WAIT_S)
        self._end_done()
        if idle:
            return True
        self._submit_idle()
        if self._in_flight:
            self._wait_one()
        self._end_done()
        return True

    def _gather(self) -> None:
        """An idle engine (nothing running, waiting or in flight) that was just given requests
        waits up to `batch_wait_s` from the first one's arrival for others, until they would
        fill the batch: requests sent together then start in one prefill step instead of the
        first alone and the rest one step later, so their rows stay in step (each later step
        of a row a step ahead is a step of its own, and rows of unequal lengths need a mask).
        A busy engine never waits: arrivals join at its next step. Holding `_cond`."""
        scheduler = self.scheduler
        if (
            not self.config.batch_wait_s
            or not self._incoming
            or self._in_flight
            or scheduler.running
            or scheduler.waiting
        ):
            return
        deadline = self._incoming[0].submitted_s + self.config.batch_wait_s
        while not self._closed and not self._cancelled:
            if sum(len(r.sequences) for r in self._incoming) >= self.config.num_slots:
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cond.wait(left)

    def _end_done(self) -> None:
        """Wake the clients of the requests that ended (each once), after the stats count
        them (a client that reads the stats as soon as its request is done sees it gone)."""
        done = self.scheduler.take_done()
        try:
            self._count_done(done)
        finally:  # taken from the scheduler: ended here, or never (counting them failed)
            for request in done:
                try:
                    request.end()
                except Exception as exc:  # the client's callback: never the loop's end
                    request.error = request.error or exc

    def _count_done(self, done: list[Request]) -> None:
        scheduler = self.scheduler
        self.stats.running = len(scheduler.running)
        self.stats.waiting = len(scheduler.waiting)
        self._pool_stats()
        self.stats.preempted(self._preemptions_base + scheduler.preemptions, time.monotonic())
        pool, queries, hits = self._pool_counted
        if pool is not scheduler.blocks:  # this engine's first pool, or a re-balance's
            queries, hits = self.stats.prefix_queries, self.stats.prefix_hits
            self._pool_counted = (scheduler.blocks, queries, hits)
        self.stats.prefix_queries = queries + scheduler.blocks.queries
        self.stats.prefix_hits = hits + scheduler.blocks.hits
        for request in done:
            for seq in request.sequences:
                if seq.finish is Finish.ERROR:
                    self.stats.finished(reason=seq.finish.value)
                else:
                    self.stats.finished(
                        len(seq.prompt), len(seq.generated), reason=seq.finish.value
                    )

    def _pool_stats(self) -> None:
        """The KV pool's blocks in use (a burst's, taken before it ran, included) and the
        tokens they hold."""
        self.stats.used_blocks = self.scheduler.used_blocks
        self.stats.used_tokens = self.scheduler.used_tokens

    def _restart(self) -> None:
        """The workers changed: what is in flight is dropped, the workers are claimed under a
        new epoch, and every running sequence starts its caches again."""
        self._in_flight.clear()
        self.scheduler.restart(self._micro_batches(), num_blocks=self._num_blocks())
        self.stats.num_blocks = self.scheduler.num_blocks
        self.stats.restarts += 1
        try:
            self._claim_workers(take=False)
        except Exception as exc:  # another engine took them, or a worker is gone again
            for seq in list(self.scheduler.waiting) + self.scheduler.running:
                self._fail_request(seq.request, exc)

    def _claim_workers(self, *, take: bool) -> None:
        self._claim += 1
        self.scheduler.owner = self.owner
        self.pipeline.claim(self.owner, take=take)

    def _submit_idle(self) -> None:
        """Plan a step for every micro-batch with none in flight and send them, inside the
        gate: each on its own (the driver then keeps each one's steps in flight), or, when
        every micro-batch decodes and nothing waits for a step boundary, all of them as one
        burst the first stage drives (`Pipeline.submit`: the driver off the per-token path)."""
        scheduler = self.scheduler
        if self._could_burst() and any(g.in_flight for g in scheduler.groups):
            return  # let the others come back: then all of them go as one burst
        with self._gate() as epoch:
            if epoch != self._seen_epoch:  # changed by another thread since the last step
                self._seen_epoch = epoch
                self._restart()
            steps = [step for g in scheduler.idle_groups() if (step := scheduler.plan(g))]
            if not steps:
                return
            count = self._burst(steps)
            for step in steps:
                step.count = count
            batches = [steps] if count > 1 else [[step] for step in steps]
            failed = None
            for n, batch in enumerate(batches):
                try:
                    handle = self.pipeline.submit(batch)
                except Exception as exc:
                    failed = (batch, exc)
                    for later in batches[n + 1 :]:  # never sent: planned again next turn
                        for step in later:
                            scheduler.unplan(step)
                    break
                self._in_flight[handle] = (batch, epoch)
                self.stats.calls += 1
        if failed is not None:  # outside the gate: a recovery needs it alone
            self._step_failed(*failed, epoch)

    def _could_burst(self, planned: list[Step] = ()) -> bool:
        """Every running sequence decodes (or is fed the rest of its prompt by a `planned`
        step in which every row chooses its token) and nothing needs a step boundary (a
        sequence that could take a free slot, a prompt chunk, a cancellation): the steps may
        run on the workers alone."""
        scheduler = self.scheduler
        if self._burst_steps() == 1 or self._cancelled:
            return False
        if self._could_admit():
            return False
        fed_whole = {id(s) for step in planned if all(step.draw.choose) for s in step.sequences}
        running = [s for s in scheduler.running if s.finish is None]
        return bool(running) and all(s.pending == 1 or id(s) in fed_whole for s in running)

    def _could_admit(self) -> bool:
        """A sequence waits (or arrived) that a step boundary would admit: a slot and blocks
        for it are free."""
        scheduler = self.scheduler
        if scheduler.waiting:
            return scheduler.can_admit(scheduler.waiting[0])
        return bool(self._incoming) and scheduler.can_admit()

    def _burst(self, steps: list[Step]) -> int:
        """Steps `steps` may run on the workers without the driver: several when they are
        every running micro-batch's and `_could_burst`, each step's first the one planned (a
        prefill whose rows all choose a token goes on decoding in the same call: one call
        for a wave of requests' prompts and their tokens); never past a sequence's
        max_new_tokens."""
        scheduler = self.scheduler
        if not self._could_burst(steps):
            return 1
        if len(steps) != sum(1 for g in scheduler.groups if g.sequences):
            return 1  # a micro-batch has a step in flight: keep to the driver's turns
        left = min(
            s.request.max_new_tokens - len(s.generated) for step in steps for s in step.sequences
        )
        # as many as the KV pool has blocks for: a burst never preempts
        return scheduler.grow(steps, max(1, min(self._burst_steps(), left)))

    def _burst_steps(self) -> int:
        steps = self.config.burst_steps or self.pipeline.max_burst
        return min(steps, UNIFORM_MAX_BURST) if self.config.uniform_steps else steps

    def _wait_one(self) -> None:
        ready = self.pipeline.wait(list(self._in_flight), self.config.step_timeout_s)
        if not ready:  # a hung stage: found and replaced as a lost one (`_step_failed`)
            timeout = StepTimeoutError(
                f"a generation step did not finish within {self.config.step_timeout_s:.0f} s "
                "(forward_timeout_s)"
            )
            in_flight = list(self._in_flight.values())
            self._in_flight.clear()
            steps = [step for batch, _ in in_flight for step in batch]
            self._step_failed(steps, timeout, min(epoch for _, epoch in in_flight))
            return
        for handle in ready:
            if handle in self._in_flight:  # else dropped by a restart meanwhile
                self._run(handle, *self._in_flight.pop(handle))

    def _run(self, handle: Handle, steps: list[Step], epoch: int) -> None:
        """Apply the steps' tokens as they come, each after the cancellations seen so far (a
        cancelled row gets no token more). A burst is cut (`Handle.stop`) when a step
        boundary is wanted; the steps that ran anyway still come (a cut ring on several
        stages runs its remaining steps out on every stage) and are applied the same way: to
        the rows still running, none computed again, no token past a row's end."""
        read = [0] * len(steps)  # results read, per step
        expected = sum(step.count for step in steps)
        cut = False
        try:
            for m, tokens in handle.results(self.config.step_timeout_s):
                step = steps[m]
                if self._hold_path:  # tests only: OFFLOAD_TEST_HOLD_TOKENS
                    self._hold_unless_cancelled(step)
                self._end_cancelled()
                added = self.scheduler.update(step, read[m], tokens)
                read[m] += 1
                self._pool_stats()  # live through a burst
                self.stats.steps += 1  # a pass through every stage
                self.stats.step_rows += len(step.sequences)
                self._deliver(added)
                if not cut and sum(read) < expected and self._wanted_at_a_boundary(steps, read):
                    handle.stop()  # a burst: the workers start no step they need not
                    self.stats.cut += 1
                    cut = True
        except Exception as exc:
            self._step_failed(steps, exc, epoch)
            return
        for step in steps:
            self.scheduler.complete(step)

    def _hold_unless_cancelled(self, step: Step) -> None:
        """Tests only (`HOLD_TOKENS_ENV`): before a token after a running request's first, wait
        while the file is missing, nothing was cancelled and the engine is open."""
        if not any(s.generated and s.finish is None for s in step.sequences):
            return
        deadline = time.monotonic() + HOLD_TOKENS_MAX_S
        with self._cond:
            while not (self._cancelled or self._closed or os.path.exists(self._hold_path)):
                if time.monotonic() >= deadline:
                    return
                self._cond.wait(0.05)

    def _end_cancelled(self) -> None:
        """End the requests cancelled since the loop last looked (`Finish.ABORT`): a step
        applied after this gives them no token. One the loop has not queued yet is left to
        the next turn, which queues it first (ended before, queuing would revive it)."""
        if not self._cancelled:  # read without the lock: a cancel just missed goes next time
            return
        with self._cond:
            incoming = {id(request) for request in self._incoming}
            cancelled = [r for r in self._cancelled if id(r) not in incoming]
            self._cancelled[:] = [r for r in self._cancelled if id(r) in incoming]
        for request in cancelled:
            self.scheduler.finish_request(request, Finish.ABORT)

    def _wanted_at_a_boundary(self, steps: list[Step], read: list[int]) -> bool:
        """The next step boundary should come now: a request was cancelled, a sequence of the
        burst ended while its micro-batch has steps left in the burst (its row would be
        computed for nothing; the others' steps are never cut for a micro-batch that is done),
        or a request arrived while a slot is free for it (`read`: each step's results read)."""
        if self.config.uniform_steps:
            return False  # never cut: a step run and dropped would still advance a state
        with self._cond:
            if self._cancelled:
                return True
            admits = self._could_admit()
        if any(
            s.finish is not None
            for step, done in zip(steps, read, strict=True)
            if done < step.count
            for s in step.sequences
        ):
            return True
        return admits

    def _deliver(self, added: list[tuple[Sequence, int]]) -> None:
        now = time.perf_counter()
        for seq, token in added:
            request = seq.request
            self.stats.token(seq, now)
            if request.on_token is not None and request.error is None:
                try:
                    if request.on_logprobs is not None:
                        self._deliver_logprobs(seq)
                    request.on_token(seq.row, token)
                except Exception as exc:  # the client's callback: its request ends, not the loop
                    self._fail_request(request, exc)

    @staticmethod
    def _deliver_logprobs(seq: Sequence) -> None:
        """The log-probabilities of the token just added, and before the first, the prompt's."""
        request = seq.request
        if len(seq.generated) == 1 and request.prompt_logprobs is not None:
            prompt = seq.prompt_logprobs()
            if prompt is None and len(seq.prompt) > 1:
                raise RuntimeError("the prompt's log-probabilities did not all come back")
            if prompt is not None:
                request.on_logprobs(seq.row, prompt)
        if request.logprobs is not None:
            if len(seq.logprobs) != len(seq.generated):
                raise RuntimeError("a token came back without its log-probabilities")
            request.on_logprobs(seq.row, seq.logprobs[-1])

    def _step_failed(self, steps: list[Step], exc: BaseException, epoch: int) -> None:
        """Steps raised: recover when a worker was lost or changed (every sequence then starts
        its caches again), else end the steps' requests with the error. Never once the job is
        closing: its workers are going on purpose."""
        changed = _workers_changed(exc)
        if self._recover is not None and changed and not self._closed:
            try:
                self._recover(exc, epoch)
            except Exception as clear:  # nothing lost (the step failed), or recovery failed
                exc = clear
            else:
                with self._gate() as now:
                    self._seen_epoch = now
                    self._restart()
                return
        self._fail_steps(steps, exc)

    def _fail_steps(self, steps: list[Step], exc: BaseException) -> None:
        for step in steps:
            for request in {id(s.request): s.request for s in step.sequences}.values():
                self._fail_request(request, exc)
            self.scheduler.unplan(step)  # what it carried may not have arrived

    def _fail_request(self, request: Request, exc: BaseException) -> None:
        self.scheduler.fail_request(request, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            incoming, self._incoming = self._incoming, []
        for request in incoming:
            self.scheduler.enqueue(request)
        sequences = list(self.scheduler.waiting) + self.scheduler.running
        for request in {id(s.request): s.request for s in sequences}.values():
            self._fail_request(request, exc)
        self._end_done()

    def _end_directly(self, error: BaseException) -> None:
        """End every request this engine knows of that has not ended, without the scheduler
        (its state is not to be trusted once updating it raised)."""
        with self._cond:
            requests = list(self._incoming)
            self._incoming.clear()
        scheduler = self.scheduler
        sequences = list(scheduler.waiting) + [s for g in scheduler.groups for s in g.sequences]
        sequences += [
            s for steps, _ in self._in_flight.values() for st in steps for s in st.sequences
        ]
        requests += [s.request for s in sequences]
        for request in {id(r): r for r in requests}.values():
            if request.done():
                continue
            request.error = request.error or error
            for seq in request.sequences:
                seq.finish = seq.finish or Finish.ERROR
            with contextlib.suppress(Exception):  # a client's callback: the others still end
                request.end()


def _workers_changed(exc: BaseException) -> bool:
    """A step failed because a worker was lost, or refused it as not claimed by this engine
    under this epoch (the worker was replaced or re-planned meanwhile), or did not come back
    within its bound (a hung worker: the recovery replaces the stage that does not answer)."""
    if isinstance(exc, StepTimeoutError):
        return True
    # imported here, at a failure: the engine's module loads without Ray (in-process pipelines)
    import ray

    from coordinator.runtime.errors import WorkerLostError

    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if isinstance(cause, NotOwnerError):
        return not cause.other_engine
    return isinstance(exc, ray.exceptions.RayError | WorkerLostError)
