"""A stage's batched generation step: one forward over every sequence of a micro-batch, each
row at its own positions in its own KV slot (`worker.batch_cache`), and on the last stage the
choice of each row's next token under that row's own settings.

What crosses Ray per step is small and plain: `StepRows` (which slots, where each row's new
tokens start, how many, the blocks its table gained, and the engine and epoch the step belongs
to), the activations, and for the last stage a `Draw` (which rows choose, and the settings of
sequences new to their slots); back come the tokens. The worker keeps per slot what does not
change from step to step (the block table, the last stage's settings) besides the keys and
values, all forgotten with a new claim: a sampled token is keyed by the row's seed and its
position, so a replaced worker, or a different batch, never changes what a seeded request
draws.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from worker.batch_cache import KvPool
from worker.decode import RowSettings, logprobs_of, sample_rows
from worker.guided import GuideBook, Guided, GuideError, words_for
from worker.positions import row_positions
from worker.steps import (
    NO_TOKEN,
    Chosen,
    ClaimedByAnotherError,
    Draw,
    Logprobs,
    NotOwnerError,
    Owner,
    SlotSettings,
    StepRows,
    send_through,
    unpack_out,
)
from worker.wire import Packed, unpack


def token_ids(out) -> torch.Tensor:
    """The tokens (rows,) of a last stage's answer (a tensor, or `Chosen`; packed or not)."""
    return unpack(out.tokens if isinstance(out, Chosen) else out)


def positions(rows: StepRows) -> torch.Tensor:
    """Position ids (rows, width): each real token its place in its sequence, padding 0."""
    return row_positions(torch.tensor(rows.starts), torch.tensor(rows.counts), rows.width)


def choose_rows(
    logits: torch.Tensor,
    rows: StepRows,
    choose: Sequence[bool],
    settings: dict,
    refused: dict | None = None,
    histories: dict | None = None,
    guided: dict | None = None,
) -> torch.Tensor | Chosen:
    """Each row's next token (CPU, NO_TOKEN where the row does not choose) from its last
    position's logits (rows, vocab), each with its slot's `settings` (slot -> SlotSettings):
    greedy and sampled rows at once on the logits' device (`worker.decode.sample_rows`), a
    row's end tokens masked before its min_tokens, only the tokens copied back; with the
    log-probabilities of the rows that ask for them (`Chosen`), computed for those rows only.
    A slot whose sampling needs its tokens so far (penalties, bad words) has them in
    `histories` (slot -> list: its `SlotSettings.history`, then each token chosen for it, at
    its position: a position chosen again replaces what came after it); a guided slot its
    place in its guide's automaton in `guided` (slot -> `worker.guided.Guided`).

    A row's failure is that row's alone (`Chosen.failed`): its slot's settings were refused
    (`refused`: slot -> why), its logits hold a NaN, or its draw left the vocabulary. Should
    choosing the rows together raise, each row is chosen on its own to find the ones at
    fault (a row's token depends on nothing but its own logits and settings, so the others'
    tokens are the same either way)."""
    refused = refused or {}
    histories = {} if histories is None else histories
    guided = {} if guided is None else guided
    choosing = [r for r, take in enumerate(choose) if take]
    if not choosing:
        return torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long)
    failed = {r: refused[rows.slots[r]] for r in choosing if rows.slots[r] in refused}
    able = [r for r in choosing if r not in failed]
    for r in able:
        if rows.slots[r] not in settings:
            raise ValueError(
                f"slot {rows.slots[r]} chooses a token but its settings never reached this stage"
            )
    try:
        tokens, scored = _choose(logits, rows, able, settings, histories, guided)
    except Exception:
        tokens = torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long)
        scored = {}
        for r in able:
            try:
                one, one_scored = _choose(logits, rows, [r], settings, histories, guided)
            except Exception as exc:
                failed[r] = f"choosing its token failed: {type(exc).__name__}: {exc}"
                continue
            tokens[r] = one[r]
            scored.update(one_scored)
    vocab = logits.shape[-1]
    for r in able:
        if r in failed:
            continue
        token = int(tokens[r])
        if token == _NOT_A_NUMBER:
            failed[r] = "its logits are not numbers (NaN): the model cannot go on for it"
        elif not 0 <= token < vocab:
            failed[r] = f"its draw gave token {token}, outside the vocabulary of {vocab}"
    for r in failed:  # a placeholder a burst may feed on: the engine never hands it out
        tokens[r] = 0
        scored.pop(r, None)
    for r in able:
        history = histories.get(rows.slots[r])
        if history is not None and r not in failed:
            history.append(int(tokens[r]))  # at its position: `_choose` cut what came after
    if not failed and not scored:
        return tokens
    return Chosen(tokens, scored, {}, failed)


