"""Block FP8 as the format defines it (issue 54, point 1): the block is config.json's
`quantization_config.weight_block_size`, the grid of scales is ceil(rows / block) x
ceil(cols / block), the last block of each dim may be partial, and scales stored as float32,
bfloat16 or E8M0 read as the numbers they are. A checkpoint either loads with those numbers or
is refused at indexing in one line naming the tensor.

The reference is independent of our code: each FP8 weight dequantized here as DeepSeek's
`weight_dequant` does (block by block of `weight_block_size`: a float32 multiply, then the cast
to bfloat16), written as a bf16 checkpoint, and loaded by transformers. transformers' own FP8
loader is no reference here: it infers the block from the grid (192 rows / 2 = 96), which is
the very mistake these tests catch.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_stack
from safetensors import safe_open
from safetensors.torch import save_file
from test_families import VOCAB, Pipeline
from test_generation import generate_each
from torch import nn

from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import (
    CheckpointShape,
    fp8_blocks,
    make_checkpoint,
    perturb_constant_parameters,
    quantize_fp8,
)
from coordinator.tools.reference import reference_generate, reference_logits
from offload import OffloadConfig, PrefetchOffloader
from offload import quant as quant_module
from offload.errors import CheckpointError
from offload.quant import BlockFormat, QuantizedTensor, dequantize_into, quantized

FP8 = torch.float8_e4m3fn
SCALE = "_scale_inv"


# --- the independent reference --------------------------------------------------------------


def scale_values(raw: torch.Tensor) -> torch.Tensor:
    """A file's scales as the numbers they are: E8M0 bytes x are 2^(x - 127), computed here in
    Python's doubles; float32 as it is, bfloat16 widened (exact)."""
    if raw.dtype in (torch.uint8, torch.float8_e8m0fnu):
        rows = raw.view(torch.uint8).tolist()
        return torch.tensor([[2.0 ** (x - 127) for x in row] for row in rows], dtype=torch.float32)
    return raw.to(torch.float32)


def weight_dequant(q: torch.Tensor, scales: torch.Tensor, block: list[int]) -> torch.Tensor:
    """DeepSeek's `weight_dequant`, one block at a time: the block's entries in float32 times
    its scale, cast to bfloat16; a block past the weight's end is cut by the slice."""
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    rows, cols = block
    assert scales.shape == (math.ceil(q.shape[0] / rows), math.ceil(q.shape[1] / cols))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[part] = (q[part].to(torch.float32) * scales[i, j]).to(torch.bfloat16)
    return out


