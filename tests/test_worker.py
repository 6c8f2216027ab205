"""The stage worker driven in-process (no Ray): it reads exactly its share, reports counters
since the previous snapshot, and refuses a stage that exceeds its simulated GPU budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from worker.spec import StageSpec
from worker.worker import StageWorker, WorkerError

TINY = dict(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=64)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("w") / "ckpt",
        CheckpointShape(num_layers=4, **TINY),
    )
    return load_index(path)


def spec_for(index, *, offloaded: tuple[str, ...]) -> StageSpec:
    return StageSpec(
        stage=0,
        num_stages=1,
        checkpoint_dir=str(index.root),
        config=index.config,
        layers=index.layers,
        offloaded=offloaded,
        prefetch_step=1,
    )


def test_snapshots_report_counters_since_the_last_one(index) -> None:
    worker = StageWorker(spec_for(index, offloaded=("layers.1", "layers.3")), device="cpu")
    try:
        first = worker.load()
        assert first.bytes_read == index.file_bytes
        ids = torch.randint(0, 64, (1, 5))
        worker.forward(ids)
        worker.forward(ids)
        report = worker.report()
        # one slot, two offloaded layers: each forward reloads both
        assert report.since_last.copies == 4
        assert report.stats.copies == first.stats.copies + 4
        assert worker.report().since_last.copies == 0
        assert report.forwards == 2 and report.init_s > 0
    finally:
        worker.close()


def test_budget_overrun_is_refused_with_numbers(index) -> None:
    worker = StageWorker(spec_for(index, offloaded=()), device="cpu", gpu_memory_bytes=1000)
    try:
        with pytest.raises(WorkerError, match=r"over its budget of 1000.*--gpu-memory"):
            worker.load()
    finally:
        worker.close()


def test_the_planned_kv_pool_is_allocated_at_load_inside_the_budget(index) -> None:
    """The KV pool the plan reserved (blocks for a pool of tokens) is allocated when the stage
    loads, exactly the bytes the index reserves for it, and counted in the budget check: a
    budget that holds the weights but not the KV fails the load with the numbers, never the
    first request."""
    import dataclasses

    slots, pool_tokens = 3, 80  # 5 blocks of 16
    planned = sum(layer.pool_bytes(slots, pool_tokens) for layer in index.layers)
    spec = dataclasses.replace(spec_for(index, offloaded=()), kv_slots=slots, kv_blocks=5)
    worker = StageWorker(spec, device="cpu")
    try:
        report = worker.load()
        assert report.kv_cache_bytes == planned > 0
        weights = report.device_used_bytes - planned
    finally:
        worker.close()
    tight = StageWorker(spec, device="cpu", gpu_memory_bytes=weights + planned // 2)
    try:
        with pytest.raises(WorkerError, match=rf"of which KV cache {planned}.*--max-batch"):
            tight.load()
    finally:
        tight.close()


def stage_spec(index, names: list[str], offloaded: tuple[str, ...] = ()) -> StageSpec:
    layers = tuple(layer for layer in index.layers if layer.name in names)
    return StageSpec(
        stage=0,
        num_stages=1,
        checkpoint_dir=str(index.root),
        config=index.config,
        layers=layers,
        offloaded=offloaded,
        prefetch_step=1,
    )


def nbytes(index, names) -> int:
    return sum(layer.file_bytes for layer in index.layers if layer.name in names)


def test_reconfigure_reads_only_the_layers_it_did_not_hold(index, monkeypatch) -> None:
    """A re-plan grows a stage and changes what it offloads: the layers it held move in memory
    (resident -> arena, arena -> device, resident kept as is), only new ones come from disk,
    and the logits equal transformers' own. The old stage's prefetch slots are freed before
    the new stage allocates anything (a survivor never needs both)."""
    import worker.worker as worker_module
    from coordinator.tools.reference import reference_logits

    slots_when_built = []
    create = worker_module.create_offloader

    def create_after_checking(*args, **kwargs):
        if worker._placement is not None:  # a rebuild: what the old stage still holds
            slots_when_built.append(worker._placement.offloader.stats().buffer_bytes)
        return create(*args, **kwargs)

    monkeypatch.setattr(worker_module, "create_offloader", create_after_checking)

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    expected = reference_logits(str(index.root), ids)
    first = ["embed", "layers.0", "layers.1", "layers.2"]
    worker = StageWorker(stage_spec(index, first, offloaded=("layers.1",)), device="cpu")
    try:
        worker.load()
        worker.forward(ids)
        assert worker.report().stats.copies > 0  # the snapshot counts them from here
        embed_ptr = worker.stage.model.get_input_embeddings().weight.data_ptr()
        everything = [layer.name for layer in index.layers]
        # layers.0: resident -> offloaded, layers.1: offloaded -> resident, embed: kept resident
        chunks = worker.reconfigure(
            stage_spec(index, everything, offloaded=("layers.0", "layers.3"))
        )
        assert sum(chunks.values()) == nbytes(index, ["layers.3", "head"])
        for chunk in chunks:
            worker.load_chunk(chunk)
        report = worker.finish_load()
        assert report.bytes_read == nbytes(index, everything)  # every byte read exactly once
        # A new offloader counts from zero, and so do the rates of the next snapshot.
        assert report.since_last.copies == report.stats.copies >= 0
        assert (
            worker.stage.model.get_input_embeddings().weight.data_ptr() == embed_ptr
        )  # adopted, not copied
        assert report.offloaded == ("layers.0", "layers.3")
        assert torch.equal(worker.forward(ids), expected)
        assert slots_when_built == [0]  # the old slot was gone before the new stage was built
        # Shrinking to a suffix reads nothing: every layer it keeps is already here.
        assert worker.reconfigure(stage_spec(index, everything, offloaded=("layers.2",))) == {}
        assert worker.finish_load().bytes_read == nbytes(index, everything)
        assert torch.equal(worker.forward(ids), expected)
    finally:
        worker.close()


def test_an_interrupted_load_resumes_where_it_stopped(index, monkeypatch) -> None:
    import worker.worker as worker_module

    monkeypatch.setattr(worker_module, "LOAD_CHUNK_BYTES", 1)  # one layer per chunk
    worker = StageWorker(spec_for(index, offloaded=("layers.2",)), device="cpu")
    try:
        chunks = worker.prepare()
        assert len(chunks) == len(index.layers)
        worker.load_chunk(0)
        worker.load_chunk(1)
        with pytest.raises(WorkerError, match=r"chunks \[2, 3, 4, 5\] were read"):
            worker.finish_load()
        assert sorted(worker.prepare()) == [2, 3, 4, 5]  # what is left, nothing rebuilt
        assert worker.load_chunk(1) == 0  # read already
        for chunk in worker.prepare():
            worker.load_chunk(chunk)
        assert worker.finish_load().bytes_read == index.file_bytes
        assert worker.prepare() == {}
    finally:
        worker.close()


def test_periodic_snapshots_add_up_to_the_counters(index) -> None:
    """The snapshot thread's `since_last` deltas and an on-request report's share one baseline:
    together they add up to the cumulative counters, nothing counted twice or lost."""
    import time

    worker = StageWorker(
        spec_for(index, offloaded=("layers.0", "layers.2")), device="cpu", snapshot_interval_s=0.05
    )
    try:
        first = worker.load()
        ids = torch.randint(0, 64, (1, 4))
        deadline = time.monotonic() + 30
        while len(worker.history(since=first.time)) < 3:
            worker.forward(ids)
            time.sleep(0.03)
            assert time.monotonic() < deadline, "no periodic snapshots"
        final = worker.report()
        periodic = [s for s in worker.history(since=first.time) if s.time <= final.time]
        copies = sum(s.since_last.copies for s in periodic) + final.since_last.copies
        assert copies == final.stats.copies - first.stats.copies > 0
        assert worker.latest().time >= periodic[-1].time
    finally:
        worker.close()


def test_a_checkpoint_rewritten_under_the_job_is_never_read(tmp_path) -> None:
    """Same shapes, new weights, written over the indexed file (an export re-run in place): the
    header and size are the same, the mtime is not. A worker that loads now (a replacement, a
    re-plan) refuses the file, naming it, rather than mix new layers with the old ones."""
    import dataclasses
    import shutil

    shape = CheckpointShape(num_layers=2, **TINY)
    root = make_checkpoint(tmp_path / "ckpt", shape)
    index = load_index(root)
    spec = dataclasses.replace(spec_for(index, offloaded=()), files=index.identities)
    other = make_checkpoint(tmp_path / "other", dataclasses.replace(shape, seed=1))
    shutil.copyfile(other / "model.safetensors", root / "model.safetensors")
    [before], [after] = index.identities, load_index(root).identities
    assert (before.size, before.header_sha256) == (after.size, after.header_sha256)
    worker = StageWorker(spec, device="cpu")
    try:
        with pytest.raises(
            WorkerError,
            match=r"model.safetensors: the checkpoint file changed "
            r"since the job indexed it \(mtime_ns \d+ -> \d+\).*load the job again",
        ):
            worker.load()
        assert worker.report().bytes_read == 0  # nothing of the new file was read
    finally:
        worker.close()


def test_a_uva_stage_reads_weights_in_place_and_takes_a_new_plan(index) -> None:
    """backend uva on the CPU stand-in: the offloaded layers' parameters are views of the host
    arena the loader wrote (no slots, no copies), the simulated GPU counts only what is
    resident, and the logits equal transformers'. A re-plan (reconfigure) moves layers between
    the arena and the device and still equals transformers."""
    import dataclasses

    from coordinator.tools.reference import reference_logits

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(11))
    expected = reference_logits(str(index.root), ids)
    everything = [layer.name for layer in index.layers]
    uva = lambda spec: dataclasses.replace(spec, backend="uva")  # noqa: E731
    resident = StageWorker(stage_spec(index, everything), device="cpu")
    worker = StageWorker(
        uva(stage_spec(index, everything, offloaded=("layers.1", "layers.2"))), device="cpu"
    )
    try:
        all_resident = resident.load().device_used_bytes
        report = worker.load()
        stats = report.stats
        assert report.backend == "uva" and "uva requested" in report.backend_reason
        offloaded = nbytes(index, ["layers.1", "layers.2"])
        assert (stats.offloaded_bytes, stats.buffer_bytes) == (offloaded, 0)
        assert report.device_used_bytes == all_resident - offloaded  # the arena is host memory
        arena = worker.offloader.host_tensors()
        block = worker.stage.model.model.layers[1]
        weight = block.mlp.down_proj.weight
        assert any(weight.data_ptr() == t.data_ptr() for t in arena.values())  # in place
        assert torch.equal(worker.forward(ids), expected)
        assert worker.report().stats.copies == 0
        # Re-plan: layers.1 comes back to the device, layers.0 and layers.3 go to the arena.
        worker.reconfigure(uva(stage_spec(index, everything, offloaded=("layers.0", "layers.3"))))
        report = worker.finish_load()
        assert report.bytes_read == index.file_bytes  # moved in memory, nothing read again
        assert report.stats.offloaded_bytes == nbytes(index, ["layers.0", "layers.3"])
        assert torch.equal(worker.forward(ids), expected)
    finally:
        worker.close()
        resident.close()


def test_the_last_stage_keeps_each_slots_settings_for_its_owner_only(index) -> None:
    """A slot's sampling settings arrive once (with its sequence's first choosing step) and
    stay for later steps; a step choosing in a slot whose settings never came is refused, and
    a new claim (another epoch) forgets them all."""
    from worker.steps import Draw, Sampling, SlotSettings, StepRows

    worker = StageWorker(spec_for(index, offloaded=()), device="cpu")
    try:
        worker.load()
        owner = ("engine-a", 1)
        worker.claim(owner)

        def rows(start: int, count: int, owner=owner) -> StepRows:
            return StepRows.in_slots(
                (2,), (start,), (count,), count, num_slots=4, max_seq_len=16, owner=owner
            )

        prompt = torch.tensor([[5, 6, 7]])
        first = Draw((True,), ((2, SlotSettings(Sampling())),))
        token = worker.batch_step(rows(0, 3), prompt, first)
        again = worker.batch_step(rows(3, 1), torch.tensor([[9]]), Draw((True,)))  # kept
        assert token.array.shape == again.array.shape == (1,)
        worker.claim(("engine-a", 2))  # a restart: its sequences send their settings again
        with pytest.raises(ValueError, match="slot 2 chooses a token but its settings never"):
            worker.batch_step(rows(0, 3, ("engine-a", 2)), prompt, Draw((True,)))
    finally:
        worker.close()


def test_only_a_cuda_stage_turns_cudnn_attention_off(index) -> None:
    """cuDNN's attention builds a graph per new input shape (bench/RESULTS.md, GPU check): a
    stage on a CUDA device turns it off for its process, a CPU stage leaves torch as it was.
    The GPU test checks that a CUDA stage's steps then run without it."""
    from worker.stage import avoid_per_shape_attention_graphs

    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        worker = StageWorker(spec_for(index, offloaded=()), device="cpu")
        worker.close()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert avoid_per_shape_attention_graphs(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not avoid_per_shape_attention_graphs(torch.device("cuda"))  # already off
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("pin", [True, False])
def test_the_loaders_staging_buffer_follows_the_nodes_pin_decision(index, monkeypatch, pin):
    """Issue 57: the loader pinned its staging buffer whenever CUDA was there. It follows the
    node's decision now (asked as the offloader asks it: the worker's environment, its probe),
    and a setting the policy refuses pins nothing."""
    import worker.worker as worker_module
    from offload.errors import PinningUnavailableError
    from offload.policy import PinDecision

    asked = []

    def decided(env, probe, planned, device):
        asked.append((env.get("OFFLOAD_PIN_MEMORY"), planned, device.type))
        return PinDecision(pin=pin, reason="test", source="probe")

    monkeypatch.setenv("OFFLOAD_PIN_MEMORY", "auto")
    monkeypatch.setattr(worker_module, "decide_for_device", decided)
    worker = StageWorker(spec_for(index, offloaded=()), device="cpu")
    try:
        assert worker._reader.pin is pin and asked == [("auto", 0, "cpu")]
    finally:
        worker.close()

    def refused(env, probe, planned, device):
        raise PinningUnavailableError("OFFLOAD_PIN_MEMORY=on where nothing can be pinned")

    monkeypatch.setattr(worker_module, "decide_for_device", refused)
    worker = StageWorker(spec_for(index, offloaded=()), device="cpu")
    try:
        assert worker._reader.pin is False
    finally:
        worker.close()


def test_host_memory_is_page_locked_in_two_places_each_given_the_decision() -> None:
    """Issue 57: nothing in the library pins because CUDA is there. Host memory is page-locked
    only by the arena's registration and by `offload.arena.host_buffer`, each told by its
    caller whether the node pins; every caller of host_buffer passes it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pinning = re.compile(r"pin_memory\s*=|\.pin_memory\(|cudaHostRegister\(")
    sites, calls = [], []
    for package in ("offload", "worker", "coordinator"):
        for path in sorted((root / package).rglob("*.py")):
            for line in path.read_text().splitlines():
                code = line.split("#", 1)[0]
                if pinning.search(code) and "`" not in code:  # code, not its docs
                    sites.append((path.relative_to(root).as_posix(), code.strip()))
                if "host_buffer(" in code and "def host_buffer" not in code:
                    calls.append((path.relative_to(root).as_posix(), code.strip()))
    assert sites == [
        ("offload/arena.py", "buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)"),
        (
            "offload/arena.py",
            "rc = int(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, "
            "_HOST_REGISTER_FLAGS))",
        ),
    ], sites
    assert calls == [
        ("offload/staging.py", "return host_buffer(nbytes, pin=True)"),  # only where it pins
        ("worker/loader.py", "self._staging = host_buffer(size, pin=self.pin)"),
    ], calls


def test_a_worker_whose_load_failed_is_broken_until_a_load_finishes(index) -> None:
    """Issue 57 point 3: a worker is healthy when it is ready, not when it answers. A load
    step that fails (here a chunk that does not exist; on a GPU, out of memory) leaves it
    broken: its ping says why (StageBrokenError), so the runtime counts it as lost and
    replaces it. A load that finishes makes it whole again."""
    from offload.errors import StageBrokenError
    from worker.actor import StageActor

    actor = StageActor(spec_for(index, offloaded=("layers.1",)), device="cpu")
    try:
        actor.load()
        assert actor.ping() > 0
        chunks = actor.prepare()
        with pytest.raises(IndexError):
            actor.load_chunk(len(chunks) + 5)
        with pytest.raises(StageBrokenError, match=r"its load_chunk failed: IndexError"):
            actor.ping()
        actor.load()
        assert actor.ping() > 0
        assert torch.isfinite(actor.forward(torch.randint(0, 64, (1, 4)))).all()
    finally:
        actor.close()


def test_a_simulated_gpu_with_a_size_holds_what_its_stage_does(index, tmp_path, monkeypatch):
    """Issue 57 point 1: on a simulated GPU with a size (OFFLOAD_SIMULATED_GPU_MEMORY), a loaded
    stage must fit beside what other processes hold there, as a CUDA allocation must; once
    loaded its bytes are in the node's ledger for the probes, and closing takes them back."""
    import os

    import worker.worker as worker_module
    from offload.simulated import DeviceLedger

    ledger = DeviceLedger("node-a", root=tmp_path)
    monkeypatch.setattr(worker_module, "simulated_place", lambda: (ledger, [1]))
    spec = spec_for(index, offloaded=())
    probe = StageWorker(spec, device="cpu")
    try:
        needed = probe.load().device_used_bytes
    finally:
        probe.close()
    total = needed * 2
    monkeypatch.setenv("OFFLOAD_SIMULATED_GPU_MEMORY", str(total))
    ledger.hold(1, total - needed + 1, pid=os.getppid())  # another load's stage, one byte too many
    crowded = StageWorker(spec, device="cpu")
    try:
        with pytest.raises(
            WorkerError,
            match=rf"holds {needed} bytes on simulated GPU 1, of which other processes hold "
            rf"{total - needed + 1} of its {total}",
        ):
            crowded.load()
        assert ledger.holders(1) == {os.getppid(): total - needed + 1}
        ledger.hold(1, total - needed, pid=os.getppid())  # room for it exactly
        crowded.load()
        assert ledger.holders(1) == {os.getppid(): total - needed, os.getpid(): needed}
        assert ledger.free(1, total, credit=[os.getpid()]) == needed  # a re-plan's view
    finally:
        crowded.close()
    assert ledger.holders(1) == {os.getppid(): total - needed}


def test_a_reconfigure_frees_the_old_arena_first_where_the_host_cannot_hold_both(
    index, monkeypatch
) -> None:
    """Issue 57 point 7: a reconfigure allocated the new arena before freeing the old one, so a
    survivor of a re-plan that offloads more held both (and on a full host was OOM-killed).
    Where the host has too little memory available for the new arena beside the old one, the
    old goes first and the layers it held are read again from disk; with room, they move in
    memory (as the test above). The logits equal transformers' both ways."""
    import worker.worker as worker_module
    from coordinator.tools.reference import reference_logits

    order = []
    create = worker_module.create_offloader

    def create_logged(*args, **kwargs):
        order.append("create")
        offloader = create(*args, **kwargs)
        detach = offloader.detach

        def detach_logged(**kw):
            order.append("detach")
            detach(**kw)

        offloader.detach = detach_logged
        return offloader

    monkeypatch.setattr(worker_module, "create_offloader", create_logged)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    expected = reference_logits(str(index.root), ids)
    everything = [layer.name for layer in index.layers]
    worker = StageWorker(stage_spec(index, everything, offloaded=("layers.1",)), device="cpu")
    try:
        worker.load()
        arena = nbytes(index, ["layers.1", "layers.2"])  # what the new stage offloads
        monkeypatch.setattr(worker_module, "host_memory", lambda: (1 << 40, arena))  # < arena/0.9
        order.clear()
        chunks = worker.reconfigure(
            stage_spec(index, everything, offloaded=("layers.1", "layers.2"))
        )
        assert order[:2] == ["detach", "create"]  # the old arena went first
        assert sum(chunks.values()) == nbytes(index, ["layers.1"])  # what it held: read again
        for chunk in chunks:
            worker.load_chunk(chunk)
        worker.finish_load()
        assert torch.equal(worker.forward(ids), expected)

        monkeypatch.setattr(worker_module, "host_memory", lambda: (1 << 40, 1 << 40))
        order.clear()
        assert worker.reconfigure(stage_spec(index, everything, offloaded=("layers.2",))) == {}
        assert order == ["create", "detach"]  # room for both: layers.2 moved in memory
        worker.finish_load()
        assert torch.equal(worker.forward(ids), expected)
    finally:
        worker.close()


def test_a_worker_refuses_a_recurrent_stage_its_own_transformers_cannot_run(
    tmp_path, monkeypatch
) -> None:
    """The driver's transformers passed the check at indexing; a node whose own is older
    refuses the stage at load, naming itself and the fix, before reading anything. A stage of
    the same model without recurrent layers (jamba's attention layer) loads."""
    from worker import layout

    shape = CheckpointShape(arch="jamba", num_layers=2, **TINY)
    index = load_index(make_checkpoint(tmp_path / "jamba", shape))
    monkeypatch.setattr(layout, "RECURRENT_CACHE_TRANSFORMERS", (999, 0))
    whole = spec_for(index, offloaded=())
    recurrent = [layer.name for layer in index.layers if layer.state_bytes]
    worker = StageWorker(whole, device="cpu")
    try:
        with pytest.raises(
            WorkerError, match=r"^stage 0 on .*: jamba keeps a recurrent state .*>=999\.0"
        ):
            worker.load()
        assert worker.report().bytes_read == 0
    finally:
        worker.close()
    attention = [layer for layer in index.layers if layer.name not in recurrent]
    plain = StageWorker(dataclasses.replace(whole, layers=tuple(attention)), device="cpu")
    try:
        plain.load()
    finally:
        plain.close()
