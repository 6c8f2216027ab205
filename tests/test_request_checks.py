"""`coordinator.engine.requests.check_request`'s contract, value by value: which values it
refuses, with which `param` and which message (an HTTP client's 400, a Python caller's
ConfigError: the field is named as the caller calls it, through `names`, and the range it
must be in); where each range's bounds lie (inclusive or not); and the values it hands the
engine (plain ints and floats, sampling normalised: a greedy request's temperature and min_p
reset, a top-k of the whole vocabulary off, end ids past the vocabulary dropped).

Written from mutation testing (issue 60): each assertion here kills mutants of
`coordinator/engine/requests.py` that the engine's tests let survive."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from coordinator.engine.requests import (
    MAX_BIAS,
    SAMPLING_EPS,
    SEED_RANGE,
    CheckedRequest,
    RequestError,
    check_request,
)
from offload.errors import ConfigError
from worker.steps import FLOAT32_MAX, FLOAT32_TINY, Sampling

VOCAB = 50


def checked(prompts=((1, 2),), **values) -> CheckedRequest:
    values.setdefault("sampling", Sampling())
    values.setdefault("max_new_tokens", 4)
    values.setdefault("vocab_size", VOCAB)
    return check_request(prompts, **values)


def refusal(prompts=((1, 2),), **values) -> RequestError:
    with pytest.raises(RequestError) as caught:
        checked(prompts, **values)
    assert isinstance(caught.value, ConfigError)  # a 400 over HTTP, exit code 2 in the CLI
    return caught.value


def sampled(**fields) -> Sampling:
    return Sampling(do_sample=True, **fields)


def test_every_refusal_names_its_field_and_its_range() -> None:
    """Each kind of bad value: the `param` (the engine's names: no `names` given) and the
    whole message, which tells the client the value it sent and what it must be instead."""
    cases = [
        # the prompts: a list of non-empty lists of ids of the vocabulary
        (
            dict(prompts="hi"),
            "prompts",
            "prompts must be a list of prompts (lists of token ids), got str",
        ),
        (dict(prompts=[[1], 7]), "prompts", "prompts[1] must be a list of token ids, got int"),
        (dict(prompts=[[1], []]), "prompts", "prompts[1] is empty: a prompt needs a token"),
        (dict(prompts=[]), "prompts", "prompts is empty: a request needs a prompt"),
        (
            dict(prompts=[[3, VOCAB]]),
            "prompts",
            "prompts[0]: token id 50 is out of the vocabulary (0..49)",
        ),
        (
            dict(prompts=[[2], [-1]]),
            "prompts",
            "prompts[1]: token id -1 is out of the vocabulary (0..49)",
        ),
        (
            dict(prompts=[[2.0]]),
            "prompts",
            "prompts[0]: token id 2.0 must be an integer, got float",
        ),
        (
            dict(prompts=[[True]]),
            "prompts",
            "prompts[0]: token id True must be an integer, not a bool",
        ),
        # the request's numbers
        (dict(max_new_tokens=-1), "max_new_tokens", "max_new_tokens=-1 must be >= 0"),
        (
            dict(max_new_tokens=2.5),
            "max_new_tokens",
            "max_new_tokens=2.5 must be an integer, got float",
        ),
        (
            dict(max_new_tokens="4"),
            "max_new_tokens",
            "max_new_tokens='4' must be an integer, got str",
        ),
        (dict(min_new_tokens=-2), "min_new_tokens", "min_new_tokens=-2 must be >= 0"),
        (dict(eos_token_ids=[2, -4]), "eos_token_ids", "eos_token_ids=-4 must be >= 0"),
        (
            dict(eos_token_ids=False),
            "eos_token_ids",
            "eos_token_ids=False must be an integer, not a bool",
        ),
        (dict(seed=2**64), "seed", f"seed={2**64} must be in [{-(2**63)}, {2**64})"),
        (dict(seed=-(2**63) - 1), "seed", f"seed={-(2**63) - 1} must be in [{-(2**63)}, {2**64})"),
        (dict(seed=True), "seed", "seed=True must be an integer, not a bool"),
        (dict(logprobs=-1), "logprobs", "logprobs=-1 must be in [0, 50]"),
        (dict(logprobs=VOCAB + 1), "logprobs", "logprobs=51 must be in [0, 50]"),
        (
            dict(prompt_logprobs=VOCAB + 1),
            "prompt_logprobs",
            "prompt_logprobs=51 must be in [0, 50]",
        ),
        (
            dict(prompt_logprobs=1.0),
            "prompt_logprobs",
            "prompt_logprobs=1.0 must be an integer, got float",
        ),
        (dict(vocab_size=-5), "vocab_size", "vocab_size=-5 must be >= 0"),
        # sampling
        (
            dict(sampling={"temperature": 1}),
            "sampling",
            "sampling must be a worker.steps.Sampling, got dict",
        ),
        (dict(sampling=Sampling(do_sample="yes")), "do_sample", "do_sample='yes' must be a bool"),
        (
            dict(sampling=sampled(temperature=-0.5)),
            "temperature",
            "temperature=-0.5 must be >= 0 (0: greedy)",
        ),
        (
            dict(sampling=sampled(temperature=1e39)),
            "temperature",
            "temperature=1e+39 is beyond float32's range, in which the logits are divided by "
            "it: at most 3.403e+38",
        ),
        (
            dict(sampling=sampled(temperature="hot")),
            "temperature",
            "temperature='hot' must be a number",
        ),
        (
            dict(sampling=sampled(temperature=b"1")),
            "temperature",
            "temperature=b'1' must be a number",
        ),
        (
            dict(sampling=sampled(temperature=True)),
            "temperature",
            "temperature=True must be a number",
        ),
        (
            dict(sampling=sampled(temperature=None)),
            "temperature",
            "temperature=None must be a number",
        ),
        (
            dict(sampling=sampled(temperature=10**400)),
            "temperature",
            "temperature must be a finite number, got an int of that size",
        ),
        (
            dict(sampling=sampled(temperature=float("inf"))),
            "temperature",
            "temperature=inf must be a finite number",
        ),
        (dict(sampling=Sampling(top_p=0.0)), "top_p", "top_p=0.0 must be in (0, 1]"),
        (dict(sampling=Sampling(top_p=1.5)), "top_p", "top_p=1.5 must be in (0, 1]"),
        (dict(sampling=Sampling(top_p=float("nan"))), "top_p", "top_p=nan must be a finite number"),
        (dict(sampling=Sampling(top_k=-1)), "top_k", "top_k=-1 must be >= 0"),
        (dict(sampling=Sampling(top_k=2.5)), "top_k", "top_k=2.5 must be an integer, got float"),
        (dict(sampling=sampled(min_p=-0.1)), "min_p", "min_p=-0.1 must be in [0, 1] (0: off)"),
        (dict(sampling=sampled(min_p=1.5)), "min_p", "min_p=1.5 must be in [0, 1] (0: off)"),
        (
            dict(sampling=Sampling(repetition_penalty=0.0)),
            "repetition_penalty",
            "repetition_penalty=0.0 must be > 0 (1: off) and within float32's normal range, "
            "[1.175e-38, 3.403e+38]",
        ),
        (
            dict(sampling=Sampling(repetition_penalty=1e39)),
            "repetition_penalty",
            "repetition_penalty=1e+39 must be > 0 (1: off) and within float32's normal range, "
            "[1.175e-38, 3.403e+38]",
        ),
        (
            dict(sampling=Sampling(frequency_penalty=2.5)),
            "frequency_penalty",
            "frequency_penalty=2.5 must be in [-2, 2] (0: off)",
        ),
        (
            dict(sampling=Sampling(presence_penalty=-3)),
            "presence_penalty",
            "presence_penalty=-3.0 must be in [-2, 2] (0: off)",
        ),
        (
            dict(sampling=Sampling(presence_penalty="x")),
            "presence_penalty",
            "presence_penalty='x' must be a number",
        ),
        (
            dict(sampling=Sampling(logit_bias={3: 1.0})),  # a mapping is not a list of pairs
            "logit_bias",
            "logit_bias must be (token id, bias) pairs",
        ),
        (
            dict(sampling=Sampling(logit_bias=((3,),))),
            "logit_bias",
            "logit_bias: (3,) is not a (token id, bias) pair",
        ),
        (
            dict(sampling=Sampling(logit_bias=(3,))),
            "logit_bias",
            "logit_bias: 3 is not a (token id, bias) pair",
        ),
        (
            dict(sampling=Sampling(logit_bias=((VOCAB, 1.0),))),
            "logit_bias",
            "logit_bias: token id 50 is out of the vocabulary (0..49)",
        ),
        (
            dict(sampling=Sampling(logit_bias=((3, 1.0), (3, 2.0)))),
            "logit_bias",
            "logit_bias: token 3 is given twice",
        ),
        (
            dict(sampling=Sampling(logit_bias=((3, 100.5),))),
            "logit_bias",
            "logit_bias: the bias 100.5 of token 3 must be within [-100, 100] (OpenAI's "
            "range: -100 and 100 already ban or force a token)",
        ),
        (
            dict(sampling=Sampling(logit_bias=((3, "1"),))),
            "logit_bias",
            "logit_bias='1' must be a number",
        ),
        (
            dict(sampling=Sampling(bad_words=5)),
            "bad_words",
            "bad_words must be a list of token id sequences",
        ),
        (
            dict(sampling=Sampling(bad_words=((),))),
            "bad_words",
            "bad_words: () is not a non-empty list of token ids",
        ),
        (
            dict(sampling=Sampling(bad_words=(7,))),
            "bad_words",
            "bad_words: 7 is not a non-empty list of token ids",
        ),
        (
            dict(sampling=Sampling(bad_words=((1, VOCAB),))),
            "bad_words",
            "bad_words: token id 50 is out of the vocabulary (0..49)",
        ),
        (
            dict(sampling=Sampling(guide=3)),
            "guide",
            "guide must be a regex string, got int",
        ),
    ]
    for values, param, message in cases:
        values = dict(values)
        error = refusal(values.pop("prompts", ((1, 2),)), **values)
        assert (error.param, str(error)) == (param, message), values
    for flag in (np.bool_(True), np.bool_(False)):  # numpy's bools are no ids either
        error = refusal([[1, flag]])
        assert error.param == "prompts" and "must be an integer" in str(error)


def test_names_renames_every_field_in_the_param_and_where_the_message_names_it() -> None:
    """`names` maps the engine's names to the caller's: every refusal's `param` is the
    caller's name, and so is the name its message gives (a sampling value's range refusal's
    too: the test below); a field `names` leaves out keeps its own. No `names` (or an empty
    one) keeps the engine's."""
    fields = (
        "prompts",
        "max_new_tokens",
        "min_new_tokens",
        "eos_token_ids",
        "seed",
        "logprobs",
        "prompt_logprobs",
        "sampling",
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "bad_words",
        "guide",
    )
    names = {field: f"api_{field}" for field in fields}
    cases = [  # (values, the engine's name, a word of the message)
        (dict(prompts=[[VOCAB]]), "prompts", "api_prompts[0]: token id 50"),
        (dict(prompts=[[1], "ab"]), "prompts", "api_prompts[1] must be"),
        (dict(prompts=[]), "prompts", "api_prompts is empty"),
        (dict(prompts=5), "prompts", "api_prompts must be"),
        (dict(prompts=[[]]), "prompts", "api_prompts[0] is empty"),
        (dict(max_new_tokens=-1), "max_new_tokens", "api_max_new_tokens=-1"),
        (dict(min_new_tokens=-1), "min_new_tokens", "api_min_new_tokens=-1"),
        (dict(eos_token_ids=[-1]), "eos_token_ids", "api_eos_token_ids=-1"),
        (dict(seed=2**64), "seed", "api_seed="),
        (dict(logprobs=-1), "logprobs", "api_logprobs=-1"),
        (dict(prompt_logprobs=-1), "prompt_logprobs", "api_prompt_logprobs=-1"),
        (dict(sampling=None), "sampling", "got NoneType"),
        (dict(sampling=Sampling(do_sample=None)), "do_sample", "must be a bool"),
        (dict(sampling=sampled(temperature=-1)), "temperature", "must be >= 0"),
        (dict(sampling=sampled(temperature=1e39)), "temperature", "beyond float32's range"),
        (dict(sampling=sampled(temperature="x")), "temperature", "api_temperature='x'"),
        (dict(sampling=Sampling(top_p=2.0)), "top_p", "must be in (0, 1]"),
        (dict(sampling=Sampling(top_p="x")), "top_p", "api_top_p='x'"),
        (dict(sampling=Sampling(top_k=-1)), "top_k", "api_top_k=-1"),
        (dict(sampling=sampled(min_p=2.0)), "min_p", "must be in [0, 1]"),
        (dict(sampling=sampled(min_p="x")), "min_p", "api_min_p='x'"),
        (dict(sampling=Sampling(repetition_penalty=0.0)), "repetition_penalty", "must be > 0"),
        (
            dict(sampling=Sampling(repetition_penalty="x")),
            "repetition_penalty",
            "api_repetition_penalty='x'",
        ),
        (dict(sampling=Sampling(frequency_penalty=3.0)), "frequency_penalty", "[-2, 2]"),
        (
            dict(sampling=Sampling(frequency_penalty="x")),
            "frequency_penalty",
            "api_frequency_penalty='x'",
        ),
        (dict(sampling=Sampling(presence_penalty=3.0)), "presence_penalty", "[-2, 2]"),
        (
            dict(sampling=Sampling(presence_penalty="x")),
            "presence_penalty",
            "api_presence_penalty='x'",
        ),
        (dict(sampling=Sampling(logit_bias=5)), "logit_bias", "api_logit_bias must be"),
        (
            dict(sampling=Sampling(logit_bias=((1, 2.0), (1, 2.0)))),
            "logit_bias",
            "api_logit_bias: token 1",
        ),
        (dict(sampling=Sampling(bad_words=5)), "bad_words", "api_bad_words must be"),
        (dict(sampling=Sampling(bad_words=((VOCAB,),))), "bad_words", "api_bad_words: token id 50"),
        (dict(sampling=Sampling(guide=None)), "guide", "api_guide must be"),
    ]
    for values, field, words in cases:
        values = dict(values)
        prompts = values.pop("prompts", ((1, 2),))
        error = refusal(prompts, names=names, **values)
        assert (error.param, words in str(error)) == (f"api_{field}", True), (field, str(error))
        for own in (None, {}, {"other": "renamed"}):  # the engine's names
            assert refusal(prompts, names=own, **values).param == field
    # vocab_size is the engine's own setting, never a request's: `names` does not rename it
    assert refusal(names={"vocab_size": "v"}, vocab_size=-1).param == "vocab_size"


