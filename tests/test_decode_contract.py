"""`worker.decode` at its edges (from the mutation run): the last stage's token choice checked
where a rounding, a boundary or an index decides it. Processors and warpers against
transformers' own classes on the same inputs, bitwise where the CPU computes what they do
(temperature, repetition penalty, top-k, top-p, min-p, bias, bad words); the draw against its
documented rule (the first token whose float64 cumulative probability exceeds u * total); the
log-probabilities against the log-softmax of the float32 logits. All in-process, on the CPU."""

from __future__ import annotations

import math
from fractions import Fraction

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
    NEUTRAL_PENALTIES,
    RowSettings,
    logprobs_of,
    row_probabilities,
    sample_rows,
    uniform,
)
from worker.steps import FLOAT32_MAX, FLOAT32_TINY, Sampling

SAMPLE = Sampling(do_sample=True)


def logits_for(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random logits rounded through bfloat16, as a model's head gives them (ties included)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).to(torch.float32)


def softmax_row(scores: torch.Tensor) -> torch.Tensor:
    """(1, vocab) processed scores to the distribution generate draws from."""
    return scores.softmax(-1)[0]


def test_uniforms_are_each_rows_uniform():
    settings = RowSettings.of([SAMPLE, Sampling(), SAMPLE], [7, 11, -3], [0, 5, 12])
    assert settings.uniforms() == (uniform(7, 0), uniform(11, 5), uniform(-3, 12))
    assert len(set(settings.uniforms())) == 3


@pytest.mark.parametrize(
    "history",
    [[40], [3, 40], [7, 8], [1, 7, 8], [8], [40, 7], []],
    ids=[
        "head-alone",
        "head-last",
        "long-head-alone",
        "long-head-last",
        "half-head",
        "no",
        "empty",
    ],
)
def test_bad_words_are_banned_exactly_where_transformers_bans_them(history):
    """A word's last token is banned where the history ends with the rest of it, including a
    history that is exactly the rest of it, and for a word of three tokens."""
    vocab = 64
    logits = logits_for(1, vocab, seed=2)
    logits[0, [9, 41]] = 20.0  # the words' last tokens would take nearly all the mass
    words = ((40, 41), (7, 8, 9))
    settings = RowSettings.of(
        [Sampling(do_sample=True, bad_words=words)], [1], [len(history)], histories=[history]
    )
    ids = torch.tensor([history], dtype=torch.long).reshape(1, len(history))
    processor = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=None)
    expected = softmax_row(processor(ids, logits.clone()))
    assert torch.equal(row_probabilities(logits, settings)[0], expected)
    banned = {41} if history[-1:] == [40] else {9} if history[-2:] == [7, 8] else set()
    assert {t for t in (9, 41) if expected[t] == 0} == banned  # the reference did ban them


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_small_top_k_keeps_what_transformers_keeps(top_k):
    logits = logits_for(3, 128, seed=3)
    logits[1, [5, 77]] = 30.0  # a tie at the top: both stay, even for top-k 1
    settings = RowSettings.of([Sampling(do_sample=True, top_k=top_k)] * 3, [1, 2, 3], [0] * 3)
    probs = row_probabilities(logits, settings)
    for r in range(3):
        expected = softmax_row(TopKLogitsWarper(top_k=top_k)(None, logits[r : r + 1].clone()))
        assert torch.equal(probs[r], expected), f"row {r}"
    assert probs[1].count_nonzero() == 2


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.75, 6), (0.875, 7), (0.5 + 1e-9, 4), (0.25 + 1e-9, 2)],
)
def test_top_p_removes_up_to_its_float32_cut_as_transformers(top_p, kept):
    """Eight equal tokens: every cumulative probability is a multiple of 1/8, exact. A cut
    that a cumulative probability meets exactly removes that token (`<=`), and 1 - top_p is
    compared in float32 (0.5 - 1e-9 rounds to 0.5), as TopPLogitsWarper compares."""
    logits = torch.zeros(1, 8)
    settings = RowSettings.of([Sampling(do_sample=True, top_p=top_p)], [1], [0])
    probs = row_probabilities(logits, settings)[0]
    expected = softmax_row(TopPLogitsWarper(top_p=top_p)(None, logits.clone()))
    assert torch.equal(probs, expected)
    assert probs.count_nonzero() == kept


