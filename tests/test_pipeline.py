"""The main job on an embedded Ray with logical GPUs: load across >= 3 stages with offloading,
logits bitwise equal to transformers in one process; failures release everything."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import ray
import torch
from helpers import assert_probe_decided_pin, kill_actor, scrape_gauges, tiny_shape, wait_gpus_free
from ray_head import free_ports, metrics_head

from coordinator.config import ConfigError, JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime import telemetry
from coordinator.runtime.errors import LaunchError
from coordinator.runtime.inputs import check_inputs
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_logits
from worker.loader import HOLD_ENV

NUM_GPUS = 3


METRICS_PORT = free_ports(1)[0]
SHAPES = {
    # sharded llama; tied-embedding qwen2 in one file
    "llama": tiny_shape(6, dtype="bfloat16", max_shard_bytes=100_000),
    "qwen2": tiny_shape(5, arch="qwen2", tie_embeddings=True, max_shard_bytes=10**8),
}


@pytest.fixture(scope="module")
def embedded_ray():
    """One Ray of this process for the module, a new one (never one another process on this
    machine runs): jobs on it leave it running (they did not start it)."""
    with metrics_head(num_gpus=NUM_GPUS, metrics_port=METRICS_PORT):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: str(make_checkpoint(root / name, shape)) for name, shape in SHAPES.items()}


def budget_forcing_offload(checkpoint: str) -> int:
    """Per-GPU bytes below a third of the model, so the GPUs together cannot hold it resident,
    yet enough for the embedding or head plus one prefetch slot."""
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    budget = index.total_bytes // NUM_GPUS - decoder // 4
    assert budget * NUM_GPUS < index.total_bytes
    return budget


def test_worker_failure_releases_every_actor(embedded_ray, checkpoints) -> None:
    config = JobConfig(
        checkpoint=checkpoints["llama"],
        gpu_memory_bytes=10**8,
        attn_implementation="no-such-attention",
        nodes=f"{ray.get_runtime_context().get_node_id()}=2",  # two workers, both fail
    )
    with pytest.raises(LaunchError, match="no-such-attention"):
        launch(config)
    wait_gpus_free(NUM_GPUS)


def test_infeasible_plan_starts_nothing(embedded_ray, checkpoints, monkeypatch) -> None:
    """...and its probes, on a node with no CUDA device, run in one process for every launch
    (a probe task's process exits after it only where it may hold a CUDA context)."""
    from coordinator.planning.planner import PlanError
    from coordinator.runtime import probing

    answered: list[int] = []
    real = probing.probed_node_info

    def seen(config, node, result, *rest):
        answered.append(result["pid"])
        assert not result["probe"].cuda_available  # the case this test is about
        return real(config, node, result, *rest)

    monkeypatch.setattr(probing, "probed_node_info", seen)
    for _ in range(3):
        with pytest.raises(PlanError, match="gpu-memory"):
            launch(JobConfig(checkpoint=checkpoints["llama"], gpu_memory_bytes=1000))
        wait_gpus_free(NUM_GPUS)  # the probe's GPUs: Ray's view of them lags its end
    assert len(answered) == 3 and len(set(answered)) == 1, answered
    wait_gpus_free(NUM_GPUS)


def llama_case(checkpoints, seed: int) -> tuple[str, JobConfig, torch.Tensor, torch.Tensor]:
    """The llama checkpoint, a job config that offloads, input ids and transformers' logits."""
    checkpoint = checkpoints["llama"]
    config = JobConfig(checkpoint=checkpoint, gpu_memory_bytes=budget_forcing_offload(checkpoint))
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(seed))
    return (
        checkpoint,
        config,
        ids,
        reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker),
    )


def test_a_worker_killed_while_loading_is_replaced_and_never_reads_a_rewritten_checkpoint(
    embedded_ray, checkpoints, tmp_path
) -> None:
    """1. A kill lands between the chunks and finish_load: launch replaces the worker, the
    others do not read again, and the logits are right. 2. The checkpoint is then rewritten in
    place (same shapes, new weights) under the running job, and a worker is lost: the recovery
    refuses the changed file by name instead of returning logits that mix old and new layers;
    the load stays releasable and releases every GPU."""
    import dataclasses
    import shutil

    from coordinator.runtime import registry

    root = shutil.copytree(checkpoints["llama"], tmp_path / "llama")
    checkpoint = str(root)
    # Two GPUs of this node, neither able to hold the model: two stages, a kill in the second
    # (the planner would spread it over all three, one more worker process to start).
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=index.total_bytes // 2 + decoder,
        nodes=f"{ray.get_runtime_context().get_node_id()}=2",
    )
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
    killed = []

    def kill_stage_1(done: int, total: int) -> None:
        if killed:  # the recovery's own load reports progress again
            return
        killed.append(done)
        actor = ray.get_actor(registry.worker_name("dying", 1), namespace=registry.NAMESPACE)
        kill_actor(actor)

    other = make_checkpoint(tmp_path / "other", dataclasses.replace(SHAPES["llama"], seed=1))
    try:
        with launch(config, progress=kill_stage_1, name="dying") as job:
            assert len(job.plan.stages) == 2
            assert [(e["event"], e["stages"]) for e in job.events] == [("replaced workers", [1])]
            reports = job.telemetry()
            for report, stage in zip(reports, job.plan.stages, strict=True):
                share = sum(x.file_bytes for x in index.layers if x.name in stage.layers)
                assert report.bytes_read == share  # nothing read twice, by anyone
            assert torch.equal(job.forward(ids), expected)

            for shard in other.glob("*.safetensors"):
                shutil.copyfile(shard, root / shard.name)
            kill_actor(job.workers[1].actor)  # dead before the forward: it must recover
            with pytest.raises(
                LaunchError,
                match=r"model-\d+-of-\d+.safetensors: the checkpoint "
                r"file changed since the job indexed it",
            ):
                job.forward(ids)
            job.refresh()  # a named load: its keeper recovered it and recorded the event
            assert "changed since the job indexed it" in job.events[-1]["error"], job.events
    finally:
        registry.forget("dying")  # a named load on a Ray it did not start: close() detaches
    wait_gpus_free(NUM_GPUS)


