"""A stage's batched generation step: one forward over every sequence of a micro-batch, each
row at its own positions in its own KV slot (`worker.batch_cache`), and on the last stage the
choice of each row's next token under that row's own settings.

What crosses Ray per step is small and plain: `StepRows` (which slots, where each row's new
tokens start, how many, and the engine and epoch the step belongs to), the activations, and
for the last stage a `Draw` (per row: greedy or sampled, temperature, top-k, top-p, and a
seed); back come the tokens. The worker keeps nothing of a request but its keys and values: a
sampled token is keyed by the row's seed and its position, so a replaced worker, or a different
batch, never changes what a seeded request draws.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from offload.errors import LaunchError
from worker.batch_cache import SlotPool, row_positions
from worker.decode import RowSettings, Sampling, sample_rows
from worker.wire import Packed, pack, unpack

NO_TOKEN = -1  # a row that did not choose this step (its prompt goes on in the next chunk)
Owner = tuple[str, int]  # (engine id, epoch of its claim)


class NotOwnerError(LaunchError):
    """A step from an engine that does not own this worker's KV pool now, or from an older
    epoch of the one that does: refused, never run (it would read keys it did not write).
    `other_engine` tells which: another engine claimed the pool (a second writer, refused for
    good), or nobody holds it since the worker changed (its engine claims it again)."""

    other_engine = False


class ClaimedByAnotherError(NotOwnerError):
    other_engine = True


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
    owner: Owner = ("", 0)

    def advanced(self) -> StepRows:
        """The next decode step of the same rows: one token each, after what this step wrote."""
        starts = tuple(s + c for s, c in zip(self.starts, self.counts, strict=True))
        return replace(self, starts=starts, counts=(1,) * len(self.slots), width=1)

    def positions(self) -> torch.Tensor:
        """Position ids (rows, width): each real token its place in its sequence, padding 0."""
        return row_positions(torch.tensor(self.starts), torch.tensor(self.counts), self.width)


@dataclass(frozen=True, slots=True)
class Draw:
    """Which rows of a step choose their next token on the last stage (a prompt chunk that
    does not end its prompt chooses nothing), and the settings (greedy or sampled,
    temperature, top-k, top-p, seed) of the slots whose sequence chooses there for the first
    time: the last stage keeps each slot's settings from then on (`BatchRunner`), so a step
    sends them once per sequence, not once per step. A sampled row's draw is keyed by its seed
    and the position of the token it chooses (`worker.decode.uniform`): a row draws the same
    token whatever else is in the batch, whichever worker runs it."""

    choose: tuple[bool, ...]
    settings: tuple[tuple[int, Sampling, int | None], ...] = ()  # (slot, sampling, seed)


def choose_rows(
    logits: torch.Tensor, rows: StepRows, choose: Sequence[bool], settings: dict
) -> torch.Tensor:
    """Each row's next token (CPU, NO_TOKEN where the row does not choose) from its last
    position's logits (rows, vocab), each with its slot's `settings` (slot -> (Sampling,
    seed)): greedy and sampled rows at once on the logits' device
    (`worker.decode.sample_rows`), only the tokens copied back."""
    tokens = torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long)
    choosing = [r for r, take in enumerate(choose) if take]
    if not choosing:
        return tokens
    try:
        chosen_settings = [settings[rows.slots[r]] for r in choosing]
    except KeyError as exc:
        raise ValueError(
            f"slot {exc.args[0]} chooses a token but its settings never reached this stage"
        ) from None
    row_settings = RowSettings.of(
        [sampling for sampling, _ in chosen_settings],
        [seed for _, seed in chosen_settings],
        [rows.starts[r] + rows.counts[r] for r in choosing],  # the index of the token chosen
    )
    every = len(choosing) == logits.shape[0]
    chosen = sample_rows(logits if every else logits[choosing], row_settings)
    if every:
        return chosen
    tokens[choosing] = chosen
    return tokens


class BatchRunner:
    """A stage's batched steps and the slot pool they write (created at the first step, sized
    by it, and kept until the stage changes), owned by one engine at a time (`claim`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: SlotPool | None = None
        self.owner: Owner | None = None  # who may step this pool now
        # the last stage: each slot's (Sampling, seed), as its owner sent them (Draw.settings)
        self.slot_settings: dict[int, tuple[Sampling, int | None]] = {}
        self.last_rows = 0  # sequences in the last step, for reports
        self.last_step_s = 0.0  # this stage's own time in its last step (not the others')

    def reset(self) -> None:
        """Forget every sequence's keys and values (the stage's layers changed): nobody owns
        the pool until an engine claims it again."""
        self.pool, self.owner, self.last_rows = None, None, 0
        self.slot_settings.clear()

    def claim(self, owner: Owner, *, take: bool = False) -> None:
        """Make `owner` the one engine (and epoch) whose steps this pool runs. An engine
        re-claims under a new epoch after the workers changed; `take` lets a new engine take
        the pool from another (a load's engine replaced), which is refused otherwise."""
        if self.owner is not None and self.owner[0] != owner[0] and not take:
            raise ClaimedByAnotherError(
                f"engine {owner[0]} cannot claim this stage: engine {self.owner[0]} owns its KV "
                "pool (one engine per load: submit through it, e.g. attach(name))"
            )
        if owner != self.owner:  # a new claim sends every sequence's settings again
            self.slot_settings.clear()
        self.owner = owner

    def release(self, owner: Owner) -> None:
        """`owner` closes: nobody owns the pool (a later engine may claim it). Another
        engine's release changes nothing."""
        if self.owner is not None and self.owner[0] == owner[0]:
            self.owner = None

    def check_owner(self, rows: StepRows) -> None:
        """Refuse a step of anyone but the pool's owner now."""
        if rows.owner == self.owner:
            return
        if self.owner is None:
            raise NotOwnerError(
                f"a step of engine {rows.owner[0]} (epoch {rows.owner[1]}) reached a stage whose "
                "KV pool no engine holds (the worker was replaced or re-planned): claim it again"
            )
        if rows.owner[0] == self.owner[0]:
            raise NotOwnerError(
                f"a step of epoch {rows.owner[1]} of engine {rows.owner[0]} reached a stage "
                f"claimed under epoch {self.owner[1]}: the step is stale (the workers changed)"
            )
        raise ClaimedByAnotherError(
            f"a step of engine {rows.owner[0]} reached a stage whose KV pool engine "
            f"{self.owner[0]} owns: refused (two engines must never write one pool; every "
            "client of a load submits through the load's engine)"
        )

    def nbytes(self) -> int:
        return self.pool.nbytes() if self.pool is not None else 0

    def allocate(self, stage, *, num_slots: int, max_seq_len: int, hidden_size: int, dtype) -> None:
        """Allocate the slot pool now (at load, inside the budget check, not at the first
        request): one step of one token in slot 0 through the stage, so each layer's stores
        take the shapes its own attention gives. What it writes is never read: a row sees only
        the positions it wrote itself."""
        if not stage.decoder_indices:
            return
        self.pool = SlotPool(
            stage.decoder_indices, num_slots=num_slots, max_seq_len=max_seq_len, device=self.device
        )
        if stage.is_first:
            x = torch.zeros((1, 1), dtype=torch.long)
        else:
            x = torch.zeros((1, 1, hidden_size), dtype=dtype)
        with torch.inference_mode():
            stage(
                x.to(self.device),
                position_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
                logits_to_keep=1 if stage.is_last else 0,
                cache=self.pool.view([0], [0], [1], 1),
            )

    def step(self, stage, rows: StepRows, x: torch.Tensor, draw: Draw | None) -> torch.Tensor:
        """Hidden states (rows, width, hidden) from a stage before the last; from the last,
        each row's chosen token (rows,), or without a `draw` the last position's logits
        (rows, vocab)."""
        self.check_owner(rows)
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
            if draw is None:  # the last position's logits (rows, vocab): the family check's
                return out[:, -1].cpu()
            if len(draw.choose) != len(rows.slots):
                raise ValueError("the last stage needs a Draw with one entry per row")
            for slot, sampling, seed in draw.settings:  # sequences new to their slots
                self.slot_settings[slot] = (sampling, seed)
            return choose_rows(out[:, -1], rows, draw.choose, self.slot_settings)

    def ring(
        self,
        stage,
        batches: Sequence[tuple[StepRows, torch.Tensor, Draw]],
        count: int,
        downstream: Sequence = (),
        timeout_s: float = 300.0,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Up to `count` decode steps of each micro-batch of `batches` (rows, input, draw), run
        from this stage, the first. A step of micro-batch m goes through this stage, then on
        through `downstream` (the later stages in order: Ray actor handles, or in-process
        workers), actor to actor; its last stage's tokens come straight back here as m's next
        input: no round trip to the driver per token. The micro-batches take turns here, so
        while the later stages work on m this stage computes m + 1: with as many micro-batches
        as stages, every stage is busy. Yields (m, tokens) per micro-batch step, in
        order. One micro-batch and no downstream: a one-stage job's decode steps. Every row
        must choose at every step (decode rows).

        Left early (the driver cut it at a yield), the steps already sent on are waited for:
        every write this call makes is done before the stage takes its next call, and the
        later stages' next calls depend on that one."""
        for rows, _, _ in batches:  # refused before any step runs
            self.check_owner(rows)
        if not all(take for _, _, draw in batches for take in draw.choose):
            raise ValueError("steps run together need every row to choose a token")
        rows = [r for r, _, _ in batches]
        xs = [x for _, x, _ in batches]
        draws = [d for _, _, d in batches]
        pending: list = [None] * len(batches)
        try:
            for step in range(count + 1):
                for m in range(len(batches)):
                    if step:
                        tokens = _collect(pending[m], timeout_s)
                        pending[m] = None
                        yield m, tokens
                        rows[m], xs[m] = rows[m].advanced(), tokens[:, None]
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
        return send_through(downstream, rows, self.step(stage, rows, x, None), draw)


def send_through(workers: Sequence, rows: StepRows, x, draw: Draw | None):
    """One step through `workers` in order (Ray actor handles, or in-process `StageWorker`s),
    each stage's `batch_step` given the previous one's output, the last one `draw`: the one
    way a step runs through stages (the engine's pipelines, a burst's ring). Tensors are
    packed (`worker.wire`) only where they cross Ray. Returns the last stage's answer: an
    object ref through Ray (the activations went actor to actor), or the tokens in process."""
    out = x
    for i, worker in enumerate(workers):
        last_draw = draw if i == len(workers) - 1 else None
        call = getattr(worker.batch_step, "remote", None)
        if call is None:
            out = worker.batch_step(rows, out, last_draw, wire=False)
        else:
            out = call(rows, pack(out) if isinstance(out, torch.Tensor) else out, last_draw)
    return out


def _collect(sent, timeout_s: float) -> torch.Tensor:
    """The tokens `_send` returned: a tensor, packed, or an object ref of an actor's answer."""
    if not isinstance(sent, torch.Tensor | Packed):
        import ray  # only here: a worker driven in-process never needs Ray

        sent = ray.get(sent, timeout=timeout_s)
    return unpack(sent)
