"""`offloadctl make-checkpoint`: a random-weight Hugging Face checkpoint of a chosen shape.

For the demo, the tests, and users who want a dry run of a real model's shape without
downloading it. Written by `transformers` itself (`save_pretrained`, sharded safetensors), so
what we load is exactly what a real checkpoint looks like: MoE families come out with one tensor
per expert (`model.layers.0.mlp.experts.3.gate_proj.weight`, Mixtral's
`model.layers.0.block_sparse_moe.experts.3.w1.weight`), GPT-NeoX's head as `embed_out.weight`.

One generic shape maps onto every family's own config. Each family also gets what makes it
itself, sized so that a 12-16 token test sequence runs through it: a sliding window shorter than
the sequence, sliding and full layers side by side, soft-capping, Granite's multipliers, MoE
routing over several experts. Flags that do not apply to a family are ignored, never an error:
`num_kv_heads` for gpt2, gpt_neox and the DeepSeek families (no grouped-query attention: they
use `num_heads`),
`num_experts` / `experts_per_token` outside the MoE families, `sliding_window` outside mistral,
gemma2 and gemma3_text. In the MoE families `intermediate_size` is each expert's width (and
qwen2_moe's shared expert's).

Unless `tokenizer=False` (`--no-tokenizer`), the checkpoint also carries a small real tokenizer
(`coordinator.tools.tiny_tokenizer`) that `AutoTokenizer.from_pretrained` loads, with a ChatML chat
template, so generation and the server deal in text; config.json and generation_config.json
then name its pad, bos and eos ids, whatever the family's defaults, so `generate` stops at its
eos. Without one, the family's own defaults stay (None where they fall outside the vocab).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from coordinator.tools import tiny_tokenizer
from offload.errors import ConfigError
from worker.names import TESTED_FAMILIES

ARCHITECTURES = TESTED_FAMILIES  # every family the parity tests check
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention
MOE_ARCHITECTURES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    *MLA_ARCHITECTURES,
    "gpt_oss",
    "qwen3_next",
    "jamba",
)
SLIDING_ARCHITECTURES = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
# num_kv_heads does not apply: multi-head attention only (no such field), or MLA (as many KV
# heads as query heads: DeepSeek's attention fails with fewer)
NO_KV_HEADS = ("gpt2", "gpt_neox", *MLA_ARCHITECTURES)
DTYPES = ("float32", "bfloat16", "float16")
# How the checkpoint is quantized, as each format is published:
# - "fp8-block": as DeepSeek-V3, Kimi-K2 and the Qwen3 -FP8 checkpoints: every linear weight of
#   the decoder layers (experts one by one) in float8_e4m3fn, one scale per block of
#   `fp8_block` x `fp8_block` (128 as published; the last block of a dim partial where the dim
#   is no multiple of it) in `<name>_scale_inv` (what the block's entries are multiplied by)
# - "fp8-compressed": compressed-tensors FP8 as RedHatAI's -FP8-dynamic checkpoints, the same
#   weights with a `<name>_scale` per tensor, channel or block (`fp8_strategy`)
# - "mxfp4": as gpt-oss-20b/120b: each layer's fused expert projections as `<name>_blocks`
#   (packed e2m1 pairs) and `<name>_scales` (an E8M0 exponent per 32 values), the rest bf16
QUANTIZATIONS = ("none", "fp8-block", "fp8-compressed", "mxfp4")
FP8_BLOCK = 128
FP8_MAX = 448.0  # the largest float8_e4m3fn
# How the scales are stored: float32 (DeepSeek-V3's, Qwen3's), bfloat16, or E8M0 powers of two
# (DeepSeek's `ue8m0`: as float8_e8m0fnu, or its bytes as uint8, as MXFP8 checkpoints ship them)
FP8_SCALE_DTYPES = ("float32", "bfloat16", "e8m0", "uint8")
# compressed-tensors FP8 weight strategies (`quantize_fp8_compressed`), and how its scales are
# stored (float32, or bfloat16 as many -FP8-dynamic checkpoints have them)
FP8_CT_STRATEGIES = ("tensor", "channel", "block")
FP8_CT_SCALE_DTYPES = ("float32", "bfloat16")
MXFP4_GROUP = 32  # values per E8M0 scale
MAX_POSITIONS = 2048
# Clearly different from Granite's neutral 1.0, so a stage that drops one of them shows.
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0
)
# GPT-2 spells the generic names its own way; its attribute_map aliases all but n_inner, but
# writing its own names keeps config.json looking like a real GPT-2's.
_OWN_NAMES = {
    "gpt2": dict(
        num_hidden_layers="n_layer",
        hidden_size="n_embd",
        num_attention_heads="n_head",
        intermediate_size="n_inner",
        max_position_embeddings="n_positions",
    )
}
_PERTURB_STD = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointShape:
    arch: str = "llama"
    num_layers: int = 8
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 512
    vocab_size: int = 1024
    dtype: str = "float32"
    tie_embeddings: bool = False
    num_experts: int = 4
    experts_per_token: int = 2
    sliding_window: int = 4
    max_positions: int = MAX_POSITIONS  # GPT-2 learns a position embedding of this many rows
    max_shard_bytes: int = 2 * 2**20
    seed: int = 0
    tokenizer: bool = True  # write a tokenizer; its special-token ids go into the configs
    quantization: str = "none"  # QUANTIZATIONS
    fp8_block: int = FP8_BLOCK  # rows and cols of an FP8 block ("fp8-block", block strategy)
    fp8_scales: str = "float32"  # FP8_SCALE_DTYPES (FP8_CT_SCALE_DTYPES for "fp8-compressed")
    fp8_strategy: str = "block"  # FP8_CT_STRATEGIES ("fp8-compressed")

    def __post_init__(self) -> None:
        for f in fields(self):  # the Python API gets the CLI's checks: a wrong type is named
            value, wanted = getattr(self, f.name), {"int": int, "bool": bool, "str": str}[f.type]
            if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                raise ConfigError(f"{f.name}={value!r} must be of type {f.type}")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"arch={self.arch!r} is not one of {', '.join(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization={self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
            )
        if self.fp8_scales not in FP8_SCALE_DTYPES:
            raise ConfigError(
                f"fp8_scales={self.fp8_scales!r} is not one of {', '.join(FP8_SCALE_DTYPES)}"
            )
        if self.quantization != "none" and self.dtype == "float32":
            raise ConfigError(
                f"quantization={self.quantization!r} goes with dtype bfloat16 or float16 "
                "(published quantized checkpoints keep their other tensors in 16 bits): pass "
                "--dtype bfloat16"
            )
        if self.quantization == "fp8-compressed":
            if self.fp8_strategy not in FP8_CT_STRATEGIES:
                raise ConfigError(
                    f"fp8_strategy={self.fp8_strategy!r} is not one of "
                    f"{', '.join(FP8_CT_STRATEGIES)}"
                )
            if self.fp8_scales not in FP8_CT_SCALE_DTYPES:
                raise ConfigError(
                    f"fp8_scales={self.fp8_scales!r}: compressed-tensors stores scales as "
                    f"{' or '.join(FP8_CT_SCALE_DTYPES)}"
                )
        if self.quantization == "mxfp4":
            if self.arch != "gpt_oss":
                raise ConfigError(
                    f"quantization='mxfp4' is gpt-oss's format (its experts' fused projections),"
                    f" not {self.arch}'s: pass --arch gpt_oss"
                )
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % MXFP4_GROUP:
                    raise ConfigError(
                        f"{name}={getattr(self, name)}: MXFP4 scales groups of {MXFP4_GROUP} "
                        f"values along it, so it must be a multiple of {MXFP4_GROUP}"
                    )
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "vocab_size",
            "num_experts",
            "experts_per_token",
            "sliding_window",
            "max_positions",
            "max_shard_bytes",
            "fp8_block",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        head_dim = self.hidden_size // self.num_heads
        if self.arch != "gpt2" and head_dim % 2:  # every other family rotates pairs (RoPE)
            raise ConfigError(
                f"hidden_size={self.hidden_size} / num_heads={self.num_heads} = {head_dim}: "
                f"{self.arch}'s rotary embedding needs an even head dim"
            )
        if self.arch not in NO_KV_HEADS and self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.arch in MOE_ARCHITECTURES and self.experts_per_token > self.num_experts:
            raise ConfigError(
                f"experts_per_token={self.experts_per_token} must be <= "
                f"num_experts={self.num_experts}"
            )
        if self.tokenizer and self.vocab_size < tiny_tokenizer.MIN_VOCAB:
            raise ConfigError(
                f"vocab_size={self.vocab_size} is too small for a tokenizer (needs "
                f">= {tiny_tokenizer.MIN_VOCAB}); pass tokenizer=False "
                "(--no-tokenizer) for a checkpoint without one"
            )

    def family_settings(self) -> dict[str, Any]:
        """What makes `arch` itself, in its config's own field names."""
        head_dim = self.hidden_size // self.num_heads
        # Gemma 3 runs 5 sliding : 1 full; capping the period at the layer count keeps that
        # from 6 layers up and still gives 2-5 layers both kinds (the last one full).
        period = min(6, self.num_layers)
        gemma3_layers = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(self.num_layers)
        ]
        window = {"sliding_window": self.sliding_window}
        gemma = {**window, "query_pre_attn_scalar": head_dim}
        experts = {"num_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token}
        qwen_moe = {**experts, "moe_intermediate_size": self.intermediate_size}
        deepseek = {
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.intermediate_size,
            "n_shared_experts": 1,
            "first_k_dense_replace": min(1, self.num_layers - 1),
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 2 * head_dim,
            "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": head_dim,  # its head_dim, as the config derives it
            "v_head_dim": head_dim,
        }
        table: dict[str, dict[str, Any]] = {
            "mistral": window,
            # Gemma 2 alternates sliding and full layers by default (sliding first).
            "gemma2": {**gemma, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
            "gemma3_text": {**gemma, "layer_types": gemma3_layers},
            "granite": GRANITE_MULTIPLIERS,
            "mixtral": experts,  # num_experts is an alias of its num_local_experts
            # The shared expert would default to 5632 wide whatever the hidden size.
            "qwen2_moe": {**qwen_moe, "shared_expert_intermediate_size": self.intermediate_size},
            # Real Qwen3 MoE checkpoints renormalise the chosen experts' routing weights.
            "qwen3_moe": {**qwen_moe, "norm_topk_prob": True},
            # DeepSeek-V3 as published, shrunk: the first layer dense, then routed experts and
            # a shared one; MLA with a compressed query, a latent of twice the head dim (what
            # the cache holds, with the rotated key part), groups that divide the experts.
            "deepseek_v3": {**deepseek, "q_lora_rank": self.hidden_size * 3 // 4},
            # DeepSeek-V2-Lite's: no query compression, greedy routing
            "deepseek_v2": {**deepseek, "q_lora_rank": None, "topk_method": "greedy"},
            # gpt-oss as published: sliding and full layers alternating, attention sinks,
            # biased attention, experts with clamped SwiGLU (its defaults)
            "gpt_oss": {
                **window,
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.experts_per_token,
                # YaRN's published factor of 32, over a context shrunk with max_positions
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": max(1, self.max_positions // 32),
                    "rope_theta": 150000.0,
                },
            },
            # Qwen3-Next: 3 gated delta-net (linear attention) layers to 1 gated full-attention
            # layer (the last one at least: a cache needs one), every layer MoE with a shared
            # expert
            "qwen3_next": {
                **qwen_moe,
                "layer_types": [
                    "full_attention"
                    if (i + 1) % min(4, self.num_layers) == 0
                    else "linear_attention"
                    for i in range(self.num_layers)
                ],
                "shared_expert_intermediate_size": self.intermediate_size,
                "linear_num_key_heads": self.num_kv_heads,
                "linear_num_value_heads": self.num_heads,
                "linear_key_head_dim": head_dim,
                "linear_value_head_dim": head_dim,
            },
            # Bamba: Mamba-2 mixers, one attention layer in four (from the second)
            "bamba": {
                "attn_layer_indices": [i for i in range(self.num_layers) if i % 4 == 1],
                "mamba_n_heads": 2 * self.hidden_size // head_dim,  # x head dim = expand x hidden
                "mamba_d_head": head_dim,
                "mamba_d_state": 16,
                "mamba_chunk_size": 4,  # shorter than most prompts: the scan continues chunks
            },
            # Jamba: Mamba mixers, attention every 4th layer from the second, experts in every
            # other layer
            "jamba": {**experts, "attn_layer_period": 4, "attn_layer_offset": 1},
            # Dropout would make a module left in train mode nondeterministic.
            "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        }
        return table.get(self.arch, {})

    def hf_config(self):
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[self.arch]
        defaults = {f.name: f.default for f in fields(cls)}
        values: dict[str, Any] = dict(
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tie_embeddings,  # explicit: gemma and gpt2 tie by default
            dtype=self.dtype,
        )
        if self.arch in MLA_ARCHITECTURES:
            values["num_key_value_heads"] = self.num_heads
        elif self.arch not in NO_KV_HEADS:
            values["num_key_value_heads"] = self.num_kv_heads
        if "head_dim" in defaults:  # else derived from hidden/heads; gemma's 256 breaks tiny shapes
            values["head_dim"] = self.hidden_size // self.num_heads
        if self.tokenizer:  # the ids of the tokenizer written alongside, inside any vocab
            values |= tiny_tokenizer.SPECIAL_IDS
        else:
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                # Defaults like phi3's pad 32000 fall outside a small vocab (an embedding's
                # padding_idx must be inside it): no such token, then.
                if isinstance(defaults.get(key), int) and defaults[key] >= self.vocab_size:
                    values[key] = None
        values |= self.family_settings()
        renames = _OWN_NAMES.get(self.arch, {})
        values = {renames.get(key, key): value for key, value in values.items()}
        # A config keeps unknown keyword arguments as stray attributes, so a misspelt field
        # would silently do nothing: refuse it here instead.
        unknown = set(values) - set(defaults) - set(getattr(cls, "attribute_map", {}))
        if unknown:
            raise AssertionError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
        return cls(**values)


def perturb_constant_parameters(model, seed: int) -> list[str]:
    """Add seeded noise to every parameter whose values are all equal (norm weights of either
    convention, zero biases, ...), so a wrong or missing load always shows. Returns their
    names."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights come once
            flat = param.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                noise = torch.randn(param.shape, generator=generator) * _PERTURB_STD
                param.copy_(param.float() + noise)
                changed.append(name)
    return changed


def make_checkpoint(out_dir: str | Path, shape: CheckpointShape, *, force: bool = False) -> Path:
    """Write a random-weight checkpoint to `out_dir`. Refuses a non-empty directory unless
    `force`, so a typo cannot overwrite someone's real model."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; choose another directory or pass --force")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FileExistsError(f"cannot create {out}: {exc.strerror or exc}") from None
    try:
        config = shape.hf_config()
    except Exception as exc:  # transformers' own validation (its own error types)
        raise ConfigError(f"{shape.arch} rejects this shape: {str(exc).strip()[:400]}") from None
    torch.manual_seed(shape.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape.dtype))
    perturb_constant_parameters(model, shape.seed)
    try:
        # save_pretrained replaces earlier shards; an earlier tokenizer would stay (`--force`
        # with `--no-tokenizer`, or files a newer tokenizer does not write) and mismatch.
        tiny_tokenizer.remove_tokenizer_files(out)
        model.save_pretrained(out, max_shard_size=shape.max_shard_bytes)
        block = (shape.fp8_block, shape.fp8_block)
        if shape.quantization == "fp8-block":
            quantize_fp8(out, model, block=block, scales=shape.fp8_scales)
        elif shape.quantization == "fp8-compressed":
            quantize_fp8_compressed(
                out,
                model,
                strategy=shape.fp8_strategy,
                block=block if shape.fp8_strategy == "block" else None,
                scales=shape.fp8_scales,
            )
        elif shape.quantization == "mxfp4":
            quantize_mxfp4(out)
        if shape.tokenizer:
            tiny_tokenizer.write_tokenizer(
                out, vocab_size=shape.vocab_size, max_positions=shape.max_positions
            )
    except OSError as exc:
        raise FileExistsError(f"cannot write the checkpoint to {out}: {exc}") from None
    return out


def fp8_weight_names(model) -> set[str]:
    """The checkpoint names FP8 publishes in 8 bits: each `nn.Linear` weight inside the decoder
    layers (transformers' FP8 loader converts exactly those), and each expert's projections
    (saved one tensor per expert). Embeddings, norms, routers that are not `nn.Linear`, and the
    head stay in the checkpoint's dtype."""
    import torch

    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}."
    }


