"""What a step carries, and what a cut burst keeps (issue 53, point 6): the stages keep each
slot's block table and a step sends only what changed (a row's new blocks; its whole table
when its sequence is new to the slot), so a long decode's steps stay as small as a short
one's; and a burst cut on several stages, whose remaining steps ran on every stage anyway, is
applied to the rows still running instead of thrown away and computed again."""

from __future__ import annotations

import contextlib
import pickle
import threading

import numpy as np
import pytest
import torch
from test_engine import GREEDY, WAIT_S, FakePipeline, expected

from coordinator.engine import Engine, EngineConfig, Finish
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequences import Request
from worker.batched import BatchRunner
from worker.steps import NO_TOKEN, Draw, SlotSettings, StepRows

OWNER = ("engine-test", 1)


def request(prompt: list[int], max_new_tokens: int = 1000) -> Request:
    return Request.of([prompt], sampling=GREEDY, max_new_tokens=max_new_tokens)


def tokens_for(step, token: int = 7) -> np.ndarray:
    """`token` for each row of `step` that chooses one."""
    return np.where(step.draw.choose, token, NO_TOKEN).astype(np.int64)


def table_entries(rows: StepRows) -> int:
    return sum(len(table) for table in rows.tables)


# 1. a step carries each row's new blocks, not its whole table


def test_a_long_decode_carries_each_rows_new_blocks_not_its_whole_table() -> None:
    """A 1000-token prompt (63 blocks of 16), then 200 decode steps: the decode steps carry
    the blocks the sequence took meanwhile (12), not its whole table every step (13,848 table
    entries before), and a decode step's rows pickle to the same size at 1000 positions as
    at 1200."""
    n, block, decodes = 1000, 16, 200
    scheduler = Scheduler(
        num_slots=2, max_seq_len=n + 256, num_groups=1, prefill_tokens=n, block_size=block
    )
    scheduler.enqueue(request([3 + i % 50 for i in range(n)]))
    [seq] = scheduler.admit()
    prefill = scheduler.plan(0)
    assert table_entries(prefill.rows) == 63  # its first step: the whole table
    scheduler.update(prefill, 0, tokens_for(prefill))
    scheduler.complete(prefill)
    carried, sizes = 0, []
    for _ in range(decodes):
        step = scheduler.plan(0)
        assert not step.prefill
        carried += table_entries(step.rows)
        sizes.append(len(pickle.dumps(step.rows)))
        scheduler.update(step, 0, tokens_for(step))
        scheduler.complete(step)
    assert len(seq.blocks) == 75  # positions 0..1199 fed
    assert carried == 75 - 63, f"{decodes} decode steps carried {carried} table entries"
    assert max(sizes) - min(sizes) <= 8, (
        f"a decode step's rows pickle to {min(sizes)}..{max(sizes)}"
    )


def test_a_decode_step_of_32_rows_at_2000_positions_pickles_small() -> None:
    """32 sequences of 2000 tokens (125 blocks each) decoding: a step's rows pickle to well
    under a kilobyte (466 bytes; 592 at a step where every row crosses a block), where their
    whole tables took 12,240 bytes, every step, to every stage."""
    rows, n = 32, 2000
    scheduler = Scheduler(num_slots=rows, max_seq_len=n + 64, num_groups=1, prefill_tokens=rows * n)
    for r in range(rows):
        scheduler.enqueue(request([3 + (r + i) % 50 for i in range(n)]))
    assert len(scheduler.admit()) == rows
    prefill = scheduler.plan(0)
    assert len(prefill.sequences) == rows
    scheduler.update(prefill, 0, tokens_for(prefill))
    scheduler.complete(prefill)
    sizes = []
    for _ in range(20):
        step = scheduler.plan(0)
        assert not step.prefill and len(step.sequences) == rows
        sizes.append(len(pickle.dumps(step.rows)))
        scheduler.update(step, 0, tokens_for(step))
        scheduler.complete(step)
    assert max(sizes) < 1024, f"a decode step's rows pickle to {max(sizes)} bytes"


