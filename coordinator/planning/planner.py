"""The planner: a pure function from (layers, cluster snapshot, options) to a frozen `Plan`.

It assigns contiguous layer ranges to GPUs and picks which decoder layers of each range are
offloaded to host memory, under each GPU's memory, each node's offload budget and a simple cost
model, minimising the slowest stage (the pipeline's bottleneck). No Ray here: the runtime
builds the `ClusterSnapshot`, `offloadctl plan` and the tests build one by hand.

Cost model, per stage: compute_s = its weight bytes (but an embedding's: `compute_bytes`) / the
node's compute rate (`NodeInfo.compute_rate`: its probe's timing of the model's own decoder
layer, for steps of `PlanOptions.rows_per_step` sequences; else
`PlanOptions.compute_bytes_per_s`); transfer_s =
its offloaded bytes / the node's host-to-device bandwidth (`NodeInfo.link_bytes_per_s`, which
the node's probe measures; `PlanOptions.default_link_bytes_per_s` where it did not); the copies
overlap compute, so the stage takes max(compute_s, transfer_s). The same holds for UVA, whose
kernels read the offloaded bytes over the same link as they compute. What the backends differ in
is device memory: a prefetching GPU holds `prefetch_step` slots of its largest offloaded layer,
a UVA GPU none (`NodeInfo.backend`, resolved per node from its probe). The search
(`coordinator.planning.search`) returns the exact optimum of this model; its module doc gives the
argument.

Resident weights (`PlanOptions.resident_weights`): a GPU may keep a quantized checkpoint's
resident matrices as stored (FP8 blocks, MXFP4), each layer's dequantized just in time into
one buffer of the model's largest such layer at width. Its layers then take fewer device
bytes, and offloading one frees fewer bytes than its slot (at width) holds: the search's
sizes say so. "auto" keeps them so where every node's GPUs compute in FP8 and the plan at
width offloads or does not fit, when that plan is faster or copies fewer bytes (`plan`).

Objectives (`PlanOptions.objective`): "latency" minimises that bottleneck; "throughput"
minimises the decode cycle of `micro_batches` micro-batches of the max_batch sequences
(`coordinator.planning.cycle`, which also proves when the bottleneck placement is that
optimum). Either way the plan predicts its decode tokens/s: max_batch / cycle_s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.planning.cycle import cycle_s, min_cycle
from coordinator.planning.formats import format_bytes, format_rate, format_seconds, layer_range
from coordinator.planning.options import DEFAULT_OPTIONS, PlanOptions, is_rate
from coordinator.planning.refusals import (
    check_largest_layer,
    check_layers,
    kv_bytes,
    slot_count,
    unplaceable,
)
from coordinator.planning.search import LayerRange, NodeLimits, Search
from coordinator.planning.snapshot import ClusterSnapshot
from coordinator.tables import render as render_table
from offload.errors import ConfigError, PlanError
from worker.names import expected_experts
from worker.spec import OFFLOAD_UNITS, LayerSpec, stored_formats

_JSON_VERSION = 1
# Kept as stored, an experts module holds at least 1/STORED_EXPERTS_FLOOR of its experts' rows
# in the buffer (`stored_expert_capacity`)
STORED_EXPERTS_FLOOR = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: a GPU, its contiguous layers, and which of them are offloaded."""

    stage: int
    node_id: str
    hostname: str
    gpu_index: int
    layers: tuple[str, ...]  # contiguous, in model order
    offloaded: tuple[str, ...]  # decoder layers of this stage kept in host memory
    # What of each offloaded layer (worker.spec.OFFLOAD_UNITS): "layer", or a part of it, the
    # rest staying resident ("experts", "mlp"); offloaded_bytes and slot_bytes count that part.
    offload_unit: str = "layer"
    prefetch_step: int  # device slots when it offloads: options.prefetch_step, 0 for uva
    resident_bytes: int
    # min(prefetch_step, len(offloaded)) slots of the largest offloaded layer (at the model's
    # width), and with 8-bit offloaded weights a staging buffer of one piece of their largest
    # weight (copies land there, to be dequantized into the slots)
    slot_bytes: int
    offloaded_bytes: int  # host bytes as stored (8 bits where so): what each step copies
    device_bytes: int  # resident + slots + reserve + KV cache
    pinned: bool  # the node's pin decision for the offloaded weights
    compute_s: float
    transfer_s: float
    time_s: float  # max(compute_s, transfer_s): the copies overlap compute
    # The node's measured host-to-device rate behind transfer_s; None: not measured, the cost
    # model used options.default_link_bytes_per_s (and plans saved before it was measured).
    link_bytes_per_s: float | None = None
    # The node's measured compute rate behind compute_s (None: options.compute_bytes_per_s),
    # and what it is (the probe's measurement, or why there is none).
    compute_bytes_per_s: float | None = None
    compute_source: str = ""
    kv_bytes: int = 0  # the KV pool of its layers (PlanOptions.pool_tokens positions)
    # How the offloaded layers reach the GPU: "prefetch" (copied into slots ahead of use) or
    # "uva" (read in place); the node's, resolved from the job's backend and the node's probe.
    backend: str = "prefetch"
    backend_reason: str = ""
    # The offloaded layers' bytes at the model's width (the device bytes offloading frees, but
    # where resident_stored: less); offloaded_bytes / offloaded_wide_bytes < 1 where they are
    # kept in 8 bits.
    offloaded_wide_bytes: int = 0
    # Of transfer_s: dequantizing the 8-bit offloaded weights after their copies (on the copy
    # stream, after the copies: the same queue), at the node's measured rate; 0.0 where none
    # is 8-bit or the node did not measure it.
    dequant_s: float = 0.0
    # How its offloaded layers' experts cross the link ("layer": with the rest of the unit,
    # prefetched under compute; "routed": only those a step routes to, after the router, so
    # time_s is then compute_s + their copy, not the larger of the two). `_fetch` chooses.
    expert_fetch: str = "layer"
    # Routed: rows each of its offloaded experts modules keeps on the device across steps (its
    # most used experts; `_cache_rows`), and their device bytes (in device_bytes): the memory
    # the plan left on the GPU
    expert_cache: int = 0
    expert_cache_bytes: int = 0
    # Routed: its experts calls of at most this many rows run on the host, reading the experts
    # in host memory (PlanOptions.host_experts, `_host_rows`); where that covers the plan's
    # rows per step, its times count the host's compute instead of the routed copies
    host_expert_rows: int = 0
    # What a step is expected to copy: its offloaded bytes as stored, or with routed fetch the
    # rest of the unit and the expected routed experts not cached (`_fetch`)
    copied_bytes: int = 0
    # Its resident quantized matrices kept as stored (PlanOptions.resident_weights): then
    # resident_bytes counts them as stored, resident_wide_bytes what they would take at the
    # model's width, and device_bytes the buffer of jit_bytes they are dequantized into just
    # in time (the model's largest such layer at width). offloaded_wide_bytes stays at width:
    # what the slots take, and what offloading frees is less.
    resident_stored: bool = False
    resident_wide_bytes: int = 0
    jit_bytes: int = 0
    # Kept as stored, each experts module's per-expert matrices take this many experts' rows
    # of the buffer (`offload.resident`'s compact rows: max_batch x experts per token, the
    # experts a decode step can route to, and a quarter of them at least; 0: every expert)
    stored_expert_capacity: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The stages in pipeline order; `bottleneck_s` is the slowest stage's time."""

    stages: tuple[StagePlan, ...]
    options: PlanOptions
    bottleneck_s: float
    total_bytes: int
    # One decode step of every micro-batch (cycle.py): each sequence's time between tokens.
    cycle_s: float = 0.0
    # Throughput plans: no placement of these options has a shorter cycle than this (== cycle_s:
    # proven optimal; below it: the search kept the bottleneck placement on a cluster too large
    # for its exact DP, and this is how far from optimal it can be). 0.0: a latency plan.
    cycle_bound_s: float = 0.0
    # What each stage step costs besides compute and copies in cycle_s: the options' runtime
    # overhead and the stage's own fixed part the nodes measured.
    step_overhead_s: float = 0.0
    # The KV pools the plan weighed and why it took this one (`pool.choose_pool`); "" where the
    # pool was given or is what the budget leaves
    pool_note: str = ""

    @property
    def bottleneck_stage(self) -> int:
        return max(self.stages, key=lambda s: s.time_s).stage

    @property
    def tokens_per_s(self) -> float:
        """Predicted decode tokens/s with every KV slot in use: max_batch per cycle."""
        return self.options.max_batch / self.cycle_s if self.cycle_s > 0 else 0.0

    def pool_text(self) -> str:
        """The KV pool in words: its tokens and bytes per GPU, and how many sequences it holds."""
        o = self.options
        tokens = o.pool_tokens
        if not tokens:
            return "no KV pool (max_seq_len 0: no generation)"
        per_gpu = [s.kv_bytes for s in self.stages]
        nbytes = (
            format_bytes(max(per_gpu))
            if len(set(per_gpu)) <= 1
            else f"{format_bytes(min(per_gpu))}-{format_bytes(max(per_gpu))}"
        )
        return (
            f"KV pool of {tokens} tokens per GPU ({nbytes}), for up to {o.max_batch} sequences "
            f"of up to {o.max_seq_len} tokens: it holds {o.sequences_held(o.expected_len)} of "
            f"the expected {o.expected_len} tokens, {o.sequences_held(o.max_seq_len)} of "
            "max_seq_len"
        )

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
            cycle_s=data.get("cycle_s", 0.0),
            cycle_bound_s=data.get("cycle_bound_s", 0.0),
            step_overhead_s=data.get("step_overhead_s", 0.0),
            pool_note=data.get("pool_note", ""),
        )

    def summary(self) -> str:
        """A table of the stages, with the bottleneck marked and each stage's link rate (the
        node's measured host-to-device rate, or the options' default where none was measured)."""
        columns = (
            "stage node gpu layers resident offloaded backend slots kv-cache device link "
            "rate compute transfer time"
        )
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
                    f"{format_bytes(s.offloaded_bytes)} ({len(s.offloaded)}"
                    f"{'' if s.offload_unit == 'layer' else ' x ' + s.offload_unit}"
                    f"{', routed' if s.expert_fetch == 'routed' else ''})",
                    s.backend,
                    format_bytes(s.slot_bytes),
                    format_bytes(s.kv_bytes),
                    format_bytes(s.device_bytes),
                    format_rate(s.link_bytes_per_s)
                    if s.link_bytes_per_s is not None
                    else f"{format_rate(self.options.default_link_bytes_per_s)} (default)",
                    format_rate(s.compute_bytes_per_s)
                    if s.compute_bytes_per_s is not None
                    else f"{format_rate(self.options.compute_bytes_per_s)} (default)",
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
            f"{self.options.prefetch_step}, reserve {format_bytes(self.options.reserve_bytes)}"
            f"{f' ({self.options.reserve_source})' if self.options.reserve_source else ''}, "
            f"{self.pool_text()}"
        )
        if self.stages:
            s = self.stages[slowest]
            bound = "transfer" if s.transfer_s > s.compute_s else "compute"
            title += f"; bottleneck: stage {slowest}, {format_seconds(s.time_s)} ({bound}-bound)"
        sources = {
            (s.hostname or s.node_id[:8], s.compute_source) for s in self.stages if s.compute_source
        }
        notes = [f"compute rate on {host}: {source}" for host, source in sorted(sources)]
        if self.options.max_batch and self.stages:
            o = self.options
            note = (
                f"objective {o.objective}: {self.tokens_per_s:.1f} decode tokens/s predicted "
                f"({o.max_batch} sequences in {o.micro_batches} micro-batch(es); "
                f"{format_seconds(self.cycle_s)} between a sequence's tokens, with "
                f"{format_seconds(self.step_overhead_s)} per stage step besides compute)"
            )
            if self.cycle_bound_s and self.cycle_bound_s < self.cycle_s:
                note += (
                    f"; too large for the exact search: no plan is more than "
                    f"{self.cycle_s / self.cycle_bound_s:.2f}x faster"
                )
            notes.append(note)
        if any(s.expert_fetch == "routed" for s in self.stages):
            rows = self.options.rows_per_step
            step = sum(s.copied_bytes for s in self.stages)
            whole = sum(s.offloaded_bytes for s in self.stages)
            notes.append(
                f"predicted copy per generated token: {format_bytes(step // rows)} (a step of "
                f"{rows} row(s) copies {format_bytes(step)}; whole-unit fetch would copy "
                f"{format_bytes(whole)})"
            )
        cached = [s for s in self.stages if s.expert_cache]
        if cached:
            notes.append(
                "expert cache: "
                + ", ".join(
                    f"stage {s.stage} {s.expert_cache} rows of each offloaded experts module "
                    f"({format_bytes(s.expert_cache_bytes)})"
                    for s in cached
                )
                + ": the most used experts stay on the GPU in the memory the plan leaves, "
                "expected to be hit C of E of the time under uniform routing (in the transfer "
                "times)"
            )
        routed = [s.stage for s in self.stages if s.expert_fetch == "routed"]
        if routed:
            notes.append(
                f"stage(s) {', '.join(map(str, routed))}: offloaded experts fetched by routing "
                f"(expert fetch {self.options.expert_fetch}): only those a step of "
                f"{self.options.rows_per_step} row(s) routes to cross, after the router, "
                "E (1 - (1 - k/E)^rows) of E expected under uniform routing, their copy added "
                "to the stage's time"
            )
        elif self.options.expert_fetch == "routed" and any(s.offloaded for s in self.stages):
            offloading = [s for s in self.stages if s.offloaded]
            if all(s.backend != "prefetch" for s in offloading):
                why = "their nodes read offloaded weights in place (uva): nothing is fetched"
            else:
                why = (
                    "no offloaded layer has experts that a step's routing picks (a dense "
                    "model, or experts modules not handed the routing, as Llama 4's, which "
                    "compute every expert), so every offloaded unit crosses whole"
                )
            notes.append(f"expert fetch routed: no stage routes: {why}")
        hosted = [s for s in self.stages if s.host_expert_rows]
        if hosted:
            notes.append(
                "experts on the host (host experts "
                f"{self.options.host_experts}): "
                + ", ".join(
                    f"stage {s.stage} for steps of up to {s.host_expert_rows} row(s)"
                    for s in hosted
                )
                + ", where the node's host computes a routed expert sooner than its link "
                "copies it and its GPU computes it (its measured rates); such a step reads "
                "them in host memory and copies none"
            )
        elif self.options.host_experts == "auto" and routed:
            notes.append(
                "experts on the host: none, the GPUs have a routed expert copied and computed "
                "sooner than their hosts compute it (or a host's rate was not measured)"
            )
        kept = [s for s in self.stages if s.resident_stored]
        if kept:
            notes.append(
                "resident quantized matrices kept as stored (FP8/MXFP4 blocks; resident weights "
                f"{self.options.resident_weights}) on stage(s) "
                f"{', '.join(str(s.stage) for s in kept)}: "
                f"{format_bytes(sum(s.resident_bytes for s in kept))} on the device instead of "
                f"{format_bytes(sum(s.resident_wide_bytes for s in kept))} at the model's width; "
                "each layer dequantized just in time into a buffer of "
                f"{format_bytes(max(s.jit_bytes for s in kept))} (counted in device)"
                + (
                    f", its experts' matrices holding {capacity} experts' rows at a time"
                    if (capacity := max(s.stored_expert_capacity for s in kept))
                    else ""
                )
            )
        stored = sum(s.offloaded_bytes for s in self.stages)
        wide = sum(s.offloaded_wide_bytes for s in self.stages)
        if wide and stored != wide:
            notes.append(
                f"offloaded weights in 8 bits (offload dtype {self.options.offload_dtype}: "
                "their matrices; norms, biases and MoE routers stay at the model's width), "
                f"dequantized on the GPU after each copy: {format_bytes(stored)} in host memory "
                f"and copied per step, {stored / wide:.2f}x their {format_bytes(wide)} at the "
                "model's width; slots include one staging buffer for the copies"
                + (
                    "; what quantizing changes is measured at load (status: each stage's "
                    "quantization error) and per family in bench/RESULTS.md"
                    if self.options.offload_dtype in ("fp8", "int8")
                    else ""
                )
            )
            dequant = sum(s.dequant_s for s in self.stages)
            if dequant:
                notes[-1] += (
                    f"; dequantizing takes {format_seconds(dequant)} per step over the stages "
                    "(at each node's measured rate), counted in their transfer times"
                )
        return "\n".join([title, *lines, *notes])