def held_load_config(tmp_path) -> str:
    """A job file whose workers hold their load at the first chunk until a file appears that
    no one creates (worker.loader.HOLD_ENV): a load that is certainly under way. On one GPU of
    this node (`nodes`): one worker process, where the planner would spread the model over all
    three."""
    job = tmp_path / "held.yaml"
    job.write_text(
        f"nodes: '{ray.get_runtime_context().get_node_id()}=1'\n"
        f"overrides:\n  - match: {{hostname: '*'}}\n"
        f"    env: {{{HOLD_ENV}: '{tmp_path / 'never'}'}}\n"
    )
    return str(job)


def waiting_for_chunks(thread_id: int) -> bool:
    """Whether thread `thread_id` is in `load_workers`, inside `ray.wait` (for the chunks)."""
    frame = sys._current_frames().get(thread_id)
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_name, frame.f_code.co_filename))
        frame = frame.f_back
    return (
        bool(stack)
        and stack[0][0] == "wait"
        and f"{os.sep}ray{os.sep}" in stack[0][1]
        and any(name == "load_workers" for name, _ in stack)
    )


def test_a_signal_mid_load_stops_the_command_and_releases_everything(
    embedded_ray, checkpoints, capsys, tmp_path, monkeypatch
) -> None:
    """SIGTERM while a named load's workers load (held at their first chunk, so the load cannot
    finish first), sent while the command waits on Ray for the chunks (Ray's waits let only a
    KeyboardInterrupt through at once: a SIGTERM raised as anything else waited for the whole
    load): the command ends with 143 while its workers are still held (its progress never past
    0 bytes: it did not wait for a chunk), one line after the progress bar (no traceback),
    every GPU it took is free again, and the load leaves no record, keeper or placement group
    behind. Ctrl-C mid-load, SIGINT ignored as a shell's background job inherits it:
    test_signals.py, on the command's own embedded Ray."""
    import importlib

    signum, code, word, name = signal.SIGTERM, 143, "terminated", "sigterm"
    import coordinator.cli as cli
    from coordinator.runtime import registry

    main_thread = threading.get_ident()
    sent: list[float] = []
    told: list[tuple[int, int]] = []  # the load's progress as the command heard it
    command = importlib.import_module("coordinator.cli.main")  # the module, not `main`
    bar = command._progress

    def progress(done: int, total: int) -> None:
        told.append((done, total))
        bar(done, total)

    monkeypatch.setattr(command, "_progress", progress)

    def send() -> None:
        deadline = time.monotonic() + 120
        while not waiting_for_chunks(main_thread):
            if time.monotonic() > deadline:
                return  # the command's result says what went wrong
            time.sleep(0.05)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    budget = load_index(checkpoints["llama"]).total_bytes  # one GPU holds it
    argv = [
        "load",
        "--checkpoint",
        checkpoints["llama"],
        "--gpu-memory",
        str(budget),
        "--config",
        held_load_config(tmp_path),
    ]
    assert cli.main([*argv, "--name", name]) == code
    # ended mid-load (issue 60: an order of events, not a time bound): not one chunk had come,
    # the workers held at their first until a file appears that no one creates
    assert sent and told and {done for done, _ in told} == {0}, told
    err = capsys.readouterr().err
    assert f"]\n{word}: every worker and Ray this command started was released" in err
    assert "Traceback" not in err
    wait_gpus_free(NUM_GPUS)
    assert registry.list_loads() == [] and registry.named_groups(name) == {}


class KillGate:
    """While inside: the engine's calls to its workers (`pipeline.submit`, in the engine's
    thread) that carry a row with `made` tokens or more wait until `killed` is set. A client
    that kills a worker on its row's `made`-th token and then sets `killed` kills mid-request,
    ordered by events (issue 60): from the client's thread alone, a kill could come after a
    request's last call (a burst may make all its tokens). Every request must need a call
    after its `made`-th token (more tokens than a call makes)."""

    def __init__(self, pipeline, *, made: int) -> None:
        self.pipeline, self.made = pipeline, made
        self.killed = threading.Event()
        self._submit_now = pipeline.submit

    def _submit(self, steps):
        made = max(len(s.generated) for step in steps for s in step.sequences)
        if made >= self.made:
            assert self.killed.wait(120), "the client's kill never came"
        return self._submit_now(steps)

    def __enter__(self) -> KillGate:
        self.pipeline.submit = self._submit
        return self

    def __exit__(self, *exc) -> None:
        del self.pipeline.submit  # the class's submit again


