"""Telemetry from worker snapshots: per-GPU and per-node aggregation, table, gauges, plot."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from coordinator.runtime.telemetry import (
    GpuRow,
    LostStage,
    MetricsExporter,
    NodeRow,
    gpu_rows,
    node_rows,
    plot,
    prometheus_lines,
    render,
    summary,
)
from offload.policy import PinDecision
from offload.stats import OffloadStats
from worker.snapshot import CopyCounters, StageSnapshot

MIB = 2**20


def report(stage: int, host: str, *, offloaded: int, pinned: bool, rss: int) -> StageSnapshot:
    return StageSnapshot(
        stage=stage,
        hostname=host,
        pid=1000 + stage,
        cpu_arch="x86_64",
        device="cpu",
        gpu=str(stage % 2),
        layers=(f"layers.{stage}",),
        offloaded=(f"layers.{stage}",),
        backend="prefetch",
        backend_reason="discrete GPU: prefetch",
        device_total_bytes=80 * MIB,
        device_used_bytes=30 * MIB,
        device_free_bytes=50 * MIB,
        host_rss_bytes=rss,
        host_peak_rss_bytes=rss,
        host_available_bytes=(100 - stage) * MIB,
        pin=PinDecision(pin=pinned, source="probe", reason="discrete GPU"),
        pin_origin="probe",
        stats=OffloadStats(
            backend="prefetch",
            offloaded_layers=1,
            resident_bytes=20 * MIB,
            buffer_bytes=5 * MIB,
            offloaded_bytes=offloaded,
            pinned_bytes=offloaded if pinned else 0,
            pageable_bytes=0 if pinned else offloaded,
            copies=7,
            copied_bytes=70,
            copy_s=0.5,
            stall_s=0.25,
            dequant_s=0.125,
            expert_hits=3,
            expert_misses=5,
            expert_predicted=4,
            expert_predicted_correct=3,
            copy_engine="cuda" if pinned else "direct",
        ),
        offload_format="int8 (1x128 blocks) x 7",
        resident_format="fp8 (128x128 blocks) x 2",
        expert_layers=(("layers.0", 3, 5, 5 * MIB),),
        quantization_error=0.004,
        since_last=CopyCounters(interval_s=10.0, copies=2, copied_bytes=20, copy_s=0.1),
        kv_cache_bytes=MIB,
        requests=1,
        time=1_700_000_000.0,
    )


REPORTS = [
    report(2, "b", offloaded=8 * MIB, pinned=False, rss=300 * MIB),
    report(0, "a", offloaded=10 * MIB, pinned=True, rss=400 * MIB),
    report(1, "a", offloaded=6 * MIB, pinned=True, rss=410 * MIB),
]


def test_rows_per_gpu_and_per_node() -> None:
    gpus = gpu_rows(REPORTS)
    assert [g.stage for g in gpus] == [0, 1, 2]
    assert gpus[0].offloaded_bytes == 10 * MIB and gpus[0].pinned_bytes == 10 * MIB
    assert gpus[2].pageable_bytes == 8 * MIB and not gpus[2].pin
    nodes = {n.hostname: n for n in node_rows(REPORTS)}
    assert nodes["a"].stages == (0, 1)
    assert nodes["a"].pinned_bytes == 16 * MIB and nodes["a"].pageable_bytes == 0
    assert nodes["a"].workers_rss_bytes == 810 * MIB
    assert nodes["a"].host_available_bytes == 99 * MIB  # the smaller of the two samples
    assert nodes["b"].pageable_bytes == 8 * MIB
    assert summary(REPORTS)["nodes"][1]["hostname"] == "b"


def test_ray_nodes_sharing_a_host_are_separate_rows() -> None:
    """Simulated (or containerised) Ray nodes may share a hostname: the node id the driver
    adds keeps them apart, in the rows and in the table."""
    reports = [
        dataclasses.replace(r, node_id=f"{node}{'0' * 30}")
        for r, node in zip(REPORTS, ("cc", "aa", "bb"), strict=True)
    ]
    rows = node_rows(reports)
    assert [(n.hostname, n.node_id[:2], n.stages) for n in rows] == [
        ("a", "aa", (0,)),
        ("a", "bb", (1,)),
        ("b", "cc", (2,)),
    ]
    assert "a (aa000000)" in render(reports) and "a (bb000000)" in render(reports)


def test_render_shows_every_gpu_and_node() -> None:
    text = render(REPORTS)
    assert "30.00 MiB / 80.00 MiB" in text and "10.00 MiB (10.00 MiB)" in text
    assert "on (probe: probe)" in text and "250.0 ms" in text
    assert "(fp8 (128x128 blocks) x 2 as stored)" in text  # resident matrices kept in 8 bits
    assert "(5 experts fetched, 3 hits, prediction 75% right)" in text
    assert "stage 0 routed experts by layer: layers.0 3 hits, 5 fetched, 5.00 MiB copied" in text
    assert "810.00 MiB" in text  # node a: both workers' RSS
    # the pageable arena's engine is named (its rate depends on it); the pinned one's is not
    assert "prefetch (direct)" in text and "prefetch (cuda)" not in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "memory.png"
    plot(REPORTS, str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_snapshot_round_trips_to_json_with_the_keys_it_always_had() -> None:
    """`to_dict` is JSON as it is (nested values as dicts, tuples as lists) and has every key
    the worker's snapshot dict had, so files and scripts written against it keep working; a
    snapshot crosses processes (Ray pickles it) unchanged."""
    snapshot = dataclasses.replace(REPORTS[1], node_id="aa" * 16, probe_errors=("no numa",))
    data = snapshot.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert {
        "stage",
        "hostname",
        "pid",
        "cpu_arch",
        "device",
        "gpu",
        "layers",
        "offloaded",
        "backend",
        "backend_reason",
        "pin",
        "pin_origin",
        "env",
        "device_total_bytes",
        "device_used_bytes",
        "device_free_bytes",
        "host_rss_bytes",
        "host_peak_rss_bytes",
        "host_available_bytes",
        "bytes_read",
        "init_s",
        "load_s",
        "forward_s",
        "forwards",
        "kv_cache_bytes",
        "requests",
        "stats",
        "since_last",
        "time",
        "probe_errors",
        "node_id",
        "offload_unit",
        "offload_format",
        "resident_format",
        "expert_layers",
        "quantization_error",
    } == set(data)
    assert data["stats"] == snapshot.stats.to_dict() and data["pin"] == snapshot.pin.to_dict()
    assert data["since_last"]["copies"] == 2 and data["layers"] == ["layers.0"]
    assert data["probe_errors"] == ["no numa"]
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.stage = 3  # type: ignore[misc]


def test_rows_read_every_number_from_the_snapshot() -> None:
    [row] = gpu_rows([REPORTS[1]])
    assert row == GpuRow(
        stage=0,
        hostname="a",
        gpu="0",
        layers="layers.0",
        backend="prefetch",
        device_total_bytes=80 * MIB,
        device_used_bytes=30 * MIB,
        device_free_bytes=50 * MIB,
        resident_bytes=20 * MIB,
        buffer_bytes=5 * MIB,
        offloaded_bytes=10 * MIB,
        pinned_bytes=10 * MIB,
        pageable_bytes=0,
        copies=7,
        copied_bytes=70,
        copy_s=0.5,
        stall_s=0.25,
        dequant_s=0.125,
        offload_format="int8 (1x128 blocks) x 7",
        quantization_error=0.004,
        expert_hits=3,
        expert_misses=5,
        expert_predicted=4,
        expert_predicted_correct=3,
        resident_format="fp8 (128x128 blocks) x 2",
        copy_engine="cuda",
        kv_cache_bytes=MIB,
        requests=1,
        pin=True,
        pin_source="probe",
        pin_reason="discrete GPU",
        pin_origin="probe",
    )
    no_gpu = dataclasses.replace(REPORTS[1], gpu="")
    assert gpu_rows([no_gpu])[0].gpu == "-"
    [node] = node_rows([REPORTS[1]])
    assert node == NodeRow(
        hostname="a",
        node_id="",
        stages=(0,),
        host_available_bytes=100 * MIB,
        workers_rss_bytes=400 * MIB,
        pinned_bytes=10 * MIB,
        pageable_bytes=0,
    )


LOST = LostStage(stage=3, hostname="c", node_id="dd" * 16, layers=("layers.3", "head"))


def test_status_json_keys_are_unchanged_and_a_lost_stage_is_listed() -> None:
    """`offloadctl status --json` prints `summary`: users' scripts read these keys."""
    data = json.loads(
        json.dumps(summary([*REPORTS, LOST], [{"event": "replaced workers", "time": 1.0}]))
    )
    assert list(data) == ["gpus", "nodes", "lost", "events"]
    assert list(data["gpus"][0]) == [
        "stage",
        "hostname",
        "gpu",
        "layers",
        "backend",
        "device_total_bytes",
        "device_used_bytes",
        "device_free_bytes",
        "resident_bytes",
        "buffer_bytes",
        "offloaded_bytes",
        "pinned_bytes",
        "pageable_bytes",
        "copies",
        "copied_bytes",
        "copy_s",
        "stall_s",
        "kv_cache_bytes",
        "requests",
        "pin",
        "pin_source",
        "pin_reason",
        "pin_origin",
        "dequant_s",
        "offload_format",
        "quantization_error",
        "expert_hits",
        "expert_misses",
        "expert_predicted",
        "expert_predicted_correct",
        "resident_format",
        "copy_engine",
    ]
    assert list(data["nodes"][0]) == [
        "hostname",
        "node_id",
        "stages",
        "host_available_bytes",
        "workers_rss_bytes",
        "pinned_bytes",
        "pageable_bytes",
    ]
    assert data["lost"] == [{"stage": 3, "hostname": "c", "layers": ["layers.3", "head"]}]
    assert [g["stage"] for g in data["gpus"]] == [0, 1, 2]  # the lost stage has no GPU row
    text = render([*REPORTS, LOST])
    assert "stage 3 (layers.3,head, on c): worker LOST" in text


