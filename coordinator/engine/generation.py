"""A generation request's settings: the checkpoint's `generation_config.json`, as
`transformers` takes them, under the arguments given; and the KV budget a request must fit.

The engine (`coordinator.engine`) runs the steps: each sequence greedy or sampled with the same
warpers as `transformers` (temperature, top-k, top-p), drawing from its own generator seeded by
`seed`, so a seeded request is reproducible whatever else is in the batch. Settings that would
change what `generate` returns and that the engine does not apply (beams, n-gram bans, ...)
are refused by name: never a different answer without an error.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from coordinator.planning.context import beyond_context
from offload.errors import ConfigError, NeverFitsError
from worker.steps import Sampling

FROM_CHECKPOINT = object()  # "the checkpoint's value": distinct from None ("no such token")
DEFAULT_MAX_NEW_TOKENS = 20  # transformers' default (max_length 20 on top of the prompt)
# generation_config.json keys whose non-default values this loop does not apply (generate's
# style: what generate would apply is applied or refused, never ignored).
UNSUPPORTED = {
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "num_beams": 1,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "num_return_sequences": 1,
    "stop_strings": None,
    "penalty_alpha": None,
    "guidance_scale": None,
    "encoder_repetition_penalty": 1.0,
}
# the keys of a generation config this module reads (with UNSUPPORTED: every one it looks at)
GENERATION_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "bad_words_ids",
    "suppress_tokens",
    "sequence_bias",
)
# The styles of defaults: "generate" takes generation_config.json as transformers' generate
# does (greedy unless it samples, top_k 50 when sampling, every processor it sets); "vllm" as
# vLLM's server does (its get_diff_sampling_param): only VLLM_KEYS (and the end and pad
# tokens), other keys ignored as vLLM ignores them, and vLLM's neutral values where the file
# sets none: temperature 1.0 (so it samples), top_p 1, top_k and min_p off, no penalty.
STYLES = ("generate", "vllm")
VLLM_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


class GenerationError(ConfigError):
    """A generation request that cannot run; the message names the setting and the fix,
    `param` the request value at fault (the engine's name: an API maps it to its own), if one
    is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class KvNeverFitsError(GenerationError, NeverFitsError):
    """Beyond the KV cache the plan reserved, whatever else runs: never fits (HTTP 400)."""


class KvBudget:
    """The KV cache the plan reserved: `max_batch` sequences in flight at once, of up to
    `max_seq_len` tokens each. A request that could never fit is refused with the numbers
    before anything runs (never an out-of-memory error halfway); one that fits waits in the
    engine's queue for its slots."""

    def __init__(self, *, max_batch: int, max_seq_len: int) -> None:
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    def check(self, sequences: int, tokens: int) -> None:
        """Refuse a request that could never fit, whatever else is in flight."""
        if self.max_seq_len == 0:
            raise KvNeverFitsError(
                "this job reserved no KV cache (max_seq_len=0), so it cannot generate: load it "
                "with max_seq_len (prompt + new tokens per sequence) and max_batch (sequences at "
                "once), e.g. --max-seq-len 512 --max-batch 4; the plan then keeps room for them"
            )
        if tokens > self.max_seq_len:
            raise KvNeverFitsError(
                f"{tokens} tokens per sequence (prompt + max_new_tokens) exceed the KV cache "
                f"reserved for max_seq_len={self.max_seq_len}: shorten the request or load the "
                "job with a larger max_seq_len",
                "max_new_tokens",
            )
        if sequences > self.max_batch:
            raise KvNeverFitsError(
                f"{sequences} sequence(s) exceed the KV cache reserved for max_batch="
                f"{self.max_batch}: send fewer sequences, or load the job with a larger max_batch",
                "num_sequences",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    max_new_tokens: int
    sampling: Sampling  # how its tokens are chosen (penalties, bias, guide: `Sampling`)
    eos_token_ids: tuple[int, ...]  # empty: never stop before max_new_tokens
    pad_token_id: int
    seed: int | None = None
    min_new_tokens: int = 0  # no end token before this many new tokens

    def __post_init__(self) -> None:
        s = self.sampling
        if self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if s.do_sample and not s.temperature > 0:
            raise GenerationError(f"temperature={s.temperature} must be > 0 when sampling")
        if not 0 < s.top_p <= 1:
            raise GenerationError(f"top_p={s.top_p} must be in (0, 1]")
        if s.top_k is not None and s.top_k < 0:
            raise GenerationError(f"top_k={s.top_k} must be >= 0 (0 or None: off)")
        if self.min_new_tokens < 0:
            raise GenerationError(f"min_new_tokens={self.min_new_tokens} must be >= 0")


def _checkpoint_generation_config(root: Path, model_config: dict) -> tuple[dict, str]:
    """generation_config.json's values (None where unset), else those of config.json, as
    `from_pretrained` builds a model's generation_config, and the file they came from (what
    a refusal names). Read once per version of the file (its size and mtime), not once per
    request."""
    path = root / "generation_config.json"
    try:
        stat = path.stat()
    except OSError:  # generate's settings are then config.json's (older checkpoints carry them)
        return _from_model_config(model_config), "config.json (there is no generation_config.json)"
    return dict(_read_generation_config(str(path), stat.st_size, stat.st_mtime_ns)), path.name


def _from_model_config(model_config: dict) -> dict:
    """The generation settings `from_pretrained` takes from config.json when a checkpoint has
    no generation_config.json (transformers' GenerationConfig.from_model_config): every key
    read or refused here, at the top level, else in the decoder's own config (a multimodal
    model's text_config)."""
    inner = next(
        (
            model_config[name]
            for name in ("decoder", "generator", "text_config")
            if isinstance(model_config.get(name), dict)
        ),
        {},
    )
    values = {}
    for key in (*GENERATION_KEYS, *UNSUPPORTED):
        value = model_config.get(key)
        values[key] = inner.get(key) if value is None else value
    return values


@functools.lru_cache(maxsize=16)
def _read_generation_config(path: str, size: int, mtime_ns: int) -> dict:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GenerationError(f"generation_config.json: cannot read: {exc}") from None
    if not isinstance(values, dict):
        raise GenerationError("generation_config.json: expected a JSON object")
    return values


def resolve(
    root: str | Path,
    model_config: dict,
    prompt_length: int,
    *,
    style: str = "generate",
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = FROM_CHECKPOINT,  # type: ignore[assignment]
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    logit_bias: dict | None = None,
    bad_words_ids: list[list[int]] | None = None,
    guide: str | None = None,
    eos_token_id: int | list[int] | None = FROM_CHECKPOINT,  # type: ignore[assignment]
    pad_token_id: int | None = None,
    seed: int | None = None,
    min_new_tokens: int | None = None,
) -> Settings:
    """The settings of one request: the arguments given, else the checkpoint's
    generation_config.json, else the defaults of `style` (STYLES). In generate's style:
    transformers' defaults (greedy, 20 new tokens, top_k 50 when sampling), and the file's
    repetition_penalty, min_p, bad_words_ids, suppress_tokens and single-token sequence_bias
    applied as generate applies them (what it sets that this loop does not apply is refused).
    In vLLM's: its server's defaults (see STYLES); `do_sample` is then the temperature's
    (0 greedy). min_new_tokens masks the end tokens until then, as generate's
    MinNewTokensLengthLogitsProcessor does (vLLM's min_tokens). `logit_bias`: token -> bias;
    `bad_words_ids`: token sequences never completed; `guide`: a regex the output must match
    (guided decoding, `worker.guided`)."""
    if style not in STYLES:
        raise GenerationError(f"style={style!r}: expected one of {', '.join(STYLES)}")
    vllm = style == "vllm"
    values, source = _checkpoint_generation_config(Path(root), model_config)
    if vllm:
        values = {k: values.get(k) for k in (*VLLM_KEYS, "eos_token_id", "pad_token_id")}
    else:
        for key, neutral in UNSUPPORTED.items():
            value = values.get(key)
            if value is not None and value != neutral:
                raise GenerationError(
                    f"{source} sets {key}={value!r}, which this generator does "
                    f"not apply (it would change the tokens); set it to {neutral!r} or remove it"
                )
    configured = values.get("max_new_tokens")
    if vllm and max_new_tokens is not None and configured is not None:
        max_new_tokens = min(int(max_new_tokens), int(configured))  # vLLM: the file caps it
    if max_new_tokens is None:
        max_new_tokens = configured
    if max_new_tokens is None:
        max_length = values.get("max_length")
        if max_length and prompt_length >= max_length:  # generate refuses it too
            raise GenerationError(
                f"the {prompt_length}-token prompt reaches the max_length {max_length} of "
                f"{source}: nothing is left to generate; give max_new_tokens",
                "max_new_tokens",
            )
        max_new_tokens = max_length - prompt_length if max_length else DEFAULT_MAX_NEW_TOKENS
    total = prompt_length + int(max_new_tokens)
    if context := beyond_context(model_config, total):
        raise GenerationError(
            f"{total} tokens per sequence (a {prompt_length}-token prompt + max_new_tokens "
            f"{max_new_tokens}) exceed the model's context of {context}: shorten the prompt or "
            "lower max_new_tokens",
            "max_new_tokens",
        )
    eos = values.get("eos_token_id") if eos_token_id is FROM_CHECKPOINT else eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    pad = pad_token_id if pad_token_id is not None else values.get("pad_token_id")
    if pad is None:  # as generate: padding finished rows with the first end token
        pad = eos_ids[0] if eos_ids else 0
    temperature = _or(temperature, values.get("temperature"))
    if vllm:  # vLLM samples unless the temperature is 0
        temperature = 1.0 if temperature is None else temperature
        do_sample = temperature > 0
        top_k = _or(top_k if top_k is not FROM_CHECKPOINT else None, values.get("top_k"))
    else:
        do_sample = bool(_or(do_sample, values.get("do_sample")) or False)
        top_k = _or(values.get("top_k"), 50) if top_k is FROM_CHECKPOINT else top_k
    temperature = 1.0 if temperature is None else float(temperature)
    if not do_sample and temperature <= 0:  # greedy: generate ignores the temperature
        temperature = 1.0
    sampling = Sampling(
        do_sample=do_sample,
        temperature=temperature,  # 0 when sampling: refused by Settings, as generate does
        top_k=top_k,
        top_p=float(_or(_or(top_p, values.get("top_p")), 1.0)),  # 0: refused, not "off"
        min_p=_or(_or(min_p, values.get("min_p")), 0.0),
        repetition_penalty=_or(_or(repetition_penalty, values.get("repetition_penalty")), 1.0),
        frequency_penalty=_or(frequency_penalty, 0.0),
        presence_penalty=_or(presence_penalty, 0.0),
        logit_bias=_logit_bias(logit_bias, None if vllm else values.get("sequence_bias")),
        bad_words=_bad_words(
            _or(bad_words_ids, None if vllm else values.get("bad_words_ids")),
            None if vllm else values.get("suppress_tokens"),
            () if vllm else eos_ids,
        ),
        guide=guide or "",
    )
    return Settings(
        max_new_tokens=int(max_new_tokens),
        sampling=sampling,
        eos_token_ids=tuple(int(e) for e in eos_ids),
        pad_token_id=int(pad),
        seed=seed,
        min_new_tokens=int(
            min_new_tokens if min_new_tokens is not None else values.get("min_new_tokens") or 0
        ),
    )


def _logit_bias(given: dict | None, sequence_bias) -> tuple[tuple[int, float], ...]:
    """(token, bias) pairs: `given` (token -> bias), else generation_config's sequence_bias
    (as generate reads it: [[token ids], bias] pairs, or a dict) where every sequence is one
    token; a longer one is refused (its bias depends on the tokens before it)."""
    if given is not None:
        if not isinstance(given, dict):
            raise GenerationError("logit_bias must be a dict of token id -> bias", "logit_bias")
        return tuple(given.items())
    if not sequence_bias:
        return ()
    pairs = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
    out = []
    for pair in pairs:
        try:
            ids, bias = pair
            ids = list(ids)  # a bare id, or a JSON object's string key: refused, as generate does
            if not all(_token_id(i) for i in ids):
                raise TypeError
        except (TypeError, ValueError):
            raise GenerationError(
                f"generation_config.json: sequence_bias entry {pair!r} is not ([token ids], bias)"
            ) from None
        if len(ids) != 1:
            raise GenerationError(
                f"generation_config.json sets a sequence_bias on the {len(ids)}-token sequence "
                f"{ids}, which this generator does not apply (only single tokens); remove it"
            )
        out.append((ids[0], bias))
    return tuple(out)


def _bad_words(words, suppress_tokens, eos_ids) -> tuple[tuple[int, ...], ...]:
    """The token sequences never completed: `words`, then generation_config's
    suppress_tokens (each a one-token word, as SuppressTokensLogitsProcessor bans them).
    Without a word that is one of `eos_ids` alone: generate drops those
    (NoBadWordsLogitsProcessor)."""
    if words is not None and not (
        isinstance(words, list | tuple)
        and all(isinstance(w, list | tuple) and all(_token_id(t) for t in w) for w in words)
    ):
        raise GenerationError("bad_words_ids must be a list of token id lists", "bad_words_ids")
    out = [tuple(w) for w in words or ()]
    out = [w for w in out if not (isinstance(w, tuple) and len(w) == 1 and w[0] in eos_ids)]
    return tuple(out + [(t,) for t in suppress_tokens or ()])


def _token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_options(
    temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None
) -> dict:
    """Job.generate options from OpenAI-style knobs: temperature 0 is greedy, a temperature > 0
    samples; with none, a top_p < 1 or a top_k asks for sampling (at the checkpoint's
    temperature: OpenAI's API samples unless told otherwise, and a knob that only acts when
    sampling must not be dropped without a word), else generation_config.json decides."""
    options: dict = {"seed": seed}
    if temperature is not None:
        if temperature < 0:
            raise GenerationError(f"temperature={temperature} must be >= 0 (0: greedy)")
        options["do_sample"] = temperature > 0
        if temperature > 0:
            options["temperature"] = temperature
    elif (top_p is not None and top_p < 1) or top_k:
        options["do_sample"] = True
    if top_p is not None:
        options["top_p"] = top_p
    if top_k is not None:
        options["top_k"] = top_k
    return options


def _or(value, default):
    return default if value is None else value
