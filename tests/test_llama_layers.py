"""Offloading a stack of Hugging Face LlamaDecoderLayers: outputs equal the plain stack's."""

from __future__ import annotations

import pytest
import torch
from helpers import storage_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from offload import OffloadConfig, create_offloader

CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=8,
    vocab_size=128,
    max_position_embeddings=64,
    attn_implementation="eager",
)


def llama_stack(num_layers: int) -> list[LlamaDecoderLayer]:
    torch.manual_seed(0)
    layers = [LlamaDecoderLayer(CONFIG, layer_idx=i).eval() for i in range(num_layers)]
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so they matter
        for layer in layers:
            layer.input_layernorm.weight.normal_(1.0, 0.1)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.1)
    return layers


def run(layers: list[LlamaDecoderLayer], hidden: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    cos_sin = LlamaRotaryEmbedding(CONFIG)(hidden, positions)
    with torch.no_grad():
        for layer in layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=cos_sin)
    return hidden


@pytest.mark.parametrize("num_layers", range(1, 9))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_llama_stack_parity(num_layers: int, data: st.DataObject) -> None:
    chosen = data.draw(st.sets(st.integers(0, num_layers - 1), min_size=1), label="layers")
    step = data.draw(st.integers(1, 4), label="prefetch_step")
    layers = llama_stack(num_layers)
    hidden = torch.randn(2, 7, CONFIG.hidden_size)
    reference = run(layers, hidden)
    before = storage_bytes(layers)
    offloader = create_offloader(
        OffloadConfig(layers=tuple(sorted(chosen)), prefetch_step=step), device="cpu", env={}
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    for _ in range(2):
        assert torch.equal(run(layers, hidden), reference)
    stats = offloader.stats()
    per_layer = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    assert stats.offloaded_bytes == per_layer * len(chosen)
    assert storage_bytes(layers) == before - stats.offloaded_bytes + stats.buffer_bytes
    assert stats.copies >= min(step, len(chosen)) and stats.sync_loads == 0
    offloader.detach()
    assert torch.equal(run(layers, hidden), reference)
    assert storage_bytes(layers) == before


def test_offload_only_the_mlp_of_llama_layers() -> None:
    layers = llama_stack(4)
    hidden = torch.randn(1, 5, CONFIG.hidden_size)
    reference = run(layers, hidden)
    config = OffloadConfig(group_size=2, num_in_group=1, param_filter=r"^mlp\.", prefetch_step=1)
    with create_offloader(config, device="cpu", env={}) as offloader:
        offloader.wrap_modules(layers)
        offloader.post_init()
        assert torch.equal(run(layers, hidden), reference)
        mlp = sum(p.numel() * p.element_size() for p in layers[1].mlp.parameters())
        assert offloader.stats().offloaded_bytes == 2 * mlp
        assert offloader.stats().copies > 0
    assert torch.equal(run(layers, hidden), reference)
