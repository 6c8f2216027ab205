"""Lost nodes, on a Ray Cluster of one-GPU nodes (`Cluster.remove_node`): the job re-plans
on the GPUs left, surviving workers keep what they hold and read only the layers that moved,
logits stay equal to transformers; when what is left cannot hold the model, a PlanError with
the numbers, and the load can still be inspected; once a node joins, the next forward recovers;
unload releases everything.

The cluster's four nodes differ in labels and environment, for the first test: each worker's
pin decision comes from the level the precedence says (job override > node label > node
environment > probe). One cluster for both concerns: a second one cost ~30-40 CPU-s of Ray
processes (five raylets and their agents, a GCS, four probes: per-process costs sampled over
the whole suite, in bench/RESULTS.md's history) on a 2-core machine."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time

import pytest
import ray
import torch
from helpers import assert_probe_decided_pin, kill_actor, tiny_shape, wait_gpus_free
from ray.cluster_utils import Cluster
from ray_head import HEAD_ARGS

from coordinator.cli import main
from coordinator.config import JobConfig, NodeMatch, Override
from coordinator.planning.budgets import GPU_BUDGET_FRACTION, HOST_BUDGET_FRACTION
from coordinator.planning.checkpoint import load_index
from coordinator.planning.planner import PlanError, PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.runtime import telemetry
from coordinator.runtime.errors import LaunchError
from coordinator.runtime.launch import launch
from coordinator.runtime.probing import probe_cluster, probed_node_info
from coordinator.runtime.recovery import match_survivors
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_logits

SHAPE = tiny_shape(6, max_shard_bytes=200_000)


@pytest.fixture(scope="module")
def cluster():
    """A CPU head (the driver's node) and four one-GPU nodes:
    plain    - nothing set: the probe decides;
    env-off  - OFFLOAD_PIN_MEMORY=off in the node's own environment;
    labelled - the offload-pin-memory=off label, over OFFLOAD_PIN_MEMORY=auto in its environment;
    override - the same label and environment, and the first test's job overrides both (and
               makes its GPU stand in for a GH200-class one: OFFLOAD_SIMULATED_GPU=coherent).
    On the CPU none of these settings changes what a recovery does (nothing is pinned there);
    the recovery tests set the number of nodes they need (`gpu_nodes`), in an order that
    removes more nodes than it adds (4, 4, 3, 3, 3): a node added costs ~2 s and ~4 CPU-s
    (a raylet and its two agents, sampled)."""
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, **HEAD_ARGS},
    )
    try:
        c.add_node(num_cpus=2, num_gpus=1, labels={"pool": "plain"})
        c.add_node(
            num_cpus=2,
            num_gpus=1,
            labels={"pool": "env-off"},
            env_vars={"OFFLOAD_PIN_MEMORY": "off"},
        )
        for pool in ("labelled", "override"):
            c.add_node(
                num_cpus=2,
                num_gpus=1,
                labels={"pool": pool, "offload-pin-memory": "off"},
                env_vars={"OFFLOAD_PIN_MEMORY": "auto"},
            )
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def gpu_nodes(c: Cluster, count: int) -> dict:
    """Exactly `count` alive one-GPU nodes (earlier tests removed and added some): nodes added,
    or the last ones removed. Their Cluster nodes, by node id."""
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU"))
    for _ in range(count - len(alive)):
        alive.append(c.add_node(num_cpus=2, num_gpus=1).node_id)
    by_id = {node.node_id: node for node in c.list_all_nodes()}
    while len(alive) > count:
        c.remove_node(by_id[alive.pop()])
    return {node_id: by_id[node_id] for node_id in alive}


def budgets(index, backend: str = "prefetch") -> tuple[int, int]:
    """Per-GPU and per-node host bytes such that three GPUs hold the model resident, two need
    offloading, and one cannot hold it at all (checked on the planner itself)."""
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    gpu, host = index.total_bytes // 3 + decoder // 2, index.total_bytes // 2

    def offloaded(num_nodes: int) -> int:
        nodes = tuple(
            NodeInfo(
                node_id=f"n{i}",
                gpus=(GpuInfo(index=0, memory_bytes=gpu),),
                host_budget_bytes=host,
                backend=backend,
            )
            for i in range(num_nodes)
        )
        p = plan(index.layers, ClusterSnapshot(nodes=nodes), PlanOptions())
        return sum(s.offloaded_bytes for s in p.stages)

    assert offloaded(3) == 0 and offloaded(2) > 0
    with pytest.raises(PlanError):
        offloaded(1)
    return gpu, host


def budgeted_job(c: Cluster, tmp_path, backend: str = "prefetch", **changes):
    """A checkpoint of SHAPE, its index, and a job on `c` with the `budgets` for it (and
    `changes` to its config): what most tests here load."""
    checkpoint = str(make_checkpoint(tmp_path / "ckpt", SHAPE))
    index = load_index(checkpoint)
    gpu, host = budgets(index, backend)
    config = JobConfig(
        checkpoint=checkpoint,
        address=c.address,
        gpu_memory_bytes=gpu,
        host_memory_bytes=host,
        **({"backend": backend} if backend != "prefetch" else {}),
        **changes,
    )
    return checkpoint, index, config


def wait_events(name: str, count: int, timeout_s: float = 90.0) -> list[dict]:
    """The named load's events once it has `count` of them (its keeper adds them)."""
    from coordinator.runtime import registry

    deadline = time.monotonic() + timeout_s
    while len(events := registry.load_record(name)[1]["events"]) < count:
        assert time.monotonic() < deadline, f"{name}: still {events} after {timeout_s} s"
        time.sleep(0.2)
    return events


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


