"""Per-expert checkpoint tensors, as `save_pretrained` writes MoE models, fill the fused expert
parameters of the transformers 5 modules exactly as `from_pretrained`'s own conversion does, each
straight into its place; and every layer counts its experts' bytes."""

from __future__ import annotations

import re

import pytest
import torch

from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from worker.loader import TensorReader
from worker.spec import apply_view

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize("arch", MOE)
def test_expert_tensors_fill_the_fused_parameters_as_transformers_fuses_them(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    shape = CheckpointShape(
        arch=arch,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        vocab_size=64,
        num_experts=4,
        max_shard_bytes=50_000,
    )
    root = make_checkpoint(tmp_path / arch, shape)
    index = load_index(root)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    expected = model.state_dict()

    # The files hold one tensor per expert, as the Hub does.
    names = [t.name for layer in index.layers for t in layer.tensors]
    assert sum(bool(re.search(r"\.experts\.3\.", n)) for n in names) == 2 * 3  # 2 layers x 3 mats
    fused = {t.target for layer in index.layers for t in layer.tensors if t.view}
    assert fused == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }

    # Rebuild every parameter from the index alone: each tensor's bytes into its view. NaN
    # first, so a part no tensor fills shows.
    built = {name: torch.full_like(t, float("nan")) for name, t in expected.items()}
    with TensorReader(root) as reader:
        for layer in index.layers:
            for t in layer.tensors:
                view = apply_view(built[t.target], t.view)
                assert view.is_contiguous(), t.name  # read straight into place, no staging
                reader.read_into(t, view)
    for name, value in expected.items():
        assert torch.equal(built[name], value), name

    # Plan and telemetry count expert bytes: a layer is all of its block's parameters.
    for i, block in enumerate(model.model.layers):
        layer = next(x for x in index.layers if x.name == f"layers.{i}")
        assert layer.nbytes == sum(p.numel() * p.element_size() for p in block.parameters())
