"""`worker.decode.sample_rows`: every row of a step chosen at once, under generate's warpers
with the row's own values, drawn with a uniform keyed by (seed, position). Checked against
transformers' warpers row by row (ties included), for batch invariance, reproducibility and
the distribution of its draws; the per-row loop it replaces is timed beside it (printed)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.decode import (
    RowSettings,
    row_probabilities,
    sample_rows,
    uniform,
)
from worker.steps import Sampling

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GREEDY = Sampling()

# Different temperature / top-k / top-p per row: top-k above the vocabulary, equal to it and 1,
# top-p 1.0 (off), tiny and near 1, greedy rows in between.
MIXED = (
    Sampling(do_sample=True, temperature=0.7, top_k=50, top_p=0.9),
    Sampling(do_sample=True),
    GREEDY,
    Sampling(do_sample=True, temperature=1.3, top_k=100_000, top_p=0.5),
    Sampling(do_sample=True, temperature=0.5, top_k=3),
    Sampling(do_sample=True, temperature=2.0, top_p=0.05),
    Sampling(do_sample=True, top_k=1, top_p=0.3),
    Sampling(do_sample=True, temperature=0.9, top_k=200, top_p=0.999),
    Sampling(do_sample=True, temperature=1.1, top_k=257, top_p=1.0),
    GREEDY,
    Sampling(do_sample=True, temperature=0.25, top_p=0.8),
    Sampling(do_sample=True, top_k=2, top_p=0.6),
)


def settings_for(samplings, seeds, positions) -> RowSettings:
    return RowSettings.of(samplings, seeds, positions)


def tied_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random logits rounded through bfloat16 (as a model's head gives them): many exact ties,
    at the top, at the top-k boundary and where top-p cuts, which is where the warpers' rules
    (keep ties with the k-th, remove by cumulative probability in sort order) show."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).to(torch.float32)


def reference_probs(row: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One row's distribution as generate builds it: its warpers, in its order, on (1, vocab)."""
    return warped_reference(row[None].to(torch.float32), sampling)