def test_a_replica_that_loses_its_node_moves_to_a_free_gpu(cluster, tmp_path) -> None:
    """Two replicas of one GPU each on a cluster of four one-GPU nodes: the node of replica 0
    leaves, and it re-plans onto a GPU no load holds (never the other replica's), takes that
    GPU as its own (`nodes`, kept in its record) and generates as before; replica 1 never
    notices."""
    from coordinator.runtime import registry
    from coordinator.runtime.launch import launch_replicas
    from coordinator.tools.reference import reference_generate

    c = cluster
    nodes = gpu_nodes(c, 4)
    checkpoint = str(make_checkpoint(tmp_path / "ckpt", SHAPE))
    index = load_index(checkpoint)
    config = JobConfig(
        checkpoint=checkpoint,
        address=c.address,
        objective="throughput",
        replicas=2,
        max_batch=1,
        max_seq_len=16,
        gpu_memory_bytes=index.total_bytes * 2,
    )
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = reference_generate(
        checkpoint, ids, num_threads=1, max_new_tokens=6, do_sample=False, eos_token_id=None
    )
    jobs = launch_replicas(config, "twin")
    try:
        # one micro-batch of one sequence: each replica runs on one of its two GPUs
        assert [len(j.plan.stages) for j in jobs] == [1, 1]
        first, second = (j.plan.stages[0].node_id for j in jobs)
        assert [j.config.nodes for j in jobs] == [f"{first}=1", f"{second}=1"]
        c.remove_node(nodes[first])
        out = jobs[0].generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert torch.equal(out, expected)
        jobs[0].refresh()  # its keeper re-planned it, for the engine there: its state now
        moved = jobs[0].plan.stages[0].node_id
        assert moved not in (first, second) and jobs[0].events[-1]["event"] == "re-planned"
        record = registry.load_record("twin-0")[1]
        assert registry.config_of(record).nodes == f"{moved}=1"  # its GPU now, for the next loss
        out = jobs[1].generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert torch.equal(out, expected) and jobs[1].events == []
    finally:
        for job in reversed(jobs):
            registry.forget(job.name)
            job.close()


