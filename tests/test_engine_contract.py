"""The engine's loop (`coordinator.engine.engine`) where test_engine.py and the other engine
tests leave it open (found by mutation testing, issue 60): the config's refusals and the step
rules a model gets, who the engine is to its workers (its id, each claim's epoch, its thread),
what a submit gives each row (seeds) and counts, close, the workers' gate taken only to send
steps, recovery (the epoch it reports, the pool the plan gives now, a claim refused after it,
and which failures are never recovered), micro-batches kept going one by one and burst together
once all decode, where a burst is cut (once, never after its last step), bursts beside a
request that waits for blocks, the batching window, log-probabilities that do not come back,
a loop that stops (even with its bookkeeping broken), and the tests-only token hold.

Ordered by events only: the stand-in pipeline's gate, its calls and waits, the clients'
callbacks on the engine's thread, and threads joined; never by sleeps or time bounds."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading

import pytest
import ray
from test_engine import GREEDY, WAIT_S, FakePipeline, expected
from test_engine_host_contract import LastStage

import coordinator.engine.engine as engine_module
from coordinator.engine import Engine, EngineConfig, Finish, QueueFullError
from coordinator.engine.engine import (
    HOLD_TOKENS_ENV,
    EngineClosedError,
    EngineStoppedError,
    model_steps,
)
from coordinator.engine.pipelines import InProcessHandle
from coordinator.runtime.errors import WorkerLostError
from offload.errors import ConfigError
from worker.steps import ClaimedByAnotherError, NotOwnerError, Sampling

SAMPLED = Sampling(do_sample=True)


@pytest.fixture
def started():
    """`start(pipeline, **options)`: an engine on `pipeline` (a FakePipeline by default) whose
    gate yields the pipeline's epoch and whose recovery is the pipeline's, unless `engine`
    (Engine's keywords; None: its default) says otherwise; every one is closed at the end."""
    engines = []

    def start(pipeline=None, *, engine=None, **options) -> tuple[Engine, FakePipeline]:
        pipeline = pipeline or FakePipeline()
        config = EngineConfig(**{"num_slots": 2, "max_seq_len": 64, **options})
        keywords = {
            "recover": pipeline.recover,
            "gate": lambda: contextlib.nullcontext(pipeline.epoch),
            **(engine or {}),
        }
        made = Engine(pipeline, config, **{k: v for k, v in keywords.items() if v is not None})
        engines.append(made)
        return made, pipeline

    yield start
    for engine in engines:
        engine.close()


def submit(engine: Engine, prompt: list[int], count: int, **kw):
    return engine.submit([prompt], sampling=GREEDY, max_new_tokens=count, **kw)


def replace_workers(pipeline: FakePipeline) -> None:
    """What replacing the workers leaves (a recovery, here or by another thread): a new
    epoch, and workers with no cache, no state and no claim."""
    pipeline.epoch += 1
    pipeline.blocks.clear()
    pipeline.pool = None
    pipeline.runner.reset()


class Recorder:
    """An engine's `recover`: records (error, epoch) and replaces the workers for a lost one
    (or a changed one: a NotOwnerError), else raises (nothing was lost). `then` runs after a
    replacement (another engine claiming the new workers first)."""

    def __init__(self, pipeline: FakePipeline, then=None) -> None:
        self.pipeline, self.then = pipeline, then
        self.calls: list[tuple[BaseException, int]] = []

    def __call__(self, exc: BaseException, epoch: int) -> None:
        self.calls.append((exc, epoch))
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        if not isinstance(cause, WorkerLostError | NotOwnerError):
            raise exc
        replace_workers(self.pipeline)
        if self.then is not None:
            self.then()


class BreaksWhileRead(FakePipeline):
    """`broken`: errors that the next calls' results raise, one per call, after all their
    results but the last (a call of one step: at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken: list[BaseException] = []

    def submit(self, steps) -> InProcessHandle:
        handle = super().submit(steps)
        if self.broken:
            error, outputs = self.broken.pop(0), list(handle.outputs)

            def results(timeout_s):
                yield from outputs[:-1]
                raise error

            handle.results = results
        return handle


class OneAtATime(FakePipeline):
    """A ring of two stages whose calls come back one at a time, the oldest first (as a Ray
    pipeline's wait hands back whichever finished): a micro-batch whose step is back may be
    sent its next while the other's is still out. `events`: ("send", groups, (prefill, count)
    per step) and ("back", groups), in order; `timeouts`: the bounds every wait and read got."""

    def __init__(self) -> None:
        super().__init__(num_stages=2)
        self.events: list[tuple] = []
        self.timeouts: list[float] = []
        self._groups: dict[InProcessHandle, tuple[int, ...]] = {}

    def submit(self, steps) -> InProcessHandle:
        handle = super().submit(steps)
        groups = tuple(step.group for step in steps)
        self._groups[handle] = groups
        self.events.append(("send", groups, tuple((s.prefill, s.count) for s in steps)))
        results = handle.results

        def bounded(timeout_s):
            self.timeouts.append(timeout_s)
            return results(timeout_s)

        handle.results = bounded
        return handle

    def wait(self, handles, timeout_s):
        self.timeouts.append(timeout_s)
        self.events.append(("back", self._groups[handles[0]]))
        return handles[:1]


# --- the config, and who the engine is ----------------------------------------------------------


def test_the_config_refuses_what_cannot_run_naming_it_and_models_get_their_step_rules() -> None:
    class Index:  # a CheckpointIndex's two facts model_steps reads
        def __init__(self, recurrent: bool, chunks_continue: bool) -> None:
            self.recurrent, self.chunks_continue = recurrent, chunks_continue

    assert model_steps(Index(False, False)) == {"uniform_steps": False, "whole_prompts": False}
    assert model_steps(Index(True, True)) == {"uniform_steps": True, "whole_prompts": False}
    assert model_steps(Index(True, False)) == {"uniform_steps": True, "whole_prompts": True}
    for name in ("num_slots", "max_seq_len", "prefill_tokens", "block_size"):
        with pytest.raises(ConfigError) as error:
            EngineConfig(**{"num_slots": 2, "max_seq_len": 64, name: 0})
        assert str(error.value) == f"{name}=0 must be >= 1"
    # blocks of 8 positions: 64 take 8 (of 16 positions, 4 would do)
    with pytest.raises(ConfigError) as error:
        EngineConfig(num_slots=2, max_seq_len=64, block_size=8, num_blocks=7)
    assert str(error.value) == (
        "a KV pool of 7 blocks x 8 positions cannot hold one sequence of max_seq_len=64 "
        "(8 blocks): give it more tokens, or lower max_seq_len"
    )
    assert EngineConfig(num_slots=2, max_seq_len=64, block_size=8, num_blocks=8).num_blocks == 8
    with pytest.raises(ConfigError) as error:
        EngineConfig(num_slots=3, max_seq_len=64, max_queue=2)
    assert str(error.value) == (
        "max_queue=2 must be >= max_batch=3: a request as large as the batch must be able to "
        "wait for it"
    )
    assert EngineConfig(num_slots=3, max_seq_len=64, max_queue=3).max_queue == 3  # a batch


def test_an_engine_is_its_own_claim_in_a_daemon_thread_with_the_configs_blocks(started) -> None:
    """Its id names it; its first claim is epoch 1; a second engine that does not say it takes
    the workers over is refused; its loop (where every callback runs) is a daemon thread named
    offload-engine; its steps and pool use the config's block size; the stats show the tokens
    the pool holds as they grow."""
    engine, pipeline = started(block_size=8, burst_steps=1)
    assert re.fullmatch(r"engine-[0-9a-f]{12}", engine.id)
    assert engine.owner == (engine.id, 1) and pipeline.claims == [(engine.id, 1)]
    with pytest.raises(ClaimedByAnotherError):
        Engine(pipeline, EngineConfig(num_slots=2, max_seq_len=64))
    # 2 slots x 64 positions in blocks of 8
    assert engine.scheduler.num_blocks == engine.stats.snapshot()["kv_blocks"] == 16
    sizes, seen = [], []
    real_submit = pipeline.submit

    def sizes_of(steps):
        sizes.extend(step.rows.block_size for step in steps)
        return real_submit(steps)

    pipeline.submit = sizes_of
    prompt = list(range(3, 13))  # 10 tokens: past a block of 8 at once

    def on_token(row, token) -> None:  # the token's position is not fed yet
        thread = threading.current_thread()
        held = engine.stats.snapshot()["kv_tokens_used"]
        seen.append((thread.name, thread.daemon, held, len(prompt) + len(seen)))

    request = submit(engine, prompt, 10, on_token=on_token)
    assert request.result(WAIT_S) == [expected(prompt, 10)]
    assert set(sizes) == {8}
    assert [(name, daemon) for name, daemon, _, _ in seen] == [("offload-engine", True)] * 10
    assert [held for _, _, held, _ in seen] == [fed for _, _, _, fed in seen]


# --- clients: submit, cancel, close ---------------------------------------------------------------


def test_submit_seeds_each_row_counts_requests_and_refusals_and_close_ends_the_rest(
    started,
) -> None:
    """A sampled request's rows draw with its seed plus their row (the last stage gets each
    once), or without one with a random seed of their own that fits 63 bits; the stats count
    every request queued and every refusal; close waits for the loop to end what was open,
    with an error that says so, never raises for workers that are going too, and a submit
    after it is refused saying the job is closed."""
    pipeline = LastStage()
    engine, _ = started(pipeline, num_slots=3, max_queue=3, burst_steps=1)
    seeded = engine.submit([[3], [4, 5], [6]], sampling=SAMPLED, max_new_tokens=2, seed=100)
    assert seeded.result(WAIT_S) == [expected([3], 2), expected([4, 5], 2), expected([6], 2)]
    assert sorted(s.seed for s in pipeline.settings) == [100, 101, 102]
    assert [s.seed for s in seeded.sequences] == [100, 101, 102]
    # nothing to generate: done at once, each row seeded all the same
    unseeded = [engine.submit([[3]] * 3, sampling=SAMPLED, max_new_tokens=0) for _ in range(6)]
    seeds = [s.seed for request in unseeded for s in request.sequences]
    assert all(isinstance(seed, int) and 0 <= seed < 2**63 for seed in seeds)
    assert len(set(seeds)) == len(seeds)
    assert all(s.seed is None for s in submit(engine, [3], 0).sequences)  # greedy draws none
    assert engine.stats.requests == 1  # those with nothing to generate never queue

    pipeline.gate.clear()  # the next step waits there: the rest queue behind it
    sent, send = threading.Event(), pipeline.submit

    def seen(steps):
        sent.set()
        return send(steps)

    pipeline.submit = seen
    running = engine.submit([[3], [4], [5]], sampling=GREEDY, max_new_tokens=30)
    assert sent.wait(WAIT_S)  # all three slots taken: its step is on its way
    assert engine.stats.requests == 2
    waiting = [submit(engine, [6 + i], 2) for i in range(3)]
    for _ in range(2):
        with pytest.raises(QueueFullError):
            submit(engine, [9], 2)
    assert engine.stats.rejected == 2

    def release(owner) -> None:
        raise RuntimeError("the workers are gone too")

    pipeline.release = release
    closed = []
    closer = threading.Thread(
        target=lambda: (engine.close(), closed.append([r.done() for r in [running, *waiting]]))
    )
    closer.start()
    pipeline.gate.set()
    closer.join()
    assert closed == [[True] * 4]  # close returned once the loop had ended them all
    for request in [running, *waiting]:
        with pytest.raises(EngineClosedError) as error:
            request.result(WAIT_S)
        assert str(error.value) == "the job was closed before the request finished"
    with pytest.raises(EngineClosedError) as error:
        submit(engine, [3], 2)
    assert str(error.value) == "the job is closed"


# --- the workers: the gate, recovery, claims ----------------------------------------------------


def test_the_gate_is_taken_only_to_send_steps_and_workers_changed_between_them_restart_once(
    started,
) -> None:
    """The workers' gate (inside which nobody replaces them) is taken at start and then only
    to send steps: an idle engine never takes it. Workers replaced by another thread between
    two steps (a new epoch the gate yields): the next turn drops the caches, claims them again
    and every sequence feeds its tokens again, once: the text is unchanged."""
    entries = []
    pipeline = FakePipeline()

    @contextlib.contextmanager
    def gate():
        entries.append(pipeline.epoch)
        yield pipeline.epoch

    engine, _ = started(pipeline, burst_steps=1, engine={"gate": gate})
    assert entries == [0]  # the claim at start; idle since
    assert submit(engine, [3, 4], 1).result(WAIT_S) == [expected([3, 4], 1)]
    assert entries == [0, 0]  # its one step
    assert submit(engine, [5], 1).result(WAIT_S) == [expected([5], 1)]
    assert entries == [0, 0, 0]

    def replaced_at_the_second(row, token) -> None:
        if len(request.sequences[0].generated) == 2:
            replace_workers(pipeline)  # as another thread's recovery would, between steps

    with engine._cond:  # named before its callback can run
        request = submit(engine, [6, 7], 6, on_token=replaced_at_the_second)
    assert request.result(WAIT_S) == [expected([6, 7], 6)]
    assert engine.stats.restarts == 1
    assert engine.owner == (engine.id, 2) and pipeline.claims == [(engine.id, 1), (engine.id, 2)]
    # its prompt and 2 tokens so far fed again from position 0, then its last 3 tokens
    assert [(p, counts) for p, _, counts, _ in pipeline.steps[-4:]] == [
        (True, (4,)),
        *[(False, (1,))] * 3,
    ]
    assert pipeline.starts[-4] == (0,)


def test_a_lost_worker_is_recovered_under_the_next_claim_with_the_pool_the_plan_gives_now(
    started,
) -> None:
    """In-process workers nobody else replaces (the default gate: epoch 0): `recover` hears
    the error with the epoch the step was sent in, the engine claims the workers again under
    its next epoch, takes the pool size the plan gives now, and counts each restart; the same
    for a worker lost while a step's tokens come back."""
    pipeline = BreaksWhileRead()
    recover, sizes = Recorder(pipeline), [8]
    engine, _ = started(
        pipeline,
        num_blocks=8,
        burst_steps=1,
        engine={"recover": recover, "gate": None, "num_blocks": lambda: sizes[0]},
    )
    assert engine.owner == (engine.id, 1) and engine.stats.snapshot()["kv_blocks"] == 8

    def lost_at_the_second(row, token) -> None:
        if len(request.sequences[0].generated) == 2:
            sizes[0] = 12  # the plan re-balanced meanwhile
            pipeline.fail.append(WorkerLostError("worker died"))

    with engine._cond:  # named before its callback can run
        request = submit(engine, [3, 4], 5, on_token=lost_at_the_second)
    assert request.result(WAIT_S) == [expected([3, 4], 5)]
    assert [(type(error), epoch) for error, epoch in recover.calls] == [(WorkerLostError, 0)]
    assert engine.owner == (engine.id, 2)
    assert pipeline.claims == [(engine.id, 1), (engine.id, 2)]
    assert engine.stats.restarts == 1
    assert engine.scheduler.num_blocks == engine.stats.snapshot()["kv_blocks"] == 12

    def lost_while_read(row, token) -> None:
        if len(request.sequences[0].generated) == 2:
            pipeline.broken.append(WorkerLostError("worker died while answering"))

    with engine._cond:  # named before its callback can run
        request = submit(engine, [5, 6], 5, on_token=lost_while_read)
    assert request.result(WAIT_S) == [expected([5, 6], 5)]
    assert [(str(error), epoch) for error, epoch in recover.calls[1:]] == [
        ("worker died while answering", 0)
    ]
    assert engine.owner == (engine.id, 3) and engine.stats.restarts == 2


