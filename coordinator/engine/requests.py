"""A generation request's values, checked once where the request enters: `Engine.submit` (every
client of a load: `Job.generate`, the CLI, `attach(name)`, another process through the load's
keeper) and the HTTP front (before it answers 200) call `check_request`, so what reaches a
worker is always valid and one client's value can never fail the rows batched beside it.

Numbers must be finite and in their ranges, token ids ints of the vocabulary (any int-like
type, a numpy or torch integer say, is converted to `int`: the engine hashes and packs them),
log-probability counts within the vocabulary. A temperature below `SAMPLING_EPS` is greedy,
as vLLM treats it: dividing logits by 1e-300 would overflow them to infinities and NaNs.
A bad value raises `RequestError` naming the field (as the caller calls it: `names` maps the
engine's names to an API's, `max_new_tokens` to `max_tokens` say): a 400 over HTTP, a
`ConfigError` in Python.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.engine.generation import GenerationError
from worker.steps import FLOAT32_MAX, FLOAT32_TINY, Sampling

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
MAX_BIAS = 100.0  # OpenAI's logit_bias range (the server clamps to it first, as vLLM does)
# A seed is used mod 2**64 by the worker (`worker.decode.uniform`); a wider one is a mistake.
SEED_RANGE = (-(2**63), 2**64)


class RequestError(GenerationError):
    """A request value that can never run: the message names the field (`param`) and the range."""


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request's values as the engine runs them: plain ints and floats, sampling normalised
    (a temperature below SAMPLING_EPS greedy, a top-k at least the vocabulary off)."""

    prompts: list[list[int]]
    sampling: Sampling
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    seed: int | None
    min_new_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None


def check_request(
    prompts,
    *,
    sampling: Sampling,
    max_new_tokens,
    eos_token_ids: Iterable = (),
    seed=None,
    min_new_tokens=0,
    logprobs=None,
    prompt_logprobs=None,
    vocab_size: int = 0,
    names: Mapping[str, str] | None = None,
) -> CheckedRequest:
    """The request's values, checked and converted; `RequestError` names the first bad one.
    `vocab_size` 0: ids are only checked to be >= 0. End ids past the vocabulary are dropped:
    the model can never choose them, so they could never end a sequence."""
    name = (lambda field: names.get(field, field)) if names else (lambda field: field)
    vocab = _int(vocab_size, "vocab_size", 0) if vocab_size else 0
    checked_prompts = _prompts(prompts, vocab, name("prompts"))
    ends = []
    for value in eos_token_ids if _iterable(eos_token_ids) else [eos_token_ids]:
        end = _int(value, name("eos_token_ids"), 0)
        if not vocab or end < vocab:
            ends.append(end)
    scores = {}
    for field, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        scores[field] = None if value is None else _int(value, name(field), 0, vocab or None)
    return CheckedRequest(
        prompts=checked_prompts,
        sampling=_sampling(sampling, vocab, name),
        max_new_tokens=_int(max_new_tokens, name("max_new_tokens"), 0),
        eos_token_ids=tuple(ends),
        seed=None if seed is None else _int(seed, name("seed"), *SEED_RANGE, high_open=True),
        min_new_tokens=_int(min_new_tokens or 0, name("min_new_tokens"), 0),
        **scores,
    )


def _sampling(sampling: Sampling, vocab: int, name) -> Sampling:
    if not isinstance(sampling, Sampling):
        raise RequestError(
            f"{name('sampling')} must be a worker.steps.Sampling, got {type(sampling).__name__}",
            name("sampling"),
        )
    if sampling.do_sample not in (True, False):
        raise RequestError(
            f"{name('do_sample')}={sampling.do_sample!r} must be a bool", name("do_sample")
        )
    temperature = _float(sampling.temperature, name("temperature"))
    if temperature < 0:
        raise RequestError(
            f"{name('temperature')}={temperature} must be >= 0 (0: greedy)", name("temperature")
        )
    if temperature > FLOAT32_MAX:  # the logits are divided in float32: it would be inf there
        raise RequestError(
            f"{name('temperature')}={temperature} is beyond float32's range, in which the logits are "
            f"divided by it: at most {FLOAT32_MAX:.4g}",
            name("temperature"),
        )
    top_p = _float(sampling.top_p, name("top_p"))
    if not 0 < top_p <= 1:
        raise RequestError(f"{name('top_p')}={top_p} must be in (0, 1]", name("top_p"))
    top_k = 0 if sampling.top_k is None else _int(sampling.top_k, name("top_k"), 0)
    if vocab and top_k >= vocab:
        top_k = 0  # keeps every token: the same as off
    do_sample = bool(sampling.do_sample) and temperature >= SAMPLING_EPS
    min_p = _float(sampling.min_p, name("min_p"))
    if not 0 <= min_p <= 1:
        raise RequestError(f"{name('min_p')}={min_p} must be in [0, 1] (0: off)", name("min_p"))
    repetition = _float(sampling.repetition_penalty, name("repetition_penalty"))
    if not FLOAT32_TINY <= repetition <= FLOAT32_MAX:  # the logits are divided in float32
        raise RequestError(
            f"{name('repetition_penalty')}={repetition} must be > 0 (1: off) and within float32's "
            f"normal range, [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}]",
            name("repetition_penalty"),
        )
    penalties = {}
    for field in ("frequency_penalty", "presence_penalty"):
        value = _float(getattr(sampling, field), name(field))
        if not -2 <= value <= 2:
            raise RequestError(f"{name(field)}={value} must be in [-2, 2] (0: off)", name(field))
        penalties[field] = value
    return Sampling(
        do_sample=do_sample,
        temperature=temperature if do_sample else 1.0,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p if do_sample else 0.0,
        repetition_penalty=repetition,
        logit_bias=_bias(sampling.logit_bias, vocab, name("logit_bias")),
        bad_words=_words(sampling.bad_words, vocab, name("bad_words")),
        guide=_guide(sampling.guide, name("guide")),
        **penalties,
    )


