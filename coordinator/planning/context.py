"""A model's context window: the most tokens (prompt + generated) one sequence may hold, from
its config.json, as serving engines derive it. Beyond it a model with learned positions fails
with an index error and a RoPE model returns text it was never trained to produce, with no
error at all: so a job plans no KV cache past it and a request past it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.errors import ConfigError

# config.json keys that bound the positions a model takes, across families (the smallest wins).
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE scalings that stretch the trained window by their `factor` (yarn from its original one);
# llama3 and longrope configs already give the stretched window as max_position_embeddings.
STRETCHING = ("linear", "dynamic", "yarn")


@dataclass(frozen=True, slots=True)
class Context:
    tokens: int
    source: str  # the config.json key it comes from (and the RoPE stretch), for messages

    def __str__(self) -> str:
        return f"{self.tokens} tokens ({self.source} in config.json)"


def model_context(config: dict) -> Context | None:
    """The context window of the model `config` describes; None when its config names none."""
    found = [
        (config[k], k) for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0
    ]
    if not found:
        return None
    tokens, key = min(found)
    source = key
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind in STRETCHING and isinstance(factor, int | float) and factor > 1:
        original = rope.get("original_max_position_embeddings")
        if kind == "yarn" and isinstance(original, int) and original > 0:
            tokens, key = original, "original_max_position_embeddings"
        source = f"{key} {tokens} x {kind} rope factor {factor:g}"
        tokens = int(tokens * factor)
    return Context(tokens, source)


def beyond_context(config: dict, tokens: int) -> Context | None:
    """The model's context when `tokens` per sequence exceed it, else None."""
    context = model_context(config)
    return context if context is not None and tokens > context.tokens else None


def check_max_seq_len(config: dict, max_seq_len: int) -> None:
    """A job's KV cache is planned for at most the model's context per sequence."""
    if context := beyond_context(config, max_seq_len):
        raise ConfigError(
            f"max_seq_len={max_seq_len} exceeds the model's context of {context}: "
            f"lower --max-seq-len to {context.tokens} or less"
        )
