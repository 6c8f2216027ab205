"""CUDA-only checks, run on a lent GPU machine: real probes, a registered arena, prefetch on a
side stream, UVA zero-copy views. Skipped cleanly without CUDA (see conftest.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from helpers import block_stack, run_stack, storage_bytes
from torch import nn

from offload import (
    HostArena,
    OffloadConfig,
    OffloadUnavailableError,
    PrefetchOffloader,
    TensorSpec,
    UVAOffloader,
    decide_pinning,
    probe_node,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def cuda_stack(num_layers: int, hidden: int = 256) -> list[torch.nn.Module]:
    return [m.to(CUDA) for m in block_stack(num_layers, hidden)]


class Sleep(nn.Module):
    """A kernel that only takes time: each layer starts with it, so a layer's reads of its
    weights run well after its kernels were issued. A copy into its slot that does not wait for
    the compute fence then lands before they read it, and the output changes."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return x


def sleepy_cuda_stack(num_layers: int, hidden: int, cycles: int) -> list[torch.nn.Module]:
    return [
        nn.Sequential(Sleep(cycles), *block).to(CUDA) for block in block_stack(num_layers, hidden)
    ]


class PinnedCount:
    """Host memory page-locked in this process since it was made, counted where it happens, not
    by what our code says it pinned (`offload.arena.pinned_buffer_bytes`, `OffloadStats`):
    - `registered`: the size of every `cudaHostRegister` made through `torch.cuda.cudart()` (the
      arena's way to pin), by a wrapper the `pinned_count` fixture puts in its place;
    - `allocator_bytes`: bytes torch's pinned allocator handed out (`torch.empty(...,
      pin_memory=True)`, `Tensor.pin_memory()`, any pinned buffer torch makes itself), from its
      historical totals (`torch.cuda.host_memory_stats()`, keys ending in `bytes.allocated`: they
      only grow, on each handout or growth of the pool; torch has named them differently over
      its versions, so every such key is read and the largest growth taken).
    The CUDA driver's own staging of a pageable copy is the driver's, and no allocation of ours."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self._before = self._totals()
        assert self._before, "torch.cuda.host_memory_stats() has no '...bytes.allocated' totals"

    @staticmethod
    def _totals() -> dict[str, int]:
        stats = torch.cuda.host_memory_stats()
        return {k: int(v) for k, v in stats.items() if k.endswith("bytes.allocated")}

    @property
    def allocator_bytes(self) -> int:
        now = self._totals()
        return max(now[k] - before for k, before in self._before.items())


@pytest.fixture
def pinned_count(monkeypatch) -> PinnedCount:
    cudart = torch.cuda.cudart()  # CUDA initialised before the allocator's totals are read
    count = PinnedCount()

    class CountingCudart:
        def __getattr__(self, name: str):
            return getattr(cudart, name)

        def cudaHostRegister(self, ptr: int, size: int, flags: int):
            count.registered.append(size)
            return cudart.cudaHostRegister(ptr, size, flags)

    counting = CountingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: counting)
    return count


def pinned_at(ptr: int) -> bool:
    """Whether CUDA sees the host address `ptr` as pinned. `Tensor.is_pinned()` asks about its
    storage's first byte, and an arena's views share a storage that starts up to a page before
    the registered, page-aligned range: so ask with a tensor whose storage starts at `ptr`."""
    return torch.frombuffer((ctypes.c_uint8 * 1).from_address(ptr), dtype=torch.uint8).is_pinned()


def test_probe_reads_the_driver() -> None:
    probe = probe_node()
    assert probe.cuda_available and len(probe.devices) == torch.cuda.device_count()
    device = probe.devices[0]
    assert device.capability == torch.cuda.get_device_capability(0)
    assert device.host_register_supported is True
    assert device.pageable_memory_access_uses_host_page_tables is not None
    assert probe.errors == ()
    decision = decide_pinning({}, probe)
    expected = not (probe.any_coherent_unified_memory or probe.any_integrated or probe.is_wsl)
    assert decision.pin == expected, decision


def test_arena_registers_and_unregisters() -> None:
    specs = [TensorSpec(f"t{i}", (1000 + 7 * i,), torch.float16) for i in range(10)]
    arena = HostArena(specs, pin=True)
    inside = [arena[k].data_ptr() for k in arena] + [arena.data_ptr + arena.nbytes - 1]
    assert arena.pinned and all(pinned_at(ptr) for ptr in inside)
    arena.close()
    assert not arena.pinned and not any(pinned_at(ptr) for ptr in inside)


# Layers of 2048 x 2048 float32 (16 MiB: ~0.3 ms over PCIe 5) behind ~0.5 ms of sleep each.
HIDDEN = 2048
SLEEP_CYCLES = 1_000_000


@pytest.mark.parametrize("pin", ["on", "off"])  # off: pageable copies, nothing pinned
@pytest.mark.parametrize(
    ("layers", "step"),
    [((0, 1, 2, 3, 4, 5), 2), ((0, 1, 2, 3, 4, 5, 6), 3), ((1, 3, 4), 1), ((0, 2), 0)],
)
def test_prefetch_on_a_side_stream_matches_resident(
    layers: tuple[int, ...], step: int, pin: str, pinned_count: PinnedCount
) -> None:
    """Fewer slots than offloaded layers (N % K != 0 too), a sleep kernel at the start of every
    layer so that a missing fence shows, bitwise over many forwards. With pinning off nothing
    is pinned, not even bounce chunks (issue 57: the direct engine's copy thread copies from
    pageable memory): counted at CUDA's registration and torch's pinned allocator, over the
    wrap and the forwards; on, the arena alone is registered."""
    modules = sleepy_cuda_stack(7, HIDDEN, SLEEP_CYCLES)
    x = torch.randn(8, HIDDEN, device=CUDA)
    reference = run_stack(modules, x)
    before = storage_bytes(modules)
    offloader = PrefetchOffloader(
        OffloadConfig(layers=layers, prefetch_step=step),
        device=CUDA,
        env={"OFFLOAD_PIN_MEMORY": pin},
    )
    offloader.wrap_modules(modules)
    offloader.post_init()
    assert offloader.pin_decision is not None and offloader.pin_decision.pin == (pin == "on")
    for _ in range(20):
        assert torch.equal(run_stack(modules, x), reference)
    offloader.synchronize()
    stats = offloader.stats()
    assert storage_bytes(modules) == before - stats.offloaded_bytes + stats.buffer_bytes
    assert stats.copies > 0 and stats.copy_s > 0
    assert stats.pinned_bytes == (stats.offloaded_bytes if offloader.pin_decision.pin else 0)
    assert stats.copy_engine == ("cuda" if pin == "on" else "direct")
    if pin == "off":
        assert stats.engine_pinned_bytes == 0
        assert pinned_count.registered == [] and pinned_count.allocator_bytes == 0
    else:
        assert pinned_count.registered == [offloader._arena.nbytes]
    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)


@pytest.mark.parametrize("pin", ["on", "off"])
def test_a_worker_pins_nothing_when_its_node_says_off(
    tmp_path, monkeypatch, pin: str, pinned_count: PinnedCount
) -> None:
    """Issue 57, the bug this project was founded on: a stage's loader staged its resident
    weights through a pinned buffer whenever CUDA was there. Every host buffer of a worker
    (arena, loader staging, bounce chunks) follows its node's decision: off, zero pinned
    bytes over the load and a forward, counted at CUDA's registration and torch's pinned
    allocator (`PinnedCount`), and reported so; on, the arena (registered) and the staging
    buffer (torch's pinned allocator)."""
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
    from worker.spec import StageSpec
    from worker.worker import StageWorker

    monkeypatch.setenv("OFFLOAD_PIN_MEMORY", pin)
    index = load_index(
        make_checkpoint(
            tmp_path / "ckpt",
            CheckpointShape(
                num_layers=4,
                hidden_size=256,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=512,
                vocab_size=512,
                dtype="bfloat16",
                tokenizer=False,
            ),
        )
    )
    spec = StageSpec(
        stage=0,
        num_stages=1,
        checkpoint_dir=str(index.root),
        config=index.config,
        dtype="float32",  # resident weights converted on the way: through the staging buffer
        layers=index.layers,
        offloaded=("layers.1", "layers.2"),
    )
    worker = StageWorker(spec, device="cuda")
    try:
        worker.load()
        worker.forward(torch.randint(0, 512, (2, 8)))
        report = worker.report()
        assert worker._reader.pin is (pin == "on")
        if pin == "off":
            assert pinned_count.registered == [] and pinned_count.allocator_bytes == 0
            assert report.stats.pinned_bytes == 0
        else:
            assert pinned_count.registered == [worker.offloader._arena.nbytes]
            assert pinned_count.allocator_bytes > 0  # the loader's staging buffer
            assert report.stats.pinned_bytes == report.stats.offloaded_bytes
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("dtype", "block"), [(torch.int8, (1, 128)), (torch.float8_e4m3fn, (128, 128))]
)
def test_a_weight_quantizes_bitwise_alike_on_cuda_and_on_the_cpu(dtype, block) -> None:
    """CUDA divides by a host scalar as a product with its reciprocal, one bit off IEEE
    division: the same weight quantized on the GPU and on the CPU (where a loader quantizes
    into host memory) gives the same values and scales, so a reference built on either side
    equals what the offloader keeps."""
    from offload.quant import BlockFormat, quantized

    fmt = BlockFormat(dtype, block)
    weight = torch.randn(512, 1024, generator=torch.Generator().manual_seed(5)) * 0.05
    on_cpu, on_cuda = quantized(weight, fmt), quantized(weight.to(CUDA), fmt)
    assert torch.equal(on_cuda.scales.cpu(), on_cpu.scales)
    assert torch.equal(on_cuda.q.cpu().view(torch.uint8), on_cpu.q.view(torch.uint8))
    assert torch.equal(
        on_cuda.dequantized(torch.bfloat16, CUDA).cpu(), on_cpu.dequantized(torch.bfloat16)
    )