def stage_tables(runners: list[BatchRunner], rows: StepRows) -> list[list[int]]:
    """Each row's whole table as every stage rebuilds it from the step (they must agree)."""
    tables = [runner.block_tables(rows) for runner in runners]
    assert all(t == tables[0] for t in tables)
    return tables[0]


@pytest.mark.parametrize("num_blocks", [14, 40])
def test_every_stage_rebuilds_each_rows_whole_table_through_bursts_cuts_and_preemption(
    num_blocks: int,
) -> None:
    """Steps of a scheduler whose pool runs short (bursts, a cut burst whose blocks are given
    back, a preempted sequence fed again, a step that reached one stage and failed, a restart
    under a new claim, a cached prefix shared at admission), taken in by two stages: at every
    step each stage's table of each row is the engine's, block for block. A pool of 14 blocks
    of 4 runs short (preemptions), one of 40 lets bursts take blocks a cut gives back."""
    block = 4
    scheduler = Scheduler(
        num_slots=3,
        max_seq_len=48,
        num_groups=1,
        prefill_tokens=64,
        num_blocks=num_blocks,
        block_size=block,
        prefix_caching=True,
    )
    scheduler.owner = OWNER
    runners = [BatchRunner(torch.device("cpu")) for _ in range(2)]
    for runner in runners:
        runner.claim(OWNER)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    scheduler.enqueue(request([*prefix, 13], max_new_tokens=30))

    def run(step, ran: int) -> None:
        """`ran` of the step's `count` steps run on the stages (a burst cut after them)."""
        rows = step.rows
        for i in range(ran):
            assert stage_tables(runners, rows) == [list(s.blocks) for s in step.sequences]
            scheduler.update(step, i, tokens_for(step, 7 + i))
            rows = rows.advanced()
        held = sum(len(s.blocks) for s in step.sequences)
        scheduler.complete(step)
        gave_back[0] += held - sum(len(s.blocks) for s in step.sequences if s.slot is not None)

    cut = shared = failed = False
    gave_back = [0]  # blocks a cut burst took and gave back
    for turn in range(200):
        if turn == 1:  # the first one's prefix is in the cache now
            for prompt in ([*prefix, 14, 15], [20, 21, 22]):
                scheduler.enqueue(request(prompt, max_new_tokens=30))
        shared |= any(s.cached for s in scheduler.admit())  # began with a cached prefix
        step = scheduler.plan(0)
        if step is None:
            assert not scheduler.running and not scheduler.waiting
            break
        step.count = 1 if step.prefill else scheduler.grow([step], 6)
        if turn == 4:  # reached the first stage only, and failed: planned again, whole
            runners[0].block_tables(step.rows)
            scheduler.unplan(step)
            failed = True
            continue
        ran = 1 + turn % 2 if turn % 3 == 1 and step.count > 2 else step.count
        cut |= ran < step.count
        run(step, ran)
        if turn == 8:  # the workers changed: a new claim, every sequence fed again
            scheduler.restart(1)
            scheduler.owner = (OWNER[0], 2)
            for runner in runners:
                runner.claim(scheduler.owner)
    assert cut and shared and failed, (cut, shared, failed)
    assert scheduler.preemptions if num_blocks == 14 else gave_back[0], gave_back