@pytest.mark.parametrize(
    ("second", "min_p"),
    [(-1.488769769668579, 0.2256501017750334), (-2.3046653866767883, 0.09979219907143655)],
)
def test_min_p_floor_is_rounded_in_float32_as_transformers(second, min_p):
    """Token 1's probability is min_p times the top's to within float32 rounding (found by a
    search): MinPLogitsWarper's float32 floor keeps it, a float64 floor would not."""
    logits = torch.tensor([[0.0, second, -1.0, -2.5]])
    settings = RowSettings.of([Sampling(do_sample=True, min_p=min_p)], [1], [0])
    probs = row_probabilities(logits, settings)[0]
    expected = softmax_row(MinPLogitsWarper(min_p=min_p)(None, logits.clone()))
    assert torch.equal(probs, expected)
    assert probs[1] > 0 and probs[3] == 0  # at the floor it stays; well below it goes


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.3])
def test_temperature_divides_as_transformers_bitwise_on_the_cpu(temperature):
    """On the CPU generate divides by the temperature: x * (1 / t) differs in the last bit for
    many x, and then so do the probabilities."""
    logits = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1)) * 3
    settings = RowSettings.of(
        [Sampling(do_sample=True, temperature=temperature)] * 3, [1, 2, 3], [0] * 3
    )
    probs = row_probabilities(logits, settings)
    for r in range(3):
        warped = TemperatureLogitsWarper(temperature)(None, logits[r : r + 1].clone())
        assert torch.equal(probs[r], softmax_row(warped)), f"row {r}"


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers_bitwise(penalty):
    """Token 0 and negative scores among the penalized (a negative score is multiplied, a
    positive one divided); the second row penalizes nearly the whole vocabulary."""
    vocab = 64
    logits = logits_for(2, vocab, seed=5)
    logits[:, 0], logits[:, 1], logits[:, 2] = 4.0, 3.0, -3.0
    histories = [[0, 2, 5, 9, 2, 0], list(range(2, vocab))]
    settings = RowSettings.of(
        [Sampling(do_sample=True, repetition_penalty=penalty)] * 2,
        [1, 2],
        [len(h) for h in histories],
        histories=histories,
        output_from=[3, 10],
    )
    probs = row_probabilities(logits, settings)
    for r, history in enumerate(histories):
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        expected = softmax_row(processor(torch.tensor([history]), logits[r : r + 1].clone()))
        assert torch.equal(probs[r], expected), f"row {r}"


def test_penalties_ignore_history_ids_beyond_the_vocabulary():
    """Ids past the logits' width (never the model's choice) penalize nothing and raise
    nothing: the same as transformers on the history without them."""
    vocab = 32
    history = [3, vocab, 5, vocab + 7, 3, vocab + 1]
    settings = RowSettings.of(
        [Sampling(do_sample=True, repetition_penalty=1.3)],
        [1],
        [len(history)],
        histories=[history],
        output_from=[1],
    )
    logits = logits_for(1, vocab, seed=6)
    inside = torch.tensor([[t for t in history if t < vocab]])
    expected = softmax_row(RepetitionPenaltyLogitsProcessor(1.3)(inside, logits.clone()))
    assert torch.equal(row_probabilities(logits, settings)[0], expected)


def test_penalized_rows_at_position_zero_have_nothing_to_penalize():
    logits = logits_for(2, 40, seed=7)
    penalized = Sampling(do_sample=True, repetition_penalty=1.3, presence_penalty=0.5)
    settings = RowSettings.of(
        [penalized, penalized], [1, 2], [0, 0], histories=[[], []], output_from=[0, 0]
    )
    probs = row_probabilities(logits, settings)
    nothing = torch.empty((1, 0), dtype=torch.long)
    for r in range(2):
        processed = RepetitionPenaltyLogitsProcessor(1.3)(nothing, logits[r : r + 1].clone())
        assert torch.equal(probs[r], softmax_row(processed))


