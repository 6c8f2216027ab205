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
from worker.batch_cache import (
    DEFAULT_BLOCK_SIZE,
    KvPool,
    blocks_for,
    contiguous_tables,
    row_positions,
)
from worker.decode import Logprobs, RowSettings, Sampling, logprobs_of, sample_rows
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
    """The rows of one step: row r (the sequence in slot `slots[r]`) writes `counts[r]` new
    tokens from position `starts[r]` on into the blocks of its table `tables[r]` (the blocks of
    its positions 0.., in order: at least through the step's last position, a burst's too); the
    step's inputs are left-padded to `width`. The pool's shape rides along, so a worker sizes
    its pool from the engine that uses it."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    width: int
    num_slots: int
    tables: tuple[tuple[int, ...], ...]
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    owner: Owner = ("", 0)

    @classmethod
    def in_slots(
        cls,
        slots: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        width: int,
        *,
        num_slots: int,
        max_seq_len: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        owner: Owner = ("", 0),
    ) -> StepRows:
        """Rows of callers that keep one sequence per slot and no block bookkeeping (a probe,
        the family check, tests): slot s's sequence in its own run of blocks for
        `max_seq_len` positions (`contiguous_tables`)."""
        return cls(
            slots=tuple(slots),
            starts=tuple(starts),
            counts=tuple(counts),
            width=width,
            num_slots=num_slots,
            tables=contiguous_tables(slots, max_seq_len, block_size),
            num_blocks=num_slots * blocks_for(max_seq_len, block_size),
            block_size=block_size,
            owner=owner,
        )

    def advanced(self) -> StepRows:
        """The next decode step of the same rows: one token each, after what this step wrote."""
        starts = tuple(s + c for s, c in zip(self.starts, self.counts, strict=True))
        return replace(self, starts=starts, counts=(1,) * len(self.slots), width=1)

    def positions(self) -> torch.Tensor:
        """Position ids (rows, width): each real token its place in its sequence, padding 0."""
        return row_positions(torch.tensor(self.starts), torch.tensor(self.counts), self.width)


@dataclass(frozen=True, slots=True)
class SlotSettings:
    """How the sequence in a slot chooses its tokens, and what the last stage returns beside
    them: sent once per sequence, with its first step (`Draw`), kept by the last stage.

    `end_ids` cannot be chosen before the sequence has `min_tokens` new tokens (vLLM's
    min_tokens, transformers' min_new_tokens: their logits are -inf until then), counted from
    `prompt_length`. `logprobs`: with every chosen token, its log-probability and those of the
    `logprobs` most likely tokens (None: nothing). `prompt_logprobs`: the same for every
    prompt position after the first (`prompt_ids`, which the last stage otherwise never
    sees) as the prompt goes through."""

    sampling: Sampling
    seed: int | None = None
    end_ids: tuple[int, ...] = ()
    prompt_length: int = 0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be None or >= 0, got {value}")
        if self.prompt_logprobs is not None and len(self.prompt_ids) != self.prompt_length:
            raise ValueError(
                f"prompt_logprobs needs the {self.prompt_length} prompt ids, got "
                f"{len(self.prompt_ids)}"
            )

    def plain(self, position: int) -> bool:
        """Its token at `position` is the argmax of the logits, with nothing else to return:
        greedy, no token banned there, no log-probabilities."""
        return not self.sampling.do_sample and self.logprobs is None and not self.banned(position)

    def banned(self, position: int) -> tuple[int, ...]:
        """The tokens this sequence may not choose at `position` (its end tokens while it has
        fewer than min_tokens new ones)."""
        if position < self.prompt_length + self.min_tokens:
            return self.end_ids
        return ()


@dataclass(frozen=True, slots=True)
class Draw:
    """Which rows of a step choose their next token on the last stage (a prompt chunk that
    does not end its prompt chooses nothing), and the settings (`SlotSettings`) of the slots
    whose sequence is new there: the last stage keeps each slot's settings from then on
    (`BatchRunner`), so a step sends them once per sequence, not once per step. A sampled
    row's draw is keyed by its seed and the position of the token it chooses
    (`worker.decode.uniform`): a row draws the same token whatever else is in the batch,
    whichever worker runs it."""

    choose: tuple[bool, ...]
    settings: tuple[tuple[int, SlotSettings], ...] = ()  # (slot, its sequence's settings)


@dataclass(frozen=True, slots=True)
class Chosen:
    """What the last stage returns when a row of the step asked for log-probabilities: the
    tokens (as without), and per row (index in the step) the `Logprobs` of its chosen token
    (`chosen`) and of the prompt positions its chunk fed (`prompt`)."""

    tokens: object  # torch.Tensor (rows,), or packed for Ray (`worker.wire`)
    chosen: dict[int, Logprobs]
    prompt: dict[int, Logprobs]

    def packed(self) -> Chosen:
        return Chosen(pack(self.tokens), self.chosen, self.prompt)

    def unpacked(self) -> Chosen:
        return Chosen(unpack(self.tokens), self.chosen, self.prompt)


def token_ids(out) -> torch.Tensor:
    """The tokens (rows,) of a last stage's answer (a tensor, or `Chosen`; packed or not)."""
    return unpack(out.tokens if isinstance(out, Chosen) else out)


def pack_out(out):
    """A last stage's answer as it crosses Ray."""
    return out.packed() if isinstance(out, Chosen) else pack(out)


def unpack_out(out):
    """A last stage's answer from Ray: a tensor, or `Chosen` with its tokens a tensor."""
    return out.unpacked() if isinstance(out, Chosen) else unpack(out)


def choose_rows(
    logits: torch.Tensor, rows: StepRows, choose: Sequence[bool], settings: dict
) -> torch.Tensor | Chosen:
    """Each row's next token (CPU, NO_TOKEN where the row does not choose) from its last
    position's logits (rows, vocab), each with its slot's `settings` (slot -> SlotSettings):
    greedy and sampled rows at once on the logits' device (`worker.decode.sample_rows`), a
    row's end tokens masked before its min_tokens, only the tokens copied back; with the
    log-probabilities of the rows that ask for them (`Chosen`), computed for those rows only."""
    choosing = [r for r, take in enumerate(choose) if take]
    if not choosing:
        return torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long)
    try:
        chosen_settings = [settings[rows.slots[r]] for r in choosing]
    except KeyError as exc:
        raise ValueError(
            f"slot {exc.args[0]} chooses a token but its settings never reached this stage"
        ) from None
    positions = [rows.starts[r] + rows.counts[r] for r in choosing]  # of the tokens chosen
    every = len(choosing) == logits.shape[0]
    if every and all(s.plain(p) for s, p in zip(chosen_settings, positions, strict=True)):
        return torch.argmax(logits.to(torch.float32), dim=-1).cpu()  # sample_rows' greedy rows
    row_settings = RowSettings.of(
        [s.sampling for s in chosen_settings],
        [s.seed for s in chosen_settings],
        positions,
        [s.banned(p) for s, p in zip(chosen_settings, positions, strict=True)],
    )
    picked = logits if every else logits[choosing]
    chosen = sample_rows(picked, row_settings)
    if every:
        tokens = chosen
    else:
        tokens = torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long)
        tokens[choosing] = chosen
    asking = [i for i, s in enumerate(chosen_settings) if s.logprobs is not None]
    if not asking:
        return tokens
    values, top_ids, top_values = logprobs_of(
        picked[asking], chosen[asking], [chosen_settings[i].logprobs for i in asking]
    )
    return Chosen(
        tokens,
        {
            choosing[i]: Logprobs(
                start=positions[i],
                token_ids=(int(chosen[i]),),
                logprobs=(values[j],),
                top_ids=(top_ids[j],),
                top_logprobs=(top_values[j],),
            )
            for j, i in enumerate(asking)
        },
        {},
    )


