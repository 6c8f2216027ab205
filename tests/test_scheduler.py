"""The scheduler's own contract, driven directly: the engine's tests reach it only through a
stand-in pipeline, where a lost block or a slot handed out twice shows, if at all, as a wrong
token many steps later.

Here stand-in stages (`Stages`) keep what the scheduler's steps tell real ones to keep: each
slot's block table (`BatchRunner.block_tables`, which refuses a table it cannot place) and
each slot's settings, and a KV pool whose every position holds the token fed there. Each row
reads its keys back through its table before it chooses, so a block handed to two sequences
at once, a table that misses a block, or keys the row never wrote fail where they happen; and
the stand-in model's next token is a function of every key it read, so each request's text is
checked against generation without a scheduler (`reference`), through preemption, bursts cut
short, steps never sent, cancellations and restarts. The direct tests also pin down what that
check cannot see: how each step is cut (prompt chunks, bursts, the blocks and settings it
carries), the pool's margin and prefix cache, and what the last stage returns besides the
tokens (`Chosen`: log-probabilities, rows it failed).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from coordinator.engine.scheduler import Scheduler, Step
from coordinator.engine.sequences import Finish, Request, Sequence, Status
from worker.batched import BatchRunner
from worker.names import blocks_for
from worker.steps import NO_TOKEN, Chosen, Logprobs, RowFailedError, Sampling

EOS = 5
EMPTY = -1  # a KV position nothing wrote since the workers (re)started
OWNER = "scheduler-test"


def next_token(tokens) -> int:
    """The stand-in model: its next token is a function of every token before it (as a causal
    model's is of every key it attends to)."""
    h = 17
    for t in tokens:
        h = (h * 131 + int(t) + 1) % 1_000_003
    return h % 97 + 3


def reference(prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> list[int]:
    """What greedy generation of `prompt` gives, without any scheduler."""
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        token = next_token(tokens)
        out.append(token)
        tokens.append(token)
        if token in eos:
            break
    return out


class Stages:
    """What the workers keep of the scheduler's steps, checked as they take each step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.claim(scheduler)

    def claim(self, scheduler: Scheduler) -> None:
        """New workers (or the first): no tables, no settings, no keys."""
        self.size = scheduler.block_size
        self.runner = BatchRunner(torch.device("cpu"))
        self.runner.claim(scheduler.owner)
        self.kv = np.full((scheduler.num_blocks, self.size), EMPTY, dtype=np.int64)
        self.settings: dict[int, Sequence] = {}  # slot -> whose settings the last stage holds

    def run(self, step: Step, ran: int) -> list[np.ndarray]:
        """The first `ran` of the step's `count` steps (a burst cut after them), each row's
        chosen token per step (NO_TOKEN where it chooses none)."""
        rows = step.rows
        self.runner.check_owner(rows)
        sent = {slot for slot, _ in step.draw.settings}
        for slot, seq in zip(rows.slots, step.sequences, strict=True):
            if slot in sent:
                self.settings[slot] = seq
        # what each row's keys must be: its tokens as planned, then what it chose in the burst
        known = [list(seq.tokens) for seq in step.sequences]
        out: list[np.ndarray] = []
        for i in range(ran):
            assert len(set(rows.slots)) == len(rows.slots), f"a slot twice in a step: {rows}"
            tables = self.runner.block_tables(rows)
            for r, seq in enumerate(step.sequences):
                assert self.settings.get(rows.slots[r]) is seq, (
                    f"row {r} (slot {rows.slots[r]}) runs without its sequence's settings"
                )
                start, count, table = rows.starts[r], rows.counts[r], tables[r]
                assert len(set(table)) == len(table), f"a block twice in one table: {table}"
                assert all(0 <= b < len(self.kv) for b in table), table
                assert len(table) * self.size >= start + count, (
                    f"row {r}'s table {table} ends before its position {start + count - 1}"
                )
                fed = step.x[r, step.x.shape[1] - count :] if i == 0 else [out[-1][r]]
                for p, token in zip(range(start, start + count), fed, strict=True):
                    self.kv[table[p // self.size], p % self.size] = token
            tokens = np.full(len(rows.slots), NO_TOKEN, dtype=np.int64)
            for r, table in enumerate(tables):  # every row's keys written first, then read
                end = rows.starts[r] + rows.counts[r]
                read = [int(self.kv[table[p // self.size], p % self.size]) for p in range(end)]
                assert read == known[r][:end], (
                    f"row {r} (slot {rows.slots[r]}, blocks {table}) reads keys {read} where it "
                    f"fed {known[r][:end]}: a block it holds was written by another sequence, "
                    "or never written"
                )
                if i or step.draw.choose[r]:
                    tokens[r] = next_token(read)
                    known[r].append(int(tokens[r]))
            out.append(tokens)
            rows = rows.advanced()
        return out


class Harness:
    """A scheduler driven as the engine drives it (admit, plan, grow a burst, update, complete,
    unplan, finish, restart), every step taken by `Stages`, and the scheduler's promises
    checked as it goes."""

    def __init__(self, **kwargs) -> None:
        self.config = kwargs
        self.scheduler = Scheduler(**kwargs)
        self.epoch = 1
        self.scheduler.owner = (OWNER, self.epoch)
        self.stages = Stages(self.scheduler)
        self.in_flight: list[Step] = []
        self.requests: list[Request] = []
        self.cancelled: set[int] = set()  # id(request)
        self.done: list[Request] = []
        self.streams: dict[int, list[int]] = {}  # id(seq) -> tokens as `update` handed them out
        self.enqueued: dict[int, int] = {}  # id(seq) -> its place in arrival order
        self.admitted_once: list[Sequence] = []  # in order of their first admission
        self.left_out: dict[int, int] = {}  # id(seq) -> its micro-batch's steps it missed
        self.preempted_seen = 0

    # what clients and the engine do
    def submit(self, prompts: list[list[int]], max_new_tokens: int, eos=(), **scoring) -> Request:
        request = Request.of(
            prompts,
            sampling=Sampling(),
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos,
            **scoring,
        )
        for seq in request.sequences:
            self.enqueued[id(seq)] = len(self.enqueued)
            self.streams[id(seq)] = []
        self.requests.append(request)
        self.scheduler.enqueue(request)
        return request

    def cancel(self, request: Request) -> None:
        self.cancelled.add(id(request))
        self.scheduler.finish_request(request, Finish.ABORT)
        flying = {step.group for step in self.in_flight}
        for seq in request.sequences:  # freed at once, unless its micro-batch has a step out
            if seq.group is None or seq.group not in flying:
                assert seq.status is Status.FINISHED and seq.slot is None and seq.blocks == []
        self.take_done()

    def admit(self) -> list[Sequence]:
        s = self.scheduler
        admitted = s.admit()
        for seq in admitted:
            assert seq.status is Status.RUNNING and seq.slot in s.groups[seq.group].slots
            if all(seq is not other for other in self.admitted_once):
                self.admitted_once.append(seq)
        places = [self.enqueued[id(seq)] for seq in self.admitted_once]
        assert places == sorted(places), "new sequences admitted out of arrival order"
        assert not s.waiting or not s.can_admit(s.waiting[0]), (
            "the head of the queue fits and was left waiting"
        )
        return admitted

    def plan(self, burst: int = 1) -> list[Step]:
        """Admit, then plan a step for every idle micro-batch; as one burst of up to `burst`
        steps where the engine would (every running micro-batch planned, every row choosing)."""
        s = self.scheduler
        self.admit()
        steps = []
        for g in s.idle_groups():
            live = [q for q in s.running if q.finish is None]
            oldest = min(live, key=lambda q: q.admitted) if live else None
            group = s.groups[g].sequences
            before = {id(q): (list(q.tokens), q.cached) for q in group}
            decoding = [q for q in group if q.finish is None and q.pending == 1]
            preempted, was_running = s.preemptions, s.running
            step = s.plan(g)
            if s.preemptions > preempted:
                self.preempted_seen += s.preemptions - preempted
                assert oldest is None or oldest.status is Status.RUNNING, (
                    "the oldest running sequence was preempted for a younger one"
                )
                victims = [q for q in was_running if q.status is Status.WAITING]
                assert len(victims) == s.preemptions - preempted
                assert {id(q) for q in list(s.waiting)[: len(victims)]} == set(map(id, victims)), (
                    "a preempted sequence is not back at the head of the queue"
                )
            for q in decoding:
                if q.slot is None:  # preempted: admitted again, it starts afresh
                    self.left_out.pop(id(q), None)
            if step is None:
                continue
            self.check_step(step, g, before)
            for q in decoding:  # a decode left out of a step goes in the next one
                if q.slot is None:
                    continue
                missed = all(q is not r for r in step.sequences)
                self.left_out[id(q)] = self.left_out.get(id(q), 0) + 1 if missed else 0
                assert self.left_out[id(q)] <= 1, "a decode was left out of two steps running"
            steps.append(step)
        running_groups = sum(1 for group in s.groups if group.sequences)
        if (
            burst > 1
            and steps
            and not self.in_flight
            and len(steps) == running_groups
            and all(all(step.draw.choose) for step in steps)
        ):
            left = min(
                q.request.max_new_tokens - len(q.generated) for st_ in steps for q in st_.sequences
            )
            asked = max(1, min(burst, left))
            count = s.grow(steps, asked)
            assert 1 <= count <= asked
            for step in steps:
                step.count = count
        self.in_flight += steps
        return steps

    def check_step(self, step: Step, g: int, before: dict) -> None:
        s, rows = self.scheduler, step.rows
        assert step.group == g and step.sequences
        assert step.x.dtype == np.int64, f"token ids of dtype {step.x.dtype}"
        assert (rows.num_slots, rows.num_blocks, rows.block_size, rows.owner) == (
            s.num_slots,
            s.num_blocks,
            s.block_size,
            s.owner,
        ), f"a step that tells the stages another pool or owner: {rows}"
        assert list(rows.slots) == sorted(rows.slots), "rows not in slot order"
        assert list(rows.slots) == [q.slot for q in step.sequences]
        width = step.x.shape[1]
        for r, seq in enumerate(step.sequences):
            tokens, _ = before[id(seq)]
            assert seq.finish is None and seq.group == g and seq.slot in s.groups[g].slots
            start, count = rows.starts[r], rows.counts[r]
            assert start == seq.cached and 1 <= count <= len(tokens) - start
            assert step.x[r, width - count :].tolist() == tokens[start : start + count], (
                "a row is fed other tokens than its own next ones"
            )
            assert step.draw.choose[r] == (start + count == len(tokens)), (
                "a row chooses before its prompt is in, or not when it is"
            )
            assert len(seq.blocks) * s.block_size >= start + count
        if step.prefill:
            if not s.whole_prompts:
                assert step.x.size <= s.prefill_tokens, (
                    f"a prefill step of {step.x.shape} padded tokens: over {s.prefill_tokens}"
                )
            else:
                assert len(step.sequences) == 1 or step.x.size <= s.prefill_tokens
        else:
            assert width == 1 and set(rows.counts) == {1}
        if s.uniform:
            assert set(rows.counts) == {width}, f"padded rows {rows.counts} in a uniform step"

    def run(
        self,
        step: Step,
        ran: int | None = None,
        cancel_after: Request | None = None,
        answer: Callable[[Step, int, np.ndarray], object] | None = None,
    ) -> None:
        """The step comes back having run `ran` of its `count` steps (all: None); with
        `cancel_after`, that request is cancelled after the first one's tokens; `answer`
        makes what the last stage returns of step i's tokens (a `Chosen`)."""
        s = self.scheduler
        ran = step.count if ran is None else ran
        for i, tokens in enumerate(self.stages.run(step, ran)):
            returned = tokens if answer is None else answer(step, i, tokens)
            for seq, token in s.update(step, i, returned):
                self.streams[id(seq)].append(token)
                assert self.streams[id(seq)] == seq.generated, "tokens out of order or lost"
            if i == 0 and cancel_after is not None:
                self.cancel(cancel_after)
        s.complete(step)
        self.in_flight.remove(step)
        for seq in step.sequences:  # those that ended in it have left their slots now
            if seq.finish is not None:
                assert seq.status is Status.FINISHED and seq.slot is None and seq.blocks == []
        self.take_done()

    def unplan(self, step: Step) -> None:
        """The step was never sent."""
        self.scheduler.unplan(step)
        self.in_flight.remove(step)
        self.take_done()

    def restart(self, num_groups: int, num_blocks: int = 0) -> None:
        """The workers changed: steps in flight are dropped, the new ones hold nothing."""
        s = self.scheduler
        requeued = sorted((q for q in s.running if q.finish is None), key=lambda q: q.admitted)
        waiting = list(s.waiting)
        s.restart(num_groups, num_blocks)
        self.in_flight.clear()
        self.left_out.clear()
        self.epoch += 1
        s.owner = (OWNER, self.epoch)
        self.stages.claim(s)
        # back at the head, ahead of those that waited (their order among themselves:
        # test_a_restart_requeues_across_micro_batches_in_admission_order)
        head = list(s.waiting)[: len(requeued)]
        assert {id(q) for q in head} == set(map(id, requeued)), (
            "a restart puts the running sequences back at the head of the queue"
        )
        assert list(s.waiting)[len(requeued) :] == waiting
        assert all(q.status is Status.WAITING and not q.blocks and q.cached == 0 for q in requeued)
        assert not s.running and s.free_slots == list(range(s.num_slots))
        assert s.used_blocks == 0 and s.blocks.available == s.num_blocks
        if num_blocks:
            assert s.num_blocks == num_blocks
        self.take_done()

    def take_done(self) -> None:
        for request in self.scheduler.take_done():
            assert all(request is not r for r in self.done), "a request handed out twice"
            assert all(q.finish is not None for q in request.sequences)
            self.done.append(request)
            self.check_text(request)

    def check_text(self, request: Request) -> None:
        for seq in request.sequences:
            want = reference(seq.prompt, request.max_new_tokens, request.eos_token_ids)
            assert self.streams[id(seq)] == seq.generated
            if id(request) in self.cancelled or seq.finish is Finish.ERROR:
                assert seq.generated == want[: len(seq.generated)]
            else:
                assert seq.generated == want, f"text {seq.generated} of {seq.prompt}: {want}"
                assert seq.finish is (
                    Finish.STOP if want[-1] in request.eos_token_ids else Finish.LENGTH
                )

    def drain(self, burst: int = 1) -> None:
        """Run every step to the end until every request is done."""
        s = self.scheduler
        for _ in range(20_000):
            if not s.running and not s.waiting and not self.in_flight:
                break
            preemptions = s.preemptions
            self.plan(burst)
            # a micro-batch whose step lost every row to preemption plans none this time
            assert self.in_flight or s.preemptions > preemptions, (
                "nothing runs and nothing can: a request would wait forever"
            )
            for step in list(self.in_flight):
                self.run(step)
            self.check()
        else:
            raise AssertionError("the requests never ended")
        assert len(self.done) == len(self.requests)
        assert s.free_slots == list(range(s.num_slots)) and s.used_blocks == 0
        assert s.blocks.available == s.num_blocks

    # what holds between any two of those
    def check(self) -> None:
        s = self.scheduler
        running = s.running
        assert len(running) <= s.num_slots
        slots = [q.slot for q in running]
        assert len(set(slots)) == len(slots), f"a slot held twice: {slots}"
        assert sorted(slots + s.free_slots) == list(range(s.num_slots)), "a slot lost"
        for g, group in enumerate(s.groups):
            assert all(q.group == g and q.slot in group.slots for q in group.sequences)
        for seq in running:
            assert seq.status is Status.RUNNING
            assert seq.finish is None or s.groups[seq.group].in_flight, (
                "an ended sequence holds its slot with no step out"
            )
            assert len(seq.blocks) * s.block_size >= seq.cached
            assert all(0 <= b < s.num_blocks for b in seq.blocks)
            assert len(set(seq.blocks)) == len(seq.blocks)
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in running:
            for i, block in enumerate(seq.blocks):
                holders.setdefault(block, []).append((seq, i))
        for block, held in holders.items():
            if len(held) == 1:
                continue
            assert s.blocks.prefix_caching, f"block {block} handed to {len(held)} sequences"
            (first, i), *others = held
            end = (i + 1) * s.block_size
            for seq, j in others:  # shared only as the same full block of the same tokens
                assert j == i and seq.cached >= end and first.cached >= end
                assert seq.tokens[:end] == first.tokens[:end], f"block {block} shared wrongly"
        assert s.used_blocks == len(holders), "the pool's count is not the blocks held"
        waiting = list(s.waiting)
        assert len({id(q) for q in waiting}) == len(waiting)
        assert all(q.status is Status.WAITING and q.finish is None for q in waiting)
        assert all(q.slot is None and not q.blocks and q.cached == 0 for q in waiting)
        live = {id(q) for r in self.requests for q in r.sequences if q.finish is None}
        assert live == {id(q) for q in waiting} | {id(q) for q in running if q.finish is None}, (
            "a sequence that has not ended is neither waiting nor running"
        )


def prompt_of(n: int, salt: int) -> list[int]:
    """Prompts that share their first tokens (a system prompt) and differ after `salt`."""
    return [7 + (i if i < 6 else (i * 13 + salt) % 29) for i in range(n)]


# 1. admission: slots, blocks, arrival order


def test_admission_is_bounded_by_the_slots_and_the_block_pool_in_arrival_order() -> None:
    """At most `num_slots` run, whatever the pool holds; a head the pool has no blocks for
    (with 1% of it left for the running ones to grow into) waits, and a short one behind it
    waits too though it would fit; blocks freed go to the head at once. `can_admit()` (a
    sequence of one block, for one not queued yet) says the same."""
    h = Harness(num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, block_size=4)
    s = h.scheduler
    a, b, c = (h.submit([prompt_of(2, n)], max_new_tokens=4) for n in range(3))
    assert h.admit() == [*a.sequences, *b.sequences]
    assert list(s.waiting) == c.sequences and s.blocks.available == 6  # no slot for c
    assert not s.can_admit()
    h.cancel(a)
    assert h.admit() == c.sequences and c.sequences[0].slot == 0

    h = Harness(
        num_slots=4, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=8, block_size=4
    )
    s = h.scheduler
    a, b, c = (h.submit([prompt_of(9, n)], max_new_tokens=4) for n in range(3))  # 3 blocks each
    d = h.submit([prompt_of(1, 3)], max_new_tokens=4)  # 1 block
    assert h.admit() == [*a.sequences, *b.sequences]
    assert s.blocks.available == 2 and s.free_slots == [2, 3]
    assert s.can_admit()  # one block, and one left: the margin
    assert list(s.waiting) == [*c.sequences, *d.sequences]  # d would fit, but c is first
    h.run(h.plan()[0])
    h.cancel(b)
    assert s.blocks.available == 5
    assert h.admit() == [*c.sequences, *d.sequences]
    assert [q.slot for q in s.running] == [0, 1, 2]
    # one block free, a slot free, a sequence of one block waiting: the block is the running
    # ones' margin (1% of the pool, at least one block), so it waits
    e = h.submit([prompt_of(4, 4)], max_new_tokens=4)
    assert s.blocks.available == 1 and not h.admit() and list(s.waiting) == e.sequences
    assert not s.can_admit()
    h.drain()
    assert [r.finish_reasons for r in (a, c, d, e)] == [[Finish.LENGTH]] * 4


def test_micro_batches_own_contiguous_slots_and_take_new_sequences_evenly() -> None:
    """Five slots in two micro-batches: 0-1 and 2-4; each admitted sequence goes to the
    micro-batch with the fewest, into its lowest free slot; a step's rows are its own."""
    h = Harness(
        num_slots=5, max_seq_len=8, num_groups=2, prefill_tokens=64, num_blocks=10, block_size=4
    )
    s = h.scheduler
    assert [g.slots for g in s.groups] == [range(0, 2), range(2, 5)]
    for n in range(5):
        h.submit([prompt_of(3, n)], max_new_tokens=2)
    admitted = h.admit()
    assert [(q.group, q.slot) for q in admitted] == [(0, 0), (1, 2), (0, 1), (1, 3), (1, 4)]
    steps = h.plan()
    assert [step.rows.slots for step in steps] == [(0, 1), (2, 3, 4)]
    for step in steps:
        h.run(step)
    h.drain()


def test_admission_leaves_one_percent_of_the_pool_free_and_none_when_nothing_runs() -> None:
    """With nothing running, a sequence may take the whole pool (one of max_seq_len always
    fits); with one running, admission leaves 1% of the pool (rounded down, at least one
    block) for it to grow into: of 201 blocks, 2."""
    h = Harness(
        num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=4, block_size=4
    )
    whole = h.submit([prompt_of(15, 0)], max_new_tokens=1)  # 4 blocks: the whole pool
    assert h.admit() == whole.sequences and h.scheduler.blocks.available == 0
    h.drain()

    h = Harness(
        num_slots=2, max_seq_len=128, num_groups=1, prefill_tokens=256, num_blocks=201, block_size=1
    )
    s = h.scheduler
    h.submit([prompt_of(100, 0)], max_new_tokens=2)
    h.admit()
    assert s.blocks.available == 101
    over = h.submit([prompt_of(100, 1)], max_new_tokens=2)  # would leave 1 block
    assert not h.admit()
    h.cancel(over)
    fits = h.submit([prompt_of(99, 2)], max_new_tokens=2)  # leaves 2
    assert h.admit() == fits.sequences and s.blocks.available == 2
    h.drain()


def test_prefix_caching_reuses_full_blocks_but_never_the_last_prompt_token() -> None:
    """A prompt that starts like an ended sequence's tokens starts past the full blocks they
    share, but never past its own last token (its first token needs that position's
    logits); the pool counts the prompt tokens looked up and those found. A restart empties
    the cache; a pool resized by one caches as before."""
    h = Harness(
        num_slots=2,
        max_seq_len=16,
        num_groups=1,
        prefill_tokens=64,
        block_size=4,
        prefix_caching=True,
    )
    s = h.scheduler
    prompt = prompt_of(9, 0)

    def first_step(tokens: list[int]) -> tuple:
        h.submit([tokens], max_new_tokens=2)
        [step] = h.plan()
        h.drain()
        return step.rows.starts, step.rows.counts

    assert first_step(prompt) == ((0,), (9,))
    assert first_step(prompt) == ((8,), (1,))  # both full blocks
    assert first_step(prompt[:8]) == ((4,), (4,))  # the second would leave nothing to feed
    assert (s.blocks.queries, s.blocks.hits) == (9 + 9 + 8, 0 + 8 + 4)
    h.restart(1, num_blocks=6)
    assert first_step(prompt) == ((0,), (9,))
    assert first_step(prompt) == ((8,), (1,))


# 2. every way out frees the slot and the blocks once


def test_a_cancel_frees_the_slot_and_blocks_at_once_or_when_the_step_out_comes_back() -> None:
    """Cancelled with no step of its micro-batch out: slot and blocks free at once; with one
    out: held until it comes back (the workers still write there), then freed. The request
    is handed out once, at the cancel, and gets no token of the step that was out."""
    h = Harness(num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, block_size=4)
    s = h.scheduler
    a = h.submit([prompt_of(6, 1)], max_new_tokens=8)
    b = h.submit([prompt_of(6, 2)], max_new_tokens=8)
    h.run(h.plan()[0])
    [step] = h.plan()
    h.cancel(a)
    [seq] = a.sequences
    assert h.done == [a]  # its client hears at once
    assert seq.slot == 0 and seq.blocks and s.free_slots == []  # the step out writes there
    h.run(step)
    assert seq.generated == reference(seq.prompt, 8, frozenset())[:1]  # none of that step's
    assert s.free_slots == [0] and not seq.blocks
    h.cancel(b)
    assert s.free_slots == [0, 1] and s.used_blocks == 0 and h.done == [a, b]
    s.finish_request(b, Finish.STOP)  # a sequence ends once: its first reason stays
    assert b.finish_reasons == [Finish.ABORT] and s.take_done() == []


def test_a_request_of_several_sequences_is_done_once_when_its_last_one_ends() -> None:
    """Three rows, two slots: the row left waiting is cancelled (it leaves the queue), a
    running one is cancelled, the last runs to its end: the request is handed out once,
    then, and every row's slot is free. A request ended before it was ever queued (the
    engine's loop had not taken it in) is handed out at once."""
    h = Harness(
        num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=16, block_size=4
    )
    s = h.scheduler
    r = h.submit([prompt_of(3, 1), prompt_of(4, 2), prompt_of(5, 3)], max_new_tokens=6)
    h.cancelled.add(id(r))  # its texts are checked as far as they went
    h.run(h.plan()[0])
    assert list(s.waiting) == r.sequences[2:]
    s.finish(r.sequences[2], Finish.ABORT)
    assert not s.waiting and r.sequences[2].status is Status.FINISHED
    s.finish(r.sequences[0], Finish.ABORT)
    assert s.free_slots == [0] and s.take_done() == []
    while s.running:
        assert h.done == []
        for step in h.plan():
            h.run(step)
    assert h.done == [r] and s.take_done() == []
    assert r.finish_reasons == [Finish.ABORT, Finish.LENGTH, Finish.ABORT]
    assert len(r.sequences[1].generated) == 6 and s.free_slots == [0, 1]

    never = Request.of([prompt_of(3, 4)], sampling=Sampling(), max_new_tokens=6)
    s.finish_request(never, Finish.ABORT)
    assert never.sequences[0].status is Status.FINISHED and s.take_done() == [never]
    assert not s.waiting and not s.running


def test_a_failed_row_ends_its_request_with_the_error_and_frees_its_slot() -> None:
    """A row the last stage could not choose for ends its request alone, with its first
    error, its slot free at once; the other request goes on to its end."""
    h = Harness(
        num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=16, block_size=4
    )
    s = h.scheduler
    r = h.submit([prompt_of(3, 1)], max_new_tokens=6)
    other = h.submit([prompt_of(3, 2)], max_new_tokens=6)
    h.run(h.plan()[0])
    error = RuntimeError("the stage could not take it")
    s.fail_request(r, error)
    s.fail_request(r, RuntimeError("later"))  # the first error stays
    assert r.error is error and r.finish_reasons == [Finish.ERROR]
    h.take_done()
    assert h.done == [r] and s.free_slots == [0]
    h.drain()
    assert other.finish_reasons == [Finish.LENGTH]


def test_a_row_the_last_stage_could_not_choose_for_ends_its_request_alone() -> None:
    """A row the last stage failed (`Chosen.failed`, its token a placeholder) ends its request
    with that row's reason, and its token is never handed out; every other row of the step,
    those after it and after a row cancelled while the step was out too, gets its token."""
    h = Harness(
        num_slots=4, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=16, block_size=4
    )
    s = h.scheduler
    gone = h.submit([prompt_of(3, 1)], max_new_tokens=6)
    failing = h.submit([prompt_of(3, 2), prompt_of(4, 3)], max_new_tokens=6)
    other = h.submit([prompt_of(5, 4)], max_new_tokens=6)
    [step] = h.plan()
    assert step.rows.slots == (0, 1, 2, 3)
    h.cancel(gone)

    def answer(step: Step, i: int, tokens: np.ndarray) -> Chosen:
        tokens = tokens.copy()
        tokens[2] = 0
        return Chosen(tokens=tokens, chosen={}, prompt={}, failed={2: "its logits are not numbers"})

    h.run(step, answer=answer)
    assert isinstance(failing.error, RowFailedError)
    assert str(failing.error) == "sequence 1: its logits are not numbers"
    assert failing.finish_reasons == [Finish.ERROR] * 2 and failing.sequences[1].generated == []
    [seq] = other.sequences
    assert seq.generated == reference(seq.prompt, 6, frozenset())[:1]
    assert h.done == [gone, failing] and s.free_slots == [0, 1, 2]
    h.drain()
    assert other.finish_reasons == [Finish.LENGTH]


def logprobs_of(start: int, ids) -> Logprobs:
    """Stand-in scores of the tokens `ids` at positions `start`.. (each its own top one)."""
    ids = tuple(int(i) for i in ids)
    return Logprobs(
        start=start,
        token_ids=ids,
        logprobs=tuple(-0.5 for _ in ids),
        top_ids=tuple((i,) for i in ids),
        top_logprobs=tuple((-0.5,) for _ in ids),
    )


def test_tokens_come_with_their_logprobs_and_the_prompt_scores_chunk_by_chunk() -> None:
    """What the last stage returns besides the tokens (`Chosen`) goes to its rows: each chosen
    token's log-probabilities, in order, and the prompt's scores by first position as its
    chunks come (joined once all came); a row that asked for none gets none."""
    h = Harness(num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=4, block_size=4)
    s = h.scheduler
    scored = h.submit([prompt_of(7, 0)], max_new_tokens=3, logprobs=1, prompt_logprobs=1)
    plain = h.submit([prompt_of(2, 1)], max_new_tokens=3)
    [seq], [other] = scored.sequences, plain.sequences

    def answer(step: Step, i: int, tokens: np.ndarray) -> Chosen:
        """Scores for `seq` only: of the prompt positions its chunk fed (from 1), and of the
        token it chose."""
        chosen, prompt = {}, {}
        for r, q in enumerate(step.sequences):
            if q is not seq:
                continue
            start = step.rows.starts[r] + (0 if i == 0 else step.rows.counts[r] + i - 1)
            end = start + (step.rows.counts[r] if i == 0 else 1)
            if start < len(seq.prompt):
                first = max(start, 1)
                prompt[r] = logprobs_of(first, seq.prompt[first:end])
            if tokens[r] != NO_TOKEN:
                chosen[r] = logprobs_of(end, [tokens[r]])
        return Chosen(tokens=tokens, chosen=chosen, prompt=prompt)

    rows = []
    while s.running or s.waiting:
        for step in h.plan():
            rows.append((step.sequences, step.rows.counts))
            h.run(step, answer=answer)
    assert rows[:3] == [([seq], (4,)), ([seq], (3,)), ([seq, other], (1, 2))]
    assert seq.prompt_chunks == {
        1: logprobs_of(1, seq.prompt[1:4]),
        4: logprobs_of(4, seq.prompt[4:7]),
    }
    assert seq.prompt_logprobs() == logprobs_of(1, seq.prompt[1:])
    assert seq.logprobs == [logprobs_of(7 + k, [t]) for k, t in enumerate(seq.generated)]
    assert len(seq.generated) == 3 and other.logprobs == [] and other.prompt_chunks == {}
    assert h.done == [scored, plain]


# 3. preemption, restarts


def test_the_youngest_is_preempted_when_the_pool_runs_short_and_every_text_is_unchanged() -> None:
    """Three sequences that each grow to 16 tokens in a pool of 6 blocks of 4 (room for one and
    a half): the youngest running is preempted (never the oldest), fed again from its start
    when admitted again, and every request's text is what generation without a scheduler
    gives."""
    h = Harness(
        num_slots=3, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=6, block_size=4
    )
    requests = [h.submit([prompt_of(3, n)], max_new_tokens=13) for n in range(3)]
    h.drain()
    assert h.preempted_seen >= 2 and h.scheduler.preemptions == h.preempted_seen
    assert all(r.finish_reasons == [Finish.LENGTH] for r in requests)


def test_a_restart_requeues_ahead_of_the_waiting_and_resizes_the_pool() -> None:
    """After the workers changed: the running sequences go back to the head of the queue,
    ahead of those that waited, the pool takes the blocks given, and every text comes out as
    without the restart."""
    h = Harness(num_slots=2, max_seq_len=16, num_groups=2, prefill_tokens=64, block_size=4)
    requests = [h.submit([prompt_of(4 + n, n)], max_new_tokens=9) for n in range(4)]
    for _ in range(3):
        for step in h.plan():
            h.run(step)
    steps = h.plan()  # out when the workers change: dropped
    assert steps
    h.restart(1, num_blocks=5)
    h.drain(burst=3)
    assert all(r.finish_reasons == [Finish.LENGTH] for r in requests)
    h.restart(2)  # nothing running: the pool keeps its size
    assert h.scheduler.num_blocks == 5


def test_a_restart_requeues_across_micro_batches_in_admission_order() -> None:
    """A (slot 0, micro-batch 0) and B (slot 1, micro-batch 1) admitted; A ends and C takes
    slot 0: after a restart B, admitted before C, is ahead of it."""
    h = Harness(
        num_slots=2, max_seq_len=16, num_groups=2, prefill_tokens=64, num_blocks=16, block_size=4
    )
    s = h.scheduler
    a = h.submit([prompt_of(3, 1)], max_new_tokens=1)
    b = h.submit([prompt_of(3, 2)], max_new_tokens=9)
    for step in h.plan():
        h.run(step)
    assert a.finish_reasons == [Finish.LENGTH]
    c = h.submit([prompt_of(3, 3)], max_new_tokens=9)
    h.admit()
    [older], [younger] = b.sequences, c.sequences
    assert (older.group, younger.group) == (1, 0) and older.admitted < younger.admitted
    s.restart(1)
    assert list(s.waiting) == [older, younger]


def test_a_restart_with_a_pool_too_small_for_one_sequence_is_refused_naming_it() -> None:
    h = Harness(num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, block_size=4)
    with pytest.raises(
        ValueError,
        match=r"a KV pool of 3 blocks cannot hold one sequence of "
        r"max_seq_len 16",
    ):
        h.scheduler.restart(1, num_blocks=3)


def test_a_refused_restart_loses_no_sequence() -> None:
    h = Harness(num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, block_size=4)
    h.submit([prompt_of(4, 1)], max_new_tokens=5)
    h.submit([prompt_of(4, 2)], max_new_tokens=5)
    h.run(h.plan()[0])
    with pytest.raises(ValueError, match="3 blocks"):
        h.scheduler.restart(1, num_blocks=3)
    h.check()  # every sequence that has not ended still waits or runs


def test_a_preempted_sequence_starts_again_as_new_in_its_slot() -> None:
    """A sequence preempted and admitted again into the slot it had (nobody took it between)
    starts there as a new one: its first step sends its settings and its whole block table
    again, as at its first admission; its other steps send neither."""
    h = Harness(
        num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=4, block_size=4
    )
    s = h.scheduler
    h.submit([prompt_of(2, 0)], max_new_tokens=2)  # ends, leaving slot 0 to `young`
    old = h.submit([prompt_of(2, 1)], max_new_tokens=13)
    for _ in range(2):
        for step in h.plan():
            h.run(step)
    young = h.submit([prompt_of(2, 2)], max_new_tokens=13)
    [seq] = young.sequences
    seen: list[list] = [[], []]  # before and after its preemption: each step of `seq`'s
    while young not in h.done:
        for step in h.plan():
            if seq in step.sequences:
                r = step.sequences.index(seq)
                sent = [slot for slot, _ in step.draw.settings]
                seen[s.preemptions].append((step.rows.slots[r], sent, step.rows.table_from[r]))
            h.run(step)
    assert s.preemptions == 1 and old.finish_reasons == [Finish.LENGTH]
    for steps in seen:
        assert len(steps) > 1 and steps[0] == (0, [0], 0)
        assert all(sent == [] and held > 0 for _, sent, held in steps[1:])


def test_the_pool_holds_one_sequence_of_max_seq_len_or_is_refused() -> None:
    """A pool of fewer blocks than one sequence of max_seq_len is refused when the scheduler is
    made; one of exactly that many is taken, made or by a restart. A sequence that outgrows
    it all the same (past max_seq_len, which the engine refuses) fails naming the pool."""
    config = dict(num_slots=1, max_seq_len=8, num_groups=1, prefill_tokens=64, block_size=4)
    with pytest.raises(AssertionError):
        Scheduler(**config, num_blocks=1)
    h = Harness(**config, num_blocks=2)
    h.restart(1, num_blocks=3)
    h.restart(1, num_blocks=2)
    h.submit([prompt_of(3, 0)], max_new_tokens=10)
    with pytest.raises(
        RuntimeError,
        match=r"the KV pool \(2 blocks\) cannot hold its one running sequence of 8 tokens",
    ):
        for _ in range(10):
            for step in h.plan():
                h.run(step)


# 4. steps: chunks, bursts, block tables
def test_a_long_prompt_goes_in_chunks_with_the_others_decodes_between_them() -> None:
    """A prompt longer than `prefill_tokens` goes in chunks of that many, each its own step,
    and a decoding sequence of the micro-batch steps between them (one chunk's delay at
    most); the last chunk, shorter, takes the decode along while the padded tokens fit."""
    h = Harness(num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=4, block_size=4)
    a = h.submit([prompt_of(2, 0)], max_new_tokens=8)
    h.run(h.plan()[0])
    b = h.submit([prompt_of(10, 1)], max_new_tokens=2)
    [decoding], [prompt] = a.sequences, b.sequences
    steps = []
    for _ in range(5):
        [step] = h.plan()
        steps.append((step.sequences, step.rows.counts, step.prefill, step.draw.choose))
        h.run(step)
    assert steps == [
        ([prompt], (4,), True, (False,)),
        ([decoding], (1,), False, (True,)),
        ([prompt], (4,), True, (False,)),
        ([decoding], (1,), False, (True,)),
        ([decoding, prompt], (1, 2), True, (True, True)),
    ]
    h.drain()


def test_a_uniform_step_takes_only_chunks_as_long_as_the_first() -> None:
    """With `uniform` (recurrent state: no padded row), a prefill step takes the prompts whose
    chunk is as long as the first one's, passing over the others, and no decode rides along
    a chunk longer than one token."""
    h = Harness(
        num_slots=3, max_seq_len=16, num_groups=1, prefill_tokens=64, uniform=True, block_size=4
    )
    a, b, c = (h.submit([prompt_of(n, i)], max_new_tokens=3) for i, n in enumerate((4, 2, 4)))
    [step] = h.plan()
    assert step.sequences == [*a.sequences, *c.sequences] and step.rows.counts == (4, 4)
    h.run(step)
    [step] = h.plan()
    assert step.sequences == b.sequences and step.rows.counts == (2,)
    h.run(step)
    [step] = h.plan()
    assert not step.prefill and step.sequences == [*a.sequences, *b.sequences, *c.sequences]
    h.run(step)
    h.drain()


def test_a_burst_takes_blocks_ahead_only_while_the_pool_is_not_in_demand() -> None:
    """A burst asked for n steps runs them all, its blocks taken ahead (and sent with its first
    step), while no sequence waits and they are at most half of the free blocks; else it runs
    to the end of each row's last block, taking none. A pool with no free block runs a burst
    that needs none."""
    config = dict(num_slots=1, max_seq_len=16, num_groups=1, prefill_tokens=64, block_size=4)
    h = Harness(**config, num_blocks=8)
    h.submit([prompt_of(2, 0)], max_new_tokens=14)
    [step] = h.plan(burst=13)  # 3 blocks ahead of 7 free
    assert step.count == 13 and step.rows.tables == ((0, 1, 2, 3),)
    assert h.scheduler.blocks.available == 4
    h.drain()
    h.submit([prompt_of(2, 1)], max_new_tokens=14)
    h.submit([prompt_of(2, 2)], max_new_tokens=14)  # waits for the slot
    [step] = h.plan(burst=5)
    assert step.count == 3 and step.rows.tables == ((0,),)  # positions 2-3 of block 0
    h.drain()

    h.submit([prompt_of(3, 7)], max_new_tokens=14)
    h.submit([prompt_of(2, 8)], max_new_tokens=14)  # waits for the slot
    [step] = h.plan(burst=6)
    assert step.count == 2 and step.rows.tables == ((0,),)  # position 3 left in block 0
    h.drain()
    # a prompt that fills its block: in demand, the burst goes through one block more
    h.submit([prompt_of(4, 5)], max_new_tokens=14)
    h.submit([prompt_of(2, 6)], max_new_tokens=14)  # waits for the slot
    [step] = h.plan(burst=6)
    assert step.count == 5 and len(step.rows.tables[0]) == 2  # positions 4-7: block 1 whole
    h.drain()

    h = Harness(**config, num_blocks=4)
    h.submit([prompt_of(2, 3)], max_new_tokens=14)
    [step] = h.plan(burst=9)  # 2 blocks ahead of 3 free
    assert step.count == 3 and step.rows.tables == ((0,),)
    h.drain()
    h.submit([prompt_of(13, 4)], max_new_tokens=3)
    [step] = h.plan(burst=3)  # positions 13-15: in its fourth block, the pool's last
    assert step.count == 3 and h.scheduler.blocks.available == 0
    h.drain()


def test_a_sequence_fills_its_slots_home_blocks_and_steps_carry_only_what_changed() -> None:
    """Each slot has a home run of blocks (the pool's share of one slot, from slot x that on),
    which its sequence takes in order. A sequence's first step in its slot carries its whole
    table, every later one only the blocks it gained (`table_from`: how many the stages
    hold), and after a burst cut short gave back the blocks it took ahead, how many stay."""
    h = Harness(
        num_slots=2, max_seq_len=16, num_groups=1, prefill_tokens=64, num_blocks=8, block_size=4
    )
    a = h.submit([prompt_of(6, 0)], max_new_tokens=9)
    b = h.submit([prompt_of(3, 1)], max_new_tokens=9)
    [seq_a], [seq_b] = a.sequences, b.sequences
    tables = []
    for burst, ran in ((1, 1), (1, 1), (1, 1), (4, 1), (1, 1)):
        [step] = h.plan(burst)
        tables.append((step.rows.table_from, step.rows.tables))
        h.run(step, ran)
        if burst > 1:
            assert step.count == burst and ran < burst  # cut after its first step
    assert tables == [
        ((0, 0), ((0, 1), (4,))),  # prompts: positions 0-5 and 0-2
        ((2, 1), ((), ())),  # positions 6 and 3
        ((2, 1), ((), (5,))),  # 7 and 4: b's second block
        ((2, 2), ((2,), (6,))),  # 8 and 5, a burst through 11 and 8: b takes block 6 ahead
        ((3, 2), ((), ())),  # 9 and 6: the stages keep b's first 2 blocks, block 6 is free
    ]
    assert (seq_a.blocks, seq_b.blocks) == ([0, 1, 2], [4, 5])
    h.drain()


# 5. any interleaving: a state machine


@st.composite
def configs(draw) -> dict:
    block_size = draw(st.sampled_from([2, 4]))
    max_seq_len = draw(st.integers(4, 20))
    num_slots = draw(st.integers(2, 4))
    per_sequence = blocks_for(max_seq_len, block_size)
    uniform = draw(st.booleans())
    return dict(
        num_slots=num_slots,
        max_seq_len=max_seq_len,
        num_groups=draw(st.integers(1, 3)),
        prefill_tokens=draw(st.integers(1, 24)),
        uniform=uniform,
        whole_prompts=uniform and draw(st.booleans()),
        num_blocks=draw(st.integers(per_sequence, per_sequence + 2 * num_slots)),
        block_size=block_size,
        prefix_caching=not uniform and draw(st.booleans()),
    )


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, are cancelled, steps are planned (bursts too), come back whole or cut,
    are never sent, and the workers change, in any order: `Harness` checks every step and
    `check` everything between; at the end every request is done once, with its text."""

    @initialize(config=configs())
    def start(self, config: dict) -> None:
        self.failed = True  # until a rule ends: no drain at teardown after a failure
        self.h = Harness(**config)
        self.failed = False

    def _guard(self, action) -> None:
        self.failed = True
        action()
        self.failed = False

    @rule(
        lengths=st.lists(st.integers(1, 12), min_size=1, max_size=2),
        new=st.integers(1, 16),
        salt=st.integers(0, 3),
        eos=st.booleans(),
    )
    def submit(self, lengths, new, salt, eos) -> None:
        limit = self.h.scheduler.max_seq_len
        prompts = [prompt_of(min(n, limit - 1), salt + i) for i, n in enumerate(lengths)]
        longest = max(len(p) for p in prompts)
        eos_ids = (EOS,) if eos else ()
        self._guard(lambda: self.h.submit(prompts, min(new, limit - longest), eos_ids))

    @rule(burst=st.integers(1, 4))
    def plan(self, burst) -> None:
        self._guard(lambda: self.h.plan(burst))

    @precondition(lambda self: self.h.in_flight)
    @rule(data=st.data())
    def come_back(self, data) -> None:
        step = data.draw(st.sampled_from(self.h.in_flight))
        ran = data.draw(st.integers(1, step.count))  # a burst may be cut
        live = [q.request for q in step.sequences if q.finish is None]
        cancel = data.draw(st.sampled_from([None, *live])) if live else None
        self._guard(lambda: self.h.run(step, ran, cancel_after=cancel))

    @precondition(lambda self: self.h.in_flight)
    @rule(data=st.data())
    def never_sent(self, data) -> None:
        step = data.draw(st.sampled_from(self.h.in_flight))
        self._guard(lambda: self.h.unplan(step))

    @precondition(lambda self: len(self.h.done) < len(self.h.requests))
    @rule(data=st.data())
    def cancel(self, data) -> None:
        open_ = [r for r in self.h.requests if all(r is not d for d in self.h.done)]
        request = data.draw(st.sampled_from(open_))
        self._guard(lambda: self.h.cancel(request))

    @rule(num_groups=st.integers(1, 3), grow=st.integers(0, 3))
    def restart(self, num_groups, grow) -> None:
        s = self.h.scheduler
        blocks = blocks_for(s.max_seq_len, s.block_size) + grow if grow else 0
        self._guard(lambda: self.h.restart(num_groups, blocks))

    @invariant()
    def consistent(self) -> None:
        self._guard(self.h.check)

    def teardown(self) -> None:
        if not getattr(self, "failed", True):
            self.h.drain(burst=3)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