# every sampling value at an inclusive edge of its range
EDGES = Sampling(
    do_sample=True,
    temperature=FLOAT32_MAX,
    top_p=1.0,
    min_p=1.0,
    repetition_penalty=FLOAT32_TINY,
    frequency_penalty=-2.0,
    presence_penalty=2.0,
    logit_bias=((0, -MAX_BIAS), (VOCAB - 1, MAX_BIAS)),
    bad_words=((0,), (VOCAB - 1, 0)),
)


def test_each_range_holds_its_bounds_and_nothing_past_them() -> None:
    """The bounds the messages state: inclusive ones are taken, one step past is refused."""
    taken = checked(
        prompts=[[0, VOCAB - 1]],
        max_new_tokens=0,  # scores the prompt only
        min_new_tokens=0,
        seed=SEED_RANGE[0],
        logprobs=VOCAB,
        prompt_logprobs=0,
        sampling=EDGES,
    )
    assert taken.prompts == [[0, VOCAB - 1]]
    assert (taken.max_new_tokens, taken.min_new_tokens, taken.seed) == (0, 0, -(2**63))
    assert (taken.logprobs, taken.prompt_logprobs) == (VOCAB, 0)
    assert taken.sampling == dataclasses.replace(  # the biases as floats
        EDGES, logit_bias=((0, -100.0), (VOCAB - 1, 100.0))
    )
    other_ends = checked(
        seed=2**64 - 1,
        sampling=sampled(
            temperature=0.0,
            top_p=1e-9,
            repetition_penalty=FLOAT32_MAX,
            frequency_penalty=2.0,
            presence_penalty=-2.0,
        ),
    )
    assert other_ends.seed == 2**64 - 1
    assert other_ends.sampling.repetition_penalty == FLOAT32_MAX
    assert other_ends.sampling.top_p == 1e-9
    assert (other_ends.sampling.frequency_penalty, other_ends.sampling.presence_penalty) == (
        2.0,
        -2.0,
    )
    for values, param in (
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(logprobs=VOCAB + 1), "logprobs"),
        (dict(sampling=sampled(temperature=-1e-300)), "temperature"),
        (dict(sampling=sampled(temperature=np.nextafter(FLOAT32_MAX, np.inf))), "temperature"),
        (dict(sampling=Sampling(top_p=np.nextafter(1.0, 2.0))), "top_p"),
        (dict(sampling=sampled(min_p=np.nextafter(1.0, 2.0))), "min_p"),
        (dict(sampling=sampled(min_p=-1e-300)), "min_p"),
        (dict(sampling=Sampling(repetition_penalty=FLOAT32_TINY / 2)), "repetition_penalty"),
        (
            dict(sampling=Sampling(repetition_penalty=np.nextafter(FLOAT32_MAX, np.inf))),
            "repetition_penalty",
        ),
        (dict(sampling=Sampling(frequency_penalty=np.nextafter(2.0, 3.0))), "frequency_penalty"),
        (dict(sampling=Sampling(frequency_penalty=np.nextafter(-2.0, -3.0))), "frequency_penalty"),
        (dict(sampling=Sampling(presence_penalty=np.nextafter(2.0, 3.0))), "presence_penalty"),
        (dict(sampling=Sampling(presence_penalty=np.nextafter(-2.0, -3.0))), "presence_penalty"),
        (dict(sampling=Sampling(logit_bias=((1, np.nextafter(100.0, 101.0)),))), "logit_bias"),
        (dict(sampling=Sampling(logit_bias=((1, np.nextafter(-100.0, -101.0)),))), "logit_bias"),
        (dict(sampling=Sampling(logit_bias=((-1, 1.0),))), "logit_bias"),
        (dict(sampling=Sampling(bad_words=((-1,),))), "bad_words"),
        (dict(sampling=Sampling(bad_words=((VOCAB,),))), "bad_words"),
    ):
        assert refusal(**values).param == param, values
    # no vocabulary known: ids and counts are only >= 0 (ids within 64 bits, the prefix
    # cache's hash), and no end id is dropped
    unknown = checked(
        prompts=[[2**63 - 1]],
        vocab_size=0,
        eos_token_ids=[10**6],
        logprobs=10**6,
        prompt_logprobs=10**6,
        sampling=Sampling(top_k=10**6, logit_bias=((2**63 - 1, 1.0),), bad_words=((2**63 - 1,),)),
    )
    assert unknown.prompts == [[2**63 - 1]]
    assert unknown.eos_token_ids == (10**6,)
    assert (unknown.logprobs, unknown.prompt_logprobs) == (10**6, 10**6)
    assert unknown.sampling.top_k == 10**6
    assert unknown.sampling.logit_bias == ((2**63 - 1, 1.0),)
    assert unknown.sampling.bad_words == ((2**63 - 1,),)
    for values, param, message in (
        (
            dict(prompts=[[2**63]]),
            "prompts",
            f"prompts[0]: token id {2**63} is out of the vocabulary (0..{2**63 - 1})",
        ),
        (dict(logprobs=-1), "logprobs", "logprobs=-1 must be >= 0"),
        (dict(prompt_logprobs=-1), "prompt_logprobs", "prompt_logprobs=-1 must be >= 0"),
        (dict(sampling=Sampling(logit_bias=((2**63, 1.0),))), "logit_bias", None),
        (dict(sampling=Sampling(bad_words=((2**63,),))), "bad_words", None),
    ):
        values = dict(values)
        error = refusal(values.pop("prompts", ((1,),)), vocab_size=0, **values)
        assert error.param == param, values
        assert message is None or str(error) == message


