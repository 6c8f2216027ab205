"""A checkpoint's own generation settings, end to end, against transformers: the files as a
model ships them (generation_config.json, or config.json alone) read by
`generation.resolve`, their tokens made by the engine on the real model (in-process workers,
two stages), and compared with `generate` on the same files given no settings of ours, so
that transformers reads the files itself. Also what a request asks of the engine beyond
greedy text where it is riskiest: sampling narrowed to one token by the file's warpers,
log-probabilities of mixture-of-experts and hybrid families, and a prompt fed in many small
chunks (sliding windows, recurrent state carried chunk to chunk).

Each test shows its settings change the text (or the chunks are many), so it could fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_engine_edges_parity import Running, assert_scored_as_transformers, prompt_of
from test_families import VOCAB, family_shape
from test_generation import WAIT_S, alone

from coordinator.engine import generation
from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_generate
from worker.steps import Sampling

NEW = 10  # new tokens of each request


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> its test checkpoint (float32, written once per module; never edited)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"settings-{family}") / "ckpt"
            cache[family] = make_checkpoint(root, family_shape(family))
        return cache[family]

    return get


def copy_with(source: Path, where: Path, generation_config: dict | None, **config) -> Path:
    """A copy of the checkpoint at `source` whose generation_config.json is the one given (none
    at all for None) and whose config.json has `config`'s keys changed."""
    root = Path(shutil.copytree(source, where))
    (root / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    if config:
        values = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps(values | config))
    return root


