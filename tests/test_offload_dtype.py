"""Offloaded weights in 8 bits through the whole stack (issue 26): the plan counts them as
stored, the workers keep them so and dequantize them on the device after each copy, and the
logits are transformers' own on the same files with those weights quantized (`--offload-dtype
fp8 | int8`), or transformers' own outright for an FP8 checkpoint kept as published."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, Pipeline, family_shape, offloading_plan, split_spec

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.planning.planner import PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.tools.make_checkpoint import make_checkpoint
from offload.errors import ConfigError, PlanError
from offload.quant import quantized
from worker.spec import file_format, parameter_formats, requantized_formats, routes


def offloaded_stages(the_plan):
    stages = [s for s in the_plan.stages if s.offloaded]
    assert stages
    return stages


def test_plan_counts_offloaded_weights_as_stored(tmp_path) -> None:
    """An FP8 checkpoint's offloaded layers take <= 0.55x their 16-bit bytes in the plan (host
    bytes, bytes per step), and their slots carry one staging buffer; "none" keeps them wide;
    int8 on a bf16 checkpoint halves them too."""
    fp8 = load_index(
        make_checkpoint(
            tmp_path / "fp8", family_shape("llama", "bfloat16", quantization="fp8-block")
        )
    )
    auto = offloading_plan(fp8)
    for stage in offloaded_stages(auto):
        assert stage.offloaded_bytes <= 0.55 * stage.offloaded_wide_bytes
        largest = max(
            x.unit_bytes(stage.offload_unit) for x in fp8.layers if x.name in stage.offloaded
        )
        assert stage.slot_bytes > min(stage.prefetch_step, len(stage.offloaded)) * largest
        assert stage.transfer_s == pytest.approx(
            stage.offloaded_bytes / auto.options.default_link_bytes_per_s
        )
    wide = offloading_plan(fp8, "none")
    for stage in offloaded_stages(wide):
        assert stage.offloaded_bytes == stage.offloaded_wide_bytes
    bf16 = load_index(make_checkpoint(tmp_path / "bf16", family_shape("llama", "bfloat16")))
    for stage in offloaded_stages(offloading_plan(bf16, "auto")):
        assert stage.offloaded_bytes == stage.offloaded_wide_bytes  # stored as they are
    for stage in offloaded_stages(offloading_plan(bf16, "int8")):
        assert stage.offloaded_bytes <= 0.6 * stage.offloaded_wide_bytes  # 32-wide rows: 4 B each


def test_plan_counts_the_measured_dequantization_in_each_stage_transfer(tmp_path) -> None:
    index = load_index(make_checkpoint(tmp_path / "bf16", family_shape("llama", "bfloat16")))
    base = offloading_plan(index, "int8")
    stage = offloaded_stages(base)[0]
    node = NodeInfo(
        node_id="node",
        hostname="node",
        gpus=tuple(
            GpuInfo(index=i, memory_bytes=s.device_bytes + 1) for i, s in enumerate(base.stages)
        ),
        host_budget_bytes=10**9,
        pinned_budget_bytes=10**9,
        dequant_bytes_per_s=(("fp8", 1e6), ("int8", 2e6)),
    )
    measured = plan(index.layers, ClusterSnapshot(nodes=(node,)), PlanOptions(offload_dtype="int8"))
    stage = offloaded_stages(measured)[0]
    assert stage.dequant_s == pytest.approx(stage.offloaded_wide_bytes / 2e6)
    link = measured.options.default_link_bytes_per_s
    assert stage.transfer_s == pytest.approx(stage.offloaded_bytes / link + stage.dequant_s)
    assert stage.time_s == max(stage.compute_s, stage.transfer_s)
    assert "dequantizing takes" in measured.summary()
    wide = plan(index.layers, ClusterSnapshot(nodes=(node,)), PlanOptions(offload_dtype="none"))
    assert all(s.dequant_s == 0 for s in wide.stages)


def test_8bit_offloading_needs_the_prefetch_backend(tmp_path) -> None:
    with pytest.raises(ConfigError, match="uva"):
        JobConfig(checkpoint=str(tmp_path), offload_dtype="int8", backend="uva")
    with pytest.raises(ConfigError, match="offload_dtype='int4'"):
        JobConfig(checkpoint=str(tmp_path), offload_dtype="int4")
    index = load_index(make_checkpoint(tmp_path / "bf16", family_shape("llama", "bfloat16")))
    node = NodeInfo(
        node_id="gh200",
        hostname="gh200",
        gpus=(GpuInfo(index=0, memory_bytes=index.total_bytes // 2),),
        host_budget_bytes=10**9,
        pinned_budget_bytes=10**9,
        backend="uva",
    )
    with pytest.raises(PlanError, match="cannot be kept in fp8"):
        plan(index.layers, ClusterSnapshot(nodes=(node,)), PlanOptions(offload_dtype="fp8"))
    # auto: an FP8 checkpoint's weights are simply dequantized while read on such a node
    the_plan = plan(index.layers, ClusterSnapshot(nodes=(node,)), PlanOptions())
    assert all(s.offloaded_bytes == s.offloaded_wide_bytes for s in the_plan.stages)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("offload_dtype", ["fp8", "int8"])
def test_8bit_offloaded_weights_match_transformers_with_them_quantized(
    tmp_path, family: str, offload_dtype: str
) -> None:
    """A bf16 checkpoint through the planner's 3 stages with `offload_dtype`: the offloaded
    matrices live in host memory in 8 bits (<= 0.6x their bytes at these 32-wide rows) and
    are dequantized into the slots after each copy; the logits are bitwise those of
    transformers loading the same files with exactly those matrices quantized and back."""
    from transformers import AutoModelForCausalLM

    index = load_index(make_checkpoint(tmp_path / family, family_shape(family, "bfloat16")))
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    pipeline = Pipeline(index, offload_dtype=offload_dtype)
    try:
        logits = pipeline(ids)
        reference = AutoModelForCausalLM.from_pretrained(str(index.root), dtype=torch.bfloat16)
        changed = 0
        for worker in pipeline.workers:
            spec = worker.spec
            if not spec.offloaded:
                continue
            stats = worker.offloader.stats()
            assert stats.copies and stats.dequant_s > 0
            # what quantizing lost, measured at load on the stage's own weights: e4m3 keeps 3
            # mantissa bits (a few percent), int8 in groups of a row far less
            error = worker.report().quantization_error
            assert 0 < error < (0.05 if offload_dtype == "fp8" else 0.01)
            assert stats.offloaded_bytes <= 0.6 * sum(
                x.unit_bytes(spec.offload_unit) for x in spec.layers if x.name in spec.offloaded
            )
            for layer in spec.layers:
                if layer.name not in spec.offloaded:
                    continue
                found = parameter_formats(layer.unit_tensors(spec.offload_unit), offload_dtype)
                for target, fmt in found.items():
                    param = reference.get_parameter(target)
                    with torch.no_grad():
                        param.copy_(quantized(param, fmt).dequantized(param.dtype))
                    changed += 1
    finally:
        pipeline.close()
    assert changed
    with torch.no_grad():
        expected = reference(ids).logits
    assert torch.equal(logits, expected)
    # `offloadctl run --check`'s reference names the same weights
    from types import SimpleNamespace

    from coordinator.cli.loads import quantized_weights
    from coordinator.tools.reference import reference_logits

    names = quantized_weights(SimpleNamespace(plan=pipeline.plan, index=index))
    assert len(names) == changed
    assert torch.equal(reference_logits(str(index.root), ids, quantized=names), expected)
    with torch.no_grad():  # and the quantization did change them: the test can fail
        wide = AutoModelForCausalLM.from_pretrained(str(index.root), dtype=torch.bfloat16)(
            ids
        ).logits
    assert not torch.equal(wide, expected)


def test_a_replan_reads_again_a_layer_whose_host_form_changes(tmp_path) -> None:
    """An FP8 checkpoint's worker re-planned: a layer that stays offloaded keeps its 8-bit
    bytes (moved, not read), a layer going from 8-bit offloaded to resident, or back, is read
    again from the file (neither conversion is exact); the logits stay transformers' own."""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from coordinator.tools.reference import reference_logits
    from worker.worker import StageWorker

    shape = family_shape("llama", "bfloat16", quantization="fp8-block")
    index = load_index(make_checkpoint(tmp_path / "fp8", shape))
    names = [[layer.name for layer in index.layers]]
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = reference_logits(str(index.root), ids, num_threads=1)
    worker = StageWorker(
        split_spec(index, 0, names, ("layers.1", "layers.3")), device="cpu", num_threads=1
    )
    try:
        worker.load()
        assert torch.equal(worker.forward(ids), expected)
        chunks = worker.reconfigure(split_spec(index, 0, names, ("layers.2", "layers.3")))
        read = {name for i in chunks for name in worker._chunks[i]}
        assert read == {"layers.1", "layers.2"}  # layers.3 stays 8-bit: moved, not read
        for i in chunks:
            worker.load_chunk(i)
        worker.finish_load()
        assert "fp8" in worker.report().offload_format
        assert torch.equal(worker.forward(ids), expected)
    finally:
        worker.close()


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "jamba"]
)
def test_8bits_never_quantize_what_routes(tmp_path, family: str) -> None:
    """`--offload-dtype fp8|int8` keeps an MoE layer's routers and shared-expert gates at the
    model's width (an 8-bit rounding could send a token to other experts), and its norms,
    biases and buffers; every other matrix, the experts' among them, goes to 8 bits."""
    index = load_index(make_checkpoint(tmp_path / family, family_shape(family, "bfloat16")))
    decoders = [layer for layer in index.layers if layer.kind == "decoder"]
    routers = {t.target for layer in decoders for t in layer.tensors if routes(t.target)}
    assert any(name.endswith((".gate.weight", ".router.weight")) for name in routers), routers
    for offload_dtype in ("fp8", "int8"):
        quantized: set[str] = set()
        for layer in decoders:
            found = parameter_formats(layer.tensors, offload_dtype)
            assert not routers & set(found), sorted(routers & set(found))
            biases = {t.target for t in layer.tensors if t.target.endswith("bias")}
            matrices = {
                t.target
                for t in layer.tensors
                if len(t.shape) >= 2 and not t.buffer and t.target not in routers | biases
            }
            assert matrices <= set(found), sorted(matrices - set(found))
            assert not biases & set(found), sorted(biases & set(found))  # gpt-oss's [E, width]
            quantized |= set(found)
        assert any(".experts." in name for name in quantized)


def test_a_block_fp8_files_own_8_bits_are_not_rounded_again_by_the_reference(tmp_path) -> None:
    """Under `--offload-dtype fp8` a block-FP8 checkpoint's offloaded weights stay the file's
    own 8 bits (its numbers as published): nothing for the reference (`run --check`, the soak)
    to round. Under int8 each of them is requantized, and all are named."""
    index = load_index(
        make_checkpoint(
            tmp_path / "fp8", family_shape("llama", "bfloat16", quantization="fp8-block")
        )
    )
    tensors = [t for layer in index.layers if layer.kind == "decoder" for t in layer.tensors]
    kept = parameter_formats(tensors, "fp8")
    assert kept
    for target, fmt in kept.items():  # each kept as the file stores it
        assert {file_format(t) for t in tensors if (t.target or t.name) == target} == {fmt}
    assert requantized_formats(tensors, "fp8") == {}
    assert requantized_formats(tensors, "int8") == parameter_formats(tensors, "int8") != {}