@pytest.mark.parametrize("pin", ["on", "off"])
@pytest.mark.parametrize(("layers", "step"), [((0, 1, 2, 3, 4, 5), 2), ((1, 3, 4), 1)])
def test_8bit_layers_are_dequantized_on_the_side_stream(
    layers: tuple[int, ...], step: int, pin: str
) -> None:
    """Offloaded matrices kept in int8 in host memory, copied 8-bit into the staging buffer and
    dequantized into their slots by kernels on the copy stream (or the staged engine's), a
    sleep kernel in every layer: bitwise the same stack with those weights quantized and back,
    resident, over many forwards."""
    from offload.quant import BlockFormat, quantized

    fmt = BlockFormat(torch.int8, (1, 128))
    modules = sleepy_cuda_stack(7, HIDDEN, SLEEP_CYCLES)
    with torch.no_grad():
        for i in layers:  # the reference: the same weights quantized and back, resident
            linear = modules[i][1]
            linear.weight.copy_(quantized(linear.weight, fmt).dequantized(torch.float32, CUDA))
    x = torch.randn(8, HIDDEN, device=CUDA)
    reference = run_stack(modules, x)
    offloader = PrefetchOffloader(
        OffloadConfig(layers=layers, prefetch_step=step),
        device=CUDA,
        env={"OFFLOAD_PIN_MEMORY": pin},
        formats={f"{i}.1.weight": fmt for i in layers},
    )
    offloader.wrap_modules(modules)
    offloader.post_init()
    for _ in range(20):
        assert torch.equal(run_stack(modules, x), reference)
    offloader.synchronize()
    stats = offloader.stats()
    assert stats.copies > 0 and stats.dequant_s > 0
    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)


