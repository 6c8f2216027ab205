"""Resident weights kept as stored (issue 54 point 4, the planner's side): a layer offloaded
from a GPU that keeps its quantized matrices as stored frees fewer bytes than its prefetch
slot holds (the slot is at the model's width). The search against a brute force over every
offload subset, the plans such GPUs get, and "auto"'s choice. No Ray is started."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.planning.planner import (
    Plan,
    PlanError,
    PlanOptions,
    plan,
    stored_expert_capacity,
)
from coordinator.planning.search import NodeLimits, Search
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from worker.spec import LayerSpec, TensorSlice

GiB = 1 << 30
FAST = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def one_gpu_search(
    resident: list[int], freed: list[int], slots: list[int], memory: int, step: int
) -> Search:
    """Decoder layers of these resident sizes on one GPU of `memory` bytes with `step` slots,
    each offloaded whole freeing `freed` bytes into a slot of `slots` bytes."""
    node = NodeLimits(gpu_memory_bytes=(memory,), offload_budget_bytes=10**9, link_bytes_per_s=1.0)
    return Search(
        resident,
        [True] * len(resident),
        [node],
        reserve_bytes=0,
        compute_bytes_per_s=1.0,
        offload_sizes=freed,
        slot_units=[slots],
    )


def least_freed(
    freed: list[int], slots: list[int], deficit: int, step: int, conservative: bool
) -> int | None:
    """The fewest bytes freed by an offload subset that makes room for `deficit` bytes beside
    min(step, its size) slots: each slot the largest of the subset's (`conservative`: the largest
    of any layer freeing no more than the subset's largest, the search's rule)."""
    best = None
    for num in range(len(freed) + 1):
        for subset in itertools.combinations(range(len(freed)), num):
            total = sum(freed[i] for i in subset)
            if subset and conservative:
                top = max(freed[i] for i in subset)
                slot = max(w for f, w in zip(freed, slots, strict=True) if f <= top)
            else:
                slot = max((slots[i] for i in subset), default=0)
            if total - min(step, num) * slot >= deficit and (best is None or total < best):
                best = total
    return best


@st.composite
def offload_cases(draw, monotone: bool):
    """Up to 7 layers, each freeing 1-20 bytes into a slot of up to twice that (`monotone`:
    the slot a nondecreasing function of the bytes freed, as for equal layers), on a GPU
    short of room for them."""
    freed = draw(st.lists(st.integers(1, 20), min_size=1, max_size=7))
    if monotone:
        widen = {f: draw(st.integers(0, f)) for f in sorted(set(freed))}
        for low, high in itertools.pairwise(sorted(widen)):  # larger freed: no smaller slot
            widen[high] = max(widen[high], widen[low] + low - high)
        slots = [f + widen[f] for f in freed]
    else:
        slots = [f + draw(st.integers(0, f)) for f in freed]
    resident = [f + draw(st.integers(0, 5)) for f in freed]  # what stays: buffers, norms
    memory = draw(st.integers(1, sum(resident)))
    return resident, freed, slots, memory, draw(st.sampled_from([0, 1, 1, 2]))


def check_against_brute_force(case, monotone: bool) -> None:
    resident, freed, slots, memory, step = case
    search = one_gpu_search(resident, freed, slots, memory, step)
    deficit = sum(resident) - memory
    expected = least_freed(freed, slots, deficit, step, conservative=True)
    if monotone:  # the conservative rule charges exactly what the subset needs
        assert expected == least_freed(freed, slots, deficit, step, conservative=False)
    if expected is None:
        assert search.offload_bytes(0, len(freed), memory, step) is None
        return
    _, moved = search.offloaded_positions(0, len(freed), memory, step)
    assert sum(freed[i] for i in moved) == expected
    # the plan fits: what the chosen layers free covers their own slots
    slot = max((slots[i] for i in moved), default=0)
    assert sum(freed[i] for i in moved) - min(step, len(moved)) * slot >= deficit


@FAST
@given(offload_cases(monotone=False))
def test_offload_choice_matches_brute_force_with_slots_larger_than_what_layers_free(case):
    """The search's least bytes freed equals the brute force's under its conservative slot
    rule, and the layers it picks fit with their own slots."""
    check_against_brute_force(case, monotone=False)


@FAST
@given(offload_cases(monotone=True))
def test_offload_choice_is_exact_where_slots_grow_with_what_layers_free(case):
    """Where equal freed sizes have equal slots and larger ones no smaller slots, the
    conservative rule is no rule: the search is the true optimum."""
    check_against_brute_force(case, monotone=True)


# -- plans of a block-FP8 checkpoint (DeepSeek-V3's layout: 128 x 128 blocks, float32 scales,
# bfloat16 norms and embeddings)

HIDDEN, INTER, VOCAB = 256, 768, 1024


def tensor(name: str, shape: tuple[int, ...], fp8: bool = False) -> TensorSlice:
    """A checkpoint tensor loaded as bfloat16: stored as FP8 in 128 x 128 blocks with their
    float32 scales where `fp8`, else as bfloat16."""
    scale = None
    if fp8:
        grid = tuple(-(-n // 128) for n in shape)
        scale = TensorSlice(
            name=f"{name}_scale_inv",
            dtype="F32",
            shape=grid,
            file="model.safetensors",
            start=0,
            end=4 * math.prod(grid),
        )
    return TensorSlice(
        name=name,
        dtype="F8_E4M3" if fp8 else "BF16",
        shape=shape,
        file="model.safetensors",
        start=0,
        end=math.prod(shape) * (1 if fp8 else 2),
        target=name,
        target_dtype="bfloat16",
        scale=scale,
        block=(128, 128) if fp8 else None,
    )


def fp8_model(num_decoders: int = 16, fp8: bool = True) -> list[LayerSpec]:
    """An embedding, decoder layers whose attention and MLP matrices are block FP8 (`fp8`;
    else bfloat16) beside bfloat16 norms, and a head."""
    layers = [
        LayerSpec(
            name="embed", kind="embed", index=None, tensors=(tensor("embed", (VOCAB, HIDDEN)),)
        )
    ]
    for i in range(num_decoders):
        prefix = f"model.layers.{i}."
        matrices = [(f"self_attn.{m}_proj", (HIDDEN, HIDDEN)) for m in "qkvo"] + [
            ("mlp.gate_proj", (INTER, HIDDEN)),
            ("mlp.up_proj", (INTER, HIDDEN)),
            ("mlp.down_proj", (HIDDEN, INTER)),
        ]
        tensors = [tensor(f"{prefix}{m}.weight", shape, fp8) for m, shape in matrices]
        tensors += [
            tensor(f"{prefix}{norm}.weight", (HIDDEN,))
            for norm in ("input_layernorm", "post_attention_layernorm")
        ]
        layers.append(
            LayerSpec(name=f"layers.{i}", kind="decoder", index=i, tensors=tuple(tensors))
        )
    head = (tensor("model.norm.weight", (HIDDEN,)), tensor("lm_head.weight", (VOCAB, HIDDEN)))
    return [*layers, LayerSpec(name="head", kind="head", index=None, tensors=head)]


def two_gpus(memory_bytes: int, fp8_compute: bool = True) -> ClusterSnapshot:
    """Two GPUs of `memory_bytes` whose link is 40x slower than their compute (an H200's HBM
    against PCIe 5 is about 60x): what decides whether dequantizing resident layers each step
    (`planner.compute_bytes`) pays for the copies it saves."""
    gpus = tuple(GpuInfo(index=i, memory_bytes=memory_bytes) for i in range(2))
    node = NodeInfo(
        node_id="node",
        gpus=gpus,
        host_budget_bytes=GiB,
        fp8_compute=fp8_compute,
        link_bytes_per_s=5e9,
    )
    return ClusterSnapshot(nodes=(node,))


def offloaded_wide(the_plan: Plan) -> int:
    return sum(s.offloaded_wide_bytes for s in the_plan.stages)


def check_stored_stages(the_plan: Plan, layers: list[LayerSpec], snap: ClusterSnapshot) -> None:
    """Each stage's numbers as the worker will find them: resident layers with their quantized
    matrices as stored, slots at width, and the just-in-time buffer, within its GPU."""
    by_name = {layer.name: layer for layer in layers}
    # an MoE model's experts hold compact rows of the buffer (stored_expert_capacity's test)
    capacity = stored_expert_capacity(layers, the_plan.options)
    jit = max(layer.jit_bytes(capacity) for layer in layers)
    memory = {(n.node_id, g.index): g.memory_bytes for n in snap.nodes for g in n.gpus}
    for s in the_plan.stages:
        mine = [by_name[name] for name in s.layers]
        moved = [by_name[name] for name in s.offloaded]
        freed = sum(layer.freed_bytes(s.offload_unit, True) for layer in moved)
        wide = [layer.unit_bytes(s.offload_unit) for layer in moved]
        assert s.resident_stored and s.jit_bytes == jit
        assert s.stored_expert_capacity == capacity
        assert s.resident_bytes == sum(layer.resident_bytes(True) for layer in mine) - freed
        assert s.resident_wide_bytes == sum(layer.nbytes for layer in mine) - sum(wide)
        assert s.offloaded_wide_bytes == sum(wide)
        staging = s.slot_bytes - min(s.prefetch_step, len(moved)) * max(wide, default=0)
        assert 0 <= staging < max(wide, default=1)  # one piece of a weight as stored, or none
        assert s.device_bytes == s.resident_bytes + s.slot_bytes + s.kv_bytes + jit
        assert s.device_bytes <= memory[s.node_id, s.gpu_index]
    assert the_plan.total_bytes == sum(layer.nbytes for layer in layers)
    assert Plan.from_json(the_plan.to_json()) == the_plan


def test_stored_resident_weights_offload_about_half_the_bytes() -> None:
    """Two GPUs of 8 MiB for 16 layers of 1.6 MiB at width: at width the plan offloads 16 MiB
    of them; kept as stored (half the bytes: FP8 values and their scales) with a buffer of one
    layer at width, 9 MiB, and the stages fit. "auto" on FP8 GPUs takes that plan."""
    layers, snap = fp8_model(), two_gpus(8 << 20)
    wide = plan(layers, snap, PlanOptions(resident_weights="wide"))
    stored = plan(layers, snap, PlanOptions(resident_weights="stored"))
    assert offloaded_wide(wide) > 0 and not any(s.resident_stored for s in wide.stages)
    assert 0 < offloaded_wide(stored) <= 0.6 * offloaded_wide(wide)
    assert stored.bottleneck_s < wide.bottleneck_s
    check_stored_stages(stored, layers, snap)
    assert plan(layers, snap, PlanOptions()).stages == stored.stages  # auto
    summary = stored.summary()
    assert (
        "resident quantized matrices kept as stored (FP8/MXFP4 blocks; resident weights " in summary
    )
    assert "on stage(s) 0, 1:" in summary and "(counted in device)" in summary


def test_auto_keeps_resident_weights_wide_unless_fp8_gpus_would_offload() -> None:
    """Resident weights "auto" stay at width on GPUs that do not compute in FP8 (a simulated
    node's too) and where the plan at width offloads nothing; "stored" keeps them as stored on
    any node (how CI tests it), and is "wide" for a checkpoint with no quantized matrices."""
    layers = fp8_model()
    tight, roomy = two_gpus(8 << 20, fp8_compute=False), two_gpus(32 << 20)
    old_gpus = plan(layers, tight, PlanOptions())
    assert old_gpus.stages == plan(layers, tight, PlanOptions(resident_weights="wide")).stages
    assert offloaded_wide(old_gpus) and not any(s.resident_stored for s in old_gpus.stages)
    fits = plan(layers, roomy, PlanOptions())
    assert not offloaded_wide(fits) and not any(s.resident_stored for s in fits.stages)
    forced = plan(layers, tight, PlanOptions(resident_weights="stored"))
    check_stored_stages(forced, layers, tight)
    plain, snap = fp8_model(fp8=False), two_gpus(12 << 20)
    same = plan(plain, snap, PlanOptions(resident_weights="stored"))
    assert same.stages == plan(plain, snap, PlanOptions(resident_weights="wide")).stages
    assert offloaded_wide(same) and not any(s.resident_stored for s in same.stages)


def test_auto_keeps_resident_weights_as_stored_where_the_plan_at_width_does_not_fit() -> None:
    """No host budget: at width 8 layers of 1.6 MiB do not fit two GPUs of 6 MiB; as stored,
    with the buffer of one of them at width on each GPU, they do."""
    layers = fp8_model(8)
    gpus = tuple(GpuInfo(index=i, memory_bytes=6 << 20) for i in range(2))
    snap = ClusterSnapshot(nodes=(NodeInfo(node_id="node", gpus=gpus, fp8_compute=True),))
    with pytest.raises(PlanError, match="the layers do not fit"):
        plan(layers, snap, PlanOptions(resident_weights="wide"))
    memo: dict = {}
    found = plan(layers, snap, PlanOptions(), memo=memo)
    check_stored_stages(found, layers, snap)
    assert found.stages == plan(layers, snap, PlanOptions(resident_weights="stored")).stages
    assert plan(layers, snap, PlanOptions(), memo=memo) == found  # the memo keeps both modes
    tiny = ClusterSnapshot(nodes=(dataclasses.replace(snap.nodes[0], gpus=gpus[:1]),))
    with pytest.raises(PlanError, match="buffer that resident quantized matrices, kept as"):
        plan(layers, tiny, PlanOptions())  # neither fits: the stored plan's error


def test_auto_keeps_resident_weights_wide_where_that_plan_is_faster() -> None:
    """Two GPUs of 5 MiB for 8 layers: as stored, the buffer of a layer at width beside 4
    layers costs more than their halving saves, and more bytes would cross the link; "auto"
    keeps the faster plan at width ("stored" takes the other all the same)."""
    layers, snap = fp8_model(8), two_gpus(5 << 20)
    wide = plan(layers, snap, PlanOptions(resident_weights="wide"))
    stored = plan(layers, snap, PlanOptions(resident_weights="stored"))
    assert stored.bottleneck_s > wide.bottleneck_s
    assert plan(layers, snap, PlanOptions()).stages == wide.stages


@pytest.mark.parametrize(
    ("family", "quantization", "changes", "offloads"),
    [
        ("deepseek_v3", "fp8-block", {}, True),
        ("gpt_oss", "mxfp4", {"intermediate_size": 64}, False),  # MXFP4: a quarter of the bytes
    ],
)
def test_quantized_checkpoints_offload_less_with_resident_weights_stored(
    tmp_path, family: str, quantization: str, changes: dict, offloads: bool
) -> None:
    """Checkpoints `transformers` writes (16 layers) on two GPUs of 30% of their bytes at
    width: kept as stored, their resident layers offload at most 0.6x the bytes, and every
    stage fits as the worker will count it."""
    from test_families import family_shape

    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import make_checkpoint

    shape = family_shape(family, "bfloat16", quantization=quantization, num_layers=16, **changes)
    index = load_index(make_checkpoint(tmp_path / family, shape))
    snap = two_gpus(int(index.total_bytes * 0.3))
    wide = plan(index.layers, snap, PlanOptions(resident_weights="wide"))
    stored = plan(index.layers, snap, PlanOptions())
    assert offloaded_wide(wide) > 0
    assert offloaded_wide(stored) <= 0.6 * offloaded_wide(wide)
    assert (offloaded_wide(stored) > 0) == offloads
    check_stored_stages(stored, index.layers, snap)


def test_workers_get_each_stages_resident_weights() -> None:
    from coordinator.config import JobConfig
    from coordinator.runtime.group import stage_specs

    layers, snap = fp8_model(), two_gpus(8 << 20)
    index = SimpleNamespace(
        root=Path("ckpt"), config={}, dtype="bfloat16", identities=(), layers=layers
    )
    for mode, stored in (("stored", True), ("wide", False)):
        the_plan = plan(layers, snap, PlanOptions(resident_weights=mode))
        specs = stage_specs(JobConfig(checkpoint="ckpt"), index, the_plan, {})
        assert [spec.resident_stored for spec in specs] == [stored] * len(the_plan.stages)


def test_a_stored_layers_step_counts_its_dequantization_and_only_routed_experts(
    tmp_path,
) -> None:
    """The cost model's work of a layer kept as stored: its weights, plus each quantized
    matrix's stored bytes read and width written (the dequantization each step); an MoE
    layer's experts only in the share a step of that many rows is expected to route to."""
    from test_fp8_blocks import CASES

    from coordinator.planning.checkpoint import load_index
    from coordinator.planning.planner import compute_bytes
    from worker.names import expected_experts
    from worker.spec import stored_formats

    index = load_index(CASES["deepseek_v3"](tmp_path / "fp8"))
    dense, moe = index.layers[1], index.layers[2]
    assert not dense.experts and moe.experts == 4
    for layer in (dense, moe):
        assert compute_bytes(layer) == layer.nbytes

    def dequantized(layer, names) -> int:
        formats = stored_formats(layer.tensors)
        return sum(
            formats[t.target].stored_bytes(t.shape) + t.loaded_bytes
            for t in layer.tensors
            if t.target in formats and t.target in names
        )

    everything = {t.target for t in dense.tensors}
    assert compute_bytes(dense, True, 1) == dense.nbytes + dequantized(dense, everything)
    assert compute_bytes(dense, True, 64) == compute_bytes(dense, True, 1)
    experts = {t.target for t in moe.unit_tensors("experts")}
    rest = {t.target for t in moe.tensors} - experts
    for rows in (1, 2, 64):
        share = expected_experts(4, 2, rows) / 4
        assert compute_bytes(moe, True, rows) == moe.nbytes + math.ceil(
            dequantized(moe, rest) + share * dequantized(moe, experts)
        )
    assert compute_bytes(moe, True, 1) < compute_bytes(moe, True, 64)


def test_the_exact_cycle_search_counts_8_bit_copies_as_stored() -> None:
    """On GPUs that keep offloaded FP8 weights in 8 bits, the cycle search (cycle.py) prices
    every range's copies as the plan's stages do: as stored (half the bytes at width) with
    their dequantization, so the cycle it proves optimal is one of the plan's own stage
    times, not one of copies at width."""
    from coordinator.planning import cycle
    from coordinator.planning.search import LayerRange

    layers, snap = fp8_model(), two_gpus(8 << 20)
    memo: dict = {}
    options = PlanOptions(objective="throughput", max_batch=4, micro_batches=2)
    the_plan = plan(layers, snap, dataclasses.replace(options, resident_weights="wide"), memo=memo)
    assert any(0 < s.offloaded_bytes < s.offloaded_wide_bytes for s in the_plan.stages)
    [search] = [value[0] for key, value in memo.items() if isinstance(key, tuple)]
    memory = snap.nodes[0].gpus[0].memory_bytes
    checked = 0
    for start in range(len(layers)):
        for end in range(start + 1, len(layers) + 1):
            time_s = cycle._range_time(search, 0, start, end, memory)
            if time_s is None:
                break
            assert time_s == max(search.stage_times(LayerRange(0, 0, start, end)))
            checked += search.offload_bytes(start, end, memory, 1) > 0
    assert checked  # ranges that offload, whose copies differ at width


def moe_model(num_decoders: int = 4, experts: int = 256, top: int = 8) -> list[LayerSpec]:
    """`fp8_model`'s shape with DeepSeek-V3's routing (`experts` routed experts, `top` per
    token): each decoder's MLP one block-FP8 gate, up and down matrix per expert, as
    DeepSeek's files hold them, beside a bfloat16 router."""
    width = 128
    dense = fp8_model(num_decoders)
    layers = [dense[0]]
    for layer in dense[1:-1]:
        prefix = f"model.layers.{layer.index}."
        attention = [t for t in layer.tensors if ".mlp." not in t.name]
        routed = [
            tensor(f"{prefix}mlp.experts.{e}.{m}.weight", shape, True)
            for e in range(experts)
            for m, shape in (
                ("gate_proj", (width, HIDDEN)),
                ("up_proj", (width, HIDDEN)),
                ("down_proj", (HIDDEN, width)),
            )
        ]
        router = tensor(f"{prefix}mlp.gate.weight", (experts, HIDDEN))
        layers.append(
            dataclasses.replace(
                layer,
                tensors=(*attention, *routed, router),
                experts=experts,
                experts_per_token=top,
            )
        )
    return [*layers, dense[-1]]


def test_stored_experts_hold_the_rows_a_decode_step_routes_to_and_a_quarter_at_least() -> None:
    """Kept as stored, DeepSeek-V3's routing (8 of 256) holds max(max_batch x 8, 64) experts'
    rows of the buffer (every expert from 32 sequences on; a dense model: all of them), and a
    layer's buffer is its attention at width plus that share of its experts at width; the
    plan's stages carry it and the summary says it."""
    layers = moe_model()
    assert [
        stored_expert_capacity(layers, PlanOptions(max_batch=b)) for b in (1, 8, 12, 31, 32)
    ] == [64, 64, 96, 248, 0]
    assert stored_expert_capacity(fp8_model(), PlanOptions(max_batch=1)) == 0
    layer = layers[1]
    attention = 4 * HIDDEN * HIDDEN * 2  # q, k, v, o at bfloat16 width
    experts = 256 * 3 * 128 * HIDDEN * 2
    assert layer.jit_bytes() == attention + experts
    assert layer.jit_bytes(64) == attention + experts // 4
    assert layer.jit_bytes(256) == layer.jit_bytes(0) == attention + experts
    snap = two_gpus(layers[1].resident_bytes(True) * 3)
    the_plan = plan(layers, snap, PlanOptions(resident_weights="stored", max_batch=1))
    check_stored_stages(the_plan, layers, snap)
    assert {s.stored_expert_capacity for s in the_plan.stages} == {64}
    assert {s.jit_bytes for s in the_plan.stages} == {attention + experts // 4}
    assert "its experts' matrices holding 64 experts' rows at a time" in the_plan.summary()
