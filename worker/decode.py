"""Choosing the next token, as `transformers`' `generate` does (its warpers, in its order).

`sample_rows` chooses every row of a step at once on the logits' device (the last stage's
`worker.batched.choose_rows`), a sampled row's draw keyed by (seed, position) alone, so it needs
no generator state and is the same whatever else is in the batch or whichever worker runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.steps import FLOAT32_MAX, FLOAT32_TINY, Sampling

# --- Vectorised, counter-based sampling -------------------------------------------------------
#
# A torch.Generator per row would need its state (~5 KB) to travel with the request every
# step. `sample_rows` instead draws every row of a step at once, on the logits' device,
# with one uniform per row that is a pure function of (seed, position): no state to keep or
# ship, and a row's token depends on nothing but its logits, its settings, its seed and its
# position (not on the other rows, the batch size or the process that runs it).

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / golden ratio, odd


def _mix64(z: int) -> int:
    """SplitMix64's output function (Stafford's "Mix13"): a bijection of 64-bit integers. Fed
    a counter that steps by GAMMA it is SplitMix64, whose stream passes BigCrush."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that a row with `seed` draws its token at `position` with.

    It is output number `position` (0-based) of a SplitMix64 generator whose state starts at
    key = the first SplitMix64 output of `seed`:

        key  = mix64(seed + GAMMA)
        bits = mix64(key + (position + 1) * GAMMA)        (all mod 2**64)
        u    = (bits >> 12) / 2**52

    SplitMix64's state only ever advances by GAMMA, so output n can be computed directly: the
    draw is a counter, not a state. The seed goes through mix64 first so that seeds s and
    s + GAMMA (or nearby seeds) do not give shifted copies of one stream. Seeds are taken mod
    2**64 (a negative seed is its two's complement). u keeps 52 bits, not 53, so that
    `u * total` rounds strictly below `total` in float64 and the inverse-CDF search always lands
    on a token of nonzero probability (see `sample_rows`)."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    key = _mix64((seed + _GAMMA) & _MASK64)
    bits = _mix64((key + (position + 1) * _GAMMA) & _MASK64)
    return (bits >> 12) * 2.0**-52


NEUTRAL_PENALTIES = (1.0, 0.0, 0.0)  # (repetition, frequency, presence): off


@dataclass(frozen=True, slots=True)
class RowSettings:
    """How each row of a step chooses its token: greedy, or sampled under its own temperature,
    top-k (0: off), top-p (1: off), min-p (0: off), seed (any int, used mod 2**64) and position
    (the index in its sequence of the token being chosen: prompt length + tokens generated so
    far). Greedy or not, its logits are first processed as `Sampling` says (bias, penalties,
    banned tokens). Plain Python values, so building one costs nothing on the device.

    The optional fields are empty when no row of the step uses them, else hold one entry per
    row: `banned` (tokens it may not choose now: its end tokens before its min_tokens, a bad
    word's last token), `bias` ((token, bias) pairs), `penalties` ((repetition, frequency,
    presence), NEUTRAL_PENALTIES for none), `history` (its tokens at positions 0 .. position
    - 1, for the penalties) and `output_from` (where its output begins in it: frequency and
    presence count only the output, repetition the prompt too)."""

    greedy: tuple[bool, ...]
    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seed: tuple[int, ...]
    position: tuple[int, ...]
    banned: tuple[tuple[int, ...], ...] = ()
    min_p: tuple[float, ...] = ()
    bias: tuple[tuple[tuple[int, float], ...], ...] = ()
    penalties: tuple[tuple[float, float, float], ...] = ()
    history: tuple[Sequence[int], ...] = ()
    output_from: tuple[int, ...] = ()
    # guided rows' allowed tokens: bitmasks (rows, words) int32 on the CPU (`worker.guided`),
    # every bit set for a row without a guide; None when no row has one
    allowed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows = len(self.greedy)
        fields = (self.temperature, self.top_k, self.top_p, self.seed, self.position)
        if any(len(f) != rows for f in fields):
            raise ValueError(f"every field needs {rows} row(s), got {[len(f) for f in fields]}")
        optional = ("banned", "min_p", "bias", "penalties", "history", "output_from")
        for name in optional:
            value = getattr(self, name)
            if value and len(value) != rows:
                raise ValueError(f"{name} needs {rows} row(s), got {len(value)}")
        if bool(self.penalties) != bool(self.history) or bool(self.history) != bool(
            self.output_from
        ):
            raise ValueError("penalties need each row's history and output_from")
        if self.allowed is not None and self.allowed.shape[0] != rows:
            raise ValueError(f"allowed needs {rows} row(s), got {self.allowed.shape[0]}")
        for r in range(rows):
            if self.position[r] < 0:
                raise ValueError(f"row {r}: position must be >= 0, got {self.position[r]}")
            self._check_processing(r)
            if self.greedy[r]:
                continue
            # The bounds generate's warpers enforce (TemperatureLogitsWarper, TopK.., TopP..).
            if not 0 < self.temperature[r] <= FLOAT32_MAX:  # divided in float32
                raise ValueError(
                    f"row {r}: temperature must be > 0 and finite in float32, got "
                    f"{self.temperature[r]}"
                )
            if self.top_k[r] < 0:
                raise ValueError(f"row {r}: top_k must be >= 0 (0: off), got {self.top_k[r]}")
            if not 0.0 <= self.top_p[r] <= 1.0:
                raise ValueError(f"row {r}: top_p must be in [0, 1], got {self.top_p[r]}")
            if self.min_p and not 0.0 <= self.min_p[r] <= 1.0:
                raise ValueError(f"row {r}: min_p must be in [0, 1], got {self.min_p[r]}")

    def _check_processing(self, r: int) -> None:
        """Row r's bias and penalties: finite, a repetition penalty > 0 (generate's bounds),
        a history of exactly its tokens before `position`."""
        for token, value in self.bias[r] if self.bias else ():
            if not math.isfinite(value):
                raise ValueError(f"row {r}: the bias of token {token} must be finite, got {value}")
        if not self.penalties or self.penalties[r] == NEUTRAL_PENALTIES:
            return
        repetition, frequency, presence = self.penalties[r]
        if not FLOAT32_TINY <= repetition <= FLOAT32_MAX:  # applied in float32
            raise ValueError(
                f"row {r}: repetition_penalty must be > 0 and a normal float32, got {repetition}"
            )
        if not (math.isfinite(frequency) and math.isfinite(presence)):
            raise ValueError(
                f"row {r}: frequency and presence penalties must be finite, got "
                f"{frequency} and {presence}"
            )
        if len(self.history[r]) != self.position[r]:
            raise ValueError(
                f"row {r}: its history holds {len(self.history[r])} tokens, but the token it "
                f"chooses is at position {self.position[r]}"
            )
        if not 0 <= self.output_from[r] <= self.position[r]:
            raise ValueError(f"row {r}: output_from {self.output_from[r]} is not in its history")

    @classmethod
    def of(
        cls,
        samplings: Sequence[Sampling],
        seeds: Sequence[int | None],
        positions: Sequence[int],
        banned: Sequence[Sequence[int]] = (),
        histories: Sequence[Sequence[int]] = (),
        output_from: Sequence[int] = (),
        allowed: torch.Tensor | None = None,
    ) -> RowSettings:
        """Per-row settings from each row's Sampling, seed, position and the tokens it may not
        choose now (`banned`: none when empty), and, for a row whose sampling needs them
        (`Sampling.needs_history`), its tokens before `position` (`histories`) and where its
        output begins in them (`output_from`). A bad word's last token is banned where the
        history ends with the rest of it. `allowed`: guided rows' bitmasks (`worker.guided`). A greedy row needs no seed (None is fine); a
        sampling row does: give an unseeded request a random one (e.g.
        `secrets.randbits(64)`) once, when it is submitted, and keep it."""
        rows = len(samplings)
        if not rows == len(seeds) == len(positions):
            raise ValueError(
                f"{len(samplings)} samplings, {len(seeds)} seeds and {len(positions)} "
                "positions: need one of each per row"
            )
        for name, given in (("banned", banned), ("histories", histories)):
            if given and len(given) != rows:
                raise ValueError(f"{name} needs {rows} row(s), got {len(given)}")
        for r, (s, seed) in enumerate(zip(samplings, seeds, strict=True)):
            if s.do_sample and seed is None:
                raise ValueError(f"row {r} samples and needs a seed")
            if s.needs_history and not histories:
                raise ValueError(f"row {r}: its penalties or bad words need its history")
        banned = [tuple(b) for b in banned] if banned else [()] * rows
        for r, s in enumerate(samplings):
            if s.bad_words:
                history = histories[r] if histories else ()
                banned[r] += _bad_word_ends(s.bad_words, history)
        penalized = [
            (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) for s in samplings
        ]
        any_penalty = any(p != NEUTRAL_PENALTIES for p in penalized)
        return cls(
            greedy=tuple(not s.do_sample for s in samplings),
            temperature=tuple(float(s.temperature) for s in samplings),
            top_k=tuple(int(s.top_k or 0) for s in samplings),
            top_p=tuple(float(s.top_p) for s in samplings),
            seed=tuple(0 if seed is None else int(seed) for seed in seeds),
            position=tuple(int(p) for p in positions),
            banned=tuple(banned) if any(banned) else (),
            min_p=tuple(float(s.min_p) for s in samplings)
            if any(s.min_p and s.do_sample for s in samplings)
            else (),
            bias=tuple(s.logit_bias for s in samplings)
            if any(s.logit_bias for s in samplings)
            else (),
            penalties=tuple(penalized) if any_penalty else (),
            history=tuple(
                histories[r] if penalized[r] != NEUTRAL_PENALTIES else () for r in range(rows)
            )
            if any_penalty
            else (),
            output_from=tuple(
                int(output_from[r]) if penalized[r] != NEUTRAL_PENALTIES else 0 for r in range(rows)
            )
            if any_penalty
            else (),
            allowed=allowed,
        )

    def __len__(self) -> int:
        return len(self.greedy)

    def uniforms(self) -> tuple[float, ...]:
        """Each row's uniform (`uniform(seed, position)`); greedy rows' are never used."""
        return tuple(uniform(s, p) for s, p in zip(self.seed, self.position, strict=True))


def _bad_word_ends(words: Sequence[Sequence[int]], history: Sequence[int]) -> tuple[int, ...]:
    """The tokens that would complete one of `words` after `history` (transformers'
    NoBadWordsLogitsProcessor): a one-token word always, a longer one's last token where the
    history ends with the rest of it."""
    ends = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (
            len(history) >= head and list(history[len(history) - head :]) == list(word[:-1])
        ):
            ends.append(word[-1])
    return tuple(ends)


# Columns of the per-step table of the sampling rows (float64: every value in it is exact).
_ROW, _SCALE, _TOP_K, _TOP_P_ON, _CUT, _U, _MIN_P = range(7)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the device needs for the sampling rows of one step, computed on the host so that
    the device gets it in one copy and nothing on the device waits for a host decision."""

    table: torch.Tensor  # (sampling rows, 6) float64 on the device, columns as above
    all_rows: bool  # every row samples: no gather of the sampling rows needed
    reciprocal: bool  # the scale column holds 1/temperature (CUDA), else temperature
    any_temperature: bool
    top_k_max: int  # largest active top-k (0: no row has one)
    any_top_p: bool
    any_min_p: bool


def _plan(settings: RowSettings, vocab: int, device: torch.device) -> _Plan | None:
    rows = [r for r in range(len(settings)) if not settings.greedy[r]]
    if not rows:
        return None
    temperatures = torch.tensor([settings.temperature[r] for r in rows], dtype=torch.float32)
    # generate divides float32 scores by the Python float temperature. On the CPU that is
    # x / float32(t); CUDA's kernel turns a division by a host scalar into x * (1 / float32(t))
    # (rounded in float32), which differs in the last bit for some x: do what it does there.
    reciprocal = device.type == "cuda"
    scales = torch.ones_like(temperatures) / temperatures if reciprocal else temperatures
    # TopKLogitsWarper keeps max(top_k, 1) tokens, at most the vocabulary: k >= vocab keeps
    # everything, the same as off (0).
    top_ks = [min(max(settings.top_k[r], 1), vocab) if settings.top_k[r] else 0 for r in rows]
    top_ks = [0 if k >= vocab else k for k in top_ks]
    top_p_on = [settings.top_p[r] < 1.0 for r in rows]
    scale_values = scales.tolist()  # exact: float32 values widen to float64 losslessly
    table = torch.tensor(
        [
            [
                r,
                scale_values[i],
                top_ks[i],
                float(top_p_on[i]),
                # TopPLogitsWarper compares float32 cumulative probabilities with the Python
                # float 1 - top_p, which torch casts to float32: cast on the device, as it does.
                1.0 - settings.top_p[r],
                uniform(settings.seed[r], settings.position[r]),
                settings.min_p[r] if settings.min_p else 0.0,
            ]
            for i, r in enumerate(rows)
        ],
        dtype=torch.float64,
    )
    return _Plan(
        table=table.to(device),
        all_rows=len(rows) == len(settings),
        reciprocal=reciprocal,
        any_temperature=any(settings.temperature[r] != 1.0 for r in rows),
        top_k_max=max(top_ks),
        any_top_p=any(top_p_on),
        any_min_p=any(settings.min_p[r] > 0 for r in rows) if settings.min_p else False,
    )


def _warped(scores: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The sampling rows' float32 scores (rows, vocab) after generate's warpers in its order
    (temperature, top-k, top-p, min-p), each row under its own values, all rows at once; removed
    tokens are -inf. Every operation is per row along the vocabulary, so a row's result does not
    depend on the other rows."""
    table = plan.table
    if plan.any_temperature:
        scale = table[:, _SCALE].to(torch.float32)[:, None]
        scores = scores * scale if plan.reciprocal else scores / scale
        scores = scores.clamp_max(FLOAT32_MAX)  # a low temperature may overflow: not inf
    if plan.top_k_max:
        # TopKLogitsWarper: remove what is below the k-th largest score, so ties with it stay.
        # One topk at the largest k gives every row's k-th largest; rows without top-k get -inf
        # (nothing is below it).
        k = table[:, _TOP_K].to(torch.long)[:, None]
        largest = torch.topk(scores, plan.top_k_max, dim=-1).values
        kth = largest.gather(1, (k - 1).clamp_min(0)).masked_fill(k == 0, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if plan.any_top_p:
        # TopPLogitsWarper, step by step: the same default (unstable) sort of the same values,
        # so where tied tokens straddle the cut the same ones go as in generate on this device.
        sorted_scores, order = torch.sort(scores, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= table[:, _CUT].to(torch.float32)[:, None]
        remove[:, -1] = False  # min_tokens_to_keep=1: the most probable stays
        remove &= table[:, _TOP_P_ON].to(torch.bool)[:, None]  # rows with top_p 1: no top-p
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if plan.any_min_p:
        # MinPLogitsWarper: remove what is less likely than min_p times the most likely token
        # (which stays, min_p being at most 1); rows with min_p 0 remove nothing
        probs = scores.softmax(dim=-1)
        floor = table[:, _MIN_P].to(torch.float32)[:, None] * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))
    return scores


def _check(logits: torch.Tensor, settings: RowSettings) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(settings):
        raise ValueError(
            f"logits must be (rows, vocab) with {len(settings)} row(s), got {tuple(logits.shape)}"
        )


def _scores(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """The float32 scores the rows choose from: the logits processed as generate's logits
    processors do before its warpers, in its order (each step only where a row asks for it,
    all its rows at once on the logits' device): a guided row's disallowed tokens -inf first
    (as vLLM applies its grammar's bitmask before sampling), then each row's bias added, its
    penalties applied, its banned tokens -inf. A copy whenever it changes something: the logits
    themselves are never changed."""
    scores = logits.to(torch.float32)
    vocab, device = scores.shape[1], scores.device
    if settings.allowed is not None:  # guided rows: only what keeps their text possible
        from worker.guided import allowed

        scores = scores.masked_fill(~allowed(settings.allowed.to(device), vocab), float("-inf"))
    if settings.bias:
        where = [
            (r, t, b) for r, pairs in enumerate(settings.bias) for t, b in pairs if 0 <= t < vocab
        ]
        if where:
            index = torch.tensor([(r, t) for r, t, _ in where], dtype=torch.long).to(device)
            values = torch.tensor([b for _, _, b in where], dtype=torch.float32).to(device)
            scores = scores.index_put((index[:, 0], index[:, 1]), values, accumulate=True)
    if settings.penalties:
        scores = _penalized(scores, settings)
    if not settings.banned:
        return scores
    where = [(r, t) for r, ids in enumerate(settings.banned) for t in ids if 0 <= t < vocab]
    if not where:
        return scores
    index = torch.tensor(where, dtype=torch.long).to(device)
    return scores.index_put((index[:, 0], index[:, 1]), torch.tensor(float("-inf"), device=device))


def _penalized(scores: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """`scores` with each penalized row's repetition, frequency and presence penalties
    applied, as vLLM's apply_penalties (and transformers' RepetitionPenaltyLogitsProcessor for
    the first): a token of the prompt or the output so far has its score divided by the
    repetition penalty when positive, multiplied when negative; then the frequency penalty
    times its count in the output and the presence penalty once if there are subtracted. The
    rows' tokens go to the device in one copy; counts are built there."""
    rows = [r for r, p in enumerate(settings.penalties) if p != NEUTRAL_PENALTIES]
    if not rows:
        return scores
    vocab, device = scores.shape[1], scores.device
    at, tokens, out_at, out_tokens = [], [], [], []
    for i, r in enumerate(rows):
        history, start = settings.history[r], settings.output_from[r]
        at.extend([i] * len(history))
        tokens.extend(history)
        out_at.extend([i] * (len(history) - start))
        out_tokens.extend(history[start:])
    # ids beyond the vocabulary (never the model's choice) land in a column that is dropped
    ids = torch.tensor([at + out_at, tokens + out_tokens], dtype=torch.long).to(device)
    ids[1].clamp_(0, vocab)
    every = len(rows) == scores.shape[0]
    picked = scores if every else scores[rows]
    n = len(rows)
    seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=device)
    seen[ids[0, : len(at)], ids[1, : len(at)]] = True
    counts = torch.zeros((n, vocab + 1), dtype=torch.float32, device=device)
    counts.index_put_(
        (ids[0, len(at) :], ids[1, len(at) :]),
        torch.ones(len(out_at), dtype=torch.float32, device=device),
        accumulate=True,
    )
    seen, counts = seen[:, :vocab], counts[:, :vocab]
    values = torch.tensor([settings.penalties[r] for r in rows], dtype=torch.float32)
    repetition = values[:, 0:1]
    # generate divides by the Python float penalty: CUDA's kernel multiplies by its float32
    # reciprocal instead (see `_plan`): do what it does there
    divide = device.type == "cuda"
    divisor = (torch.ones_like(repetition) / repetition if divide else repetition).to(device)
    repetition = repetition.to(device)
    shrunk = picked / divisor if not divide else picked * divisor
    penalized = torch.where(picked < 0, picked * repetition, shrunk)
    # a tiny penalty can push a score past float32: the largest finite instead (inf - inf in
    # the softmax would be NaN), so the row still chooses its most favoured token
    picked = torch.where(seen, penalized, picked).clamp_max(FLOAT32_MAX)
    frequency, presence = values[:, 1:2].to(device), values[:, 2:3].to(device)
    picked = picked - frequency * counts
    picked = picked - presence * (counts > 0)
    if every:
        return picked
    return scores.index_copy(0, torch.tensor(rows, dtype=torch.long).to(device), picked)


def row_probabilities(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """The distribution (rows, vocab) float32, on the logits' device, that each row's token is
    drawn from by `sample_rows`: for a sampling row the softmax of its warped scores (what
    generate hands to torch.multinomial), for a greedy row all mass on its argmax."""
    _check(logits, settings)
    scores = _scores(logits, settings)
    probs = torch.zeros_like(scores)
    probs.scatter_(1, torch.argmax(scores, dim=-1, keepdim=True), 1.0)
    plan = _plan(settings, scores.shape[1], scores.device)
    if plan is not None:
        rows = plan.table[:, _ROW].to(torch.long)
        sampled = scores if plan.all_rows else scores.index_select(0, rows)
        probs.index_copy_(0, rows, _warped(sampled, plan).softmax(dim=-1))
    return probs


def sample_rows(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """Each row's next token (rows,) int64 on the CPU from its logits (rows, vocab), any device
    and dtype: the argmax of the float32 logits for a greedy row; for a sampling row a draw
    from the softmax of its scores after generate's temperature, top-k and top-p (its own
    values), by inverse CDF with the single uniform u = `uniform(seed, position)`: the token is
    the first, in vocabulary order, whose float64 cumulative probability exceeds u * total.

    Seeded draws are reproducible with no generator state: the same (logits, settings, seed,
    position) give the same token on the same kind of device, whatever the other rows, the
    batch size or the process. The host sends the device one small table and gets back the
    tokens: the logits never leave their device. A row's `banned` tokens are never chosen."""
    _check(logits, settings)
    scores = _scores(logits, settings)
    tokens = torch.argmax(scores, dim=-1)
    plan = _plan(settings, scores.shape[1], scores.device)
    if plan is not None:
        rows = plan.table[:, _ROW].to(torch.long)
        sampled = scores if plan.all_rows else scores.index_select(0, rows)
        probs = _warped(sampled, plan).softmax(dim=-1)
        # float64 so the CDF's rounding is far below any probability that matters. Cumulative
        # sums of nonnegative terms never decrease, and u * total < total (52-bit u), so the
        # first index whose CDF exceeds u * total exists and has probability > 0.
        cdf = probs.to(torch.float64).cumsum(dim=-1)
        target = plan.table[:, _U : _U + 1] * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
        tokens = tokens.index_copy(0, rows, drawn)
    return tokens.cpu()


# --- Log-probabilities ------------------------------------------------------------------------


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, tops: Sequence[int]) -> tuple:
    """For each row of `logits` (rows, vocab), any device and dtype, the log-probability of its
    `targets` token (rows,) and of its `tops[row]` most likely tokens: one log_softmax over the
    rows at once in float32 and one topk at the largest k, then what the rows asked copied to
    the host. Returns (logprobs, top ids, top logprobs), plain Python lists per row."""
    if logits.shape[0] == 0:
        return [], [], []
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = logp.gather(1, targets.to(logp.device, torch.long)[:, None]).squeeze(1).cpu()
    k = min(max(tops, default=0), logp.shape[1])
    if k:
        values, ids = torch.topk(logp, k, dim=-1)
        values, ids = values.cpu().tolist(), ids.cpu().tolist()
    else:
        values = ids = [[] for _ in range(logp.shape[0])]
    return (
        chosen.tolist(),
        [tuple(row[:n]) for row, n in zip(ids, tops, strict=True)],
        [tuple(row[:n]) for row, n in zip(values, tops, strict=True)],
    )
