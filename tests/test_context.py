"""The model's context window, from config.json files as transformers writes them: the key each
family uses, RoPE scalings that stretch it (vLLM's rule) and those whose config already gives
the stretched window; a request or a planned KV cache past it is refused with the numbers."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from coordinator.engine import generation
from coordinator.planning.context import check_max_seq_len, model_context


def written(model_type: str, **kwargs) -> dict:
    """config.json as save_pretrained writes it for these settings."""
    return AutoConfig.for_model(model_type, **kwargs).to_dict()


@pytest.mark.parametrize(
    ("model_type", "kwargs", "tokens", "source"),
    [
        ("llama", {"max_position_embeddings": 4096}, 4096, "max_position_embeddings"),
        ("gpt2", {"n_positions": 1024}, 1024, "n_positions"),
        # Qwen2.5's YaRN: 4 x the original 32768
        (
            "qwen2",
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            131072,
            "original_max_position_embeddings 32768 x yarn rope factor 4",
        ),
        (
            "llama",
            {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
            8192,
            "max_position_embeddings 4096 x linear rope factor 2",
        ),
        # Llama 3.1: max_position_embeddings is already the stretched window
        (
            "llama",
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            131072,
            "max_position_embeddings",
        ),
    ],
)
def test_the_window_each_config_gives(model_type, kwargs, tokens, source) -> None:
    context = model_context(written(model_type, **kwargs))
    assert (context.tokens, context.source) == (tokens, source)


def test_no_window_named_means_no_limit() -> None:
    assert model_context({"model_type": "x", "hidden_size": 8}) is None
    check_max_seq_len({"model_type": "x"}, 10**9)  # nothing to check against


def test_a_kv_plan_past_the_window_is_refused() -> None:
    config = written("llama", max_position_embeddings=2048)
    check_max_seq_len(config, 2048)
    with pytest.raises(
        ValueError,
        match=r"max_seq_len=2049 exceeds the model's context of 2048 "
        r"tokens \(max_position_embeddings in config.json\): lower --max-seq-len "
        r"to 2048",
    ):
        check_max_seq_len(config, 2049)


def test_a_request_past_the_window_is_refused(tmp_path) -> None:
    config = written("llama", max_position_embeddings=64)
    assert generation.resolve(tmp_path, config, 60, max_new_tokens=4).max_new_tokens == 4
    with pytest.raises(
        generation.GenerationError,
        match=r"65 tokens per sequence \(a 60-token "
        r"prompt \+ max_new_tokens 5\) exceed the model's context of 64 tokens",
    ):
        generation.resolve(tmp_path, config, 60, max_new_tokens=5)
