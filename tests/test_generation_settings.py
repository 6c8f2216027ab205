"""A request's settings (`coordinator.engine.generation`), in-process and without a model: the
checkpoint's generation_config.json as transformers' `GenerationConfig` reads it and
`generate` fills it in, the arguments over it, the range checks, the KV budget's refusals,
and the OpenAI-style knobs (`sampling_options`) as the options `Job.generate` takes."""

from __future__ import annotations

import inspect
import json
import os

import pytest
from transformers import GenerationConfig

from coordinator.engine import generation
from coordinator.engine.generation import GenerationError, KvBudget, Settings
from worker.steps import Sampling

# no context window named: no request is refused for its length
UNBOUNDED: dict = {}


def write(root, values: dict) -> None:
    (root / "generation_config.json").write_text(json.dumps(values))


def as_generate_runs(config: GenerationConfig):
    """The value `generate` runs with: the config's, else generate's own default for it."""
    defaults = GenerationConfig._get_default_generation_params()

    def value(key: str):
        given = getattr(config, key)
        return defaults.get(key) if given is None else given

    return value


FILES = {
    "sampling": {
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "eos_token_id": [5, 6],
        "pad_token_id": 7,
        "max_length": 30,
        "min_new_tokens": 2,
    },
    "defaults": {"eos_token_id": 5},
    "max_new_tokens_over_max_length": {
        "do_sample": False,
        "temperature": 0.7,
        "max_new_tokens": 9,
        "max_length": 100,
        "eos_token_id": [4],
    },
}