@pytest.fixture(scope="class")
def job(request, embedded_ray, checkpoints):
    """The llama job of `llama_case`, from the first to the last test of a class, on GPUs that
    stand in for GH200-class ones: the job sets OFFLOAD_SIMULATED_GPU=coherent on every node, so
    backend `auto` takes uva there as on that hardware. KV cache for three sequences of 16."""
    import dataclasses

    from coordinator.config import NodeMatch, Override

    _, config, _, _ = llama_case(checkpoints, seed=0)
    kv_total = sum(x.kv_bytes(3, 16) for x in load_index(config.checkpoint).layers)
    coherent = Override(match=NodeMatch(), env={"OFFLOAD_SIMULATED_GPU": "coherent"})
    config = dataclasses.replace(
        config,
        overrides=(coherent,),
        max_batch=3,
        max_seq_len=16,
        gpu_memory_bytes=config.gpu_memory_bytes + kv_total // 2,
    )
    request.cls.load_progress = []  # (done, total) as the launch reported them
    with launch(config, progress=lambda *told: request.cls.load_progress.append(told)) as job:
        job.export_metrics_every(0.3)  # what a test changes reaches the gauges by itself
        yield job
    with pytest.raises(RuntimeError, match="closed"):
        job.forward(torch.tensor([[1, 2]]))
    wait_gpus_free(NUM_GPUS)


