"""Telemetry from worker snapshots: per-GPU and per-node aggregation, table, plot."""

from __future__ import annotations

from pathlib import Path

from coordinator.runtime.telemetry import gpu_rows, node_rows, plot, render, summary

MIB = 2**20


def report(stage: int, host: str, *, offloaded: int, pinned: bool, rss: int) -> dict:
    return {
        "stage": stage, "hostname": host, "gpu": str(stage % 2), "layers": [f"layers.{stage}"],
        "device_total_bytes": 80 * MIB, "device_used_bytes": 30 * MIB, "device_free_bytes": 50 * MIB,
        "host_rss_bytes": rss, "host_available_bytes": (100 - stage) * MIB,
        "pin": {"pin": pinned, "source": "probe", "reason": "discrete GPU"}, "pin_origin": "probe",
        "stats": {"resident_bytes": 20 * MIB, "buffer_bytes": 5 * MIB, "offloaded_bytes": offloaded,
                  "pinned_bytes": offloaded if pinned else 0,
                  "pageable_bytes": 0 if pinned else offloaded, "copies": 7, "copied_bytes": 70,
                  "copy_s": 0.5, "stall_s": 0.25},
    }  # fmt: skip


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
    reports = [{**r, "node_id": f"{node}{'0' * 30}"}
               for r, node in zip(REPORTS, ("cc", "aa", "bb"), strict=True)]  # fmt: skip
    rows = node_rows(reports)
    assert [(n.hostname, n.node_id[:2], n.stages) for n in rows] == [
        ("a", "aa", (0,)), ("a", "bb", (1,)), ("b", "cc", (2,))]  # fmt: skip
    assert "a (aa000000)" in render(reports) and "a (bb000000)" in render(reports)


def test_render_shows_every_gpu_and_node() -> None:
    text = render(REPORTS)
    assert "30.00 MiB / 80.00 MiB" in text and "10.00 MiB (10.00 MiB)" in text
    assert "on (probe: probe)" in text and "250.0 ms" in text
    assert "810.00 MiB" in text  # node a: both workers' RSS


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "memory.png"
    plot(REPORTS, str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