def test_the_checked_values_are_what_the_engine_runs() -> None:
    """Plain ints and floats; a greedy request (do_sample off, or a temperature below vLLM's
    epsilon) runs at temperature 1 and min_p 0 whatever it sent, its top_p kept; a top-k of the
    whole vocabulary (or 0) is off; an end id the model can never choose is dropped, a single
    one is taken as a list of one; no min_new_tokens is 0."""
    greedy = checked(
        sampling=Sampling(do_sample=False, temperature=0.5, min_p=0.4, top_p=0.9, top_k=VOCAB - 1),
        eos_token_ids=np.int64(VOCAB - 1),
        min_new_tokens=None,
    )
    assert greedy.sampling == Sampling(temperature=1.0, min_p=0.0, top_p=0.9, top_k=VOCAB - 1)
    assert greedy.eos_token_ids == (VOCAB - 1,) and type(greedy.eos_token_ids[0]) is int
    assert greedy.min_new_tokens == 0 and greedy.seed is None
    assert checked().min_new_tokens == 0  # none given: no minimum
    assert greedy.logprobs is None and greedy.prompt_logprobs is None
    below = checked(sampling=sampled(temperature=SAMPLING_EPS * 0.99, min_p=0.4))
    assert below.sampling == Sampling(temperature=1.0, min_p=0.0)
    at = checked(
        sampling=sampled(temperature=SAMPLING_EPS, min_p=0.4, top_k=VOCAB),
        eos_token_ids=(VOCAB, 3, VOCAB - 1, VOCAB + 7),
        seed=0,
        min_new_tokens=np.int8(2),
        prompt_logprobs=np.int64(3),
    )
    assert at.sampling == Sampling(do_sample=True, temperature=SAMPLING_EPS, min_p=0.4, top_k=None)
    assert at.eos_token_ids == (3, VOCAB - 1)
    assert (at.seed, at.min_new_tokens, at.prompt_logprobs) == (0, 2, 3)
    assert type(at.min_new_tokens) is int and type(at.prompt_logprobs) is int
    assert checked(sampling=Sampling(top_k=0)).sampling.top_k is None
    assert checked(sampling=Sampling(top_k=np.int64(1))).sampling.top_k == 1
    # do_sample as any bool (numpy's too), an int-like float for a float field
    assert checked(sampling=Sampling(do_sample=np.bool_(True))).sampling.do_sample is True
    floats = checked(
        sampling=sampled(temperature=2, top_p=np.float32(0.5), min_p=0, presence_penalty=1)
    ).sampling
    assert (floats.temperature, floats.top_p, floats.presence_penalty) == (2.0, 0.5, 1.0)
    assert all(
        type(v) is float for v in (floats.temperature, floats.top_p, floats.presence_penalty)
    )
    guided = checked(sampling=Sampling(guide="[0-9]+", logit_bias=[[np.int32(3), -2]])).sampling
    assert guided.guide == "[0-9]+" and guided.logit_bias == ((3, -2.0),)
    assert type(guided.logit_bias[0][1]) is float
    # a vocabulary size given as a numpy integer
    assert checked(prompts=[[VOCAB - 1]], vocab_size=np.int64(VOCAB)).prompts == [[VOCAB - 1]]


def test_a_sampling_range_refusal_names_the_callers_field_in_its_message() -> None:
    names = {"temperature": "temp", "top_p": "p", "frequency_penalty": "freq"}
    for sampling, mapped in (
        (sampled(temperature=-1.0), "temp"),
        (Sampling(top_p=2.0), "p"),
        (Sampling(frequency_penalty=3.0), "freq"),
    ):
        error = refusal(sampling=sampling, names=names)
        assert error.param == mapped
        assert str(error).startswith(f"{mapped}="), str(error)


def test_a_torch_bool_is_no_integer_either() -> None:
    for values, param in (
        (dict(prompts=[[1, torch.tensor(True)]]), "prompts"),
        (dict(max_new_tokens=torch.tensor(True)), "max_new_tokens"),
        (dict(seed=torch.tensor(False)), "seed"),
    ):
        values = dict(values)
        error = refusal(values.pop("prompts", ((1, 2),)), **values)
        assert error.param == param and "not a bool" in str(error), values