class TestOneRunningJob:
    """Tests of a job that keeps running after them (its lost workers replaced), on one
    launch: workers take ~12 s to start here, most of it importing torch and transformers.
    The job holds every GPU until the last of these tests ends; the watched one is last (its
    watcher runs until the job closes)."""

    def test_the_main_job_matches_transformers(self, job, checkpoints) -> None:
        """The sharded bf16 llama over >= 3 stages that offload, loaded with progress, logits
        bitwise equal to transformers in one process (twice, and left-padded with one kept
        position), bad input refused by name, Prometheus seeing what each worker reported,
        each worker having read exactly its own tensors. This job runs uva; the prefetch
        backend end to end, bitwise in bf16: test_named_loads (`load`, then `run --check`)."""
        checkpoint = checkpoints["llama"]
        config = job.config
        assert len(job.plan.stages) >= 3
        assert any(stage.offloaded for stage in job.plan.stages)
        ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
        logits = job.forward(ids)
        again = job.forward(ids)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # row 1 left-padded
        last = job.forward(ids, mask, logits_to_keep=1)
        reports = job.export_metrics()
        expected_gauges = {str(r.stage): float(r.stats.offloaded_bytes) for r in reports}
        scraped = scrape_gauges("offload_offloaded_weight_bytes", expected_gauges, METRICS_PORT)
        # Bad input is refused in the driver, by name, and leaves the job usable.
        with pytest.raises(ValueError, match="out of the vocabulary"):
            job.forward(torch.tensor([[1, 500]]))
        with pytest.raises(ValueError, match=r"attention_mask rows \[0\] have no tokens"):
            job.forward(ids[:1], torch.zeros_like(ids[:1]))
        assert torch.equal(job.forward(ids), logits)
        expected = reference_logits(checkpoint, ids, num_threads=config.cpus_per_worker)
        # Same ops, same weights, same dtype, one thread on both sides: bitwise equal.
        assert logits.dtype == getattr(torch, load_index(checkpoint).dtype) == torch.bfloat16
        assert torch.equal(logits, expected) and torch.equal(again, expected)
        positions = check_inputs(ids, mask, 1, 128)[2]
        expected_last = reference_logits(
            checkpoint,
            ids,
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=1,
            num_threads=config.cpus_per_worker,
        )
        assert last.shape == (2, 1, 128) and torch.equal(last, expected_last)
        index = load_index(checkpoint)
        assert self.load_progress[-1] == (index.file_bytes, index.file_bytes)
        assert scraped == expected_gauges  # per stage, what the workers reported
        for report, stage in zip(reports, job.plan.stages, strict=True):
            share = sum(layer.file_bytes for layer in index.layers if layer.name in stage.layers)
            assert report.bytes_read == share  # each worker read exactly its own tensors
            assert report.offloaded == stage.offloaded
            assert report.device_used_bytes <= config.gpu_memory_bytes
            assert_probe_decided_pin(report.device, report.pin.to_dict())

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the simulated probe yields to CUDA")
    def test_auto_on_coherent_nodes_is_uva_end_to_end(self, job, checkpoints) -> None:
        """The plan knows each stage's backend (uva: no prefetch slots), the workers run it
        (parameters read in place, no copies), the reports and the table say so, and the
        logits and greedy tokens equal transformers'."""
        from coordinator.tools.reference import reference_generate

        checkpoint, _, ids, expected = llama_case(checkpoints, seed=8)
        stages = job.plan.stages
        assert [s.backend for s in stages] == ["uva"] * 3 and any(s.offloaded for s in stages)
        assert all(s.slot_bytes == 0 and s.prefetch_step == 0 for s in stages)
        assert torch.equal(job.forward(ids), expected)
        reports = job.telemetry()
        for report, stage in zip(reports, stages, strict=True):
            assert report.backend == "uva" and "simulated coherent" in report.backend_reason
            assert report.stats.buffer_bytes == report.stats.copies == 0
            assert report.stats.offloaded_bytes == stage.offloaded_bytes
            # the arena is host memory; the planned KV slots are allocated at load
            assert report.kv_cache_bytes == stage.kv_bytes > 0
            assert report.device_used_bytes == stage.resident_bytes + stage.kv_bytes
        assert " uva " in telemetry.render(reports)
        prompt = ids[:, :4]
        want = reference_generate(
            checkpoint,
            prompt,
            attention_mask=torch.ones_like(prompt),
            num_threads=1,
            max_new_tokens=8,
            do_sample=False,
        )
        got = job.generate(prompt, torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
        assert torch.equal(got, want)

    def test_a_job_never_plans_on_gpus_another_job_holds(self, job, checkpoints) -> None:
        """A job on a cluster whose 3 GPUs another job holds plans on none of them: it fails at
        once, saying who holds them, starts nothing and leaves the first job as it was (a
        reservation that times out is tested in test_recovery)."""
        import dataclasses

        from ray.util import placement_group_table

        _, config, ids, expected = llama_case(checkpoints, seed=6)
        blocked = dataclasses.replace(config, placement_timeout_s=3.0)
        with pytest.raises(
            LaunchError,
            match=r"every GPU of the cluster's 3 is held by other loads or jobs \(held by: "
            r"unnamed jobs \(3\)\)",
        ):
            launch(blocked)
        states = [g["state"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
        assert states == ["CREATED"]  # the first job's; the second's was removed
        assert torch.equal(job.forward(ids), expected)

    def test_a_killed_worker_is_replaced_and_only_its_stage_reloaded(
        self, job, checkpoints
    ) -> None:
        checkpoint, _, ids, expected = llama_case(checkpoints, seed=3)
        events_before = len(job.events)
        assert torch.equal(job.forward(ids), expected)
        before = {r.stage: r.pid for r in job.telemetry()}
        ray.kill(job.workers[1].actor, no_restart=True)  # asynchronous: wait until it is gone
        deadline = time.monotonic() + 30
        while job.dead_stages() != [1]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        lost = job.telemetry()  # the other stages still report; the lost one is marked
        assert [isinstance(r, telemetry.LostStage) for r in lost] == [False, True, False]
        assert "stage 1 " in telemetry.render(lost) and "LOST" in telemetry.render(lost)
        assert torch.equal(job.forward(ids), expected)  # recovered inside forward
        after = {r.stage: r for r in job.telemetry()}
        assert [e["stages"] for e in job.events[events_before:]] == [[1]]
        assert after[1].pid != before[1] and after[0].pid == before[0]
        assert after[2].pid == before[2]
        share = sum(
            layer.file_bytes
            for layer in load_index(checkpoint).layers
            if layer.name in job.plan.stages[1].layers
        )
        assert after[1].bytes_read == share  # the replacement read its own stage only
        assert job.dead_stages() == []
        assert "replaced workers" in telemetry.render(list(after.values()), job.events)
        # no export call: the fixture's periodic one publishes the count this test changed
        events = {"replaced workers": float(len(job.events))}
        assert scrape_gauges("offload_recovery_events", events, METRICS_PORT, tag="event") == events

    def test_generate_equals_transformers_and_survives_lost_workers(self, job, checkpoints) -> None:
        """Generation through the Ray pipeline (bf16 llama, stages offloading): each row of a
        left-padded batch gets the greedy tokens transformers' `generate` gives for the same
        padded rows (in bf16 the padding may change a rounding; see `greedy_of`); killing a
        worker mid-request recovers the job and the request goes on from the tokens made so
        far; several requests at once share the steps, and all of them survive a lost worker.
        On this class's job (uva): a launch of its own cost ~30 CPU-s of worker processes.
        The kills land mid-request, ordered by events (`KillGate`)."""
        from coordinator.tools.reference import reference_generate

        checkpoint = checkpoints["llama"]
        index = load_index(checkpoint)
        max_batch, max_seq_len = job.config.max_batch, job.config.max_seq_len
        events_before = len(job.events)
        ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(9))
        mask = torch.ones_like(ids)
        ids[0, :2], mask[0, :2] = 0, 0

        def greedy_of(rows: torch.Tensor, rows_mask: torch.Tensor, new: int) -> list[list[int]]:
            """transformers' greedy tokens for exactly these rows, their padding included: in
            bf16 a left-padded row may round differently from its prompt without the padding
            (seen on an AVX2 host without AVX-512: token 10 of row 0), and the job was given the
            padded rows."""
            out = reference_generate(
                checkpoint,
                rows,
                attention_mask=rows_mask,
                pad_token_id=0,
                num_threads=1,
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
            )
            return out[:, rows.shape[1] :].tolist()

        expected = greedy_of(ids, mask, 10)
        # the pool holds the 3 sequences at the expected length (one block each, which is
        # max_seq_len here), the weights offloaded to make room: planned, not found
        pool = job.config.kv_cache_tokens
        assert pool == max_batch * max_seq_len
        planned = sum(x.pool_bytes(max_batch, pool) for x in index.layers)
        assert sum(s.kv_bytes for s in job.plan.stages) == planned > 0
        assert any(s.offloaded for s in job.plan.stages)
        out = job.generate(ids, mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert torch.equal(out[:, :6], ids) and out[:, 6:].tolist() == expected
        with pytest.raises(
            ValueError,
            match=r"17 tokens per sequence \(prompt \+ max_new_tokens\) "
            r"exceed",
        ):
            job.generate(ids, mask, max_new_tokens=11)
        with pytest.raises(
            ValueError,
            match=r"4 sequence\(s\) exceed the KV cache reserved "
            r"for max_batch=3: send fewer",
        ):
            job.generate(torch.cat([ids, ids]), torch.cat([mask, mask]), max_new_tokens=2)
        pipeline = job.engine().local.pipeline
        assert pipeline.max_burst <= 8  # a call makes at most 8 of a request's 10 tokens
        streamed: list[tuple[int, int]] = []
        during: list[list[telemetry.Report]] = []
        gate = KillGate(pipeline, made=2)

        def kill_after_two(row: int, token: int) -> None:
            streamed.append((row, token))
            if len(streamed) == 2:  # mid-request: its last call waits for the kill below
                during.append(job.telemetry())
            if len(streamed) == 4:  # two tokens each: the request must recover
                kill_actor(job.workers[1].actor)
                gate.killed.set()

        with gate:
            out = job.generate(
                ids,
                mask,
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                on_token=kill_after_two,
            )
        assert [e["event"] for e in job.events[events_before:]] == ["replaced workers"]
        assert out[:, 6:].tolist() == expected
        assert [[t for r, t in streamed if r == row] for row in range(2)] == expected
        # Mid-request, the stages with decoder layers held KV slots of their own layers only.
        [reports] = during
        for report, stage in zip(reports, job.plan.stages, strict=True):
            holds_decoders = any(n.startswith("layers.") for n in stage.layers)
            assert (report.kv_cache_bytes > 0) == holds_decoders
            assert report.kv_cache_bytes <= stage.kv_bytes
        # Three requests at once share the steps (micro-batches, one per stage): each gets
        # what transformers gives that request's rows alone.
        from concurrent.futures import ThreadPoolExecutor

        rows = [(ids[i : i + 1, 2 * i :], mask[i : i + 1, 2 * i :]) for i in range(2)] * 2
        expected_rows = [greedy_of(r, m, 10)[0] for r, m in rows[:3]]

        def request(row, on_token=None) -> list[int]:
            out = job.generate(
                *row, max_new_tokens=10, do_sample=False, eos_token_id=None, on_token=on_token
            )
            return out[0, row[0].shape[1] :].tolist()

        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(request, rows[:3]))
        assert outs == expected_rows
        # ...and a worker lost while they run: every one of them is recovered, none is lost.
        gate = KillGate(job.engine().local.pipeline, made=1)

        def kill_once(row: int, token: int) -> None:
            if not gate.killed.is_set():
                kill_actor(job.workers[0].actor)  # dead before these requests end
                gate.killed.set()

        with gate, ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda r: request(r, kill_once), rows[:3]))
        assert outs == expected_rows
        assert [e["event"] for e in job.events[events_before:]] == ["replaced workers"] * 2
        assert len(job.engine().local.scheduler.free_slots) == max_batch  # every slot back

    def test_a_watched_job_recovers_before_the_next_forward(self, job, checkpoints) -> None:
        _, _, ids, expected = llama_case(checkpoints, seed=5)
        events_before = len(job.events)
        job.watch(0.3)
        ray.kill(job.workers[2].actor, no_restart=True)
        deadline = time.monotonic() + 60
        while len(job.events) == events_before:  # no forward runs: the watcher notices
            assert time.monotonic() < deadline, "the watcher did not recover the lost stage"
            time.sleep(0.2)
        events = [(e["event"], e["stages"]) for e in job.events[events_before:]]
        assert events == [("replaced workers", [2])]
        assert torch.equal(job.forward(ids), expected)
        assert len(job.events) == events_before + 1  # the forward found every stage alive


