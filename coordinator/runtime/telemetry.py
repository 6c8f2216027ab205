"""Where memory goes on every GPU and node: aggregation of worker snapshots, a table, Ray
metrics (scraped by Prometheus from each node's metrics endpoint) and a plot.

The worker's `report()` is the snapshot (`worker.snapshot.StageSnapshot`); everything here is
a pure function of a list of them (with a `LostStage` where a worker is gone), except `collect`,
which waits for them, `MetricsExporter`, which owns the Ray gauges, and `plot`, which writes a
PNG.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from coordinator.planning.formats import format_bytes, layer_range
from coordinator.planning.planner import StagePlan
from coordinator.tables import render as render_table
from offload.errors import LaunchError
from worker.snapshot import StageSnapshot

METRIC_PREFIX = "offload_"


@dataclass(frozen=True, kw_only=True, slots=True)
class LostStage:
    """A planned stage whose worker is gone: what the driver knows of it from the plan.

    A type of its own rather than a `lost` flag on StageSnapshot: a live snapshot then has
    every field set (no reader checks for a missing number), and the few readers that show
    lost stages pick them out by type (`lost_stages`)."""

    stage: int
    hostname: str
    node_id: str
    layers: tuple[str, ...]


Report = StageSnapshot | LostStage  # what `collect` returns per planned stage


# The copy engines of pageable arenas (`offload.copy_engines`): named in the status table, where
# the copies' rate depends on which one it is.
PAGEABLE_ENGINES = ("staged", "direct")


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuRow:
    stage: int
    hostname: str
    gpu: str
    layers: str
    backend: str  # how its offloaded layers reach the device: prefetch, uva, none
    device_total_bytes: int
    device_used_bytes: int
    device_free_bytes: int
    resident_bytes: int
    buffer_bytes: int
    offloaded_bytes: int
    pinned_bytes: int
    pageable_bytes: int
    copies: int
    copied_bytes: int
    copy_s: float
    stall_s: float
    kv_cache_bytes: int
    requests: int
    pin: bool
    pin_source: str
    pin_reason: str
    pin_origin: str
    # added later (status --json keeps the keys before them in their order)
    dequant_s: float  # dequantizing 8-bit offloaded weights after their copies
    offload_format: str  # how they are kept in host memory ("" at the model's width)
    quantization_error: float  # relative RMS error of the weights quantized at load
    # routed experts (--expert-fetch routed): experts a step routed to that were in their slot
    # already (hits) or were copied then (misses)
    expert_hits: int
    expert_misses: int
    # of them, the experts predicted for a call (its layer's last routing) and the right ones
    expert_predicted: int
    expert_predicted_correct: int
    # resident quantized matrices kept as stored on the device ("" dequantized at load)
    resident_format: str
    # how the offloaded weights' copies reach the device (`OffloadStats.copy_engine`)
    copy_engine: str


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRow:
    hostname: str
    node_id: str  # Ray's node id when the driver knew it ("" otherwise)
    stages: tuple[int, ...]
    host_available_bytes: int
    workers_rss_bytes: int
    pinned_bytes: int
    pageable_bytes: int


def collect(
    stages: Sequence[StagePlan], refs: Sequence[object | None], timeout_s: float
) -> list[Report]:
    """One snapshot per planned stage, from `refs` (a pending worker call per stage, None where
    the worker is gone), each with its stage's Ray node id. A lost worker's stage gets a
    `LostStage`. All within `timeout_s`, else TimeoutError naming the stage that did not
    answer."""
    import ray

    deadline = time.monotonic() + timeout_s
    reports = []
    for stage, ref in zip(stages, refs, strict=True):
        try:
            if ref is not None:
                report = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
                reports.append(replace(report, node_id=stage.node_id))
                continue
        except ray.exceptions.RayActorError:
            pass
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"stage {stage.stage} on {stage.hostname} did not report within {timeout_s:.0f} s"
            ) from None
        reports.append(
            LostStage(
                stage=stage.stage,
                hostname=stage.hostname,
                node_id=stage.node_id,
                layers=tuple(stage.layers),
            )
        )
    return reports


def live(reports: Sequence[Report]) -> list[StageSnapshot]:
    """The snapshots of live workers (a lost stage is a `LostStage`)."""
    return [r for r in reports if isinstance(r, StageSnapshot)]


def lost_stages(reports: Sequence[Report]) -> list[LostStage]:
    return [r for r in reports if isinstance(r, LostStage)]


def gpu_rows(reports: Sequence[Report]) -> list[GpuRow]:
    rows = []
    for r in sorted(live(reports), key=lambda r: r.stage):
        stats, pin = r.stats, r.pin
        rows.append(
            GpuRow(
                stage=r.stage,
                hostname=r.hostname,
                gpu=r.gpu or "-",
                layers=layer_range(r.layers),
                backend=r.backend,
                device_total_bytes=r.device_total_bytes,
                device_used_bytes=r.device_used_bytes,
                device_free_bytes=r.device_free_bytes,
                resident_bytes=stats.resident_bytes,
                buffer_bytes=stats.buffer_bytes,
                offloaded_bytes=stats.offloaded_bytes,
                pinned_bytes=stats.pinned_bytes,
                pageable_bytes=stats.pageable_bytes,
                copies=stats.copies,
                copied_bytes=stats.copied_bytes,
                copy_s=stats.copy_s,
                stall_s=stats.stall_s,
                dequant_s=stats.dequant_s,
                offload_format=r.offload_format,
                quantization_error=r.quantization_error,
                expert_hits=stats.expert_hits,
                expert_misses=stats.expert_misses,
                expert_predicted=stats.expert_predicted,
                expert_predicted_correct=stats.expert_predicted_correct,
                resident_format=r.resident_format,
                copy_engine=stats.copy_engine,
                kv_cache_bytes=r.kv_cache_bytes,
                requests=r.requests,
                pin=pin.pin,
                pin_source=pin.source,
                pin_reason=pin.reason,
                pin_origin=r.pin_origin,
            )
        )
    return rows


def node_rows(reports: Sequence[Report]) -> list[NodeRow]:
    """Per node (Ray's node id, which the driver adds to each snapshot; else the hostname:
    several Ray nodes may share a host): the host memory its workers hold. Workers of one node
    report the same `host_available_bytes` (sampled at slightly different times): the smallest
    is kept."""
    by_node: dict[tuple[str, str], list[StageSnapshot]] = defaultdict(list)
    for r in live(reports):
        by_node[(r.hostname, r.node_id)].append(r)
    rows = []
    for (hostname, node_id), items in sorted(by_node.items()):
        rows.append(
            NodeRow(
                hostname=hostname,
                node_id=node_id,
                stages=tuple(sorted(i.stage for i in items)),
                host_available_bytes=min(i.host_available_bytes for i in items),
                workers_rss_bytes=sum(i.host_rss_bytes for i in items),
                pinned_bytes=sum(i.stats.pinned_bytes for i in items),
                pageable_bytes=sum(i.stats.pageable_bytes for i in items),
            )
        )
    return rows


def summary(reports: Sequence[Report], events: list[dict] = ()) -> dict:
    """JSON-ready: per GPU and per node, the stages whose worker is lost, recovery events.
    What `offloadctl status --json` prints: its keys are what users' scripts read."""
    lost = lost_stages(reports)
    return {
        "gpus": [asdict(row) for row in gpu_rows(reports)],
        "nodes": [asdict(row) for row in node_rows(reports)],
        "lost": [
            {"stage": r.stage, "hostname": r.hostname, "layers": list(r.layers)} for r in lost
        ],
        "events": list(events),
    }