def read_all(root: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return tensors


def dequantized_copy(fp8: Path, out: Path) -> Path:
    """`fp8` as a bf16 checkpoint: each FP8 weight through `weight_dequant` with the config's
    block, its scales dropped, every other tensor as it is."""
    config = json.loads((fp8 / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    tensors = read_all(fp8)
    wide = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE):
            continue
        if tensor.dtype == FP8:
            tensor = weight_dequant(tensor, scale_values(tensors[name + SCALE]), block)
        wide[name] = tensor
    out.mkdir(parents=True)
    save_file(wide, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


# --- the checkpoints ------------------------------------------------------------------------


def saved(root: Path, config, block: tuple[int, int], scales: str) -> Path:
    """A random-weight model of `config` as `save_pretrained` writes it, made block-FP8."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    perturb_constant_parameters(model, 0)
    model.save_pretrained(root, max_shard_size=400_000)
    quantize_fp8(root, model, block=block, scales=scales)
    return root


def deepseek_v3(root: Path, scales: str, num_layers: int = 3) -> Path:
    """DeepSeek-V3's attention at its real latent sizes (kv_lora_rank 512 + qk_rope_head_dim
    64: a 576-row `kv_a_proj_with_mqa`, 5 block rows, the last of 64) on hidden 256, so that
    tensor is the issue's [576, 256] with a [5, 2] grid; 128 x 128 blocks as published, and
    other sizes partial in rows (q_lora_rank 96, 192-row q_b_proj, 320 intermediate) and
    columns (a 64-wide o_proj, the experts' 96-wide down_proj)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=320,
        moe_intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=96,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return saved(root, config, (128, 128), scales)


def kimi_k2(root: Path, scales: str) -> Path:
    """Kimi-K2's shape (DeepSeek-V3's architecture: MLA, one expert group, many experts, 8 of
    them per token, a larger routed scaling factor) shrunk onto 32 x 32 blocks: hidden 48
    (1.5 blocks), kv_lora_rank 128 + qk_rope_head_dim 16 = a 144-row kv_a_proj_with_mqa
    (4.5 blocks: the 576-row one's analogue), 40-wide experts."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=72,
        moe_intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        n_shared_experts=1,
        n_routed_experts=12,
        num_experts_per_tok=8,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=80,
        kv_lora_rank=128,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return saved(root, config, (32, 32), scales)


# The small dense models' config (transformers' names): hidden 48 (1.5 blocks of 32),
# intermediate 80, 4 layers, 4 heads over 2 KV heads
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def qwen3(root: Path, scales: str) -> Path:
    """A Qwen3-FP8 on blocks of 32 rows by 20 columns (not square, so rows and columns cannot
    be confused): hidden 48, 64-row q_proj, 32-row k_proj and v_proj, intermediate 80."""
    from transformers import Qwen3Config

    return saved(root, Qwen3Config(**SMALL, head_dim=16), (32, 20), scales)


def llama(
    root: Path, scales: str, *, hidden: int, intermediate: int, block: int, num_layers: int = 4
) -> Path:
    shape = CheckpointShape(
        arch="llama",
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=intermediate,
        vocab_size=VOCAB,
        dtype="bfloat16",
        max_positions=64,
        max_shard_bytes=400_000,
        tokenizer=False,
        quantization="fp8-block",
        fp8_block=block,
        fp8_scales=scales,
    )
    return make_checkpoint(root, shape)


CASES = {
    # the silent wrong answer: every grid divides, the blocks are 128 (partial) not 96
    "llama-192": lambda root: llama(root, "float32", hidden=192, intermediate=384, block=128),
    "deepseek_v3": lambda root: deepseek_v3(root, "float32"),
    "kimi_k2-e8m0": lambda root: kimi_k2(root, "e8m0"),
    "qwen3-bf16": lambda root: qwen3(root, "bfloat16"),
    # E8M0 exponents as plain bytes (how MXFP8 checkpoints ship them)
    "llama-uint8": lambda root: llama(root, "uint8", hidden=48, intermediate=80, block=32),
}


def partial(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    return bool(shape[-2] % block[0] or shape[-1] % block[1])


@pytest.mark.parametrize("case", list(CASES))
def test_block_fp8_loads_with_the_numbers_its_format_defines(tmp_path, case: str) -> None:
    """Each checkpoint loads over the planner's offloading stages (offloaded FP8 weights kept in
    8 bits with their partial blocks, dequantized into their slots) with logits bitwise those
    of transformers loading the independently dequantized bf16 files, plain and left-padded,
    and greedy generation token for token the same."""
    fp8 = CASES[case](tmp_path / "fp8")
    reference = dequantized_copy(fp8, tmp_path / "bf16")
    index = load_index(fp8)
    eight = [t for layer in index.layers for t in layer.tensors if t.scale is not None]
    block = tuple(
        json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"]
    )
    assert eight and all(t.block == block for t in eight)
    assert any(partial(t.shape, block) for t in eight)  # the point of the case
    matches_reference(
        fp8, reference, case, lambda held: any(partial(tuple(h.shape), h.fmt.block) for h in held)
    )


def matches_reference(
    fp8: Path,
    reference: Path,
    case: str,
    check_held=None,
    resident_weights: str = "auto",
    check_stored=None,
) -> None:
    """`fp8` over the planner's offloading stages (offloaded FP8 weights kept in 8 bits, which
    `check_held` is asked about; resident ones as `resident_weights` says, the workers that
    keep them as stored `check_stored` is asked about once they ran) gives logits bitwise
    those of transformers loading the bf16 checkpoint `reference`, plain and left-padded, and
    greedy generation token for token."""
    index = load_index(fp8)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (5, 8)]
    new = 8
    pipeline = Pipeline(index, resident_weights=resident_weights)
    try:
        assert any(s.offloaded for s in pipeline.plan.stages)
        stored = [w for w in pipeline.workers if w.spec.resident_stored]
        assert bool(stored) == (resident_weights == "stored")
        # (a stage whose quantized matrices are all offloaded holds none as stored)
        assert not stored or any(w.report().resident_format for w in stored)
        held = [
            h
            for worker in pipeline.workers
            if worker.spec.offloaded
            for h in worker.offloader.host_tensors().values()
            if isinstance(h, QuantizedTensor)
        ]
        assert held
        if check_held is not None:
            assert check_held(held)
        logits, padded = pipeline(ids), pipeline(ids, mask)
        ours = [generate_each(pipeline, [prompt], new)[0] for prompt in prompts]
        if check_stored is not None:
            assert check_stored(stored)
    finally:
        pipeline.close()
    expected = reference_logits(str(reference), ids, dtype="bfloat16", num_threads=1)
    diff = (logits.float() - expected.float()).abs().max().item()
    top = expected.float().abs().max().item()
    assert torch.equal(logits, expected), f"{case}: logits {diff:.3g} off on a maximum of {top:.3g}"
    assert torch.equal(
        padded,
        reference_logits(
            str(reference),
            ids,
            dtype="bfloat16",
            num_threads=1,
            attention_mask=mask,
            position_ids=positions,
        ),
    )
    for prompt, tokens in zip(prompts, ours, strict=True):
        theirs = reference_generate(
            str(reference),
            torch.tensor([prompt]),
            dtype="bfloat16",
            num_threads=1,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        assert tokens == theirs, case


# --- offload.quant: partial blocks ----------------------------------------------------------


def random_fp8(shape: tuple[int, ...], fmt: BlockFormat, seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(FP8)
    scales = torch.rand(fmt.scale_shape(shape), generator=g) * 1e-2 + 1e-4
    return QuantizedTensor(q, scales, fmt)


@pytest.mark.parametrize(
    ("shape", "block"),
    [((576, 256), (128, 128)), ((80, 48), (32, 20)), ((3, 144, 48), (32, 32)), ((5, 70), (1, 32))],
)
def test_partial_blocks_dequantize_as_deepseeks_weight_dequant(
    monkeypatch, shape: tuple[int, ...], block: tuple[int, int]
) -> None:
    """Whole and in small chunks (a stacked weight whose rows end in a partial block goes one
    matrix at a time), each entry is its block's scale times it, as `weight_dequant` gives."""
    fmt = BlockFormat(FP8, block)
    weight = random_fp8(shape, fmt)
    q, scales = (
        weight.q.reshape(-1, *shape[-2:]),
        weight.scales.reshape(-1, *weight.scales.shape[-2:]),
    )
    expected = torch.stack(
        [weight_dequant(q[m], scales[m], list(block)) for m in range(q.shape[0])]
    ).reshape(shape)
    assert torch.equal(weight.dequantized(torch.bfloat16), expected)
    monkeypatch.setattr(quant_module, "CHUNK_ELEMENTS", 3 * shape[-1])
    out = torch.empty(shape, dtype=torch.bfloat16)
    dequantize_into(out, weight)
    assert torch.equal(out, expected)


def test_partial_blocks_quantize_each_block_by_its_own_entries() -> None:
    """A partial block's scale maps its own largest entry to 448 (nothing past the weight's
    edge counts); views take whole blocks or the partial last one."""
    fmt = BlockFormat(FP8, (32, 32))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 72, 48, generator=g)
    q = quantized(w, fmt)
    assert q.scales.shape == (2, 3, 2)
    for m, i, j in [(0, 2, 1), (1, 2, 0), (1, 0, 1), (0, 0, 0)]:
        part = w[m, i * 32 : (i + 1) * 32, j * 32 : (j + 1) * 32]
        assert q.scales[m, i, j] == part.abs().max() / torch.tensor(448.0)
    back = q.dequantized(torch.float32)
    scale = q.scales.repeat_interleave(32, -2)[:, :72].repeat_interleave(32, -1)[..., :48]
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale * 2**-9 + 1e-6).all()  # e4m3 rounding
    tail = q.select(0, 1).narrow(0, 64, 8)  # the partial last block row
    assert tail.scales.shape == (1, 2)
    assert torch.equal(tail.dequantized(torch.float32), back[1, 64:])
    with pytest.raises(ValueError, match="not whole"):
        q.select(0, 1).narrow(0, 32, 8)  # ends inside a block that goes on