def prompt_logprobs(
    logits: torch.Tensor, rows: StepRows, settings: dict, tails: dict
) -> dict[int, Logprobs]:
    """The `Logprobs` of the prompt positions each row of a step fed, for the rows whose slot
    asks for them (`SlotSettings.prompt_logprobs`), from the step's logits (rows, width,
    vocab; rows left-padded): the token at position q is scored by the logits of position
    q - 1, which for the first token of a chunk are the last of the chunk before, kept per
    slot in `tails` (slot -> logits (vocab,)) between the two steps. Position 0 has no score
    (nothing comes before it). All asking rows' positions in one log-softmax."""
    pieces, targets, tops, spans = [], [], [], {}
    for r, slot in enumerate(rows.slots):
        s = settings.get(slot)
        if s is None or s.prompt_logprobs is None:
            continue
        start, count, width = rows.starts[r], rows.counts[r], rows.width
        end = min(start + count, s.prompt_length)  # prompt positions this chunk fed
        first = max(start, 1)
        if first < end:
            c0 = width - count  # the column of position `start`
            # the logits of positions first - 1 .. end - 2: in this chunk from `start` on
            columns = logits[r, c0 : c0 + end - 1 - start]
            if first == start:  # position start - 1: the last of the previous chunk
                tail = tails.get(slot)
                if tail is None:
                    raise ValueError(f"slot {slot}: the prompt's previous chunk left no logits")
                columns = torch.cat([tail[None].to(columns.dtype), columns])
            spans[r] = (first, end - first)
            pieces.append(columns)
            targets.extend(s.prompt_ids[first:end])
            tops.extend([s.prompt_logprobs] * (end - first))
        if start + count < s.prompt_length:
            tails[slot] = logits[r, -1].clone()  # scores the next chunk's first token
        else:
            tails.pop(slot, None)
    if not pieces:
        return {}
    values, top_ids, top_values = logprobs_of(
        torch.cat(pieces), torch.tensor(targets, dtype=torch.long), tops
    )
    out, offset = {}, 0
    for r, (first, n) in spans.items():
        out[r] = Logprobs(
            start=first,
            token_ids=tuple(settings[rows.slots[r]].prompt_ids[first : first + n]),
            logprobs=tuple(values[offset : offset + n]),
            top_ids=tuple(top_ids[offset : offset + n]),
            top_logprobs=tuple(top_values[offset : offset + n]),
        )
        offset += n
    return out