def _event_line(event: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["time"]))
    details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("time", "event"))
    return f"{when}  {event['event']}: {details}"


def _node_label(row: NodeRow) -> str:
    return f"{row.hostname} ({row.node_id[:8]})" if row.node_id else row.hostname


def render(
    reports: Sequence[Report], events: list[dict] = (), generated_tokens: int | None = None
) -> str:
    """The status table of every GPU and node, each routed stage's experts by layer (with the
    expert bytes copied per generated token where the load's engine says how many it
    generated: `generated_tokens`), lost stages and the job's events."""
    gpus = [
        (
            "stage",
            "host",
            "gpu",
            "layers",
            "backend",
            "device used/total",
            "resident",
            "slots",
            "offloaded (pinned)",
            "kv cache (requests)",
            "copies",
            "stall",
            "pin",
        )
    ]
    for g in gpu_rows(reports):
        gpus.append(
            (
                str(g.stage),
                g.hostname,
                g.gpu,
                g.layers,
                g.backend + (f" ({g.copy_engine})" if g.copy_engine in PAGEABLE_ENGINES else ""),
                f"{format_bytes(g.device_used_bytes)} / {format_bytes(g.device_total_bytes)}",
                format_bytes(g.resident_bytes)
                + (f" ({g.resident_format} as stored)" if g.resident_format else ""),
                format_bytes(g.buffer_bytes),
                f"{format_bytes(g.offloaded_bytes)} ({format_bytes(g.pinned_bytes)})"
                + (f" {g.offload_format}" if g.offload_format else ""),
                f"{format_bytes(g.kv_cache_bytes)} ({g.requests})",
                str(g.copies)
                + (
                    f" ({g.expert_misses} experts fetched, {g.expert_hits} hits"
                    + (
                        f", prediction {g.expert_predicted_correct / g.expert_predicted:.0%} right"
                        if g.expert_predicted
                        else ""
                    )
                    + ")"
                    if g.expert_hits or g.expert_misses
                    else ""
                ),
                f"{g.stall_s * 1e3:.1f} ms",
                f"{'on' if g.pin else 'off'} ({g.pin_origin}: {g.pin_source})",
            )
        )
    nodes = [("node", "stages", "host available", "workers RSS", "pinned", "pageable")]
    for n in node_rows(reports):
        nodes.append(
            (
                _node_label(n),
                ",".join(map(str, n.stages)),
                format_bytes(n.host_available_bytes),
                format_bytes(n.workers_rss_bytes),
                format_bytes(n.pinned_bytes),
                format_bytes(n.pageable_bytes),
            )
        )
    out = render_table(gpus) + "\n\n" + render_table(nodes)
    for r in reports:
        if isinstance(r, StageSnapshot) and r.expert_layers:
            out += f"\nstage {r.stage} routed experts by layer: " + "; ".join(
                f"{name} {hits} hits, {misses} fetched, {format_bytes(nbytes)} copied"
                + (
                    f" ({format_bytes(round(nbytes / generated_tokens))} per token)"
                    if generated_tokens
                    else ""
                )
                for name, hits, misses, nbytes in r.expert_layers
            )
    for r in lost_stages(reports):
        out += (
            f"\nstage {r.stage} ({layer_range(r.layers)}, on {r.hostname}): worker "
            "LOST; the next forward recovers it, or unload"
        )
    if events:
        out += "\n\nevents:\n" + "\n".join(_event_line(e) for e in events)
    return out