def test_micro_batches_on_every_stage_burst_actor_to_actor(embedded_ray, checkpoints) -> None:
    """Nothing offloaded, two stages (two GPUs of this node, `nodes`: a third worker process
    would add ~6 CPU-s and nothing to check): one micro-batch per stage. Six requests at once:
    each gets transformers' greedy tokens for its prompt alone, and once they all decode,
    their steps run as bursts the first stage drives through the others (fewer driver calls
    than steps)."""
    from concurrent.futures import ThreadPoolExecutor

    from coordinator.tools.reference import reference_generate

    checkpoint = checkpoints["qwen2"]
    index = load_index(checkpoint)
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=index.total_bytes,
        max_batch=6,
        max_seq_len=24,
        batch_wait_s=0.02,  # the 6 concurrent requests start together: one prefill
        nodes=f"{ray.get_runtime_context().get_node_id()}=2",
    )
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 128, (1, 3 + i), generator=g) for i in range(6)]
    expected = [
        reference_generate(
            checkpoint, p, num_threads=1, max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, p.shape[1] :].tolist()
        for p in prompts
    ]
    with launch(config) as job, ThreadPoolExecutor(6) as pool:
        assert len(job.plan.stages) == 2 and not any(s.offloaded for s in job.plan.stages)
        assert len(job.engine().local.scheduler.groups) == 2
        assert job.engine().local.config.batch_wait_s == 0.02
        outs = list(
            pool.map(
                lambda p: job.generate(p, max_new_tokens=12, do_sample=False, eos_token_id=None),
                prompts,
            )
        )
        assert [o[0, p.shape[1] :].tolist() for o, p in zip(outs, prompts, strict=True)] == expected
        forwards = [r.forwards for r in job.telemetry()]
        stats = job.engine().local.stats
        assert stats.steps >= 6 * 12 / 6  # every token, in steps of up to 6 rows
        assert min(forwards) >= stats.steps  # one forward per stage per step read
        assert stats.calls < stats.steps / 2  # bursts: the driver is off the per-token path
    wait_gpus_free(NUM_GPUS)