def test_a_stage_refuses_a_table_tail_it_cannot_place() -> None:
    """A step that extends a slot's table the stage does not hold as the engine means it
    (another sequence's, none since a new claim or a reset, or shorter than the engine
    counts) is refused, never read with wrong blocks."""
    runner = BatchRunner(torch.device("cpu"))
    runner.claim(OWNER)

    def rows(table_from: int, tail: tuple[int, ...], table_id: int = 1) -> StepRows:
        return StepRows(
            slots=(0,),
            starts=(0,),
            counts=(1,),
            width=1,
            num_slots=2,
            tables=(tail,),
            num_blocks=8,
            owner=OWNER,
            table_from=(table_from,),
            table_ids=(table_id,),
        )

    assert runner.block_tables(rows(0, (4, 5))) == [[4, 5]]
    assert runner.block_tables(rows(2, (6,))) == [[4, 5, 6]]
    assert runner.block_tables(rows(3, ())) == [[4, 5, 6]]
    assert runner.block_tables(rows(1, (7,))) == [[4, 7]]  # a cut burst's blocks given back
    with pytest.raises(ValueError, match=r"slot 0: .* holds another sequence's table"):
        runner.block_tables(rows(1, (3,), table_id=2))
    with pytest.raises(ValueError, match=r"slot 0: .* after 3 block\(s\), .* holds 2 block"):
        runner.block_tables(rows(3, (3,)))
    assert runner.block_tables(rows(2, ())) == [[4, 7]]  # nothing read or changed meanwhile
    runner.claim((OWNER[0], 2))  # a new claim: no table is kept
    with pytest.raises(ValueError, match=r"slot 0: .* holds no table there"):
        runner.block_tables(rows(1, (3,)))
    runner.block_tables(rows(0, (1,)))
    runner.reset()
    with pytest.raises(ValueError, match=r"slot 0: .* holds no table there"):
        runner.block_tables(rows(1, (3,)))
    # rows of callers without block bookkeeping carry whole tables, every step
    contiguous = StepRows.in_slots((1, 0), (0, 0), (3, 3), 3, num_slots=2, max_seq_len=8)
    assert contiguous.advanced().tables == contiguous.tables
    assert runner.block_tables(contiguous.advanced()) == [[1], [0]]


# 2. a cut burst that ran on every stage is applied, not computed again