def greedy(root: Path, prompt: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy tokens, no end token: what the settings below are chosen from."""
    return alone(load_index(root), prompt, new)


def generate_reading_the_files(root: Path, prompt: list[int]) -> list[int]:
    """transformers' tokens with only what its files say (the pad id given to quiet it)."""
    out = reference_generate(str(root), torch.tensor([prompt]), num_threads=1, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def ours_reading_the_files(root: Path, prompts: list[list[int]], **config) -> list:
    """Each prompt's request as `generation.resolve` sets it from the files alone, all in one
    engine over two stages: (tokens, finish reason) per prompt."""
    index = load_index(root)
    with Running(index, **config) as engine:
        requests = []
        for prompt in prompts:
            settings = generation.resolve(root, index.config, len(prompt))
            requests.append(
                engine.submit(
                    [prompt],
                    sampling=settings.sampling,
                    max_new_tokens=settings.max_new_tokens,
                    eos_token_ids=settings.eos_token_ids,
                    seed=settings.seed if settings.seed is not None else 5,
                    min_new_tokens=settings.min_new_tokens,
                )
            )
        return [(r.result(WAIT_S)[0], r.finish_reasons[0].value) for r in requests]


def first_new(tokens: list[int], start: int = 2) -> int:
    """The index of the first token past `start` that greedy had not made before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mixtral"])
def test_a_checkpoints_generation_config_gives_the_tokens_generate_gives_reading_it(
    made, tmp_path, family: str
) -> None:
    """The file sets a repetition penalty, a bad word, a suppressed token, a single-token
    sequence bias, two end ids and max_new_tokens, as Qwen's and Llama's files do: each of two
    prompts, batched, makes what generate makes reading the file, to the same stop."""
    source = made(family)
    prompts = [prompt_of(1, 7), prompt_of(2, 5)]
    plain = [greedy(source, p) for p in prompts]
    first, second = plain
    file = {
        "do_sample": False,
        "repetition_penalty": 1.4,
        "bad_words_ids": [[first[1]]],
        "suppress_tokens": [first[3]],
        "sequence_bias": [[[second[2]], -4.0]],
        "eos_token_id": [VOCAB - 1],
        "max_new_tokens": NEW,
    }
    # the second end id: a token the settings make the second prompt's text reach (4th or on)
    unstopped = generate_reading_the_files(copy_with(source, tmp_path / "a", file), prompts[1])
    file["eos_token_id"].insert(0, unstopped[first_new(unstopped, 3)])
    root = copy_with(source, tmp_path / "ckpt", file)
    ours = ours_reading_the_files(root, prompts)
    assert ours[1][1] == "stop"
    for prompt, plain_tokens, (tokens, reason) in zip(prompts, plain, ours, strict=True):
        expected = generate_reading_the_files(root, prompt)
        assert tokens == expected, family
        assert reason == ("stop" if tokens[-1] in file["eos_token_id"] else "length")
        assert tokens != plain_tokens  # the file's settings changed the text


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_generation_settings_named_only_in_config_json_are_those_generate_applies(
    made, tmp_path, family: str
) -> None:
    """No generation_config.json, and a config.json carrying generation settings, as older
    checkpoints do: `from_pretrained` makes the model's generation config of them (an end id,
    a repetition penalty, max_length), and so must we. Of two prompts, one stops at that end
    id and the other at max_length, each where generate stops it, with the penalty's text."""
    source = made(family)
    prompts = [prompt_of(3, 7), prompt_of(10, 5)]
    legacy = {"repetition_penalty": 1.5, "max_length": 19, "eos_token_id": VOCAB - 1}
    unended = copy_with(source, tmp_path / "a", None, **legacy)
    unstopped = [generate_reading_the_files(unended, p) for p in prompts]
    end = next(t for t in unstopped[0][3:] if t not in unstopped[0][:3] + unstopped[1])
    root = copy_with(source, tmp_path / "ckpt", None, **legacy | {"eos_token_id": end})
    ours = ours_reading_the_files(root, prompts)
    for prompt, (tokens, _) in zip(prompts, ours, strict=True):
        assert tokens == generate_reading_the_files(root, prompt)
    assert ours[0][1] == "stop" and ours[0][0][-1] == end
    assert ours[1][1] == "length" and len(prompts[1]) + len(ours[1][0]) == 19
    assert ours[1][0] != greedy(source, prompts[1], len(ours[1][0]))  # the penalty applied


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_max_length_in_generation_config_counts_the_prompt_as_generate_does(
    made, tmp_path, family: str
) -> None:
    """max_length (no max_new_tokens) bounds prompt and text together: prompts of 4 and 9
    tokens under max_length 15 get 11 and 6 new tokens, as generate gives them."""
    source = made(family)
    prompts = [prompt_of(4, 4), prompt_of(5, 9)]
    root = copy_with(source, tmp_path / "ckpt", {"max_length": 15, "eos_token_id": VOCAB - 1})
    ours = ours_reading_the_files(root, prompts)
    for prompt, (tokens, reason) in zip(prompts, ours, strict=True):
        assert tokens == generate_reading_the_files(root, prompt)
        assert len(prompt) + len(tokens) == 15 and reason == "length"


@pytest.mark.parametrize(
    "narrowing",
    [{"top_k": 1}, {"top_p": 1e-6, "top_k": 0}, {"min_p": 1.0, "top_k": 0}],
    ids=["top_k", "top_p", "min_p"],
)
def test_sampling_the_file_narrows_to_one_token_equals_generate_sampling_it(
    made, tmp_path, narrowing: dict
) -> None:
    """The file samples (temperature 0.7, a repetition penalty of 1.6) through a warper that
    leaves one token: whatever the random draw, each step takes the top token of the
    penalised logits, so our sampled path and generate's must agree token for token, which
    they do only if the penalty comes before the warpers in both. The penalty changes the
    text, so the order matters."""
    source = made("llama")
    prompt = prompt_of(6, 7)
    file = {"do_sample": True, "temperature": 0.7, "repetition_penalty": 1.6, **narrowing}
    file |= {"max_new_tokens": 12, "eos_token_id": VOCAB - 1}
    root = copy_with(source, tmp_path / "ckpt", file)
    settings = generation.resolve(root, load_index(root).config, len(prompt)).sampling
    assert settings.do_sample and settings.repetition_penalty == 1.6
    [(tokens, _)] = ours_reading_the_files(root, [prompt])
    torch.manual_seed(0)  # generate's draw; any seed gives the one token left
    assert tokens == generate_reading_the_files(root, prompt)
    assert tokens != greedy(source, prompt, 12)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "qwen3_next", "jamba"])