def test_only_a_lost_or_changed_worker_is_recovered_and_a_refused_claim_ends_every_request(
    started,
) -> None:
    """A step that fails otherwise (while it is sent or read) ends every request in it with
    its error, and `recover` never hears it; nor a step another engine's claim refused (it
    comes wrapped in a RayTaskError). One refused because the workers changed is recovered.
    A step that does not come back within step_timeout_s says which setting bounds it. When
    another engine claims the new workers before this one does again, every request waiting
    or running ends with that refusal."""
    pipeline = BreaksWhileRead()
    recover = Recorder(pipeline)
    engine, _ = started(pipeline, burst_steps=1, engine={"recover": recover})
    broken = ValueError("the stage broke while answering")
    pipeline.broken.append(broken)
    with engine._cond:  # both in one turn: one step
        first, second = submit(engine, [3, 4], 3), submit(engine, [5], 3)
    for request in (first, second):
        assert request.wait(WAIT_S) and request.error is broken
        assert request.finish_reasons == [Finish.ERROR]
    refused = ray.exceptions.RayTaskError("submit", "", ClaimedByAnotherError("owned"))
    pipeline.fail.append(refused)
    request = submit(engine, [3, 4], 3)
    assert request.wait(WAIT_S) and request.error is refused
    assert recover.calls == [] and engine.stats.restarts == 0
    changed = ray.exceptions.RayTaskError("submit", "", NotOwnerError("an older epoch"))
    pipeline.fail.append(changed)
    assert submit(engine, [6, 7], 3).result(WAIT_S) == [expected([6, 7], 3)]
    assert recover.calls == [(changed, 0)] and engine.stats.restarts == 1

    for failing in (3, 4):  # each turn sends micro-batch 0's step, then 1's
        pipeline, sent = FakePipeline(num_stages=2), []
        send = pipeline.submit

        def fails_once(steps, send=send, sent=sent, failing=failing):
            sent.append((steps[0].rows.slots, steps[0].rows.table_from))
            if len(sent) == failing:  # the first of the second turn's, or the second
                raise ValueError("the stage broke taking it")
            return send(steps)

        pipeline.submit = fails_once
        engine, _ = started(pipeline, burst_steps=1)
        with engine._cond:  # one to each micro-batch (its slot: 0 or 1)
            requests = [submit(engine, [3, 4], 4), submit(engine, [5, 6], 4)]
        broken, fine = requests if failing == 3 else requests[::-1]
        assert broken.wait(WAIT_S) and str(broken.error) == "the stage broke taking it"
        assert fine.result(WAIT_S) == [expected([3, 4] if failing == 4 else [5, 6], 4)]
        slot = requests.index(fine)
        assert pipeline.settings_sent.count(slot) == 1  # the last stage keeps them
        # its whole block table: with its first step, and again only after a step of it
        # that was planned and never sent (it may have reached some stages), not one sent
        whole = [table_from for slots, table_from in sent if slots == (slot,)].count((0,))
        assert whole == (2 if failing == 3 else 1)

    hung, _ = started(FakePipeline(), step_timeout_s=5)
    hung.pipeline.wait = lambda handles, timeout_s: []  # a stage that does not answer
    request = submit(hung, [3], 2)
    with pytest.raises(TimeoutError) as error:
        request.result(WAIT_S)
    assert str(error.value) == "a generation step did not finish within 5 s (forward_timeout_s)"

    taken = FakePipeline()
    other = ("engine-other", 1)
    recover = Recorder(taken, then=lambda: taken.runner.claim(other, take=False))
    engine, _ = started(taken, burst_steps=1, engine={"recover": recover})

    def lost_at_the_first(row, token) -> None:
        if not taken.fail and not recover.calls:
            taken.fail.append(WorkerLostError("worker died"))

    taken.gate.clear()
    running = engine.submit(
        [[3], [4]], sampling=GREEDY, max_new_tokens=5, on_token=lost_at_the_first
    )
    waiting = submit(engine, [5], 5)
    taken.gate.set()
    for request in (running, waiting):
        assert request.wait(WAIT_S) and isinstance(request.error, ClaimedByAnotherError)
    assert running.error is waiting.error
    assert taken.owner == other and engine.stats.restarts == 1


