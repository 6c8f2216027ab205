"""Every supported family, as `save_pretrained` writes it, split into stages by the planner with
layers offloaded, gives the logits `transformers` gives loading the same files in the same dtype
in one process (same thread count): bitwise, in float32 and in bfloat16.

The stages are StageWorkers driven in this process (what a Ray actor runs, without the actor):
one checkpoint per family, several passes: plain, left-padded with a mask, last position only.
The Ray path itself is covered by test_pipeline.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from coordinator.planning.planner import Plan, PlanOptions, plan, stored_expert_capacity
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.runtime.group import stage_specs
from coordinator.runtime.inputs import check_inputs
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from coordinator.tools.reference import reference_logits
from offload.errors import PlanError
from offload.quant import QuantizedTensor
from worker.layout import TESTED_FAMILIES
from worker.spec import StageSpec
from worker.worker import StageWorker

NUM_GPUS = 3
VOCAB = 96
CASES = [(family, "float32") for family in TESTED_FAMILIES] + [
    (family, "bfloat16")
    for family in ("llama", "qwen3", "mixtral", "deepseek_v3", "qwen3_next", "bamba")
]
NO_GQA = ("gpt2", "gpt_neox")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[tuple[str, str], CheckpointIndex] = {}

    def get(family: str, dtype: str) -> CheckpointIndex:
        if (family, dtype) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{dtype}") / "ckpt"
            made[family, dtype] = load_index(make_checkpoint(root, family_shape(family, dtype)))
        return made[family, dtype]

    return get


def family_shape(family: str, dtype: str = "float32", **changes) -> CheckpointShape:
    """The families' test checkpoint: 4 layers, hidden 32, 4 heads (2 KV heads where the family
    groups them), intermediate 48, the tests' vocabulary, several shards."""
    defaults = dict(
        arch=family,
        num_layers=4,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4 if family in NO_GQA else 2,
        intermediate_size=48,
        vocab_size=VOCAB,
        dtype=dtype,
        max_positions=64,
        max_shard_bytes=40_000,
    )
    return CheckpointShape(**{**defaults, **changes})