def test_a_rebalance_mid_generation_grows_the_pool_and_every_text_equals_transformers(
    embedded_ray, checkpoints
) -> None:
    """Issue 59 points 2 and 5: a one-stage load whose pool holds one sequence of max_seq_len,
    three requests of 20 tokens at once (so they wait, or are preempted, for blocks). At the
    engine's third submit, with sequences running (checked there, in the engine's thread: an
    order by events, not by time), the load re-balances for the lengths of such requests: the
    stage keeps its layers, offloads more and takes a pool for all three. Every text equals
    transformers' on its prompt alone, nothing is dropped, and the engine runs on the new
    pool's blocks."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from coordinator.planning.pool import Lengths
    from coordinator.tools.reference import reference_generate

    checkpoint = checkpoints["qwen2"]
    index = load_index(checkpoint)
    max_seq_len, new = 32, 20
    one = sum(x.kv_bytes(1, max_seq_len) for x in index.layers)
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=index.total_bytes + one + 4096,  # everything and one sequence
        max_batch=3,
        max_seq_len=max_seq_len,
        kv_cache_tokens=max_seq_len,
        nodes=f"{ray.get_runtime_context().get_node_id()}=1",
    )
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 128, (1, 4 + i), generator=g) for i in range(3)]
    expected = [
        reference_generate(
            checkpoint, p, num_threads=1, max_new_tokens=new, do_sample=False, eos_token_id=None
        )[0, p.shape[1] :].tolist()
        for p in prompts
    ]
    events: list[dict] = []
    running_then: list[int] = []
    with launch(config) as job, ThreadPoolExecutor(3) as pool:
        assert len(job.plan.stages) == 1 and not job.plan.stages[0].offloaded
        gate, submits = job.passes, []

        @contextlib.contextmanager
        def passes():  # the engine's gate, entered in its thread at every submit
            submits.append(1)
            if len(submits) == 3:
                engine = job.engine().local
                running_then.append(len(engine.scheduler.running))
                events.append(job.rebalance(Lengths(((6, new),) * 8)))
            with gate() as epoch:
                yield epoch

        job.passes = passes  # before the engine is made (at the first request)

        def request(i: int) -> list[int]:
            out = job.generate(prompts[i], max_new_tokens=new, do_sample=False, eos_token_id=None)
            return out[0, prompts[i].shape[1] :].tolist()

        outs = list(pool.map(request, range(3)))
        assert outs == expected
        [event] = events
        assert running_then[0] >= 1  # sequences were running: a re-balance mid-generation
        assert event["event"] == "re-balanced", event
        assert event["kv_pool_tokens"][0] == max_seq_len < event["kv_pool_tokens"][1]
        assert job.config.kv_cache_tokens == event["kv_pool_tokens"][1]
        assert job.plan.stages[0].offloaded  # the weights made room for the pool
        engine = job.engine().local
        assert engine.scheduler.num_blocks == job.config.kv_blocks() > 2  # 2: one sequence
        assert engine.stats.restarts == 1 and engine.stats.num_blocks == job.config.kv_blocks()
        assert 'offload:kv_pool_rebalances_total{model_name="m"} 1' in engine.stats.prometheus("m")
        assert job.events[-1]["event"] == "re-balanced"
        assert len(engine.stats.observed_lengths()) == 3  # the lengths it learned
        # for them, the pool it has is the best: kept
        kept = job.rebalance()
        assert kept["event"] == "kept the KV pool", kept
        assert list(pool.map(request, range(3))) == expected  # and the new pool serves
    wait_gpus_free(NUM_GPUS)


def test_offloadctl_generate_streams_the_greedy_text(
    embedded_ray, checkpoints, capsys, tmp_path
) -> None:
    """Text in, text out: the checkpoint's tokenizer, the text streamed to stdout equal to
    transformers' greedy generate decoded the same way, time to first token and tokens/s on
    stderr; a checkpoint without a tokenizer is refused before anything is loaded."""
    import dataclasses

    from transformers import AutoTokenizer

    from coordinator.cli import main
    from coordinator.tools.reference import reference_generate

    checkpoint = checkpoints["llama"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "the cat sat"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = reference_generate(checkpoint, ids, num_threads=1, max_new_tokens=8, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    # one GPU holds the model and the request's KV cache, and the job file gives it one GPU:
    # one worker process (the stages' generation is test_generate_through_ray's; this is the
    # command's text in and out)
    budget = load_index(checkpoint).total_bytes + 64 * 1024
    one_gpu = tmp_path / "one-gpu.yaml"
    one_gpu.write_text(f"nodes: '{ray.get_runtime_context().get_node_id()}=1'\n")
    assert (
        main(
            [
                "generate",
                "--config",
                str(one_gpu),
                "--checkpoint",
                checkpoint,
                "--gpu-memory",
                str(budget),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out == tokenizer.decode(new, skip_special_tokens=True) + "\n"
    assert "first after" in captured.err and "tokens/s" in captured.err
    bare = make_checkpoint(tmp_path / "bare", dataclasses.replace(SHAPES["qwen2"], tokenizer=False))
    assert (
        main(["generate", "--checkpoint", str(bare), "--gpu-memory", "1MiB", "--prompt", "hi"]) == 2
    )
    assert "has no tokenizer" in capsys.readouterr().err
    wait_gpus_free(NUM_GPUS)


def test_replicas_each_on_their_own_gpu_and_a_lost_worker_stays_in_its_replica(
    embedded_ray, checkpoints, tmp_path
) -> None:
    """Two replicas (throughput), one GPU each, loaded at once: two named loads, each planned
    on its own GPU (`nodes`) with the plan the replica search made, each generating
    transformers' greedy tokens, their loading told as one progress; a worker lost in one
    replica is replaced there, and the other never notices (a third replica added a worker, a
    keeper and a record, ~9 CPU-s, and nothing to check). A launch whose second name is taken,
    or whose second replica fails while the first loads, leaves nothing of its own."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    import coordinator.runtime.launch as launching
    from coordinator.config import NodeMatch, Override
    from coordinator.runtime import registry
    from coordinator.runtime.launch import launch_replicas
    from coordinator.tools.reference import reference_generate

    checkpoint = checkpoints["llama"]
    index = load_index(checkpoint)
    node = ray.get_runtime_context().get_node_id()
    config = JobConfig(
        checkpoint=checkpoint,
        max_batch=2,
        max_seq_len=16,
        objective="throughput",
        replicas=2,
        nodes=f"{node}=2",  # two GPUs of this node
        gpu_memory_bytes=index.total_bytes * 2,
    )
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    expected = reference_generate(
        checkpoint, ids, num_threads=1, max_new_tokens=8, do_sample=False, eos_token_id=None
    )
    told: list[tuple[int, int]] = []
    jobs = launch_replicas(config, "rep", progress=lambda done, total: told.append((done, total)))
    try:
        assert [j.name for j in jobs] == ["rep-0", "rep-1"]
        # one bar for the two: its total never changes, and it ends full
        assert len({total for _, total in told}) == 1 and told[-1][0] == told[-1][1] > 0, told
        assert [done for done, _ in told] == sorted(done for done, _ in told), told
        assert {j.config.nodes for j in jobs} == {f"{node}=1"} and len(
            {s.gpu_index for j in jobs for s in j.plan.stages}
        ) == 2
        assert all(j.plan.options.objective == "throughput" for j in jobs)

        def run(i: int) -> torch.Tensor:
            if i == 0:
                # Lost before its request, which must then recover it: a kill at the first
                # streamed token came too late when the one stage had already made every token
                # in one burst (seen: no recovery, no event). Mid-request kills: the class above.
                kill_actor(jobs[0].workers[0].actor)
            return jobs[i].generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(run, range(2)))
        assert all(torch.equal(out, expected) for out in outs)
        # each load's engine runs in its keeper, which recovered it: its record has the events
        events = [registry.load_record(j.name)[1]["events"] for j in jobs]
        assert [[e["event"] for e in load] for load in events] == [["replaced workers"], []]
    finally:
        for job in reversed(jobs):
            registry.forget(job.name)
            job.close()
    wait_gpus_free(NUM_GPUS)

    def holdings() -> tuple[list[str], set[str]]:
        table = ray.util.placement_group_table().values()
        return registry.list_loads(), {g["name"] for g in table if g["state"] != "REMOVED"}

    def settles_to(expected, timeout_s: float = 30.0) -> bool:  # kills and removals are async
        deadline = time.monotonic() + timeout_s
        while holdings() != expected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    before = holdings()
    taken = registry.claim("clash-1")  # another load's name: the launch fails before any GPU
    try:
        with pytest.raises(ConfigError, match="'clash-1' already exists"):
            launch_replicas(config, "clash")
        # the other's, untouched; nothing of this launch's own
        assert settles_to((sorted([*before[0], "clash-1"]), before[1])), holdings()
    finally:
        registry.release(taken)
    real_start = launching._start
    # The first replica's workers hold their load at the first chunk until file `released`
    # appears (worker.loader.HOLD_ENV, at most 60 s), and the second fails once the first has
    # asked for its chunks: it fails while the first loads, ordered by events (issue 60). The
    # failure stops the first where it is held: it never loads all its bytes (it did, after
    # the hold's 60 s, when the failures were read in the replicas' order).
    released = tmp_path / "released"
    hold = Override(match=NodeMatch(), env={HOLD_ENV: str(released)})
    held = dataclasses.replace(config, overrides=(hold,))
    loading = threading.Event()
    first_told: list[tuple[int, int]] = []

    def second_fails(replica, index, plan, envs, session, load, progress, *rest):
        if load.endswith("-1"):
            assert loading.wait(120), "the first replica never started to load"
            raise LaunchError(f"{load}: failed on purpose")

        def told(done: int, total: int) -> None:  # the chunks are asked for (and held)
            first_told.append((done, total))
            loading.set()
            if progress is not None:
                progress(done, total)

        return real_start(replica, index, plan, envs, session, load, told, *rest)

    launching._start = second_fails
    try:
        with pytest.raises(LaunchError, match="fail-1: failed on purpose"):
            # two replicas on two of the GPUs: one loading while the other fails
            launch_replicas(held, "fail")
    finally:
        launching._start = real_start
        released.touch()  # nothing is held any more, whatever happened
    assert first_told and all(done < total for done, total in first_told), first_told
    assert settles_to(before), holdings()  # no load, record or placement group of any replica
    wait_gpus_free(NUM_GPUS)