def _guide(regex, field: str) -> str:
    """A guide's regex: a string ("" for none)."""
    if not isinstance(regex, str):
        raise RequestError(f"{field} must be a regex string, got {type(regex).__name__}", field)
    return regex


def _bias(pairs, vocab: int, field: str) -> tuple[tuple[int, float], ...]:
    """(token, bias) pairs: ids of the vocabulary, finite biases, each token once."""
    if not _iterable(pairs):
        raise RequestError(f"{field} must be (token id, bias) pairs", field)
    out: dict[int, float] = {}
    for pair in pairs:
        if not _iterable(pair) or len(pair := tuple(pair)) != 2:
            raise RequestError(f"{field}: {pair!r} is not a (token id, bias) pair", field)
        token = _int(pair[0], field, 0, vocab or 2**63, what="token id")
        if token in out:
            raise RequestError(f"{field}: token {token} is given twice", field)
        bias = _float(pair[1], field)
        if not -MAX_BIAS <= bias <= MAX_BIAS:  # summed in float32 with the logits
            raise RequestError(
                f"{field}: the bias {bias} of token {token} must be within [-{MAX_BIAS:g}, "
                f"{MAX_BIAS:g}] (OpenAI's range: -100 and 100 already ban or force a token)",
                field,
            )
        out[token] = bias
    return tuple(out.items())


def _words(words, vocab: int, field: str) -> tuple[tuple[int, ...], ...]:
    """Bad words: non-empty sequences of token ids of the vocabulary."""
    if not _iterable(words):
        raise RequestError(f"{field} must be a list of token id sequences", field)
    out = []
    for word in words:
        if not _iterable(word) or not (
            ids := tuple(_int(t, field, 0, vocab or 2**63, what="token id") for t in word)
        ):
            raise RequestError(f"{field}: {word!r} is not a non-empty list of token ids", field)
        out.append(ids)
    return tuple(out)


def _prompts(prompts, vocab: int, field: str) -> list[list[int]]:
    if not _iterable(prompts):
        raise RequestError(
            f"{field} must be a list of prompts (lists of token ids), got {type(prompts).__name__}",
            field,
        )
    out = []
    for row, prompt in enumerate(prompts):
        if not _iterable(prompt):
            raise RequestError(
                f"{field}[{row}] must be a list of token ids, got {type(prompt).__name__}", field
            )
        where = f"{field}[{row}]"
        # a vocabulary not known: ids within 64 bits still (the prefix cache hashes them so)
        high = vocab or 2**63
        ids = [_int(t, where, 0, high, what="token id", param=field) for t in prompt]
        if not ids:
            raise RequestError(f"{field}[{row}] is empty: a prompt needs a token", field)
        out.append(ids)
    if not out:
        raise RequestError(f"{field} is empty: a request needs a prompt", field)
    return out


def _iterable(value) -> bool:
    return not isinstance(value, str | bytes | Mapping) and isinstance(value, Iterable)


def _int(
    value,
    field: str,
    low: int | None = None,
    high: int | None = None,
    *,
    high_open: bool = False,
    what: str = "",
    param: str | None = None,
) -> int:
    """`value` as an int (numpy and torch integers too; never a bool, a float or a string),
    within [low, high] ([low, high) with high_open; a token id: [low, high)). The error's
    `param` is `field` unless given (a prompt's id: the prompt field, not its row)."""
    param = param or field
    label = f"{field}: {what} {value!r}" if what else f"{field}={value!r}"
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise RequestError(f"{label} must be an integer, not a bool", param)  # numpy's, torch's
    try:
        number = operator.index(value)
    except TypeError:
        raise RequestError(
            f"{label} must be an integer, got {type(value).__name__}", param
        ) from None
    below = low is not None and number < low
    above = high is not None and (number >= high if high_open or what else number > high)
    if below or above:
        if what:  # a token id of a vocabulary of `high`
            known = f"0..{high - 1}" if high is not None else ">= 0"
            raise RequestError(f"{label} is out of the vocabulary ({known})", param)
        bound = ")" if high_open else "]"
        span = f"[{low}, {high}{bound}" if high is not None else f">= {low}"
        raise RequestError(f"{label} must be {'in ' if high is not None else ''}{span}", param)
    return number


def _float(value, field: str) -> float:
    if isinstance(value, bool | str | bytes):
        raise RequestError(f"{field}={value!r} must be a number", field)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RequestError(f"{field}={value!r} must be a number", field) from None
    except OverflowError:  # an int past float's range
        raise RequestError(
            f"{field} must be a finite number, got an int of that size", field
        ) from None
    if not math.isfinite(number):
        raise RequestError(f"{field}={value!r} must be a finite number", field)
    return number
