"""Random checkpoints of every supported family, loaded back by `transformers` itself.

For each family: the config has the requested shape and what makes the family itself (sliding
windows shorter than a test sequence, sliding and full layers side by side, soft-capping,
Granite's multipliers, several experts with real routing); `from_pretrained` finds every tensor
it expects and no other; no parameter is left constant (a wrong or missing load would show);
and saving the loaded model again gives the same tensors, which checks the loaded values even
where `transformers` renames or fuses them (per-expert files -> fused experts, GPT-NeoX's head).

Every checkpoint carries a tokenizer that `AutoTokenizer` loads: its ids fit the vocab, text
round-trips, config.json and generation_config.json name its special tokens, the ChatML template
renders with its markers as single special tokens, and the same shape writes the same files.
"""

from __future__ import annotations

import json
import struct
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer

from coordinator.cli import main
from coordinator.tools.make_checkpoint import (
    ARCHITECTURES,
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    NO_KV_HEADS,
    SLIDING_ARCHITECTURES,
    CheckpointShape,
    make_checkpoint,
)
from coordinator.tools.tiny_tokenizer import (
    BYTE_LEVEL_MIN_VOCAB,
    EOS,
    IM_START,
    MIN_VOCAB,
    TOKENIZER_FILES,
)

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 3, 32, 4, 2, 64, 80  # VOCAB != 3 * HIDDEN (fused qkv)
TINY = dict(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    intermediate_size=FFN,
    vocab_size=VOCAB,
)
SEQ = 14  # longer than the default sliding window of 4
LAYER_PREFIX = {"gpt2": "transformer.h.{}.", "gpt_neox": "gpt_neox.layers.{}."}
SPECIAL: dict[str, dict[str, object]] = {
    "mistral": {"sliding_window": 4},
    "gemma2": {
        "sliding_window": 4,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": HIDDEN // HEADS,
    },
    "gemma3_text": {
        "sliding_window": 4,
        "query_pre_attn_scalar": HIDDEN // HEADS,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "granite": {
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": FFN,
        "shared_expert_intermediate_size": FFN,
    },
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": FFN,
        "norm_topk_prob": True,
    },
}
# Where each MoE family's checkpoint keeps expert E of layer L: transformers fuses them in memory
# and splits them again on save.
EXPERT_TENSORS = {
    "mixtral": [f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w2", "w3")],
    "qwen2_moe": [f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")],
    "qwen3_moe": [f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")],
    "deepseek_v2": [f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")],
    "deepseek_v3": [f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")],
    "qwen3_next": [f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")],
    "jamba": [f"feed_forward.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")],
}
# which layers have experts: DeepSeek's first is dense, Jamba's every other from the second
MOE_LAYERS = {
    "deepseek_v2": range(1, LAYERS),
    "deepseek_v3": range(1, LAYERS),
    "jamba": range(1, LAYERS, 2),
}


WRITTEN = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # by transformers 5
SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Lowercase English of the small vocabs' alphabet: round-trips exactly whatever the vocab size.
SENTENCE = "the little town sat between the hills and the sea, and the boats came back at six.\n"


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def ties_by_default(arch: str) -> bool:
    return next(f.default for f in fields(CONFIG_MAPPING[arch]) if f.name == "tie_word_embeddings")


def write(tmp_path: Path, arch: str, **changes) -> Path:
    return make_checkpoint(tmp_path / arch, CheckpointShape(arch=arch, **{**TINY, **changes}))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_family_loads_with_its_shape_and_features(tmp_path: Path, arch: str) -> None:
    tie = not ties_by_default(arch)  # the flag, not the family's habit, decides
    out = write(tmp_path, arch, tie_embeddings=tie)
    model, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert {key: value for key, value in info.items() if value} == {}
    config = model.config
    assert config.model_type == arch
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (config.num_hidden_layers, config.hidden_size) == (LAYERS, HIDDEN)
    assert config.num_attention_heads == HEADS
    kv_heads = HEADS if arch in NO_KV_HEADS else KV_HEADS  # no GQA there: flag ignored
    assert getattr(config, "num_key_value_heads", HEADS) == kv_heads
    assert getattr(config, "n_inner", None) or config.intermediate_size == FFN
    assert getattr(config, "head_dim", None) in (None, HIDDEN // HEADS)
    assert config.max_position_embeddings == 2048
    for key, value in SPECIAL.get(arch, {}).items():
        assert getattr(config, key) == value, key
    if arch in ("gemma2", "gemma3_text"):
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}

    assert config.tie_word_embeddings is tie
    out_emb, in_emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (out_emb.data_ptr() == in_emb.data_ptr()) is tie
    saved = read_tensors(out)
    assert sum(t.shape == (VOCAB, HIDDEN) for t in saved.values()) == (1 if tie else 2)
    prefix = LAYER_PREFIX.get(arch, "model.layers.{}.")
    for layer in range(LAYERS):
        assert any(name.startswith(prefix.format(layer)) for name in saved), (arch, layer)

    # Nothing left at its constant initial value (norms of either convention, biases): a
    # parameter initialised instead of loaded would be constant again.
    for name, param in model.named_parameters():
        assert param.unique().numel() > 1, name
    state = model.state_dict()
    for name in saved.keys() & state.keys():
        assert torch.equal(saved[name], state[name]), name
    model.save_pretrained(tmp_path / "again")  # covers renamed and fused tensors too
    again = read_tensors(tmp_path / "again")
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[name], saved[name]) for name in saved)

    # Whichever tokenizer class transformers picks for the family (qwen2: its own), the
    # checkpoint's text and special tokens work.
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer(SENTENCE)["input_ids"]) == SENTENCE
    assert [getattr(config, key) for key in SPECIAL_KEYS] == [
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    ]


@pytest.mark.parametrize(("arch", "vocab"), [("llama", 64), ("qwen3_moe", VOCAB), ("gpt2", 1024)])
def test_tokenizer_fits_the_vocab_and_the_configs(tmp_path: Path, arch: str, vocab: int) -> None:
    out = write(tmp_path, arch, vocab_size=vocab)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.is_fast and len(tokenizer) <= vocab
    ids = tokenizer(SENTENCE)["input_ids"]
    assert len(ids) < len(SENTENCE) and max(ids) < vocab  # merges learnt, every id in the vocab
    assert tokenizer.decode(ids) == SENTENCE
    if vocab >= BYTE_LEVEL_MIN_VOCAB:  # all 256 bytes: any text round-trips
        text = "Ünïcödé, CAPITALS & tabs\t\u2713 \U0001f600!"
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text

    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert len(set(special)) == 3 and max(special) < vocab
    for name in ("config.json", "generation_config.json"):
        values = json.loads((out / name).read_text())
        assert [values[key] for key in SPECIAL_KEYS] == special, name
    assert tokenizer.model_max_length == 2048 and tokenizer.padding_side == "left"


def test_chat_template_renders_with_special_markers(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(write(tmp_path, "qwen3_moe"))
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    start, end = (tokenizer.convert_tokens_to_ids(marker) for marker in (IM_START, EOS))
    assert end == tokenizer.eos_token_id  # generate stops where a reply ends
    assert {start, end} <= set(tokenizer.all_special_ids)
    ids = tokenizer(text)["input_ids"]
    assert ids.count(start) == 3 and ids.count(end) == 2  # each marker one token
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    assert plain == "system\nbe brief.\nuser\nhi\nassistant\n"


def test_small_vocab_lowercases_and_marks_unknown_characters(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(write(tmp_path, "llama", vocab_size=64))
    ids = tokenizer("Hello, Wörld")["input_ids"]
    assert tokenizer.decode(ids) == "hello, w<|unk|>rld"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello, wrld"


@pytest.mark.parametrize("vocab", [64, 1024])
def test_same_shape_same_tokenizer_files(tmp_path: Path, vocab: int) -> None:
    def files(name: str) -> dict[str, bytes]:
        out = write(tmp_path / name, "llama", num_layers=1, vocab_size=vocab)
        found = {p.name: p.read_bytes() for p in out.iterdir() if p.name in TOKENIZER_FILES}
        assert set(found) == set(WRITTEN)
        return found

    assert files("a") == files("b")


def test_no_tokenizer_keeps_the_family_defaults(tmp_path: Path) -> None:
    out = write(tmp_path, "gemma", tokenizer=False)
    assert not [name for name in TOKENIZER_FILES if (out / name).exists()]
    config = json.loads((out / "config.json").read_text())
    defaults = CONFIG_MAPPING["gemma"]()
    assert [config[key] for key in SPECIAL_KEYS] == [getattr(defaults, k) for k in SPECIAL_KEYS]
    # The tokenizer's alphabet needs MIN_VOCAB ids; a checkpoint without one does not.
    with pytest.raises(ValueError, match=r"^vocab_size=16 is too small.*--no-tokenizer"):
        CheckpointShape(vocab_size=16)
    assert CheckpointShape(vocab_size=MIN_VOCAB - 1, tokenizer=False).hf_config().vocab_size == 31


@pytest.mark.parametrize("arch", [a for a in MOE_ARCHITECTURES if a != "gpt_oss"])
def test_moe_files_hold_one_tensor_per_expert_and_routing_is_real(
    tmp_path: Path, arch: str
) -> None:
    out = write(tmp_path, arch)
    saved = read_tensors(out)
    moe_layers = MOE_LAYERS.get(arch, range(LAYERS))
    for layer in moe_layers:
        for expert in range(4):
            for pattern in EXPERT_TENSORS[arch]:
                assert f"model.layers.{layer}.{pattern.format(e=expert)}" in saved
    assert not [name for name in saved if "experts.4." in name or "gate_up_proj" in name]
    if arch == "qwen2_moe":
        assert saved["model.layers.0.mlp.shared_expert.up_proj.weight"].shape == (FFN, HIDDEN)
    if arch in MLA_ARCHITECTURES:  # a dense first layer, a shared expert, routing by a gate
        assert saved["model.layers.0.mlp.gate_proj.weight"].shape == (FFN, HIDDEN)
        assert not [name for name in saved if name.startswith("model.layers.0.mlp.experts")]
        assert saved["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (FFN, HIDDEN)
        assert saved["model.layers.1.mlp.gate.weight"].shape == (4, HIDDEN)
        return  # its gate returns no router logits; test_families checks its outputs

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    assert len(router_logits) == len(moe_layers)
    for logits in router_logits:  # random gates: not every token goes to the same two experts
        assert logits.shape == (SEQ, 4)
        assert logits.topk(2).indices.unique().numel() > 2


def test_gpt_oss_experts_are_fused_as_published(tmp_path: Path) -> None:
    """gpt-oss publishes each layer's experts as one tensor per projection (with biases), the
    router with a bias, and attention with sinks: as `save_pretrained` writes them."""
    saved = read_tensors(write(tmp_path, "gpt_oss"))
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        assert saved[prefix + "mlp.experts.gate_up_proj"].shape == (4, HIDDEN, 2 * FFN)
        assert saved[prefix + "mlp.experts.down_proj"].shape == (4, FFN, HIDDEN)
        assert saved[prefix + "mlp.router.bias"].shape == (4,)
        assert saved[prefix + "self_attn.sinks"].shape == (HEADS,)


@pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES)
def test_sliding_window_changes_outputs_past_the_window(tmp_path: Path, arch: str) -> None:
    out = write(tmp_path, arch)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    windowed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # Mistral reads "no window" as None; the gemmas need a window, so one wider than the input.
    full = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, sliding_window=None if arch == "mistral" else 4 * SEQ
    )
    with torch.no_grad():
        a, b = windowed(ids).logits[0], full(ids).logits[0]
    same = [torch.allclose(a[i], b[i], atol=1e-5) for i in range(SEQ)]
    assert same == [True] * 4 + [False] * (SEQ - 4)


def test_bfloat16_files_and_config(tmp_path: Path) -> None:
    out = write(tmp_path, "llama", dtype="bfloat16")
    for path in out.glob("*.safetensors"):
        raw = path.read_bytes()
        header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
        header.pop("__metadata__", None)
        assert header and {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_same_seed_same_files_other_seed_other_files(tmp_path: Path) -> None:
    def files(name: str, seed: int) -> dict[str, bytes]:
        out = write(tmp_path / name, "gpt2", seed=seed)  # biases and LayerNorms perturbed too
        return {p.name: p.read_bytes() for p in out.glob("*.safetensors")}

    assert files("a", 7) == files("b", 7) != files("c", 8)


def test_cli_writes_a_moe_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe"
    argv = [
        "make-checkpoint",
        str(out),
        "--arch",
        "qwen2_moe",
        "--layers",
        "2",
        "--hidden-size",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate-size",
        "32",
        "--vocab",
        "64",
        "--experts",
        "3",
        "--experts-per-token",
        "1",
        "--tie-embeddings",
    ]
    assert main(argv) == 0
    assert "qwen2_moe" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["tie_word_embeddings"] is True
    assert (config["num_experts"], config["num_experts_per_tok"]) == (3, 1)
    saved = read_tensors(out)
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in saved
    assert not any("experts.3." in name for name in saved)
    assert all((out / name).is_file() for name in WRITTEN)
    # Overwritten without one: the earlier tokenizer (ids up to 63) must not stay behind.
    assert main([*argv[:2], "--force", "--vocab", "16", "--no-tokenizer"]) == 0
    assert not any((out / name).exists() for name in TOKENIZER_FILES)


def test_unknown_arch_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"^arch='bert' is not one of") as info:
        CheckpointShape(arch="bert")
    assert all(arch in str(info.value) for arch in ARCHITECTURES)


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("num_experts", {"num_experts": 0}),
        ("experts_per_token", {"experts_per_token": 0}),
        ("experts_per_token", {"num_experts": 2, "experts_per_token": 3}),
        ("sliding_window", {"sliding_window": 0}),
    ],
)
def test_invalid_moe_and_window_fields(field: str, changes: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{field}={changes[field]}"):
        CheckpointShape(arch="mixtral", **changes)


def test_kv_heads_do_not_apply_to_families_without_gqa() -> None:
    with pytest.raises(ValueError, match=r"^num_heads=4 must be a multiple of num_kv_heads=3"):
        CheckpointShape(arch="llama", num_heads=4, hidden_size=32, num_kv_heads=3)
    for arch in NO_KV_HEADS:
        config = CheckpointShape(arch=arch, num_heads=4, hidden_size=32, num_kv_heads=3).hf_config()
        assert config.num_attention_heads == 4
        if arch in MLA_ARCHITECTURES:  # as many as the query heads: DeepSeek fails with fewer
            assert config.num_key_value_heads == 4
        else:
            assert not hasattr(config, "num_key_value_heads")


@pytest.mark.parametrize(
    "values", [{"num_layers": "3"}, {"tie_embeddings": "yes"}, {"num_layers": True}, {"arch": 7}]
)
def test_wrong_types_are_named(values: dict) -> None:
    """The Python API gets the checks the CLI gets: a ValueError naming the field and type."""
    [(name, value)] = values.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be of type"):
        CheckpointShape(**values)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "deepseek_v3"])