def plan(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions = DEFAULT_OPTIONS,
    *,
    memo: dict | None = None,
    keep: Plan | None = None,
) -> Plan:
    """The placement that is best for `options.objective` under the cost model above: the
    smallest bottleneck stage time (latency), or the shortest decode cycle of
    `options.micro_batches` micro-batches (throughput; `coordinator.planning.throughput` also
    chooses the batch and the micro-batches, `coordinator.planning.replicas` the pipelines).

    GPUs form the pipeline in the order given: nodes in order, each node's GPUs in order. Each
    used GPU runs one contiguous, non-empty range of layers; a GPU may be left unused (skipped)
    when the optimum does not need it or it cannot hold anything, so the plan can have fewer
    stages than the cluster has GPUs. Embedding and head stay resident; a stage offloads the
    fewest bytes of decoder layers that make it fit. Raises `PlanError` when nothing fits.
    Resident weights (`options.resident_weights`): "wide" at the model's width; "stored" as the
    checkpoint stores them on every node (the same as wide for a checkpoint with no quantized
    matrices); "auto" plans at width, and plans again stored where the checkpoint has quantized
    matrices, every node's GPUs compute in FP8 (`NodeInfo.fp8_compute`) and the plan at width
    offloads or does not fit: the stored plan where the wide one does not fit, else the better
    of the two (`_merit`).
    `memo`: a dict kept across calls on the same layers and cluster (the throughput search's
    many micro-batch counts): the bottleneck search runs once per distinct budgets and rates.
    `keep`: a plan whose stages (GPUs, layer ranges, resident weights kept as stored or not)
    stay as they are, only what each offloads chosen anew for `options` (a running load's
    re-balance: its workers keep their layers); PlanError naming the stage that no longer fits.
    """
    check_layers(layers)
    if not cluster.num_gpus:
        raise PlanError(f"the cluster has no GPUs ({len(cluster.nodes)} node(s)): add GPUs")
    for node in cluster.nodes:
        for name, default in (
            ("link_bytes_per_s", "default_link_bytes_per_s"),
            ("compute_bytes_per_s", "compute_bytes_per_s"),
        ):
            value = getattr(node, name)
            if value is not None and not is_rate(value):
                raise PlanError(
                    f"node {node.node_id}: {name}={value!r} must be a finite number "
                    f"> 0 (or None to use PlanOptions.{default})"
                )
    limits = [
        NodeLimits(
            gpu_memory_bytes=tuple(g.memory_bytes for g in node.gpus),
            offload_budget_bytes=node.offload_budget_bytes,
            link_bytes_per_s=node.link_bytes_per_s or options.default_link_bytes_per_s,
            compute_bytes_per_s=node.compute_rate(options.rows_per_step)[0],
            slots=slot_count(node, options),
            packed=packs_weights(node, options),
            dequant_factor=dequant_factor(node, options),
        )
        for node in cluster.nodes
    ]
    kv = [kv_bytes(layer, options) for layer in layers]
    jit = _jit_bytes(layers, options, memo)
    if keep is not None:
        stored = any(s.resident_stored for s in keep.stages)
        return _kept(layers, cluster, options, limits, kv, jit if stored else 0, keep)
    mode = options.resident_weights
    if (
        mode == "wide"
        or not jit
        or (mode == "auto" and not all(node.fp8_compute for node in cluster.nodes))
    ):
        return _plan(layers, cluster, options, limits, kv, 0, memo)
    if mode == "stored":
        return _plan(layers, cluster, options, limits, kv, jit, memo)
    try:
        wide = _plan(layers, cluster, options, limits, kv, 0, memo)
    except PlanError:
        return _plan(layers, cluster, options, limits, kv, jit, memo)
    if not any(s.offloaded for s in wide.stages):
        return wide
    try:
        stored = _plan(layers, cluster, options, limits, kv, jit, memo)
    except PlanError:  # the buffer they are dequantized into does not fit
        return wide
    return stored if _merit(stored) < _merit(wide) else wide