def quantize_fp8(
    out: Path,
    model,
    *,
    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
    scales: str = "float32",
) -> None:
    """Rewrite the shards `save_pretrained` wrote of `model` into `out` with the FP8 weights
    (`fp8_weight_names`) and their scales, one per block of `block` (rows, cols; the last
    block of a dim partial where the dim is no multiple of it) stored as `scales`
    (FP8_SCALE_DTYPES); the index and config.json to match (`quantization_config` as
    DeepSeek-V3's, `weight_block_size` = `block`)."""
    import torch

    from coordinator.planning.weight_map import FP8_SCALE

    if scales not in FP8_SCALE_DTYPES:
        raise ConfigError(f"scales={scales!r} is not one of {', '.join(FP8_SCALE_DTYPES)}")
    if len(block) != 2 or min(block) < 1:
        raise ConfigError(f"block={block!r} must be two sizes >= 1")

    def written(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, stored = fp8_blocks(weight, block, scales)
        return {name: q, name + FP8_SCALE: stored}

    _rewrite_fp8(out, model, written)
    _set_quantization_config(
        out,
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
        },
    )


def _set_quantization_config(out: Path, quant: dict) -> None:
    """config.json in `out` with its `quantization_config` set to `quant`."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quant
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _rewrite_fp8(out: Path, model, written) -> None:
    """Rewrite the shards `save_pretrained` wrote of `model` into `out`, each FP8 weight
    (`fp8_weight_names`, and experts saved one by one) replaced by `written(name, weight)`
    (the tensors to write in its place: it and its scales), the index to match."""
    linear = fp8_weight_names(model)

    def quantized(name: str, tensor) -> bool:
        if tensor.ndim != 2 or not name.endswith(".weight") or ".layers." not in name:
            return False
        return name in linear or ".experts." in name  # experts: saved one by one

    _rewrite(out, quantized, written)


def _rewrite(out: Path, quantized, written) -> None:
    """Rewrite the shards in `out`, each tensor `quantized(name, tensor)` chooses replaced by
    `written(name, tensor)` (the tensors to write in its place), the index to match."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            metadata = f.metadata()
        out_tensors: dict = {}
        for name, tensor in tensors.items():
            if not quantized(name, tensor):
                out_tensors[name] = tensor
                continue
            if index is not None:
                del index["weight_map"][name]
            for key, value in written(name, tensor).items():
                out_tensors[key] = value
                if index is not None:
                    index["weight_map"][key] = shard.name
        save_file(out_tensors, shard, metadata=metadata)
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def quantize_fp8_compressed(
    out: Path,
    model,
    *,
    strategy: str,
    block: tuple[int, int] | None = None,
    scales: str = "float32",
    activations: str = "dynamic",
) -> None:
    """Rewrite the shards `save_pretrained` wrote of `model` into `out` as compressed-tensors
    FP8 (format float-quantized, as RedHatAI's -FP8-dynamic checkpoints): each linear weight of
    the decoder layers (`fp8_weight_names`, experts one by one) in float8_e4m3fn with a
    `<name>_scale` stored as `scales`: [1] for `strategy` "tensor", [rows, 1] for "channel",
    one per `block` (ceil(shape / block), the last block of a dim partial) for "block"; each
    scale the largest magnitude of its part / FP8_MAX. Embeddings, norms and lm_head stay as
    they are (`ignore`: lm_head). `activations` "static" also writes an `input_scale` of 1.0
    per module (a static FP8 activation scheme), "dynamic" a dynamic per-token one."""
    import torch

    from coordinator.planning.weight_map import CT_SCALE

    if strategy not in FP8_CT_STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is not one of {', '.join(FP8_CT_STRATEGIES)}")
    if scales not in FP8_CT_SCALE_DTYPES:
        raise ConfigError(f"scales={scales!r} is not one of {', '.join(FP8_CT_SCALE_DTYPES)}")
    if activations not in ("dynamic", "static"):
        raise ConfigError(f"activations={activations!r} is not 'dynamic' or 'static'")
    if (strategy == "block") != (block is not None) or (
        block and (len(block) != 2 or min(block) < 1)
    ):
        raise ConfigError(f"block={block!r}: two sizes >= 1 with strategy 'block', else None")

    def written(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, cols = weight.shape
        part = {"tensor": (rows, cols), "channel": (1, cols), "block": block}[strategy]
        q, stored = fp8_blocks(weight, part, scales)
        if strategy == "tensor":
            stored = stored.reshape(1)
        out_tensors = {name: q, name + CT_SCALE: stored}
        if activations == "static":
            module = name.removesuffix(".weight")
            out_tensors[module + ".input_scale"] = torch.ones(1, dtype=stored.dtype)
        return out_tensors

    _rewrite_fp8(out, model, written)
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "dynamic": False,
        "group_size": None,
        "block_structure": list(block) if block else None,
        "actorder": None,
        "observer": "minmax",
    }
    inputs = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "token" if activations == "dynamic" else "tensor",
        "dynamic": activations == "dynamic",
        "observer": None if activations == "dynamic" else "minmax",
    }
    _set_quantization_config(
        out,
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": inputs,
                    "output_activations": None,
                    "format": "float-quantized",
                }
            },
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "global_compression_ratio": None,
        },
    )