class BatchRunner:
    """A stage's batched steps and the KV pool they write (created at the first step, sized
    by it, and kept until the stage changes), owned by one engine at a time (`claim`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: KvPool | None = None
        self.owner: Owner | None = None  # who may step this pool now
        # the last stage: each slot's settings, as its owner sent them (Draw.settings), and the
        # last logits of a prompt chunk whose next chunk's first token is to be scored
        self.slot_settings: dict[int, SlotSettings] = {}
        self.prompt_tails: dict[int, torch.Tensor] = {}
        self.last_rows = 0  # sequences in the last step, for reports
        self.last_step_s = 0.0  # this stage's own time in its last step (not the others')

    def reset(self) -> None:
        """Forget every sequence's keys and values (the stage's layers changed): nobody owns
        the pool until an engine claims it again."""
        self.pool, self.owner, self.last_rows = None, None, 0
        self.slot_settings.clear()
        self.prompt_tails.clear()

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
            self.prompt_tails.clear()
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

    def allocate(
        self, stage, *, num_blocks: int, block_size: int, num_slots: int, hidden_size: int, dtype
    ) -> None:
        """Allocate the KV pool now (at load, inside the budget check, not at the first
        request): one step of one token in slot 0 and block 0 through the stage, so each
        layer's stores take the shapes its own attention gives. What it writes is never read:
        a row sees only the positions it wrote itself."""
        if not stage.decoder_indices:
            return
        self.pool = KvPool(
            stage.decoder_indices,
            num_blocks=num_blocks,
            block_size=block_size,
            num_slots=num_slots,
            device=self.device,
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
                cache=self.pool.view([0], [0], [1], 1, [[0]]),
            )

    def step(self, stage, rows: StepRows, x: torch.Tensor, draw: Draw | None) -> torch.Tensor:
        """Hidden states (rows, width, hidden) from a stage before the last; from the last,
        each row's chosen token (rows,) (`Chosen` when a row asked for log-probabilities), or
        without a `draw` the last position's logits (rows, vocab)."""
        self.check_owner(rows)
        view = None
        held = stage.decoder_indices
        if held:
            pool = self.pool
            if pool is None or pool.shape != (rows.num_blocks, rows.block_size, rows.num_slots):
                pool = self.pool = KvPool(
                    held,
                    num_blocks=rows.num_blocks,
                    block_size=rows.block_size,
                    num_slots=rows.num_slots,
                    device=self.device,
                )
            view = pool.view(
                list(rows.slots), list(rows.starts), list(rows.counts), rows.width, rows.tables
            )
        if x.shape[:2] != (len(rows.slots), rows.width):
            raise ValueError(
                f"step input of shape {tuple(x.shape)} does not match "
                f"{len(rows.slots)} rows of width {rows.width}"
            )
        self.last_rows = len(rows.slots)
        start = time.perf_counter()
        try:
            out = self._forward(stage, rows, x, view, draw)
            if view is not None:
                view.commit()  # recurrent states updated in place on copies
            return out
        finally:
            self.last_step_s = time.perf_counter() - start

    def _forward(self, stage, rows: StepRows, x: torch.Tensor, view, draw: Draw | None):
        # inference_mode: no version counters or view tracking on activations and caches
        scoring = False  # a row feeds prompt positions it wants scored: every position's logits
        if stage.is_last and draw is not None:
            if len(draw.choose) != len(rows.slots):
                raise ValueError("the last stage needs a Draw with one entry per row")
            for slot, settings in draw.settings:  # sequences new to their slots
                self.slot_settings[slot] = settings
                self.prompt_tails.pop(slot, None)
            scoring = any(
                (s := self.slot_settings.get(slot)) is not None
                and s.prompt_logprobs is not None
                and start < s.prompt_length
                for slot, start in zip(rows.slots, rows.starts, strict=True)
            )
        with torch.inference_mode():
            out = stage(
                x.to(self.device),
                position_ids=rows.positions().to(self.device),
                logits_to_keep=1 if stage.is_last and not scoring else 0,
                cache=view,
            )
            if not stage.is_last:
                return out.cpu()
            if draw is None:  # the last position's logits (rows, vocab): the family check's
                return out[:, -1].cpu()
            chosen = choose_rows(out[:, -1], rows, draw.choose, self.slot_settings)
            if not scoring:
                return chosen
            prompt = prompt_logprobs(out, rows, self.slot_settings, self.prompt_tails)
            if isinstance(chosen, Chosen):
                return Chosen(chosen.tokens, chosen.chosen, prompt)
            return Chosen(chosen, {}, prompt)

    def ring(
        self,
        stage,
        batches: Sequence[tuple[StepRows, torch.Tensor, Draw]],
        count: int,
        downstream: Sequence = (),
        timeout_s: float = 300.0,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Up to `count` steps of each micro-batch of `batches` (rows, input, draw), run from
        this stage, the first: the step given (a decode step, or a prefill), then decode steps
        of its rows, its draw's settings taken by the first. A step of micro-batch m goes
        through this stage, then on through `downstream` (the later stages in order: Ray actor
        handles, or in-process workers), actor to actor; its last stage's tokens come straight
        back here as m's next input: no round trip to the driver per token. The micro-batches take turns here, so
        while the later stages work on m this stage computes m + 1: with as many micro-batches
        as stages, every stage is busy. Yields (m, tokens) per micro-batch step, in
        order. One micro-batch and no downstream: a one-stage job's steps. Every row must
        choose at every step (a prefill's rows are fed their whole prompts).

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
                        rows[m], xs[m] = rows[m].advanced(), token_ids(tokens)[:, None]
                    if step < count:
                        pending[m] = self._send(stage, rows[m], xs[m], draws[m], downstream)
                        draws[m] = replace(draws[m], settings=())  # taken by the first step
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


def _collect(sent, timeout_s: float):
    """The last stage's answer `_send` returned (a tensor or `Chosen`, packed or not), or from
    an object ref of an actor's answer: unpacked."""
    if not isinstance(sent, torch.Tensor | Packed | Chosen):
        import ray  # only here: a worker driven in-process never needs Ray

        sent = ray.get(sent, timeout=timeout_s)
    return unpack_out(sent)