@pytest.mark.parametrize("name", FILES)
def test_the_file_is_taken_as_transformers_takes_it(tmp_path, name) -> None:
    """Each setting of a written generation_config.json, and generate's defaults where it
    sets none, as `GenerationConfig.from_pretrained` reads the same file and generate runs
    it: max_new_tokens over max_length (a total: prompt + new tokens), the pad token the first
    end token where unset."""
    write(tmp_path, FILES[name])
    config = GenerationConfig.from_pretrained(tmp_path)
    theirs = as_generate_runs(config)
    prompt = 12
    settings = generation.resolve(tmp_path, UNBOUNDED, prompt)
    s = settings.sampling
    assert s.do_sample == theirs("do_sample")
    assert s.temperature == theirs("temperature")
    assert s.top_k == theirs("top_k")
    assert s.top_p == theirs("top_p")
    assert s.min_p == (theirs("min_p") or 0.0)
    assert s.repetition_penalty == theirs("repetition_penalty")
    eos = theirs("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    assert settings.eos_token_ids == eos
    pad = theirs("pad_token_id")
    assert settings.pad_token_id == (eos[0] if pad is None else pad)
    if theirs("max_new_tokens") is not None:
        expected = theirs("max_new_tokens")
    elif config.max_length is not None:
        expected = theirs("max_length") - prompt
    else:  # generate's default max_length (20) counts new tokens when nothing sets it
        expected = theirs("max_length")
    assert settings.max_new_tokens == expected
    assert settings.min_new_tokens == (theirs("min_new_tokens") or 0)


def test_without_a_file_the_end_and_pad_tokens_come_from_config_json(tmp_path) -> None:
    """No generation_config.json: config.json's end and pad tokens, as transformers'
    `GenerationConfig.from_model_config` takes them for a model loaded from these files."""
    config = {"bos_token_id": 1, "eos_token_id": 3, "pad_token_id": 7, "vocab_size": 32}
    theirs = GenerationConfig.from_model_config(dict(config))
    settings = generation.resolve(tmp_path, config, 4)
    assert settings.eos_token_ids == (theirs.eos_token_id,) == (3,)
    assert settings.pad_token_id == theirs.pad_token_id == 7
    listed = {"eos_token_id": [3, 4], "vocab_size": 32}
    theirs = GenerationConfig.from_model_config(dict(listed))
    settings = generation.resolve(tmp_path, listed, 4)
    assert settings.eos_token_ids == tuple(theirs.eos_token_id) == (3, 4)
    assert settings.pad_token_id == 3  # as generate pads: the first end token


def test_without_a_file_config_json_and_its_text_config_give_generates_settings(tmp_path):
    """No generation_config.json, and a config.json that carries generation settings (older
    checkpoints), some only in its decoder's text_config (a multimodal model's): the values
    `GenerationConfig.from_model_config` makes of it, which `from_pretrained` gives the
    model; one that generate would apply and this loop does not is refused by name."""
    config = {
        "vocab_size": 32,
        "repetition_penalty": 1.3,
        "max_length": 30,
        "do_sample": True,
        "temperature": 0.5,
        "top_k": 7,
        "text_config": {"eos_token_id": 5, "top_p": 0.9, "repetition_penalty": 2.0},
    }
    theirs = GenerationConfig.from_model_config(json.loads(json.dumps(config)))
    settings = generation.resolve(tmp_path, config, 4)
    sampling = settings.sampling
    assert sampling.repetition_penalty == theirs.repetition_penalty == 1.3  # the top level's
    assert settings.eos_token_ids == (theirs.eos_token_id,) == (5,)  # only in text_config
    assert sampling.top_p == theirs.top_p == 0.9
    assert (sampling.do_sample, sampling.temperature, sampling.top_k) == (True, 0.5, 7)
    assert (theirs.do_sample, theirs.temperature, theirs.top_k) == (True, 0.5, 7)
    assert settings.max_new_tokens == theirs.max_length - 4 == 26
    for inner in ("decoder", "generator"):  # an encoder-decoder's, a RAG model's
        nested = {"vocab_size": 32, inner: {"eos_token_id": 6, "top_k": 3}}
        theirs = GenerationConfig.from_model_config(json.loads(json.dumps(nested)))
        settings = generation.resolve(tmp_path, nested, 4)
        assert settings.eos_token_ids == (theirs.eos_token_id,) == (6,)
        assert settings.sampling.top_k == theirs.top_k == 3
    named = r"^config\.json \(there is no generation_config\.json\) sets num_beams=4, .* to 1"
    with pytest.raises(GenerationError, match=named):
        generation.resolve(tmp_path, {**config, "num_beams": 4}, 4)
    with pytest.raises(GenerationError, match=r"max_length 30 of config\.json \(there is no"):
        generation.resolve(tmp_path, config, 30)
    # with a generation_config.json, a refusal names it, and the length's names max_new_tokens
    write(tmp_path, {"num_beams": 2, "max_length": 10})
    with pytest.raises(GenerationError, match=r"^generation_config\.json sets num_beams=2, "):
        generation.resolve(tmp_path, config, 4)
    write(tmp_path, {"max_length": 10})
    with pytest.raises(GenerationError, match=r"max_length 10 of generation_config\.json:") as e:
        generation.resolve(tmp_path, config, 10)
    assert e.value.param == "max_new_tokens"


def test_a_rewritten_file_is_read_again(tmp_path) -> None:
    """The file is read once per version: a new size with the same mtime, or the same size
    with a new mtime, is a new version and its values are taken."""
    path = tmp_path / "generation_config.json"
    write(tmp_path, {"max_new_tokens": 5})
    assert generation.resolve(tmp_path, UNBOUNDED, 3).max_new_tokens == 5
    before = path.stat()
    write(tmp_path, {"max_new_tokens": 12})  # one byte longer
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    assert generation.resolve(tmp_path, UNBOUNDED, 3).max_new_tokens == 12
    before = path.stat()
    write(tmp_path, {"max_new_tokens": 13})  # the same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == before.st_size
    assert generation.resolve(tmp_path, UNBOUNDED, 3).max_new_tokens == 13


def test_the_arguments_win_over_the_file(tmp_path) -> None:
    write(
        tmp_path,
        {
            "do_sample": True,
            "top_k": 20,
            "top_p": 0.8,
            "min_p": 0.1,
            "min_new_tokens": 3,
            "pad_token_id": 7,
            "eos_token_id": 2,
            "sequence_bias": [[[4], 1.5]],
        },
    )
    settings = generation.resolve(
        tmp_path,
        UNBOUNDED,
        3,
        do_sample=False,
        top_k=5,
        top_p=0.5,
        min_p=0.2,
        min_new_tokens=0,
        pad_token_id=9,
        logit_bias={6: -1.0},
        frequency_penalty=0.5,
        presence_penalty=0.25,
        guide="a+",
        seed=11,
    )
    s = settings.sampling
    assert (s.do_sample, s.top_k, s.top_p, s.min_p) == (False, 5, 0.5, 0.2)
    assert s.logit_bias == ((6, -1.0),)
    assert (s.frequency_penalty, s.presence_penalty, s.guide) == (0.5, 0.25, "a+")
    assert (settings.min_new_tokens, settings.pad_token_id, settings.seed) == (0, 9, 11)
    assert generation.resolve(tmp_path, UNBOUNDED, 3, min_new_tokens=1).min_new_tokens == 1
    assert generation.resolve(tmp_path, UNBOUNDED, 3, top_k=None).sampling.top_k is None
    # and where none is given, the file's: its single-token sequence_bias and its pad token
    settings = generation.resolve(tmp_path, UNBOUNDED, 3)
    assert settings.sampling.logit_bias == ((4, 1.5),) and settings.pad_token_id == 7
    assert (settings.sampling.guide, settings.seed) == ("", None)


def test_vllm_style_keeps_the_pad_token_and_a_requests_bad_words_on_end_tokens(tmp_path) -> None:
    """vLLM's style takes the file's pad token, and bans the words a request names even where
    one is an end token alone (generate drops those; vLLM does not)."""
    write(tmp_path, {"eos_token_id": [3, 4], "pad_token_id": 7})
    settings = generation.resolve(tmp_path, UNBOUNDED, 3, style="vllm", bad_words_ids=[[3], [8]])
    assert settings.pad_token_id == 7
    assert settings.sampling.bad_words == ((3,), (8,))
    generate = generation.resolve(tmp_path, UNBOUNDED, 3, bad_words_ids=[[3], [8]])
    assert generate.sampling.bad_words == ((8,),)


def test_bad_arguments_are_refused_by_name(tmp_path) -> None:
    with pytest.raises(
        GenerationError, match=r"^logit_bias must be a dict of token id -> bias$"
    ) as e:
        generation.resolve(tmp_path, UNBOUNDED, 3, logit_bias=[(4, 1.0)])
    assert e.value.param == "logit_bias"
    with pytest.raises(
        GenerationError, match=r"^bad_words_ids must be a list of token id lists$"
    ) as e:
        generation.resolve(tmp_path, UNBOUNDED, 3, bad_words_ids=5)
    assert e.value.param == "bad_words_ids"
    with pytest.raises(GenerationError, match=r"style='hf': expected one of generate, vllm$"):
        generation.resolve(tmp_path, UNBOUNDED, 3, style="hf")
    write(tmp_path, {"sequence_bias": [[[4]]]})  # no bias: transformers refuses it too
    with pytest.raises(
        GenerationError, match=r"sequence_bias entry \[\[4\]\] is not \(\[token ids\], bias\)"
    ):
        generation.resolve(tmp_path, UNBOUNDED, 3)


def test_past_the_context_the_error_names_max_new_tokens(tmp_path) -> None:
    config = {"max_position_embeddings": 16}
    with pytest.raises(GenerationError, match=r"shorten the prompt or lower max_new_tokens$") as e:
        generation.resolve(tmp_path, config, 10, max_new_tokens=7)
    assert e.value.param == "max_new_tokens"


def settings(*, max_new_tokens: int = 4, min_new_tokens: int = 0, **sampling) -> Settings:
    return Settings(
        max_new_tokens=max_new_tokens,
        sampling=Sampling(**sampling),
        eos_token_ids=(),
        pad_token_id=0,
        min_new_tokens=min_new_tokens,
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": -1}, r"max_new_tokens=-1 must be >= 0"),
        ({"do_sample": True, "temperature": 0.0}, r"temperature=0.0 must be > 0 when sampling"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_k": -1}, r"top_k=-1 must be >= 0"),
        ({"min_new_tokens": -1}, r"min_new_tokens=-1 must be >= 0"),
    ],
)
def test_settings_refuse_values_out_of_range(fields, message) -> None:
    with pytest.raises(GenerationError, match=message):
        settings(**fields)


def test_settings_take_the_edges_of_their_ranges() -> None:
    assert settings(max_new_tokens=0).max_new_tokens == 0
    assert settings(top_p=1.0, top_k=0).sampling.top_p == 1.0
    assert settings(do_sample=False, temperature=0.0).sampling.temperature == 0.0  # greedy


def test_the_kv_budget_names_the_setting_at_fault() -> None:
    budget = KvBudget(max_batch=2, max_seq_len=10)
    budget.check(2, 10)  # the edges fit
    with pytest.raises(GenerationError, match=r"^11 tokens per sequence .* max_seq_len=10") as e:
        budget.check(1, 11)
    assert e.value.param == "max_new_tokens"
    assert str(e.value).endswith("load the job with a larger max_seq_len")
    with pytest.raises(GenerationError, match=r"^3 sequence\(s\) exceed .* max_batch=2") as e:
        budget.check(3, 5)
    assert e.value.param == "num_sequences"
    KvBudget(max_batch=1, max_seq_len=1).check(1, 1)
    with pytest.raises(GenerationError) as e:
        KvBudget(max_batch=4, max_seq_len=0).check(1, 1)
    assert str(e.value) == (  # the operator's fix: the load flags, with an example
        "this job reserved no KV cache (max_seq_len=0), so it cannot generate: load it with "
        "max_seq_len (prompt + new tokens per sequence) and max_batch (sequences at once), e.g. "
        "--max-seq-len 512 --max-batch 4; the plan then keeps room for them"
    )


# OpenAI's knobs (temperature, top_p, top_k, seed) -> Job.generate's options.
KNOBS = [
    ((None, None, None, None), {"seed": None}),  # nothing asked: the file decides
    ((0, 0.5, 40, 3), {"seed": 3, "do_sample": False, "top_p": 0.5, "top_k": 40}),
    ((0.5, None, None, 1), {"seed": 1, "do_sample": True, "temperature": 0.5}),
    ((1.0, None, None, None), {"seed": None, "do_sample": True, "temperature": 1.0}),
    ((None, 0.5, None, None), {"seed": None, "do_sample": True, "top_p": 0.5}),
    ((None, 1.0, None, None), {"seed": None, "top_p": 1.0}),  # top_p 1: no knob turned
    ((None, None, 5, None), {"seed": None, "do_sample": True, "top_k": 5}),
    ((None, None, 0, None), {"seed": None, "top_k": 0}),  # top_k 0: off
]


@pytest.mark.parametrize(("knobs", "options"), KNOBS)
def test_openai_knobs_become_generate_options(tmp_path, knobs, options) -> None:
    from coordinator.runtime.job import Job

    got = generation.sampling_options(*knobs)
    assert got == options
    assert set(got) <= set(inspect.signature(Job.generate).parameters)
    # as Job.generate resolves them, over a file that samples at temperature 0.7
    write(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.9})
    resolved = generation.resolve(tmp_path, UNBOUNDED, 3, **got)
    s = resolved.sampling
    temperature, top_p, top_k, seed = knobs
    assert s.do_sample == (temperature != 0)  # OpenAI's: greedy only at temperature 0
    assert s.temperature == (temperature or 0.7)  # greedy: the file's, unused
    assert s.top_p == (0.9 if top_p is None else top_p)
    assert s.top_k == (50 if top_k is None else top_k)
    assert resolved.seed == seed


