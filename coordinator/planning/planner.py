"""The planner: a pure function from (layers, cluster snapshot, options) to a frozen `Plan`.

It assigns contiguous layer ranges to GPUs and picks which decoder layers of each range are
offloaded to host memory, under each GPU's memory, each node's offload budget and a simple cost
model, minimising the slowest stage (the pipeline's bottleneck). No Ray here: the runtime
builds the `ClusterSnapshot`, `offloadctl plan` and the tests build one by hand.

Cost model, per stage: compute_s = all its weight bytes / compute_bytes_per_s; transfer_s =
its offloaded bytes / the node's host-to-device bandwidth (`NodeInfo.link_bytes_per_s`, which
the node's probe measures; `PlanOptions.default_link_bytes_per_s` where it did not); the copies
overlap compute, so the stage takes max(compute_s, transfer_s). The same holds for UVA, whose
kernels read the offloaded bytes over the same link as they compute. What the backends differ in
is device memory: a prefetching GPU holds `prefetch_step` slots of its largest offloaded layer,
a UVA GPU none (`NodeInfo.backend`, resolved per node from its probe). The search
(`coordinator.planning.search`) returns the exact optimum of this model; its module doc gives the
argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.planning.formats import format_bytes, format_rate, format_seconds, layer_range
from coordinator.planning.search import LayerRange, NodeLimits, Search
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.tables import render as render_table
from offload.errors import ConfigError, PlanError
from worker.spec import LayerSpec

MAX_PREFETCH_STEP = 64
# What can make a plan fit, as flags (and the job-file keys behind them).
KNOBS = (
    "add GPUs, raise --gpu-memory, raise the node's host budget (--host-memory / "
    "host_memory_bytes), lower --prefetch-step, --reserve (reserve_bytes), --max-batch or "
    "--max-seq-len"
)
_JSON_VERSION = 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_rate(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """The planner's knobs and its cost model's rates."""

    reserve_bytes: int = 0  # per GPU, kept free for activations and workspace
    prefetch_step: int = 1  # device slots per offloading stage
    compute_bytes_per_s: float = 200e9  # weight bytes a stage computes through per second
    default_link_bytes_per_s: float = 25e9  # host-to-device, for nodes that did not measure it
    # KV cache reserved on each GPU for its decoder layers: max_batch sequences of up to
    # max_seq_len tokens each (0: none; the job cannot generate).
    max_batch: int = 0
    max_seq_len: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.reserve_bytes) or self.reserve_bytes < 0:
            raise ConfigError(
                f"PlanOptions.reserve_bytes={self.reserve_bytes!r} must be an int >= 0"
            )
        for name in ("max_batch", "max_seq_len"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"PlanOptions.{name}={getattr(self, name)!r} must be an int >= 0")
        if not _is_int(self.prefetch_step) or not 1 <= self.prefetch_step <= MAX_PREFETCH_STEP:
            raise ConfigError(
                f"PlanOptions.prefetch_step={self.prefetch_step!r} must be an int in "
                f"1..{MAX_PREFETCH_STEP}"
            )
        for name in ("compute_bytes_per_s", "default_link_bytes_per_s"):
            value = getattr(self, name)
            if not _is_rate(value):
                raise ConfigError(f"PlanOptions.{name}={value!r} must be a finite number > 0")


DEFAULT_OPTIONS = PlanOptions()


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: a GPU, its contiguous layers, and which of them are offloaded."""

    stage: int
    node_id: str
    hostname: str
    gpu_index: int
    layers: tuple[str, ...]  # contiguous, in model order
    offloaded: tuple[str, ...]  # decoder layers of this stage kept in host memory
    prefetch_step: int  # device slots when it offloads: options.prefetch_step, 0 for uva
    resident_bytes: int
    slot_bytes: int  # min(prefetch_step, len(offloaded)) slots of the largest offloaded layer
    offloaded_bytes: int
    device_bytes: int  # resident + slots + reserve + KV cache
    pinned: bool  # the node's pin decision for the offloaded weights
    compute_s: float
    transfer_s: float
    time_s: float  # max(compute_s, transfer_s): the copies overlap compute
    # The node's measured host-to-device rate behind transfer_s; None: not measured, the cost
    # model used options.default_link_bytes_per_s (and plans saved before it was measured).
    link_bytes_per_s: float | None = None
    kv_bytes: int = 0  # KV cache reserved for max_batch x max_seq_len
    # How the offloaded layers reach the GPU: "prefetch" (copied into slots ahead of use) or
    # "uva" (read in place); the node's, resolved from the job's backend and the node's probe.
    backend: str = "prefetch"
    backend_reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The stages in pipeline order; `bottleneck_s` is the slowest stage's time."""

    stages: tuple[StagePlan, ...]
    options: PlanOptions
    bottleneck_s: float
    total_bytes: int

    @property
    def bottleneck_stage(self) -> int:
        return max(self.stages, key=lambda s: s.time_s).stage

    def to_json(self) -> str:
        return json.dumps({"version": _JSON_VERSION, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.pop("version", None) != _JSON_VERSION:
            raise ConfigError(f"Plan.from_json: expected version {_JSON_VERSION}")
        stages = tuple(
            StagePlan(**{**s, "layers": tuple(s["layers"]), "offloaded": tuple(s["offloaded"])})
            for s in data["stages"]
        )
        return cls(
            stages=stages,
            options=PlanOptions(**data["options"]),
            bottleneck_s=data["bottleneck_s"],
            total_bytes=data["total_bytes"],
        )

    def summary(self) -> str:
        """A table of the stages, with the bottleneck marked and each stage's link rate (the
        node's measured host-to-device rate, or the options' default where none was measured)."""
        columns = ("stage node gpu layers resident offloaded backend slots kv-cache device link "
                   "compute transfer time")  # fmt: skip
        head = (*columns.split(), "")
        rows = [head]
        slowest = self.bottleneck_stage if self.stages else -1
        for s in self.stages:
            rows.append(
                (
                    str(s.stage),
                    # Ray node ids are 56 hex digits: 8 identify a node in any real cluster.
                    f"{s.hostname} ({s.node_id[:8]})" if s.hostname else s.node_id[:8],
                    str(s.gpu_index),
                    layer_range(s.layers),
                    format_bytes(s.resident_bytes),
                    f"{format_bytes(s.offloaded_bytes)} ({len(s.offloaded)})",
                    s.backend,
                    format_bytes(s.slot_bytes),
                    format_bytes(s.kv_bytes),
                    format_bytes(s.device_bytes),
                    format_rate(s.link_bytes_per_s)
                    if s.link_bytes_per_s is not None
                    else f"{format_rate(self.options.default_link_bytes_per_s)} (default)",
                    format_seconds(s.compute_s),
                    format_seconds(s.transfer_s),
                    format_seconds(s.time_s),
                    "<- bottleneck" if s.stage == slowest else "",
                )
            )
        lines = render_table(rows).splitlines()
        nodes = len({s.node_id for s in self.stages})
        title = (
            f"plan: {len(self.stages)} stages on {nodes} node(s), "
            f"{format_bytes(self.total_bytes)} of weights, prefetch_step "
            f"{self.options.prefetch_step}, reserve {format_bytes(self.options.reserve_bytes)}, "
            f"KV cache for {self.options.max_batch} x {self.options.max_seq_len} tokens"
        )
        if self.stages:
            s = self.stages[slowest]
            bound = "transfer" if s.transfer_s > s.compute_s else "compute"
            title += f"; bottleneck: stage {slowest}, {format_seconds(s.time_s)} ({bound}-bound)"
        return "\n".join([title, *lines])


def plan(
    layers: Sequence[LayerSpec], cluster: ClusterSnapshot, options: PlanOptions = DEFAULT_OPTIONS
) -> Plan:
    """The placement with the smallest bottleneck stage time under the cost model above.

    GPUs form the pipeline in the order given: nodes in order, each node's GPUs in order. Each
    used GPU runs one contiguous, non-empty range of layers; a GPU may be left unused (skipped)
    when the optimum does not need it or it cannot hold anything, so the plan can have fewer
    stages than the cluster has GPUs. Embedding and head stay resident; a stage offloads the
    fewest bytes of decoder layers that make it fit. Raises `PlanError` when nothing fits.
    """
    _check_layers(layers)
    gpus = [(node, gpu) for node in cluster.nodes for gpu in node.gpus]
    if not gpus:
        raise PlanError(f"the cluster has no GPUs ({len(cluster.nodes)} node(s)): add GPUs")
    for node in cluster.nodes:
        if node.link_bytes_per_s is not None and not _is_rate(node.link_bytes_per_s):
            raise PlanError(
                f"node {node.node_id}: link_bytes_per_s={node.link_bytes_per_s!r} must be a "
                "finite number > 0 (or None to use PlanOptions.default_link_bytes_per_s)"
            )
    _check_largest_layer(layers, gpus, options)

    limits = [
        NodeLimits(
            gpu_memory_bytes=tuple(g.memory_bytes for g in node.gpus),
            offload_budget_bytes=node.offload_budget_bytes,
            link_bytes_per_s=node.link_bytes_per_s or options.default_link_bytes_per_s,
            slots=_slots(node, options),
        )
        for node in cluster.nodes
    ]
    search = Search(
        [layer.nbytes for layer in layers],
        [layer.kind == "decoder" for layer in layers],
        limits,
        reserve_bytes=options.reserve_bytes,
        compute_bytes_per_s=options.compute_bytes_per_s,
        kv_sizes=[_kv(layer, options) for layer in layers],
    )
    reached, best = search.solve()
    if reached < len(layers):
        raise _unplaceable(layers, cluster, options, reached, best)
    return _build(layers, cluster, options, search, best)


def _build(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    search: Search,
    placements: Sequence[LayerRange],
) -> Plan:
    stages = []
    for i, p in enumerate(placements):
        node = cluster.nodes[p.node]
        gpu = node.gpus[p.gpu]
        step = _slots(node, options)
        moved = search.offloaded_positions(p.start, p.end, gpu.memory_bytes, step)
        weights = sum(layers[j].nbytes for j in range(p.start, p.end))
        offloaded = sum(layers[j].nbytes for j in moved)
        slots = min(step, len(moved)) * max(
            (layers[j].nbytes for j in moved), default=0
        )
        kv = sum(_kv(layers[j], options) for j in range(p.start, p.end))
        device = weights - offloaded + slots + kv + options.reserve_bytes
        assert device <= gpu.memory_bytes, (p, device, gpu.memory_bytes)
        compute_s, transfer_s = search.stage_times(p)
        stages.append(
            StagePlan(
                stage=i,
                node_id=node.node_id,
                hostname=node.hostname,
                gpu_index=gpu.index,
                layers=tuple(layers[j].name for j in range(p.start, p.end)),
                offloaded=tuple(layers[j].name for j in moved),
                prefetch_step=step,
                resident_bytes=weights - offloaded,
                slot_bytes=slots,
                offloaded_bytes=offloaded,
                device_bytes=device,
                pinned=node.pin,
                compute_s=compute_s,
                transfer_s=transfer_s,
                time_s=max(compute_s, transfer_s),
                link_bytes_per_s=node.link_bytes_per_s,
                kv_bytes=kv,
                backend=node.backend,
                backend_reason=node.backend_reason,
            )
        )
    return Plan(
        stages=tuple(stages),
        options=options,
        bottleneck_s=max(s.time_s for s in stages),
        total_bytes=sum(layer.nbytes for layer in layers),
    )


# -- input checks and error messages ------------------------------------------------------------


def _check_layers(layers: Sequence[LayerSpec]) -> None:
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


def _slots(node: NodeInfo, options: PlanOptions) -> int:
    """Device slots an offloading GPU of `node` holds: none where the GPU reads in place."""
    return 0 if node.backend == "uva" else options.prefetch_step


def _kv(layer: LayerSpec, options: PlanOptions) -> int:
    return layer.kv_bytes(options.max_batch, options.max_seq_len)


def _check_largest_layer(
    layers: Sequence[LayerSpec], gpus: list[tuple[NodeInfo, GpuInfo]], options: PlanOptions
) -> None:
    """Every layer needs its own bytes on one device (resident, or as a prefetch slot; a UVA GPU
    reads an offloaded decoder layer in place), plus its KV cache."""
    # The largest GPU of each backend: the only candidates that matter for a single layer.
    largest: dict[str, tuple[NodeInfo, GpuInfo]] = {}
    for node, gpu in gpus:
        if node.backend not in largest or gpu.memory_bytes > largest[node.backend][1].memory_bytes:
            largest[node.backend] = (node, gpu)

    def need(layer: LayerSpec, node: NodeInfo) -> int:
        in_place = layer.kind == "decoder" and node.backend == "uva"
        return (0 if in_place else layer.nbytes) + _kv(layer, options) + options.reserve_bytes

    for big in sorted(layers, key=lambda layer: layer.nbytes + _kv(layer, options), reverse=True):
        node, gpu = max(largest.values(), key=lambda ng: ng[1].memory_bytes - need(big, ng[0]))
        if need(big, node) <= gpu.memory_bytes:
            continue
        kv = _kv(big, options)
        why = (
            "offloaded, a decoder layer still needs a device slot of its size"
            if big.kind == "decoder" and node.backend != "uva"
            else f"the {big.kind} is never offloaded"
            if big.kind != "decoder"
            else "its KV cache stays on the GPU"
        )
        cache = (f" + {format_bytes(kv)} of KV cache for max_batch {options.max_batch} x "
                 f"max_seq_len {options.max_seq_len}") if kv else ""  # fmt: skip
        weights = 0 if big.kind == "decoder" and node.backend == "uva" else big.nbytes
        raise PlanError(
            f"layer {big.name!r} needs {need(big, node)} bytes on one GPU "
            f"({format_bytes(weights)} of weights{cache} + reserve_bytes "
            f"{options.reserve_bytes}; {why}), but the largest GPU (node {node.node_id}, GPU "
            f"{gpu.index}) has {gpu.memory_bytes} bytes: raise --gpu-memory, lower --reserve "
            "(reserve_bytes), --max-batch or --max-seq-len, or add larger GPUs"
        )


def _unplaceable(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    reached: int,
    placements: Sequence[LayerRange],
) -> PlanError:
    left = sum(layer.nbytes for layer in layers[reached:])
    device_total = sum(
        max(0, g.memory_bytes - options.reserve_bytes) for n in cluster.nodes for g in n.gpus
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
        f"{sum(layer.nbytes for layer in layers)} bytes of weights"
        f"{_kv_needed(layers, options)}; available "
        f"{device_total} bytes of GPU memory (less reserve_bytes {options.reserve_bytes} per GPU) "
        f"on {cluster.num_gpus} GPUs plus {host} bytes of host offload budget on "
        f"{len(cluster.nodes)} node(s), less {options.prefetch_step} slot(s) per prefetching GPU: "
        f"{KNOBS}"
    )


def _kv_needed(layers: Sequence[LayerSpec], options: PlanOptions) -> str:
    kv = sum(_kv(layer, options) for layer in layers)
    if not kv:
        return ""
    return (f" and {kv} bytes of KV cache (max_batch {options.max_batch} x max_seq_len "
            f"{options.max_seq_len}), which stays on the GPUs")  # fmt: skip