def _merit(the_plan: Plan) -> tuple[float, int]:
    """What "auto" resident weights compare plans by, the less the better: the objective's
    time, then the bytes copied per step. Kept as stored, layers free half their bytes or
    less, but the buffer they are dequantized into can cost more than that saves where a GPU
    holds few layers; and on ties, fewer bytes crossing the link is what it is for."""
    time_s = the_plan.bottleneck_s if the_plan.options.objective == "latency" else the_plan.cycle_s
    return time_s, sum(s.offloaded_bytes for s in the_plan.stages)


def stored_expert_capacity(layers: Sequence[LayerSpec], options: PlanOptions) -> int:
    """The experts' rows each experts module of a GPU keeping its resident quantized matrices
    as stored holds at width in the buffer (`offload.resident`'s compact rows; 0: all): what
    a decode step of max_batch rows can route to, max_batch x experts per token, and at least
    a quarter of the experts, which bounds the groups of rows a prompt's call is split into
    (each dequantizes its experts again). DeepSeek-V3 at max_batch 1: 64 of 256, a buffer of
    5.7 GiB rather than 21.4 GiB."""
    moe = [layer for layer in layers if layer.experts and layer.experts_per_token]
    if not moe:
        return 0
    experts = max(layer.experts for layer in moe)
    decode = max(options.max_batch, 1) * max(layer.experts_per_token for layer in moe)
    capacity = max(decode, math.ceil(experts / STORED_EXPERTS_FLOOR))
    return 0 if capacity >= experts else capacity