def prometheus_lines(reports: Sequence[Report], model_name: str, generated_tokens: int) -> str:
    """The offloaders' counters in Prometheus' text format, for a server's `GET /metrics`
    beside the engine's (`EngineStats.prometheus`), labelled by model and stage:

    - `offload:copied_bytes_total`: host-to-device bytes each stage's offloader copied;
    - `offload:copied_bytes_per_token`: the same over the tokens the load's engine generated
      (`generated_tokens`; absent before the first);
    - per offloaded layer of a routed stage (labelled `layer` too):
      `offload:expert_cache_hits_total` (routed experts found on the device),
      `offload:expert_cache_misses_total` (copied when routed to) and
      `offload:expert_copied_bytes_per_token`.

    A lost stage has no series until its worker is back."""
    families: dict[str, tuple[str, list[tuple[str, float]]]] = {}

    def add(name: str, kind: str, labels: str, value: float) -> None:
        families.setdefault(name, (kind, []))[1].append((labels, value))

    for r in sorted((r for r in reports if isinstance(r, StageSnapshot)), key=lambda r: r.stage):
        labels = f'model_name="{model_name}",stage="{r.stage}"'
        add("offload:copied_bytes_total", "counter", labels, r.stats.copied_bytes)
        if generated_tokens:
            per_token = r.stats.copied_bytes / generated_tokens
            add("offload:copied_bytes_per_token", "gauge", labels, per_token)
        for name, hits, misses, nbytes in r.expert_layers:
            layer = f'{labels},layer="{name}"'
            add("offload:expert_cache_hits_total", "counter", layer, hits)
            add("offload:expert_cache_misses_total", "counter", layer, misses)
            if generated_tokens:
                per_token = nbytes / generated_tokens
                add("offload:expert_copied_bytes_per_token", "gauge", layer, per_token)
    lines = []
    for name, (kind, series) in families.items():
        lines.append(f"# TYPE {name} {kind}")
        lines += [f"{name}{{{labels}}} {value}" for labels, value in series]
    return "".join(line + "\n" for line in lines)


