"""Generating tokens: the settings a checkpoint's `generation_config.json` gives, as
`transformers` takes them, and the decoding loop over any pipeline (`step`).

The loop is `generate`'s greedy / sampling loop: a prefill of the (left-padded) prompt, then one
position per sequence per step, the positions counted from the attention mask, rows that hit an
end-of-sequence token padded with `pad_token_id` until every row has ended or `max_new_tokens`
is reached. Only the last position's logits come back from a step. Sampling applies the same
warpers as `transformers` (temperature, top-k, top-p) and draws from a generator seeded by
`seed`, so a seeded request is reproducible. Settings that would change what `generate` returns
and that this loop does not apply (repetition penalty, beams, ...) are refused by name: never a
different answer without an error.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from coordinator.planning.context import beyond_context
from offload.errors import BusyError, ConfigError, NeverFitsError
from worker.decode import Sampling, advance, choose

FROM_CHECKPOINT = object()  # "the checkpoint's value": distinct from None ("no such token")
DEFAULT_MAX_NEW_TOKENS = 20  # transformers' default (max_length 20 on top of the prompt)
# generation_config.json keys whose non-default values this loop does not apply.
UNSUPPORTED = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0,
    "min_new_tokens": None, "num_beams": 1, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "min_p": None, "top_h": None, "bad_words_ids": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
    "renormalize_logits": False, "num_return_sequences": 1, "stop_strings": None,
    "penalty_alpha": None, "guidance_scale": None, "encoder_repetition_penalty": 1.0,
}  # fmt: skip

# step(ids (batch, n), attention_mask (batch, total), position_ids (batch, n)) -> logits of the
# last position (batch, 1, vocab); the pipeline keeps each request's KV cache between steps.
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GenerationError(ConfigError):
    """A generation request that cannot run; the message names the setting and the fix."""


class KvNeverFitsError(GenerationError, NeverFitsError):
    """Beyond the KV cache the plan reserved, whatever else runs: never fits (HTTP 400)."""


class KvBusyError(GenerationError, BusyError):
    """Fits the reserved KV cache, but not beside the requests in flight: retry (HTTP 429)."""


class KvBudget:
    """The KV cache the plan reserved: `max_batch` sequences in flight at once, of up to
    `max_seq_len` tokens each. A request that would exceed it is refused with the numbers
    before anything runs (never an out-of-memory error halfway)."""

    def __init__(self, *, max_batch: int, max_seq_len: int) -> None:
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self._lock = threading.Lock()
        self.in_flight = 0  # sequences

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
                "job with a larger max_seq_len"
            )
        if sequences > self.max_batch:
            raise KvNeverFitsError(
                f"{sequences} sequence(s) exceed the KV cache reserved for max_batch="
                f"{self.max_batch}: send fewer sequences, or load the job with a larger max_batch"
            )

    @contextmanager
    def claim(self, sequences: int, tokens: int) -> Iterator[None]:
        """Hold room for `sequences` of up to `tokens` each while the request runs."""
        self.check(sequences, tokens)
        with self._lock:
            if self.in_flight + sequences > self.max_batch:
                raise KvBusyError(
                    f"{sequences} sequence(s), with {self.in_flight} in flight, exceed the KV "
                    f"cache reserved for max_batch={self.max_batch}: wait for a request to end, "
                    "send fewer sequences, or load the job with a larger max_batch"
                )
            self.in_flight += sequences
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= sequences


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

    @property
    def sampling(self) -> Sampling:
        return Sampling(do_sample=self.do_sample, temperature=self.temperature,
                        top_k=self.top_k, top_p=self.top_p)  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.do_sample and not self.temperature > 0:
            raise GenerationError(f"temperature={self.temperature} must be > 0 when sampling")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise GenerationError(f"top_k={self.top_k} must be >= 0 (0 or None: off)")


def _checkpoint_generation_config(root: Path, model_config: dict) -> dict:
    """generation_config.json's values (None where unset), else those of config.json, as
    `from_pretrained` builds a model's generation_config."""
    path = root / "generation_config.json"
    if path.is_file():
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise GenerationError(f"generation_config.json: cannot read: {exc}") from None
        if not isinstance(values, dict):
            raise GenerationError("generation_config.json: expected a JSON object")
        return values
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: model_config.get(k) for k in keys}


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
) -> Settings:
    """The settings of one request: the arguments given, else the checkpoint's
    generation_config.json, else transformers' defaults (greedy, 20 new tokens, top_k 50 when
    sampling)."""
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
            "lower max_new_tokens"
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
    )


