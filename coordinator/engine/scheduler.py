"""Which sequences run in the next step, in which slots and KV blocks: the engine's bookkeeping,
without Ray and without threads (the engine calls it from its one loop). The scheduler is the
one writer of every sequence's status; the engine and the clients read it.

A sequence moves WAITING -> RUNNING -> FINISHED, and every way out (end token, max tokens,
cancel, client gone, error, recovery, close) goes through `finish`: a sequence ends once, its
slot is freed once (at once, or when the step of its micro-batch in flight comes back), and
the requests whose sequences have all ended are handed out once by `take_done`.

Sequences wait in one FIFO queue. The head is admitted when a slot is free (at most
`num_slots` run at once: the plan's max_batch, vLLM's max_num_seqs) and the KV pool has blocks
for every token it feeds first (its prompt; a preempted sequence's tokens so far) with a margin
of 1% of the pool left for the running ones to grow into; it gets those blocks at once, and one
more each time it crosses a block's end. The stages keep each slot's block table: a sequence's
first step in its slot carries the whole table (its cached prefix's blocks first), every later
one only the blocks it gained, and where the engine gave back blocks the stages hold (a burst
cut before its steps ran), how many of them stay (`StepRows.table_from`). A step that needs
blocks the pool no longer has preempts the youngest running sequence (of a micro-batch with no
step in flight): its blocks and slot are freed and it goes back to the head of the queue, to
feed its prompt and its tokens so far again when it is admitted again (as after a recovery),
so its text is unchanged. The oldest sequence is never preempted for a younger one, and the
pool holds at least one sequence of `max_seq_len` tokens (checked when the scheduler is made,
and by the plan), so every request ends. Running sequences are split over `num_groups`
micro-batches, each owning a contiguous range of slots (so a step's rows are consecutive
slots, and the workers read their keys and values through a view, never a gather); each
micro-batch alternates two kinds of step when it has both to do:

- a **decode** step: every sequence of the micro-batch that has one token to feed (its last
  one chosen) feeds it, so each offloaded layer is brought in once for all of them;
- a **prefill** step: sequences whose prompt is not in the cache yet feed a chunk of it, at most
  `prefill_tokens` tokens in all (rows x width, the rows left-padded to the widest), in
  admission order; the decodes ride along in the same step while the padded tokens stay
  within that budget (short prompts: one step for all), else a long prompt takes several
  steps, and the decodes of the others go on between them, so a new prompt delays them by one
  chunk at most.
A sequence whose chunk ends its prompt chooses its first token in the same step.

A model with recurrent state per sequence (mamba, linear attention) cannot take padded rows (a
padded position would enter the recurrence): with `uniform`, every row of a step feeds the same
number of tokens, so a prefill step takes the chunks as long as the first one's and decodes
ride along only when that is one token. A chunk after the first continues each row's state;
with `whole_prompts` (a model whose code does not continue a recurrence over a second chunk:
Jamba's cached forward over tokens 8-10 after 0-7 differs from the whole forward by 0.02 in
transformers 5.23, where Qwen3-Next's and Bamba's agree to 1e-7) each prompt goes in whole, as
`generate` feeds it (the plan reserves activations for `max_seq_len` tokens then).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from coordinator.engine.blocks import BlockPool
from coordinator.engine.sequences import Finish, Request, Sequence, Status
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for
from worker.steps import NO_TOKEN, Chosen, Draw, RowFailedError, StepRows


@dataclass(eq=False)
class Step:
    """One planned step of micro-batch `group`: its sequences (row order), what the workers
    get, and how many decode steps it may run on the worker (a burst)."""

    group: int
    sequences: list[Sequence]
    rows: StepRows
    x: np.ndarray  # token ids (rows, width), int64: packed for Ray without torch
    draw: Draw
    prefill: bool
    count: int = 1


@dataclass
class _Group:
    slots: range  # the slots (running sequences' indices) this micro-batch owns
    free: list[int] = field(default_factory=list)  # a heap: the lowest free slot goes first
    sequences: list[Sequence] = field(default_factory=list)
    in_flight: bool = False
    last_prefill: bool = False

    def __post_init__(self) -> None:
        self.free = list(self.slots)


class Scheduler:
    def __init__(
        self,
        *,
        num_slots: int,
        max_seq_len: int,
        num_groups: int,
        prefill_tokens: int,
        uniform: bool = False,
        whole_prompts: bool = False,
        num_blocks: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_caching: bool = False,
    ) -> None:
        """`num_blocks` of `block_size` positions: the KV pool (0: one run of blocks for
        `max_seq_len` positions per slot, as much as a slot per sequence would hold).
        `prefix_caching`: a sequence reuses the full blocks of an earlier one with the same
        first tokens (`coordinator.engine.blocks`); never with `uniform` (a recurrent state
        cannot start past tokens it did not take in)."""
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.block_size = block_size
        self.num_blocks = num_blocks or num_slots * blocks_for(max_seq_len, block_size)
        # EngineConfig refuses a pool smaller than that: requests could wait forever
        assert self.num_blocks >= blocks_for(max_seq_len, block_size)
        self.blocks = BlockPool(
            self.num_blocks,
            block_size,
            num_slots=num_slots,
            prefix_caching=prefix_caching and not uniform,
        )
        self.preemptions = 0
        self._admissions = itertools.count()
        self.prefill_tokens, self.uniform = prefill_tokens, uniform
        self.whole_prompts = whole_prompts
        self.waiting: deque[Sequence] = deque()
        self.groups: list[_Group] = []
        self._done: list[Request] = []  # requests whose last sequence ended, not yet taken
        self.owner: tuple[str, int] = ("", 0)  # the engine's claim, stamped on every step
        self._sent: dict[int, Sequence] = {}  # slot -> whose settings the last stage holds
        # slot -> whose block table the stages hold, and how many of its blocks (`_tables`)
        self._held: dict[int, tuple[Sequence, int]] = {}
        self.reform(num_groups)

    def reform(self, num_groups: int) -> None:
        """Split the slots into `num_groups` micro-batches (at most one per slot) of contiguous
        ranges. Only with no sequence running (at start, or after a restart, when every
        running sequence is put back at the head of the queue)."""
        assert not self.running, "micro-batches re-formed under running sequences"
        k = max(1, min(num_groups, self.num_slots))
        bounds = [g * self.num_slots // k for g in range(k + 1)]
        self.groups = [_Group(slots=range(bounds[g], bounds[g + 1])) for g in range(k)]

    # queues
    @property
    def running(self) -> list[Sequence]:
        return [s for g in self.groups for s in g.sequences]

    @property
    def free_slots(self) -> list[int]:
        return sorted(slot for g in self.groups for slot in g.free)

    def enqueue(self, request: Request) -> None:
        for seq in request.sequences:
            seq.status = Status.WAITING
        self.waiting.extend(request.sequences)

    @property
    def used_blocks(self) -> int:
        return self.blocks.used

    @property
    def used_tokens(self) -> int:
        """Positions of the pool that hold a running sequence's keys and values."""
        return sum(s.cached for s in self.running)

    def _margin(self) -> int:
        """Blocks admission leaves free for the running sequences to grow into: 1% of the
        pool (vLLM's watermark), none when nothing runs."""
        return max(1, self.num_blocks // 100) if any(g.sequences for g in self.groups) else 0

    def can_admit(self, seq: Sequence | None = None) -> bool:
        """A slot is free and the pool has blocks for `seq` (the head of the queue; None: a
        sequence of one block) with the margin left, the blocks it reuses counted."""
        if not any(g.free for g in self.groups):
            return False
        if seq is None:
            return 1 + self._margin() <= self.blocks.available
        reused = self._reusable(seq)
        need = blocks_for(len(seq.tokens), self.block_size) - len(reused)
        return need + self.blocks.cost(reused) + self._margin() <= self.blocks.available

    def _looks_up(self, seq: Sequence) -> bool:
        """`seq` may start with cached blocks: caching is on, and it does not score its prompt
        (that needs every position's logits)."""
        return self.blocks.prefix_caching and seq.request.prompt_logprobs is None

    def _reusable(self, seq: Sequence) -> list[int]:
        """The blocks of the prefix cache `seq` may start with: full blocks of its tokens,
        leaving at least its last token to feed (its next token needs that position's logits);
        none where it may not (`_looks_up`)."""
        if not self._looks_up(seq):
            return []
        full = (len(seq.tokens) - 1) // self.block_size
        return self.blocks.lookup(self.blocks.names(seq.tokens, seq.block_names, full))

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots while the pool has blocks for what they
        feed first, first come first served (the head waits, and everyone behind it), each
        into the micro-batch with the fewest sequences that has a free slot; returns them."""
        admitted = []
        while self.waiting and self.can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            open_groups = [g for g in range(len(self.groups)) if self.groups[g].free]
            g = min(open_groups, key=lambda g: len(self.groups[g].sequences))
            group = self.groups[g]
            seq.slot, seq.group = heapq.heappop(group.free), g
            seq.status = Status.RUNNING
            seq.admitted = next(self._admissions)
            reused = self._reusable(seq)
            if self._looks_up(seq):
                self.blocks.queries += len(seq.tokens)
                self.blocks.hits += len(reused) * self.block_size
            self.blocks.share(reused)
            seq.blocks, seq.cached = list(reused), len(reused) * self.block_size
            self._take_blocks(seq, len(seq.tokens))
            group.sequences.append(seq)
            admitted.append(seq)
        return admitted

    def _take_blocks(self, seq: Sequence, tokens: int) -> None:
        """Give `seq` blocks through position `tokens` - 1 (the caller checked they are free)."""
        for _ in range(blocks_for(tokens, self.block_size) - len(seq.blocks)):
            seq.blocks.append(self.blocks.take(self.blocks.home(seq.slot, len(seq.blocks))))

    def _blocks_needed(self, seq: Sequence, tokens: int) -> int:
        return max(0, blocks_for(tokens, self.block_size) - len(seq.blocks))

    def _free_blocks_of(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks = []

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's slot and blocks (no step of its micro-batch in flight) and
        put it back at the head of the queue: it feeds its prompt and tokens so far again when
        admitted again."""
        assert not self.groups[seq.group].in_flight, "a sequence preempted under a step in flight"
        self._sent.pop(seq.slot, None)  # its settings go again with its next first step
        self._vacate(seq)
        seq.status = Status.WAITING
        seq.cached = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _make_room(self, g: int, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Give each (sequence, tokens) of a step of micro-batch `g` its blocks through
        position tokens - 1, preempting the youngest running sequences (of micro-batches with no
        step in flight, this step's own included) while the pool is short; returns the rows
        still in the step (empty: it waits for steps in flight to free blocks)."""
        while True:
            need = sum(self._blocks_needed(seq, tokens) for seq, tokens in rows)
            if need <= self.blocks.available:
                for seq, tokens in rows:
                    self._take_blocks(seq, tokens)
                return rows
            live = [s for group in self.groups for s in group.sequences if s.finish is None]
            oldest = min(live, key=lambda s: s.admitted)
            candidates = [
                s
                for i, group in enumerate(self.groups)
                if i == g or not group.in_flight
                for s in group.sequences
                if s.finish is None and s is not oldest
            ]
            if not candidates:  # the oldest is never preempted for a younger one
                if any(group.in_flight for group in self.groups):
                    return []  # their steps end, and free blocks or can be preempted
                raise RuntimeError(
                    f"the KV pool ({self.num_blocks} blocks) cannot hold its one running "
                    f"sequence of {oldest.cached} tokens: it must hold one of max_seq_len"
                )
            victim = max(candidates, key=lambda s: s.admitted)
            self._preempt(victim)
            rows = [(seq, tokens) for seq, tokens in rows if seq is not victim]
            if not rows:
                return rows

    def grow(self, steps: list[Step], count: int) -> int:
        """Blocks for `count` steps of every row of `steps` (a burst: the planned step, then
        decode steps), as many steps as the free blocks allow without preempting (at least the
        one each step has); the blocks taken ride with each step's rows (`StepRows.tables`).
        A burst takes its blocks before it runs, and holds them empty until its steps fill
        them: when the pool is in demand (a sequence waits, or the burst would take more than
        half of the blocks left), it runs only to the end of each row's last block (or through
        one new block, where that is full), so that a row never holds a block it has not begun
        to fill. Returns the steps the burst may run."""
        # each row holds base + n tokens' keys after n steps: its first step feeds what it was
        # planned with (a prompt, or one token), every later one a token
        rows = [
            (seq, seq.cached + fed - 1)
            for step in steps
            for seq, fed in zip(step.sequences, step.rows.counts, strict=True)
        ]
        size = self.block_size
        ahead = sum(self._blocks_needed(s, base + count) for s, base in rows)
        if self.waiting or ahead > self.blocks.available // 2:
            # after the planned step a row holds base + 1 keys: it runs to its last block's
            # end, and where that step fills the block, through one block more
            room = [len(s.blocks) * size - base for s, base in rows]
            count = min([count] + [r if r > 1 else 1 + size for r in room])
        while count > 1:
            need = sum(self._blocks_needed(s, base + count) for s, base in rows)
            if need <= self.blocks.available:
                break
            count -= 1
        for seq, base in rows:
            self._take_blocks(seq, base + count)
        for step in steps:  # the blocks taken ride with the burst's first step
            step.rows = dataclasses.replace(
                step.rows, tables=self._tables(step.sequences, step.rows.table_from)
            )
        return count

    def finish(self, seq: Sequence, reason: Finish) -> None:
        """End `seq` (once: a sequence already ended keeps its first reason). A waiting one
        leaves the queue; a running one frees its slot now, or when the step of its
        micro-batch in flight comes back (`complete`). Its request is done once every one of
        its sequences is (`take_done`)."""
        if seq.finish is not None:
            return
        seq.finish = reason
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            seq.status = Status.FINISHED
        elif seq.status is Status.RUNNING:
            if not self.groups[seq.group].in_flight:
                self._release(seq)
        else:  # never queued (nothing to generate)
            seq.status = Status.FINISHED
        if all(s.finish is not None for s in seq.request.sequences):
            self._done.append(seq.request)

    def finish_request(self, request: Request, reason: Finish) -> None:
        for seq in request.sequences:
            self.finish(seq, reason)

    def fail_request(self, request: Request, error: BaseException) -> None:
        """End `request` with `error` (its first error is kept)."""
        if request.error is None:
            request.error = error
        self.finish_request(request, Finish.ERROR)

    @property
    def has_done(self) -> bool:
        """Whether requests have ended that `take_done` has not handed out yet."""
        return bool(self._done)

    def take_done(self) -> list[Request]:
        """The requests that ended since the last call, each once."""
        done, self._done = self._done, []
        return done

    def _release(self, seq: Sequence) -> None:
        """A running sequence leaves its micro-batch and frees its slot (no step of its
        micro-batch is in flight: the slot goes to the next sequence at once)."""
        assert not self.groups[seq.group].in_flight, "a slot freed under a step in flight"
        self._vacate(seq)
        seq.status = Status.FINISHED

    def _vacate(self, seq: Sequence) -> None:
        """`seq` leaves its micro-batch: its slot and blocks are free."""
        self._held.pop(seq.slot, None)  # the slot's next sequence sends its whole table
        group = self.groups[seq.group]
        group.sequences.remove(seq)
        heapq.heappush(group.free, seq.slot)
        self._free_blocks_of(seq)
        seq.slot = seq.group = None

    def restart(self, num_groups: int, num_blocks: int = 0) -> None:
        """Every running sequence's keys and values are gone (workers replaced or re-planned):
        the ended ones free their slots, the others go back to the head of the queue, in the
        order they were admitted, to feed their prompt and their tokens so far again; the
        micro-batches are re-formed to `num_groups` (the plan may have changed), and the KV
        pool takes `num_blocks` blocks where given (a re-balance resized it). A size the pool
        cannot take is refused before anything moves."""
        resize = bool(num_blocks) and num_blocks != self.num_blocks
        if resize and num_blocks < blocks_for(self.max_seq_len, self.block_size):
            raise ValueError(
                f"a KV pool of {num_blocks} blocks cannot hold one sequence of "
                f"max_seq_len {self.max_seq_len}"
            )
        requeue = []
        for group in self.groups:
            group.in_flight = False
            for seq in list(group.sequences):
                if seq.finish is None:
                    requeue.append(seq)
                    self._vacate(seq)
                    seq.status = Status.WAITING
                    seq.cached = 0
                else:
                    self._release(seq)
        self.blocks.clear()  # the workers hold no keys: no cached prefix is true any more
        if resize:
            self.num_blocks = num_blocks
            self.blocks = BlockPool(
                num_blocks,
                self.block_size,
                num_slots=self.num_slots,
                prefix_caching=self.blocks.prefix_caching,
            )
        self.reform(num_groups)
        requeue.sort(key=lambda seq: seq.admitted)  # across micro-batches: the oldest first
        self.waiting.extendleft(reversed(requeue))
        self._sent.clear()  # the workers are claimed again: they hold no settings
        self._held.clear()  # nor tables

    # steps
    def idle_groups(self) -> list[int]:
        return [g for g, group in enumerate(self.groups) if not group.in_flight and group.sequences]

    def plan(self, g: int) -> Step | None:
        """The next step of micro-batch `g`, or None when it has nothing to run."""
        group = self.groups[g]
        live = [s for s in group.sequences if s.finish is None]
        prefill = [s for s in live if s.pending > 1]
        decode = [s for s in live if s.pending == 1]
        if prefill and (not decode or not group.last_prefill):
            step = self._prefill_step(g, prefill, decode)
        elif decode:
            step = self._decode_step(g, decode)
        else:
            return None
        if step is None:  # the pool is short until steps in flight end
            return None
        # a decode left out of a prefill step goes first next time: prompts never starve it
        group.last_prefill = step.prefill and any(s not in step.sequences for s in decode)
        return step

    def unplan(self, step: Step) -> None:
        """A planned step that was never sent (or failed): its micro-batch may plan again, and
        the settings and tables it carried are sent again (whole) with the next."""
        for slot, _ in step.draw.settings:
            self._sent.pop(slot, None)
        for seq in step.sequences:  # it may have reached some stages and not others
            if seq.slot is not None:
                self._held.pop(seq.slot, None)
        self.complete(step)

    def _prefill_step(self, g: int, candidates: list[Sequence], decode: list[Sequence]) -> Step:
        """Prompt chunks, and the micro-batch's decodes with them while the step's padded
        tokens (rows x width) stay within `prefill_tokens`: requests that arrive a little
        apart (one while another's prompt runs) then share steps instead of taking turns,
        and a decode costs at most `width` padded positions, never a long prompt's."""
        chosen: list[Sequence] = []
        width = 0
        for seq in candidates:
            chunk = seq.pending if self.whole_prompts else min(seq.pending, self.prefill_tokens)
            if self.uniform and chosen and chunk != width:
                continue  # no padding: only chunks as long as the first
            if chosen and (len(chosen) + 1) * max(width, chunk) > self.prefill_tokens:
                break
            chosen.append(seq)
            width = max(width, chunk)
        room = self.prefill_tokens // width - len(chosen)
        if not self.uniform or width == 1:
            chosen += decode[: max(0, room)]
        x = np.zeros((len(chosen), width), dtype=np.int64)
        counts = []
        for r, seq in enumerate(chosen):
            count = min(seq.pending, width)
            x[r, width - count :] = seq.tokens[seq.cached : seq.cached + count]
            counts.append(count)
        samples = [c == s.pending for s, c in zip(chosen, counts, strict=True)]
        return self._step(g, chosen, x, counts, samples, prefill=True)

    def _decode_step(self, g: int, chosen: list[Sequence]) -> Step:
        x = np.array([[s.tokens[-1]] for s in chosen], dtype=np.int64)
        return self._step(g, chosen, x, [1] * len(chosen), [True] * len(chosen), prefill=False)

    def _step(self, g, chosen, x, counts, samples, *, prefill: bool) -> Step | None:
        kept = {
            id(seq)
            for seq, _ in self._make_room(
                g, [(seq, seq.cached + c) for seq, c in zip(chosen, counts, strict=True)]
            )
        }
        if not kept:
            return None  # no blocks now: steps in flight will free some
        # rows in slot order: a micro-batch's slots are one range, so its rows are often
        # consecutive slots, whose recurrent states a worker reads through a view
        order = sorted(
            (r for r in range(len(chosen)) if id(chosen[r]) in kept), key=lambda r: chosen[r].slot
        )
        chosen, x = [chosen[r] for r in order], x[order]
        counts, samples = [counts[r] for r in order], [samples[r] for r in order]
        table_from = tuple(self._held_blocks(s) for s in chosen)
        rows = StepRows(
            slots=tuple(s.slot for s in chosen),
            starts=tuple(s.cached for s in chosen),
            counts=tuple(counts),
            width=x.shape[1],
            num_slots=self.num_slots,
            tables=self._tables(chosen, table_from),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            owner=self.owner,
            table_from=table_from,
            table_ids=tuple(s.admitted for s in chosen),
        )
        # settings travel once per sequence: with its first step (the last stage scores the
        # prompt's chunks as they come when asked)
        new = [s for s in chosen if self._sent.get(s.slot) is not s]
        for seq in new:
            self._sent[seq.slot] = seq
        draw = Draw(tuple(samples), tuple((s.slot, s.settings()) for s in new))
        self.groups[g].in_flight = True
        return Step(group=g, sequences=chosen, rows=rows, x=x, draw=draw, prefill=prefill)

    def _held_blocks(self, seq: Sequence) -> int:
        """How many blocks of `seq`'s table the stages hold for its slot, as its steps sent
        them (0: none, or another sequence's: its next step sends the whole table)."""
        held = self._held.get(seq.slot)
        return held[1] if held is not None and held[0] is seq else 0

    def _tables(self, sequences: list[Sequence], table_from: tuple[int, ...]) -> tuple:
        """What a step carries of each sequence's table (`StepRows.table_from`): its blocks
        after the first `table_from[r]`, which the stages hold; the stages hold them all
        once the step has run (its failure forgets them: `unplan`)."""
        tails = []
        for seq, kept in zip(sequences, table_from, strict=True):
            assert kept <= len(seq.blocks), "the stages hold blocks the sequence gave back"
            tails.append(tuple(seq.blocks[kept:]))
            self._held[seq.slot] = (seq, len(seq.blocks))
        return tuple(tails)

    def update(self, step: Step, index: int, tokens: Chosen | object) -> list[tuple[Sequence, int]]:
        """The tokens of step `index` (0 first; a burst has several) of `step`: each row's
        cache grew by what it fed, its token is added (an ended row's ignored), with its
        log-probabilities and its prompt chunk's when they came (`Chosen`). Returns the
        (sequence, token) pairs added; a sequence that ends here is finished (its slot freed
        when the step completes)."""
        chosen = prompt = failed = {}
        if isinstance(tokens, Chosen):
            chosen, prompt, failed = tokens.chosen, tokens.prompt, tokens.failed
            tokens = tokens.tokens
        added = []
        for r, seq in enumerate(step.sequences):
            fed = step.rows.counts[r] if index == 0 else 1
            if seq.finish is not None:
                continue
            before = seq.cached
            seq.cached += fed
            self._name_full_blocks(seq, before)
            if r in prompt and not seq.generated:  # by position: a restart's again is the same
                seq.prompt_chunks[prompt[r].start] = prompt[r]
            token = int(tokens[r])
            if token == NO_TOKEN:
                continue
            if r in failed:  # that row's request ends with why; the step's others go on
                why = failed[r]
                self.fail_request(seq.request, RowFailedError(f"sequence {seq.row}: {why}"))
                continue
            if r in chosen:
                seq.logprobs.append(chosen[r])
            seq.generated.append(token)
            added.append((seq, token))
            if token in seq.request.eos_token_ids:  # never before min_new_tokens: masked
                self.finish(seq, Finish.STOP)
            elif len(seq.generated) >= seq.request.max_new_tokens:
                self.finish(seq, Finish.LENGTH)
        return added

    def _name_full_blocks(self, seq: Sequence, before: int) -> None:
        """The blocks `seq` filled since it held `before` tokens' keys: a later sequence with
        the same first tokens may share them (prefix caching)."""
        if not self.blocks.prefix_caching:
            return
        size = self.block_size
        first, full = before // size, seq.cached // size
        if full > first:
            names = self.blocks.names(seq.tokens, seq.block_names, full)
            self.blocks.name(seq.blocks[first:full], names[first:full])

    def complete(self, step: Step) -> None:
        """The step is over (or failed): its micro-batch may plan again, the slots and blocks
        of its sequences that ended meanwhile are freed, and so are the blocks the others took
        for steps of a burst that were cut before they ran, or whose tokens were never read
        (they hold only what those steps wrote, never read: the next step writes there
        again). The stages still hold those blocks in the sequence's table: its next step
        tells them to drop them (`StepRows.table_from`)."""
        group = self.groups[step.group]
        group.in_flight = False
        for seq in [s for s in group.sequences if s.finish is not None]:
            self._release(seq)
        for seq in group.sequences:
            keep = blocks_for(len(seq.tokens), self.block_size)
            if len(seq.blocks) > keep:
                self.blocks.release(seq.blocks[keep:])
                del seq.blocks[keep:]
                held = self._held.get(seq.slot)
                if held is not None and held[0] is seq and held[1] > keep:
                    self._held[seq.slot] = (seq, keep)
