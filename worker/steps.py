"""What a generation step carries between the engine and the stages, as plain values that
import no torch: which rows and slots (`StepRows`), how each new sequence chooses its tokens
(`SlotSettings`, `Sampling`), which rows choose (`Draw`), and what the last stage answers
(`Chosen`, `Logprobs`, tokens). The engine of a named load runs in its keeper, a process that
lives as long as the load: built from these alone it never imports torch (measured: 144 against
346 MiB and ~1 against 2.5-4 CPU-s per keeper). `worker.batched` runs the steps; `worker.wire`
moves their arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from offload.errors import LaunchError
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for
from worker.wire import pack, packable, unpack, values

# The logits are processed in float32: a temperature or penalty past its range is inf or ~0
# there (-inf / inf, x / 0 are NaN), so requests and rows are held to it.
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32
FLOAT32_TINY = 1.1754943508222875e-38  # the least normal float32
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
    tokens from position `starts[r]` on into the blocks of its block table (the blocks of its
    positions 0.., in order: at least through the step's last position, a burst's too); the
    step's inputs are left-padded to `width`. The pool's shape rides along, so a worker sizes
    its pool from the engine that uses it.

    Each stage keeps every slot's table (`BatchRunner.block_tables`), so a step carries only
    what changed: row r's table is the first `table_from[r]` blocks of the one its slot holds,
    then `tables[r]` (its whole table when `table_from[r]` is 0: a sequence new to its slot,
    or one whose table the stages may not hold). `table_ids[r]` names the table (the engine's
    id of the sequence's admission): a stage that holds another one for the slot, or fewer
    than `table_from[r]` blocks of it, refuses the step rather than read keys it does not
    know. A decode step of a long sequence then carries its new block when it crosses one,
    not its whole table. Without `table_from` (callers with no block bookkeeping:
    `in_slots`), every row's `tables[r]` is its whole table, every step."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    width: int
    num_slots: int
    tables: tuple[tuple[int, ...], ...]
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    owner: Owner = ("", 0)
    table_from: tuple[int, ...] = ()
    table_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        rows = len(self.slots)
        if not len(self.starts) == len(self.counts) == len(self.tables) == rows:
            raise ValueError("slots, starts, counts and tables must have one entry per row")
        if self.table_from and not len(self.table_from) == len(self.table_ids) == rows:
            raise ValueError("table_from and table_ids must have one entry per row")

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
        `max_seq_len` positions (`contiguous_tables`), whole in every step."""
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
        """The next decode step of the same rows: one token each, after what this step wrote,
        in the tables this step left (nothing more to carry, but whole tables)."""
        starts = tuple(s + c for s, c in zip(self.starts, self.counts, strict=True))
        if not self.table_from:
            return replace(self, starts=starts, counts=(1,) * len(self.slots), width=1)
        return replace(
            self,
            starts=starts,
            counts=(1,) * len(self.slots),
            width=1,
            tables=((),) * len(self.slots),
            table_from=tuple(
                n + len(tail) for n, tail in zip(self.table_from, self.tables, strict=True)
            ),
        )


@dataclass(frozen=True, slots=True)
class SlotSettings:
    """How the sequence in a slot chooses its tokens, and what the last stage returns beside
    them: sent once per sequence, with its first step (`Draw`), kept by the last stage.

    `end_ids` cannot be chosen before the sequence has `min_tokens` new tokens (vLLM's
    min_tokens, transformers' min_new_tokens: their logits are -inf until then), counted from
    `prompt_length`. `logprobs`: with every chosen token, its log-probability and those of the
    `logprobs` most likely tokens (None: nothing). `prompt_logprobs`: the same for every
    prompt position after the first (`prompt_ids`, which the last stage otherwise never
    sees) as the prompt goes through. `history`: its tokens so far, when its choice depends
    on them (`Sampling.needs_history`)."""

    sampling: Sampling
    seed: int | None = None
    end_ids: tuple[int, ...] = ()
    prompt_length: int = 0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_ids: tuple[int, ...] = ()
    # when its sampling needs them (`Sampling.needs_history`): its tokens at positions 0..
    # as it enters the slot (the prompt, and what it generated before a preemption); the last
    # stage adds each token it chooses for it
    history: tuple[int, ...] = ()

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
        if self.sampling.needs_history and len(self.history) < self.prompt_length:
            raise ValueError(
                f"its sampling needs the tokens before each choice: history must hold at least "
                f"the {self.prompt_length} prompt tokens, got {len(self.history)}"
            )

    def plain(self, position: int) -> bool:
        """Its token at `position` is the argmax of the logits, with nothing else to return:
        greedy, its logits not processed, no token banned there, no log-probabilities."""
        return (
            not self.sampling.do_sample
            and not self.sampling.processed
            and self.logprobs is None
            and not self.banned(position)
        )

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
    """What the last stage returns when a row of the step asked for log-probabilities, or
    could not choose: the tokens (as without), per row (index in the step) the `Logprobs` of
    its chosen token (`chosen`) and of the prompt positions its chunk fed (`prompt`), and the
    rows that failed (`failed`: row -> why; their token is a placeholder, 0, that a burst may
    feed on but the engine never hands out: it ends that row's request with the reason, and
    the other rows go on)."""

    # torch.Tensor (rows,), packed for Ray (`worker.wire`), or a numpy array as the engine reads
    # it (`answer_values`)
    tokens: object
    chosen: dict[int, Logprobs]
    prompt: dict[int, Logprobs]
    failed: dict[int, str] = field(default_factory=dict)

    def packed(self) -> Chosen:
        return replace(self, tokens=pack(self.tokens))

    def unpacked(self) -> Chosen:
        return replace(self, tokens=unpack(self.tokens))


