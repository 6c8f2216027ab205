"""compressed-tensors FP8 as the format defines it (issue 54, point 2): `quant_method:
compressed-tensors`, format float-quantized, 8-bit float symmetric weights with a
`<module>.weight_scale` per tensor ([1]), per channel ([rows, 1]) or per block of
`block_structure` (ceil(shape / block), the last block of a dim partial), modules in `ignore`
unquantized. Each weight reads as weight.float() * its scale, cast to the model's dtype;
activations are not quantized (a static scheme's `input_scale` is dropped). Anything else is
refused at indexing in one line naming the field or tensor.

The reference is independent of our code: each FP8 weight dequantized here (float32 multiply
by its scale broadcast over its part, then the cast to bfloat16), written as a bf16 checkpoint
and loaded by transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_fp8_blocks import (
    SMALL,
    edited,
    matches_reference,
    partial,
    read_all,
    refused_at_indexing,
    weight_dequant,
)

from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import perturb_constant_parameters, quantize_fp8_compressed

FP8 = torch.float8_e4m3fn
SCALE = "_scale"


# --- the independent reference --------------------------------------------------------------


def dequant(q: torch.Tensor, scale: torch.Tensor, quant: dict) -> torch.Tensor:
    """The compressed-tensors reading: weight.float() * scale (broadcast over the tensor, each
    row, or each block of `block_structure`), cast to bfloat16."""
    weights = quant["config_groups"]["group_0"]["weights"]
    scale = scale.to(torch.float32)
    if weights["strategy"] == "tensor":
        assert scale.numel() == 1
        return (q.to(torch.float32) * scale.reshape(())).to(torch.bfloat16)
    if weights["strategy"] == "channel":
        assert scale.shape == (q.shape[0], 1)
        return (q.to(torch.float32) * scale).to(torch.bfloat16)
    return weight_dequant(q, scale, weights["block_structure"])


def dequantized_copy(fp8: Path, out: Path) -> Path:
    config = json.loads((fp8 / "config.json").read_text())
    quant = config.pop("quantization_config")
    tensors = read_all(fp8)
    wide = {}
    for name, tensor in tensors.items():
        if name.endswith((SCALE, ".input_scale")):
            continue
        if tensor.dtype == FP8:
            tensor = dequant(tensor, tensors[name + SCALE], quant)
        wide[name] = tensor
    out.mkdir(parents=True)
    save_file(wide, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


# --- the checkpoints ------------------------------------------------------------------------


def saved(root: Path, config, strategy: str, block=None, scales="float32", activations="dynamic"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    perturb_constant_parameters(model, 0)
    model.save_pretrained(root, max_shard_size=400_000)
    quantize_fp8_compressed(
        root, model, strategy=strategy, block=block, scales=scales, activations=activations
    )
    return root


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**SMALL)


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(**SMALL, head_dim=16)


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **SMALL, head_dim=16, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2
    )


CASES = {
    "llama-tensor": lambda root: saved(root, llama_config(), "tensor"),
    # a static activation scheme: its input_scale tensors are dropped, activations unquantized
    "llama-channel-static": lambda root: saved(
        root, llama_config(), "channel", activations="static"
    ),
    # blocks of 32 x 20: partial in rows (48, 80) and columns (48)
    "llama-block": lambda root: saved(root, llama_config(), "block", (32, 20)),
    "qwen3-tensor-bf16": lambda root: saved(root, qwen3_config(), "tensor", scales="bfloat16"),
    "qwen3-channel-bf16": lambda root: saved(root, qwen3_config(), "channel", scales="bfloat16"),
    "qwen3-block": lambda root: saved(root, qwen3_config(), "block", (32, 32)),
    # experts fused into one parameter per layer (gate and up concatenated, experts stacked)
    "qwen3_moe-tensor": lambda root: saved(root, qwen3_moe_config(), "tensor"),
    "qwen3_moe-block": lambda root: saved(root, qwen3_moe_config(), "block", (32, 32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_fp8_loads_with_the_numbers_its_format_defines(tmp_path, case: str) -> None:
    """Each checkpoint loads over the planner's offloading stages (offloaded FP8 weights kept in
    8 bits as the file's blocks) with logits bitwise those of transformers loading the
    independently dequantized bf16 files, plain and left-padded, and greedy generation token
    for token the same."""
    fp8 = CASES[case](tmp_path / "fp8")
    reference = dequantized_copy(fp8, tmp_path / "bf16")
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    weights = quant["config_groups"]["group_0"]["weights"]
    index = load_index(fp8)
    eight = [t for layer in index.layers for t in layer.tensors if t.scale is not None]
    assert eight
    assert not any("lm_head" in t.name or "embed" in t.name for t in eight)
    for t in eight:
        rows, cols = t.shape
        block = {
            "tensor": (rows, cols),
            "channel": (1, cols),
            "block": tuple(weights["block_structure"] or (0, 0)),
        }[weights["strategy"]]
        assert t.block == block, t.name
        assert t.scale.shape == (-(-rows // block[0]), -(-cols // block[1])), t.name
    if weights["strategy"] == "block":
        assert any(partial(t.shape, t.block) for t in eight)  # the point of the case
    matches_reference(fp8, reference, case)


# --- refused at indexing, in one line naming the field or tensor ----------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("small")
    return {
        strategy: saved(base / strategy, llama_config(), strategy, block)
        for strategy, block in (("tensor", None), ("channel", None), ("block", (32, 32)))
    }


DOWN = "model.layers.1.mlp.down_proj.weight"  # [48, 80]


def _set(name: str, make):
    def edit(tensors: dict, config: dict) -> None:
        tensors[name] = make(tensors)

    return edit


def _drop(name: str):
    def edit(tensors: dict, config: dict) -> None:
        del tensors[name]

    return edit


def _quant(**changes):
    def edit(tensors: dict, config: dict) -> None:
        config["quantization_config"].update(changes)

    return edit


def _weights(**changes):
    def edit(tensors: dict, config: dict) -> None:
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(changes)

    return edit


def _group(**changes):
    def edit(tensors: dict, config: dict) -> None:
        config["quantization_config"]["config_groups"]["group_0"].update(changes)

    return edit


def _second_group(tensors: dict, config: dict) -> None:
    groups = config["quantization_config"]["config_groups"]
    other = json.loads(json.dumps(groups["group_0"]))
    other["weights"]["strategy"] = "channel"
    other["targets"] = ["re:.*down_proj"]
    groups["group_1"] = other


FIELD = r"config\.json: quantization_config\.{}.* is not supported; supported: compressed-tensors"
REFUSALS = {
    "pack-quantized": (
        "tensor",
        _quant(format="pack-quantized"),
        FIELD.format("format='pack-quantized'"),
    ),
    "int-quantized": (
        "tensor",
        _quant(format="int-quantized"),
        FIELD.format("format='int-quantized'"),
    ),
    "nvfp4": (
        "tensor",
        _quant(format="nvfp4-pack-quantized"),
        FIELD.format("format='nvfp4-pack-quantized'"),
    ),
    "sparse": (
        "tensor",
        _quant(sparsity_config={"format": "sparse-24-bitmask"}),
        FIELD.format(r"sparsity_config=\{'format': 'sparse-24-bitmask'\}"),
    ),
    "kv-cache": (
        "tensor",
        _quant(kv_cache_scheme={"num_bits": 8, "type": "float"}),
        FIELD.format("kv_cache_scheme="),
    ),
    "4-bits": (
        "tensor",
        _weights(num_bits=4),
        FIELD.format("config_groups.group_0.weights.num_bits=4"),
    ),
    "int": (
        "tensor",
        _weights(type="int"),
        FIELD.format("config_groups.group_0.weights.type='int'"),
    ),
    "no-type": (  # compressed-tensors' default type is int
        "tensor",
        lambda tensors, config: config["quantization_config"]["config_groups"]["group_0"][
            "weights"
        ].pop("type"),
        FIELD.format("config_groups.group_0.weights.type=None"),
    ),
    "asymmetric": (
        "tensor",
        _weights(symmetric=False),
        FIELD.format("config_groups.group_0.weights.symmetric=False"),
    ),
    "dynamic-weights": (
        "tensor",
        _weights(dynamic=True),
        FIELD.format("config_groups.group_0.weights.dynamic=True"),
    ),
    "group": (
        "channel",
        _weights(strategy="group", group_size=16),
        FIELD.format("config_groups.group_0.weights.strategy='group'"),
    ),
    "tensor_group": (
        "channel",
        _weights(strategy="tensor_group"),
        FIELD.format("config_groups.group_0.weights.strategy='tensor_group'"),
    ),
    "block-structure": (
        "block",
        _weights(block_structure=[0, 32]),
        FIELD.format(r"config_groups.group_0.weights.block_structure=\[0, 32\]"),
    ),
    "output-activations": (
        "tensor",
        _group(output_activations={"num_bits": 8, "type": "float"}),
        FIELD.format("config_groups.group_0.output_activations="),
    ),
    "two-schemes": (
        "tensor",
        _second_group,
        FIELD.format(r"config_groups=.2 groups of weight schemes"),
    ),
    "scale-beside-bf16": (
        "tensor",
        _set(DOWN, lambda t: torch.zeros(48, 80, dtype=torch.bfloat16)),
        rf"tensor '{re.escape(DOWN + SCALE)}' holds scales, but its weight '{re.escape(DOWN)}' "
        r"is BF16, not F8_E4M3",
    ),
    "no-scale": (
        "channel",
        _drop(DOWN + SCALE),
        rf"FP8 tensor '{re.escape(DOWN)}' \[48, 80\] has no '{re.escape(DOWN + SCALE)}'",
    ),
    "fp8-in-ignore": (
        "tensor",
        _quant(ignore=["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]),
        rf"FP8 tensor '{re.escape(DOWN)}' \[48, 80\] is in quantization_config\.ignore",
    ),
    "tensor-scale-of-two": (
        "tensor",
        _set(DOWN + SCALE, lambda t: torch.ones(2)),
        rf"'{re.escape(DOWN)}' \[48, 80\] has a \[2\] '{re.escape(DOWN + SCALE)}', but strategy "
        r"'tensor' makes \[\] or \[1\] or \[1, 1\]",
    ),
    "channel-scale-flat": (
        "channel",
        _set(DOWN + SCALE, lambda t: t[DOWN + SCALE].reshape(48)),
        r"has a \[48\] '.*', but strategy 'channel' makes \[48, 1\]",
    ),
    "block-grid": (
        "block",
        _weights(block_structure=[16, 16]),
        r"FP8 tensor 'model\.layers\.\d\.[a-z_.]+' \[\d+, \d+\] has a \[\d, \d\] '.*_scale', but "
        r"strategy 'block' with block_structure=\[16, 16\] makes \[\d, \d\]",
    ),
    "int-scales": (
        "tensor",
        _set(DOWN + SCALE, lambda t: torch.ones(1, dtype=torch.int32)),
        r"are I32, which has no defined reading as compressed-tensors FP8 scales",
    ),
    "e5m2": (
        "tensor",
        _set(DOWN, lambda t: t[DOWN].float().to(torch.float8_e5m2)),
        rf"tensor '{re.escape(DOWN)}' is F8_E5M2 \[48, 80\]; supported: compressed-tensors FP8",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_would_read_as_other_numbers_is_refused_at_indexing(
    small: dict[str, Path], tmp_path, case: str
) -> None:
    strategy, edit, expected = REFUSALS[case]
    refused_at_indexing(edited(small[strategy], tmp_path / case, edit), expected)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_the_unedited_checkpoints_load(small: dict[str, Path], tmp_path, strategy: str) -> None:
    """The refusals' checkpoints, rewritten as one file but unchanged, are indexed."""
    root = edited(small[strategy], tmp_path / strategy, lambda tensors, config: None)
    index = load_index(root)
    scales = {t.scale.shape for layer in index.layers for t in layer.tensors if t.name == DOWN}
    assert scales == {{"tensor": (1, 1), "channel": (48, 1), "block": (2, 3)}[strategy]}