def test_gauges_are_set_from_the_snapshots(monkeypatch) -> None:
    """Per live stage every GPU gauge and `stage_up` 1; a lost stage's `stage_up` 0."""
    import ray.util.metrics

    values: dict[tuple[str, tuple], float] = {}

    class Gauge:
        def __init__(self, name: str, *, description: str = "", tag_keys: tuple = ()) -> None:
            self.name = name

        def set(self, value: float, tags: dict) -> None:
            values[(self.name, tuple(sorted(tags.items())))] = value

    monkeypatch.setattr(ray.util.metrics, "Gauge", Gauge)
    MetricsExporter().export([*REPORTS, LOST], [{"event": "replaced workers", "time": 1.0}])
    stage0 = (("gpu", "0"), ("node", "a"), ("stage", "0"))
    assert values[("offload_offloaded_weight_bytes", stage0)] == 10 * MIB
    assert values[("offload_copies", stage0)] == 7.0
    assert values[("offload_expert_cache_hits", stage0)] == 3.0
    assert values[("offload_expert_cache_misses", stage0)] == 5.0
    layer0 = tuple(sorted((*stage0, ("layer", "layers.0"))))
    assert values[("offload_expert_layer_hits", layer0)] == 3.0
    assert values[("offload_expert_layer_misses", layer0)] == 5.0
    assert values[("offload_expert_layer_copied_bytes", layer0)] == 5 * MIB
    assert values[("offload_pin_memory", stage0)] == 1.0
    assert values[("offload_kv_cache_bytes", stage0)] == MIB
    assert values[("offload_stage_up", stage0)] == 1.0
    assert values[("offload_stage_up", (("gpu", "-"), ("node", "c"), ("stage", "3")))] == 0.0
    assert values[("offload_recovery_events", (("event", "replaced workers"),))] == 1.0


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, read by prometheus_client's own parser (which
    refuses a family whose samples are not together under one TYPE line)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_give_bytes_per_token_and_expert_hits_by_layer() -> None:
    """A server's /metrics lines for the offloaders: every live stage's copied bytes (total
    and per generated token), each routed layer's hits, misses and expert bytes per token;
    nothing for a lost stage, and no per-token series before the first token."""
    reports = [
        *REPORTS,
        LOST,
        dataclasses.replace(
            report(4, "c", offloaded=MIB, pinned=True, rss=MIB),
            expert_layers=(("layers.4", 0, 2, 3 * MIB), ("layers.5", 7, 1, MIB)),
        ),
    ]
    text = prometheus_lines(reports, "m", 10)
    values = scrape(text)

    def at(stage: int, layer: str | None = None) -> tuple:
        labels = {"model_name": "m", "stage": str(stage)}
        return tuple(sorted({**labels, **({"layer": layer} if layer else {})}.items()))

    for stage in (0, 1, 2, 4):
        assert values[("offload:copied_bytes_total", at(stage))] == 70
        assert values[("offload:copied_bytes_per_token", at(stage))] == 7.0
    assert not any(labels == at(3) for _, labels in values)  # the lost stage
    assert values[("offload:expert_cache_hits_total", at(0, "layers.0"))] == 3
    assert values[("offload:expert_cache_misses_total", at(0, "layers.0"))] == 5
    assert values[("offload:expert_copied_bytes_per_token", at(0, "layers.0"))] == MIB / 2
    assert values[("offload:expert_cache_hits_total", at(4, "layers.5"))] == 7
    assert values[("offload:expert_cache_misses_total", at(4, "layers.4"))] == 2
    assert values[("offload:expert_copied_bytes_per_token", at(4, "layers.4"))] == 0.3 * MIB
    assert text.count("# TYPE offload:expert_cache_hits_total counter") == 1
    before = scrape(prometheus_lines(reports, "m", 0))
    assert not any("per_token" in name for name, _ in before)
    assert before[("offload:expert_cache_misses_total", at(4, "layers.4"))] == 2
    # `offloadctl status` shows the same per token where the engine says how many it made
    assert "layers.0 3 hits, 5 fetched, 5.00 MiB copied (512.00 KiB per token)" in render(
        reports, generated_tokens=10
    )
    assert "per token" not in render(reports)