def test_as_many_penalized_rows_as_the_vocabulary_beside_a_plain_row():
    """Four penalized rows and a plain one over a vocabulary of four: only the penalized rows
    change, each as transformers changes it."""
    vocab = 4
    logits = logits_for(5, vocab, seed=8)
    histories = [[0], [], [1, 2], [3], [0, 3]]
    samplings = [Sampling(do_sample=True, repetition_penalty=1.5)] * 5
    samplings[1] = SAMPLE
    settings = RowSettings.of(
        samplings,
        [1, 2, 3, 4, 5],
        [len(h) for h in histories],
        histories=histories,
        output_from=[0] * 5,
    )
    probs = row_probabilities(logits, settings)
    assert probs.shape == (5, vocab)
    for r, history in enumerate(histories):
        scores = logits[r : r + 1].clone()
        if samplings[r] != SAMPLE:
            scores = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([history]), scores)
        assert torch.equal(probs[r], softmax_row(scores)), f"row {r}"


def test_logit_bias_adds_as_transformers_and_ids_beyond_the_vocabulary_are_ignored():
    vocab = 32
    logits = logits_for(1, vocab, seed=9)
    bias = ((0, 2.0), (5, -1.5), (9, 0.5))
    sampling = Sampling(do_sample=True, logit_bias=(*bias, (vocab, 3.0), (vocab + 4, -2.0)))
    settings = RowSettings.of([sampling], [1], [0])
    processor = SequenceBiasLogitsProcessor(sequence_bias={(t,): b for t, b in bias})
    expected = softmax_row(processor(torch.tensor([[1]]), logits.clone()))
    assert torch.equal(row_probabilities(logits, settings)[0], expected)


def test_banned_token_zero_is_never_chosen_and_ids_beyond_the_vocabulary_are_ignored():
    vocab = 32
    logits = logits_for(2, vocab, seed=10)
    logits[:, 0] = 30.0  # token 0 would be the choice
    settings = RowSettings.of(
        [Sampling(), SAMPLE], [None, 1], [0, 0], banned=[[0, vocab], [vocab + 3, 0]]
    )
    processor = NoBadWordsLogitsProcessor([[0]], eos_token_id=None)
    expected = [
        softmax_row(processor(torch.tensor([[1]]), logits[r : r + 1].clone())) for r in (0, 1)
    ]
    assert sample_rows(logits, settings)[0].item() == int(expected[0].argmax())
    assert torch.equal(row_probabilities(logits, settings)[1], expected[1])
    assert expected[1][0] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_processed_in_float32(dtype):
    logits = logits_for(2, 64, seed=11).to(dtype)
    biased = Sampling(do_sample=True, logit_bias=((3, 0.3),))
    settings = RowSettings.of([SAMPLE, biased], [1, 2], [0, 0])
    probs = row_probabilities(logits, settings)
    assert probs.dtype == torch.float32
    wide = logits.to(torch.float32)
    assert torch.equal(probs[0], softmax_row(wide[0:1]))
    processor = SequenceBiasLogitsProcessor(sequence_bias={(3,): 0.3})
    assert torch.equal(probs[1], softmax_row(processor(torch.tensor([[1]]), wide[1:2].clone())))


# --- The draw ----------------------------------------------------------------------------------

FLAT_VOCAB = 3 * 2**16  # 1/vocab is inexact in float32: the total is 1 + 3e-8, not 1
SEED = 20240611
# Positions whose u (for SEED) lies within float32 rounding, or 3e-8, of a token's edge in the
# flat row (found by a search over positions 0..20000), and two ordinary ones.
NEAR_EDGES = (192, 495, 853, 867, 1100, 1143, 5, 17)


