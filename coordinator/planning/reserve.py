"""The device memory a stage needs besides its weights and KV cache: the reserve.

A step's transient memory on a real GPU: cuBLAS's workspace, and the largest activations of a
step, one decoder layer at a time (the planner keeps this much free on every GPU):
- a prefill chunk of T tokens (`prefill_tokens`, or the whole batch of decodes when larger):
  its hidden states and the attention's inputs and output (~6 T x hidden), the MLP's three
  T x intermediate tensors, the attention mask (T x positions), and with eager attention the
  scores, T x heads x positions, in the model's dtype and again in float32 for the softmax
  (SDPA on CUDA uses fused kernels that never hold them);
- the last stage's logits: one row per sequence in the step, float32, twice (logits and the
  sampling's probabilities).
The CUDA context is not in it: the budget comes from the memory a probe found free with its own
context open, which the worker's context replaces. On simulated GPUs (the CPU stands in) the
activations live in host memory, outside the simulated budget: no reserve unless given.

Pure, no Ray: `launch`, `offloadctl plan` and re-plans resolve the same reserve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from coordinator.planning.options import AUTO_MAX_BATCH, PlanOptions
from coordinator.planning.snapshot import ClusterSnapshot

CUBLAS_WORKSPACE_BYTES = 32 << 20  # cuBLAS's default workspace on Hopper: 4 x 8 MiB
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Reserve:
    nbytes: int
    parts: tuple[tuple[str, int], ...]  # (what, bytes), for the plan to show
    source: str  # "computed", "given (--reserve)", or why there is none

    def describe(self) -> str:
        from coordinator.planning.formats import format_bytes

        if not self.parts:
            return self.source
        parts = " + ".join(f"{what} {format_bytes(n)}" for what, n in self.parts)
        return f"{self.source}: {parts}"


def step_reserve(
    model: dict[str, Any],
    dtype: str,
    *,
    max_batch: int,
    max_seq_len: int,
    prefill_tokens: int,
    attn_implementation: str | None,
) -> Reserve:
    """The reserve of one GPU for the model's config.json `model` in `dtype`, computed."""
    text = model.get("text_config") or model
    hidden = int(text.get("hidden_size") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    intermediate = max(
        int(text.get("intermediate_size") or 0),
        int(text.get("moe_intermediate_size") or 0) * int(text.get("num_experts_per_tok") or 1),
    )
    vocab = int(text.get("vocab_size") or 0)
    size = _DTYPE_BYTES.get(dtype, 4)
    rows = max(max_batch, 1)
    tokens = max(min(prefill_tokens, rows * max_seq_len) if max_seq_len else prefill_tokens, rows)
    positions = max_seq_len or tokens
    eager = attn_implementation == "eager"
    parts = [
        ("cuBLAS workspace", CUBLAS_WORKSPACE_BYTES),
        (
            f"activations of {tokens} tokens"
            + (f" with eager attention ({heads} heads x {positions} positions)" if eager else ""),
            tokens * size * (6 * hidden + 3 * intermediate + positions)
            + (tokens * heads * positions * (size + 4) if eager else 0),
        ),
        (f"logits of {rows} rows", rows * vocab * 4 * 2),
    ]
    return Reserve(sum(n for _, n in parts), tuple(parts), "computed")


def resolve_reserve(config, index, snapshot: ClusterSnapshot) -> Reserve:
    """The job's reserve: `--reserve` when given, computed where a node has real GPUs, else
    none (simulated GPUs)."""
    if config.reserve_bytes is not None:
        return Reserve(config.reserve_bytes, (), "given (--reserve)")
    if not any(node.cuda for node in snapshot.nodes):
        return Reserve(0, (), "none: simulated GPUs keep activations in host memory")
    return step_reserve(
        index.config,
        index.dtype,
        max_batch=config.max_batch or AUTO_MAX_BATCH,  # auto: the largest it may choose
        max_seq_len=config.max_seq_len,
        # a model whose recurrence does not continue over chunks takes each prompt whole
        # (engine.scheduler)
        prefill_tokens=max(config.prefill_tokens, config.max_seq_len)
        if not index.chunks_continue
        else config.prefill_tokens,
        attn_implementation=config.attn_implementation or default_attention(index.config),
    )


def default_attention(model: dict) -> str | None:
    """The attention transformers runs the model with where none is asked for: sdpa for most,
    eager for some (Gemma 2), whose scores then need their room. The model's class settles it
    when built, so one layer of it is built on the meta device, from the config as the workers
    read it (`worker.layout`). None where transformers cannot say."""
    import torch

    from worker.layout import hf_config_from_dict, model_class_for

    def one_layer(values: dict) -> dict:
        out = {**values, "num_hidden_layers": 1}
        if isinstance(values.get("layer_types"), list):
            out["layer_types"] = values["layer_types"][:1]
        return out

    try:
        one = one_layer(model)
        if isinstance(model.get("text_config"), dict):
            one["text_config"] = one_layer(model["text_config"])
        config = hf_config_from_dict(one, dtype=torch.float32)
        with torch.device("meta"):
            built = model_class_for(config)(config)
        return getattr(built.config, "_attn_implementation", None)
    except Exception:  # a config transformers cannot build is refused where the model is
        return None


def job_options(config, index, snapshot: ClusterSnapshot) -> PlanOptions:
    """The planner's options of a job (`JobConfig.plan_options`) with its reserve resolved on
    `snapshot`: what `launch`, `offloadctl plan` and a re-plan all plan with."""
    reserve = resolve_reserve(config, index, snapshot)
    return dataclasses.replace(
        config.plan_options(), reserve_bytes=reserve.nbytes, reserve_source=reserve.describe()
    )
