"""A node's budgets: `offloadctl plan` and the runtime build the same NodeInfo from the same
probe, and the measured link rate reaches the planner. No Ray is started."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_shape

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


def test_a_node_computes_in_fp8_when_every_gpu_it_sees_does() -> None:
    """Compute capability 8.9 (Ada) or higher on every device: where "auto" keeps a quantized
    checkpoint's resident weights as stored; never on simulated GPUs."""
    config = JobConfig(checkpoint="c")
    ada = dataclasses.replace(H100, name="NVIDIA L4", capability=(8, 9))
    ampere = dataclasses.replace(H100, name="NVIDIA A100", capability=(8, 0))
    for devices, fp8 in (((H100, ada), True), ((H100, ampere), False)):
        probed = result(cuda_probe(devices=devices), pin=True)
        assert node_info(config, probed, node_id="n", num_gpus=2).fp8_compute == fp8
    simulated = JobConfig(checkpoint="c", gpu_memory_bytes=GiB)
    assert not node_info(
        simulated, result(NodeProbe(), pin=False), node_id="n", num_gpus=2
    ).fp8_compute


@pytest.mark.parametrize(
    ("config", "probed", "message"),
    [
        (
            JobConfig(checkpoint="c"),
            result(NodeProbe(), pin=False),
            "node gpu-a (node-0) has 2 GPUs that are not CUDA devices (simulated); give their "
            "memory with --gpu-memory",
        ),
        (  # --gpu-memory never makes a node whose CUDA fails into simulated GPUs
            JobConfig(checkpoint="c", gpu_memory_bytes=GiB),
            result(NodeProbe(nvidia_gpus_present=2), pin=False),
            "node gpu-a (node-0) has 2 NVIDIA GPU(s) but CUDA does not start in its processes "
            "(torch.cuda.is_available() is False): fix its driver, CUDA runtime or "
            "CUDA_VISIBLE_DEVICES, or take it out of the cluster; it is never run as simulated "
            "GPUs",
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


def test_gpu_memory_caps_what_the_device_has_free_and_host_memory_what_is_available() -> None:
    """--gpu-memory is a cap: 80 GiB on an 80 GB H100 with 79 GiB free plans 90% of the free
    memory, and says so; below that it is the budget. A probe that holds one GPU of a node of
    two (a surviving worker's) stands for both. --host-memory beyond what is available is
    capped, and said."""
    free = dataclasses.replace(H100, free_memory_bytes=79 * GiB)
    measured = int(79 * GiB * GPU_BUDGET_FRACTION)
    probe = cuda_probe(devices=(free,))
    capped = node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=80 * GiB, host_memory_bytes=500 * GiB),
        result(probe, pin=True),
        node_id="n",
        num_gpus=2,
    )
    assert [g.memory_bytes for g in capped.gpus] == [measured, measured]
    assert capped.host_budget_bytes == 400 * GiB and capped.cuda
    assert capped.budget_note == (
        "2 GPUs, 1 seen by the probes: the others taken to be like GPU 0 (NVIDIA H100 80GB "
        "HBM3); --gpu-memory 80.00 GiB capped at 71.10 GiB (90% of the 79.00 GiB free on NVIDIA "
        "H100 80GB HBM3); --host-memory 500.00 GiB capped at the 400.00 GiB of host memory "
        "available"
    )
    under = node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=40 * GiB),
        result(probe, pin=True),
        node_id="n",
        num_gpus=1,
    )
    assert [g.memory_bytes for g in under.gpus] == [40 * GiB] and under.budget_note == ""


def test_plan_shows_the_reserve_computed_for_real_gpus_given_or_none(tmp_path) -> None:
    """On real GPUs the plan keeps a computed reserve free on every GPU (cuBLAS's workspace, a
    prefill chunk's activations, with eager attention its scores, the logits) and shows what it
    is made of; --reserve replaces it; simulated GPUs keep none unless given."""
    from coordinator.planning.batch_size import plan_job
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import make_checkpoint

    shape = tiny_shape(2, dtype="bfloat16")
    index = load_index(make_checkpoint(tmp_path / "ckpt", shape))
    config = JobConfig(
        checkpoint="c", max_batch=4, max_seq_len=64, attn_implementation="eager", gpus=1
    )
    gpu = node_info(config, result(cuda_probe(), pin=True), node_id="n", num_gpus=1)
    _, computed = plan_job(config, index, ClusterSnapshot(nodes=(gpu,)))
    tokens = 4 * 64  # the whole batch's prompts fit one prefill chunk (512 tokens)
    activations = tokens * 2 * (6 * 64 + 3 * 128 + 64) + tokens * 4 * 64 * (2 + 4)
    logits = 4 * 128 * 4 * 2
    assert computed.options.reserve_bytes == (32 << 20) + activations + logits
    [stage] = computed.stages
    assert stage.device_bytes == (
        stage.resident_bytes + stage.kv_bytes + computed.options.reserve_bytes
    )
    assert (
        "(computed: cuBLAS workspace 32.00 MiB + activations of 256 tokens with eager "
        "attention (4 heads x 64 positions) 800.00 KiB + logits of 4 rows 4.00 KiB)"
    ) in computed.summary()
    _, given = plan_job(
        dataclasses.replace(config, reserve_bytes=1 << 20), index, ClusterSnapshot(nodes=(gpu,))
    )
    assert given.options.reserve_bytes == 1 << 20 and "(given (--reserve))" in given.summary()
    simulated = plan_cluster(
        dataclasses.replace(config, gpu_memory_bytes=64 << 20), probe_here(), num_nodes=1
    )
    _, none = plan_job(config, index, simulated)
    assert none.options.reserve_bytes == 0
    assert "(none: simulated GPUs keep activations in host memory)" in none.summary()