def test_a_negative_temperature_is_refused() -> None:
    with pytest.raises(GenerationError, match=r"temperature=-0.1 must be >= 0 \(0: greedy\)"):
        generation.sampling_options(-0.1, None, None, None)


# Divergences from transformers found by the mutation run, fixed: each gave an answer where
# generate refuses the same settings (or crashed later where it refuses up front).


def test_sampling_at_temperature_zero_is_refused(tmp_path) -> None:
    from transformers.generation.logits_process import TemperatureLogitsWarper

    with pytest.raises(ValueError, match="strictly positive"):
        TemperatureLogitsWarper(0.0)
    write(tmp_path, {"do_sample": True, "temperature": 0.0})
    with pytest.raises(GenerationError, match="temperature"):
        generation.resolve(tmp_path, UNBOUNDED, 3)


def test_top_p_zero_is_not_taken_as_off(tmp_path) -> None:
    with pytest.raises(GenerationError, match=r"top_p"):
        generation.resolve(tmp_path, UNBOUNDED, 3, do_sample=True, top_p=0.0)


def test_a_prompt_past_the_files_max_length_is_refused(tmp_path) -> None:
    write(tmp_path, {"max_length": 12})
    assert generation.resolve(tmp_path, UNBOUNDED, 7).max_new_tokens == 5
    with pytest.raises(GenerationError, match="max_length"):
        generation.resolve(tmp_path, UNBOUNDED, 12)


@pytest.mark.parametrize("bias", [{"4": 1.5}, [[4, 1.5]], [[["4"], 1.5]]])
def test_a_sequence_bias_that_is_not_token_id_lists_is_refused_up_front(tmp_path, bias) -> None:
    """A JSON object (string keys), a bare id, a string id: each refused by name, as generate
    refuses them, instead of a bias the worker fails on mid-run."""
    write(tmp_path, {"sequence_bias": bias})
    with pytest.raises(GenerationError, match="sequence_bias"):
        generation.resolve(tmp_path, UNBOUNDED, 3)


def test_a_bad_word_that_is_not_a_list_is_refused_up_front(tmp_path) -> None:
    with pytest.raises(GenerationError, match="bad_words_ids") as e:
        generation.resolve(tmp_path, UNBOUNDED, 3, bad_words_ids=[5])
    assert e.value.param == "bad_words_ids"
