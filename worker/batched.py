"""A stage's batched generation step: one forward over every sequence of a micro-batch, each
row at its own positions in its own KV slot (`worker.batch_cache`), and on the last stage the
choice of each row's next token under that row's own settings.

What crosses Ray per step is small and plain: `StepRows` (which slots, where each row's new
tokens start, how many), the activations, and for the last stage a `Draw` (per row: greedy or
sampled, temperature, top-k, top-p; the generator states of the sampling rows). The worker
keeps nothing of a request but its keys and values: generator states go back with the tokens,
so a replaced worker, or a different batch, never changes what a seeded request draws.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from worker.batch_cache import SlotPool, row_positions
from worker.decode import Sampling, next_tokens
from worker.wire import Packed, pack, unpack

NO_TOKEN = -1  # a row that did not choose this step (its prompt goes on in the next chunk)


@dataclass(frozen=True, slots=True)
class StepRows:
    """The rows of one step: row r writes `counts[r]` new tokens into KV slot `slots[r]` from
    position `starts[r]` on; the step's inputs are left-padded to `width`. The pool's size
    rides along, so a worker sizes its pool from the engine that uses it."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    width: int
    num_slots: int
    max_seq_len: int

    def advanced(self) -> StepRows:
        """The next decode step of the same rows: one token each, after what this step wrote."""
        starts = tuple(s + c for s, c in zip(self.starts, self.counts, strict=True))
        return replace(self, starts=starts, counts=(1,) * len(self.slots), width=1)

    def positions(self) -> torch.Tensor:
        """Position ids (rows, width): each real token its place in its sequence, padding 0."""
        return row_positions(torch.tensor(self.starts), torch.tensor(self.counts), self.width)


@dataclass(frozen=True, slots=True)
class Draw:
    """How each row of a step chooses its next token on the last stage (None: it does not
    choose in this step), and the generator states (uint8, rows that sample x state bytes) of
    the rows whose Sampling samples, in row order."""

    samplings: tuple[Sampling | None, ...]
    states: Packed | torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Drawn:
    """The last stage's answer: each row's token (NO_TOKEN where it did not choose) and the
    sampling rows' generator states after drawing (as in `Draw`)."""

    tokens: Packed | torch.Tensor
    states: Packed | torch.Tensor | None = None