def test_a_named_load_heals_itself_and_leaves_out_a_node_that_keeps_failing(
    cluster, tmp_path
) -> None:
    """No driver attached: the load's keeper replaces a lost worker by itself; once a node has
    lost NODE_LOSS_LIMIT workers it plans without that node (an event says so); the logits
    stay those of transformers, and unload releases everything, keeper included."""
    from coordinator.runtime import registry
    from coordinator.runtime.keeper import NODE_LOSS_LIMIT
    from coordinator.runtime.launch import attach

    c = cluster
    gpu_nodes(c, 3)
    checkpoint, index, config = budgeted_job(c, tmp_path, watch_interval_s=0.5)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(8))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    launch(config, name="healing").close()  # detached: nobody attached from here on
    try:
        failing = registry.group_of(registry.load_record("healing")[1], index).handles[1]
        for loss in range(1, NODE_LOSS_LIMIT + 1):
            record = registry.load_record("healing")[1]
            worker = next(
                h for h in registry.group_of(record, index).handles if h.node_id == failing.node_id
            )
            ray.kill(worker.actor, no_restart=True)
            events = wait_events("healing", loss + (loss == NODE_LOSS_LIMIT))
        kinds = [e["event"] for e in events]
        assert kinds == ["replaced workers"] * (NODE_LOSS_LIMIT - 1) + [
            "node left out",
            "re-planned",
        ]
        assert events[-2]["hosts"] == [failing.hostname]
        record = registry.load_record("healing")[1]
        assert failing.node_id not in {s["node_id"] for s in json.loads(record["plan"])["stages"]}
        with attach("healing", address=c.address) as job:
            assert torch.equal(job.forward(ids), expected)
    finally:
        registry.forget("healing")
    wait_gpus_free(3)
    assert keeper_gone("healing")