def test_simulated_gpus_with_a_size_are_budgeted_as_real_ones() -> None:
    """Issue 57 point 1: a simulated GPU with a size (OFFLOAD_SIMULATED_GPU_MEMORY) is budgeted
    from what its probe found free, capped by --gpu-memory, as a real one; `offloadctl plan`
    (no Ray: no GPU held, none measured) takes each to be wholly free. Without a size,
    --gpu-memory is the budget, as before."""
    from offload.simulated import simulated_device

    total = 8 * GiB
    probe = NodeProbe(
        simulated_gpu="discrete",
        simulated_gpu_memory_bytes=total,
        simulated_devices=(simulated_device(3, total, 6 * GiB), simulated_device(5, total)),
        host_available_bytes=100 * GiB,
        cpu_count=8,
    )
    info = node_info(JobConfig(checkpoint="c"), result(probe, pin=False), node_id="n", num_gpus=2)
    assert [g.memory_bytes for g in info.gpus] == [
        int(6 * GiB * GPU_BUDGET_FRACTION),
        int(total * GPU_BUDGET_FRACTION),
    ]
    assert not info.cuda and info.concurrent_stages is not None and info.budget_note == ""
    capped = node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=6 * GiB),
        result(probe, pin=False),
        node_id="n",
        num_gpus=2,
    )
    assert [g.memory_bytes for g in capped.gpus] == [int(6 * GiB * GPU_BUDGET_FRACTION), 6 * GiB]
    assert "--gpu-memory 6.00 GiB capped at 5.40 GiB" in capped.budget_note
    unheld = dataclasses.replace(probe, simulated_devices=())
    info = node_info(JobConfig(checkpoint="c"), result(unheld, pin=False), node_id="n", num_gpus=3)
    assert [g.memory_bytes for g in info.gpus] == [int(total * GPU_BUDGET_FRACTION)] * 3
    unsized = dataclasses.replace(unheld, simulated_gpu_memory_bytes=None)
    info = node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=GiB),
        result(unsized, pin=False),
        node_id="n",
        num_gpus=2,
    )
    assert [g.memory_bytes for g in info.gpus] == [GiB, GiB]


def test_a_nodes_probes_merge_into_one_answer_with_every_gpu_they_hold() -> None:
    """Issue 57 point 2: on a re-plan a node answers through several processes (each surviving
    worker for its GPU, a task for its free ones): one result with every GPU, the node's facts
    from the first, the first error, the first measured compute."""
    from coordinator.runtime.probing import merge_results

    survivor = dataclasses.replace(H100, free_memory_bytes=70 * GiB)  # its stage credited
    free = dataclasses.replace(H100, free_memory_bytes=79 * GiB)
    first = {**result(cuda_probe(devices=(survivor,)), pin=True), "compute": "not measured"}
    second = {**result(cuda_probe(devices=(free,)), pin=True), "compute": {"rate": 1.0}}
    merged = merge_results([first, second])
    assert merged["probe"].devices == (survivor, free) and merged["compute"] == {"rate": 1.0}
    assert merged["error"] is None and merged["pin"] == first["pin"]
    info = node_info(JobConfig(checkpoint="c"), merged, node_id="n", num_gpus=2)
    assert [g.memory_bytes for g in info.gpus] == [
        int(70 * GiB * GPU_BUDGET_FRACTION),
        int(79 * GiB * GPU_BUDGET_FRACTION),
    ]
    assert info.budget_note == ""  # every GPU measured, none assumed
    failed = result(cuda_probe(), pin=False, error="OFFLOAD_PIN_MEMORY='x' is not a mode")
    assert merge_results([first, failed])["error"] == failed["error"]
    assert merge_results([first]) is first


