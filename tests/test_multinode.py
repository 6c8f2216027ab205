"""Four simulated nodes on one machine (ray.cluster_utils.Cluster), differing in labels and in
environment: each worker's pin decision comes from the level the precedence says
(job override > node label > node environment > probe), and the pipeline output still equals
transformers in one process."""

from __future__ import annotations

import pytest
import ray
import torch
from helpers import assert_probe_decided_pin, tiny_shape
from ray.cluster_utils import Cluster
from ray_head import HEAD_ARGS

from coordinator.config import JobConfig, NodeMatch, Override
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_logits


@pytest.fixture(scope="module")
def cluster():
    """A CPU head (the driver's node) and four one-GPU nodes:
    plain    - nothing set: the probe decides;
    env-off  - OFFLOAD_PIN_MEMORY=off in the node's own environment;
    labelled - the offload-pin-memory=off label, over OFFLOAD_PIN_MEMORY=auto in its environment;
    override - the same label and environment, and the job overrides both (and makes its GPU
               stand in for a GH200-class one: OFFLOAD_SIMULATED_GPU=coherent)."""
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, **HEAD_ARGS},
    )
    try:
        c.add_node(num_cpus=1, num_gpus=1, labels={"pool": "plain"})
        c.add_node(
            num_cpus=1,
            num_gpus=1,
            labels={"pool": "env-off"},
            env_vars={"OFFLOAD_PIN_MEMORY": "off"},
        )
        for pool in ("labelled", "override"):
            c.add_node(
                num_cpus=1,
                num_gpus=1,
                labels={"pool": pool, "offload-pin-memory": "off"},
                env_vars={"OFFLOAD_PIN_MEMORY": "auto"},
            )
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_pin_decisions_follow_precedence_and_output_matches(cluster, tmp_path) -> None:
    checkpoint = str(
        make_checkpoint(
            tmp_path / "ckpt",
            tiny_shape(6, max_shard_bytes=200_000),
        )
    )
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    config = JobConfig(
        checkpoint=checkpoint,
        address=cluster.address,
        # Room for two decoder layers per GPU, and host memory for one offloaded layer per
        # node: the six layers need all four GPUs.
        gpu_memory_bytes=2 * decoder + 4096,
        host_memory_bytes=decoder,
        # "0" rather than "off": the decision's reason shows whose setting won.
        overrides=(
            Override(
                match=NodeMatch(labels={"pool": "override"}),
                env={"OFFLOAD_PIN_MEMORY": "0", "OFFLOAD_SIMULATED_GPU": "coherent"},
            ),
        ),
    )
    with launch(config) as job:
        stages = job.plan.stages
        assert len(stages) == 4
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
        logits = job.forward(ids)
        reports = {r.stage: r for r in job.telemetry()}
        labels = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
        by_pool = {labels[s.node_id]["pool"]: reports[s.stage] for s in job.plan.stages}
    assert set(by_pool) == {"plain", "env-off", "labelled", "override"}
    plain, env_off, override = by_pool["plain"], by_pool["env-off"], by_pool["override"]
    labelled = by_pool["labelled"]
    assert (labelled.pin.source, labelled.pin_origin) == (
        "OFFLOAD_PIN_MEMORY",
        "node label",
    )
    assert labelled.pin.reason.startswith("OFFLOAD_PIN_MEMORY=off")
    assert plain.pin_origin == "probe"
    assert_probe_decided_pin(plain.device, plain.pin.to_dict())  # "cpu", or on a GPU host "cuda"
    assert (env_off.pin.source, env_off.pin_origin) == (
        "OFFLOAD_PIN_MEMORY",
        "node environment",
    )
    assert env_off.pin.reason.startswith("OFFLOAD_PIN_MEMORY=off")
    assert (override.pin.source, override.pin_origin) == (
        "OFFLOAD_PIN_MEMORY",
        "job override",
    )
    assert override.pin.reason.startswith("OFFLOAD_PIN_MEMORY=0")
    # backend auto per node: uva where the probe says coherent memory, prefetch elsewhere; the
    # plan gives the uva stage no prefetch slots (the uva job itself: test_pipeline).
    backends = {
        pool: s.backend for s in stages for pool, r in by_pool.items() if r.stage == s.stage
    }
    if override.device == "cpu":  # with CUDA present the simulated kind is ignored
        assert backends == {
            "plain": "prefetch",
            "env-off": "prefetch",
            "labelled": "prefetch",
            "override": "uva",
        }
        assert [s.slot_bytes for s in stages if s.backend == "uva"] == [0]
        [uva] = [s for s in stages if s.backend == "uva"]
        assert "simulated coherent GPU" in uva.backend_reason
    assert not any(r.pin.pin for pool, r in by_pool.items() if pool != "plain")
    assert torch.equal(logits, reference_logits(checkpoint, ids, num_threads=1))