def keeper_gone(name: str) -> bool:
    from coordinator.runtime.keeper import find

    deadline = time.monotonic() + 30
    while find(name) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_replan_never_takes_another_loads_gpu_and_waits_on_its_old_plan(
    cluster, tmp_path, monkeypatch
) -> None:
    """Three one-GPU nodes, another load's placement group on one of them, this job on the
    other two. Its node leaves: the re-plan counts only free GPUs and its own, so one GPU,
    which cannot hold the model: a PlanError, and the other load is untouched (before, it planned onto that load's
    GPU and then waited on it). A node joins, and another process takes its GPU between the
    plan and the reservation: the reservation times out, its placement group is removed, and
    the survivor is unchanged; once that GPU is free, the next forward recovers, its logits
    those of transformers."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from coordinator.runtime import recovery
    from coordinator.runtime.group import NODE_ID_LABEL

    c = cluster
    nodes = gpu_nodes(c, 3)
    free = sorted(nodes)
    checkpoint = str(make_checkpoint(tmp_path / "ckpt", SHAPE))
    index = load_index(checkpoint)
    gpu, host = budgets(index)
    # another load's GPU: its placement group, as `load` reserves it
    bystander = placement_group(
        [{"GPU": 1}], bundle_label_selector=[{NODE_ID_LABEL: free[0]}], name="load:by:pg-0"
    )
    ray.get(bystander.ready(), timeout=60)
    config = JobConfig(
        checkpoint=checkpoint,
        address=c.address,
        gpu_memory_bytes=gpu,
        host_memory_bytes=host,
        placement_timeout_s=3,
    )
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    job = launch(config)
    try:
        assert {s.node_id for s in job.plan.stages} == set(free[1:])  # the free two
        assert torch.equal(job.forward(ids), expected)
        c.remove_node(nodes[job.workers[1].node_id])
        with pytest.raises(PlanError, match=r"the 1 GPU\(s\) left cannot hold the model"):
            job.forward(ids)
        assert ray.util.placement_group_table(bystander)["state"] == "CREATED"  # untouched

        new = c.add_node(num_cpus=2, num_gpus=1)
        blocker = []
        real_decide = recovery.decide

        def decide_then_lose_the_gpu(*args, **kwargs):
            decision = real_decide(*args, **kwargs)
            assert any(s.node_id == new.node_id for s in decision.plan.stages)
            blocker.append(placement_group([{"GPU": 1}], strategy="STRICT_PACK"))
            ray.get(blocker[0].ready(), timeout=60)
            return decision

        monkeypatch.setattr(recovery, "decide", decide_then_lose_the_gpu)
        survivor = job.workers[0]
        groups = list(job.group.placement_groups)
        with pytest.raises(LaunchError, match="did not reserve 1 GPU"):
            job.forward(ids)
        assert job.workers[0] is survivor
        assert job.plan.stages[0].layers == tuple(x.name for x in survivor.spec.layers)
        assert ray.get(survivor.actor.ping.remote(), timeout=30) is not None  # still running
        assert job.group.placement_groups == groups  # the timed-out group is not kept...
        pending = [e for e in ray.util.placement_group_table().values() if e["state"] == "PENDING"]
        assert pending == []  # ...and not left waiting for a GPU
        monkeypatch.setattr(recovery, "decide", real_decide)
        remove_placement_group(blocker[0])
        wait_gpus_free(1)  # the removal is asynchronous
        assert torch.equal(job.forward(ids), expected)
        assert job.events[-1]["event"] == "re-planned"
        assert {s.node_id for s in job.plan.stages} == {survivor.node_id, new.node_id}
    finally:
        job.close()
        remove_placement_group(bystander)


def test_lost_nodes_replan_fail_with_numbers_then_recover(cluster, tmp_path, capsys) -> None:
    """With backend uva (the other test's load re-plans with prefetch): a re-plan moves layers
    between the device and the arena the UVA parameters are views of."""
    c = cluster
    nodes = gpu_nodes(c, 3)
    checkpoint, index, config = budgeted_job(c, tmp_path, "uva")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    nbytes = {layer.name: layer.file_bytes for layer in index.layers}
    address = ["--address", c.address]
    job = launch(config, name="survivor")
    try:
        assert len(job.plan.stages) == 3 and not any(s.offloaded for s in job.plan.stages)
        assert torch.equal(job.forward(ids), expected)
        before = {r.pid: r for r in job.telemetry()}
        lost_layers = set(job.plan.stages[1].layers)

        # 1. The node of the middle stage leaves: two GPUs are left, enough with offloading.
        c.remove_node(nodes[job.workers[1].node_id])
        assert torch.equal(job.forward(ids), expected)
        [event] = job.events
        assert event["event"] == "re-planned" and event["lost_stages"] == [1]
        assert len(job.plan.stages) == 2 and event["stages_on_new_workers"] == []
        after = job.telemetry()
        assert sum(r.stats.offloaded_bytes for r in after) > 0  # more offloading
        assert all(s.backend == "uva" and s.slot_bytes == 0 for s in job.plan.stages)
        assert {r.backend for r in after if r.offloaded} == {"uva"}
        assert sum(r.stats.copies + r.stats.buffer_bytes for r in after) == 0
        taken_over: set[str] = set()
        for report in after:
            old = before[report.pid]  # the same process: a survivor, reconfigured
            moved = set(report.layers) - set(old.layers)
            taken_over |= moved
            # It read exactly the layers new to it; what it held moved in memory.
            assert report.bytes_read - old.bytes_read == sum(nbytes[n] for n in moved)
        # The survivors took over the lost stage's layers (which survivor takes how many is
        # the planner's choice, with the link rates the probes measured).
        assert lost_layers <= taken_over
        assert main(["status", "survivor", "--json", *address]) == 0
        status = json.loads(capsys.readouterr().out)
        assert [e["event"] for e in status["events"]] == ["re-planned"] and status["lost"] == []
        assert len(status["nodes"]) == 2  # two Ray nodes, one hostname: a row each

        # 2. Another node leaves: one GPU cannot hold the model.
        c.remove_node(nodes[job.workers[0].node_id])
        with pytest.raises(
            PlanError,
            match=r"the 1 GPU\(s\) left cannot hold the model "
            rf"\({index.total_bytes} bytes\).*Needed",
        ):
            job.forward(ids)
        reports = job.telemetry()  # still usable: the survivor reports, the lost stage is marked
        assert [isinstance(r, telemetry.LostStage) for r in reports] == [True, False]
        assert "LOST" in telemetry.render(reports, job.events)
        assert main(["status", "survivor", "--json", *address]) == 0  # as another process would
        status = json.loads(capsys.readouterr().out)
        assert [e["event"] for e in status["events"]] == ["re-planned", "re-plan failed"]
        assert [lost["stage"] for lost in status["lost"]] == [0] and len(status["gpus"]) == 1

        # 3. A node joins: the next forward re-plans onto the survivor and a new worker.
        c.add_node(num_cpus=2, num_gpus=1)
        assert torch.equal(job.forward(ids), expected)
        assert job.events[-1]["event"] == "re-planned"
        assert len(job.events[-1]["stages_on_new_workers"]) == 1
    finally:
        job.close()  # a named load on a cluster: close() only detaches
    assert main(["status", "survivor", "--json", *address]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["lost"] == [] and len(status["gpus"]) == 2
    assert main(["unload", "survivor", *address]) == 0
    assert "2 workers released" in capsys.readouterr().out
    wait_gpus_free(2)


def test_a_replan_on_simulated_gpus_that_hold_memory_credits_the_survivors(
    cluster, tmp_path
) -> None:
    """Issue 57 points 1 and 2: simulated GPUs with a size (OFFLOAD_SIMULATED_GPU_MEMORY, set
    by a job override) report free = total - what the processes on them hold, so the budgets
    come from the probes as on real GPUs. After a node loss each survivor answers for its own
    GPU with its own stage's bytes counted as free, and a task measures the free GPUs: the
    re-plan fits, and the output is unchanged. Not credited, the survivors' GPUs would have
    collapsed to what their stages leave free, which cannot hold the model (checked on the
    planner). Host memory holds nothing here, so the GPUs must hold every layer."""
    from offload.simulated import DeviceLedger

    c = cluster
    nodes = gpu_nodes(c, 3)
    checkpoint = str(make_checkpoint(tmp_path / "ckpt", SHAPE))
    index = load_index(checkpoint)
    total = int(index.total_bytes * 0.7)  # two GPUs hold the model, one does not
    budget = int(total * GPU_BUDGET_FRACTION)  # a probe's budget: 90% of what is free
    config = JobConfig(
        checkpoint=checkpoint,
        address=c.address,
        host_memory_bytes=1,  # no --gpu-memory: the probes' free memory is the budget
        overrides=(Override(match=NodeMatch(), env={"OFFLOAD_SIMULATED_GPU_MEMORY": str(total)}),),
    )
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(11))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    snapshot, _ = probe_cluster(config)  # a task holding each node's free GPU measures it
    assert [g.memory_bytes for n in snapshot.nodes for g in n.gpus] == [budget] * 3
    with launch(config) as job:
        stages = len(job.plan.stages)  # two or three: the planner's choice
        assert stages >= 2 and not any(s.offloaded for s in job.plan.stages)
        assert torch.equal(job.forward(ids), expected)
        # Each worker wrote what it holds to its node's ledger, as the probes read it.
        held = {}
        for report in job.telemetry():
            ledger = DeviceLedger(report.node_id)
            assert ledger.holders(int(report.gpu)) == {report.pid: report.device_used_bytes}
            held[report.stage] = report.device_used_bytes
        # What a re-plan sees: each worker answers for its GPU, its own stage counted as free.
        snapshot, _ = probe_cluster(
            config,
            probers={w.node_id: [w.actor] for w in job.workers},
            own=[w.node_id for w in job.workers],
        )
        assert [g.memory_bytes for n in snapshot.nodes for g in n.gpus] == [budget] * 3
        assert not any(n.budget_note for n in snapshot.nodes)  # each GPU measured, none assumed
        # Stage 0's node leaves. Without the credit: the survivors' GPUs as their stages leave
        # them, the free GPUs whole; the model does not fit.
        survivors = [held[s] for s in range(1, stages)]
        uncredited = [int((total - h) * GPU_BUDGET_FRACTION) for h in survivors]
        uncredited += [budget] * (3 - stages)
        with pytest.raises(PlanError):
            plan(
                index.layers,
                ClusterSnapshot(
                    nodes=tuple(
                        NodeInfo(
                            node_id=f"n{i}",
                            gpus=(GpuInfo(index=0, memory_bytes=b),),
                            host_budget_bytes=1,
                        )
                        for i, b in enumerate(uncredited)
                    )
                ),
                PlanOptions(),
            )

        wait_gpus_free(3 - stages)  # the probes' GPUs back in the cluster's view of them
        c.remove_node(nodes[job.workers[0].node_id])
        assert torch.equal(job.forward(ids), expected)
        [event] = job.events
        assert event["event"] == "re-planned" and event["lost_stages"] == [0]
        assert len(job.plan.stages) == 2 and not any(s.offloaded for s in job.plan.stages)
        for report in job.telemetry():  # the ledger follows the stages of the new plan
            assert DeviceLedger(report.node_id).holders(int(report.gpu)) == {
                report.pid: report.device_used_bytes
            }


def test_a_worker_whose_load_failed_is_replaced_like_a_lost_one(cluster, tmp_path) -> None:
    """Issue 57 point 3: a worker is healthy when it is ready, not when it answers a ping. A
    worker whose load step failed (a chunk that does not exist here; on a GPU, out of memory
    or a timeout) answers, broken: the job counts it lost, replaces it in its bundle, and the
    output is the same."""
    c = cluster
    gpu_nodes(c, 3)
    checkpoint, _, config = budgeted_job(c, tmp_path)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    job = launch(config, name="mended")
    try:
        assert torch.equal(job.forward(ids), expected) and job.dead_stages() == []
        broken = job.workers[1].actor
        pid = ray.get(broken.ping.remote(), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(broken.load_chunk.remote(10_000), timeout=60)
        assert job.dead_stages() == [1]  # it answers, but it is not ready
        assert job.recover() == [1]
        assert ray.get(job.workers[1].actor.ping.remote(), timeout=60) != pid  # a new worker
        assert torch.equal(job.forward(ids), expected) and job.dead_stages() == []
        assert job.events[-1]["event"] == "replaced workers" and job.events[-1]["stages"] == [1]
    finally:
        job.close()  # a named load on a cluster: close() only detaches
        assert main(["unload", "mended", "--address", c.address]) == 0


def test_a_load_whose_recoveries_keep_failing_is_failed_then_recovers(cluster, tmp_path) -> None:
    """Issue 57 point 3: bounded retries, then the load reports failed. Another process holds
    all of stage 1's simulated GPU (as a foreign CUDA process would), so each replacement's load
    fails on memory; after three losses there its node is left out, and the GPU left cannot
    hold the model. After MAX_FAILED_RECOVERIES failures in a row the record's state is
    "failed", an event says why, and health says so; once a node joins, a recovery asked for
    succeeds and the load is loaded again, with the same output. (The replacements fail only
    because they get the job's variables for their node: a named load's group, rebuilt from its
    record, started them with none, so they ignored the job's overrides and node labels, their
    pin decisions included.)"""
    import os

    from coordinator.runtime import registry
    from coordinator.runtime.keeper import MAX_FAILED_RECOVERIES
    from offload.simulated import DeviceLedger

    c = cluster
    gpu_nodes(c, 2)
    checkpoint = str(make_checkpoint(tmp_path / "ckpt", SHAPE))
    index = load_index(checkpoint)
    total = int(index.total_bytes * 0.7)  # two GPUs hold the model, one does not
    config = JobConfig(
        checkpoint=checkpoint,
        address=c.address,
        host_memory_bytes=1,
        watch_interval_s=0,  # recoveries only when asked: the test counts them
        overrides=(Override(match=NodeMatch(), env={"OFFLOAD_SIMULATED_GPU_MEMORY": str(total)}),),
    )
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    job = launch(config, name="gives-up")
    try:
        assert len(job.plan.stages) == 2 and torch.equal(job.forward(ids), expected)
        [report] = [r for r in job.telemetry() if r.stage == 1]
        foreign = DeviceLedger(report.node_id)
        foreign.hold(int(report.gpu), total, pid=os.getpid())  # this process holds it all
        kill_actor(job.workers[1].actor)
        errors = []
        for _ in range(MAX_FAILED_RECOVERIES):
            # out of memory on the GPU held by this process, then no plan without its node
            with pytest.raises((LaunchError, PlanError)) as failure:
                job.recover()
            errors.append(str(failure.value))
        assert "other processes hold" in errors[0] and "cannot hold the model" in errors[-1]
        _, record = registry.load_record("gives-up")
        assert record["state"] == "failed"
        [failed] = [e for e in record["events"] if e["event"] == "load failed"]
        assert failed["reason"].startswith(f"{MAX_FAILED_RECOVERIES} recoveries failed in a row")
        keeper = job.keeper
        assert ray.get(keeper.health.remote(), timeout=60).startswith("load 'gives-up' failed")

        foreign.release(int(report.gpu), pid=os.getpid())
        c.add_node(num_cpus=2, num_gpus=1)
        job.recover()
        assert torch.equal(job.forward(ids), expected)
        _, record = registry.load_record("gives-up")
        assert record["state"] == "loaded" and record["events"][-1]["event"] == "re-planned"
        assert ray.get(keeper.health.remote(), timeout=60) is None
    finally:
        job.close()
        assert main(["unload", "gives-up", "--address", c.address]) == 0


def test_two_loads_launched_together_share_a_node(cluster, tmp_path, monkeypatch) -> None:
    """Issue 57 point 5: two loads launched at the same moment, each planned on 2 of one node's
    4 GPUs. The second failed: it looked while the first one's probe task held every GPU of
    the node to measure them ("every GPU of the cluster's ... is held"). Here the first load's
    probe is held mid-measure (OFFLOAD_TEST_HOLD_PROBE) while the second starts. With the
    desk's turn (`coordinator.runtime.desk`) the second probes, plans and reserves once the
    first has reserved its GPUs: both load, on the node's four GPUs, with the same logits."""
    import concurrent.futures

    from coordinator.runtime import desk

    c = cluster
    waiting = threading.Event()  # a load found the turn held by another and waits for it
    read = desk._get

    def watched(key: str):
        if key == desk.TURN_KEY and sys._getframe(1).f_code is desk.Turn.__enter__.__code__:
            waiting.set()  # read by a Turn that could not take the turn: it waits
        return read(key)

    monkeypatch.setattr(desk, "_get", watched)
    gpu_nodes(c, 2)  # the one-GPU nodes stay out of it: the loads run on `nodes`
    big = c.add_node(num_cpus=4, num_gpus=4)
    checkpoint, _, config = budgeted_job(c, tmp_path, nodes=f"{big.node_id}=2")
    measured = tmp_path / "measured"  # the first load's probe holds the GPUs until it exists
    held = dataclasses.replace(
        config,
        overrides=(Override(match=NodeMatch(), env={"OFFLOAD_TEST_HOLD_PROBE": str(measured)}),),
    )
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(13))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    jobs = []
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(launch, held)
            deadline = time.monotonic() + 60
            while ray.available_resources().get("GPU", 0) > 2:  # its probe holds the four
                assert time.monotonic() < deadline and not first.done(), first
                time.sleep(0.1)
            assert not waiting.is_set()  # the first took the turn at once
            second = pool.submit(launch, config)
            assert waiting.wait(120), "the second load never found the first's turn held"
            measured.touch()
            for future in (first, second):
                try:
                    jobs.append(future.result(timeout=300))
                except Exception as exc:  # the other's job is still closed below
                    jobs.append(exc)
        failed = [j for j in jobs if isinstance(j, BaseException)]
        assert not failed, failed
        assert [len(j.plan.stages) for j in jobs] == [2, 2]
        assert {s.node_id for j in jobs for s in j.plan.stages} == {big.node_id}
        assert ray.available_resources().get("GPU", 0) == 2  # the one-GPU nodes' only
        for job in jobs:
            assert torch.equal(job.forward(ids), expected)
    finally:
        measured.touch()
        for job in jobs:
            if not isinstance(job, BaseException):
                job.close()
        wait_gpus_free(6)
        c.remove_node(big)


