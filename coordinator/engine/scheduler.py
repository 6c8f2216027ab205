"""Which sequences run in the next step, and in which KV slots: the engine's bookkeeping,
without Ray and without threads (the engine calls it from its one loop).

Sequences wait in one FIFO queue (bounded: `max_queue`) and take a KV slot as one frees (at
most `num_slots` run at once, the plan's max_batch). Running sequences are split over
`num_groups` micro-batches (one per pipeline stage, so that every stage has one to work on);
each micro-batch alternates two kinds of step when it has both to do:

- a **decode** step: every sequence of the micro-batch that has one token to feed (its last
  one chosen) feeds it, so each offloaded layer is brought in once for all of them;
- a **prefill** step: sequences whose prompt is not in the cache yet feed a chunk of it, at most
  `prefill_tokens` tokens in all (rows x width, the rows left-padded to the widest), in
  admission order; a long prompt takes several, and the decodes of the others go on between
  them, so a new prompt delays them by one chunk at most.
A sequence whose chunk ends its prompt chooses its first token in the same step.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import torch

from coordinator.engine.sequences import Finish, Sequence
from worker.batched import NO_TOKEN, Draw, StepRows


@dataclass(eq=False)
class Step:
    """One planned step of micro-batch `group`: its sequences (row order), what the workers
    get, and how many decode steps it may run on the worker (one-stage jobs)."""

    group: int
    sequences: list[Sequence]
    rows: StepRows
    x: torch.Tensor
    draw: Draw
    prefill: bool
    count: int = 1


@dataclass
class _Group:
    sequences: list[Sequence] = field(default_factory=list)
    in_flight: bool = False
    last_prefill: bool = False


class Scheduler:
    def __init__(
        self,
        *,
        num_slots: int,
        max_seq_len: int,
        num_groups: int,
        max_queue: int,
        prefill_tokens: int,
    ) -> None:
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.max_queue, self.prefill_tokens = max_queue, prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.free_slots = list(range(num_slots))  # a heap: the lowest free slot goes first
        self.groups = [_Group() for _ in range(max(1, min(num_groups, num_slots)))]

    # queues
    @property
    def running(self) -> list[Sequence]:
        return [s for g in self.groups for s in g.sequences]

    def room(self) -> int:
        """Sequences the queue can still take."""
        return self.max_queue - len(self.waiting)

    def enqueue(self, sequences: list[Sequence]) -> None:
        self.waiting.extend(sequences)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, first come first served; returns them."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            if seq.finish is not None:  # cancelled while waiting
                continue
            seq.slot = seq.slot_used = heapq.heappop(self.free_slots)
            seq.group = min(range(len(self.groups)), key=lambda g: len(self.groups[g].sequences))
            self.groups[seq.group].sequences.append(seq)
            admitted.append(seq)
        return admitted

    def drop_waiting(self, seq: Sequence) -> None:
        """A waiting sequence leaves the queue (its request was cancelled or failed)."""
        if seq in self.waiting:
            self.waiting.remove(seq)

    def release(self, seq: Sequence) -> None:
        """A running sequence leaves its micro-batch and frees its slot (no step of its
        micro-batch may be in flight: the slot goes to the next sequence at once)."""
        group = self.groups[seq.group]
        assert not group.in_flight, "a slot freed under a step in flight"
        group.sequences.remove(seq)
        heapq.heappush(self.free_slots, seq.slot)
        seq.slot = seq.group = None

    def reset_caches(self) -> None:
        """Every running sequence's keys and values are gone (workers replaced): each feeds
        its prompt and its tokens so far again, as a prefill."""
        for seq in self.running:
            seq.cached = 0
        for group in self.groups:
            group.in_flight = False

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
            step = self._prefill_step(g, prefill)
        elif decode:
            step = self._decode_step(g, decode)
        else:
            return None
        group.last_prefill = step.prefill
        return step

    def _prefill_step(self, g: int, candidates: list[Sequence]) -> Step:
        chosen: list[Sequence] = []
        width = 0
        for seq in candidates:
            chunk = min(seq.pending, self.prefill_tokens)
            if chosen and (len(chosen) + 1) * max(width, chunk) > self.prefill_tokens:
                break
            chosen.append(seq)
            width = max(width, chunk)
        x = torch.zeros((len(chosen), width), dtype=torch.long)
        counts = []
        for r, seq in enumerate(chosen):
            count = min(seq.pending, width)
            x[r, width - count :] = torch.tensor(seq.tokens[seq.cached : seq.cached + count])
            counts.append(count)
        samples = [c == s.pending for s, c in zip(chosen, counts, strict=True)]
        return self._step(g, chosen, x, counts, samples, prefill=True)

    def _decode_step(self, g: int, chosen: list[Sequence]) -> Step:
        x = torch.tensor([[s.tokens[-1]] for s in chosen], dtype=torch.long)
        return self._step(g, chosen, x, [1] * len(chosen), [True] * len(chosen), prefill=False)

    def _step(self, g, chosen, x, counts, samples, *, prefill: bool) -> Step:
        # rows in slot order: with the lowest free slot handed out first they are often
        # consecutive, and a worker then reads its stores through a view (worker.batch_cache)
        order = sorted(range(len(chosen)), key=lambda r: chosen[r].slot)
        chosen, x = [chosen[r] for r in order], x[order]
        counts, samples = [counts[r] for r in order], [samples[r] for r in order]
        rows = StepRows(
            slots=tuple(s.slot for s in chosen),
            starts=tuple(s.cached for s in chosen),
            counts=tuple(counts),
            width=x.shape[1],
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
        )
        samplings = tuple(
            s.sampling if take else None for s, take in zip(chosen, samples, strict=True)
        )
        states = [
            s.state for s, m in zip(chosen, samplings, strict=True) if m is not None and m.do_sample
        ]
        draw = Draw(samplings, torch.stack(states) if states else None)
        self.groups[g].in_flight = True
        return Step(group=g, sequences=chosen, rows=rows, x=x, draw=draw, prefill=prefill)

    def apply(
        self, step: Step, index: int, tokens: torch.Tensor, states: torch.Tensor | None
    ) -> list[tuple[Sequence, int]]:
        """The tokens of step `index` (0 first; a burst has several) of `step`: each row's
        cache grew by what it fed, its token is added (a finished row's ignored). Returns the
        (sequence, token) pairs added; a sequence that ends is marked, and keeps its slot until
        `complete`."""
        added = []
        sampled = iter(states) if states is not None else iter(())
        for r, seq in enumerate(step.sequences):
            state = next(sampled) if seq.sampling.do_sample and step.draw.samplings[r] else None
            fed = step.rows.counts[r] if index == 0 else 1
            if seq.finish is not None:
                continue
            seq.cached += fed
            token = int(tokens[r])
            if token == NO_TOKEN:
                continue
            seq.generated.append(token)
            if state is not None:
                seq.state = state
            added.append((seq, token))
            if token in seq.request.eos_token_ids:
                seq.finish = Finish.STOP
            elif len(seq.generated) >= seq.request.max_new_tokens:
                seq.finish = Finish.LENGTH
        return added

    def complete(self, step: Step) -> list[Sequence]:
        """The step is over: its micro-batch may plan again; the slots of the sequences that
        ended are freed. Returns those sequences."""
        self.groups[step.group].in_flight = False
        ended = [s for s in step.sequences if s.finish is not None and s.slot is not None]
        for seq in ended:
            self.release(seq)
        return ended