def test_a_draw_is_the_first_token_whose_float64_cumulative_probability_exceeds_u_total():
    """In a flat row every token has the same float32 probability p, so token i's float64
    cumulative probability is (i + 1) * p exactly, the total is vocab * p, and the rule picks
    floor(u * total / p): u kept to its 52 bits, the total not taken as 1, the CDF summed in
    float64."""
    rows = len(NEAR_EDGES)
    logits = torch.zeros(rows, FLAT_VOCAB)
    settings = RowSettings.of([SAMPLE] * rows, [SEED] * rows, NEAR_EDGES)
    probs = row_probabilities(logits, settings)
    p = float(probs[0, 0])
    assert (probs == p).all()
    total = FLAT_VOCAB * p  # exact in float64
    expected = [math.floor(Fraction(uniform(SEED, n) * total) / Fraction(p)) for n in NEAR_EDGES]
    assert sample_rows(logits, settings).tolist() == expected


# Seeds whose uniform at position 0 is exactly 0 and exactly 0.5 (SplitMix64's mix inverted:
# one draw in 2**52 each).
U_ZERO_SEED = 14258097010372255221
U_HALF_SEED = 16394053443022800329


def test_a_draw_on_an_exact_cumulative_edge_takes_the_next_token():
    """u * total equal to a cumulative probability: that token's cumulative does not exceed
    it, so the next is drawn. With u = 0 and token 0 banned (cumulative 0) that keeps a banned
    token from being drawn."""
    assert uniform(U_ZERO_SEED, 0) == 0.0 and uniform(U_HALF_SEED, 0) == 0.5
    logits = torch.zeros(2, 4)  # row 1: cumulative 0.25, 0.5, 0.75, 1, exact
    settings = RowSettings.of(
        [SAMPLE, SAMPLE], [U_ZERO_SEED, U_HALF_SEED], [0, 0], banned=[[0], []]
    )
    assert sample_rows(logits, settings).tolist() == [1, 2]


# --- Log-probabilities --------------------------------------------------------------------------


def test_logprobs_of_one_half_precision_row_are_those_of_its_float32_logits():
    logits = logits_for(1, 50, seed=12).to(torch.bfloat16)
    targets = torch.tensor([7], dtype=torch.int32)
    values, ids, tops = logprobs_of(logits, targets, [3])
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    best = torch.topk(logp, 3, dim=-1)
    assert values == [logp[0, 7].item()]
    assert ids == [tuple(best.indices[0].tolist())]
    assert tops == [tuple(best.values[0].tolist())]


def test_logprobs_of_rows_that_ask_for_no_top_tokens():
    logits = logits_for(3, 50, seed=13)
    targets = torch.tensor([1, 2, 3], dtype=torch.int16)  # any integer dtype
    values, ids, tops = logprobs_of(logits, targets, [0, 0, 0])
    logp = torch.log_softmax(logits, dim=-1)
    assert values == [logp[r, t].item() for r, t in enumerate(targets.tolist())]
    assert ids == [(), (), ()] and tops == [(), (), ()]


# --- Settings: what is refused, by name, and what is taken -----------------------------------

TWO_GREEDY = dict(
    greedy=(True, True),
    temperature=(1.0, 1.0),
    top_k=(0, 0),
    top_p=(1.0, 1.0),
    seed=(0, 0),
    position=(0, 0),
)