class RowFailedError(RuntimeError):
    """A row of a step that the last stage could not choose a token for (settings it cannot
    take, logits that are not numbers): the request of that row ends with it, alone."""


def pack_out(out):
    """A last stage's answer as it crosses Ray."""
    return out.packed() if isinstance(out, Chosen) else pack(out)


def unpack_out(out):
    """A last stage's answer from Ray: a tensor, or `Chosen` with its tokens a tensor."""
    return out.unpacked() if isinstance(out, Chosen) else unpack(out)


def answer_values(out):
    """A last stage's answer as the engine reads it, without torch: its tokens a numpy array
    (`wire.values`), or `Chosen` with them so; an in-process stage's tensors as they are."""
    if isinstance(out, Chosen):
        return replace(out, tokens=values(out.tokens))
    return values(out)


def contiguous_tables(
    slots: Sequence[int], max_seq_len: int, block_size: int
) -> tuple[tuple[int, ...], ...]:
    """Block tables that give each slot its own run of blocks for `max_seq_len` positions (slot
    s: blocks s*n .. s*n + n-1): for callers that keep one sequence per slot and no block
    bookkeeping (a probe, the family check, tests). Their pool needs `num_slots * n` blocks."""
    n = blocks_for(max_seq_len, block_size)
    return tuple(tuple(range(slot * n, slot * n + n)) for slot in slots)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a sequence chooses its tokens. Greedy unless `do_sample`; then temperature, top-k
    (0 or None: off), top-p (1: off) and min-p (0: off) applied in generate's order before
    drawing. Before them, greedy or not, in generate's order (vLLM applies the same ones):

    - `logit_bias`: (token, bias) pairs added to the logits (OpenAI's logit_bias,
      transformers' single-token sequence_bias);
    - `repetition_penalty` (1: off) on every token of the prompt and of the output so far:
      a logit divided by it when positive, multiplied when negative (transformers' and
      vLLM's);
    - `frequency_penalty` and `presence_penalty` (0: off), OpenAI's and vLLM's: subtracted,
      times a token's count in the output so far, and once for a token it holds;
    - `bad_words`: token sequences never completed (transformers' bad_words_ids: a word of
      one token is never chosen, a longer one's last token is not chosen right after the rest
      of it);
    - `guide`: a regex the output must match (guided decoding, `worker.guided`): only the
      tokens that keep it possible are allowed, before anything else, and the end token only
      once it is complete."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    guide: str = ""

    @property
    def needs_history(self) -> bool:
        """Its choice depends on the tokens before it (a penalty, a bad word of several
        tokens, a guide): the last stage keeps the sequence's tokens
        (`SlotSettings.history`)."""
        return (
            bool(self.guide)
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or any(len(word) > 1 for word in self.bad_words)
        )

    @property
    def processed(self) -> bool:
        """The logits are changed before the choice (bias, penalties, bad words): a greedy
        row's token is then not the argmax of the model's logits."""
        return self.needs_history or bool(self.logit_bias) or bool(self.bad_words)


@dataclass(frozen=True, slots=True)
class Logprobs:
    """The model's log-probabilities at consecutive positions of one sequence, from `start` on:
    of the token at each position, and of the `k` most likely tokens there (most likely
    first). Those of its raw distribution, the log-softmax of its float32 logits before any
    temperature, top-k, top-p or masking (vLLM's default `logprobs_mode`, raw_logprobs), so
    they are the same whatever the request's sampling settings."""

    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]

    def __len__(self) -> int:
        return len(self.token_ids)

    def __add__(self, other: Logprobs) -> Logprobs:
        """The positions of `self` and then those of `other` (which must follow them)."""
        if other.start != self.start + len(self):
            raise ValueError(f"positions from {other.start} do not follow {self.start}+{len(self)}")
        return Logprobs(
            start=self.start,
            token_ids=self.token_ids + other.token_ids,
            logprobs=self.logprobs + other.logprobs,
            top_ids=self.top_ids + other.top_ids,
            top_logprobs=self.top_logprobs + other.top_logprobs,
        )


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
            out = call(rows, pack(out) if packable(out) else out, last_draw)
    return out
