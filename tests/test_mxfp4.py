"""MXFP4 as gpt-oss publishes it (issue 54, point 3): each layer's fused expert projections as
`<name>_blocks` (uint8 pairs of e2m1 values) and `<name>_scales` (one E8M0 exponent per 32
values), of the parameter's transpose. Offloaded experts stay in 4 bits in host memory and on
the link and are dequantized after each copy; resident ones are dequantized while read.

The reference is transformers' own MXFP4 dequantization: `from_pretrained` with
`Mxfp4Config(dequantize=True)` on the same files (`convert_moe_packed_tensors`), code this
project does not share. The arithmetic is the same (an e2m1 number times 2^(x - 127) in
float32, rounded once to bfloat16), so the logits must be bitwise equal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import run_stack
from test_families import VOCAB, Pipeline, family_shape
from test_fp8_blocks import edited, matches_reference, read_all, refused_at_indexing
from test_fp8_compressed import _drop, _set
from torch import nn

from coordinator.config import ConfigError
from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint, mxfp4_blocks
from coordinator.tools.reference import reference_logits
from offload import OffloadConfig, PrefetchOffloader
from offload import mxfp4 as mxfp4_module
from offload.mxfp4 import Mxfp4Format
from offload.quant import QuantizedTensor, dequantize_into
from worker.spec import parameter_formats

MX = Mxfp4Format()
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def gpt_oss(root: Path, *, hidden: int = 64, intermediate: int = 96, **changes) -> Path:
    """A gpt-oss checkpoint as published, shrunk: MXFP4 experts, the rest bf16."""
    shape = family_shape(
        "gpt_oss",
        "bfloat16",
        hidden_size=hidden,
        intermediate_size=intermediate,
        quantization="mxfp4",
        **changes,
    )
    return make_checkpoint(root, shape)


def transformers_dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


# --- the format against transformers' dequantization ---------------------------------------


def ldexp_rounds_once(dtype) -> bool:
    """Whether this torch's `ldexp` in `dtype` gives x * 2^e rounded once. Up to torch 2.9 it
    took 2^e in the dtype first: in float16, 0 x 2^30 gave NaN (2^30 is inf there) and 4 x 2^-25
    gave 0, not 2^-23, so transformers' dequantization, which calls it, read other numbers."""
    x = torch.tensor([0.0, 4.0], dtype=dtype)
    exact = torch.tensor([0.0, 2.0**-23], dtype=dtype)
    return torch.equal(torch.ldexp(x, torch.tensor([30, -25])), exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_code_and_scale_dequantizes_as_transformers_does(dtype) -> None:
    """Every e2m1 code in both nibbles beside every E8M0 exponent 0..254 (subnormal results,
    overflow to infinity in float16 included) reads bitwise as transformers'
    `convert_moe_packed_tensors` reads it, in each model dtype: as it reads it in float32 (every
    such product exact there) and then rounds once to the dtype, and as it reads it in the dtype
    itself on a torch whose `ldexp` rounds once (`ldexp_rounds_once`)."""
    g = torch.Generator().manual_seed(0)
    experts, rows, groups = 2, 255, 3
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    blocks[0, :16, 0] = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte
    scales = torch.randint(0, 255, (experts, rows, groups), dtype=torch.uint8, generator=g)
    scales[0, :, 0] = torch.arange(255, dtype=torch.uint8)  # every exponent but NaN's
    expected = transformers_dequantized(blocks, scales, dtype)
    weight = QuantizedTensor(blocks.view(experts, rows, -1), scales, MX)
    assert tuple(weight.shape) == tuple(expected.shape) == (experts, groups * 32, rows)
    ours = weight.dequantized(dtype)
    rounded_once = transformers_dequantized(blocks, scales, torch.float32).to(dtype)
    assert torch.equal(ours.isinf(), rounded_once.isinf()) and torch.equal(ours, rounded_once)
    if ldexp_rounds_once(dtype):
        assert torch.equal(ours.isinf(), expected.isinf()) and torch.equal(ours, expected)


def test_the_packed_layout_is_the_parameters_transpose() -> None:
    """The writer's blocks read back to the weight they quantize where its values are e2m1
    numbers times a power of two: the even value in the low nibble, groups along the stored
    rows, the parameter the stored matrix's transpose."""
    g = torch.Generator().manual_seed(1)
    codes = torch.tensor(mxfp4_module.E2M1)[torch.randint(0, 16, (3, 64, 40), generator=g)]
    exponents = torch.randint(-6, 3, (3, 40, 2), generator=g).float()
    stored = codes.transpose(1, 2) * torch.pow(2.0, exponents).repeat_interleave(32, dim=2)
    weight = stored.transpose(1, 2).contiguous()  # the parameter: [3, 64, 40]
    blocks, scales = mxfp4_blocks(stored)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    assert torch.equal(
        QuantizedTensor(blocks.view(3, 40, 32), scales, MX).dequantized(torch.float32), weight
    )
    assert torch.equal(transformers_dequantized(blocks, scales, torch.float32), weight)


def test_prefetch_keeps_mxfp4_in_4_bits_and_dequantizes_each_piece(monkeypatch) -> None:
    """Offloaded 4-bit weights cross in pieces of a few stored rows through a small staging
    buffer (several per matrix, never two matrices), each dequantized into its strided place
    in the slot (the parameter's columns), in chunks smaller than a piece: the layers compute
    with the weights transformers dequantizes; the arena holds 4.25 bits a value."""
    monkeypatch.setattr(mxfp4_module, "STAGING_BYTES", 700)  # ~20 stored rows a piece
    monkeypatch.setattr(mxfp4_module, "CHUNK_ELEMENTS", 300)  # ~4 rows a chunk
    experts, cols, rows = 3, 64, 40

    class Experts(nn.Module):
        def __init__(self, device: str = "cpu") -> None:
            super().__init__()
            self.proj = nn.Parameter(
                torch.empty(experts, cols, rows, dtype=torch.bfloat16, device=device),
                requires_grad=False,
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.tanh(torch.einsum("bi,eio->bo", x, self.proj) / 8)  # [b, rows]
            return torch.cat((out, out[:, : cols - rows]), dim=1)  # [b, cols]: the next input

    g = torch.Generator().manual_seed(2)
    packed = []
    for _ in range(4):
        blocks = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g
        )
        scales = torch.randint(
            120, 130, (experts, rows, cols // 32), dtype=torch.uint8, generator=g
        )
        packed.append((blocks, scales))
    reference = [Experts() for _ in range(4)]
    with torch.no_grad():
        for module, (blocks, scales) in zip(reference, packed, strict=True):
            module.proj.copy_(transformers_dequantized(blocks, scales, torch.bfloat16))
    layers = [Experts("meta") for _ in range(4)]
    layers[0].load_state_dict(reference[0].state_dict(), assign=True)
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=(1, 2, 3), prefetch_step=2),
        device="cpu",
        formats={f"{i}.proj": MX for i in (1, 2, 3)},
    )
    offloader.wrap_modules(layers)
    try:
        host = offloader.host_tensors()
        for i in (1, 2, 3):
            blocks, scales = packed[i]
            host[f"{i}.proj"].copy_(QuantizedTensor(blocks.view(experts, rows, -1), scales, MX))
            assert host[f"{i}.proj"].nbytes == experts * cols * rows * 17 // 32  # 4.25 bits
        assert MX.rows_per_piece((experts, cols, rows)) < rows  # several pieces a matrix
        offloader.post_init()
        x = torch.randn(2, cols).to(torch.bfloat16)
        expected = run_stack(reference, x)
        for _ in range(2):
            assert torch.equal(run_stack(layers, x), expected)
    finally:
        offloader.detach()