@ray.remote(num_cpus=0)
class _StuckRing:
    """A first stage whose burst streams one step, then hangs (a stuck stage) until file
    `release` exists, at most `max_s` (a read that waits for it fails instead of hanging)."""

    def ring(self, release: str, max_s: float):
        from worker.wire import pack

        yield [(0, pack(torch.tensor([7, 8])))]
        deadline = time.monotonic() + max_s
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield [(0, pack(torch.tensor([9, 9])))]


def test_a_burst_whose_stage_hangs_ends_at_its_bound(embedded_ray, tmp_path) -> None:
    """The engine reads a burst through Ray with every wait bounded: a stage that stops
    streaming mid-burst ends the read at the bound with an error naming it, never holding
    the engine's only thread. The stage streams nothing more until a file appears that no one
    creates (an order of events, issue 60: not a stage that sleeps longer than the read may
    take)."""
    from coordinator.engine.ray_pipeline import BurstHandle

    stuck = _StuckRing.remote()
    try:
        never = str(tmp_path / "never")
        stream = stuck.ring.options(num_returns="streaming").remote(never, 120.0)
        burst = BurstHandle(stream, through=False)
        # the first step, however long the actor takes to start on a busy machine
        m, tokens = next(burst.results(timeout_s=120.0))
        assert m == 0 and tokens.tolist() == [7, 8]
        with pytest.raises(TimeoutError, match=r"next step did not come within 1 s"):
            next(burst.results(timeout_s=1.0))
    finally:
        ray.kill(stuck)