def test_settings_whose_fields_do_not_match_the_rows_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^every field needs 2 row\(s\), got \[2, 1, 2, 2, 2\]$"):
        RowSettings(**{**TWO_GREEDY, "top_k": (0,)})
    for name, value in (("banned", ((1,),)), ("min_p", (0.1, 0.2, 0.3)), ("bias", ((),))):
        with pytest.raises(ValueError, match=rf"^{name} needs 2 row\(s\), got {len(value)}$"):
            RowSettings(**TWO_GREEDY, **{name: value})
    # penalties and history without output_from
    with pytest.raises(ValueError, match=r"^penalties need each row's history and output_from$"):
        RowSettings(**TWO_GREEDY, penalties=(NEUTRAL_PENALTIES,) * 2, history=((), ()))
    allowed = torch.full((3, 5), -1, dtype=torch.int32)  # 3 rows of 5 words for 2 rows
    with pytest.raises(ValueError, match=r"^allowed needs 2 row\(s\), got 3$"):
        RowSettings(**TWO_GREEDY, allowed=allowed)
    with pytest.raises(
        ValueError, match=r"^1 samplings, 2 seeds and 2 positions: need one of each per row$"
    ):
        RowSettings.of([Sampling()], [1, 2], [0, 1])
    with pytest.raises(ValueError, match=r"^banned needs 2 row\(s\), got 1$"):
        RowSettings.of([Sampling()] * 2, [None] * 2, [0, 0], banned=[[1]])
    with pytest.raises(ValueError, match=r"^histories needs 2 row\(s\), got 1$"):
        RowSettings.of([Sampling()] * 2, [None] * 2, [0, 0], histories=[[1]])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (Sampling(do_sample=True, temperature=0.0), "temperature must be > 0"),
        (Sampling(do_sample=True, top_k=-1), r"top_k must be >= 0 \(0: off\), got -1$"),
        (Sampling(do_sample=True, top_p=1.5), "top_p must be in"),
        (Sampling(do_sample=True, min_p=1.5), "min_p must be in"),
    ],
)
def test_a_sampling_row_after_a_greedy_row_is_still_checked(bad, message):
    with pytest.raises(ValueError, match=rf"^row 1: {message}"):
        RowSettings.of([Sampling(), bad], [None, 1], [0, 0])


def test_bad_penalties_are_refused_by_name():
    tokens = [1, 2, 3]
    for frequency, presence in ((float("inf"), 0.0), (0.0, float("nan"))):
        with pytest.raises(
            ValueError,
            match=rf"^row 0: frequency and presence penalties must be finite, got "
            rf"{frequency} and {presence}$",
        ):
            RowSettings.of(
                [Sampling(frequency_penalty=frequency, presence_penalty=presence)],
                [None],
                [3],
                histories=[tokens],
                output_from=[0],
            )
    with pytest.raises(ValueError, match=r"^row 0: output_from 4 is not in its history$"):
        RowSettings.of(
            [Sampling(repetition_penalty=1.2)], [None], [3], histories=[tokens], output_from=[4]
        )


def test_the_extreme_temperature_and_repetition_penalties_float32_holds_are_taken():
    """The bounds are inclusive: a temperature of float32's largest, a repetition penalty of
    its largest or of its smallest normal, each as transformers applies it."""
    logits = logits_for(1, 32, seed=14)
    hottest = RowSettings.of([Sampling(do_sample=True, temperature=FLOAT32_MAX)], [1], [0])
    expected = softmax_row(TemperatureLogitsWarper(FLOAT32_MAX)(None, logits.clone()))
    assert torch.equal(row_probabilities(logits, hottest)[0], expected)
    history = [int(t) for t in torch.nonzero(logits[0] < 0).flatten()[:5]]  # negative scores
    for penalty in (FLOAT32_MAX, FLOAT32_TINY):
        settings = RowSettings.of(
            [Sampling(do_sample=True, repetition_penalty=penalty)],
            [1],
            [len(history)],
            histories=[history],
            output_from=[0],
        )
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        expected = softmax_row(processor(torch.tensor([history]), logits.clone()))
        assert torch.equal(row_probabilities(logits, settings)[0], expected), penalty


def test_one_token_bad_words_need_no_history_and_add_to_the_banned_tokens():
    """A row's banned tokens (its end tokens before min_tokens) stay banned beside its bad
    words, and one-token bad words are banned with no history given."""
    logits = logits_for(1, 32, seed=15)
    sampling = Sampling(do_sample=True, bad_words=((17,), (20,)))
    settings = RowSettings.of([sampling], [1], [0], banned=[[5]])
    processor = NoBadWordsLogitsProcessor([[5], [17], [20]], eos_token_id=None)
    expected = softmax_row(processor(torch.tensor([[1]]), logits.clone()))
    probs = row_probabilities(logits, settings)[0]
    assert torch.equal(probs, expected)
    assert probs[5] == probs[17] == probs[20] == 0
