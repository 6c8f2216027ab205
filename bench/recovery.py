"""Recovery benchmark: a node of a three-node job leaves; how long until the next forward
returns, and how many bytes are read again, against unloading and loading from scratch on the
two nodes left (what an operator would do without re-planning).

A `ray.cluster_utils.Cluster` on this machine: a head without GPUs and three nodes of one
logical GPU each (workers compute on the CPU when there is no CUDA). Budgets as in
tests/test_recovery.py: three GPUs hold the model resident, two need offloading.

  recovery  - remove the node of the middle stage, then time `job.forward` (it notices the
              lost worker, re-plans, reconfigures the two survivors, reads the moved layers and
              runs the pass). Bytes read = the survivors' `bytes_read` deltas.
  relaunch  - close the job, launch the same config on the two nodes left, run one forward:
              new processes, the whole model read again.

    python bench/recovery.py [--layers 16] [--hidden 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from coordinator.tools.reference import reference_logits

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        shape = CheckpointShape(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=args.hidden * 2,
            vocab_size=1024,
            max_shard_bytes=64 * MIB,
        )
        checkpoint = str(make_checkpoint(Path(tmp) / "ckpt", shape))
        index = load_index(checkpoint)
        decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
        total = index.total_bytes
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
        try:
            nodes = {
                n.node_id: n for n in [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(3)]
            }
            ray.init(address=cluster.address, log_to_driver=False)
            config = JobConfig(
                checkpoint=checkpoint,
                address=cluster.address,
                gpu_memory_bytes=total // 3 + decoder // 2,
                host_memory_bytes=total // 2,
            )
            ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(0))
            expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
            result = run(cluster, nodes, config, ids, expected, total)
        finally:
            ray.shutdown()
            cluster.shutdown()
    result["machine"] = f"{platform.machine()}, torch {torch.__version__}, ray {ray.__version__}"
    result["model_mib"] = round(total / MIB, 1)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def run(cluster, nodes, config, ids, expected, total) -> dict:
    job = launch(config)
    try:
        assert torch.equal(job.forward(ids), expected)
        before = {r.pid: r.bytes_read for r in job.telemetry()}
        stages_before = len(job.plan.stages)
        cluster.remove_node(nodes[job.workers[1].node_id])
        start = time.perf_counter()
        logits = job.forward(ids)
        recovery_s = time.perf_counter() - start
        assert torch.equal(logits, expected), "logits differ after recovery"
        after = job.telemetry()
        reread = sum(r.bytes_read - before.get(r.pid, 0) for r in after)
        offloaded = sum(r.stats.offloaded_bytes for r in after)
        event = job.events[-1]
        stages_after = len(job.plan.stages)
    finally:
        job.close()
    start = time.perf_counter()
    with launch(config) as fresh:
        assert torch.equal(fresh.forward(ids), expected)
        relaunch_s = time.perf_counter() - start
        fresh_reports = fresh.telemetry()
        relaunch_read = sum(r.bytes_read for r in fresh_reports)
        relaunch_load_s = max(r.load_s for r in fresh_reports)
    return {
        "stages": f"{stages_before} -> {stages_after}",
        "event": event,
        "recovery_s": round(recovery_s, 2),
        "relaunch_s": round(relaunch_s, 2),
        "time_ratio": round(recovery_s / relaunch_s, 3),
        # of the relaunch: the slowest worker's own load (build + read), no process start
        "relaunch_load_s": round(relaunch_load_s, 2),
        "recovery_read_mib": round(reread / MIB, 2),
        "relaunch_read_mib": round(relaunch_read / MIB, 2),
        "read_ratio": round(reread / relaunch_read, 3),
        "offloaded_after_mib": round(offloaded / MIB, 2),
        "total_mib": round(total / MIB, 2),
    }


if __name__ == "__main__":
    main()