def test_the_desk_gives_one_turn_at_a_time_and_reserves_host_memory(cluster) -> None:
    """A turn is held by one load at a time (a second waits, or fails after its wait naming the
    holder); the host bytes a load left reserved count against every other load's budgets on
    that node until it exits, and never against its own."""
    from ray.experimental import internal_kv

    from coordinator.runtime import desk
    from coordinator.runtime.desk import Turn, reserved_host

    with Turn("load 'a'") as a:
        with (
            pytest.raises(LaunchError, match=r"waited 0 s \(TURN_WAIT_S\) for load 'a'"),
            Turn("load 'b'", wait_s=0.3),
        ):
            pass
        a.leave([("node-1", 1000), ("node-2", 5)])
        with Turn("load 'b'", wait_s=5) as b:  # a left its turn: b gets one at once
            assert b.reserved_elsewhere() == {"node-1": 1000, "node-2": 5}
            b.leave([("node-1", 24)])
            assert a.reserved_elsewhere() == {"node-1": 24}
            assert reserved_host() == {"node-1": 1024, "node-2": 5}
        assert reserved_host() == {"node-1": 1000, "node-2": 5}
    assert reserved_host() == {}
    # A holder killed with -9 renews nothing: its turn and reservation expire, and go.
    dead = json.dumps({"holder": "load 'gone'", "until": time.time() - 1})
    internal_kv._internal_kv_put(desk.TURN_KEY, dead, namespace=desk.KV_NAMESPACE)
    gone = json.dumps({"nodes": {"node-1": 7}, "until": time.time() - 1})
    internal_kv._internal_kv_put(
        desk.RESERVATION_PREFIX + "load 'gone'", gone, namespace=desk.KV_NAMESPACE
    )
    with Turn("load 'c'", wait_s=1) as c:
        assert c.reserved_elsewhere() == {}
        c.leave([("node-1", 3)])
        [key] = internal_kv._internal_kv_list(desk.RESERVATION_PREFIX, namespace=desk.KV_NAMESPACE)

        def until() -> float:
            return json.loads(internal_kv._internal_kv_get(key, namespace=desk.KV_NAMESPACE))[
                "until"
            ]

        written, deadline = until(), time.monotonic() + 120
        while until() == written:  # the holder's next renewal pushes the lease on
            assert time.monotonic() < deadline, "the reservation was never renewed"
            time.sleep(0.1)
        assert until() > written and reserved_host() == {"node-1": 3}
    probed = {"hostname": "h", "error": None, "pin": {"pin": False}}
    from offload import NodeProbe

    probed["probe"] = NodeProbe(host_available_bytes=10_000, cpu_count=4)
    info = probed_node_info(
        JobConfig(checkpoint="c", gpu_memory_bytes=1000),
        {"NodeID": "node-1", "Resources": {"GPU": 1.0}, "Labels": {}},
        probed,
        reserved_bytes=1000,
    )
    assert info.host_budget_bytes == int(9000 * HOST_BUDGET_FRACTION)