def test_uva_parameters_are_zero_copy_views_of_host_memory() -> None:
    modules = cuda_stack(4)
    x = torch.randn(8, 256, device=CUDA)
    reference = run_stack(modules, x)
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(1, 3)), device=CUDA, env={"OFFLOAD_PIN_MEMORY": "on"}
    )
    offloader.wrap_modules(modules)
    weight = modules[1][0].weight
    assert weight.device.type == "cuda"
    arena = offloader._arena
    assert arena is not None and arena.pinned
    # The device address lies inside the registered host buffer (UVA: same address space).
    assert arena.data_ptr <= weight.data_ptr() < arena.data_ptr + arena.nbytes
    assert torch.equal(run_stack(modules, x), reference)
    stats = offloader.stats()
    assert stats.copies == 0 and stats.buffer_bytes == 0 and stats.pinned_bytes > 0
    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)
    assert not (arena.data_ptr <= modules[1][0].weight.data_ptr() < arena.data_ptr + arena.nbytes)


def test_uva_refuses_pageable_memory_without_ats() -> None:
    if probe_node().any_coherent_unified_memory:
        pytest.skip("this GPU reads pageable memory (ATS): UVA without pinning is valid here")
    offloader = UVAOffloader(
        OffloadConfig(backend="uva", layers=(0,)), device=CUDA, env={"OFFLOAD_PIN_MEMORY": "off"}
    )
    with pytest.raises(OffloadUnavailableError, match="backend='prefetch'"):
        offloader.wrap_modules(cuda_stack(2))