@pytest.fixture
def make():
    engines = []

    def make(pipeline, **options) -> Engine:
        config = EngineConfig(**{"num_slots": 2, "max_seq_len": 64, **options})
        engine = Engine(
            pipeline,
            config,
            recover=pipeline.recover,
            gate=lambda: contextlib.nullcontext(pipeline.epoch),
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def submit(engine, prompt, count, **kw):
    return engine.submit([prompt], sampling=GREEDY, max_new_tokens=count, **kw)


def computed(pipeline: FakePipeline) -> int:
    """Steps the stages ran: every step of every burst (the ring's remaining ones run on
    every stage whether the engine reads them or not)."""
    return sum(count for _, _, _, count in pipeline.steps)


def test_a_cut_burst_that_ran_on_every_stage_is_applied_not_computed_again(make) -> None:
    """Two stages, a burst of 8 (the prompt's step going on decoding), cut at its third step
    by an arrival: its remaining steps ran on both stages, so their tokens are the sequence's
    and the next step starts after them (position 9), none computed twice."""
    pipeline = FakePipeline(num_stages=2, drains=True)
    engine = make(pipeline, burst_steps=8, micro_batches=1)
    joined = []

    def join_at_the_third(row, token):
        if len(first.sequences[0].generated) == 3 and not joined:
            joined.append(submit(engine, [9, 8, 7], 4))

    first = submit(engine, [3, 4], 20, on_token=join_at_the_third)
    assert first.result(WAIT_S) == [expected([3, 4], 20)]
    assert joined[0].result(WAIT_S) == [expected([9, 8, 7], 4)]
    assert engine.stats.cut >= 1
    assert pipeline.steps[0][0] and pipeline.steps[0][3] == 8
    # the next step of the first sequence feeds position 9: 2 prompt + 7 decode tokens fed
    assert pipeline.starts[1][0] == 9, pipeline.starts[1]
    assert computed(pipeline) == engine.stats.steps, (computed(pipeline), engine.stats.steps)


def test_steps_applied_after_a_cut_give_no_token_past_an_end_or_a_cancel(make) -> None:
    """Two stages draining a cut burst: a request cancelled at its third token gets no token
    more (the cancel the engine saw ends it before the remaining steps apply), one that ends
    at its end token none past it, and the other goes on with every step that ran applied."""
    pipeline = FakePipeline(num_stages=2, drains=True)
    engine = make(pipeline, num_slots=3, burst_steps=8, micro_batches=1)
    pipeline.gate.clear()
    seen = []

    def cancel_at_the_third(row, token):
        seen.append(token)
        if len(seen) == 3:
            engine.cancel(cancelled)

    ends = expected([5, 6], 8)
    cancelled = submit(engine, [3, 4], 30, on_token=cancel_at_the_third)
    ending = submit(engine, [5, 6], 30, eos_token_ids=(ends[4],))
    going = submit(engine, [7, 8, 9], 30)
    pipeline.gate.set()
    assert going.result(WAIT_S) == [expected([7, 8, 9], 30)]
    assert ending.result(WAIT_S) == [ends[: ends.index(ends[4]) + 1]]
    assert ending.finish_reasons == [Finish.STOP]
    cancelled.result(WAIT_S)
    assert cancelled.finish_reasons == [Finish.ABORT]
    assert cancelled.sequences[0].generated == expected([3, 4], 3)  # not one token more
    assert engine.stats.cut >= 1
    assert computed(pipeline) == engine.stats.steps, (computed(pipeline), engine.stats.steps)


class Echo:
    """A one-stage stand-in for `BatchRunner.ring`: each row's next token is its input + 1;
    counts its forwards."""

    is_first = is_last = True

    def __init__(self) -> None:
        self.decoder_indices: list[int] = []  # no KV pool
        self.forwards = 0

    def __call__(self, x, *, position_ids, logits_to_keep, cache):
        self.forwards += 1
        return torch.nn.functional.one_hot((x[:, -1:] + 1) % 50, 50).float()


def test_in_process_a_cut_ring_hands_back_the_steps_it_sent_and_sends_no_more() -> None:
    """Three micro-batches in one process: the ring runs each one's next step before it yields
    the previous one's tokens, so when it is stopped at a yield, two steps have run that were
    not yet read. They are yielded (applied), no further step is sent, and every forward that
    ran is read."""
    runner, stage = BatchRunner(torch.device("cpu")), Echo()
    runner.claim(OWNER)
    settings = SlotSettings(GREEDY)
    batches = [
        (
            StepRows.in_slots((m,), (0,), (1,), 1, num_slots=3, max_seq_len=32, owner=OWNER),
            torch.tensor([[10 * m]]),
            Draw((True,), ((m, settings),)),
        )
        for m in range(3)
    ]
    stop = threading.Event()
    ring = runner.ring(stage, batches, 8, stop=stop)
    read = [next(ring) for _ in range(4)]  # micro-batch 0's first two steps, 1's and 2's first
    stop.set()
    read += list(ring)
    assert stage.forwards == len(read) == 6, (stage.forwards, len(read))
    assert [(m, int(t[0])) for m, t in read] == [(0, 1), (1, 11), (2, 21), (0, 2), (1, 12), (2, 22)]


def test_a_request_cancelled_before_it_was_queued_ends_once_and_takes_no_slot(make) -> None:
    """A request submitted and cancelled mid-burst (before the loop queued it) ends with no
    token, once, and never takes a slot (here, a micro-batch of its own, where nothing would
    ever free it); the others go on exactly."""
    pipeline = FakePipeline(num_stages=2, drains=True)
    engine = make(pipeline, num_slots=2, burst_steps=8)  # two micro-batches of one slot
    late, ended = [], []

    def submit_and_cancel_at_the_third(row, token):
        if len(first.sequences[0].generated) == 3 and not late:
            late.append(submit(engine, [9, 8, 7], 4, on_finish=lambda: ended.append("late")))
            engine.cancel(late[0])

    first = submit(engine, [3, 4], 20, on_token=submit_and_cancel_at_the_third)
    assert first.result(WAIT_S) == [expected([3, 4], 20)]
    late[0].result(WAIT_S)
    assert late[0].finish_reasons == [Finish.ABORT] and late[0].sequences[0].generated == []
    assert ended == ["late"]
    assert submit(engine, [5, 6], 3).result(WAIT_S) == [expected([5, 6], 3)]
    assert len(engine.scheduler.free_slots) == 2 and not engine.scheduler.running