def serving_line(stats: dict | None) -> str:
    """One line of a served load's generation stats (the engine's, published through the
    load's keeper), or that nothing serves it."""
    if not stats:
        return "\nserving: no engine has published stats for this load (not served?)"

    def ms(key: str) -> str:
        value = stats.get(key)
        return "-" if value is None else f"{value * 1e3:.0f} ms"

    age = time.time() - stats["time"] if "time" in stats else 0.0
    engine = ""
    if stats.get("engine_failures"):
        state = stats.get("engine_state", "serving")
        engine = (
            f"\nengine: {state}; its loop stopped {stats['engine_failures']} time(s) on an "
            f"error, {stats.get('engine_restarts', 0)} new engine(s) started; last: "
            f"{stats.get('engine_stopped', '')}"
        )
        if state == "failed":
            engine += "\nthis load cannot serve: unload it and load it again"
    blocks = stats.get("kv_blocks")
    pool = (
        f"KV blocks {stats['kv_blocks_used']} used / {blocks - stats['kv_blocks_used']} free of "
        f"{blocks} on every GPU (each keeps its layers' part of each block; "
        f"{stats['kv_tokens_used']} tokens held), {stats['preemptions']} preemption(s) "
        f"({stats.get('preemptions_per_min', 0.0):.1f} a minute lately), "
        if blocks
        else ""
    )
    lengths = (
        f"\nlengths of the last {stats['observed_sequences']} sequences: prompt p50 "
        f"{stats['observed_prompt_p50']}, generated p50 {stats['observed_generated_p50']}, "
        f"prompt + generated p90 {stats['observed_total_p90']} tokens"
        if stats.get("observed_sequences")
        else ""
    )
    if stats.get("pool_advice"):
        checked = time.time() - stats.get("pool_advice_at", time.time())
        lengths += (
            f"\nKV pool for those lengths (checked {checked:.0f} s ago): {stats['pool_advice']}; "
            f"{stats.get('rebalances', 0)} re-balance(s)"
        )
    return (
        f"\nserving ({age:.0f} s ago): {stats['requests_running']} running (at most "
        f"{stats['kv_slots']}), {stats['requests_waiting']} waiting, {pool}batch occupancy "
        f"{stats['batch_occupancy']:.0%} (mean batch {stats['mean_batch']}), "
        f"{stats['generation_tokens']} tokens generated, {stats['requests']} requests "
        f"({stats['rejected']} refused: queue full); time to first token p50 "
        f"{ms('ttft_p50_s')} p99 {ms('ttft_p99_s')}, inter-token p50 {ms('itl_p50_s')} "
        f"p99 {ms('itl_p99_s')}{lengths}{engine}"
    )


# (metric name, description, GpuRow field)
GPU_GAUGES = (
    ("device_used_bytes", "Device memory in use on the GPU", "device_used_bytes"),
    (
        "device_total_bytes",
        "Device memory of the GPU (or its simulated budget)",
        "device_total_bytes",
    ),
    ("resident_weight_bytes", "Weight bytes resident on the GPU", "resident_bytes"),
    ("prefetch_buffer_bytes", "Device bytes of prefetch slots", "buffer_bytes"),
    ("offloaded_weight_bytes", "Weight bytes offloaded to host memory", "offloaded_bytes"),
    ("pinned_weight_bytes", "Offloaded weight bytes in pinned host memory", "pinned_bytes"),
    ("pageable_weight_bytes", "Offloaded weight bytes in pageable host memory", "pageable_bytes"),
    ("kv_cache_bytes", "KV cache bytes of the requests in flight on the GPU", "kv_cache_bytes"),
    ("copies", "Host-to-device copies issued so far", "copies"),
    ("stall_seconds", "Seconds the compute side waited for copies so far", "stall_s"),
    (
        "dequant_seconds",
        "Seconds spent dequantizing 8-bit offloaded weights after their copies so far",
        "dequant_s",
    ),
    ("pin_memory", "1 if the node pins offloaded weights", "pin"),
    (
        "expert_cache_hits",
        "Routed experts found in their slot already, so far (--expert-fetch routed)",
        "expert_hits",
    ),
    (
        "expert_cache_misses",
        "Routed experts copied when a step routed to them, so far (--expert-fetch routed)",
        "expert_misses",
    ),
    (
        "expert_predictions",
        "Routed experts predicted for a call (by its router ahead, or its last routing), so far",
        "expert_predicted",
    ),
    (
        "expert_predictions_correct",
        "Predicted routed experts the call did route to, so far",
        "expert_predicted_correct",
    ),
)