# --- steps: micro-batches, bursts, cuts ---------------------------------------------------------


def test_micro_batches_go_on_one_by_one_and_burst_together_once_all_of_them_decode(
    started,
) -> None:
    """Two micro-batches on a ring whose calls come back one at a time. One step per call:
    each is sent on its own, and a micro-batch whose step is back gets its next at once while
    the other's is still out. With bursts: a micro-batch is never sent a burst of its own
    while the other has sequences (its step out, a prompt chunked); once both decode, both go
    in one burst (of 2 when that is what they have left). Every call and read is bounded by
    step_timeout_s; the stats count each call, each step read and its rows."""
    engine, pipeline = started(OneAtATime(), burst_steps=1, step_timeout_s=77)
    with engine._cond:  # both in one turn: one to each micro-batch
        requests = [submit(engine, [3, 4], 4), submit(engine, [5, 6], 4)]
    for request, prompt in zip(requests, ([3, 4], [5, 6]), strict=True):
        assert request.result(WAIT_S) == [expected(prompt, 4)]
    single = ((True, 1),), ((False, 1),)
    assert pipeline.events[:6] == [
        ("send", (0,), single[0]),
        ("send", (1,), single[0]),
        ("back", (0,)),
        ("send", (0,), single[1]),  # while the other's is out
        ("back", (1,)),
        ("send", (1,), single[1]),
    ]
    assert set(pipeline.timeouts) == {77}
    sends = [event for event in pipeline.events if event[0] == "send"]
    snapshot = engine.stats.snapshot()
    assert snapshot["calls"] == len(sends) == 8
    assert snapshot["steps"] == 8 and snapshot["mean_batch"] == 1.0

    engine, pipeline = started(OneAtATime(), burst_steps=4, prefill_tokens=4)
    long = list(range(3, 11))  # 8 tokens: 2 chunks, the second choosing its first token
    with engine._cond:
        requests = [submit(engine, long, 8), submit(engine, [5], 8)]
    for request, prompt in zip(requests, (long, [5]), strict=True):
        assert request.result(WAIT_S) == [expected(prompt, 8)]
    sends = [event[1:] for event in pipeline.events if event[0] == "send"]
    assert sends == [
        ((0,), ((True, 1),)),  # the first chunk of the long prompt
        ((1,), ((False, 1),)),  # the one-token prompt, a decode
        ((0,), ((True, 1),)),  # the second chunk chooses, but the other's step is out: alone
        ((1,), ((False, 1),)),
        ((0, 1), ((False, 4), (False, 4))),  # both decode: one burst of both
        ((0, 1), ((False, 2), (False, 2))),  # what the one-token prompt has left
        ((0,), ((False, 1),)),
    ]
    snapshot = engine.stats.snapshot()
    assert snapshot["calls"] == len(sends)
    assert snapshot["steps"] == sum(count for _, steps in sends for _, count in steps)