def test_the_load_table_reads_the_snapshots() -> None:
    from coordinator.cli.loads import stage_table

    table = stage_table([REPORTS[1], dataclasses.replace(REPORTS[0], gpu="")])
    assert "on" in table and "probe: probe: discrete GPU" in table
    assert "10.00 MiB (1)" in table and "20.00 MiB" in table  # offloaded (layers), resident
    assert "backend" in table.splitlines()[0]
    assert {REPORTS[0].backend, REPORTS[1].backend} <= set(table.split())
    assert " - " in table  # no CUDA_VISIBLE_DEVICES


def test_the_serving_line_shows_the_kv_blocks_used_and_free() -> None:
    """`offloadctl status`'s serving line: the pool's blocks in use and free (the same blocks on
    every GPU, each keeping its layers' part), the tokens they hold and the preemptions."""
    import time

    from coordinator.engine.stats import EngineStats
    from coordinator.runtime.telemetry import serving_line

    stats = EngineStats(num_slots=4, num_blocks=10, used_blocks=3, used_tokens=40, preemptions=2)
    line = serving_line({**stats.snapshot(), "time": time.time()})
    assert "0 running (at most 4)" in line
    assert "KV blocks 3 used / 7 free of 10 on every GPU" in line and "40 tokens held" in line
    assert "2 preemption(s)" in line
    assert stats.snapshot()["kv_cache_usage"] == 0.3