def test_a_simulated_gpu_size_comes_from_the_nodes_environment_and_a_typo_is_an_error() -> None:
    sized = probe_here(env={"OFFLOAD_SIMULATED_GPU_MEMORY": "2GiB"})
    if sized["probe"].cuda_available:
        pytest.skip("a CUDA node: its GPUs are real")
    assert sized["error"] is None and sized["probe"].simulated_gpu_memory_bytes == 2 * GiB
    bad = probe_here(env={"OFFLOAD_SIMULATED_GPU_MEMORY": "2 gigs"})
    assert "OFFLOAD_SIMULATED_GPU_MEMORY='2 gigs' is not a size" in bad["error"]
    with pytest.raises(ConfigError, match="OFFLOAD_SIMULATED_GPU_MEMORY='2 gigs'"):
        node_info(JobConfig(checkpoint="c"), bad, node_id="n", num_gpus=1)


def test_an_error_names_each_variable_it_mentions_and_who_set_it() -> None:
    """A probe's error that names variables set for the node's workers says, for each one named,
    who set it (the job's override, a node label) and to change it there; the node is named by
    its hostname and the first 8 characters of its id. A node whose CUDA does not start lists
    every error its probe saw."""
    origins = {
        "OFFLOAD_PIN_MEMORY": "node label",
        "CUDA_VISIBLE_DEVICES": "job override",  # not in the error: not named
        "OFFLOAD_SIMULATED_GPU_MEMORY": "job override",
    }
    error = (
        "OFFLOAD_PIN_MEMORY='maybe' is not valid; "
        "OFFLOAD_SIMULATED_GPU_MEMORY='2 gigs' is not a size"
    )
    config = JobConfig(checkpoint="c", gpu_memory_bytes=GiB)
    with pytest.raises(ConfigError) as err:
        node_info(
            config,
            result(NodeProbe(), pin=False, error=error),
            node_id="0123456789abcdef",
            num_gpus=1,
            origins=origins,
        )
    assert str(err.value) == (
        f"node gpu-a (01234567): {error} (OFFLOAD_PIN_MEMORY is set by the node label for this "
        "node; OFFLOAD_SIMULATED_GPU_MEMORY is set by the job override for this node: change it "
        "there)"
    )
    unrelated = {"CUDA_VISIBLE_DEVICES": "job override"}
    with pytest.raises(ConfigError) as err:
        node_info(
            config,
            result(NodeProbe(), pin=False, error=error),
            node_id="n",
            num_gpus=1,
            origins=unrelated,
        )
    assert str(err.value) == f"node gpu-a (n): {error}"
    failed = NodeProbe(nvidia_gpus_present=1, errors=("cuInit: 999", "nvml: driver mismatch"))
    with pytest.raises(ConfigError) as err:
        node_info(config, result(failed, pin=False), node_id="n", num_gpus=1)
    assert "in its processes (cuInit: 999; nvml: driver mismatch): fix its driver" in str(err.value)


def test_host_budget_takes_off_what_other_loads_reserved() -> None:
    """Host memory other loads planned on the node and do not hold yet is taken; what this
    job's own workers hold is available again; available memory not measured counts as none.
    --host-memory up to what is available is the budget as given (no note); beyond it, capped,
    down to nothing where reservations take it all."""
    config = JobConfig(checkpoint="c")
    probe = cuda_probe(host_available_bytes=400 * GiB)
    info = node_info(
        config, result(probe, pin=True), node_id="n", num_gpus=1, reserved_bytes=100 * GiB
    )
    assert info.host_budget_bytes == int(300 * GiB * HOST_BUDGET_FRACTION)
    assert info.pinned_budget_bytes == int(300 * GiB * PIN_HEADROOM_FRACTION)
    unmeasured = cuda_probe(host_available_bytes=None)
    info = node_info(config, result(unmeasured, pin=True), node_id="n", num_gpus=1, held_bytes=GiB)
    assert info.host_budget_bytes == int(GiB * HOST_BUDGET_FRACTION)
    assert info.pinned_budget_bytes == int(GiB * PIN_HEADROOM_FRACTION)
    exact = node_info(
        JobConfig(checkpoint="c", host_memory_bytes=300 * GiB),
        result(probe, pin=True),
        node_id="n",
        num_gpus=1,
        reserved_bytes=100 * GiB,
    )
    assert exact.host_budget_bytes == 300 * GiB and exact.budget_note == ""
    taken = node_info(
        JobConfig(checkpoint="c", host_memory_bytes=10 * GiB),
        result(probe, pin=True),
        node_id="n",
        num_gpus=1,
        reserved_bytes=500 * GiB,
    )
    assert (taken.host_budget_bytes, taken.pinned_budget_bytes) == (0, 0)
    assert taken.budget_note == "--host-memory 10.00 GiB capped at the 0 B of host memory available"