def _jit_bytes(layers: Sequence[LayerSpec], options: PlanOptions, memo: dict | None) -> int:
    """The buffer a GPU keeping resident quantized matrices as stored dequantizes each layer
    into: the model's largest such layer at width, its experts' matrices in compact rows
    (`stored_expert_capacity`); 0: the checkpoint has none. Once per memo and capacity: it
    reads every tensor's format."""
    capacity = stored_expert_capacity(layers, options)
    known = memo.setdefault("jit_bytes", {}) if memo is not None else {}
    if capacity not in known:
        quantized = any(t.scale is not None for layer in layers for t in layer.tensors)
        known[capacity] = max(layer.jit_bytes(capacity) for layer in layers) if quantized else 0
    return known[capacity]


def _plan(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    limits: Sequence[NodeLimits],
    kv: Sequence[int],
    jit: int,
    memo: dict | None,
) -> Plan:
    """`plan` with resident quantized matrices kept as stored where `jit` (their buffer's
    bytes) is not 0, at the model's width where it is."""
    stored = bool(jit)
    key = (
        tuple(limits),
        tuple(kv),
        options.reserve_bytes,
        options.compute_bytes_per_s,
        options.offload_dtype,
        stored,
        options.rows_per_step if stored else 0,  # the step's dequantization (compute_bytes)
    )
    if memo is None or key not in memo:
        search, unit_names = _search(layers, cluster, options, limits, kv, jit)
        solved = (search, unit_names, *search.solve())
        if memo is not None:
            memo[key] = solved
    search, unit_names, reached, best = solved if memo is None else memo[key]
    if reached < len(layers):
        raise unplaceable(layers, cluster, options, reached, best, search)
    if options.objective == "latency":
        return _build(layers, cluster, options, search, unit_names, best)
    found = min_cycle(search, options.micro_batches, _overhead_s(cluster, options), best)
    assert found is not None  # solve placed every layer
    return _build(layers, cluster, options, search, unit_names, found.placements, found.bound_s)