def test_a_burst_is_cut_once_at_the_step_a_boundary_is_wanted_never_after_its_last(
    started,
) -> None:
    """Bursts of up to 8 steps (12 where the config says so: only a model with recurrent
    state is held to 8). A request arriving at a burst's last step cuts nothing; a cancel
    from a token's callback cuts the burst at that very step, however late in it; a sequence
    that ends on its end token mid-burst cuts it for the others. On a ring that runs a cut
    burst out, its remaining steps are read (and applied to nobody) and it is cut once."""
    engine, pipeline = started(burst_steps=8)
    stats = engine.stats
    joined = []

    def join_at_the_last(row, token) -> None:
        if len(first.sequences[0].generated) == 4:
            joined.append(submit(engine, [9, 8], 2))

    with engine._cond:  # named before its callback can run
        first = submit(engine, [3, 4], 4, on_token=join_at_the_last)
    assert first.result(WAIT_S) == [expected([3, 4], 4)]
    assert joined[0].result(WAIT_S) == [expected([9, 8], 2)]
    assert [count for _, _, _, count in pipeline.steps] == [4, 2]
    assert (stats.cut, stats.steps) == (0, 6)

    def cancel_at_the_sixth(row, token) -> None:
        if len(cancelled.sequences[0].generated) == 6:
            engine.cancel(cancelled)

    with engine._cond:  # named before its callback can run
        cancelled = submit(engine, [3, 4], 20, on_token=cancel_at_the_sixth)
    assert cancelled.wait(WAIT_S) and cancelled.finish_reasons == [Finish.ABORT]
    assert cancelled.sequences[0].generated == expected([3, 4], 6)
    assert pipeline.steps[-1][3] == 8 and (stats.cut, stats.steps) == (1, 6 + 6)

    eos, base = expected([3, 4], 8)[2], len(pipeline.steps)
    with engine._cond:  # one step for both
        ends = submit(engine, [3, 4], 8, eos_token_ids=(eos,))
        goes_on = submit(engine, [5, 6], 20)
    assert ends.result(WAIT_S) == [expected([3, 4], 3)] and ends.finish_reasons == [Finish.STOP]
    assert goes_on.result(WAIT_S) == [expected([5, 6], 20)]
    assert stats.cut == 2 and pipeline.steps[base][1:] == ((0, 1), (2, 2), 8)
    # cut after the third step: the other goes on alone feeding its third token at 2 + 2
    assert (pipeline.steps[base + 1][1], pipeline.starts[base + 1]) == ((1,), (4,))

    ring, drained = started(FakePipeline(num_stages=2, drains=True), burst_steps=12)

    def cancel_at_the_third(row, token) -> None:
        if len(long.sequences[0].generated) == 3:
            ring.cancel(long)

    with ring._cond:  # named before its callback can run
        long = submit(ring, [3, 4], 30, on_token=cancel_at_the_third)
    assert long.wait(WAIT_S) and long.sequences[0].generated == expected([3, 4], 3)
    assert drained.steps[0][3] == 12  # a burst of 12
    assert (ring.stats.cut, ring.stats.steps) == (1, 12)  # cut once, every step read