def test_worker_reconfigure_moves_layers_within_device_memory(tmp_path) -> None:
    """On a GPU: a re-plan that offloads more frees the device memory of the layers that went
    to the arena (nothing restored on the way), a layer kept resident is not copied, and the
    logits are those of the same worker before the change (same device, same kernels)."""
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
    from worker.spec import StageSpec
    from worker.worker import StageWorker

    index = load_index(
        make_checkpoint(
            tmp_path / "ckpt",
            CheckpointShape(
                num_layers=6,
                hidden_size=256,
                num_heads=8,
                num_kv_heads=4,
                intermediate_size=512,
                vocab_size=512,
            ),
        )
    )

    def spec(offloaded: tuple[str, ...]) -> StageSpec:
        return StageSpec(
            stage=0,
            num_stages=1,
            checkpoint_dir=str(index.root),
            config=index.config,
            layers=index.layers,
            offloaded=offloaded,
        )

    worker = StageWorker(spec(("layers.1",)), device="cuda")
    try:
        worker.load()
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
        before = worker.forward(ids)
        used_before = torch.cuda.memory_allocated()
        embed_ptr = worker.stage.model.get_input_embeddings().weight.data_ptr()
        chunks = worker.reconfigure(spec(("layers.1", "layers.2", "layers.3", "layers.4")))
        assert chunks == {}  # every layer was here already
        report = worker.finish_load()
        assert worker.stage.model.get_input_embeddings().weight.data_ptr() == embed_ptr
        decoder = max(x.nbytes for x in index.layers if x.kind == "decoder")
        # three more layers in host memory; one prefetch slot was there before and stays
        assert used_before - torch.cuda.memory_allocated() >= 3 * decoder * 0.99
        assert report.stats.offloaded_bytes == 4 * decoder
        assert torch.equal(worker.forward(ids), before)
    finally:
        worker.close()