def _kept(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    limits: Sequence[NodeLimits],
    kv: Sequence[int],
    jit: int,
    keep: Plan,
) -> Plan:
    """`plan` with `keep`'s stages (see there)."""
    search, unit_names = _search(layers, cluster, options, limits, kv, jit)
    position = {layer.name: i for i, layer in enumerate(layers)}
    nodes = {node.node_id: n for n, node in enumerate(cluster.nodes)}
    placements = []
    for stage in keep.stages:
        where = f"stage {stage.stage} ({stage.hostname} GPU {stage.gpu_index})"
        n = nodes.get(stage.node_id)
        gpus = cluster.nodes[n].gpus if n is not None else ()
        g = next((i for i, gpu in enumerate(gpus) if gpu.index == stage.gpu_index), None)
        missing = [name for name in stage.layers if name not in position]
        if g is None or missing:
            raise PlanError(
                f"{where} cannot be kept: "
                + (f"layers {missing[:3]} are not the model's" if missing else "its GPU is gone")
            )
        start, end = position[stage.layers[0]], position[stage.layers[-1]] + 1
        node = cluster.nodes[n]
        fits = search.offload_bytes(
            start, end, gpus[g].memory_bytes, slot_count(node, options), limits[n].packed
        )
        if fits is None:
            raise PlanError(
                f"{where} cannot hold its layers {stage.layers[0]}..{stage.layers[-1]} beside a "
                f"KV pool of {options.pool_tokens} tokens in its {format_bytes(gpus[g].memory_bytes)}"
                ", even with every one it may offload offloaded"
            )
        placements.append(LayerRange(n, g, start, end))
    the_plan = _build(layers, cluster, options, search, unit_names, placements)
    for node in cluster.nodes:
        host = sum(s.offloaded_bytes for s in the_plan.stages if s.node_id == node.node_id)
        if host > node.offload_budget_bytes:
            raise PlanError(
                f"node {node.hostname} would keep {format_bytes(host)} of offloaded weights, "
                f"over its host budget of {format_bytes(node.offload_budget_bytes)}"
            )
    return the_plan