def test_prefetch_keeps_partial_blocks_in_8_bits(monkeypatch) -> None:
    """Offloaded layers with partial blocks in both dims, a stacked parameter whose rows end in
    a partial block among them, cross in pieces through a small staging buffer and dequantize
    into their slots to the weights of their 8-bit round trip."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Parameter(torch.randn(3, 72, 40) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("bi,eoi->bo", x, self.proj)

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(72, 40), Experts()).to(torch.bfloat16).eval()

    monkeypatch.setattr(quant_module, "STAGING_BYTES", 2000)  # a few block rows a piece
    torch.manual_seed(0)
    layers = [block() for _ in range(4)]
    formats = {}
    reference = [block() for _ in range(4)]
    with torch.no_grad():
        for i, layer in enumerate(layers):
            reference[i].load_state_dict(layer.state_dict())
            if i == 0:
                continue
            for name, fmt in (
                ("0.weight", BlockFormat(FP8, (32, 32))),
                ("1.proj", BlockFormat(FP8, (32, 16))),
            ):
                formats[f"{i}.{name}"] = fmt
                param = reference[i].get_parameter(name)
                param.copy_(quantized(param, fmt).dequantized(torch.bfloat16))
    x = torch.randn(2, 72).to(torch.bfloat16)
    expected = run_stack(reference, x)
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=(1, 2, 3), prefetch_step=2),
        device="cpu",
        formats=formats,
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        host = offloader.host_tensors()
        assert host["1.1.proj"].scales.shape == (3, 3, 3)
        for _ in range(2):
            assert torch.equal(run_stack(layers, x), expected)
    finally:
        offloader.detach()


# --- refused at indexing, in one line naming the tensor -------------------------------------


@pytest.fixture(scope="module")
def small_fp8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small") / "fp8"
    return llama(root, "float32", hidden=48, intermediate=80, block=32)


def edited(source: Path, root: Path, edit) -> Path:
    """A copy of checkpoint `source` whose tensors (one dict over all shards) and config `edit`
    changes in place."""
    shutil.copytree(source, root)
    tensors = read_all(root)
    config = json.loads((root / "config.json").read_text())
    edit(tensors, config)
    for file in root.glob("*.safetensors*"):
        file.unlink()
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config))
    return root


DOWN = "model.layers.1.mlp.down_proj.weight"  # [48, 80]: a [2, 3] grid of 32 x 32 blocks


def _set(name: str, make):
    def edit(tensors: dict, config: dict) -> None:
        tensors[name] = make(tensors)

    return edit


def _config(**changes):
    def edit(tensors: dict, config: dict) -> None:
        config["quantization_config"].update(changes)

    return edit


def _drop_config(tensors: dict, config: dict) -> None:
    del config["quantization_config"]


def _drop_scale(tensors: dict, config: dict) -> None:
    del tensors[DOWN + SCALE]


REFUSALS = {
    # blocks of 16 make a [3, 5] grid of a [48, 80] down_proj, the file has [2, 3]
    "grid-not-the-block's": (
        _config(weight_block_size=[16, 16]),
        r"FP8 tensor 'model\.layers\.\d\.[a-z_.]+' \[\d+, \d+\] has a \[\d, \d\] grid of block "
        r"scales, but blocks of weight_block_size=\[16, 16\] make a \[\d, \d\] grid",
    ),
    "grid-one-row-short": (
        _set(DOWN + SCALE, lambda t: t[DOWN + SCALE][:1].clone()),
        r"\[48, 80\] has a \[1, 3\] grid of block scales, but blocks of "
        r"weight_block_size=\[32, 32\] make a \[2, 3\] grid",
    ),
    "scale-beside-bf16": (
        _set(DOWN, lambda t: torch.zeros(48, 80, dtype=torch.bfloat16)),
        rf"tensor '{re.escape(DOWN + SCALE)}' holds block scales, but its weight "
        rf"'{re.escape(DOWN)}' is BF16, not F8_E4M3",
    ),
    "e5m2-weight": (
        _set(DOWN, lambda t: t[DOWN].float().to(torch.float8_e5m2)),
        rf"tensor '{re.escape(DOWN)}' is F8_E5M2 \[48, 80\]; supported: block-FP8",
    ),
    "int-scales": (
        _set(DOWN + SCALE, lambda t: torch.ones(2, 3, dtype=torch.int32)),
        r"are I32, which has no defined reading as block scales",
    ),
    "no-scales": (_drop_scale, rf"'{re.escape(DOWN)}' \[48, 80\] has no 2-D '.*_scale_inv'"),
    "no-quantization-config": (
        _drop_config,
        r"config.json has no block-FP8 quantization_config",
    ),
    "block-of-one-size": (
        _config(weight_block_size=[128]),
        r"weight_block_size=\[128\] is not two block sizes >= 1",
    ),
    "block-of-zero": (
        _config(weight_block_size=[0, 128]),
        r"weight_block_size=\[0, 128\] is not two block sizes >= 1",
    ),
}


def refused_at_indexing(root: Path, expected: str) -> None:
    """Indexing `root` fails with one line that matches `expected`."""
    with pytest.raises(CheckpointError) as caught:
        load_index(root)
    message = str(caught.value)
    assert "\n" not in message
    assert re.search(expected, message), message


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_would_read_as_other_numbers_is_refused_at_indexing(
    small_fp8: Path, tmp_path, case: str
) -> None:
    edit, expected = REFUSALS[case]
    refused_at_indexing(edited(small_fp8, tmp_path / case, edit), expected)


def test_the_unedited_checkpoint_loads(small_fp8: Path, tmp_path) -> None:
    """The refusals' checkpoint, rewritten as one file but unchanged, is indexed."""
    index = load_index(edited(small_fp8, tmp_path / "same", lambda tensors, config: None))
    scales = {t.scale.shape for layer in index.layers for t in layer.tensors if t.name == DOWN}
    assert scales == {(2, 3)}


