"""`offloadctl make-checkpoint`: a random-weight Hugging Face checkpoint of a chosen shape.

For the demo, the tests, and users who want a dry run of a real model's shape without
downloading it. Written by `transformers` itself (`save_pretrained`, sharded safetensors), so
what we load is exactly what a real checkpoint looks like.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")


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
    max_shard_bytes: int = 2 * 2**20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r} is not one of {', '.join(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "intermediate_size", "vocab_size", "max_shard_bytes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def hf_config(self):
        from transformers import LlamaConfig, Qwen2Config

        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[self.arch]
        return cls(
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=2048,
            tie_word_embeddings=self.tie_embeddings,
            dtype=self.dtype,
        )


def make_checkpoint(out_dir: str | Path, shape: CheckpointShape, *, force: bool = False) -> Path:
    """Write a random-weight checkpoint to `out_dir`. Refuses a non-empty directory unless
    `force`, so a typo cannot overwrite someone's real model."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; choose another directory or pass --force")
    torch.manual_seed(shape.seed)
    model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=getattr(torch, shape.dtype))
    with torch.no_grad():  # norms start at exactly 1: perturb them so a wrong load shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    model.save_pretrained(out, max_shard_size=shape.max_shard_bytes)
    return out