def test_a_ray_worker_of_ours_imports_with_the_gc_held_off_then_settles(embedded_ray) -> None:
    """worker.startup's test of a Ray worker process (the raylet's default_worker.py and its
    RAY_RAYLET_PID) holds in a real one: a fresh process (its own runtime_env) raises the
    thresholds when it imports `coordinator` (as a keeper or a probe does) and settles back."""
    import gc_state
    from ray import cloudpickle

    from worker.startup import DEFAULT_THRESHOLDS, IMPORT_THRESHOLDS

    cloudpickle.register_pickle_by_value(gc_state)  # tests/ is not on the workers' path

    fresh = {"env_vars": {"OFFLOAD_TEST_FRESH_PROCESS": str(time.monotonic_ns())}}
    task = ray.remote(num_cpus=0)(gc_state.thresholds_around).options(runtime_env=fresh)
    imported, settled = ray.get(task.remote("coordinator"), timeout=120)
    assert (tuple(imported), tuple(settled)) == (IMPORT_THRESHOLDS, DEFAULT_THRESHOLDS)


@ray.remote(num_cpus=0)
class _Stage:
    """A stand-in stage: answers pings, hangs in `hang`, or passes on what it is given."""

    def ping(self) -> int:
        return os.getpid()

    def hang(self, seconds: float) -> int:
        time.sleep(seconds)
        return 1

    def after(self, upstream: int) -> int:
        return upstream


def test_kill_hung_kills_the_hung_stage_not_the_one_waiting_on_it(embedded_ray) -> None:
    """Stage 1 hangs; stage 2's call waits on its output, so stage 2 does not answer a ping
    either (its calls run in order): only stage 1 is killed, and stage 2 answers once its
    wait fails with it."""
    from types import SimpleNamespace

    from coordinator.runtime.group import WorkerGroup

    stages = [_Stage.remote() for _ in range(3)]
    try:
        pids = ray.get([s.ping.remote() for s in stages], timeout=120)
        stages[2].after.remote(stages[1].hang.remote(600))
        group = SimpleNamespace(
            handles=[
                SimpleNamespace(actor=a, spec=SimpleNamespace(stage=i))
                for i, a in enumerate(stages)
            ]
        )
        assert WorkerGroup.kill_hung(group, timeout_s=3.0) == [1]
        assert ray.get(stages[0].ping.remote(), timeout=60) == pids[0]
        assert ray.get(stages[2].ping.remote(), timeout=60) == pids[2]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(stages[1].ping.remote(), timeout=60)
    finally:
        for stage in stages:
            ray.kill(stage)


def test_a_hung_worker_is_replaced_and_its_request_goes_on(
    embedded_ray, checkpoints, tmp_path
) -> None:
    """A worker that hangs mid-generation (worker.loader.HANG_ENV names its process): the step
    times out at forward_timeout_s, the worker that does not answer is killed and replaced as
    a lost one, and the request goes on to transformers' greedy tokens."""
    from coordinator.config import NodeMatch, Override
    from coordinator.tools.reference import reference_generate
    from worker.loader import HANG_ENV

    checkpoint = checkpoints["llama"]
    hang_file = tmp_path / "hang-pid"
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=10**8,
        nodes=f"{ray.get_runtime_context().get_node_id()}=1",
        overrides=(Override(match=NodeMatch(), env={HANG_ENV: str(hang_file)}),),
        max_batch=2,
        max_seq_len=16,
        forward_timeout_s=15.0,
    )
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    expected = reference_generate(
        checkpoint, ids, num_threads=1, max_new_tokens=6, do_sample=False, eos_token_id=None
    )
    with launch(config) as job:
        pid = ray.get(job.workers[0].actor.ping.remote(), timeout=60)
        hang_file.write_text(str(pid))
        out = job.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert torch.equal(out, expected)
        assert [e["event"] for e in job.events] == ["replaced workers"]
        assert ray.get(job.workers[0].actor.ping.remote(), timeout=60) != pid
        assert job.engine().local.stats.restarts == 1
    wait_gpus_free(NUM_GPUS)