def test_the_engine_records_lengths_and_the_preemption_rate_and_status_shows_them() -> None:
    """Issue 59 points 2 and 3: each sequence that ends gives its prompt and generated lengths
    (not one that ended on an error: its lengths say nothing of the traffic), preemptions are
    counted per minute over the last 5 minutes, and the serving line shows both."""
    import time

    from coordinator.engine.stats import PREEMPTION_WINDOW_S, EngineStats
    from coordinator.runtime.telemetry import serving_line

    stats = EngineStats(num_slots=4, num_blocks=10)
    assert stats.snapshot()["observed_sequences"] == 0
    assert "lengths of the last" not in serving_line({**stats.snapshot(), "time": time.time()})
    for prompt, generated in ((8, 24), (8, 20), (40, 480)):
        stats.finished(prompt, generated)
    stats.finished()  # an error
    assert stats.ended == 4 and stats.observed_lengths() == ((8, 24), (8, 20), (40, 480))
    now = time.monotonic()
    stats.preempted(3, now - PREEMPTION_WINDOW_S - 1)  # three, long ago
    stats.preempted(5, now - 10)  # two, lately
    stats.preempted(5, now)  # none more
    assert stats.preemptions == 5 and stats.preemptions_per_min(now) == 2 * 60 / PREEMPTION_WINDOW_S
    snap = stats.snapshot()
    assert (snap["observed_prompt_p50"], snap["observed_generated_p50"]) == (8, 24)
    assert snap["observed_total_p90"] == 520
    line = serving_line({**snap, "time": time.time()})
    assert "5 preemption(s) (0.4 a minute lately)" in line
    assert (
        "lengths of the last 3 sequences: prompt p50 8, generated p50 24, prompt + generated "
        "p90 520 tokens"
    ) in line
    assert "KV pool for those lengths" not in line  # not checked yet
    stats.rebalanced({"event": "re-balanced", "why": "KV pool 64 -> 256 tokens: +40.0%"})
    stats.rebalanced({"event": "kept the KV pool", "why": "the KV pool of 256 tokens stays"})
    line = serving_line({**stats.snapshot(), "time": time.time()})
    assert "KV pool for those lengths (checked 0 s ago): the KV pool of 256 tokens stays" in line
    assert "1 re-balance(s)" in line and stats.snapshot()["rebalances"] == 1
