"""The values a job's config chooses from, without torch: the model's dtype names, how offloaded
weights are kept, the KV block size, the families CI checks. `coordinator.config` validates a
job against them, and the driver's commands that only look at loads (`offloadctl list`,
`unload`) import it: they must not pay torch's import (2-3 s of CPU) to print a name.
`worker.spec` maps the names to torch; `worker.layout` checks the families."""

from __future__ import annotations

# The dtypes a model may load and compute in (`--dtype`), by their torch names.
COMPUTE_DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# How offloaded weights are kept in host memory and cross the link (`--offload-dtype`): "auto"
# as the checkpoint stores them (block-FP8 weights in 8 bits, the rest at the model's width),
# "none" all at the model's width (FP8 dequantized while read), "fp8" / "int8" every offloaded
# matrix in 8 bits (an FP8 checkpoint's as stored; others quantized at load in groups of
# QUANT_GROUP entries of a row). Dequantized on the device after each copy (prefetch backend).
OFFLOAD_DTYPES: tuple[str, ...] = ("auto", "none", "fp8", "int8")

# How an offloaded MoE layer's experts cross the link (`--expert-fetch`): "layer" with the
# rest of the layer, prefetched while earlier layers compute; "routed" only the experts the
# step's router chose, copied once it has (`offload.routed`); "auto" the planner's choice per
# stage, whichever its cost model says is faster at the plan's batch.
EXPERT_FETCHES: tuple[str, ...] = ("auto", "layer", "routed")

# Where a routed stage computes a step of few rows' experts (`--host-experts`): "off" on the
# GPU, copied in; "auto" on the host, read where they are in host memory, where the node's
# measured rates say that is sooner (Fiddler's choice; `offload.prefetch`, experts on the host).
HOST_EXPERTS: tuple[str, ...] = ("off", "auto")

# How a quantized checkpoint's resident weights sit on the GPU (`--resident-weights`): "stored"
# as the checkpoint stores them (FP8 blocks, MXFP4: 1 byte or half a byte an entry), each
# layer's dequantized into one buffer just before it runs (`offload.resident`); "wide"
# dequantized at load, at the model's width (twice the bytes of FP8); "auto" stored where every
# node's GPUs compute in FP8 (compute capability 8.9 or higher) and the plan at width would
# offload, so that fewer weights cross the link; wide elsewhere.
RESIDENT_WEIGHTS: tuple[str, ...] = ("auto", "stored", "wide")


def expected_experts(experts: int, per_token: int, rows: int) -> float:
    """Distinct experts a step of `rows` rows routes to, in expectation, each row choosing
    `per_token` of `experts` uniformly: E (1 - (1 - k/E)^rows)."""
    if experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - min(per_token, experts) / experts) ** max(rows, 1))


# Positions per KV block (worker.batch_cache): vLLM's default. Smaller wastes less of a
# sequence's last block; larger makes shorter block tables and fewer, larger gathers.
DEFAULT_BLOCK_SIZE = 16


def blocks_for(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


# Families checked against transformers in CI (tests/test_families.py). Others that pass
# worker.layout's checks load too, untested: `offloadctl` says so.
TESTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "bamba",
    "jamba",
    "gpt2",
    "gpt_neox",
)