def test_survivors_are_matched_to_the_stages_they_share_most_with() -> None:
    from coordinator.planning.planner import StagePlan

    def stage(i: int, node: str, layers: tuple[str, ...]) -> StagePlan:
        return StagePlan(
            stage=i,
            node_id=node,
            hostname="h",
            gpu_index=0,
            layers=layers,
            offloaded=(),
            prefetch_step=1,
            resident_bytes=0,
            slot_bytes=0,
            offloaded_bytes=0,
            device_bytes=0,
            pinned=False,
            compute_s=0.0,
            transfer_s=0.0,
            time_s=0.0,
        )

    sizes = {"a": 1, "b": 10, "c": 100, "d": 1000}
    survivors = [("n1", frozenset({"a", "b"})), ("n1", frozenset({"c"})), ("n2", frozenset())]
    stages = [stage(0, "n1", ("a", "b", "c")), stage(1, "n1", ("d",)), stage(2, "n3", ("d",))]
    # stage 0 goes to the survivor holding "c" (100 bytes in common, more than 11); the other
    # survivor on n1 still takes stage 1 (no process start); nobody is on n3; n2's is unused.
    assert match_survivors(survivors, stages, sizes) == {0: 1, 1: 0}


def test_a_repeated_failure_is_counted_not_listed_again() -> None:
    from coordinator.runtime.job import Job

    job = Job(group=None, session=None)
    failed = {"event": "re-plan failed", "lost_stages": [0], "error": "1 GPU(s) left ..."}
    job.record_event({"event": "re-planned", "lost_stages": [1]})
    for _ in range(3):  # a watcher retrying while the cluster stays as it is
        job.record_event(dict(failed))
    job.record_event({**failed, "error": "no GPU node is left"})
    assert [(e["event"], e.get("repeats")) for e in job.events] == [
        ("re-planned", None),
        ("re-plan failed", 3),
        ("re-plan failed", None),
    ]
