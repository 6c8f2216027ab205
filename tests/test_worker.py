"""The stage worker driven in-process (no Ray): it reads exactly its share, reports counters
since the previous snapshot, and refuses a stage that exceeds its simulated GPU budget."""

from __future__ import annotations

import pytest
import torch

from coordinator.checkpoint import load_index
from coordinator.make_checkpoint import CheckpointShape, make_checkpoint
from worker.spec import StageSpec
from worker.worker import StageWorker, WorkerError


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("w") / "ckpt", CheckpointShape(
        num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64,
        vocab_size=64))  # fmt: skip
    return load_index(path)


def spec_for(index, *, offloaded: tuple[str, ...]) -> StageSpec:
    return StageSpec(stage=0, num_stages=1, checkpoint_dir=str(index.root), config=index.config,
                     layers=index.layers, offloaded=offloaded, prefetch_step=1)  # fmt: skip


def test_snapshots_report_counters_since_the_last_one(index) -> None:
    worker = StageWorker(spec_for(index, offloaded=("layers.1", "layers.3")), device="cpu")
    try:
        first = worker.load()
        assert first["bytes_read"] == index.total_bytes
        ids = torch.randint(0, 64, (1, 5))
        worker.forward(ids)
        worker.forward(ids)
        report = worker.report()
        # one slot, two offloaded layers: each forward reloads both
        assert report["since_last"]["copies"] == 4
        assert report["stats"]["copies"] == first["stats"]["copies"] + 4
        assert worker.report()["since_last"]["copies"] == 0
        assert report["forwards"] == 2 and report["init_s"] > 0
    finally:
        worker.close()


def test_budget_overrun_is_refused_with_numbers(index) -> None:
    worker = StageWorker(spec_for(index, offloaded=()), device="cpu", gpu_memory_bytes=1000)
    try:
        with pytest.raises(WorkerError, match=r"over its budget of 1000.*--gpu-memory"):
            worker.load()
    finally:
        worker.close()