# --- a gpt-oss checkpoint as published, through the planner's stages --------------------------


@pytest.mark.parametrize(
    ("hidden", "intermediate"), [(64, 96), (96, 32)], ids=["hidden-64", "hidden-96"]
)
def test_gpt_oss_mxfp4_loads_with_transformers_numbers(tmp_path, hidden, intermediate) -> None:
    """gpt-oss's MXFP4 checkpoint over the planner's offloading stages: the offloaded experts
    kept in 4 bits (0.27x their bf16 bytes in host memory and on the link) and dequantized
    into their slots, resident ones dequantized while read: logits bitwise those of
    transformers loading the same files with `Mxfp4Config(dequantize=True)`, plain and
    left-padded, and greedy generation token for token the same."""
    root = gpt_oss(tmp_path / "mxfp4", hidden=hidden, intermediate=intermediate)
    index = load_index(root)
    packed = [t for layer in index.layers for t in layer.tensors if t.packed]
    assert len(packed) == 2 * index.config["num_hidden_layers"]
    assert {t.target.rsplit(".", 2)[-2] + "." + t.target.rsplit(".", 1)[-1] for t in packed} == {
        "experts.gate_up_proj",
        "experts.down_proj",
    }
    for layer in index.layers:
        for t in layer.tensors:
            if t.packed:
                formats = parameter_formats([t], "auto")
                assert formats[t.target] == MX
                assert formats[t.target].stored_bytes(t.shape) / t.loaded_bytes == 17 / 64
    matches_reference(root, root, "gpt_oss-mxfp4", lambda held: {h.fmt for h in held} == {MX})


