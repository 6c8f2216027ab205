"""A generation request's settings: the checkpoint's `generation_config.json`, as
`transformers` takes them, under the arguments given; and the KV budget a request must fit.

The engine (`coordinator.engine`) runs the steps: each sequence greedy or sampled with the same
warpers as `transformers` (temperature, top-k, top-p), drawing from its own generator seeded by
`seed`, so a seeded request is reproducible whatever else is in the batch. Settings that would
change what `generate` returns and that the engine does not apply (repetition penalty, beams,
...) are refused by name: never a different answer without an error.
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
# generation_config.json keys whose non-default values this loop does not apply.
UNSUPPORTED = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "num_beams": 1,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "top_h": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "num_return_sequences": 1,
    "stop_strings": None,
    "penalty_alpha": None,
    "guidance_scale": None,
    "encoder_repetition_penalty": 1.0,
}


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
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]  # empty: never stop before max_new_tokens
    pad_token_id: int
    seed: int | None = None
    min_new_tokens: int = 0  # no end token before this many new tokens

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            do_sample=self.do_sample,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
        )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.do_sample and not self.temperature > 0:
            raise GenerationError(f"temperature={self.temperature} must be > 0 when sampling")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise GenerationError(f"top_k={self.top_k} must be >= 0 (0 or None: off)")
        if self.min_new_tokens < 0:
            raise GenerationError(f"min_new_tokens={self.min_new_tokens} must be >= 0")


def _checkpoint_generation_config(root: Path, model_config: dict) -> dict:
    """generation_config.json's values (None where unset), else those of config.json, as
    `from_pretrained` builds a model's generation_config. Read once per version of the file
    (its size and mtime), not once per request."""
    path = root / "generation_config.json"
    try:
        stat = path.stat()
    except OSError:
        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        return {k: model_config.get(k) for k in keys}
    return dict(_read_generation_config(str(path), stat.st_size, stat.st_mtime_ns))


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
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = FROM_CHECKPOINT,  # type: ignore[assignment]
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = FROM_CHECKPOINT,  # type: ignore[assignment]
    pad_token_id: int | None = None,
    seed: int | None = None,
    min_new_tokens: int | None = None,
) -> Settings:
    """The settings of one request: the arguments given, else the checkpoint's
    generation_config.json, else transformers' defaults (greedy, 20 new tokens, top_k 50 when
    sampling, no min_new_tokens). min_new_tokens masks the end tokens until then, as
    generate's MinNewTokensLengthLogitsProcessor does (vLLM's min_tokens)."""
    values = _checkpoint_generation_config(Path(root), model_config)
    for key, neutral in UNSUPPORTED.items():
        value = values.get(key)
        if value is not None and value != neutral:
            raise GenerationError(
                f"generation_config.json sets {key}={value!r}, which this generator does not "
                f"apply (it would change the tokens); set it to {neutral!r} or remove it"
            )
    if max_new_tokens is None:
        max_new_tokens = values.get("max_new_tokens")
    if max_new_tokens is None:
        max_length = values.get("max_length")
        max_new_tokens = (
            max(max_length - prompt_length, 0) if max_length else DEFAULT_MAX_NEW_TOKENS
        )
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
    return Settings(
        max_new_tokens=int(max_new_tokens),
        do_sample=bool(do_sample if do_sample is not None else values.get("do_sample") or False),
        temperature=float(
            temperature if temperature is not None else values.get("temperature") or 1.0
        ),
        top_k=_or(values.get("top_k"), 50) if top_k is FROM_CHECKPOINT else top_k,
        top_p=float(top_p if top_p is not None else values.get("top_p") or 1.0),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        pad_token_id=int(pad),
        seed=seed,
        min_new_tokens=int(
            min_new_tokens if min_new_tokens is not None else values.get("min_new_tokens") or 0
        ),
    )


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