def test_logprobs_of_routed_and_recurrent_families_equal_transformers_log_softmax(
    made, family: str
) -> None:
    """A greedy request asks for its prompt's log-probabilities (top 2) and its tokens' (top
    3) in a family whose layers route tokens to experts or carry a recurrent state: every
    value equals transformers' log_softmax of its float32 logits over prompt and text, and
    the top ids are its top ids."""
    index = load_index(made(family))
    prompt = prompt_of(7, 9)
    got = []
    with Running(index, prefill_tokens=4) as engine:  # the prompt in three chunks
        request = engine.submit(
            [prompt],
            sampling=Sampling(),
            max_new_tokens=6,
            logprobs=3,
            prompt_logprobs=2,
            on_logprobs=lambda row, scores: got.append(scores),
            on_token=lambda row, token: None,
        )
        tokens = request.result(WAIT_S)[0]
    assert tokens == alone(index, prompt, 6)
    assert_scored_as_transformers(index, prompt, tokens, got, top=3, prompt_top=2)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen3_next", "bamba", "jamba"])
def test_a_prompt_fed_in_many_small_chunks_equals_generate(made, family: str) -> None:
    """A 22-token prompt fed 3 tokens a step (8 chunks, each past the sliding window of 4,
    or carrying the recurrent state on) beside a short request that decodes meanwhile: both
    texts equal generate's on each prompt alone."""
    root = made(family)
    index = load_index(root)
    long, short = prompt_of(8, 22), prompt_of(9, 3)
    with Running(index, prefill_tokens=3) as engine:
        requests = [
            engine.submit([p], sampling=Sampling(), max_new_tokens=8) for p in (short, long)
        ]
        tokens = [r.result(WAIT_S)[0] for r in requests]
        steps = engine.stats.steps
    assert tokens == [greedy(root, short, 8), greedy(root, long, 8)]
    assert steps >= len(long) // 3 + 8  # the prompt did go in small chunks


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_files_min_new_tokens_holds_the_end_token_back_as_generate_does(
    made, tmp_path, family: str
) -> None:
    """The file names an end token greedy makes at its third step and min_new_tokens 6:
    the token cannot end the text before 6 new tokens (generate's
    MinNewTokensLengthLogitsProcessor), and the text is generate's reading the file."""
    source = made(family)
    prompt = prompt_of(11, 6)
    plain = greedy(source, prompt, 12)
    end = plain[2]
    file = {"min_new_tokens": 6, "eos_token_id": [end], "max_new_tokens": 12}
    root = copy_with(source, tmp_path / "ckpt", file)
    [(tokens, reason)] = ours_reading_the_files(root, [prompt])
    assert tokens == generate_reading_the_files(root, prompt)
    assert end not in tokens[:6] and tokens[:2] == plain[:2] and tokens[2] != end
    assert reason == ("stop" if tokens[-1] == end else "length")


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_each_row_of_a_request_stops_at_the_files_end_token_where_generate_stops_it(
    made, tmp_path, family: str
) -> None:
    """One request of three prompts, the file's end ids chosen from two of their greedy
    texts (at different steps): each row ends where generate, reading the file, ends that
    prompt alone, the third at max_new_tokens."""
    source = made(family)
    prompts = [prompt_of(12, 5), prompt_of(13, 8), prompt_of(14, 3)]
    plain = [greedy(source, p) for p in prompts]
    ends = [plain[0][first_new(plain[0], 2)], plain[1][first_new(plain[1], 5)]]
    ends = [e for e in ends if e not in plain[2]] or [VOCAB - 1]
    root = copy_with(source, tmp_path / "ckpt", {"eos_token_id": ends, "max_new_tokens": NEW})
    index = load_index(root)
    settings = generation.resolve(root, index.config, max(len(p) for p in prompts))
    with Running(index) as engine:
        request = engine.submit(
            prompts,
            sampling=settings.sampling,
            max_new_tokens=settings.max_new_tokens,
            eos_token_ids=settings.eos_token_ids,
        )
        rows = request.result(WAIT_S)
    reasons = [r.value for r in request.finish_reasons]
    for prompt, tokens, reason in zip(prompts, rows, reasons, strict=True):
        assert tokens == generate_reading_the_files(root, prompt)
        assert reason == ("stop" if tokens[-1] in ends else "length")
    assert reasons[2] == "length" and "stop" in reasons[:2]