_NOT_A_NUMBER = -2  # a row whose logits hold a NaN (argmax would pick the NaN's index)


def _choose(
    logits: torch.Tensor,
    rows: StepRows,
    choosing: list[int],
    settings: dict,
    histories: dict,
    guided: dict,
) -> tuple[torch.Tensor, dict[int, Logprobs]]:
    """The tokens of rows `choosing` (CPU (rows,), NO_TOKEN elsewhere, _NOT_A_NUMBER where a
    row's logits hold a NaN) and the `Logprobs` of those that ask."""
    if not choosing:
        return torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long), {}
    chosen_settings = [settings[rows.slots[r]] for r in choosing]
    positions = [rows.starts[r] + rows.counts[r] for r in choosing]  # of the tokens chosen
    every = len(choosing) == logits.shape[0]
    picked = logits if every else logits[choosing]
    nan = torch.isnan(picked).any(dim=-1)
    if all(s.plain(p) for s, p in zip(chosen_settings, positions, strict=True)):
        # sample_rows' greedy rows, and the NaN rows marked, in one copy to the host
        marked = torch.argmax(picked.to(torch.float32), dim=-1).masked_fill(nan, _NOT_A_NUMBER)
        chosen = marked.cpu()
    else:
        kept = [
            _history(histories, rows.slots[r], p) if s.sampling.needs_history else ()
            for r, s, p in zip(choosing, chosen_settings, positions, strict=True)
        ]
        row_settings = RowSettings.of(
            [s.sampling for s in chosen_settings],
            [s.seed for s in chosen_settings],
            positions,
            [s.banned(p) for s, p in zip(chosen_settings, positions, strict=True)],
            kept,
            [s.prompt_length for s in chosen_settings],
            _masks(guided, [rows.slots[r] for r in choosing], chosen_settings, kept, logits),
        )
        chosen = sample_rows(picked, row_settings).masked_fill(nan.cpu(), _NOT_A_NUMBER)
    if every:
        tokens = chosen
    else:
        tokens = torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.long)
        tokens[choosing] = chosen
    asking = [
        i
        for i, s in enumerate(chosen_settings)
        if s.logprobs is not None and int(chosen[i]) != _NOT_A_NUMBER
    ]
    if not asking:
        return tokens, {}
    values, top_ids, top_values = logprobs_of(
        picked[asking], chosen[asking], [chosen_settings[i].logprobs for i in asking]
    )
    return tokens, {
        choosing[i]: Logprobs(
            start=positions[i],
            token_ids=(int(chosen[i]),),
            logprobs=(values[j],),
            top_ids=(top_ids[j],),
            top_logprobs=(top_values[j],),
        )
        for j, i in enumerate(asking)
    }


def _masks(guided: dict, slots, chosen_settings, kept, logits: torch.Tensor):
    """The guided rows' allowed tokens as bitmasks (rows, words), every bit set for the
    others; None when no row has a guide."""
    if not any(s.sampling.guide for s in chosen_settings):
        return None
    words = words_for(logits.shape[-1])
    masks = torch.full((len(slots), words), -1, dtype=torch.int32)
    for i, (slot, s) in enumerate(zip(slots, chosen_settings, strict=True)):
        if s.sampling.guide:
            guide = guided.get(slot)
            if guide is None:
                raise ValueError(f"slot {slot}: its guide never reached this stage")
            masks[i] = guide.mask(kept[i], s.prompt_length, words)
    return masks


def _history(histories: dict, slot: int, position: int) -> list[int]:
    """The tokens of `slot`'s sequence before `position`: its kept history, cut there (what
    came after was chosen by steps the engine dropped: the position is chosen again now)."""
    history = histories.get(slot)
    if history is None:
        raise ValueError(f"slot {slot}: its sampling needs its tokens, but none reached this stage")
    if len(history) < position:
        raise ValueError(
            f"slot {slot}: this stage holds its tokens up to position {len(history)}, not up "
            f"to {position}: its history cannot be known"
        )
    del history[position:]
    return history