def choose_rows(logits: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's next token from its last position's logits (rows, vocab): argmax for greedy
    rows (all at once), a draw from the row's own generator for sampling rows (a row's draw
    depends on its logits and its generator only, never on the other rows)."""
    rows = logits.shape[0]
    tokens = torch.full((rows,), NO_TOKEN, dtype=torch.long)
    greedy = [r for r, s in enumerate(draw.samplings) if s is not None and not s.do_sample]
    if greedy:
        chosen = torch.argmax(logits[greedy].to(torch.float32), dim=-1)
        tokens[greedy] = chosen.cpu()
    sampling = [r for r, s in enumerate(draw.samplings) if s is not None and s.do_sample]
    if not sampling:
        return tokens, None
    states = unpack(draw.states)
    if states is None or states.shape[0] != len(sampling):
        raise ValueError(
            f"{len(sampling)} sampling row(s) need as many generator states, got "
            f"{None if states is None else states.shape[0]}"
        )
    after = []
    for state, r in zip(states, sampling, strict=True):
        generator = torch.Generator()
        generator.set_state(state.clone())
        tokens[r] = next_tokens(logits[r : r + 1, None].cpu(), None, draw.samplings[r], generator)[
            0
        ]
        after.append(generator.get_state())
    return tokens, torch.stack(after)


class BatchRunner:
    """A stage's batched steps and the slot pool they write (created at the first step, sized
    by it, and kept until the stage changes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: SlotPool | None = None
        self.last_rows = 0  # sequences in the last step, for reports
        self.last_step_s = 0.0  # this stage's own time in its last step (not the others')

    def reset(self) -> None:
        """Forget every sequence's keys and values (the stage's layers changed)."""
        self.pool, self.last_rows = None, 0

    def nbytes(self) -> int:
        return self.pool.nbytes() if self.pool is not None else 0

    def step(
        self, stage, rows: StepRows, x: torch.Tensor, draw: Draw | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states (rows, width, hidden) from a stage before the last; from the last,
        each row's chosen token and the sampling rows' generator states."""
        view = None
        held = stage.decoder_indices
        if held:
            pool = self.pool
            if pool is None or (pool.num_slots, pool.max_seq_len) != (
                rows.num_slots,
                rows.max_seq_len,
            ):
                pool = self.pool = SlotPool(
                    held, num_slots=rows.num_slots, max_seq_len=rows.max_seq_len, device=self.device
                )
            view = pool.view(list(rows.slots), list(rows.starts), list(rows.counts), rows.width)
        if x.shape[:2] != (len(rows.slots), rows.width):
            raise ValueError(
                f"step input of shape {tuple(x.shape)} does not match "
                f"{len(rows.slots)} rows of width {rows.width}"
            )
        self.last_rows = len(rows.slots)
        start = time.perf_counter()
        try:
            return self._forward(stage, rows, x, view, draw)
        finally:
            self.last_step_s = time.perf_counter() - start

    def _forward(self, stage, rows: StepRows, x: torch.Tensor, view, draw: Draw | None):
        # inference_mode: no version counters or view tracking on activations and caches
        with torch.inference_mode():
            out = stage(
                x.to(self.device),
                position_ids=rows.positions().to(self.device),
                logits_to_keep=1 if stage.is_last else 0,
                cache=view,
            )
            if not stage.is_last:
                return out.cpu()
            if draw is None or len(draw.samplings) != len(rows.slots):
                raise ValueError("the last stage needs a Draw with one entry per row")
            return choose_rows(out[:, -1], draw)

    def ring(
        self,
        stage,
        batches: Sequence[tuple[StepRows, torch.Tensor, Draw]],
        count: int,
        downstream: Sequence = (),
        timeout_s: float = 300.0,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """Up to `count` decode steps of each micro-batch of `batches` (rows, input, draw), run
        from this stage, the first. A step of micro-batch m goes through this stage, then on
        through `downstream` (the later stages in order: Ray actor handles, or in-process
        workers), actor to actor; its last stage's tokens come straight back here as m's next
        input: no round trip to the driver per token. The micro-batches take turns here, so
        while the later stages work on m this stage computes m + 1: with as many micro-batches
        as stages, every stage is busy. Yields (m, tokens, states) per micro-batch step, in
        order. One micro-batch and no downstream: a one-stage job's decode steps. Every row
        must choose at every step (decode rows).

        Left early (the driver cut it at a yield), the steps already sent on are waited for:
        every write this call makes is done before the stage takes its next call, and the
        later stages' next calls depend on that one."""
        if any(s is None for _, _, draw in batches for s in draw.samplings):
            raise ValueError("steps run together need every row to choose a token")
        rows = [r for r, _, _ in batches]
        xs = [x for _, x, _ in batches]
        draws = [d for _, _, d in batches]
        pending: list = [None] * len(batches)
        try:
            for step in range(count + 1):
                for m in range(len(batches)):
                    if step:
                        tokens, states = _collect(pending[m], timeout_s)
                        pending[m] = None
                        yield m, tokens, states
                        rows[m], xs[m] = rows[m].advanced(), tokens[:, None]
                        draws[m] = Draw(draws[m].samplings, states)
                    if step < count:
                        pending[m] = self._send(stage, rows[m], xs[m], draws[m], downstream)
        finally:
            for sent in pending:
                if sent is not None:
                    with contextlib.suppress(Exception):  # only waited for: never read
                        _collect(sent, timeout_s)

    def _send(self, stage, rows: StepRows, x: torch.Tensor, draw: Draw, downstream: Sequence):
        """This stage's part of a step, sent on through `downstream`: an object ref of the
        last stage's answer, or (in process, or with no downstream) the answer itself."""
        if not downstream:
            return self.step(stage, rows, x, draw)
        out: object = pack(self.step(stage, rows, x, None))
        wire_draw = Draw(
            draw.samplings, pack(unpack(draw.states)) if draw.states is not None else None
        )
        for i, worker in enumerate(downstream):
            last_draw = wire_draw if i == len(downstream) - 1 else None
            call = getattr(worker.batch_step, "remote", None)
            out = (
                call(rows, out, last_draw)
                if call is not None
                else worker.batch_step(rows, out, last_draw)
            )
        return out


def _collect(sent, timeout_s: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens and states from what `_send` returned."""
    if isinstance(sent, tuple):
        return sent
    if not isinstance(sent, Drawn):  # an object ref from an actor
        import ray  # only here: a worker driven in-process never needs Ray

        sent = ray.get(sent, timeout=timeout_s)
    return unpack(sent.tokens), unpack(sent.states)


def packed(result) -> Packed | Drawn:
    """A step's result as it crosses Ray."""
    if isinstance(result, torch.Tensor):
        return pack(result)
    tokens, states = result
    return Drawn(pack(tokens), pack(states))