def offloading_plan(
    index: CheckpointIndex,
    offload_dtype: str = "auto",
    expert_fetch: str = "layer",
    resident_weights: str = "auto",
) -> Plan:
    """The planner's split on three GPUs too small to hold the model resident together (two
    where three cannot offload: 8-bit layers need a staging buffer beside their slot, so
    offloading one layer of a GPU saves nothing, and DeepSeek's dense first layer is a sixth of
    its MoE layers). Resident weights "stored": the layers' sizes as stored, and each GPU the
    buffer of one layer at width besides."""
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    options = PlanOptions(
        offload_dtype=offload_dtype, expert_fetch=expert_fetch, resident_weights=resident_weights
    )
    stored = resident_weights == "stored"
    total = sum(layer.resident_bytes(stored) for layer in index.layers)
    held = max(layer.resident_bytes(stored) for layer in index.layers if layer.kind == "decoder")
    capacity = stored_expert_capacity(index.layers, options)  # experts in compact rows
    jit = max(layer.jit_bytes(capacity) for layer in index.layers) if stored else 0
    for num_gpus in (NUM_GPUS, 2):
        # at least the largest layer and a little
        budget = max(total // num_gpus - held // 4, decoder + decoder // 16) + jit
        the_plan = fitting_plan(index, options, num_gpus, budget)
        if the_plan and len(the_plan.stages) >= 2 and any(s.offloaded for s in the_plan.stages):
            return the_plan
        # else no plan, or more memory would not offload either
    raise AssertionError(f"no budget gives {index.family} a split that offloads")


def fitting_plan(
    index: CheckpointIndex, options: PlanOptions, num_gpus: int, budget: int, tries: int = 32
) -> Plan | None:
    """The planner's plan of `index` on one node of `num_gpus` equal GPUs of `budget` bytes,
    the budget raised by a sixteenth of the largest decoder layer until one fits (None after
    `tries`); hosts of 1 GB."""
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    for _ in range(tries):
        gpus = tuple(GpuInfo(index=i, memory_bytes=budget) for i in range(num_gpus))
        node = NodeInfo(
            node_id="node",
            hostname="node",
            gpus=gpus,
            host_budget_bytes=10**9,
            pinned_budget_bytes=10**9,
        )
        try:
            return plan(index.layers, ClusterSnapshot(nodes=(node,)), options)
        except PlanError:
            budget += decoder // 16
    return None


class Pipeline:
    """The plan's stages as in-process workers, one thread each (as the reference)."""

    def __init__(
        self,
        index: CheckpointIndex,
        groups: list[list[str]] | None = None,
        offloaded: tuple[str, ...] = (),
        unit: str = "layer",
        offload_dtype: str = "auto",
        expert_fetch: str = "layer",
        resident_weights: str = "auto",
        expert_cache: int = 0,
        host_expert_rows: int = 0,
    ) -> None:
        """The planner's split (offloaded weights kept as `offload_dtype` says, resident ones
        as `resident_weights` does), or `groups` of layers with `offloaded` ones offloaded
        (their `unit`: all of them, or their experts or MLP); their experts fetched as
        `expert_fetch` says (routed: with caches of `expert_cache` rows, calls of at most
        `host_expert_rows` rows on the host)."""
        self.index = index
        if groups is None:
            self.plan = offloading_plan(index, offload_dtype, expert_fetch, resident_weights)
            specs = stage_specs(JobConfig(checkpoint=str(index.root)), index, self.plan, {})
        else:
            specs = [
                dataclasses.replace(
                    split_spec(index, stage, groups, offloaded, unit),
                    offload_dtype=offload_dtype,
                    expert_fetch=expert_fetch,
                    expert_cache=expert_cache,
                    host_expert_rows=host_expert_rows,
                )
                for stage in range(len(groups))
            ]
        self.workers = [StageWorker(spec, device="cpu", num_threads=1) for spec in specs]
        for worker in self.workers:
            worker.load()

    def __call__(self, ids, mask=None, logits_to_keep=0) -> torch.Tensor:
        x, mask, positions, keep = check_inputs(ids, mask, logits_to_keep, VOCAB)
        for worker in self.workers:
            x = worker.forward(x, mask, positions, keep)
        return x

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def reference(index: CheckpointIndex, ids, **kwargs) -> torch.Tensor:
    return reference_logits(str(index.root), ids, num_threads=1, **kwargs)


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_family_matches_transformers(checkpoints, family: str, dtype: str) -> None:
    index = checkpoints(family, dtype)
    assert index.dtype == dtype and index.family == family
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, (2, 14), generator=generator)  # longer than every window
    pipeline = Pipeline(index)
    try:
        logits = pipeline(ids)
        again = pipeline(ids)  # a second pass through the prefetch schedule
        last = pipeline(ids, logits_to_keep=1)
        reports = [worker.report() for worker in pipeline.workers]
    finally:
        pipeline.close()
    expected = reference(index, ids)
    assert logits.dtype == expected.dtype == getattr(torch, dtype)
    assert torch.equal(logits, expected) and torch.equal(again, expected)
    assert last.shape == (2, 1, VOCAB)
    assert torch.equal(last, reference(index, ids, logits_to_keep=1))
    # The stages held what the plan said, and read exactly their layers' bytes.
    for report, stage in zip(reports, pipeline.plan.stages, strict=True):
        assert report.offloaded == stage.offloaded
        share = sum(x.file_bytes for x in index.layers if x.name in stage.layers)
        assert report.bytes_read == share
    offloaded = sum(r.stats.offloaded_bytes for r in reports)
    planned = sum(s.offloaded_bytes for s in pipeline.plan.stages)
    assert offloaded == planned > 0