def test_bursts_go_on_beside_a_request_that_waits_for_blocks_not_beside_one_that_could_start(
    started,
) -> None:
    """A request at the head of the queue that the pool has no blocks for yet (a slot is
    free): the running sequence bursts on, since no step boundary would admit it. One that
    arrives while the driver plans, with a slot and blocks free: that step goes alone (no
    burst to cut at once), and the newcomer starts at the next. A preemption is counted in
    the rate the stats give at that moment."""
    engine, pipeline = started(num_blocks=5, prefill_tokens=64, burst_steps=4)
    with engine._cond:  # both arrive in one turn
        first = submit(engine, list(range(3, 40)), 20)  # 37 tokens: 3 blocks of 5
        blocked = submit(engine, list(range(4, 50)), 5)  # 46: 3 more, 2 free (1 margin)
    assert first.result(WAIT_S) == [expected(list(range(3, 40)), 20)]
    assert blocked.result(WAIT_S) == [expected(list(range(4, 50)), 5)]
    # its prompt going on as a burst, then bursts: 4 x 5 = its 20 tokens before the other
    assert [(prefill, counts, count) for prefill, _, counts, count in pipeline.steps[:6]] == [
        (True, (37,), 4),
        *[(False, (1,), 4)] * 4,
        (True, (46,), 4),
    ]

    armed, joined = [], []
    pipeline = FakePipeline()

    @contextlib.contextmanager
    def gate():
        if armed and not joined:  # the engine's thread, about to plan
            joined.append(submit(engine, [9, 8], 3))
        yield pipeline.epoch

    engine, _ = started(pipeline, burst_steps=4, engine={"gate": gate})

    def arm_at_the_fourth(row, token) -> None:  # the last of the first burst
        if len(first.sequences[0].generated) == 4:
            armed.append(True)

    with engine._cond:  # named before its callback can run
        first = submit(engine, [3, 4], 10, on_token=arm_at_the_fourth)
    assert first.result(WAIT_S) == [expected([3, 4], 10)]
    assert joined[0].result(WAIT_S) == [expected([9, 8], 3)]
    assert engine.stats.cut == 0
    assert [(prefill, slots, count) for prefill, slots, _, count in pipeline.steps[:3]] == [
        (True, (0,), 4),
        (False, (0,), 1),  # planned as the newcomer came: alone
        (True, (0, 1), 3),  # the newcomer's prompt with the other's decode, going on
    ]

    engine, _ = started(num_slots=4, num_blocks=6, burst_steps=4)
    with engine._cond:  # three at once in a pool too small for them: preemptions
        requests = [submit(engine, p, 40) for p in ([3, 4, 5], [6, 7], [8, 9, 10, 11])]
    for request, prompt in zip(requests, ([3, 4, 5], [6, 7], [8, 9, 10, 11]), strict=True):
        assert request.result(WAIT_S) == [expected(prompt, 40)]
    snapshot = engine.stats.snapshot()
    assert snapshot["preemptions"] >= 1 and snapshot["preemptions_per_min"] > 0