@pytest.mark.parametrize("quantization", ["fp8-block", "mxfp4"])
def test_resident_matrices_kept_as_stored_on_cuda(tmp_path, quantization: str) -> None:
    """On a GPU: a stage keeping its resident FP8 (partial blocks) or MXFP4 matrices as stored
    reads the file's bytes onto the device and dequantizes each layer just in time: the logits
    of the same stage dequantized at load (same device, same numbers), in fewer device bytes,
    what `LayerSpec.resident_bytes(stored=True)` and one layer at width say; gpt-oss's experts
    in compact rows too (issue 54 point 4)."""
    import dataclasses

    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
    from worker.spec import StageSpec
    from worker.worker import StageWorker

    arch = "gpt_oss" if quantization == "mxfp4" else "llama"
    index = load_index(
        make_checkpoint(
            tmp_path / "ckpt",
            CheckpointShape(
                arch=arch,
                num_layers=6,
                hidden_size=576 if arch == "llama" else 512,
                num_heads=8,
                num_kv_heads=4,
                intermediate_size=1344 if arch == "llama" else 1024,
                vocab_size=512,
                dtype="bfloat16",
                quantization=quantization,
                tokenizer=False,
                num_experts=8,  # gpt-oss: top 2 of 8, so 2 compact rows hold fewer than all
            ),
        )
    )
    spec = StageSpec(
        stage=0,
        num_stages=1,
        checkpoint_dir=str(index.root),
        config=index.config,
        dtype="bfloat16",
        layers=index.layers,
    )
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    one = ids[:1, :1]  # a one-token step: its call fits 2 compact rows, not split
    runs = [(False, 0), (True, 0)] + ([(True, 2)] if arch == "gpt_oss" else [])
    out, held, steps, splits = [], [], [], []
    for stored, rows in runs:
        worker = StageWorker(
            dataclasses.replace(spec, resident_stored=stored, stored_expert_capacity=rows),
            device="cuda",
        )
        try:
            base = torch.cuda.memory_allocated()
            worker.load()
            held.append(torch.cuda.memory_allocated() - base)
            out.append(worker.forward(ids).cpu())
            steps.append(worker.forward(one).cpu())
            splits.append(worker._placement.residency.split_calls)
            report = worker.report()
        finally:
            worker.close()
    assert report.resident_format
    assert torch.equal(out[0], out[1])
    planned = sum(x.resident_bytes(True) for x in index.layers)
    jit = max(x.jit_bytes() for x in index.layers)
    assert held[1] < held[0]
    # the stored bytes and one layer's buffer (CUDA's allocator rounds each block up a little)
    assert planned + jit <= held[1] <= (planned + jit) * 1.02 + 2**21
    if arch == "gpt_oss":  # experts in 2 compact rows: a smaller buffer, the same numbers
        compact = max(x.jit_bytes(2) for x in index.layers)
        assert compact < jit and planned + compact <= held[2] <= (planned + compact) * 1.02 + 2**21
        assert torch.equal(steps[2], steps[0])  # the same kernels on the same rows
        # the prompt's calls ran in groups of rows: each expert's matmuls on fewer rows, which
        # CUDA may tile otherwise; bounded by bf16's rounding of the logits
        assert splits[2] > 0
        bound = 2 * torch.finfo(torch.bfloat16).eps * out[0].float().abs().max()
        assert (out[2].float() - out[0].float()).abs().max() <= bound


def two_cuda_stages(index, backend: str) -> list:
    """Specs of two stages (embed + layers 0-1 | layers 2-3 + head), each offloading one
    decoder layer with `backend`."""
    from worker.spec import StageSpec

    names = [layer.name for layer in index.layers]
    return [
        StageSpec(
            stage=stage,
            num_stages=2,
            checkpoint_dir=str(index.root),
            config=index.config,
            dtype=index.dtype,
            layers=tuple(x for x in index.layers if x.name in group),
            offloaded=tuple(n for n in group if n in ("layers.1", "layers.3")),
            backend=backend,
        )
        for stage, group in enumerate([names[:3], names[3:]])
    ]


def small_checkpoint(tmp_path, arch: str, dtype: str = "bfloat16"):
    """A 4-layer checkpoint of `arch` (hidden 256, vocab 512) in `dtype` under `tmp_path`,
    indexed."""
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

    shape = CheckpointShape(
        arch=arch,
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=512,
        vocab_size=512,
        dtype=dtype,
    )
    return load_index(make_checkpoint(tmp_path / arch, shape))