# Per offloaded layer of a routed stage (StageSnapshot.expert_layers, in its order after the
# layer's name), tagged with the layer too: (metric name, description)
EXPERT_LAYER_GAUGES = (
    ("expert_layer_hits", "Routed experts of this layer found on the GPU, so far"),
    ("expert_layer_misses", "Routed experts of this layer copied when routed to, so far"),
    ("expert_layer_copied_bytes", "Expert bytes of this layer copied to the GPU, so far"),
)


class MetricsExporter:
    """Ray gauges, tagged with node, GPU and stage. Created in the driver; Ray exports them on
    the node's metrics endpoint for Prometheus."""

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        tags = ("node", "gpu", "stage")
        self._gauges = {
            field: Gauge(METRIC_PREFIX + name, description=text, tag_keys=tags)
            for name, text, field in GPU_GAUGES
        }

        self._up = Gauge(
            METRIC_PREFIX + "stage_up",
            tag_keys=tags,
            description="1 while the stage's worker answers, 0 once it is lost",
        )
        self._events = Gauge(
            METRIC_PREFIX + "recovery_events",
            tag_keys=("event",),
            description="Recovery events of the job so far, by kind",
        )

        self._was_up: set[tuple[str, str, str]] = set()
        self._by_layer = {
            index: Gauge(METRIC_PREFIX + name, description=text, tag_keys=(*tags, "layer"))
            for index, (name, text) in enumerate(EXPERT_LAYER_GAUGES, start=1)
        }

    def export(self, reports: Sequence[Report], events: list[dict] = ()) -> None:
        up = set()
        for row in gpu_rows(reports):
            tags = {"node": row.hostname, "gpu": row.gpu, "stage": str(row.stage)}
            for field, gauge in self._gauges.items():
                gauge.set(float(getattr(row, field)), tags=tags)
            up.add((row.hostname, row.gpu, str(row.stage)))
        for r in reports:
            if not isinstance(r, StageSnapshot):
                continue
            tags = {"node": r.hostname, "gpu": r.gpu or "-", "stage": str(r.stage)}
            for counts in r.expert_layers:
                for index, gauge in self._by_layer.items():
                    gauge.set(float(counts[index]), tags={**tags, "layer": counts[0]})
        down = {(r.hostname, "-", str(r.stage)) for r in lost_stages(reports)}
        # A stage renumbered or gone after a re-plan must not stay "up" under its old tags.
        down |= self._was_up - up
        for value, keys in ((1.0, up), (0.0, down)):
            for node, gpu, stage in keys:
                self._up.set(value, tags={"node": node, "gpu": gpu, "stage": stage})
        self._was_up = up
        counts: dict[str, int] = defaultdict(int)
        for e in events:
            counts[e["event"]] += 1
        for kind, count in counts.items():
            self._events.set(float(count), tags={"event": kind})


def _stacked(ax, labels: list[str], parts: list[tuple[str, list[int]]], title: str) -> None:
    """One stacked bar per label, a segment per (name, bytes per label) part, in MiB."""
    bottom = [0.0] * len(labels)
    for name, values in parts:
        heights = [v / 2**20 for v in values]
        ax.bar(labels, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_title(title)
    ax.set_ylabel("MiB")
    ax.legend()


def plot(reports: Sequence[Report], path: str) -> None:
    """Per GPU: stacked resident / prefetch buffers / other used / free; per node: pinned /
    pageable offloaded weights and free host memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus, nodes = gpu_rows(reports), node_rows(reports)
    if not gpus:
        raise LaunchError("no live worker to plot: every stage of the job is lost")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _stacked(
        left,
        [f"{g.stage}: {g.hostname}/{g.gpu}" for g in gpus],
        [
            ("resident weights", [g.resident_bytes for g in gpus]),
            ("prefetch buffers", [g.buffer_bytes for g in gpus]),
            (
                "other used",
                [max(g.device_used_bytes - g.resident_bytes - g.buffer_bytes, 0) for g in gpus],
            ),
            ("free", [g.device_free_bytes for g in gpus]),
        ],
        "GPU memory per stage",
    )
    _stacked(
        right,
        [_node_label(n) for n in nodes],
        [
            ("pinned offloaded", [n.pinned_bytes for n in nodes]),
            ("pageable offloaded", [n.pageable_bytes for n in nodes]),
            ("available", [n.host_available_bytes for n in nodes]),
        ],
        "Host memory per node",
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