def test_the_batching_window_ends_at_a_cancel_and_a_busy_engine_never_opens_one(started) -> None:
    """An idle engine waits up to batch_wait_s for requests to start with the first (here
    far longer than the test may take): a cancel ends that wait at once (the request ends
    with nothing generated). A request that arrives while others run never opens one, though
    nothing else waits and no step is out when it is taken in."""
    engine, pipeline = started(batch_wait_s=10 * WAIT_S, burst_steps=1)
    alone = submit(engine, [3, 4], 5)  # one sequence of two: the window stays open
    engine.cancel(alone)
    assert alone.wait(WAIT_S) and alone.finish_reasons == [Finish.ABORT]
    assert alone.result(WAIT_S) == [[]] and pipeline.steps == []

    joined = []

    def join_at_the_second(row, token) -> None:
        if row == 0 and len(both.sequences[0].generated) == 2:
            joined.append(submit(engine, [9, 8], 3))  # every slot is taken: it waits

    with engine._cond:  # named before its callback can run
        both = engine.submit(  # as many sequences as slots: no window
            [[3, 4], [5, 6]], sampling=GREEDY, max_new_tokens=6, on_token=join_at_the_second
        )
    assert both.result(WAIT_S) == [expected([3, 4], 6), expected([5, 6], 6)]
    assert joined[0].result(WAIT_S) == [expected([9, 8], 3)]