def cuda_reference_logits(index, ids: torch.Tensor) -> torch.Tensor:
    """transformers' bf16 logits for `ids` on the GPU, the same files, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        index.root, dtype=torch.bfloat16, device_map="cuda"
    )
    with torch.no_grad():
        return model(ids.to(CUDA)).logits.cpu()


@pytest.mark.parametrize(
    ("arch", "backend"), [("llama", "prefetch"), ("mixtral", "prefetch"), ("llama", "uva")]
)
def test_bf16_stages_on_cuda_match_transformers_on_cuda(tmp_path, arch: str, backend: str) -> None:
    """Two stages on the GPU, bf16 as published, one layer offloaded per stage (prefetch on a
    side stream, or uva: read in place from pinned host memory): bitwise the logits of
    transformers on the same GPU. Both run transformers' model code in bf16 on the same shapes
    with the same kernels: the offloaded weights are copied bitwise into their slots (prefetch)
    or read in place (uva), and the reference runs after the workers, so without the cuDNN
    attention they turned off for this process (`avoid_per_shape_attention_graphs`). Measured
    on an H200: max abs difference 0 in all four cases (bench/RESULTS.md, gpu_check's stage
    section)."""

    from worker.worker import StageWorker

    index = small_checkpoint(tmp_path, arch)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    x = ids
    for spec in two_cuda_stages(index, backend):
        worker = StageWorker(spec, device="cuda")
        try:
            assert worker.load().backend == backend
            x = worker.forward(x)
        finally:
            worker.close()
    expected = cuda_reference_logits(index, ids)
    diff = float((x.float() - expected.float()).abs().max())
    assert x.dtype == torch.bfloat16
    assert torch.equal(x, expected), f"{arch} {backend}: max abs diff {diff:.3e}"


def test_moe_experts_computed_on_the_host_beside_a_cuda_stage(tmp_path) -> None:
    """Issue 55 point 5 on a GPU: mixtral's experts offloaded from two CUDA stages, routed,
    and every call (2 x 8 rows) run on the host (`host_expert_rows`): the experts read in host
    memory, nothing of them copied to the GPU, the output brought back. The host computes
    them with the CPU's kernels, so the logits are transformers' on the GPU within bfloat16
    rounding of the expert outputs (not bitwise: other kernels, other sums)."""
    import dataclasses

    from worker.worker import StageWorker

    index = small_checkpoint(tmp_path, "mixtral")
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    x, stats = ids, []
    for spec in two_cuda_stages(index, "prefetch"):
        spec = dataclasses.replace(
            spec, offload_unit="experts", expert_fetch="routed", host_expert_rows=16
        )
        worker = StageWorker(spec, device="cuda")
        try:
            worker.load()
            x = worker.forward(x)
            stats.append(worker.report().stats)
        finally:
            worker.close()
    expected = cuda_reference_logits(index, ids)
    assert sum(s.expert_host for s in stats) > 0
    assert sum(s.expert_hits + s.expert_misses for s in stats) == 0
    assert x.device.type == "cpu" and x.dtype == torch.bfloat16
    scale = float(expected.float().abs().max())
    diff = float((x.float() - expected.float()).abs().max())
    assert diff <= 0.05 * scale, f"max abs diff {diff:.3e} of {scale:.3e}"


@pytest.mark.parametrize("backend", ["prefetch", "uva"])
def test_batched_generation_on_cuda_equals_transformers_alone(tmp_path, backend: str) -> None:
    """The engine's batched steps on the GPU (slot pool, per-row masks and positions on CUDA,
    offloaded layers copied on a side stream or read in place): three requests of different
    prompt lengths at once, two stages (a burst the first stage drives through the second),
    each request's greedy tokens those of transformers on the same GPU, that prompt alone
    (float32, no TF32)."""
    from transformers import AutoModelForCausalLM

    from coordinator.engine import Engine, EngineConfig
    from coordinator.engine.pipelines import LocalPipeline
    from worker.steps import Sampling
    from worker.worker import StageWorker

    index = small_checkpoint(tmp_path, "llama", "float32")
    workers = [StageWorker(spec, device="cuda") for spec in two_cuda_stages(index, backend)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 4, 13)]
    engine = None
    try:
        for worker in workers:
            worker.load()
        engine = Engine(
            LocalPipeline(workers), EngineConfig(num_slots=3, max_seq_len=40, micro_batches=1)
        )
        requests = [engine.submit([p], sampling=Sampling(), max_new_tokens=16) for p in prompts]
        ours = [r.result(120)[0] for r in requests]
    finally:
        if engine is not None:
            engine.close()
        for worker in workers:
            worker.close()
    model = AutoModelForCausalLM.from_pretrained(index.root, dtype=torch.float32, device_map="cuda")
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device=CUDA),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
            )
        assert tokens == out[0, len(prompt) :].tolist()


@pytest.fixture
def cudnn_attention_on():
    """cuDNN's attention on, as in a fresh process (whatever an earlier stage set), and the flag
    as it was afterwards; yields a function listing the attention operators a call runs."""
    from torch.profiler import ProfilerActivity, profile

    def attention_ops(run) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        return [e.key for e in prof.key_averages() if "attention" in e.key]

    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield attention_ops
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def bf16_llama(tmp_path):
    """The index of a 2-layer bf16 llama whose heads (128 wide) cuDNN's attention takes."""
    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

    shape = CheckpointShape(
        num_layers=2,
        hidden_size=512,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        vocab_size=512,
        dtype="bfloat16",
    )
    return load_index(make_checkpoint(tmp_path / "llama", shape))