@pytest.mark.parametrize("family", TESTED_FAMILIES)
def test_left_padded_rows_get_the_unpadded_logits(checkpoints, family: str) -> None:
    """A batch of a full row and a left-padded one: each row's logits are what transformers
    gives that row alone (to float32 rounding: the shapes differ), and bitwise what it gives
    the same padded batch with the same mask and positions."""
    index = checkpoints(family, "float32")
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(2, VOCAB, (2, 12), generator=generator)
    pad = 5
    ids[1, :pad] = 0
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    pipeline = Pipeline(index)
    try:
        logits = pipeline(ids, mask)
        last = pipeline(ids, mask, logits_to_keep=1)
    finally:
        pipeline.close()
    _, _, positions, _ = check_inputs(ids, mask, 0, VOCAB)
    assert positions[1].tolist() == [0] * pad + list(range(12 - pad))
    batched = reference(index, ids, attention_mask=mask, position_ids=positions)
    assert torch.equal(logits, batched)
    kept = reference(index, ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
    assert torch.equal(last, kept)
    for row, start in ((0, 0), (1, pad)):
        alone = reference(index, ids[row : row + 1, start:])
        torch.testing.assert_close(logits[row : row + 1, start:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["granite", "gpt2", "gemma2", "qwen2_moe"])
def test_stages_of_only_an_embedding_or_only_a_head(checkpoints, family: str) -> None:
    """The splits the planner rarely makes: a stage of the embedding alone (its output is what
    the model feeds its first block: Granite's multiplier and GPT-2's positions applied once)
    and one of the head alone (the final norm and the model's own logit processing)."""
    index = checkpoints(family, "float32")
    names = [layer.name for layer in index.layers]
    ids = torch.randint(2, VOCAB, (1, 13), generator=torch.Generator().manual_seed(3))
    groups = [names[:1], names[1:3], names[3:-1], names[-1:]]
    assert torch.equal(
        run_split(index, ids, groups, offloaded=("layers.1",)), reference(index, ids)
    )


def split_spec(
    index: CheckpointIndex,
    stage: int,
    groups: list[list[str]],
    offloaded: tuple,
    unit: str = "layer",
) -> StageSpec:
    """Stage `stage` of a hand-made split: layers `groups[stage]`, `offloaded` ones offloaded."""
    group = groups[stage]
    return StageSpec(
        stage=stage,
        num_stages=len(groups),
        checkpoint_dir=str(index.root),
        config=index.config,
        dtype=index.dtype,
        layers=tuple(layer for layer in index.layers if layer.name in group),
        offloaded=tuple(n for n in group if n in offloaded),
        offload_unit=unit,
    )


def run_split(
    index: CheckpointIndex, ids, groups: list[list[str]], offloaded: tuple
) -> torch.Tensor:
    """`ids` through in-process workers holding `groups` of layers, `offloaded` ones offloaded."""
    pipeline = Pipeline(index, groups, offloaded)
    try:
        return pipeline(ids)
    finally:
        pipeline.close()


@pytest.mark.parametrize(
    ("family", "unit", "pattern"),
    [
        ("mixtral", "experts", "mlp.experts."),
        ("qwen3_moe", "experts", "mlp.experts."),
        ("llama", "mlp", "mlp."),
        ("qwen2_moe", "mlp", "mlp."),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_part_of_each_layer_offloaded(
    checkpoints, family: str, unit: str, pattern: str, dtype: str
) -> None:
    """Sub-layer offload: of three offloaded layers only their experts (or MLP) go to host
    memory and come back through the prefetch slot; attention, norms and the router stay on
    the device. Bitwise the logits of transformers, over two passes of the prefetch schedule,
    with exactly the unit's bytes in the arena (what the planner counts for it)."""
    index = checkpoints(family, dtype)
    names = [layer.name for layer in index.layers]
    moved = ("layers.0", "layers.1", "layers.3")
    ids = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))
    pipeline = Pipeline(index, [names[:3], names[3:]], offloaded=moved, unit=unit)
    try:
        first, second = pipeline(ids), pipeline(ids)
        stats = [worker.report().stats for worker in pipeline.workers]
        placed = pipeline.workers[0]._placement
        held = dict(placed.modules["layers.1"].named_parameters())
    finally:
        pipeline.close()
    expected = reference(index, ids)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    by_name = {layer.name: layer for layer in index.layers}
    assert sum(s.offloaded_bytes for s in stats) == sum(by_name[n].unit_bytes(unit) for n in moved)
    assert 0 < by_name["layers.1"].unit_bytes(unit) < by_name["layers.1"].nbytes
    # the offloaded unit's parameters are views of the stage's prefetch slot, the rest its own
    slot = {p.untyped_storage().data_ptr() for n, p in held.items() if n.startswith(pattern)}
    rest = {p.untyped_storage().data_ptr() for n, p in held.items() if not n.startswith(pattern)}
    assert len(slot) == 1 and not slot & rest and any(n.startswith("self_attn.") for n in held)


def test_what_the_model_keeps_in_float32_stays_in_float32(tmp_path) -> None:
    """DeepSeek-V3 keeps its router's score-correction bias in float32
    (`_keep_in_fp32_modules_strict`) while save_pretrained of a bf16 model writes it in BF16:
    it is read into float32, as from_pretrained gives it, and the logits match (bitwise). Also
    shows a family outside the tested list (MLA attention, shared experts) loading."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3",
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if (
                tensor.is_floating_point()
                and tensor.numel() > 1
                and bool((tensor == tensor.flatten()[0]).all())
            ):
                tensor.normal_(0.5, 0.1)  # constant after init (norms, the bias): make it count
    model.save_pretrained(tmp_path / "dsv3")
    index = load_index(tmp_path / "dsv3")
    bias = [t for layer in index.layers for t in layer.tensors if "e_score_correction" in t.name]
    assert bias and {(t.dtype, t.target_dtype) for t in bias} == {("BF16", "float32")}
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    # Both MoE layers offloaded: the bias is a buffer, read into the device even so.
    logits = run_split(
        index,
        ids,
        [["embed", "layers.0", "layers.1"], ["layers.2", "head"]],
        offloaded=("layers.1", "layers.2"),
    )
    assert torch.equal(logits, reference(index, ids))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "deepseek_v3"])
def test_block_fp8_checkpoints_load_as_transformers_reads_them(tmp_path, family: str) -> None:
    """A block-FP8 checkpoint as DeepSeek-V3 publishes it (`make-checkpoint --quantization
    fp8-block`: the linear weights in float8_e4m3fn, a float32 scale per block) loads through the
    planner's 3 stages with layers offloaded: resident weights dequantized while read as
    transformers dequantizes them on a CPU, offloaded ones kept in host memory as stored (8
    bits and the scales: at most 0.55x their 16-bit bytes) and dequantized into their device
    slot after each copy: logits bitwise equal to transformers loading the same files (bf16),
    plain and left-padded. The bytes read count as stored."""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    shape = family_shape(family, "bfloat16", quantization="fp8-block")
    index = load_index(make_checkpoint(tmp_path / family, shape))
    eight = [t for layer in index.layers for t in layer.tensors if t.scale is not None]
    assert eight and all(t.dtype == "F8_E4M3" and t.target_dtype == "bfloat16" for t in eight)
    assert index.file_bytes < index.total_bytes
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    pipeline = Pipeline(index)
    try:
        assert any(s.offloaded for s in pipeline.plan.stages)
        logits, padded = pipeline(ids), pipeline(ids, mask)
        for worker in pipeline.workers:
            if not worker.spec.offloaded:
                continue
            wide = sum(
                layer.unit_bytes(worker.spec.offload_unit)
                for layer in worker.spec.layers
                if layer.name in worker.spec.offloaded
            )
            stats = worker.offloader.stats()
            assert 0 < stats.offloaded_bytes <= 0.55 * wide
            held = worker.offloader.host_tensors().values()
            assert any(isinstance(h, QuantizedTensor) for h in held)
            assert stats.copies and stats.dequant_s > 0
    finally:
        pipeline.close()
    assert torch.equal(logits, reference(index, ids))
    assert torch.equal(padded, reference(index, ids, attention_mask=mask, position_ids=positions))