def test_offload_dtype_none_dequantizes_while_read_and_int8_keeps_4_bits(tmp_path) -> None:
    """`--offload-dtype none` keeps the offloaded experts at the model's width (dequantized
    while read: the same logits); int8 and fp8 keep MXFP4's 4 bits (fewer bytes than 8, and
    the checkpoint's own numbers), never requantized."""
    root = gpt_oss(tmp_path / "mxfp4")
    index = load_index(root)
    experts = [t for t in index.layers[1].tensors if t.packed]
    for dtype in ("auto", "fp8", "int8"):
        assert set(parameter_formats(experts, dtype).values()) == {MX}
    assert parameter_formats(experts, "none") == {}
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    pipeline = Pipeline(index, offload_dtype="none")
    try:
        offloaded = [w for w in pipeline.workers if w.spec.offloaded]
        assert offloaded
        held = [h for w in offloaded for h in w.offloader.host_tensors().values()]
        assert held and not any(isinstance(h, QuantizedTensor) for h in held)
        logits = pipeline(ids)
    finally:
        pipeline.close()
    assert torch.equal(logits, reference_logits(str(root), ids, dtype="bfloat16", num_threads=1))


def test_dequantize_into_a_part_of_a_parameter_goes_through_a_temporary() -> None:
    """A strided destination (one expert of a larger parameter, seen transposed) is filled
    right: dequantized whole, then copied."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 40, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (2, 40, 2), dtype=torch.uint8, generator=g)
    big = torch.zeros(4, 40, 64, dtype=torch.bfloat16)
    dequantize_into(big[1:3].transpose(1, 2), QuantizedTensor(blocks.view(2, 40, 32), scales, MX))
    expected = transformers_dequantized(blocks, scales, torch.bfloat16)
    assert torch.equal(big[1:3].transpose(1, 2), expected)
    assert not big[0].any() and not big[3].any()


# --- refused at indexing, in one line naming the tensor -------------------------------------


@pytest.fixture(scope="module")
def small_mxfp4(tmp_path_factory) -> Path:
    return gpt_oss(tmp_path_factory.mktemp("small") / "mxfp4", num_layers=2)


GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"  # [4, 64, 192]: blocks [4, 192, 2, 16]


def _no_quantization_config(tensors: dict, config: dict) -> None:
    del config["quantization_config"]


REFUSALS = {
    "blocks-without-scales": (
        _drop(GATE_UP + "_scales"),
        rf"tensor '{re.escape(GATE_UP)}_blocks' U8\[4, 192, 2, 16\] has no "
        rf"'{re.escape(GATE_UP)}_scales' beside it; supported: MXFP4",
    ),
    "scales-without-blocks": (
        _drop(GATE_UP + "_blocks"),
        rf"tensor '{re.escape(GATE_UP)}_scales' U8\[4, 192, 2\] has no "
        rf"'{re.escape(GATE_UP)}_blocks' beside it",
    ),
    "float-scales": (
        _set(GATE_UP + "_scales", lambda t: t[GATE_UP + "_scales"].float()),
        r"its scales '.*gate_up_proj_scales' are F32\[4, 192, 2\], not U8 or "
        r"F8_E8M0\[4, 192, 2\]",
    ),
    "scales-one-group-short": (
        _set(GATE_UP + "_scales", lambda t: t[GATE_UP + "_scales"][..., :1].clone()),
        r"are U8\[4, 192, 1\], not U8 or F8_E8M0\[4, 192, 2\]",
    ),
    "blocks-of-8-bytes": (
        _set(GATE_UP + "_blocks", lambda t: t[GATE_UP + "_blocks"].view(4, 192, 4, 8)),
        r"MXFP4 tensor '.*gate_up_proj_blocks' U8\[4, 192, 4, 8\] is not U8 with 16 bytes",
    ),
    "blocks-of-another-weight": (
        lambda tensors, config: tensors.update(
            {k: tensors[k][:, :96].clone() for k in (GATE_UP + "_blocks", GATE_UP + "_scales")}
        ),
        r"tensor '.*gate_up_proj_blocks' has the MXFP4 values of a \[4, 64, 96\] weight "
        r"\(the file's transposed\) but config.json implies \[4, 64, 192\]",
    ),
    "blocks-without-mxfp4-config": (
        _no_quantization_config,
        r"tensor '.*experts\.(down|gate_up)_proj_blocks' is not a weight of GptOssForCausalLM",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_would_read_as_other_numbers_is_refused_at_indexing(
    small_mxfp4: Path, tmp_path, case: str
) -> None:
    edit, expected = REFUSALS[case]
    refused_at_indexing(edited(small_mxfp4, tmp_path / case, edit), expected)


def test_the_unedited_checkpoint_loads(small_mxfp4: Path, tmp_path) -> None:
    index = load_index(edited(small_mxfp4, tmp_path / "same", lambda tensors, config: None))
    (gate_up,) = [t for t in index.layers[2].tensors if t.target == GATE_UP]
    assert gate_up.packed == "mxfp4" and gate_up.shape == (4, 64, 192)


# --- make-checkpoint writes the format ------------------------------------------------------


def test_make_checkpoint_cli_writes_gpt_oss_mxfp4(tmp_path) -> None:
    from coordinator.cli.main import main

    out = tmp_path / "ckpt"
    args = ["make-checkpoint", str(out), "--arch", "gpt_oss", "--layers", "2"]
    args += ["--hidden-size", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "96"]
    args += ["--intermediate-size", "96", "--dtype", "bfloat16", "--quantization", "mxfp4"]
    assert main([*args, "--no-tokenizer", "--shard-size", "40000"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    tensors = read_all(out)
    name = "model.layers.0.mlp.experts.down_proj"  # [4, 96, 64]: stored [4, 64, 3, 16]
    assert name not in tensors
    assert tensors[name + "_blocks"].dtype == torch.uint8
    assert tensors[name + "_blocks"].shape == (4, 64, 3, 16)
    assert tensors[name + "_scales"].shape == (4, 64, 3)
    assert tensors[name + "_bias"].dtype == torch.bfloat16  # biases stay bf16
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(tensors)
    load_index(out)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"arch": "llama"}, r"quantization='mxfp4' is gpt-oss's format .* pass --arch gpt_oss"),
        ({"hidden_size": 48}, r"hidden_size=48: MXFP4 scales groups of 32 values"),
        ({"intermediate_size": 40}, r"intermediate_size=40: .* a multiple of 32"),
        ({"dtype": "float32"}, r"quantization='mxfp4' goes with dtype bfloat16 or float16"),
    ],
)
def test_make_checkpoint_refuses_shapes_mxfp4_cannot_hold(changes, expected) -> None:
    base = dict(arch="gpt_oss", hidden_size=64, num_heads=4, intermediate_size=64)
    with pytest.raises(ConfigError, match=expected):
        CheckpointShape(**{"dtype": "bfloat16", "quantization": "mxfp4", **base, **changes})