def sampling_options(temperature: float | None, top_p: float | None, top_k: int | None,
                     seed: int | None) -> dict:  # fmt: skip
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


class Burst(Protocol):
    """A pipeline that can also run decode steps on its own (a job of one stage: its worker
    chooses each token and feeds it straight back, with no round trip to the driver per
    token). `burst` yields each step's tokens (batch,) as they come, up to `count` steps or
    until every row has ended: the tokens `generate` would choose here, the generator's state
    moving alike. It may stop early (a worker was lost and recovered): the loop then goes on
    from the last token it got."""

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor): ...

    def burst(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
              unfinished: torch.Tensor, count: int, settings: Settings,
              generator: torch.Generator | None) -> Generator[torch.Tensor, None, None]: ...  # fmt: skip


def generate(
    step: Step | Burst,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    settings: Settings,
    *,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """(batch, prompt + new) token ids, as `generate` returns its sequences. `on_tokens` sees
    each step's new tokens (batch,) as they come (streaming); when `cancelled()` turns true
    (a client went away) the loop stops before its next step and returns what it has. A `step`
    with a `burst` (`Burst`; None: not now) runs the decode steps through it."""
    sequences = input_ids
    if settings.max_new_tokens == 0:
        return sequences
    generator = None
    if settings.do_sample:
        generator = torch.Generator()
        if settings.seed is not None:
            generator.manual_seed(settings.seed)
        else:
            generator.seed()
    eos = torch.tensor(settings.eos_token_ids, dtype=sequences.dtype)
    unfinished = torch.ones(sequences.shape[0], dtype=torch.bool)

    def take(tokens: torch.Tensor) -> bool:
        """Add one step's tokens; True when the request is over."""
        nonlocal sequences, unfinished
        sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
        if on_tokens is not None:
            on_tokens(tokens)
        if len(eos):
            unfinished = unfinished & ~torch.isin(tokens, eos)
        produced = sequences.shape[1] - input_ids.shape[1]
        if not bool(unfinished.any()) or produced == settings.max_new_tokens:
            return True
        return cancelled is not None and cancelled()

    logits = step(input_ids, attention_mask, position_ids)
    tokens = choose(logits, sequences, settings.sampling, generator, unfinished,
                    settings.pad_token_id)  # fmt: skip
    done = take(tokens)
    while not done:
        attention_mask, position_ids = advance(attention_mask, position_ids)
        burst = getattr(step, "burst", None)  # asked each time: the pipeline may change
        if burst is None:
            logits = step(tokens[:, None], attention_mask, position_ids)
            tokens = choose(logits, sequences, settings.sampling, generator, unfinished,
                            settings.pad_token_id)  # fmt: skip
            done = take(tokens)
            continue
        left = settings.max_new_tokens - (sequences.shape[1] - input_ids.shape[1])
        steps = burst(tokens[:, None], attention_mask, position_ids, unfinished, left, settings,
                      generator)  # fmt: skip
        try:
            for tokens in steps:  # the last one feeds the next burst
                done = take(tokens)
                if done:
                    break
                attention_mask, position_ids = advance(attention_mask, position_ids)
        finally:
            steps.close()  # stops the worker's steps when this loop ended first
        if not done:  # the burst ended (its length, or a recovery): the next one goes on
            attention_mask, position_ids = attention_mask[:, :-1], position_ids - 1
    return sequences
