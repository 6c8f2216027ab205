"""A node's budgets: `offloadctl plan` and the runtime build the same NodeInfo from the same
probe, and the measured link rate reaches the planner. No Ray is started."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.cli import plan_cluster
from coordinator.config import ConfigError, JobConfig
from coordinator.planning.budgets import GPU_BUDGET_FRACTION, HOST_BUDGET_FRACTION, node_info
from coordinator.planning.planner import PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot
from coordinator.runtime.probing import probed_node_info
from offload import DeviceInfo, NodeProbe
from offload.policy import PIN_HEADROOM_FRACTION
from worker.node import probe_here
from worker.spec import LayerSpec, TensorSlice

GiB = 1 << 30
H100 = DeviceInfo(
    index=0,
    name="NVIDIA H100 80GB HBM3",
    capability=(9, 0),
    total_memory_bytes=80 * GiB,
    integrated=False,
)


def result(probe: NodeProbe, *, pin: bool, hostname: str = "gpu-a", error: str | None = None):
    """What `worker.node.probe_here()` returns on a node."""
    decision = {"pin": pin, "reason": "test", "source": "probe"} if error is None else None
    return {"hostname": hostname, "probe": probe, "pin": decision, "error": error}


def ray_node(node_id: str, num_gpus: int) -> dict:
    """The fields of a `ray.nodes()` entry the runtime reads."""
    return {
        "NodeID": node_id,
        "Resources": {"GPU": float(num_gpus), "CPU": 8.0},
        "Labels": {"ray.io/node-id": node_id},
    }


def cuda_probe(**fields) -> NodeProbe:
    """Two H100s, 400 GiB available, both link rates measured; `fields` replace any of it."""
    probe = NodeProbe(
        cuda_available=True,
        devices=(H100, H100),
        host_available_bytes=400 * GiB,
        link_pinned_bytes_per_s=50e9,
        link_pageable_bytes_per_s=12e9,
    )
    return dataclasses.replace(probe, **fields)


@pytest.mark.parametrize(
    ("config", "probed"),
    [
        # this machine, probed for real (its link rate measured), simulated GPUs
        (JobConfig(checkpoint="c", gpus=2, gpu_memory_bytes=64 << 20), None),
        # a CUDA node: GPU budgets from the devices, pinned, its pinned link rate
        (JobConfig(checkpoint="c", gpus=2), result(cuda_probe(), pin=True)),
        # the same node not pinning: host budget given, the pageable rate
        (
            JobConfig(checkpoint="c", gpus=2, host_memory_bytes=10 * GiB),
            result(cuda_probe(), pin=False),
        ),
    ],
)
def test_plan_and_launcher_build_the_same_node(config: JobConfig, probed: dict | None) -> None:
    probed = probed or probe_here()
    planned = plan_cluster(config, probed, num_nodes=1).nodes[0]
    launched = probed_node_info(config, ray_node("node-0", config.gpus), probed)
    assert planned == launched
    assert launched.link_bytes_per_s is not None and launched.link_bytes_per_s > 0


def test_budgets_from_the_probe() -> None:
    config = JobConfig(checkpoint="c")
    held = 20 * GiB  # this job's own arenas on the node: available again after a re-plan
    info = node_info(
        config,
        result(cuda_probe(), pin=True),
        node_id="n" * 56,
        num_gpus=2,
        labels={"pool": "a"},
        held_bytes=held,
    )
    available = 420 * GiB
    assert [g.memory_bytes for g in info.gpus] == [int(80 * GiB * GPU_BUDGET_FRACTION)] * 2
    assert info.host_budget_bytes == int(available * HOST_BUDGET_FRACTION)
    assert info.pinned_budget_bytes == int(available * PIN_HEADROOM_FRACTION)
    assert (info.pin, info.link_bytes_per_s, info.labels) == (True, 50e9, {"pool": "a"})
    unpinned = node_info(config, result(cuda_probe(), pin=False), node_id="n", num_gpus=1)
    assert (unpinned.pin, unpinned.link_bytes_per_s, len(unpinned.gpus)) == (False, 12e9, 1)
    unmeasured = cuda_probe(link_pinned_bytes_per_s=None, errors=("link (pinned, cuda:0): ...",))
    info = node_info(config, result(unmeasured, pin=True), node_id="n", num_gpus=2)
    assert info.link_bytes_per_s is None  # the planner falls back to its default


@pytest.mark.parametrize(
    ("config", "probed", "message"),
    [
        (
            JobConfig(checkpoint="c"),
            result(NodeProbe(), pin=False),
            "node gpu-a (node-0) has 2 GPUs that are not CUDA devices (simulated); give their "
            "memory with --gpu-memory",
        ),
        (
            JobConfig(checkpoint="c"),
            result(cuda_probe(devices=(H100,)), pin=True),
            "node gpu-a (node-0) has 2 GPUs but its probe sees 1 CUDA device(s); give the GPUs' "
            "memory with --gpu-memory, or ask for at most 1 GPUs",
        ),
        (
            JobConfig(checkpoint="c", gpu_memory_bytes=GiB),
            result(NodeProbe(), pin=False, error="OFFLOAD_PIN_MEMORY='maybe' is not valid"),
            "node gpu-a (node-0): OFFLOAD_PIN_MEMORY='maybe' is not valid",
        ),
    ],
)
def test_errors_name_the_node_and_the_fix(config, probed, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        node_info(config, probed, node_id="node-0", num_gpus=2)
    assert str(err.value) == message


def test_measured_link_rates_reach_the_plan() -> None:
    """Two nodes alike but for their measured link: the same offloaded bytes take each node's
    own time, and when free to choose the planner offloads more where copies are faster."""

    def decoder(i: int) -> LayerSpec:
        tensor = TensorSlice(
            name=f"layers.{i}.w", dtype="U8", shape=(GiB,), file="x", start=0, end=GiB
        )
        return LayerSpec(name=f"layers.{i}", kind="decoder", index=i, tensors=(tensor,))

    def plan_on(host_memory_bytes: int | None):
        config = JobConfig(
            checkpoint="c", gpu_memory_bytes=3 * GiB, host_memory_bytes=host_memory_bytes
        )
        nodes = []
        for n, rate in enumerate((8e9, 32e9)):
            probe = NodeProbe(host_available_bytes=100 * GiB, link_pageable_bytes_per_s=rate)
            nodes.append(
                node_info(
                    config,
                    result(probe, pin=False, hostname=f"h{n}"),
                    node_id=f"node-{n}",
                    num_gpus=1,
                )
            )
        return plan(
            [decoder(i) for i in range(8)],
            ClusterSnapshot(nodes=tuple(nodes)),
            PlanOptions(compute_bytes_per_s=1e15),
        )

    # 3 GiB GPUs (two resident layers and a slot) and 2 GiB of host each: 4 layers per node.
    the_plan = plan_on(host_memory_bytes=2 * GiB)
    slow, fast = the_plan.stages
    assert slow.offloaded_bytes == fast.offloaded_bytes == 2 * GiB
    assert (slow.link_bytes_per_s, fast.link_bytes_per_s) == (8e9, 32e9)
    assert (slow.transfer_s, fast.transfer_s) == (2 * GiB / 8e9, 2 * GiB / 32e9)
    text = the_plan.summary()
    assert "8.0 GB/s" in text and "32.0 GB/s" in text
    # the links are measured: the only defaults shown are the (unmeasured) compute rates
    assert text.count("(default)") == len(the_plan.stages)
    slow, fast = plan_on(host_memory_bytes=None).stages  # host budgets do not bind
    assert slow.offloaded_bytes < fast.offloaded_bytes


def test_a_simulated_coherent_node_plans_uva_and_a_typo_is_an_error() -> None:
    """OFFLOAD_SIMULATED_GPU, set for a node without CUDA (here as a job override would set it),
    makes the node plan as a GH200-class one: backend auto -> uva, and the reason says why; a
    value that is not a kind is a ConfigError naming the variable, not a silent default."""
    if probe_here()["probe"].cuda_available:
        pytest.skip("the simulated kind is ignored where CUDA is present")
    config = JobConfig(checkpoint="ckpt/", gpu_memory_bytes=1 << 20)
    coherent = node_info(
        config, probe_here(env={"OFFLOAD_SIMULATED_GPU": "coherent"}), node_id="n0", num_gpus=1
    )
    assert coherent.backend == "uva" and "simulated coherent GPU" in coherent.backend_reason
    plain = node_info(config, probe_here(env={}), node_id="n0", num_gpus=1)
    assert plain.backend == "prefetch"
    forced = node_info(
        dataclasses.replace(config, backend="prefetch"),
        probe_here(env={"OFFLOAD_SIMULATED_GPU": "coherent"}),
        node_id="n0",
        num_gpus=1,
    )
    assert (forced.backend, forced.backend_reason) == ("prefetch", "backend=prefetch requested")
    with pytest.raises(
        ConfigError,
        match=r"OFFLOAD_SIMULATED_GPU='gh200' is not a simulated GPU "
        r"kind; allowed: discrete, coherent",
    ):
        node_info(
            config, probe_here(env={"OFFLOAD_SIMULATED_GPU": "gh200"}), node_id="n0", num_gpus=1
        )