# --- make-checkpoint writes the format's blocks ---------------------------------------------


@pytest.mark.parametrize("scales", ["float32", "bfloat16", "e8m0", "uint8"])
def test_fp8_blocks_are_the_formats_with_partial_last_ones(scales: str) -> None:
    """A [576, 256] weight in 128 x 128 blocks: a [5, 2] grid, the last block row of 64 rows
    scaled by its own largest entry; each stored dtype reads back (as the reference reads it)
    to within FP8's rounding, E8M0 scales powers of two at or above amax / 448."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, 256, generator=g).to(torch.bfloat16)
    w[512:] *= 100  # the partial block row: its own scale
    q, stored = fp8_blocks(w, (128, 128), scales)
    wanted = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "e8m0": torch.float8_e8m0fnu,
        "uint8": torch.uint8,
    }[scales]
    assert q.dtype == FP8 and q.shape == (576, 256)
    assert stored.dtype == wanted and stored.shape == (5, 2)
    values = scale_values(stored)
    amax = w[512:, :128].float().abs().max() / 448
    if scales in ("e8m0", "uint8"):
        assert amax <= values[4, 0] < 2 * amax
    else:
        assert torch.isclose(values[4, 0], amax, rtol=2**-7)
    back = weight_dequant(q, values, [128, 128]).float()
    assert ((back - w.float()).abs() <= w.float().abs() / 8 + values.max() * 2**-8).all()


def test_make_checkpoint_cli_writes_the_block_and_scale_dtype(tmp_path) -> None:
    from coordinator.cli.main import main

    out = tmp_path / "ckpt"
    args = ["make-checkpoint", str(out), "--layers", "2", "--hidden-size", "48", "--heads", "4"]
    args += ["--kv-heads", "2", "--intermediate-size", "80", "--vocab", "96", "--dtype", "bfloat16"]
    args += ["--quantization", "fp8-block", "--fp8-block", "32", "--fp8-scales", "e8m0"]
    assert main([*args, "--no-tokenizer"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    tensors = read_all(out)
    assert tensors[DOWN.replace(".1.", ".0.") + SCALE].dtype == torch.float8_e8m0fnu
    assert tensors[DOWN.replace(".1.", ".0.") + SCALE].shape == (2, 3)
    load_index(out)


@pytest.mark.parametrize("case", ["llama-192", "deepseek_v3"])
def test_checks_reference_reads_partial_blocks_as_the_format_defines(tmp_path, case) -> None:
    """`offloadctl run --check`'s reference (`reference_logits` on the FP8 files themselves):
    where transformers' own FP8 loader would infer other blocks (llama-192) or not load at all
    (deepseek_v3's 576-row kv_a_proj_with_mqa), it reads a copy dequantized as the format
    defines: the logits of this test's own dequantized bf16 files."""
    fp8 = CASES[case](tmp_path / "fp8")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    expected = reference_logits(
        str(dequantized_copy(fp8, tmp_path / "bf16")), ids, dtype="bfloat16", num_threads=1
    )
    assert torch.equal(reference_logits(str(fp8), ids, dtype="bfloat16", num_threads=1), expected)