def test_the_node_carries_its_name_gpus_rates_and_measured_compute() -> None:
    """The NodeInfo names the node and numbers its GPUs from 0, carries the probe's dequantize
    rates and the probe's timing of the model's layer, or the reason there is none; "auto"
    resolves to prefetch on a discrete CUDA GPU and says so."""
    from worker.compute_probe import ComputeProfile

    profile = ComputeProfile(
        family="llama",
        dtype="bfloat16",
        device="NVIDIA H100 80GB HBM3",
        rows=(1, 4),
        layer_s=(1e-3, 2e-3),
        fixed_s=(1e-4, 1e-4),
        layer_bytes=GiB,
    )
    rates = (("fp8", 400e9), ("int8", 300e9))
    probed = {
        **result(
            cuda_probe(dequant_bytes_per_s=rates, host_matmul_bytes_per_s=((1, 9e9), (16, 7e9))),
            pin=True,
            hostname="gpu-b",
        ),
        "compute": profile,
    }
    info = node_info(JobConfig(checkpoint="c"), probed, node_id="n", num_gpus=2)
    assert (info.hostname, [g.index for g in info.gpus]) == ("gpu-b", [0, 1])
    assert info.dequant_bytes_per_s == rates
    assert info.host_matmul_bytes_per_s == ((1, 9e9), (16, 7e9))
    assert (info.compute, info.compute_source) == (profile, "")
    assert (info.backend, info.backend_reason) == (
        "prefetch",
        "auto: discrete GPU, weights are copied in ahead of use on a side stream",
    )
    reason = "not measured: ValueError: unknown model family"
    unmeasured = node_info(
        JobConfig(checkpoint="c"), {**probed, "compute": reason}, node_id="n", num_gpus=1
    )
    assert (unmeasured.compute, unmeasured.compute_source) == (None, reason)
    assert unmeasured.compute_rate(4) == (None, reason)


@pytest.mark.parametrize(
    ("cpu_count", "cpus_per_worker", "stages"),
    [(9, 2, 4), (8, 2, 3), (8, 1, 7), (2, 1, 1), (1, 1, 1), (0, 1, None)],
)
def test_simulated_gpus_compute_at_once_as_the_cores_allow(
    cpu_count: int, cpus_per_worker: int, stages: int | None
) -> None:
    """GPUs simulated on the CPU: its cores less one over each worker's threads compute at once
    (at least one); unknown cores: no limit said. Real GPUs: each its own device, never."""
    config = JobConfig(checkpoint="c", gpu_memory_bytes=GiB, cpus_per_worker=cpus_per_worker)
    simulated = NodeProbe(host_available_bytes=10 * GiB, cpu_count=cpu_count)
    info = node_info(config, result(simulated, pin=False), node_id="n", num_gpus=2)
    assert info.concurrent_stages == stages
    assert type(info.concurrent_stages) is type(stages)
    real = node_info(
        config, result(cuda_probe(cpu_count=cpu_count), pin=True), node_id="n", num_gpus=2
    )
    assert real.concurrent_stages is None


def test_gpus_the_probes_did_not_see_are_like_the_one_with_least_free() -> None:
    """Two GPUs of four seen, alike but for what is free: the other two are budgeted like the
    one with less free, and the note names it. --gpu-memory at exactly what the device gives is
    the budget, with nothing to say; below it, every GPU's budget."""
    roomy = dataclasses.replace(H100, free_memory_bytes=79 * GiB)
    busy = dataclasses.replace(H100, index=1, free_memory_bytes=10 * GiB)
    probe = cuda_probe(devices=(roomy, busy))
    info = node_info(JobConfig(checkpoint="c"), result(probe, pin=True), node_id="n", num_gpus=4)
    least = int(10 * GiB * GPU_BUDGET_FRACTION)
    assert [g.memory_bytes for g in info.gpus] == [
        int(79 * GiB * GPU_BUDGET_FRACTION),
        least,
        least,
        least,
    ]
    assert info.budget_note == (
        "4 GPUs, 2 seen by the probes: the others taken to be like GPU 1 (NVIDIA H100 80GB HBM3)"
    )
    exact = node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=least),
        result(cuda_probe(devices=(busy,)), pin=True),
        node_id="n",
        num_gpus=1,
    )
    assert [g.memory_bytes for g in exact.gpus] == [least] and exact.budget_note == ""
    under = node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=GiB),
        result(probe, pin=True),
        node_id="n",
        num_gpus=2,
    )
    assert [g.memory_bytes for g in under.gpus] == [GiB, GiB] and under.budget_note == ""