def _search(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    limits: Sequence[NodeLimits],
    kv: Sequence[int],
    jit: int,
) -> tuple[Search, list[str]]:
    """The bottleneck search over these layers and nodes (not solved), and the names of its
    offload units in order."""
    stored = bool(jit)
    weights = [layer.resident_bytes(stored) for layer in layers]
    gpus = [(node, gpu) for node in cluster.nodes for gpu in node.gpus]
    check_largest_layer(layers, gpus, options, weights, jit)
    unit_names = [*sub_layer_units(layers), "layer"]
    # offloaded weights kept in 8 bits: asked for, or as a block-FP8 checkpoint stores them
    eight_bit = options.offload_dtype in ("fp8", "int8") or (
        options.offload_dtype == "auto"
        and any(t.scale is not None for layer in layers for t in layer.tensors)
    )
    # what offloading each layer by each unit frees: less than its slot holds (the unit at
    # width) where resident matrices are kept as stored
    freed = [[layer.freed_bytes(name, stored) for layer in layers] for name in unit_names]
    search = Search(
        weights,
        [layer.kind == "decoder" for layer in layers],
        limits,
        reserve_bytes=options.reserve_bytes,
        compute_bytes_per_s=options.compute_bytes_per_s,
        kv_sizes=kv,
        compute_sizes=[compute_bytes(layer, stored, options.rows_per_step) for layer in layers],
        units=freed[:-1],
        offload_sizes=freed[-1],
        slot_units=[[layer.unit_bytes(name) for layer in layers] for name in unit_names]
        if stored
        else None,
        stored_units=[
            [layer.stored_bytes(name, options.offload_dtype) for layer in layers]
            for name in unit_names
        ]
        if eight_bit
        else None,
        staging_units=[
            [layer.staging_bytes(name, options.offload_dtype) for layer in layers]
            for name in unit_names
        ]
        if eight_bit
        else None,
        jit_bytes=jit,
    )
    return search, unit_names


def _fetch(
    moved: Sequence[LayerSpec],
    unit: str,
    stored: Sequence[int],
    compute_s: float,
    transfer_s: float,
    node,
    options: PlanOptions,
    cache_rows: int = 0,
) -> tuple[str, float, float, int, int]:
    """(expert fetch, transfer seconds, stage seconds, bytes a step copies, host rows) of a stage
    offloading `moved` by `unit` (`stored`: each one's bytes as it crosses), whose whole-unit
    copies take `transfer_s`.

    Routed fetch copies, of each MoE layer's experts, the expected distinct experts a step of
    `options.rows_per_step` rows routes to (`expected_experts`: uniform routing), after its
    router: not under compute. The rest of the unit (attention, shared experts) is still
    prefetched. So routed takes max(compute, the rest's copy) + the routed experts' copy,
    against max(compute, the whole copy); each byte's time is the whole copy's per byte
    (dequantizing included). Where the node's GPUs are simulated on its CPU, its copy thread
    shares the cores with compute (`NodeInfo.concurrent_stages`), so a copy is not hidden
    under compute there: the choice weighs compute + copy either way. "auto" takes the
    faster; the placement itself was searched with whole-unit copies. UVA nodes read the
    experts in place: nothing to fetch. A routed stage's small steps may run its experts on
    the host (`_host_rows`); where its rows cover the plan's step, the routed copies' time is
    the host's compute of every routed expert instead, and a step copies only the rest."""
    whole = max(compute_s, transfer_s)
    total = sum(stored)
    if options.expert_fetch == "layer" or node.backend != "prefetch" or not moved:
        return "layer", transfer_s, whole, total, 0
    experts = routed = chosen = 0.0
    wide = True  # every MoE layer's experts cross at the model's width (the host reads them so)
    for layer, nbytes in zip(moved, stored, strict=True):
        if not layer.experts or not total:
            continue
        # the experts' share of what this layer's unit moves, as it crosses
        share = layer.unit_bytes("experts") / max(layer.unit_bytes(unit), 1)
        part = nbytes * min(share, 1.0)
        experts += part
        rows = options.rows_per_step
        # a cache of C rows holds the most used experts: under uniform routing C of E of them
        misses = 1.0 - min(cache_rows, layer.experts) / layer.experts
        share_routed = (
            expected_experts(layer.experts, layer.experts_per_token, rows) / layer.experts
        )
        chosen += part * share_routed
        routed += part * share_routed * misses
        wide &= nbytes == layer.unit_bytes(unit)
    if not experts:
        return "layer", transfer_s, whole, total, 0
    per_byte = transfer_s / total
    rest_s, routed_s = (total - experts) * per_byte, routed * per_byte
    time_s = max(compute_s, rest_s) + routed_s
    shared = node.concurrent_stages is not None  # copies take the cores compute needs
    against = compute_s + transfer_s if shared else whole
    host_rows = _host_rows(node, options, routed / chosen if chosen else 1.0) if wide else 0
    if host_rows >= options.rows_per_step:  # the plan's steps compute the experts on the host
        host_s = chosen / _host_rate(node, options, options.rows_per_step)
        host_time = max(compute_s, rest_s) + host_s
        if (
            options.expert_fetch == "routed"
            or (compute_s + rest_s + host_s if shared else host_time) < against
        ):
            return "routed", rest_s, host_time, math.ceil(total - experts), host_rows
    if (
        options.expert_fetch == "routed"
        or (compute_s + rest_s + routed_s if shared else time_s) < against
    ):
        copied = math.ceil(total - experts + routed)
        return "routed", rest_s + routed_s, time_s, copied, host_rows
    return "layer", transfer_s, whole, total, 0


def _host_rate(node, options: PlanOptions, rows: int) -> float | None:
    """Weight bytes per second `node`'s host computes through for a step of `rows` rows. Where
    its GPUs are simulated on its CPU, the host is what computes them: their compute rate.
    Else from its measured rates (`NodeInfo.host_matmul_bytes_per_s`; None: not measured): as
    the nearest measured rows at or above `rows` measured it (more rows never compute faster
    per row), beyond the largest that rate slowed in proportion to the rows (the host is then
    bound by its arithmetic)."""
    if not node.cuda:
        return node.compute_rate(rows)[0] or options.compute_bytes_per_s
    rates = sorted(node.host_matmul_bytes_per_s)
    if not rates:
        return None
    for measured, rate in rates:
        if rows <= measured:
            return rate
    measured, rate = rates[-1]
    return rate * measured / rows


