"""The engine's loop on a stand-in pipeline whose "model" is a pure function of each slot's
cached tokens: what it answers depends only on what the scheduler wrote where, so these tests
check the bookkeeping (queue, slots, chunked prefill, micro-batches, bursts, cancellation,
failures, recovery) fast and exactly. The real models are in test_generation.py."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from coordinator.engine import Engine, EngineConfig, Finish, QueueFullError
from coordinator.engine.engine import UNIFORM_MAX_BURST, EngineClosedError
from coordinator.engine.pipelines import InProcessHandle
from coordinator.runtime.errors import WorkerLostError
from offload.errors import BusyError, ConfigError, NeverFitsError
from worker.batch_cache import KvPool
from worker.batched import BatchRunner
from worker.steps import NO_TOKEN, ClaimedByAnotherError, Sampling

GREEDY = Sampling()
WAIT_S = 30.0


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


def expected(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakePipeline:
    """Blocks of tokens: a step writes each row's real tokens at their positions in the blocks
    of its table, and a row that chooses gets `next_token` of what its blocks hold up to its
    end. A block keeps everything ever written to it (nothing is cleared), and every read is
    checked against the sequence's own tokens: a row that reads another sequence's keys (a
    block two sequences hold, or one freed under it), or a stale position, fails the test.
    Like a worker, it runs only the steps of the engine (and epoch) that claimed it, and
    keeps each slot's block table from what the steps carry (`BatchRunner.block_tables`).
    Records every step; `fail` makes the next submits raise (a lost worker, or another
    error). A burst's steps all run when it is submitted."""

    max_burst = 8

    def __init__(
        self, num_stages: int = 1, *, recurrent: bool = False, drains: bool = False
    ) -> None:
        """`recurrent`: the model keeps a state per sequence, as a worker's KV pool keeps
        it (`worker.batch_cache`): a padded row, or a step that does not start where its
        slot's last step ended (one ran whose tokens were dropped), is refused. A cut burst's
        steps that ran are never read (as a cancelled one-stage Ray burst's), or with
        `drains` all read (as a ring on several stages runs them out)."""
        self.num_stages = num_stages
        self.recurrent = recurrent
        self.drains = drains
        self.pool: KvPool | None = None
        self.blocks: dict[int, list[int | None]] = {}
        self.steps: list[tuple[bool, tuple[int, ...], tuple[int, ...], int]] = []
        self.fail: list[BaseException] = []
        self.recoveries = 0
        self.submits: list[int] = []  # steps per submit (> 1: micro-batches in one burst)
        self.starts: list[tuple[int, ...]] = []
        self.epoch = 0
        self.runner = BatchRunner(torch.device("cpu"))  # the workers' claims and refusals
        self.claims: list[tuple[str, int]] = []
        self.settings_sent: list[int] = []  # slots whose sequence's settings a step carried
        self.gate = threading.Event()
        self.gate.set()

    @property
    def owner(self) -> tuple[str, int] | None:
        return self.runner.owner

    def claim(self, owner, *, take) -> None:
        self.runner.claim(owner, take=take)
        self.claims.append(owner)

    def release(self, owner) -> None:
        self.runner.release(owner)

    def submit(self, steps) -> InProcessHandle:
        """One step, or a burst of `count` steps of each micro-batch, taking turns as the
        first stage drives them (`StageWorker.batch_ring`)."""
        self.gate.wait(WAIT_S)
        if self.fail:
            raise self.fail.pop(0)
        for step in steps:
            self.runner.check_owner(step.rows)
        self.submits.append(len(steps))
        current = []
        for step in steps:
            self.steps.append((step.prefill, step.rows.slots, step.rows.counts, step.count))
            self.starts.append(step.rows.starts)
            current.append([step.rows, step.x, step.draw, step.sequences])
            self.settings_sent.extend(slot for slot, _ in step.draw.settings)
        outputs = []
        for _ in range(steps[0].count):
            for m, (rows, x, draw, sequences) in enumerate(current):
                tables = self.runner.block_tables(rows)
                self._take_in(rows, tables)
                tokens = torch.full((len(rows.slots),), NO_TOKEN)
                for r, (start, count) in enumerate(zip(rows.starts, rows.counts, strict=True)):
                    table, size = tables[r], rows.block_size
                    assert len(table) * size >= start + count, "a row wrote past its blocks"
                    new = x[r, rows.width - count :].tolist()
                    for p, token in enumerate(new, start):
                        block = self.blocks.setdefault(table[p // size], [None] * size)
                        block[p % size] = token
                    seen = [
                        self.blocks.get(table[p // size], [None] * size)[p % size]
                        for p in range(start + count)
                    ]
                    # as far as the engine knows the sequence (a burst's later steps feed the
                    # tokens this burst chose, which the engine reads after it)
                    own = sequences[r].tokens[: start + count]
                    if sequences[r].finish is None:  # an ended row's reads are never used
                        assert seen[: len(own)] == own, "a row read what it did not write"
                    if draw.choose[r]:
                        tokens[r] = next_token(seen)
                outputs.append((m, tokens))
                current[m][:2] = rows.advanced(), tokens[:, None]
        return InProcessHandle(outputs if self.drains else iter_over(outputs))

    def _take_in(self, rows, tables) -> None:
        """A recurrent model's step through the workers' own checks on a one-layer state."""
        if not self.recurrent:
            return
        if self.pool is None:
            self.pool = KvPool(
                [0],
                num_blocks=rows.num_blocks,
                block_size=rows.block_size,
                num_slots=rows.num_slots,
                device=torch.device("cpu"),
            )
            self.pool.states["recurrent", 0, 0] = torch.zeros(rows.num_slots, 1)
        view = self.pool.view(
            list(rows.slots), list(rows.starts), list(rows.counts), rows.width, tables
        )
        view.get_recurrent_state(0)  # refuses padding
        view.commit()

    def wait(self, handles, timeout_s):
        return list(handles)

    def recover(self, exc, epoch) -> None:
        if epoch != self.epoch:  # replaced since the step was sent: nothing more to do
            return
        if not isinstance(exc, WorkerLostError):
            raise exc
        self.recoveries += 1
        self.epoch += 1
        self.blocks.clear()  # the new worker holds no cache
        self.pool = None  # nor any state
        self.runner.reset()  # nor any claim


def iter_over(outputs):
    """The steps that ran, read one by one: `stop` (closing it) leaves the rest unread."""
    yield from outputs


@pytest.fixture
def make():
    engines = []

    def make(
        pipeline=None, plan_micro_batches=None, take_over=False, **options
    ) -> tuple[Engine, FakePipeline]:
        pipeline = pipeline or FakePipeline()
        config = EngineConfig(**{"num_slots": 2, "max_seq_len": 64, **options})
        engine = Engine(
            pipeline,
            config,
            recover=pipeline.recover,
            gate=lambda: contextlib.nullcontext(pipeline.epoch),
            micro_batches=plan_micro_batches,
            take_over=take_over,
        )
        engines.append(engine)
        return engine, pipeline

    yield make
    for engine in engines:
        engine.close()


def submit(engine, prompt, count, **kw):
    return engine.submit([prompt], sampling=GREEDY, max_new_tokens=count, **kw)


def test_sequences_join_and_leave_and_each_gets_its_own_tokens(make) -> None:
    engine, pipeline = make(num_slots=2, prefill_tokens=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17]]
    counts = [9, 3, 5, 7]
    requests = [submit(engine, p, n) for p, n in zip(prompts, counts, strict=True)]
    for request, prompt, count in zip(requests, prompts, counts, strict=True):
        assert request.result(WAIT_S) == [expected(prompt, count)]
        assert request.finish_reasons == [Finish.LENGTH]
    # never more rows than slots; a decode step carries every decoding sequence at once
    assert all(
        len(slots) <= 2 and len(set(slots)) == len(slots) for _, slots, _, _ in pipeline.steps
    )
    assert any(len(slots) == 2 for prefill, slots, _, _ in pipeline.steps if not prefill)
    # the 7-token prompt went in chunks of at most 4 tokens (rows x width <= prefill_tokens)
    assert max(sum(c) for p, _, c, _ in pipeline.steps if p) <= 4
    assert engine.scheduler.free_slots and len(engine.scheduler.free_slots) == 2


def test_a_long_prompt_is_chunked_and_decodes_go_on_between_chunks(make) -> None:
    engine, pipeline = make(num_slots=2, prefill_tokens=4, burst_steps=1)
    joined = []

    def join_at_the_second_token(row, token):  # the first sequence is decoding by then
        if not joined and len(first.sequences[0].generated) == 2:
            joined.append(submit(engine, list(range(3, 20)), 2))  # 17 tokens: 5 chunks

    first = submit(engine, [3, 4], 30, on_token=join_at_the_second_token)
    assert first.result(WAIT_S) == [expected([3, 4], 30)]
    [long] = joined
    assert long.result(WAIT_S) == [expected(list(range(3, 20)), 2)]
    slot = next(slots[0] for prefill, slots, counts, _ in pipeline.steps if counts == (4,))
    chunks = [
        i for i, (prefill, slots, _, _) in enumerate(pipeline.steps) if prefill and slots == (slot,)
    ]
    assert [pipeline.steps[i][2] for i in chunks] == [(4,), (4,), (4,), (4,)]
    # between two chunks of the long prompt, one decode step of the running sequence; its
    # last token (a chunk of one) joins that sequence's decode step
    assert all(not pipeline.steps[i + 1][0] for i in chunks)
    assert pipeline.steps[chunks[-1] + 1][1:3] == ((0, slot), (1, 1))


def test_the_queue_is_fifo_bounded_and_only_full_is_busy(make) -> None:
    engine, pipeline = make(num_slots=1, max_queue=2)
    pipeline.gate.clear()  # steps wait: everything queues
    running = submit(engine, [3], 4)
    while engine.scheduler.free_slots:  # the first took the slot
        running.wait(0.01)
    queued = [submit(engine, [4 + i], 2) for i in range(2)]
    with pytest.raises(QueueFullError, match=r"2 sequence\(s\) already wait .*max_queue=2") as err:
        submit(engine, [9], 2)
    assert isinstance(err.value, BusyError)
    with pytest.raises(NeverFitsError, match=r"70 tokens per sequence .* max_seq_len=64"):
        submit(engine, [3] * 60, 10)  # never fits: refused at once, not queued
    with pytest.raises(
        NeverFitsError,
        match=r"2 sequence\(s\) exceed the KV cache reserved for "
        r"max_batch=1",
    ):
        engine.submit([[3], [4]], sampling=GREEDY, max_new_tokens=2)
    pipeline.gate.set()
    assert [r.result(WAIT_S) for r in queued] == [[expected([4], 2)], [expected([5], 2)]]
    order = [slots for _, slots, _, _ in pipeline.steps]
    assert order.count((0,)) == len(order)  # one slot, reused by each in turn
    assert queued[0].first_token_s < queued[1].first_token_s  # first come, first served
    assert engine.stats.rejected == 1


def test_a_cancelled_request_frees_its_slot_for_the_next_at_once(make) -> None:
    """Cancelled mid-burst (8 decode steps per call): the burst ends at that step."""
    engine, _ = make(num_slots=1, burst_steps=8)
    seen = []

    def cancel_at_the_third(row, token):  # as a client going away mid-stream
        seen.append(token)
        if len(seen) == 3:
            engine.cancel(long)

    long = submit(engine, [3, 4], 50, on_token=cancel_at_the_third)
    waiting = submit(engine, [5], 3)
    assert waiting.result(WAIT_S) == [expected([5], 3)]
    assert long.done() and long.finish_reasons == [Finish.ABORT]
    assert len(long.sequences[0].generated) == 3  # not one step more
    assert long.sequences[0].generated == expected([3, 4], 50)[: len(long.sequences[0].generated)]


def test_eos_ends_a_sequence_and_its_slot_is_reused(make) -> None:
    engine, _ = make(num_slots=1)
    tokens = expected([3, 4], 6)
    eos = tokens[2]
    request = submit(engine, [3, 4], 6, eos_token_ids=(eos,))
    assert request.result(WAIT_S) == [tokens[: tokens.index(eos) + 1]]
    assert request.finish_reasons == [Finish.STOP]
    assert submit(engine, [6], 2).result(WAIT_S) == [expected([6], 2)]


def test_bursts_only_when_nothing_waits(make) -> None:
    engine, pipeline = make(num_slots=2, burst_steps=4)
    request = submit(engine, [3, 4], 11)
    assert request.result(WAIT_S) == [expected([3, 4], 11)]
    # the prompt's step goes on decoding in the same call (every row chooses: the whole
    # prompt is fed), then decode bursts, never past max_new_tokens
    counts = [(prefill, count) for prefill, _, _, count in pipeline.steps]
    assert counts == [(True, 4), (False, 4), (False, 3)]
    # two stages, one micro-batch: bursts driven by the first stage through the others
    one, ring = make(FakePipeline(num_stages=2), num_slots=2, burst_steps=4, micro_batches=1)
    assert submit(one, [3, 4], 5).result(WAIT_S) == [expected([3, 4], 5)]
    assert [(prefill, count) for prefill, _, _, count in ring.steps] == [(True, 4), (False, 1)]
    # two micro-batches, each a whole prompt to feed: one ring of both, prompts first
    two, pipelined = make(FakePipeline(num_stages=2), num_slots=2, burst_steps=4)
    pipelined.gate.clear()
    first, second = submit(two, [3, 4], 3), submit(two, [5, 6, 7], 3)
    pipelined.gate.set()
    assert [first.result(WAIT_S), second.result(WAIT_S)] == [
        [expected([3, 4], 3)],
        [expected([5, 6, 7], 3)],
    ]
    assert pipelined.submits == [2], pipelined.steps
    assert [(p, counts, count) for p, _, counts, count in pipelined.steps] == [
        (True, (2,), 3),
        (True, (3,), 3),
    ]
    # a prompt longer than prefill_tokens: its first chunk chooses nothing, so the driver
    # takes the next step (the chunk's rows cannot go on decoding on the workers)
    chunked, pipeline = make(num_slots=2, burst_steps=4, prefill_tokens=4)
    assert submit(chunked, list(range(3, 9)), 3).result(WAIT_S) == [expected(list(range(3, 9)), 3)]
    assert [(p, counts, count) for p, _, counts, count in pipeline.steps] == [
        (True, (4,), 1),
        (True, (2,), 3),
    ]


def test_a_burst_ends_at_the_step_a_request_arrives(make) -> None:
    """A request arriving mid-burst joins at the next step boundary, not after the burst; the
    running sequence goes on exactly where the burst was cut."""
    engine, pipeline = make(num_slots=2, burst_steps=8)
    joined = []

    def join_at_the_third(row, token):
        if len(first.sequences[0].generated) == 3 and not joined:
            joined.append(submit(engine, [9, 8, 7], 4))

    first = submit(engine, [3, 4], 20, on_token=join_at_the_third)
    assert first.result(WAIT_S) == [expected([3, 4], 20)]
    assert joined[0].result(WAIT_S) == [expected([9, 8, 7], 4)]
    # the prompt's step going on as a burst of 8, cut after its third step (token 3), then the
    # newcomer's prefill, which the first sequence's decode rides along: it resumes feeding
    # token 3 at position 4 (2 prompt + 2 fed)
    assert pipeline.steps[0][0] and pipeline.steps[0][3] == 8
    assert pipeline.steps[1][:3] == (True, (0, 1), (1, 3)) and pipeline.starts[1] == (4, 0)


@pytest.mark.parametrize("whole_prompts", [False, True])
def test_a_model_with_recurrent_state_gets_no_padding_and_no_cut_burst(make, whole_prompts) -> None:
    """`uniform_steps` (mamba, linear attention): a step that ran updated each row's state even
    if its tokens were dropped, and a padded position would enter it. So a request arriving
    mid-burst waits for the burst's end (at most `UNIFORM_MAX_BURST` steps), prompts of other
    lengths go in steps of their own, and every step that ran is applied. A prompt longer than
    `prefill_tokens` goes in chunks that continue the state, or whole with `whole_prompts`.
    Without `uniform_steps` the cut burst of the same requests is refused by the state (a step
    starting behind what the state took in)."""

    def run(**options):
        engine, pipeline = make(
            FakePipeline(recurrent=True),
            num_slots=3,
            burst_steps=16,
            prefill_tokens=4,
            **options,
        )
        joined = []

        def join(row, token):
            if len(first.sequences[0].generated) == 3 and not joined:
                joined.append(submit(engine, [9, 8, 7], 4))
                joined.append(submit(engine, list(range(3, 12)), 3))  # 9 > prefill_tokens

        first = submit(engine, [3, 4], 20, on_token=join)
        return engine, pipeline, first, joined

    _, _, first, _ = run()
    with pytest.raises(ValueError, match=r"took in .* a step ran whose tokens were dropped"):
        first.result(WAIT_S)
    engine, pipeline, first, joined = run(uniform_steps=True, whole_prompts=whole_prompts)
    assert first.result(WAIT_S) == [expected([3, 4], 20)]
    assert [r.result(WAIT_S) for r in joined] == [
        [expected([9, 8, 7], 4)],
        [expected(list(range(3, 12)), 3)],
    ]
    assert engine.stats.cut == 0
    assert pipeline.steps[0][3] == UNIFORM_MAX_BURST  # the prompt and 7 tokens; 16, capped
    prefills = [
        (counts, starts)
        for (p, _, counts, _), starts in zip(pipeline.steps, pipeline.starts, strict=True)
        if p
    ]
    # each prompt alone; the 9 tokens whole, or in chunks of 4 each starting where the last
    # ended (the ninth then goes as a decode, at 8: the fake's state checks every start)
    nine = [((9,), (0,))] if whole_prompts else [((4,), (0,)), ((4,), (4,))]
    assert prefills[:2] == [((2,), (0,)), ((3,), (0,))] and prefills[2:] == nine
    assert all(len(set(counts)) == 1 for _, _, counts, _ in pipeline.steps)


def test_requests_a_step_apart_share_their_prefill_with_the_decodes(make) -> None:
    """A prompt that arrives while another sequence decodes goes in one step with that decode
    (both choose a token), while the padded tokens fit `prefill_tokens`; a prompt as wide as
    the budget goes alone and the decode goes next (it never starves)."""
    engine, pipeline = make(num_slots=3, prefill_tokens=8, burst_steps=1)
    joined = []

    def join(row, token):
        if len(first.sequences[0].generated) == 2 and not joined:
            joined.append(submit(engine, [9, 8, 7], 3))  # 2 rows x 3 wide <= 8: together
            joined.append(submit(engine, list(range(3, 11)), 2))  # 8 wide: alone

    first = submit(engine, [3, 4], 8, on_token=join)
    assert first.result(WAIT_S) == [expected([3, 4], 8)]
    assert joined[0].result(WAIT_S) == [expected([9, 8, 7], 3)]
    assert joined[1].result(WAIT_S) == [expected(list(range(3, 11)), 2)]
    kinds = [(prefill, counts) for prefill, _, counts, _ in pipeline.steps[:5]]
    assert kinds == [
        (True, (2,)),  # the first prompt
        (False, (1,)),  # its second token; the two requests arrive during it
        (True, (1, 3)),  # the first one's decode rides along the 3-token prompt
        (True, (8,)),  # the 8-token prompt fills the budget: the decodes wait one step
        (False, (1, 1, 1)),  # and go first after it, with its first token
    ], kinds


@pytest.mark.parametrize("wait_s", [0.0, WAIT_S])
def test_an_idle_engine_waits_for_requests_sent_together_to_start_together(make, wait_s) -> None:
    """Three requests reach an idle engine one after another. With a window, the engine waits
    for them and prefills all three in one step, and they decode in step (every step carries
    all three); the window ends as soon as they fill the batch (not after WAIT_S). Without one,
    the first starts alone: its step is sent (an event the test waits for, its steps held)
    before the others are submitted, never a matter of time."""
    engine, pipeline = make(num_slots=3, burst_steps=1, batch_wait_s=wait_s)
    prompts = [[3, 4], [5, 6], [7, 8]]
    sent, send = threading.Event(), pipeline.submit

    def seen(steps):
        sent.set()
        return send(steps)

    pipeline.submit = seen
    if not wait_s:
        pipeline.gate.clear()  # the first step waits there, its rows already chosen
    requests = [submit(engine, prompts[0], 4)]
    if not wait_s:
        assert sent.wait(WAIT_S), "the first request did not start on its own"
    requests += [submit(engine, prompt, 4) for prompt in prompts[1:]]
    pipeline.gate.set()
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.result(WAIT_S / 3) == [expected(prompt, 4)]
    first = pipeline.steps[0]
    if wait_s:
        assert [len(slots) for _, slots, _, _ in pipeline.steps] == [3, 3, 3, 3]
    else:
        assert first[0] and len(first[1]) == 1, pipeline.steps


def test_the_window_ends_at_its_bound_and_a_busy_engine_never_waits(make) -> None:
    """A lone request starts `batch_wait_s` after it came (not sooner, and it does start); one
    arriving while it runs joins at the next step, without a window."""
    engine, pipeline = make(num_slots=3, burst_steps=1, batch_wait_s=0.3)
    joined = []

    def join(row, token):
        if not joined:
            joined.append(submit(engine, [9, 8], 2))
            joined.append(len(pipeline.steps))  # the steps run when it arrived

    lone = submit(engine, [3, 4], 4, on_token=join)
    assert lone.result(WAIT_S) == [expected([3, 4], 4)]
    assert lone.first_token_s - lone.submitted_s >= 0.3
    assert joined[0].result(WAIT_S) == [expected([9, 8], 2)]
    assert pipeline.steps[joined[1]][0] and len(pipeline.steps[joined[1]][1]) == 2


def test_batch_wait_must_be_a_number_of_seconds_from_0() -> None:
    with pytest.raises(ConfigError, match=r"batch_wait_s=-0.1 must be >= 0"):
        EngineConfig(num_slots=2, max_seq_len=8, batch_wait_s=-0.1)


def test_micro_batches_split_the_running_sequences(make) -> None:
    """Two stages, two micro-batches of two; once all decode and nothing waits, both go in one
    burst the first stage drives (taking turns), not one driver call per step."""
    engine, pipeline = make(FakePipeline(num_stages=2), num_slots=4, burst_steps=4)
    pipeline.gate.clear()
    requests = [submit(engine, [3 + i], 9) for i in range(4)]
    pipeline.gate.set()
    for i, request in enumerate(requests):
        assert request.result(WAIT_S) == [expected([3 + i], 9)]
    decode_rows = [len(slots) for prefill, slots, _, _ in pipeline.steps if not prefill]
    assert max(decode_rows) == 2  # two micro-batches of two, one per stage
    assert 2 in pipeline.submits  # both micro-batches in one burst
    assert sum(pipeline.submits) == len(pipeline.steps)


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_lost_worker_is_recovered_and_every_sequence_goes_on_exactly(make, recurrent) -> None:
    """After the recovery both running sequences feed their prompt and tokens so far again,
    from position 0: in one prefill step, or, for a model with recurrent state (the new worker
    holds none; no padding), each in a step of its own length."""
    engine, pipeline = make(
        FakePipeline(recurrent=recurrent), num_slots=2, burst_steps=1, uniform_steps=recurrent
    )
    seen = []

    def on_token(row, token):
        seen.append(token)
        if len(seen) == 5:
            pipeline.fail.append(WorkerLostError("worker died"))

    with engine._cond:  # both arrive in one turn: admitted together, in one first step
        a = submit(engine, [3, 4, 5], 12, on_token=on_token)
        b = submit(engine, [6, 7], 9)
    assert a.result(WAIT_S) == [expected([3, 4, 5], 12)]
    assert b.result(WAIT_S) == [expected([6, 7], 9)]
    assert pipeline.recoveries == 1 and engine.stats.restarts == 1
    # 5 tokens each by then (a: 3 + 5, b: 2 + 5), each fed whole
    again = [i for i, s in enumerate(pipeline.steps) if s[0] and i > 1]
    if recurrent:
        assert [(pipeline.starts[i], pipeline.steps[i][2]) for i in again] == [
            ((0,), (8,)),
            ((0,), (7,)),
        ]
    else:
        restart = again[0]
        assert pipeline.starts[restart] == (0, 0) and sorted(pipeline.steps[restart][2]) == [7, 8]


def test_a_failing_step_ends_its_requests_with_the_error_and_the_engine_goes_on(make) -> None:
    engine, pipeline = make(num_slots=2)
    pipeline.fail.append(ValueError("the stage broke"))
    failed = submit(engine, [3], 4)
    with pytest.raises(ValueError, match="the stage broke"):
        failed.result(WAIT_S)
    assert failed.finish_reasons == [Finish.ERROR]
    assert submit(engine, [4], 3).result(WAIT_S) == [expected([4], 3)]
    assert len(engine.scheduler.free_slots) == 2


def test_a_client_callback_that_raises_ends_only_its_request(make) -> None:
    engine, _ = make(num_slots=2)

    def broken(row, token):
        raise RuntimeError("client gone")

    bad = submit(engine, [3], 5, on_token=broken)
    good = submit(engine, [4], 5)
    with pytest.raises(RuntimeError, match="client gone"):
        bad.result(WAIT_S)
    assert good.result(WAIT_S) == [expected([4], 5)]


def test_close_ends_waiting_and_running_requests(make) -> None:
    engine, pipeline = make(num_slots=1)
    pipeline.gate.clear()
    running, waiting = submit(engine, [3], 5), submit(engine, [4], 5)
    engine.close()
    pipeline.gate.set()
    for request in (running, waiting):
        with pytest.raises(EngineClosedError):
            request.result(WAIT_S)
    with pytest.raises(EngineClosedError):
        submit(engine, [5], 1)


def test_zero_new_tokens_is_done_at_once(make) -> None:
    engine, pipeline = make()
    assert submit(engine, [3, 4], 0).result(WAIT_S) == [[]]
    assert pipeline.steps == []


def test_the_stats_count_a_request_gone_once_it_is_done(make) -> None:
    """A client that reads the stats as soon as its request is done (offloadctl status after a
    generate) sees it neither running nor waiting."""
    engine, _ = make(num_slots=2)
    seen = []  # the stats at the moment the request is done (its on_finish, the engine's thread)
    request = submit(engine, [3, 4], 5, on_finish=lambda: seen.append(engine.stats.snapshot()))
    request.result(WAIT_S)
    [snapshot] = seen
    assert (snapshot["requests_running"], snapshot["requests_waiting"]) == (0, 0)
    assert snapshot["generation_tokens"] == 5


def test_the_engine_records_each_ended_sequences_lengths(make) -> None:
    """Issue 59 point 2: the lengths the planner prices a pool for are what each sequence's
    prompt and output came to, including one ended early by its end token;
    one that failed gives none."""
    engine, pipeline = make(num_slots=2)
    submit(engine, [3, 4, 5], 6).result(WAIT_S)
    submit(engine, [7], 2).result(WAIT_S)
    tokens = expected([9, 9], 20)
    eos = tokens[2]
    out = submit(engine, [9, 9], 20, eos_token_ids=(eos,)).result(WAIT_S)
    assert len(out[0]) == tokens.index(eos) + 1 < 20  # ended early, on its end token
    pipeline.fail = [RuntimeError("broken step")]
    with pytest.raises(RuntimeError, match="broken step"):
        submit(engine, [1, 2], 4).result(WAIT_S)
    assert engine.stats.observed_lengths() == ((3, 6), (1, 2), (2, len(out[0])))
    assert engine.stats.snapshot()["observed_sequences"] == 3


def test_a_request_that_ended_in_a_burst_that_then_fails_completes_once(make) -> None:
    """A burst in which one request ends, then a worker is lost: that request completes (its
    client is woken, once), the other goes on after the recovery with the text an
    uninterrupted run gives."""
    engine, pipeline = make(num_slots=2, burst_steps=8)
    real_submit = pipeline.submit
    ended = []

    def burst_then_lost(steps):
        done = real_submit(steps)
        if steps[0].count > 1 and not pipeline.recoveries and not pipeline.fail:
            outputs = list(done.outputs)

            def results(timeout_s):  # every step of the burst, then the worker is gone
                yield from outputs
                pipeline.recover(WorkerLostError("worker died mid-burst"), pipeline.epoch)
                raise WorkerLostError("worker died mid-burst")

            done.results = results
        return done

    pipeline.submit = burst_then_lost
    pipeline.gate.clear()
    short = submit(engine, [3, 4], 3, on_finish=lambda: ended.append("short"))
    long = submit(engine, [5, 6], 20)
    pipeline.gate.set()
    assert short.result(WAIT_S) == [expected([3, 4], 3)]
    assert long.result(WAIT_S) == [expected([5, 6], 20)]
    assert ended == ["short"]  # woken once
    assert pipeline.recoveries == 1 and engine.stats.restarts == 1


def test_a_step_planned_before_the_workers_changed_is_refused_and_dropped(make) -> None:
    """The workers are replaced by someone else (another thread's recovery) after the engine
    planned a step and before the step reaches them: the step, stamped with the old claim, is
    refused by the new workers (never run on an empty cache), the engine claims them again
    and every sequence feeds its tokens again: the text is unchanged."""
    engine, pipeline = make(num_slots=2, burst_steps=1)
    real_submit = pipeline.submit
    replaced = []

    def replaced_on_the_way(steps):
        if len(pipeline.steps) == 4 and not replaced:
            replaced.append(True)
            pipeline.epoch += 1  # a recovery elsewhere: new workers, no cache, no claim
            pipeline.blocks.clear()
            pipeline.runner.reset()
        return real_submit(steps)

    pipeline.submit = replaced_on_the_way
    a, b = submit(engine, [3, 4, 5], 10), submit(engine, [6, 7], 10)
    assert a.result(WAIT_S) == [expected([3, 4, 5], 10)]
    assert b.result(WAIT_S) == [expected([6, 7], 10)]
    assert replaced and engine.stats.restarts == 1
    assert len(pipeline.claims) == 2 and pipeline.claims[0][0] == pipeline.claims[1][0]


def test_a_second_engine_on_the_same_workers_is_refused_never_mixed(make) -> None:
    """Two engines on one set of workers: a second one is refused, unless it takes them over
    (a load's engine replaced); then every later step of the first is refused with an error naming both: its request ends
    with that error, never with tokens computed from the other's cache."""
    first, pipeline = make(num_slots=2, burst_steps=1)
    assert submit(first, [3, 4], 3).result(WAIT_S) == [expected([3, 4], 3)]
    with pytest.raises(ClaimedByAnotherError, match="owns its KV pool"):
        make(pipeline, num_slots=2)  # a second engine by mistake: it does not start
    second, _ = make(pipeline, num_slots=2, burst_steps=1, take_over=True)
    assert pipeline.owner[0] == second.id != first.id
    with pytest.raises(ClaimedByAnotherError):
        submit(first, [5, 6], 3).result(WAIT_S)
    assert submit(second, [5, 6], 3).result(WAIT_S) == [expected([5, 6], 3)]


def test_a_step_that_never_comes_back_ends_at_its_bound(make) -> None:
    engine, pipeline = make(num_slots=1, step_timeout_s=0.2)
    pipeline.wait = lambda handles, timeout_s: []  # a stage that hangs
    request = submit(engine, [3], 4)
    with pytest.raises(TimeoutError, match=r"did not finish within 0 s"):
        request.result(WAIT_S)
    assert request.finish_reasons == [Finish.ERROR]


def test_max_queue_must_hold_a_whole_batch() -> None:
    with pytest.raises(ConfigError, match=r"max_queue=1 must be >= max_batch=2"):
        EngineConfig(num_slots=2, max_seq_len=8, max_queue=1)


def test_bursts_go_on_while_every_slot_is_busy_and_requests_wait(make) -> None:
    """One slot, two requests: the first decodes in bursts although the second waits (it has
    no slot to take); the burst is cut the step the first ends, and the second starts."""
    engine, pipeline = make(num_slots=1, burst_steps=4)
    pipeline.gate.clear()
    first, second = submit(engine, [3, 4], 9), submit(engine, [5], 3)
    pipeline.gate.set()
    assert first.result(WAIT_S) == [expected([3, 4], 9)]
    assert second.result(WAIT_S) == [expected([5], 3)]
    counts = [(prefill, slots, count) for prefill, slots, _, count in pipeline.steps]
    # 4 + 4 + 1 = 9 tokens of the first (its prompt's step going on as a burst), then the second
    # (a one-token prompt: a decode)
    assert counts[:4] == [(True, (0,), 4), (False, (0,), 4), (False, (0,), 1), (False, (0,), 3)]


def test_each_micro_batch_owns_a_contiguous_range_of_slots(make) -> None:
    engine, pipeline = make(FakePipeline(num_stages=2), num_slots=6, burst_steps=1)
    pipeline.gate.clear()
    requests = [submit(engine, [3 + i], 4) for i in range(6)]
    pipeline.gate.set()
    for i, request in enumerate(requests):
        assert request.result(WAIT_S) == [expected([3 + i], 4)]
    steps = {slots for _, slots, _, _ in pipeline.steps}
    # each step's rows lie in one micro-batch's range, and both ranges ran full steps
    assert all(set(slots) <= {0, 1, 2} or set(slots) <= {3, 4, 5} for slots in steps)
    assert {(0, 1, 2), (3, 4, 5)} <= steps


def test_micro_batches_are_formed_again_when_the_plan_changes(make) -> None:
    """After a recovery the plan offloads layers: the engine asks again how many micro-batches
    it wants (one) and re-forms them; every sequence goes on exactly."""
    wanted = [2]
    engine, pipeline = make(
        FakePipeline(num_stages=2), plan_micro_batches=lambda: wanted[0], num_slots=4, burst_steps=1
    )
    seen = []

    def lose_a_worker_at_the_fourth(row, token):
        seen.append(token)
        if len(seen) == 4:
            wanted[0] = 1
            pipeline.fail.append(WorkerLostError("worker died"))

    pipeline.gate.clear()
    requests = [submit(engine, [3 + i], 8, on_token=lose_a_worker_at_the_fourth) for i in range(4)]
    pipeline.gate.set()
    for i, request in enumerate(requests):
        assert request.result(WAIT_S) == [expected([3 + i], 8)]
    assert len(engine.scheduler.groups) == 1 and engine.stats.restarts == 1
    last = [slots for prefill, slots, _, _ in pipeline.steps if not prefill][-1]
    assert len(last) > 2  # one micro-batch of every sequence left


def test_a_sequences_settings_reach_the_last_stage_once(make) -> None:
    """Each sequence's sampling settings travel with its first step that chooses a token, not
    with every step (the last stage keeps them per slot); a slot's next sequence sends its
    own; after a recovery (a new claim, workers without them) every running one sends again."""
    engine, pipeline = make(num_slots=1, burst_steps=1)
    first = submit(engine, [3, 4], 5)
    second = submit(engine, [5], 4)
    assert first.result(WAIT_S) == [expected([3, 4], 5)]
    assert second.result(WAIT_S) == [expected([5], 4)]
    assert pipeline.settings_sent == [0, 0]  # one slot, two sequences, once each
    seen = []

    def lose_a_worker(row, token):
        seen.append(token)
        if len(seen) == 2:
            pipeline.fail.append(WorkerLostError("worker died"))

    third = submit(engine, [6, 7], 6, on_token=lose_a_worker)
    assert third.result(WAIT_S) == [expected([6, 7], 6)]
    assert pipeline.settings_sent == [0, 0, 0, 0]  # its first step, and again after recovery


# KV in blocks (block_size 16 by default): admission by tokens, preemption when the pool runs out


def test_short_sequences_run_beyond_what_max_seq_len_slots_would_hold(make) -> None:
    """A pool of 12 blocks holds 3 sequences of max_seq_len 64, yet 8 short ones (1 block
    each, 1% of the pool kept free) run at once: the batch is bounded by their tokens, not by
    max_seq_len."""
    engine, pipeline = make(num_slots=8, max_seq_len=64, num_blocks=12, prefill_tokens=64)
    prompts = [[3 + i, 4 + i] for i in range(8)]
    usage = []  # the pool's share of blocks in use, as the metrics show it mid-run

    def seen(row, token) -> None:
        usage.append(engine.stats.prometheus("m"))

    with engine._cond:  # all eight arrive in one turn
        requests = [submit(engine, p, 6, on_token=seen) for p in prompts]
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.result(WAIT_S) == [expected(prompt, 6)]
    assert max(len(slots) for _, slots, _, _ in pipeline.steps) == 8
    # 8 sequences of one block each in a pool of 12: 8/12 of it in use while they ran
    assert any(f'vllm:kv_cache_usage_perc{{model_name="m"}} {8 / 12}' in u for u in usage)
    assert engine.stats.preemptions == 0 and engine.scheduler.used_blocks == 0


def test_a_sequence_grows_past_many_blocks_in_a_pool_of_exactly_one(make) -> None:
    """A pool of exactly the blocks one sequence of max_seq_len takes: requests that long run
    one after another (none refused, none stuck), each crossing every block boundary."""
    engine, _ = make(num_slots=2, max_seq_len=64, num_blocks=4, burst_steps=8)
    requests = [submit(engine, [5 + i, 6, 7], 61) for i in range(3)]
    for i, request in enumerate(requests):
        assert request.result(WAIT_S) == [expected([5 + i, 6, 7], 61)]
    assert engine.scheduler.used_blocks == 0 and engine.scheduler.blocks.available == 4


def test_the_youngest_is_preempted_when_the_pool_runs_out_and_its_text_is_unchanged(make) -> None:
    """Three sequences admitted with one block each grow until the pool (6 blocks) cannot give
    each its third: the youngest is preempted (its blocks freed, back at the head of the
    queue), fed again from its start later, and every text equals what it makes alone."""
    engine, pipeline = make(num_slots=4, max_seq_len=64, num_blocks=6, burst_steps=4)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    with engine._cond:  # all three arrive in one turn
        requests = [submit(engine, p, 40) for p in prompts]
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.result(WAIT_S) == [expected(prompt, 40)]
    assert engine.stats.preemptions >= 1
    youngest = requests[2].sequences[0]
    # the youngest fed its prompt and tokens so far again: a prefill from position 0 of more
    # tokens than its prompt
    refeeds = [
        counts
        for (prefill, _, counts, _), starts in zip(pipeline.steps, pipeline.starts, strict=True)
        if prefill and starts == (0,) and counts[0] > len(prompts[2])
    ]
    assert refeeds, "the preempted sequence was never fed again from its start"
    assert youngest.finish is Finish.LENGTH
    text = engine.stats.prometheus("m")
    assert f'vllm:num_preemptions_total{{model_name="m"}} {engine.stats.preemptions}' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.0' in text  # all freed at the end
    assert 'offload:kv_cache_blocks{model_name="m"} 6' in text
    assert 'offload:kv_cache_blocks_used{model_name="m"} 0' in text


def test_admission_waits_for_blocks_and_keeps_fifo_order(make) -> None:
    """A long prompt at the head of the queue that the pool cannot take yet: the short one
    behind it waits too (first come, first served), and both end right."""
    engine, _ = make(num_slots=3, max_seq_len=64, num_blocks=5, prefill_tokens=64)
    with engine._cond:  # all three arrive in one turn
        first = submit(engine, list(range(3, 40)), 20)  # 37 tokens: 3 blocks
        long = submit(engine, list(range(4, 50)), 5)  # 46 tokens: 3 blocks, 2 free (1 margin)
        short = submit(engine, [7], 3)
    assert first.result(WAIT_S) == [expected(list(range(3, 40)), 20)]
    assert long.result(WAIT_S) == [expected(list(range(4, 50)), 5)]
    assert short.result(WAIT_S) == [expected([7], 3)]
    assert short.first_token_s >= long.first_token_s  # never ahead of the head


def test_a_pool_that_cannot_hold_one_max_seq_len_sequence_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"3 blocks x 16 positions cannot hold one sequence"):
        EngineConfig(num_slots=2, max_seq_len=64, num_blocks=3)


# prefix caching: full blocks of an earlier sequence's tokens are reused, never recomputed


def test_a_shared_prompt_prefix_reuses_the_full_blocks_and_every_text_is_right(make) -> None:
    """A second request whose prompt starts with the first one's 40 tokens, sent once the
    first has finished: it starts at position 32 (its 2 full blocks of the prefix reused: the
    fake checks that every position it reads holds its own tokens), counts 32 hits of 45
    queried tokens, and both texts are right. A prompt of exactly 2 full blocks reuses 1: its
    last token is always fed, for its next token's logits."""
    engine, pipeline = make(num_slots=2, max_seq_len=64, prefill_tokens=64)
    prefix = list(range(3, 43))
    first = submit(engine, [*prefix, 50, 51], 5)
    assert first.result(WAIT_S) == [expected([*prefix, 50, 51], 5)]
    steps_before = len(pipeline.steps)
    second = submit(engine, [*prefix, 60, 61, 62, 63, 64], 5)
    assert second.result(WAIT_S) == [expected([*prefix, 60, 61, 62, 63, 64], 5)]
    assert pipeline.starts[steps_before] == (32,) and pipeline.steps[steps_before][2] == (13,)
    assert (engine.stats.prefix_hits, engine.stats.prefix_queries) == (32, 42 + 45)
    steps_before = len(pipeline.steps)
    third = submit(engine, list(range(3, 35)), 3)  # 32 tokens: one block reused, 16 fed
    assert third.result(WAIT_S) == [expected(list(range(3, 35)), 3)]
    assert pipeline.starts[steps_before] == (16,) and pipeline.steps[steps_before][2] == (16,)
    assert engine.stats.prefix_hits == 32 + 16
    text = engine.stats.prometheus("m")
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 48' in text


def test_the_stats_counters_go_on_growing_across_engines_and_pools(make) -> None:
    """The stats outlive an engine (a host restarts it with them) and a pool (a re-balance
    takes another): their preemption and prefix counters go on from their totals, never back
    to what the new scheduler or pool counted (vllm:*_total are counters)."""
    first, _ = make(num_slots=4, max_seq_len=64, num_blocks=6, burst_steps=4, prefill_tokens=64)
    prefix = list(range(3, 43))
    with first._cond:  # three at once in a pool too small for them: preemptions
        requests = [submit(first, p, 40) for p in ([3, 4, 5], [6, 7], [8, 9, 10, 11])]
    for request in requests:
        request.result(WAIT_S)
    assert submit(first, [*prefix, 50], 3).result(WAIT_S)
    assert submit(first, [*prefix, 60], 3).result(WAIT_S)  # its prefix's blocks reused
    stats = first.stats
    before = (stats.preemptions, stats.prefix_queries, stats.prefix_hits)
    assert before[0] >= 1 and before[2] >= 32
    first.close()
    config = EngineConfig(num_slots=2, max_seq_len=64, prefill_tokens=64)
    pipeline = FakePipeline()
    second = Engine(
        pipeline, config, gate=lambda: contextlib.nullcontext(pipeline.epoch), stats=stats
    )
    try:
        assert submit(second, [*prefix, 70], 3).result(WAIT_S)
        assert submit(second, [*prefix, 80], 3).result(WAIT_S)  # 32 hits in the new pool
        assert stats.preemptions == before[0]
        assert stats.prefix_queries == before[1] + 41 + 41
        assert stats.prefix_hits == before[2] + 32
        with second._cond:  # the loop idles on it: a re-balance's restart, with a new pool
            second.scheduler.restart(len(second.scheduler.groups), num_blocks=8)
        after = (stats.prefix_queries, stats.prefix_hits)
        assert submit(second, [*prefix, 90], 3).result(WAIT_S)  # nothing cached in it yet
        assert (stats.prefix_queries, stats.prefix_hits) == (after[0] + 41, after[1])
    finally:
        second.close()


def test_running_sequences_share_blocks_and_a_restart_forgets_every_cached_prefix(make) -> None:
    """Two sequences with one prefix run at once, sharing its blocks; a worker is lost: the new
    worker holds no keys, so nothing cached before is reused after (a read of a cleared block
    fails the fake), and every text is right."""
    engine, pipeline = make(num_slots=2, max_seq_len=64, prefill_tokens=64, burst_steps=1)
    prefix = list(range(3, 23))  # 20 tokens: one full block
    tables, joined = [], []

    def both_tables(row, token) -> None:  # the second's first token: the first still runs
        if not tables:
            tables.append((list(first.sequences[0].blocks), list(joined[0].sequences[0].blocks)))

    def join(row, token) -> None:  # at the first's second token: its prefix block is named
        if len(first.sequences[0].generated) == 2:
            joined.append(submit(engine, [*prefix, 40], 6, on_token=both_tables))

    first = submit(engine, [*prefix, 30], 40, on_token=join)
    while not joined:
        first.wait(0.01)
    [second] = joined
    assert second.result(WAIT_S) == [expected([*prefix, 40], 6)]
    assert engine.stats.prefix_hits == 16
    [(first_blocks, second_blocks)] = tables
    assert first_blocks[0] == second_blocks[0] and first_blocks[1:] != second_blocks[1:2]
    pipeline.fail.append(WorkerLostError("worker died"))
    assert first.result(WAIT_S) == [expected([*prefix, 30], 40)]
    hits = engine.stats.prefix_hits
    third = submit(engine, [*prefix, 50], 4)
    assert third.result(WAIT_S) == [expected([*prefix, 50], 4)]
    assert pipeline.recoveries == 1
    # after the restart, the first fed everything again and named its blocks anew: the third
    # may reuse those (their keys were written by the new worker), never an older one
    assert engine.stats.prefix_hits in (hits, hits + 16)


def test_no_prefix_reuse_where_it_would_be_wrong(make) -> None:
    """A request that scores its prompt needs every position's logits, and a model with
    recurrent state cannot start past tokens its state did not take in: neither reuses."""
    engine, _ = make(num_slots=2, max_seq_len=64, prefill_tokens=64)
    prefix = list(range(3, 40))
    assert submit(engine, prefix, 2).result(WAIT_S) == [expected(prefix, 2)]
    scored = engine.submit(
        [[*prefix, 7]], sampling=GREEDY, max_new_tokens=2, prompt_logprobs=1, on_logprobs=None
    )
    assert scored.result(WAIT_S) == [expected([*prefix, 7], 2)]
    assert engine.stats.prefix_hits == 0
    recurrent, _ = make(FakePipeline(recurrent=True), num_slots=2, uniform_steps=True)
    for _ in range(2):
        assert submit(recurrent, prefix, 2).result(WAIT_S) == [expected(prefix, 2)]
    assert recurrent.stats.prefix_hits == recurrent.stats.prefix_queries == 0