# --- what reaches the client ----------------------------------------------------------------------


class NoPromptScores(LastStage):
    """A last stage that answers with each token's log-probabilities, never the prompt's."""

    def __init__(self) -> None:
        super().__init__(scores=True)

    def submit(self, steps) -> InProcessHandle:
        [(m, chosen)] = list(super().submit(steps).outputs)
        return InProcessHandle([(m, dataclasses.replace(chosen, prompt={}))])


def test_log_probabilities_that_do_not_come_back_end_the_request_saying_which(started) -> None:
    """A one-token prompt has no positions to score: asked for its prompt's log-probabilities
    it gets each token's only. A longer prompt whose scores never came, or a token that came
    without its own, ends its request with an error that says which."""
    engine, _ = started(LastStage(scores=True), burst_steps=1)
    got = []
    one = engine.submit(
        [[5]],
        sampling=GREEDY,
        max_new_tokens=3,
        logprobs=1,
        prompt_logprobs=1,
        on_logprobs=lambda row, scores: got.append(scores.start),
        on_token=lambda row, token: None,
    )
    assert one.result(WAIT_S) == [expected([5], 3)]
    assert got == [1, 2, 3]  # each token's, at its position: none for the prompt

    engine, _ = started(NoPromptScores(), burst_steps=1)
    unscored = engine.submit(
        [[3, 4]],
        sampling=GREEDY,
        max_new_tokens=3,
        prompt_logprobs=1,
        on_logprobs=lambda row, scores: None,
        on_token=lambda row, token: None,
    )
    with pytest.raises(RuntimeError) as error:
        unscored.result(WAIT_S)
    assert str(error.value) == "the prompt's log-probabilities did not all come back"

    engine, pipeline = started(LastStage(scores=True), burst_steps=1)
    pipeline.withhold.add(9)
    bare = engine.submit(
        [[9, 10]],
        sampling=GREEDY,
        max_new_tokens=3,
        logprobs=1,
        on_logprobs=lambda row, scores: None,
        on_token=lambda row, token: None,
    )
    with pytest.raises(RuntimeError) as error:
        bare.result(WAIT_S)
    assert str(error.value) == "a token came back without its log-probabilities"


# --- a loop that stops ----------------------------------------------------------------------------


def test_a_stopped_loop_ends_every_request_with_why_even_when_its_bookkeeping_is_broken(
    started, caplog, monkeypatch
) -> None:
    """A bug in the loop (a step's plan raises) stops it: the request ends with an
    EngineStoppedError naming the error, the traceback goes to the log, and the thread ends
    cleanly though nobody listens (`on_stopped` unset) and the workers' release raises. When
    ending the requests through the scheduler fails too, each open request is ended directly
    with that error (waiting, running, out in a step), one already ended is passed over, the
    second failure is logged too, and `on_stopped` hears the stop."""
    unhandled = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    caplog.set_level(logging.ERROR, logger="coordinator.engine.engine")
    engine, pipeline = started()
    bug = RuntimeError("the plan broke")

    def broken(*args) -> None:
        raise bug

    def release(owner) -> None:
        raise RuntimeError("the workers are gone too")

    engine.scheduler.plan, pipeline.release = broken, release
    request = submit(engine, [3, 4], 2)
    with pytest.raises(EngineStoppedError) as error:
        request.result(WAIT_S)
    assert str(error.value) == (
        "the load's engine stopped on an error (RuntimeError: the plan broke); its requests "
        "ended with it, and a new engine is started for the load: retry shortly"
    )
    assert error.value is engine.failure
    engine._thread.join(WAIT_S)
    assert not engine._thread.is_alive() and unhandled == []
    [record] = caplog.records
    assert record.getMessage() == f"engine {engine.id} stopped" and record.exc_info[1] is bug

    caplog.clear()
    ring = OneAtATime()
    engine, _ = started(ring, burst_steps=1)
    heard = []
    engine.on_stopped = heard.append
    broke, again = RuntimeError("the ring broke"), RuntimeError("the bookkeeping broke")
    wait = ring.wait

    def fails(*args) -> None:
        raise again

    def breaks_at_the_third(handles, timeout_s):
        if sum(event[0] == "back" for event in ring.events) == 2:
            engine.scheduler.fail_request = fails  # and so does ending them
            raise broke
        return wait(handles, timeout_s)

    def cancel_the_other(row, token) -> None:  # its first token: the other's step is out
        engine.cancel(other)

    ring.wait = breaks_at_the_third
    with engine._cond:  # one turn: one to each micro-batch, the third waits for a slot
        other = submit(engine, [3, 4], 10)
        running = submit(engine, [5, 6], 10, on_token=cancel_the_other)
        waiting = submit(engine, [7], 3)
    assert other.wait(WAIT_S) and other.finish_reasons == [Finish.ABORT] and not other.error
    for request in (running, waiting):
        assert request.wait(WAIT_S) and request.finish_reasons == [Finish.ERROR]
        assert request.error is engine.failure
    assert "(RuntimeError: the ring broke)" in str(engine.failure)
    engine._thread.join(WAIT_S)
    assert heard == [engine.failure] and unhandled == []
    assert [(r.getMessage(), r.exc_info[1]) for r in caplog.records] == [
        (f"engine {engine.id} stopped", broke),
        (f"engine {engine.id}: ending its requests failed", again),
    ]