def warped_reference(scores: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(1, vocab) scores to the distribution generate draws from: the argmax when greedy, else
    its warpers in its order (temperature, top-k, top-p, min-p), then softmax."""
    if not sampling.do_sample:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1])[0].float()
    if sampling.temperature != 1.0:
        scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
    if sampling.top_k:
        scores = TopKLogitsWarper(top_k=sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=sampling.top_p)(None, scores)
    if sampling.min_p:
        scores = MinPLogitsWarper(min_p=sampling.min_p)(None, scores)
    return scores.softmax(-1)[0]


def handmade_ties(vocab: int) -> torch.Tensor:
    """Rows whose ties sit exactly on a boundary: three scores tie with the 2nd largest (top-k 2
        keeps all four), five tokens of equal probability straddle a top-p cut, and two tie at the
    top (twice: for a small top-p and for top-p 0)."""
    low = torch.full((vocab,), -20.0)
    at_k = low.clone()
    at_k[[3, 40, 41, 90]] = torch.tensor([5.0, 4.0, 4.0, 4.0])
    at_p = low.clone()
    at_p[[7, 20, 33, 46, 59]] = 2.0
    at_top = low.clone()
    at_top[[11, 12]] = 6.0
    return torch.stack([at_k, at_p, at_top, at_top])


@pytest.mark.parametrize("device", DEVICES)
def test_warped_distribution_matches_transformers_row_by_row(device):
    vocab = 257  # above 16 entries torch's default CPU sort is unstable: tie order matters
    logits = torch.cat([tied_logits(len(MIXED), vocab), handmade_ties(vocab)])
    samplings = (
        *MIXED,
        Sampling(do_sample=True, top_k=2),
        Sampling(do_sample=True, top_p=0.5),
        Sampling(do_sample=True, top_p=0.2),
        Sampling(do_sample=True, temperature=0.6, top_p=0.0),  # only min_tokens_to_keep is left
    )
    rows = len(samplings)
    settings = settings_for(samplings, range(rows), range(rows))
    probs = row_probabilities(logits.to(device), settings).cpu()
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for r, sampling in enumerate(samplings):
        expected = reference_probs(logits[r].to(device), sampling).cpu()
        kept = torch.nonzero(probs[r]).flatten().tolist()
        assert kept == torch.nonzero(expected).flatten().tolist(), f"row {r}: {sampling}"
        torch.testing.assert_close(probs[r], expected, rtol=1e-5, atol=1e-7)
    # the hand-made boundaries did what the warpers' rules say
    assert torch.nonzero(probs[-4]).flatten().tolist() == [3, 40, 41, 90]
    assert 1 < len(torch.nonzero(probs[-3])) < 5  # the cut falls inside the tied group
    assert len(torch.nonzero(probs[-2])) == 1  # top-p 0.2 keeps one of the two tied tops
    assert len(torch.nonzero(probs[-1])) == 1  # top-p 0 too: the one it must keep


def test_top_k_larger_than_vocab_and_top_p_one_change_nothing():
    logits = tied_logits(2, 64)
    plain = settings_for([Sampling(do_sample=True, temperature=0.8)] * 2, [1, 2], [0, 0])
    wide = settings_for(
        [
            Sampling(do_sample=True, temperature=0.8, top_k=10**6),
            Sampling(do_sample=True, temperature=0.8, top_k=64, top_p=1.0),
        ],
        [1, 2],
        [0, 0],
    )
    assert torch.equal(row_probabilities(logits, plain), row_probabilities(logits, wide))
    assert torch.equal(sample_rows(logits, plain), sample_rows(logits, wide))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1000, 32000])
def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch(device, vocab):
    rows = len(MIXED)
    logits = tied_logits(rows, vocab, seed=vocab).to(device)
    g = torch.Generator().manual_seed(1)
    trials = 12 if vocab <= 1000 else 2
    for _ in range(trials):
        seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
        positions = torch.randint(0, 4096, (rows,), generator=g).tolist()
        full = sample_rows(logits, settings_for(MIXED, seeds, positions))
        full_probs = row_probabilities(logits, settings_for(MIXED, seeds, positions))
        order = torch.randperm(rows, generator=g).tolist()
        shuffled = sample_rows(
            logits[order],
            settings_for(
                [MIXED[i] for i in order], [seeds[i] for i in order], [positions[i] for i in order]
            ),
        )
        assert torch.equal(shuffled, full[order])
        for r in range(rows):
            alone = settings_for([MIXED[r]], [seeds[r]], [positions[r]])
            assert sample_rows(logits[r : r + 1], alone).item() == full[r].item(), f"row {r}"
            # bitwise, not just the same token: the whole distribution is the row's own
            assert torch.equal(row_probabilities(logits[r : r + 1], alone)[0], full_probs[r])
        # inside a different batch: the row among copies of the others, in another order
        mates = torch.randint(0, rows, (5,), generator=g).tolist()
        for r in range(rows):
            picked = [*mates[:2], r, *mates[2:]]
            batch = settings_for(
                [MIXED[i] for i in picked],
                [seeds[i] + 1 if i != r else seeds[i] for i in picked],  # other seeds too
                [positions[i] for i in picked],
            )
            assert sample_rows(logits[picked], batch)[2].item() == full[r].item()


def test_same_key_same_token_and_positions_draw_anew():
    vocab = 1000
    logits = torch.zeros(1, vocab)  # flat: every position's u shows in the token
    spread = Sampling(do_sample=True)

    def token(seed: int, position: int) -> int:
        return sample_rows(logits, settings_for([spread], [seed], [position])).item()

    assert [token(7, p) for p in range(5)] == [token(7, p) for p in range(5)]
    by_position = [token(7, p) for p in range(100)]
    assert len(set(by_position)) > 90  # distinct u per position; 100 of 1000 tokens
    assert len({token(s, 3) for s in range(100)}) > 90  # and per seed
    assert len({uniform(7, p) for p in range(10_000)}) == 10_000
    # a batch of one row at many positions equals each drawn alone
    many = settings_for([spread] * 100, [7] * 100, range(100))
    assert sample_rows(logits.expand(100, vocab), many).tolist() == by_position


def splitmix64(state: int):
    """The textbook SplitMix64 generator (Steele, Lea, Flood 2014; Vigna's C code)."""
    while True:
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        yield z ^ (z >> 31)


def test_uniform_is_splitmix64_keyed_by_seed_and_counted_by_position():
    for seed in (0, 7, 2**63 + 5, -1):
        key = next(splitmix64(seed % 2**64))
        stream = splitmix64(key)
        for position in range(40):
            assert uniform(seed, position) == (next(stream) >> 12) / 2**52
    # pinned: a change here changes every seeded request's tokens
    assert uniform(0, 0) == 0.6524484863740321
    assert uniform(7, 100) == 0.9175328114048549
    assert uniform(2**64 + 7, 100) == uniform(7, 100)  # seeds are mod 2**64
    with pytest.raises(ValueError, match="position"):
        uniform(1, -1)


def test_another_process_draws_the_same_tokens():
    logits = tied_logits(len(MIXED), 500)
    settings = settings_for(MIXED, [11 * r for r in range(len(MIXED))], range(len(MIXED)))
    here = sample_rows(logits, settings).tolist()
    code = (
        "import torch, sys; sys.path.insert(0, '.');"
        "from tests.test_sampling import MIXED, settings_for, tied_logits;"
        "from worker.decode import sample_rows;"
        "print(sample_rows(tied_logits(len(MIXED), 500),"
        " settings_for(MIXED, [11 * r for r in range(len(MIXED))], range(len(MIXED)))).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == str(here)


def chi_square(tokens: list[int], probs: list[float]) -> float:
    n = len(tokens)
    counts = [tokens.count(i) for i in range(len(probs))]
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


BASE = [0.05, 0.1, 0.2, 0.25, 0.4]


def expected(sampling: Sampling) -> list[float]:
    """The distribution generate draws from for logits log(BASE), worked out by hand."""
    weights = [p ** (1 / sampling.temperature) for p in BASE]
    if sampling.top_k:
        kth = sorted(weights, reverse=True)[sampling.top_k - 1]
        weights = [w if w >= kth else 0.0 for w in weights]
    total = sum(weights)
    probs = [w / total for w in weights]
    if sampling.top_p < 1:
        # smallest first; drop while the cumulative probability stays <= 1 - top_p
        cumulative, cut = 0.0, set()
        for i in sorted(range(len(probs)), key=probs.__getitem__):
            cumulative += probs[i]
            if cumulative <= 1 - sampling.top_p:
                cut.add(i)
        probs = [0.0 if i in cut else p for i, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


# Chi-square with 4 degrees of freedom (or fewer): P(X > 30) < 5e-6 for the true distribution.
# The draws are fixed (seeds 0..N-1), so this either always passes or always fails.
CHI2_BOUND = 30.0


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(do_sample=True),
        Sampling(do_sample=True, temperature=2.0),
        Sampling(do_sample=True, temperature=0.5, top_k=3),
        Sampling(do_sample=True, top_p=0.6),  # keeps 0.25 and 0.4
    ],
)
def test_draws_follow_the_distribution(sampling):
    n = 20_000
    probs = expected(sampling)
    logits = torch.tensor(BASE).log().expand(n, len(BASE))
    over_seeds = sample_rows(logits, settings_for([sampling] * n, range(n), [0] * n))
    assert chi_square(over_seeds.tolist(), probs) < CHI2_BOUND, over_seeds.bincount()
    # and along one request's positions: successive draws of one seed are as good as seeds
    over_positions = sample_rows(logits, settings_for([sampling] * n, [12345] * n, range(n)))
    assert chi_square(over_positions.tolist(), probs) < CHI2_BOUND, over_positions.bincount()


def test_a_skewed_draw_fails_the_bound():
    """The bound can fail: the draws of one distribution judged against a nearby other."""
    n = 20_000
    logits = torch.tensor(BASE).log().expand(n, len(BASE))
    tokens = sample_rows(logits, settings_for([Sampling(do_sample=True)] * n, range(n), [0] * n))
    assert chi_square(tokens.tolist(), [0.06, 0.1, 0.19, 0.25, 0.4]) > CHI2_BOUND


def test_uniforms_are_uniform():
    n = 20_000
    u = sorted(uniform(s, 0) for s in range(n))
    ks = max(max(abs((i + 1) / n - x), abs(i / n - x)) for i, x in enumerate(u))
    assert ks < 1.95 / math.sqrt(n)  # Kolmogorov-Smirnov, alpha ~ 0.001
    assert all(0.0 <= x < 1.0 for x in u)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_rows_take_the_argmax_in_any_dtype(dtype):
    logits = tied_logits(len(MIXED), 300, seed=3).to(dtype)
    logits[2, [17, 30]] = 50.0  # a tie at the top of a greedy row: the first index wins
    rows = len(MIXED)
    settings = settings_for(MIXED, range(rows), range(rows))
    tokens = sample_rows(logits, settings)
    assert tokens.dtype == torch.int64 and tokens.device.type == "cpu" and tokens.shape == (rows,)
    argmax = logits.to(torch.float32).argmax(-1)
    for r, sampling in enumerate(MIXED):
        if not sampling.do_sample:
            assert tokens[r].item() == argmax[r].item()
    assert tokens[2].item() == 17
    # bfloat16 and float16 widen exactly: the same tokens as their float32 copies
    assert torch.equal(tokens, sample_rows(logits.to(torch.float32), settings))
    all_greedy = settings_for([GREEDY] * rows, [None] * rows, [0] * rows)
    assert torch.equal(sample_rows(logits, all_greedy), argmax)


def test_drawn_tokens_have_nonzero_probability():
    logits = tied_logits(len(MIXED), 400, seed=5)
    rows = len(MIXED)
    for start in range(0, 400, 20):
        settings = settings_for(MIXED, [start + r for r in range(rows)], [start] * rows)
        probs = row_probabilities(logits, settings)
        tokens = sample_rows(logits, settings)
        assert all(probs[r, t] > 0 for r, t in enumerate(tokens.tolist()))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="needs a seed"):
        RowSettings.of([Sampling(do_sample=True)], [None], [0])
    with pytest.raises(ValueError, match="one of each"):
        RowSettings.of([GREEDY, GREEDY], [1], [0, 1])
    with pytest.raises(ValueError, match="temperature"):
        RowSettings.of([Sampling(do_sample=True, temperature=0.0)], [1], [0])
    with pytest.raises(ValueError, match="top_p"):
        RowSettings.of([Sampling(do_sample=True, top_p=1.5)], [1], [0])
    with pytest.raises(ValueError, match="position"):
        RowSettings.of([GREEDY], [None], [-1])
    with pytest.raises(ValueError, match="rows"):
        sample_rows(torch.zeros(2, 10), RowSettings.of([GREEDY], [None], [0]))
    assert sample_rows(torch.zeros(0, 10), RowSettings.of([], [], [])).shape == (0,)


# --- Logits processors: bias, penalties, bad words, min-p -------------------------------------

# Per row: its sampling, its tokens so far and where its output begins in them. Greedy and
# sampled rows, each processor alone and together, rows without any in between.
PROCESSED = (
    (Sampling(repetition_penalty=1.3), 20, 12),
    (Sampling(do_sample=True, temperature=0.7, repetition_penalty=0.8, top_k=40), 33, 5),
    (Sampling(logit_bias=((3, 30.0), (9, -100.0), (250, 2.5))), 4, 4),
    (Sampling(do_sample=True, top_p=0.9, min_p=0.05), 8, 2),
    (Sampling(), 6, 6),
    (Sampling(do_sample=True, bad_words=((17,), (40, 41), (7, 8, 9))), 30, 10),
    (
        Sampling(
            do_sample=True,
            temperature=1.3,
            min_p=0.2,
            repetition_penalty=1.1,
            logit_bias=((0, 1.0),),
            bad_words=((5, 6),),
        ),
        25,
        20,
    ),
    (Sampling(do_sample=True, frequency_penalty=0.7, presence_penalty=-0.4), 40, 10),
    (Sampling(frequency_penalty=-1.5, presence_penalty=2.0, repetition_penalty=1.2), 18, 3),
    (Sampling(do_sample=True, min_p=1.0), 5, 5),
)


def histories(logits: torch.Tensor, seed: int = 0) -> list[list[int]]:
    """Tokens so far per PROCESSED row: repeats (so counts exceed 1), the row's most likely
    token in its output (so that a greedy row's penalty shows), and the heads of the rows' bad
    words at their ends where one is to match."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, (sampling, length, start) in enumerate(PROCESSED):
        tokens = torch.randint(0, 60, (length,), generator=g).tolist()
        if start < length:
            tokens[start] = int(logits[r].argmax())
        for word in sampling.bad_words:
            if len(word) == 2:  # (40, 41): ends with 40 -> 41 banned; (5, 6) too
                tokens[-1] = word[0]
        out.append(tokens)
    return out


def reference_processed(row, history, output_from, sampling) -> torch.Tensor:
    """One row's distribution as transformers' processors and warpers make it, in generate's
    order; frequency and presence penalties (which generate has not) as vLLM's
    apply_penalties writes them, token by token."""
    scores = row[None].to(torch.float32).clone()
    ids = torch.tensor([history], dtype=torch.long)
    if sampling.logit_bias:
        bias = {(t,): b for t, b in sampling.logit_bias}
        scores = SequenceBiasLogitsProcessor(sequence_bias=bias)(ids, scores)
    if sampling.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(ids, scores)
    for token in set(history[output_from:]):
        count = history[output_from:].count(token)
        scores[0, token] -= torch.tensor(sampling.frequency_penalty) * count
        scores[0, token] -= torch.tensor(sampling.presence_penalty)
    if sampling.bad_words:
        words = [list(w) for w in sampling.bad_words]
        scores = NoBadWordsLogitsProcessor(words, eos_token_id=None)(ids, scores)
    return warped_reference(scores, sampling)


def processed_settings(rows, tokens, positions=None) -> RowSettings:
    samplings = [PROCESSED[r][0] for r in rows]
    return RowSettings.of(
        samplings,
        [r + 1 for r in rows],
        positions or [len(tokens[r]) for r in rows],
        histories=[tokens[r] for r in rows],
        output_from=[PROCESSED[r][2] for r in rows],
    )


@pytest.mark.parametrize("device", DEVICES)
def test_processed_distribution_matches_transformers_row_by_row(device):
    vocab = 257
    logits = tied_logits(len(PROCESSED), vocab, seed=9)
    tokens = histories(logits)
    rows = list(range(len(PROCESSED)))
    probs = row_probabilities(logits.to(device), processed_settings(rows, tokens)).cpu()
    bare = [  # the same temperature, top-k and top-p, nothing else
        Sampling(s.do_sample, s.temperature, s.top_k, s.top_p) for s, _, _ in PROCESSED
    ]
    plain = row_probabilities(logits, settings_for(bare, [1] * len(rows), [0] * len(rows)))
    for r, (sampling, _, start) in enumerate(PROCESSED):
        expected = reference_processed(logits[r].to(device), tokens[r], start, sampling).cpu()
        kept = torch.nonzero(probs[r]).flatten().tolist()
        assert kept == torch.nonzero(expected).flatten().tolist(), f"row {r}: {sampling}"
        torch.testing.assert_close(probs[r], expected, rtol=1e-5, atol=1e-7)
        if sampling.processed or sampling.min_p:  # each row's settings changed its distribution
            assert not torch.equal(probs[r], plain[r]), f"row {r}: {sampling}"
    # the bad words: one-token always, two-token after their head, three-token not (no head)
    assert probs[5, 17] == 0 and probs[5, 41] == 0 and probs[6, 6] == 0
    assert probs[9].count_nonzero() == 1  # min_p 1: only the most likely token is left


def test_a_processed_rows_token_does_not_depend_on_the_rest_of_the_batch():
    vocab = 300
    logits = tied_logits(len(PROCESSED), vocab, seed=4)
    tokens = histories(logits, seed=4)
    rows = list(range(len(PROCESSED)))
    full = row_probabilities(logits, processed_settings(rows, tokens))
    drawn = sample_rows(logits, processed_settings(rows, tokens))
    for r in rows:
        alone = processed_settings([r], tokens)
        assert torch.equal(row_probabilities(logits[r : r + 1], alone)[0], full[r]), f"row {r}"
        assert sample_rows(logits[r : r + 1], alone).item() == drawn[r].item()
    picked = [7, 2, 0, 5]
    assert torch.equal(
        row_probabilities(logits[picked], processed_settings(picked, tokens)), full[picked]
    )


def test_a_temperature_near_float32s_limit_samples_and_past_it_is_refused():
    """Found by the fuzzer: a temperature past float32's range is inf where the logits are
    divided, and a masked token's -inf / inf is NaN. Within the range the row samples (its
    masked tokens stay out); past it the row is refused."""
    logits = tied_logits(1, 64)
    held_back = Sampling(do_sample=True, temperature=3e38)
    settings = RowSettings.of([held_back], [1], [0], [[5, 6]])
    probs = row_probabilities(logits, settings)
    assert torch.isfinite(probs).all() and probs[0, 5] == probs[0, 6] == 0
    assert sample_rows(logits, settings).item() not in (5, 6)
    with pytest.raises(ValueError, match="finite in float32"):
        RowSettings.of([Sampling(do_sample=True, temperature=1e300)], [1], [0], [[5]])


def test_scores_pushed_past_float32_stay_numbers():
    """Found by the fuzzer: a tiny repetition penalty divides a positive score past float32,
    and a low temperature can too; inf - inf in the softmax was NaN (a 500). The scores stop
    at float32's largest instead: the rows sample from numbers (the overflowed tokens tie)."""
    logits = tied_logits(2, 64)
    logits[:, 9] = 50.0
    penalized = Sampling(do_sample=True, repetition_penalty=1.2e-38)  # 50 / 1.2e-38 = inf
    cold = Sampling(do_sample=True, temperature=1e-5)
    settings = RowSettings.of(
        [penalized, cold], [1, 2], [3, 3], histories=[[9, 9, 9], [1, 2, 3]], output_from=[0, 0]
    )
    huge = logits * torch.tensor([[1.0], [1e34]])  # row 1: every positive score overflows
    probs = row_probabilities(huge, settings)
    assert torch.isfinite(probs).all() and (probs.sum(-1) - 1).abs().max() < 1e-5
    tokens = sample_rows(huge, settings).tolist()
    assert tokens[0] == 9 and probs[1, tokens[1]] > 0 and huge[1, tokens[1]] > 0


def test_bad_processing_is_refused():
    tokens = [1, 2, 3]
    penalized = Sampling(repetition_penalty=1.2)
    with pytest.raises(ValueError, match="history"):
        RowSettings.of([penalized], [None], [3])
    with pytest.raises(ValueError, match=r"holds 3 tokens.*position 4"):
        RowSettings.of([penalized], [None], [4], histories=[tokens], output_from=[0])
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            RowSettings.of(
                [Sampling(repetition_penalty=bad)],
                [None],
                [3],
                histories=[tokens],
                output_from=[0],
            )
    with pytest.raises(ValueError, match="bias of token 4 must be finite"):
        RowSettings.of([Sampling(logit_bias=((4, float("nan")),))], [None], [0])
    with pytest.raises(ValueError, match="min_p"):
        RowSettings.of([Sampling(do_sample=True, min_p=1.5)], [1], [0])