def test_a_cuda_stage_runs_attention_without_cudnn_graphs(tmp_path, cudnn_attention_on) -> None:
    """cuDNN's SDPA builds a graph for every new shape (~17 ms each on an H200, cached per
    thread), and a serving stage meets a new shape at almost every step. A CUDA stage's worker
    turns it off: bf16 forwards of three lengths run SDPA, never cuDNN's attention, and are
    bitwise transformers' logits on the same GPU, in the same process after the worker: the
    same model code, weights, shapes and dtype, and the attention then takes the same kernels."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from worker.spec import StageSpec
    from worker.worker import StageWorker

    attention_ops = cudnn_attention_on
    q, k, v = (torch.randn(2, 4, 7, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    control = attention_ops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    if not any("cudnn" in op for op in control):
        pytest.skip(f"this torch does not choose cuDNN's attention here ({control})")
    index = bf16_llama(tmp_path)
    spec = StageSpec(
        stage=0,
        num_stages=1,
        checkpoint_dir=str(index.root),
        config=index.config,
        dtype=index.dtype,
        layers=index.layers,
        offloaded=(),
    )
    worker = StageWorker(spec, device="cuda")
    try:
        worker.load()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 512, (2, n), generator=g) for n in (5, 6, 9)]
        outs = []
        ops = attention_ops(lambda: outs.extend(worker.forward(ids) for ids in batches))
    finally:
        worker.close()
    assert any("scaled_dot_product" in op for op in ops), ops
    assert not any("cudnn" in op for op in ops), ops
    model = AutoModelForCausalLM.from_pretrained(
        index.root, dtype=torch.bfloat16, device_map="cuda"
    )
    for ids, out in zip(batches, outs, strict=True):
        with torch.no_grad():
            expected = model(ids.to(CUDA)).logits.cpu()
        diff = float((out.float() - expected.float()).abs().max())
        assert torch.equal(out, expected), f"{ids.shape[1]} positions: max abs diff {diff:.3e}"


def test_the_compute_probe_times_attention_as_a_stage_runs_it(tmp_path, cudnn_attention_on) -> None:
    """The planner's compute probe times decode steps of growing length: with cuDNN's attention
    each would include a graph build. On CUDA it turns cuDNN's attention off as a stage does,
    and its steps run without it."""
    from worker.compute_probe import measure

    config = bf16_llama(tmp_path).config
    found = []
    ops = cudnn_attention_on(
        lambda: found.append(measure(config, "bfloat16", "cuda", use_cache=False))
    )
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert any("scaled_dot_product" in op for op in ops), ops
    assert not any("cudnn" in op for op in ops), ops
    assert all(t > 0 for t in found[0].layer_s), found