# gpt-oss's MXFP4 names: `<parameter>_blocks` and `<parameter>_scales`
MXFP4_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def quantize_mxfp4(out: Path) -> None:
    """Rewrite the shards `save_pretrained` wrote of a gpt-oss model into `out` as gpt-oss
    publishes them (`offload.mxfp4`): each layer's `mlp.experts.gate_up_proj` and
    `mlp.experts.down_proj` as `<name>_blocks` and `<name>_scales` of its transpose
    (`mxfp4_blocks`), biases, attention, router, embeddings and head as they are;
    config.json's `quantization_config` as gpt-oss-20b's."""

    def chosen(name: str, tensor) -> bool:
        return name.endswith(MXFP4_WEIGHTS) and tensor.ndim == 3

    def written(name: str, weight) -> dict:
        blocks, scales = mxfp4_blocks(weight.transpose(-1, -2))
        return {name + "_blocks": blocks, name + "_scales": scales}

    _rewrite(out, chosen, written)
    _set_quantization_config(
        out,
        {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    )


def mxfp4_blocks(weight):
    """`weight` (..., rows, cols), cols a multiple of MXFP4_GROUP, as MXFP4: blocks (..., rows,
    cols / 32, 16) of uint8, each byte two e2m1 codes (the even-numbered value in the low
    nibble; a code is a sign bit over the index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), and scales
    (..., rows, cols / 32) of uint8 E8M0 exponents x, the group's scale 2^(x - 127). A group's
    exponent is the smallest that brings its largest magnitude to 6 or below; each value is
    rounded to the nearest e2m1 number (the smaller on a tie)."""
    import torch

    *lead, rows, cols = weight.shape
    if cols % MXFP4_GROUP:
        raise ConfigError(f"a {list(weight.shape)} weight has no whole groups of {MXFP4_GROUP}")
    groups = weight.float().reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(
        amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)
    ).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8)
    pairs = codes.reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def fp8_blocks(weight, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK), scales: str = "float32"):
    """`weight` (rows, cols) as float8_e4m3fn, and its scales as `scales` (FP8_SCALE_DTYPES):
    one per block of `block` over a grid of ceil(rows / block rows) x ceil(cols / block cols),
    the last block of a dim partial where the dim is no multiple of it (the format's blocks,
    never equal ones the grid divides the weight into). Each block is divided by its scale,
    its largest magnitude / FP8_MAX (in bfloat16 to nearest, or the power of two at or above
    it for E8M0), and saturated at FP8_MAX; the scale is what to multiply by."""
    import torch

    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = weight.new_zeros((grid[0] * block[0], grid[1] * block[1]), dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    if scales == "bfloat16":
        stored = scale.to(torch.bfloat16)
        scale = stored.float()
    elif scales in ("e8m0", "uint8"):
        exponent = torch.ceil(torch.log2(scale)).clamp(-127, 127)
        stored = (exponent + 127).to(torch.uint8)
        scale = stored.view(torch.float8_e8m0fnu).float()  # 2^exponent, exactly
        if scales == "e8m0":
            stored = stored.view(torch.float8_e8m0fnu)
    else:
        stored = scale
    scaled = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    values = scaled.reshape(padded.shape)[:rows, :cols].contiguous()
    return values.to(torch.float8_e4m3fn), stored
