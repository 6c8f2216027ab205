"""Named loads on a cluster: load --name leaves detached workers behind; run, status, list and
unload attach to them by name from later commands; unload releases every GPU."""

from __future__ import annotations

import json

import pytest
import ray
from helpers import scrape_gauges, wait_gpus_free
from ray.cluster_utils import Cluster
from ray_head import free_ports

from coordinator.cli import EXIT_ERROR, main
from coordinator.planning.checkpoint import load_index
from coordinator.runtime import registry
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

METRICS_PORT = free_ports(1)[0]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "num_gpus": 3,
            "metrics_export_port": METRICS_PORT,
            "_system_config": {"metrics_report_interval_ms": 500},
        },
    )
    try:
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_load_run_status_list_unload(cluster, tmp_path, capsys) -> None:
    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        CheckpointShape(
            num_layers=6,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=128,
        ),
    )
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    budget = str(index.total_bytes // 3 - decoder // 4 + 16 * 1024)  # + a 12 KiB KV cache
    address = ["--address", cluster.address]
    assert (
        main(
            [
                "load",
                "--checkpoint",
                str(checkpoint),
                "--gpu-memory",
                budget,
                "--name",
                "m1",
                "--snapshot-interval",
                "0.5",
                "--max-seq-len",
                "24",
                *address,
            ]
        )
        == 0
    )
    assert "stays on the cluster" in capsys.readouterr().out
    assert ray.available_resources().get("GPU", 0) == 0  # the workers are still there
    assert list(registry.named_groups("m1")) == ["load:m1:pg-0"]  # their GPUs, reserved as one

    assert (
        main(
            [
                "load",
                "--checkpoint",
                str(checkpoint),
                "--gpu-memory",
                budget,
                "--name",
                "m1",
                *address,
            ]
        )
        == EXIT_ERROR
    )
    assert "already exists" in capsys.readouterr().err

    assert main(["list", *address]) == 0
    assert capsys.readouterr().out.split() == ["m1"]

    assert main(["run", "m1", "--check", *address]) == 0
    out = capsys.readouterr().out
    assert "attached to load 'm1'" in out and "bitwise equal" in out
    assert ray.available_resources().get("GPU", 0) == 0  # run detached, did not release

    # Text from the named load, from another command: its tokenizer, its planned KV cache.
    assert main(["generate", "m1", "--prompt", "the cat", "--max-new-tokens", "5", *address]) == 0
    generated = capsys.readouterr()
    assert "tokens/s" in generated.err
    assert (
        main(["generate", "m1", "--prompt", "the cat", "--max-new-tokens", "40", *address])
        == EXIT_ERROR
    )
    assert "exceed the KV cache reserved for max_seq_len=24" in capsys.readouterr().err

    assert main(["status", "m1", "--json", *address]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [g["stage"] for g in status["gpus"]] == [0, 1, 2]
    # the generating process's engine left its stats with the load's keeper
    serving = status["serving"]
    assert serving["generation_tokens"] == 5 and serving["requests"] == 1  # 40 never fitted
    assert serving["requests_running"] == 0 and serving["ttft_p50_s"] > 0
    assert sum(g["offloaded_bytes"] for g in status["gpus"]) > 0
    # No driver is left, yet Prometheus sees the load: its record publishes the workers'
    # periodic snapshots, and `run` above made copies that the gauges now count.
    offloaded = {str(g["stage"]): float(g["offloaded_bytes"]) for g in status["gpus"]}
    assert scrape_gauges("offload_offloaded_weight_bytes", offloaded, METRICS_PORT) == offloaded
    copies = {str(g["stage"]): float(g["copies"]) for g in status["gpus"]}
    assert scrape_gauges("offload_copies", copies, METRICS_PORT) == copies
    up = {str(g["stage"]): 1.0 for g in status["gpus"]}
    assert scrape_gauges("offload_stage_up", up, METRICS_PORT) == up
    plot = tmp_path / "m1.png"
    assert main(["status", "m1", "--plot", str(plot), *address]) == 0
    table = capsys.readouterr().out
    assert "device used/total" in table and "host available" in table  # per GPU, per node
    assert plot.read_bytes()[:4] == b"\x89PNG"

    assert main(["unload", "m1", *address]) == 0
    assert "3 workers released" in capsys.readouterr().out
    wait_gpus_free(3)
    assert registry.named_groups("m1") == {}  # the placement group went with them
    assert main(["list", *address]) == 0
    assert "no named loads" in capsys.readouterr().out
    assert main(["run", "m1", *address]) == EXIT_ERROR
    assert "no load named 'm1'" in capsys.readouterr().err