def test_fp8_checkpoints_are_written_as_deepseek_publishes_them(tmp_path: Path, arch) -> None:
    """`--quantization fp8-block`: the decoder layers' linear weights (experts one by one) in
    float8_e4m3fn with a float32 scale per block, everything else as the bf16 checkpoint of the
    same seed writes it. transformers reads it (dequantizing on the CPU) to weights within
    FP8's rounding of the unquantized ones: half a step of 3 mantissa bits, 2^-4 of each block's
    largest magnitude at most. (Loading it: tests/test_families.py.)"""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    shards = dict(dtype="bfloat16", max_shard_bytes=20_000)  # several: the index too
    out = write(tmp_path, arch, quantization="fp8-block", **shards)
    plain = write(tmp_path / "plain", arch, **shards)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    saved, unquantized = read_tensors(out), read_tensors(plain)
    eight = {name for name, t in saved.items() if t.dtype == torch.float8_e4m3fn}
    assert eight and all(saved[f"{name}_scale_inv"].dtype == torch.float32 for name in eight)
    assert any(".experts." in name for name in eight) == (arch in ("mixtral", "deepseek_v3"))
    for name, tensor in unquantized.items():
        if name in eight:
            error = (saved[name].float() * saved[f"{name}_scale_inv"] - tensor.float()).abs()
            assert error.max() <= tensor.float().abs().max() / 16, name
        else:
            assert torch.equal(saved[name], tensor), name  # norms, embeddings, head, routers
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(saved)

    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16).state_dict()
    assert theirs.keys() == reference.keys()
    for name, tensor in reference.items():
        bound = tensor.float().abs().max() / 16 + 1e-2 * tensor.float().abs().max()
        assert (theirs[name].float() - tensor.float()).abs().max() <= bound, name


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_each_moe_family_routes_the_experts_per_token_asked(tmp_path: Path, arch: str) -> None:
    """`experts_per_token` reaches every MoE family's config, gpt-oss's too (it was left at
    transformers' default of 4: 4 of 4 experts, or a top-k past the experts with fewer)."""
    out = write(tmp_path, arch, num_experts=3, experts_per_token=1)
    config = AutoConfig.from_pretrained(out)
    assert config.num_experts_per_tok == 1