def refusal(settings: SlotSettings) -> str | None:
    """Why the last stage cannot choose tokens with `settings` (None: it can). The engine
    checks every request where it enters (`coordinator.engine.requests`), so this only
    catches a caller that did not: the row then fails alone, never the step."""
    try:
        RowSettings.of(
            [settings.sampling],
            [settings.seed],
            [len(settings.history) if settings.sampling.needs_history else settings.prompt_length],
            [settings.end_ids],
            [settings.history],
            [settings.prompt_length],
        )
    except (TypeError, ValueError, OverflowError) as exc:
        return f"its settings were refused: {exc}"
    return None


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
    by it, and kept until the stage changes), owned by one engine at a time (`claim`), and
    what its steps keep per slot (block tables; on the last stage, settings)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: KvPool | None = None
        self.owner: Owner | None = None  # who may step this pool now
        # the last stage: each slot's settings, as its owner sent them (Draw.settings), and the
        # last logits of a prompt chunk whose next chunk's first token is to be scored
        self.slot_settings: dict[int, SlotSettings] = {}
        self.refused: dict[int, str] = {}  # slot -> why its settings cannot be used
        self.prompt_tails: dict[int, torch.Tensor] = {}
        # slot -> its tokens so far, where its sampling needs them (`choose_rows`), and its
        # place in its guide's automaton where it has one (the book: the checkpoint's guides)
        self.histories: dict[int, list[int]] = {}
        self.guided: dict[int, Guided] = {}
        self.guide_book: GuideBook | None = None
        # every stage: each slot's block table as its owner's steps built it (`block_tables`),
        # slot -> (the table's id, None for a whole table sent alone; its blocks)
        self.tables: dict[int, tuple[int | None, list[int]]] = {}
        self.last_rows = 0  # sequences in the last step, for reports
        self.last_step_s = 0.0  # this stage's own time in its last step (not the others')

    def reset(self) -> None:
        """Forget every sequence's keys and values (the stage's layers changed): nobody owns
        the pool until an engine claims it again."""
        self.pool, self.owner, self.last_rows = None, None, 0
        self._forget_slots()

    def _forget_slots(self) -> None:
        """Forget what this stage keeps per slot (settings, tokens, guides, block tables)."""
        for kept in (
            self.slot_settings,
            self.refused,
            self.prompt_tails,
            self.histories,
            self.guided,
            self.tables,
        ):
            kept.clear()

    def claim(self, owner: Owner, *, take: bool = False) -> None:
        """Make `owner` the one engine (and epoch) whose steps this pool runs. An engine
        re-claims under a new epoch after the workers changed; `take` lets a new engine take
        the pool from another (a load's engine replaced), which is refused otherwise."""
        if self.owner is not None and self.owner[0] != owner[0] and not take:
            raise ClaimedByAnotherError(
                f"engine {owner[0]} cannot claim this stage: engine {self.owner[0]} owns its KV "
                "pool (one engine per load: submit through it, e.g. attach(name))"
            )
        if owner != self.owner:  # a new claim sends every sequence's settings and table again
            self._forget_slots()
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

    def block_tables(self, rows: StepRows) -> list[list[int]]:
        """Each row's whole block table for this step, its slot's kept table updated by what
        the step carries (`StepRows.table_from`): cut to the blocks the engine counts on (a
        burst cut short gave its last ones back) and extended by the new ones; a row with a
        whole table replaces its slot's. Raises, before anything is read, when the slot's
        table is not the one the step extends (another sequence's, none since a new claim, or
        shorter: a step the engine counted on never reached this stage)."""
        if not rows.table_from:
            tables = [list(table) for table in rows.tables]
            for slot, table in zip(rows.slots, tables, strict=True):
                self.tables[slot] = (None, table)
            return tables
        tables = []
        for slot, kept, tail, table_id in zip(
            rows.slots, rows.table_from, rows.tables, rows.table_ids, strict=True
        ):
            if not kept:
                table = list(tail)
                self.tables[slot] = (table_id, table)
            else:
                held = self.tables.get(slot)
                if held is None or held[0] != table_id or len(held[1]) < kept:
                    if held is None:
                        what = "no table there"
                    elif held[0] != table_id:
                        what = "another sequence's table there"
                    else:
                        what = f"{len(held[1])} block(s) of it"
                    raise ValueError(
                        f"slot {slot}: the step extends its sequence's block table after "
                        f"{kept} block(s), but this stage holds {what}: a step the engine "
                        "counted on did not reach it; refused (its keys would be read from "
                        "blocks the engine does not mean)"
                    )
                table = held[1]
                del table[kept:]
                table.extend(tail)
            tables.append(table)
        return tables

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
        tables = self.block_tables(rows)  # every stage keeps them, whether it holds layers
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
                list(rows.slots), list(rows.starts), list(rows.counts), rows.width, tables
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
                self.prompt_tails.pop(slot, None)
                self.histories.pop(slot, None)
                self.guided.pop(slot, None)
                why = refusal(settings) or self._guide(slot, settings)
                if why is None:
                    self.slot_settings[slot] = settings
                    self.refused.pop(slot, None)
                    if settings.sampling.needs_history:
                        self.histories[slot] = list(settings.history)
                else:  # that row fails alone (`choose_rows`), at each of its steps
                    self.slot_settings.pop(slot, None)
                    self.refused[slot] = why
            scoring = any(
                (s := self.slot_settings.get(slot)) is not None
                and s.prompt_logprobs is not None
                and start < s.prompt_length
                for slot, start in zip(rows.slots, rows.starts, strict=True)
            )
        with torch.inference_mode():
            out = stage(
                x.to(self.device),
                position_ids=positions(rows).to(self.device),
                logits_to_keep=1 if stage.is_last and not scoring else 0,
                cache=view,
            )
            if not stage.is_last:
                return out.cpu()
            if draw is None:  # the last position's logits (rows, vocab): the family check's
                return out[:, -1].cpu()
            chosen = choose_rows(
                out[:, -1],
                rows,
                draw.choose,
                self.slot_settings,
                self.refused,
                self.histories,
                self.guided,
            )
            if not scoring:
                return chosen
            prompt = prompt_logprobs(out, rows, self.slot_settings, self.prompt_tails)
            if isinstance(chosen, Chosen):
                return replace(chosen, prompt=prompt)
            return Chosen(chosen, {}, prompt)

    def _guide(self, slot: int, settings: SlotSettings) -> str | None:
        """Start `slot`'s place in its guide's automaton (compiled once per regex); why it
        cannot be used, if it cannot (that row then fails alone)."""
        if not settings.sampling.guide:
            return None
        if self.guide_book is None:
            return "its guide was refused: this stage has no tokenizer to guide with"
        try:
            self.guided[slot] = Guided(self.guide_book, settings.sampling.guide)
        except GuideError as exc:
            return f"its guide was refused: {exc}"
        return None

    def ring(
        self,
        stage,
        batches: Sequence[tuple[StepRows, torch.Tensor, Draw]],
        count: int,
        downstream: Sequence = (),
        timeout_s: float = 300.0,
        stop: threading.Event | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Up to `count` steps of each micro-batch of `batches` (rows, input, draw), run from
        this stage, the first: the step given (a decode step, or a prefill), then decode steps
        of its rows, its draw's settings taken by the first. A step of micro-batch m goes
        through this stage, then on through `downstream` (the later stages in order: Ray actor
        handles, or in-process workers), actor to actor; its last stage's tokens come straight
        back here as m's next input: no round trip to the driver per token. The micro-batches
        take turns here, so while the later stages work on m this stage computes m + 1: with
        as many micro-batches as stages, every stage is busy. Yields (m, tokens) per
        micro-batch step, in order. One micro-batch and no downstream: a one-stage job's
        steps. Every row must choose at every step (a prefill's rows are fed their whole
        prompts).

        `stop` (in process: the driver sets it at a yield to cut the burst) sends no step
        more, and yields the steps already sent (each of the other micro-batches has one under
        way): they ran, or run, on every stage, so the driver applies them instead of having
        them computed again. Left early (the driver closed it at a yield, or Ray cancelled
        it), the steps already sent on are waited for: every write this call makes is done
        before the stage takes its next call, and the later stages' next calls depend on that
        one."""
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
                    if pending[m] is not None:
                        tokens = _collect(pending[m], timeout_s)
                        pending[m] = None
                        yield m, tokens
                        rows[m], xs[m] = rows[m].advanced(), token_ids(tokens)[:, None]
                    if step < count and (stop is None or not stop.is_set()):
                        pending[m] = self._send(stage, rows[m], xs[m], draws[m], downstream)
                        draws[m] = replace(draws[m], settings=())  # taken by the first step
                if all(sent is None for sent in pending):
                    break  # stopped: every step sent was yielded
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


def _collect(sent, timeout_s: float):
    """The last stage's answer `_send` returned (a tensor or `Chosen`, packed or not), or from
    an object ref of an actor's answer: unpacked."""
    if not isinstance(sent, torch.Tensor | Packed | Chosen):
        import ray  # only here: a worker driven in-process never needs Ray

        sent = ray.get(sent, timeout=timeout_s)
    return unpack_out(sent)