def _host_rows(node, options: PlanOptions, miss: float) -> int:
    """The most rows (at most `options.max_batch`, the steps decode takes) for which `node`'s
    host computes a routed expert sooner than the GPU has it copied in (`miss`: the share not
    cached) and computed: per expert byte, 1 / host rate < miss / link rate + 1 / compute rate,
    each at that many rows. 0 where `options.host_experts` is off, the host's rate was not
    measured, or the GPU is sooner at one row. On a node whose GPUs are simulated on its CPU
    the host computes as fast as they do, so every step of up to max_batch rows runs there
    (what a copy costs is never saved otherwise)."""
    if options.host_experts != "auto" or _host_rate(node, options, 1) is None:
        return 0
    link = node.link_bytes_per_s or options.default_link_bytes_per_s
    best = 0
    for rows in range(1, max(options.max_batch, 1) + 1):
        device = node.compute_rate(rows)[0] or options.compute_bytes_per_s
        if 1.0 / _host_rate(node, options, rows) >= miss / link + 1.0 / device:
            break
        best = rows
    return best


def _cache_rows(moved: Sequence[LayerSpec], room: int, options: PlanOptions) -> tuple[int, int]:
    """(rows, device bytes a row takes) of the expert cache of a stage offloading `moved`,
    in `room` device bytes (what the plan leaves on its GPU): a row of each MoE layer's cache,
    plus the scratch row a call gathers its experts into (`offload.prefetch`'s module doc).
    Fewer rows than a token's experts (k) would never serve a call: none then. At most
    `options.expert_cache` rows (-1: no bound), never all of a layer's experts."""
    moe = [layer for layer in moved if layer.experts]
    if not moe or not options.expert_cache:
        return 0, 0
    per_expert = [layer.unit_bytes("experts") // layer.experts for layer in moe]
    row = sum(per_expert) + max(per_expert)
    rows = min(max(room, 0) // row, max(layer.experts for layer in moe) - 1)
    if options.expert_cache > 0:
        rows = min(rows, options.expert_cache)
    return (rows, row) if rows >= max(layer.experts_per_token for layer in moe) else (0, row)


def packs_weights(node, options: PlanOptions) -> bool:
    """Whether `node`'s workers keep offloaded weights as stored under the job's offload dtype
    (8 bits where so): the prefetch backend dequantizes them after each copy. UVA computes on
    host memory as it is: there an FP8 checkpoint's weights are dequantized while read, and an
    explicit fp8 or int8 is refused."""
    if options.offload_dtype in ("fp8", "int8") and node.backend == "uva":
        raise PlanError(
            f"node {node.hostname or node.node_id[:8]} reads offloaded weights in place (UVA: "
            f"{node.backend_reason or 'its backend'}), so they cannot be kept in "
            f"{options.offload_dtype}: use --backend prefetch, or --offload-dtype auto"
        )
    return node.backend == "prefetch" and options.offload_dtype != "none"


def dequant_factor(node, options: PlanOptions) -> float:
    """Link bytes per full-width byte dequantized on `node` (its link rate over its measured
    dequantization rate for the job's 8-bit format: fp8 unless int8 is asked for); 0.0 where
    either rate is unknown."""
    rate = dict(node.dequant_bytes_per_s).get("int8" if options.offload_dtype == "int8" else "fp8")
    link = node.link_bytes_per_s or options.default_link_bytes_per_s
    return link / rate if rate else 0.0


def compute_bytes(layer: LayerSpec, stored: bool = False, rows: int = 1) -> int:
    """The weight bytes a step of `rows` rows computes through in this layer: all of them, but
    for an embedding, which is looked up (its rows for the step's tokens), not multiplied.
    Where its quantized matrices are kept as `stored` (`offload.resident`), also their
    dequantization each step: their stored bytes read and their width written before the
    step reads them (FP8: 2.5x those matrices' bytes in all), for an MoE layer's experts only
    the expected distinct experts the step routes to (`expected_experts`: uniform routing).
    An offloaded layer is dequantized after its copy instead: counted here too, an overcount
    on the safe side."""
    if layer.kind == "embed":
        return 0
    if not stored:
        return layer.nbytes
    formats = stored_formats(layer.tensors)
    experts = {t.target or t.name for t in layer.unit_tensors("experts")}
    share = (
        expected_experts(layer.experts, layer.experts_per_token, rows) / layer.experts
        if layer.experts
        else 1.0
    )
    work = 0.0
    for t in layer.tensors:
        fmt = formats.get(t.target or t.name)
        if fmt is not None:
            nbytes = fmt.stored_bytes(t.shape) + t.loaded_bytes
            work += nbytes * (share if (t.target or t.name) in experts else 1.0)
    return layer.nbytes + math.ceil(work)


def sub_layer_units(layers: Sequence[LayerSpec]) -> dict[str, list[int]]:
    """The OFFLOAD_UNITS smaller than a whole layer that this model has (experts, an MLP):
    those that move something of some decoder layer and not all of it, with the bytes each
    moves of every layer (0 for the embedding and head)."""
    whole = [layer.unit_bytes("layer") for layer in layers]
    found = {}
    for name, pattern in OFFLOAD_UNITS.items():
        sizes = [layer.unit_bytes(name) for layer in layers] if pattern else []
        if any(sizes) and sizes != whole:
            found[name] = sizes
    return found


def _shared_cores_s(
    stages: Sequence[StagePlan], cluster: ClusterSnapshot, options: PlanOptions
) -> float:
    """The least cycle where a node's GPUs are simulated on its CPU: its stages share its cores,
    and so do their copies (the CPU copy engine is a thread), so every micro-batch's compute and
    copies through them (with each step's own fixed part) take at least their sum over how many
    run at once (`NodeInfo.concurrent_stages`). Not part of the exact placement search
    (cycle.py): real GPUs compute side by side and copy by DMA."""
    least = 0.0
    for node in cluster.nodes:
        if node.concurrent_stages is None:
            continue
        fixed = node.fixed_step_s(options.rows_per_step)
        work = sum(s.compute_s + s.transfer_s + fixed for s in stages if s.node_id == node.node_id)
        least = max(least, options.micro_batches * work / node.concurrent_stages)
    return least


def _overhead_s(cluster: ClusterSnapshot, options: PlanOptions) -> float:
    """A stage step's cost besides compute and copies: the runtime's (options) and the
    stage's own fixed part, as the nodes' probes measured it (the largest: one overhead for
    every stage keeps the cycle search exact)."""
    rows = options.rows_per_step
    return options.step_overhead_s + max(node.fixed_step_s(rows) for node in cluster.nodes)


def _build(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    search: Search,
    unit_names: Sequence[str],  # of search.units, in order
    placements: Sequence[LayerRange],
    bound_s: float | None = None,
) -> Plan:
    stages = []
    for i, p in enumerate(placements):
        node = cluster.nodes[p.node]
        gpu = node.gpus[p.gpu]
        step = slot_count(node, options)
        limits = search.nodes[p.node]
        packed = limits.packed
        unit, moved = search.offloaded_positions(p.start, p.end, gpu.memory_bytes, step, packed)
        weights = search.prefix[p.end] - search.prefix[p.start]
        units = search.units[unit]
        freed = sum(units.movable[j] for j in moved)  # == wide unless resident_stored
        wide = sum(units.slot[j] for j in moved)
        offloaded = sum(units.stored[j] for j in moved) if packed else wide
        largest = max((units.movable[j] for j in moved), default=0)
        slot = max((units.slot[j] for j in moved), default=0)
        slots = min(step, len(moved)) * slot + (units.staging(largest, packed) if moved else 0)
        kv = search.kv_prefix[p.end] - search.kv_prefix[p.start]
        device = weights - freed + slots + kv + options.reserve_bytes + search.jit_bytes
        assert device <= gpu.memory_bytes, (p, device, gpu.memory_bytes)
        compute_s, transfer_s = search.stage_times(p)  # copies and their dequantization
        dequantized = sum(units.slot[j] for j in moved if units.stored[j] != units.slot[j])
        dequant_s = dequantized * limits.dequant_factor / limits.link_bytes_per_s if packed else 0.0
        rate, source = node.compute_rate(options.rows_per_step)
        rows, row_bytes = _cache_rows(
            [layers[j] for j in moved], gpu.memory_bytes - device, options
        )
        fetch, transfer_s, time_s, copied, host_rows = _fetch(
            [layers[j] for j in moved],
            unit_names[unit] if moved else "layer",
            [units.stored[j] if packed else units.slot[j] for j in moved],
            compute_s,
            transfer_s,
            node,
            options,
            rows,
        )
        if fetch != "routed":
            rows = 0
        cache_bytes = rows * row_bytes
        device += cache_bytes
        stages.append(
            StagePlan(
                stage=i,
                node_id=node.node_id,
                hostname=node.hostname,
                gpu_index=gpu.index,
                layers=tuple(layers[j].name for j in range(p.start, p.end)),
                offloaded=tuple(layers[j].name for j in moved),
                offload_unit=unit_names[unit] if moved else "layer",
                prefetch_step=step,
                resident_bytes=weights - freed,
                slot_bytes=slots,
                offloaded_bytes=offloaded,
                offloaded_wide_bytes=wide,
                dequant_s=dequant_s,
                device_bytes=device,
                pinned=node.pin,
                compute_s=compute_s,
                transfer_s=transfer_s,
                time_s=time_s,
                expert_fetch=fetch,
                expert_cache=rows,
                expert_cache_bytes=cache_bytes,
                host_expert_rows=host_rows,
                copied_bytes=copied,
                link_bytes_per_s=node.link_bytes_per_s,
                compute_bytes_per_s=rate,
                compute_source=source,
                kv_bytes=kv,
                backend=node.backend,
                backend_reason=node.backend_reason,
                resident_stored=bool(search.jit_bytes),
                resident_wide_bytes=sum(layer.nbytes for layer in layers[p.start : p.end]) - wide
                if search.jit_bytes
                else weights - freed,
                jit_bytes=search.jit_bytes,
                stored_expert_capacity=stored_expert_capacity(layers, options)
                if search.jit_bytes
                else 0,
            )
        )
    overhead = _overhead_s(cluster, options)
    cycle = max(
        cycle_s([s.time_s for s in stages], options.micro_batches, overhead),
        _shared_cores_s(stages, cluster, options),
    )
    return Plan(
        stages=tuple(stages),
        options=options,
        bottleneck_s=max(s.time_s for s in stages),
        # the model's weights at its width, however its resident weights are kept
        total_bytes=sum(layer.nbytes for layer in layers)
        if search.jit_bytes
        else search.prefix[-1],
        cycle_s=cycle,
        cycle_bound_s=0.0 if bound_s is None else bound_s,
        step_overhead_s=overhead,
    )
