"""What the planner refuses, and why, with the numbers and the knobs: malformed layer lists, a
layer that fits no GPU, layers the cluster cannot hold. Also the two per-stage byte rules every
check and the plan share: KV cache per layer and prefetch slots per GPU. No Ray here."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.planning.formats import format_bytes
from coordinator.planning.options import PlanOptions
from coordinator.planning.search import LayerRange, Search
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from offload.errors import PlanError
from worker.spec import LayerSpec

# What can make a plan fit, as flags (and the job-file keys behind them).
KNOBS = (
    "add GPUs, raise --gpu-memory, raise the node's host budget (--host-memory / "
    "host_memory_bytes), lower --prefetch-step, --reserve (reserve_bytes), --max-batch or "
    "--max-seq-len"
)


def check_layers(layers: Sequence[LayerSpec]) -> None:
    if not layers:
        raise PlanError("no layers to place")
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        raise PlanError(f"duplicate layer names in {names}")
    for i, layer in enumerate(layers):
        if layer.kind not in ("embed", "decoder", "head"):
            raise PlanError(f"layer {layer.name!r}: kind={layer.kind!r} is not embed/decoder/head")
        if (layer.kind == "embed" and i != 0) or (layer.kind == "head" and i != len(layers) - 1):
            raise PlanError(
                f"layer {layer.name!r} ({layer.kind}) is at position {i} of {len(layers)}"
            )


def slot_count(node: NodeInfo, options: PlanOptions) -> int:
    """Device slots an offloading GPU of `node` holds: none where the GPU reads in place."""
    return 0 if node.backend == "uva" else options.prefetch_step


def kv_bytes(layer: LayerSpec, options: PlanOptions) -> int:
    return layer.pool_bytes(options.max_batch, options.pool_tokens)


def check_largest_layer(
    layers: Sequence[LayerSpec],
    gpus: list[tuple[NodeInfo, GpuInfo]],
    options: PlanOptions,
    weights: Sequence[int],
    jit_bytes: int = 0,
) -> None:
    """Every layer needs its own bytes on one device (`weights`: resident, its quantized
    matrices as stored where they are kept so; no less as a prefetch slot, at width; a UVA GPU
    reads an offloaded decoder layer in place), plus its KV cache, and where resident matrices
    are kept as stored the buffer of `jit_bytes` they are dequantized into."""
    # The largest GPU of each backend: the only candidates that matter for a single layer.
    largest: dict[str, tuple[NodeInfo, GpuInfo]] = {}
    for node, gpu in gpus:
        if node.backend not in largest or gpu.memory_bytes > largest[node.backend][1].memory_bytes:
            largest[node.backend] = (node, gpu)

    def held(i: int, node: NodeInfo) -> int:
        return 0 if layers[i].kind == "decoder" and node.backend == "uva" else weights[i]

    def need(i: int, node: NodeInfo) -> int:
        return held(i, node) + kv_bytes(layers[i], options) + jit_bytes + options.reserve_bytes

    for i in sorted(
        range(len(layers)), key=lambda i: weights[i] + kv_bytes(layers[i], options), reverse=True
    ):
        big = layers[i]
        node, gpu = max(largest.values(), key=lambda ng: ng[1].memory_bytes - need(i, ng[0]))
        if need(i, node) <= gpu.memory_bytes:
            continue
        kv = kv_bytes(big, options)
        why = (
            "offloaded, a decoder layer still needs a device slot of its size"
            if big.kind == "decoder" and node.backend != "uva"
            else f"the {big.kind} is never offloaded"
            if big.kind != "decoder"
            else "its KV cache stays on the GPU"
        )
        cache = (
            (
                f" + {format_bytes(kv)} of KV pool ({options.pool_tokens} tokens: max_batch "
                f"{options.max_batch}, max_seq_len {options.max_seq_len})"
            )
            if kv
            else ""
        )
        jit = (
            f" + {format_bytes(jit_bytes)} of buffer that resident quantized matrices, kept as "
            "stored, are dequantized into (none with --resident-weights wide)"
            if jit_bytes
            else ""
        )
        raise PlanError(
            f"layer {big.name!r} needs {need(i, node)} bytes on one GPU "
            f"({format_bytes(held(i, node))} of weights{cache}{jit} + reserve_bytes "
            f"{options.reserve_bytes}; {why}), but the largest GPU (node {node.node_id}, GPU "
            f"{gpu.index}) has {gpu.memory_bytes} bytes: raise --gpu-memory, lower --reserve "
            "(reserve_bytes), --kv-cache-tokens, --max-batch or --max-seq-len, or add larger "
            "GPUs"
        )


def unplaceable(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    reached: int,
    placements: Sequence[LayerRange],
    search: Search,
) -> PlanError:
    """The layers `search` could not place: its sizes are the plan's (resident quantized
    matrices as stored where they are kept so), its reserve the options' and the buffer they
    are dequantized into."""
    weights = search.prefix
    left = weights[-1] - weights[reached]
    device_total = sum(
        max(0, g.memory_bytes - search.reserve_bytes) for n in cluster.nodes for g in n.gpus
    )
    jit = (
        f" and the {search.jit_bytes}-byte buffer that resident quantized matrices, kept as "
        "stored, are dequantized into (none with --resident-weights wide)"
        if search.jit_bytes
        else ""
    )
    host = sum(n.offload_budget_bytes for n in cluster.nodes)
    where = "before any GPU took a layer"
    if placements:
        last = placements[-1]
        node = cluster.nodes[last.node]
        gpu = node.gpus[last.gpu]
        where = (
            f"after node {node.node_id} GPU {gpu.index} ({gpu.memory_bytes} bytes; the node's "
            f"offload budget is {node.offload_budget_bytes} bytes)"
        )
    return PlanError(
        f"the layers do not fit: placed {reached} of {len(layers)} layers, stopping {where}; "
        f"{left} bytes from layer {layers[reached].name!r} on are left. Needed "
        f"{weights[-1]} bytes of weights"
        f"{_kv_needed(layers, options)}; available "
        f"{device_total} bytes of GPU memory (less reserve_bytes {options.reserve_bytes}{jit} "
        "per GPU) "
        f"on {cluster.num_gpus} GPUs plus {host} bytes of host offload budget on "
        f"{len(cluster.nodes)} node(s), less {options.prefetch_step} slot(s) per prefetching GPU: "
        f"{KNOBS}"
    )


def _kv_needed(layers: Sequence[LayerSpec], options: PlanOptions) -> str:
    kv = sum(kv_bytes(layer, options) for layer in layers)
    if not kv:
        return ""
    return (
        f" and {kv} bytes of KV pool ({options.pool_tokens} tokens: max_batch "
        f"{options.max_batch}, max_seq_len {options.max_seq_len}), which stays on the GPUs"
    )