def test_a_loop_that_stops_while_ending_requests_still_ends_them(started) -> None:
    """The loop's promise (`_loop`: a bug must not leave clients waiting): a request whose
    last token came in the turn the bug hits is ended by the time `on_stopped` hears it."""
    engine, _ = started(burst_steps=1)
    stopped = threading.Event()
    engine.on_stopped = lambda error: stopped.set()
    record = engine.stats.preempted

    def broken(*args) -> None:
        raise RuntimeError("the stats broke")

    def break_at_the_last(row, token) -> None:  # the request is taken as done next
        if len(request.sequences[0].generated) == 2:
            engine.stats.preempted = broken

    with engine._cond:  # named before its callback can run
        request = submit(engine, [3, 4], 2, on_token=break_at_the_last)
    assert stopped.wait(WAIT_S)
    engine.stats.preempted = record
    assert request.done()


def test_a_request_cancelled_while_the_engine_goes_idle_ends_without_the_idle_wait(
    started, monkeypatch
) -> None:
    """A request cancelled from its first token's callback: the next turn finds nothing
    else to run. Its client hears the end at once, not after the idle wait (made longer
    than the test's bound here), and the engine then serves the next request."""
    monkeypatch.setattr(engine_module, "IDLE_WAIT_S", 10 * WAIT_S)
    engine, _ = started(burst_steps=1)

    def cancel_at_first(row, token) -> None:
        engine.cancel(request)

    with engine._cond:  # named before its callback can run
        request = submit(engine, [3, 4], 40, on_token=cancel_at_first)
    assert request.wait(WAIT_S), "the cancelled request waited out the idle wait"
    assert request.finish_reasons == [Finish.ABORT] and len(request.sequences[0].generated) < 40
    assert submit(engine, [5, 6], 3).result(WAIT_S) == [expected([5, 6], 3)]


# --- tests only: the token hold -------------------------------------------------------------------


def test_the_token_hold_keeps_a_requests_second_token_until_a_cancel_or_its_file(
    started, tmp_path, monkeypatch
) -> None:
    """With OFFLOAD_TEST_HOLD_TOKENS naming a missing file, the loop applies a request's first
    token, then holds the next (looking for the file again and again) until the request is
    cancelled (it ends with that one token) or the file appears (it goes on to its end)."""
    hold = tmp_path / "go"
    monkeypatch.setenv(HOLD_TOKENS_ENV, str(hold))
    looks, held = [0], threading.Event()
    exists = os.path.exists

    def looking(path) -> bool:
        if path == str(hold):
            looks[0] += 1
            if looks[0] >= 2:  # a second look with no token applied since: held
                held.set()
        return exists(path)

    monkeypatch.setattr(os.path, "exists", looking)
    engine, _ = started(burst_steps=1)

    def on_token(row, token) -> None:
        looks[0] = 0

    for prompt, release in (([3, 4], "cancel"), ([5, 6], "file")):
        held.clear()
        request = submit(engine, prompt, 4, on_token=on_token, on_finish=held.set)
        assert held.wait(WAIT_S) and not request.done()  # held, not ended
        assert request.sequences[0].generated == expected(prompt, 1)
        if release == "cancel":
            engine.cancel(request)
            assert request.wait(WAIT_S) and request.finish_reasons == [Finish.ABORT]
            assert request.sequences[0].generated == expected(prompt, 1)
        else:
            hold.touch()
            assert request.result(WAIT_S) == [expected(prompt, 4)]
