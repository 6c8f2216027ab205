"""Resident quantized weights kept as stored on the device (issue 54, point 4): an FP8 or
MXFP4 checkpoint's resident matrices take their stored bytes on the GPU (1 byte an entry and
its block's scale, not bf16's 2), each layer's dequantized into one shared buffer just before
it runs (`offload.resident`). The numbers are the ones the format defines: the same logits as
transformers loading the independently dequantized files, bitwise, over stages that also
offload; and the device holds the stored bytes plus one layer at width.

On the CPU the stand-in GPU is the CPU, so CI checks every number here; tests/test_gpu.py
checks the same on a real GPU when one is lent.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_families import VOCAB, split_spec
from test_fp8_blocks import (
    CASES,
    deepseek_v3,
    dequantized_copy,
    llama,
    matches_reference,
    random_fp8,
)
from test_generation import REQUESTS, alone, prompts, run_joining
from test_mxfp4 import gpt_oss
from torch import nn

from coordinator.planning.checkpoint import load_index
from coordinator.runtime.inputs import check_inputs
from coordinator.tools.make_checkpoint import MOE_ARCHITECTURES, CheckpointShape, make_checkpoint
from coordinator.tools.reference import reference_logits
from offload.errors import OffloadError
from offload.quant import BlockFormat, QuantizedTensor
from offload.resident import StoredResidency
from worker.spec import stored_formats
from worker.worker import StageWorker

FP8 = torch.float8_e4m3fn


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(40, 72, bias=False, dtype=torch.bfloat16, device="meta")
        self.down = nn.Linear(72, 40, bias=True, dtype=torch.bfloat16, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_each_layer_is_dequantized_into_the_shared_buffer_just_before_it_runs() -> None:
    """Two layers kept as stored share one buffer (the larger layer's width): each computes
    with its own weights, bitwise the dequantized ones, whichever ran last; the stored bytes
    are the values and scales; close lets the memory go."""
    fmt = BlockFormat(FP8, (32, 32))  # partial blocks: 72 rows, 40 columns
    layers = [TwoLinears(), TwoLinears()]
    stored = {
        layer: {"up.weight": random_fp8((72, 40), fmt, seed=i), "down.weight": None}
        for i, layer in enumerate(layers)
    }
    for i, layer in enumerate(layers):
        stored[layer]["down.weight"] = random_fp8((40, 72), fmt, seed=10 + i)
        layer.down.bias = nn.Parameter(torch.randn(40, dtype=torch.bfloat16))
    residency = StoredResidency(torch.device("cpu"))
    kept = residency.keep(
        {layer: {name: q.fmt for name, q in by_name.items()} for layer, by_name in stored.items()}
    )
    for layer, by_name in stored.items():
        for name, q in by_name.items():
            kept[layer][name].copy_(q)  # what the loader reads from the file
    with pytest.raises(RuntimeError, match="once per stage"):
        residency.keep({})
    # one buffer at the model's width for all: both layers' weights view it
    assert residency.buffer_bytes >= 2 * 72 * 40 * 2
    assert layers[0].up.weight.untyped_storage().data_ptr() == (
        layers[1].up.weight.untyped_storage().data_ptr()
    )
    assert residency.stored_bytes == sum(q.nbytes for b in stored.values() for q in b.values())
    assert residency.wide_bytes == 2 * 2 * 72 * 40 * 2
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    wide = [
        TwoLinears().to_empty(device="cpu").requires_grad_(False) for _ in layers
    ]  # the same layers dequantized at load
    for plain, layer in zip(wide, layers, strict=True):
        plain.up.weight.copy_(stored[layer]["up.weight"].dequantized(torch.bfloat16))
        plain.down.weight.copy_(stored[layer]["down.weight"].dequantized(torch.bfloat16))
        plain.down.bias.copy_(layer.down.bias)
    with torch.no_grad():
        for order in ([0, 1], [1, 0], [1, 1, 0]):
            for i in order:
                assert torch.equal(layers[i](x), wide[i](x)), order
    assert residency.describe() == "fp8 (32x32 blocks) x 4"
    residency.close()
    assert residency.stored_bytes == residency.buffer_bytes == 0
    assert all(p.is_meta for layer in layers for p in [layer.up.weight, layer.down.weight])
    with torch.no_grad():
        assert torch.equal(wide[0](x), wide[0](x))  # no hook left on anything else


@dataclasses.dataclass
class Held:
    """What a worker held, read before it closed."""

    report: object
    device_bytes: int
    stored_bytes: int
    buffer_bytes: int
    split_calls: int = 0  # compact experts calls split into runs of rows


@pytest.mark.parametrize("case", ["llama-192", "gpt_oss-mxfp4", "deepseek_v3"])
def test_the_planners_stored_stages_give_transformers_numbers(tmp_path, case: str) -> None:
    """The planner's offloading split with resident weights "stored" (12 layers: kept as
    stored, a GPU offloads only where what three layers free pays for the buffer and a slot
    at width): every stage keeps its resident quantized matrices as stored, beside 8-bit (or
    4-bit) offloaded layers; logits (plain and left-padded) bitwise transformers' on the
    dequantized files, and greedy generation under the engine's batching token for token.
    The MoE models' experts (top 2 of 4) hold the planner's compact rows (2: one sequence's
    step), so their prompts run in split calls and their steps in one."""
    if case == "gpt_oss-mxfp4":
        root = reference = gpt_oss(tmp_path / "mxfp4", num_layers=12)
    elif case == "deepseek_v3":
        root = deepseek_v3(tmp_path / "fp8", "float32", num_layers=8)
        reference = dequantized_copy(root, tmp_path / "bf16")
    else:  # the partial 128-blocks of a 192-wide llama
        root = llama(
            tmp_path / "fp8", "float32", hidden=192, intermediate=384, block=128, num_layers=12
        )
        reference = dequantized_copy(root, tmp_path / "bf16")

    rows = {"llama-192": 0, "gpt_oss-mxfp4": 2, "deepseek_v3": 2}[case]

    def compact(workers) -> bool:  # the MoE experts: 2 rows of 4, DeepSeek's prompts split
        capacities = {w.spec.stored_expert_capacity for w in workers}
        splits = sum(w._placement.residency.split_calls for w in workers)
        # (the small gpt-oss's stored layers route all rows of a prompt to few pairs)
        return capacities == {rows} and (bool(splits) or case != "deepseek_v3")

    matches_reference(root, reference, case, resident_weights="stored", check_stored=compact)


def stored_workers(
    index, groups, offloaded, unit: str = "layer", *, stored: bool, capacity: int
) -> list[StageWorker]:
    """In-process CPU workers (not loaded) of a hand-made split, keeping their resident
    matrices as stored or not, their experts modules holding `capacity` experts' rows."""
    return [
        StageWorker(
            dataclasses.replace(
                split_spec(index, s, groups, offloaded, unit),
                resident_stored=stored,
                stored_expert_capacity=capacity,
            ),
            device="cpu",
            num_threads=1,
        )
        for s in range(len(groups))
    ]


def _run(
    index, groups, offloaded, unit, stored: bool, ids, capacity: int = 0
) -> tuple[torch.Tensor, list[Held]]:
    """`ids` through in-process workers of a hand-made split (`capacity`: the experts' rows
    its stored experts modules hold); their logits (run twice: the second pass must agree)
    and what each held."""
    workers = stored_workers(index, groups, offloaded, unit, stored=stored, capacity=capacity)
    try:
        for worker in workers:
            worker.load()
        outs = []
        for _ in range(2):
            x, mask, positions, keep = check_inputs(ids, None, 0, VOCAB)
            for worker in workers:
                x = worker.forward(x, mask, positions, keep)
            outs.append(x)
        assert torch.equal(outs[0], outs[1])
        return outs[0], [
            Held(
                w.report(),
                w.device_bytes(),
                w._placement.residency.stored_bytes,
                w._placement.residency.buffer_bytes,
                w._placement.residency.split_calls,
            )
            for w in workers
        ]
    finally:
        for worker in workers:
            worker.close()


def _checkpoint(case: str, root: Path) -> tuple[Path, Path]:
    """(the quantized checkpoint, the files transformers loads as the reference)."""
    if case == "gpt_oss-mxfp4":  # transformers dequantizes MXFP4 itself (Mxfp4Config)
        path = gpt_oss(root / "mxfp4")
        return path, path
    path = CASES[case](root / "fp8")
    return path, dequantized_copy(path, root / "bf16")


@pytest.mark.parametrize("case", ["deepseek_v3", "kimi_k2-e8m0", "qwen3-bf16", "gpt_oss-mxfp4"])
def test_stored_resident_layers_give_the_formats_numbers(tmp_path, case: str) -> None:
    """Stages that keep resident quantized matrices as stored, beside offloaded layers (whole,
    and by MLP or experts: the rest of such a layer stays resident as stored too): logits
    bitwise transformers' on the dequantized files; the device holds each stored matrix's
    values and scales and one buffer at width instead of its width bytes."""
    root, reference = _checkpoint(case, tmp_path)
    index = load_index(root)
    names = [layer.name for layer in index.layers]
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    expected = reference_logits(str(reference), ids, dtype="bfloat16", num_threads=1)
    groups = [names[: len(names) // 2], names[len(names) // 2 :]]
    decoders = [n for n in names if n.startswith("layers.")]
    offloaded = tuple(decoders[1::2])  # MoE layers in DeepSeek (its first is dense)
    unit = "experts" if index.config.get("num_local_experts") or "v3" in case else "mlp"
    for offload_unit in ("layer", unit):
        logits, stages = _run(index, groups, offloaded, offload_unit, True, ids)
        assert torch.equal(logits, expected), (case, offload_unit)
        for held in stages:
            report = held.report
            layers = [layer for layer in index.layers if layer.name in report.layers]
            # what the worker keeps as stored: every quantized matrix of its resident layers
            # (and, offloading by a part, those outside it of its offloaded layers)
            kept = sum(
                len(stored_formats(layer.tensors))
                for layer in layers
                if layer.name not in offloaded
            )
            held_count = sum(int(n) for n in _counts(report.resident_format))
            assert held_count == kept if offload_unit == "layer" else held_count >= kept
            assert bool(held.stored_bytes) == bool(held_count)
            if held_count:
                assert report.stats.resident_bytes < sum(
                    layer.nbytes for layer in layers if layer.name not in offloaded
                )
            assert held.device_bytes == report.device_used_bytes
    wide, wide_stages = _run(index, groups, offloaded, "layer", False, ids)
    assert torch.equal(wide, expected)
    assert all(not held.report.resident_format for held in wide_stages)


def _counts(described: str) -> list[str]:
    """The counts in a residency's description ("fp8 (32x32 blocks) x 4, ..." -> ["4"])."""
    return [part.rsplit(" x ", 1)[1] for part in described.split(", ") if " x " in part]


def test_a_stage_of_many_stored_layers_holds_about_half_their_bytes(tmp_path) -> None:
    """A DeepSeek-V3-shaped stage holding all its layers resident: the device holds the FP8
    values and scales (about half their bf16 bytes) plus one layer at width, exactly what
    `LayerSpec.resident_bytes(stored=True)` and `jit_bytes` say the planner must count."""
    root = CASES["deepseek_v3"](tmp_path / "fp8")
    index = load_index(root)
    names = [[layer.name for layer in index.layers]]
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    _, [wide] = _run(index, names, (), "layer", False, ids)
    _, [stored] = _run(index, names, (), "layer", True, ids)
    layers = index.layers
    # (the CPU stand-in counts parameters: the router's bias buffers aside)
    buffers = sum(t.loaded_bytes for layer in layers for t in layer.tensors if t.buffer)
    assert wide.device_bytes == sum(layer.resident_bytes() for layer in layers) - buffers
    planned = sum(layer.resident_bytes(True) for layer in layers) - buffers
    # the stored matrices' values and scales: what they take as stored, less the rest
    assert stored.stored_bytes == sum(
        layer.resident_bytes(True) - layer.resident_bytes() + layer.jit_bytes() for layer in layers
    )
    buffer = max(layer.jit_bytes() for layer in layers)
    assert buffer <= stored.buffer_bytes <= buffer + 64 * 32  # each matrix aligned
    assert stored.device_bytes == planned + stored.buffer_bytes
    assert planned / wide.device_bytes < 0.56  # FP8 and its float32 block scales: about half
    assert stored.report.stats.buffer_bytes == stored.buffer_bytes


def test_an_moe_layer_dequantizes_only_the_experts_a_step_routes_to(tmp_path, monkeypatch) -> None:
    """A stored MoE layer's experts are dequantized once the router has chosen, only those a
    row routes to: one token of DeepSeek-V3's top-2 of 4 dequantizes 2 experts' rows of each
    expert matrix per MoE layer, not 4; a call without readable routing dequantizes all."""
    import offload.resident as resident

    root = CASES["deepseek_v3"](tmp_path / "fp8")
    index = load_index(root)
    top, experts = index.config["num_experts_per_tok"], index.config["n_routed_experts"]
    moe = [layer for layer in index.layers if layer.experts]
    calls: list[tuple[int, ...]] = []
    original = resident.dequantize_into

    def counting(dst, src):
        calls.append(tuple(dst.shape))
        original(dst, src)

    monkeypatch.setattr(resident, "dequantize_into", counting)
    names = [[layer.name for layer in index.layers]]
    ids = torch.tensor([[5]])
    logits, _ = _run(index, names, (), "layer", True, ids)
    gate_up = [c for c in calls if c == (96 * 2, 256)]  # one expert's rows of gate_up_proj
    # two forwards (_run checks a second pass), each MoE layer: its top experts, not all
    assert len(gate_up) == 2 * len(moe) * top < 2 * len(moe) * experts
    reference = dequantized_copy(root, tmp_path / "bf16")
    assert torch.equal(
        logits, reference_logits(str(reference), ids, dtype="bfloat16", num_threads=1)
    )


@pytest.mark.parametrize(
    ("case", "capacity"), [("deepseek_v3", 2), ("kimi_k2-e8m0", 8), ("gpt_oss-mxfp4", 4)]
)
def test_experts_in_compact_rows_give_the_formats_numbers(tmp_path, case, capacity) -> None:
    """Stored experts modules holding only `capacity` experts' rows (the fewest a token routes
    to): a prompt whose calls route to more is split into groups of rows, a one-token step is
    not; logits bitwise transformers' on the dequantized files (gpt-oss: its per-expert
    biases gathered with the rows); the buffer is smaller than with every expert's rows."""
    if case == "gpt_oss-mxfp4":  # its top 4 of 8 (the shrunk default routes to all 4 of 4)
        root = reference = gpt_oss(tmp_path / "mxfp4", num_experts=8)
    else:
        root, reference = _checkpoint(case, tmp_path)
    index = load_index(root)
    names = [layer.name for layer in index.layers]
    groups = [names[: len(names) // 2], names[len(names) // 2 :]]
    decoders = [n for n in names if n.startswith("layers.")]
    assert capacity < max(layer.experts for layer in index.layers)
    prompt = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    one = torch.tensor([[11]])
    for ids, split in ((prompt, True), (one, False)):
        expected = reference_logits(str(reference), ids, dtype="bfloat16", num_threads=1)
        logits, stages = _run(index, groups, tuple(decoders[-1:]), "layer", True, ids, capacity)
        assert torch.equal(logits, expected), (case, ids.shape)
        assert bool(sum(held.split_calls for held in stages)) == split
    _, full = _run(index, groups, tuple(decoders[-1:]), "layer", True, one)
    assert sum(h.buffer_bytes for h in stages) < sum(h.buffer_bytes for h in full)


@pytest.mark.parametrize("arch", [a for a in MOE_ARCHITECTURES if a != "gpt_oss"])
def test_each_moe_familys_fp8_experts_in_compact_rows_give_transformers_numbers(
    tmp_path, arch: str
) -> None:
    """Every MoE family written as block FP8 (32-blocks, top 2 of 6 experts), its stored
    experts in 2 compact rows over two stages: a prompt of two rows splits into groups, and
    the logits are bitwise transformers' on the dequantized files (gpt-oss, MXFP4:
    `test_experts_in_compact_rows_give_the_formats_numbers`), and each stage's buffer is what
    the planner counts for it (`LayerSpec.jit_bytes` of the compact rows)."""
    shape = CheckpointShape(
        arch=arch,
        dtype="bfloat16",
        quantization="fp8-block",
        fp8_block=32,
        num_experts=6,
        experts_per_token=2,
        vocab_size=VOCAB,
        tokenizer=False,
    )
    root = make_checkpoint(tmp_path / "fp8", shape)
    reference = dequantized_copy(root, tmp_path / "bf16")
    index = load_index(root)
    names = [layer.name for layer in index.layers]
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    expected = reference_logits(str(reference), ids, dtype="bfloat16", num_threads=1)
    groups = [names[: len(names) // 2], names[len(names) // 2 :]]
    logits, stages = _run(index, groups, (), "layer", True, ids, 2)
    assert sum(held.split_calls for held in stages) > 0
    assert torch.equal(logits, expected), arch
    # the buffer each stage holds is what the planner counts for its layers in compact rows
    by_name = {layer.name: layer for layer in index.layers}
    for group, held in zip(groups, stages, strict=True):
        planned = max(by_name[name].jit_bytes(2) for name in group)
        assert planned <= held.buffer_bytes <= planned + 256 * 16, (arch, group)  # aligned


def test_joining_and_leaving_requests_over_compact_rows_equal_transformers_alone(tmp_path) -> None:
    """Continuous batching over stages whose stored experts hold 2 of DeepSeek-V3's 4 rows:
    requests join and leave mid-generation (test_generation's schedule), so each step's call
    groups the rows of whichever sequences run together; each request's greedy tokens equal
    transformers' on its prompt alone, on the dequantized files."""
    root = CASES["deepseek_v3"](tmp_path / "fp8")
    reference = load_index(dequantized_copy(root, tmp_path / "bf16"))
    index = load_index(root)
    names = [layer.name for layer in index.layers]
    groups = [names[: len(names) // 2], names[len(names) // 2 :]]
    workers = stored_workers(index, groups, (), stored=True, capacity=2)
    try:
        for worker in workers:
            worker.load()
        ids = prompts(seed=4)
        ours, _ = run_joining(SimpleNamespace(workers=workers, index=index), ids)
        splits = sum(w._placement.residency.split_calls for w in workers)
    finally:
        for worker in workers:
            worker.close()
    assert splits > 0
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(reference, prompt, new)


def test_a_compact_experts_call_is_run_on_the_routed_experts_rows_in_expert_order() -> None:
    """The module's own forward sees its experts' rows renumbered in expert order (rows 0.. of
    the compact buffer, each the expert's weights), its other per-expert tensors gathered the
    same way and num_experts the capacity, all put back after; a call routing to more experts
    than the rows hold runs in groups of rows (rows that share experts together), each
    group's output put back at its rows; a call without routing indices is refused, naming
    the module."""
    fmt = BlockFormat(FP8, (8, 32))
    seen: list[tuple] = []

    class Biased(Experts):
        num_experts = 5

        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.gate_up_proj = nn.Parameter(
                torch.empty(5, 8, 32, dtype=torch.bfloat16, device="meta")
            )
            self.bias = nn.Parameter(torch.arange(5, dtype=torch.bfloat16)[:, None].repeat(1, 8))

        def forward(self, x, top_k_index=None):
            seen.append(
                (
                    top_k_index.tolist(),
                    self.num_experts,
                    self.gate_up_proj.clone(),
                    self.bias[:, 0].tolist(),
                )
            )
            # each row: its experts' first weight and bias entries, summed in index order
            w = self.gate_up_proj[top_k_index, 0, 0] + self.bias[top_k_index, 0]
            return x + w.sum(dim=-1, keepdim=True)

    layer = MoeLayer()
    layer.experts = Biased()
    residency = StoredResidency(torch.device("cpu"), expert_capacity=3)
    [kept] = residency.keep({layer: {"experts.gate_up_proj": fmt}}).values()
    source = random_fp8((5, 8, 32), fmt, seed=5)
    kept["experts.gate_up_proj"].copy_(source)
    wide = source.dequantized(torch.bfloat16)
    assert tuple(layer.experts.gate_up_proj.shape) == (3, 8, 32)
    x = torch.zeros(3, 1, dtype=torch.bfloat16)
    out = layer(x, torch.tensor([[4, 1], [1, 4], [1, 2]]))  # experts 1, 2, 4: one run
    index, count, weights, bias = seen[-1]
    assert index == [[2, 0], [0, 2], [0, 1]] and count == 3 and bias == [1.0, 2.0, 4.0]
    assert torch.equal(weights, wide[[1, 2, 4]])
    expected = wide[:, 0, 0] + torch.arange(5, dtype=torch.bfloat16)
    assert torch.equal(
        out[:, 0],
        torch.stack([expected[[4, 1]].sum(), expected[[1, 4]].sum(), expected[[1, 2]].sum()]),
    )
    assert layer.experts.num_experts == 5 and layer.experts.bias.shape == (5, 8)
    assert residency.split_calls == 0
    seen.clear()
    out = layer(x, torch.tensor([[0, 1], [2, 3], [3, 4]]))  # 5 experts: rows {0}, {1, 2}
    assert [s[0] for s in seen] == [[[0, 1]], [[0, 1], [1, 2]]]
    assert [s[3][:2] for s in seen] == [[0.0, 1.0], [2.0, 3.0]]
    assert residency.split_calls == 1
    seen.clear()
    shared = layer(x, torch.tensor([[0, 1], [2, 3], [1, 0]]))  # rows 0 and 2 go together
    assert [s[0] for s in seen] == [[[0, 1], [1, 0]], [[0, 1]]]
    assert residency.split_calls == 2
    assert torch.equal(
        shared[:, 0],
        torch.stack([expected[[0, 1]].sum(), expected[[2, 3]].sum(), expected[[1, 0]].sum()]),
    )
    assert torch.equal(
        out[:, 0],
        torch.stack([expected[[0, 1]].sum(), expected[[2, 3]].sum(), expected[[3, 4]].sum()]),
    )
    with pytest.raises(OffloadError, match="'experts' keeps 3 of its 5 experts' rows"):
        layer(x, None)
    residency.close()
    assert tuple(layer.experts.gate_up_proj.shape) == (5, 8, 32)
    assert "forward" not in vars(layer.experts)  # its class's own forward again


class Experts(nn.Module):
    num_experts = 3

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(3, 8, 32, dtype=torch.bfloat16, device="meta"))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        return x


class MoeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor | None) -> torch.Tensor:
        return self.experts(x, top_k_index)


def test_experts_rows_follow_the_routing_and_all_of_them_without_it() -> None:
    """The experts hook dequantizes the rows of the experts a call routes to (the others stay
    as they were: zeros in a fresh buffer); called without routing indices it dequantizes
    every expert."""
    fmt = BlockFormat(FP8, (8, 32))
    layer = MoeLayer()
    residency = StoredResidency(torch.device("cpu"))
    [kept] = residency.keep({layer: {"experts.gate_up_proj": fmt}}).values()
    source = random_fp8((3, 8, 32), fmt, seed=4)
    kept["experts.gate_up_proj"].copy_(source)
    wide = source.dequantized(torch.bfloat16)
    weight = layer.experts.gate_up_proj
    x = torch.zeros(1, 32)
    layer(x, torch.tensor([[2]]))
    assert torch.equal(weight[2], wide[2]) and not weight[:2].any()
    layer(x, None)  # routing unknown: every expert
    assert torch.equal(weight, wide)
    residency.close()


def test_a_replan_moves_stored_layers_and_reads_again_what_changes_form(tmp_path) -> None:
    """A worker re-planned between resident-as-stored and offloaded, and from stored to wide:
    a layer that stays resident as stored, or goes between stored on the device and 8 bits in
    host memory (the same bytes), is moved, not read; one that goes from stored to wide is
    read again; the logits stay the reference's."""
    root = CASES["qwen3-bf16"](tmp_path / "fp8")
    index = load_index(root)
    reference = dequantized_copy(root, tmp_path / "bf16")
    names = [[layer.name for layer in index.layers]]
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = reference_logits(str(reference), ids, dtype="bfloat16", num_threads=1)

    def spec(offloaded: tuple[str, ...], stored: bool):
        return dataclasses.replace(split_spec(index, 0, names, offloaded), resident_stored=stored)

    worker = StageWorker(spec(("layers.1", "layers.3"), True), device="cpu", num_threads=1)
    try:
        worker.load()
        x, mask, positions, keep = check_inputs(ids, None, 0, VOCAB)
        assert torch.equal(worker.forward(x, mask, positions, keep), expected)
        for offloaded, stored, reread in (
            (("layers.2", "layers.3"), True, set()),  # 1 back, 2 out: the same FP8 bytes
            (("layers.2", "layers.3"), False, {"layers.0", "layers.1"}),  # stored -> wide
        ):
            chunks = worker.reconfigure(spec(offloaded, stored))
            assert {name for i in chunks for name in worker._chunks[i]} == reread
            for i in chunks:
                worker.load_chunk(i)
            worker.finish_load()
            assert bool(worker.report().resident_format) == stored
            x, mask, positions, keep = check_inputs(ids, None, 0, VOCAB)
            assert torch.equal(worker.forward(x, mask, positions, keep), expected), offloaded
    finally:
        worker.close()


def test_the_loader_reads_stored_bytes_into_a_strided_part_through_a_temporary(tmp_path) -> None:
    """A stored destination that is not contiguous (a part of a wider parameter, narrowed
    along its columns) takes the file's bytes through a temporary of that tensor: the very
    bytes and scales, nothing requantized."""
    from safetensors import safe_open

    from worker.loader import TensorReader
    from worker.spec import file_format

    root = CASES["qwen3-bf16"](tmp_path / "fp8")  # blocks of 32 rows by 20 columns
    index = load_index(root)
    tensor = next(t for t in index.layers[1].tensors if t.target.endswith("q_proj.weight"))
    fmt = file_format(tensor)
    rows, cols = tensor.shape  # 64 x 48: the last block column partial
    wide = (rows, 60 + cols)
    whole = QuantizedTensor(torch.zeros(wide, dtype=FP8), torch.zeros(fmt.scale_shape(wide)), fmt)
    part = whole.narrow(1, 60, cols)
    assert not part.q.is_contiguous()
    with TensorReader(root) as reader:
        reader.read_many([(tensor, part)])
    with safe_open(root / tensor.file, "pt") as f:
        values = f.get_tensor(tensor.name)
        scales = f.get_tensor(tensor.scale.name).float()
    assert torch.equal(whole.q[:, 60:].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(whole.scales[:, 3:], scales)
    assert not whole.q[:, :60].view(torch.uint8).any()  # nothing else written


@pytest.mark.parametrize("capacity", [-1, True, 2.5, "2"])
def test_an_expert_capacity_that_is_not_an_integer_of_at_least_zero_is_refused(capacity) -> None:
    """`expert_capacity` is an integer >= 0: a negative one, a bool, a float or a string is
    refused, the message naming the value and what 0 means."""
    with pytest.raises(
        ValueError,
        match=re.escape(f"expert_capacity={capacity!r} must be an integer >= 0 (0: every expert)"),
    ):
        StoredResidency(torch.device("cpu"), expert_capacity=capacity)


def test_a_residency_that_keeps_nothing_holds_no_memory_and_describes_nothing() -> None:
    """Before `keep`, and after a `keep` of layers with no quantized parameters, a residency
    holds no stored bytes and no buffer, and describes no format."""
    residency = StoredResidency(torch.device("cpu"))
    assert residency.buffer_bytes == residency.stored_bytes == residency.wide_bytes == 0
    assert residency.keep({TwoLinears(): {}}) == {}
    assert residency.buffer_bytes == residency.stored_bytes == 0
    assert residency.describe() == ""


def test_stored_values_scales_and_buffer_are_on_the_residencys_device() -> None:
    """The stored values and scales, and the buffer the parameters view, are on the device the
    residency was made for (here the meta device, named by a string), also past a layer with
    nothing to keep."""
    residency = StoredResidency("meta")
    assert residency.device == torch.device("meta")
    empty, layer = TwoLinears(), TwoLinears()
    fmt = BlockFormat(FP8, (32, 32))
    kept = residency.keep({empty: {}, layer: {"up.weight": fmt, "down.weight": fmt}})
    assert list(kept) == [layer]
    for stored in kept[layer].values():
        assert stored.q.is_meta and stored.scales.is_meta
    assert layer.up.weight.is_meta and layer.down.weight.is_meta
    assert residency.buffer_bytes >= 2 * 72 * 40 * 2


def test_parameters_keep_their_dtype_shape_and_grad_flag_while_kept_and_after_close() -> None:
    """A layer's parameters that need no grad view the buffer as parameters that need none
    (a forward builds no autograd graph), and after close are meta tensors of their dtype and
    shape that need none; the description lists each format with its count."""
    layer = TwoLinears().requires_grad_(False)
    residency = StoredResidency(torch.device("cpu"))
    kept = residency.keep(
        {layer: {"up.weight": BlockFormat(FP8, (32, 32)), "down.weight": BlockFormat(FP8, (8, 8))}}
    )
    kept[layer]["up.weight"].copy_(random_fp8((72, 40), BlockFormat(FP8, (32, 32)), seed=1))
    kept[layer]["down.weight"].copy_(random_fp8((40, 72), BlockFormat(FP8, (8, 8)), seed=2))
    layer.down.bias = nn.Parameter(torch.zeros(40, dtype=torch.bfloat16), requires_grad=False)
    assert not layer.up.weight.requires_grad and not layer.down.weight.requires_grad
    assert not layer(torch.randn(2, 40, dtype=torch.bfloat16)).requires_grad
    assert residency.describe() == "fp8 (32x32 blocks) x 1, fp8 (8x8 blocks) x 1"
    residency.close()
    for weight, shape in ((layer.up.weight, (72, 40)), (layer.down.weight, (40, 72))):
        assert weight.is_meta and weight.dtype == torch.bfloat16
        assert tuple(weight.shape) == shape and not weight.requires_grad


class RichExperts(nn.Module):
    """An experts module of 5 experts with what real ones hold beside their matrices: an
    instance `num_experts`, a per-expert bias (parameter) and expert ids (buffer), a shared
    scale and a 0-d step that are not per expert, and an absent parameter. Its forward takes
    every argument by keyword, skips indices outside 0..num_experts-1 and records what it
    saw."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 5
        self.gate_up_proj = nn.Parameter(
            torch.empty(5, 8, 32, dtype=torch.bfloat16, device="meta"), requires_grad=False
        )
        self.register_parameter("down_bias", None)
        self.scale = nn.Parameter(torch.ones(5 + 3, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(
            torch.arange(5, dtype=torch.bfloat16)[:, None].repeat(1, 8), requires_grad=False
        )
        self.register_buffer("expert_ids", torch.arange(5))
        self.register_buffer("step", torch.tensor(0.0))
        self.seen: list[dict] = []

    def forward(self, x, top_k_index=None, top_k_weights=None):
        self.seen.append(
            {
                "index": top_k_index.clone(),
                "num_experts": self.num_experts,
                "weights": self.gate_up_proj.clone(),
                "bias": self.bias.clone(),
                "expert_ids": self.expert_ids.clone(),
                "kinds": (type(self.bias), type(self.expert_ids)),
            }
        )
        inside = (top_k_index >= 0) & (top_k_index < self.num_experts)
        index = torch.where(inside, top_k_index, 0)
        values = (self.gate_up_proj[index, 0, 0] + self.bias[index, 0]) * top_k_weights
        return x + torch.where(inside, values, 0).sum(dim=-1)


class KeywordMoeLayer(nn.Module):
    """A layer that calls its experts with every argument by keyword, hidden states one entry
    per row."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = RichExperts()

    def forward(self, x, index, weights):
        return self.experts(x=x, top_k_index=index, top_k_weights=weights)


def _rich_compact(capacity: int = 3) -> tuple[KeywordMoeLayer, StoredResidency, KeywordMoeLayer]:
    """A `KeywordMoeLayer` whose experts keep `capacity` compact rows, and the same layer with
    every expert's weights dequantized (the reference)."""
    fmt = BlockFormat(FP8, (8, 32))
    layer = KeywordMoeLayer()
    residency = StoredResidency(torch.device("cpu"), expert_capacity=capacity)
    [kept] = residency.keep({layer: {"experts.gate_up_proj": fmt}}).values()
    source = random_fp8((5, 8, 32), fmt, seed=6)
    kept["experts.gate_up_proj"].copy_(source)
    wide = KeywordMoeLayer()
    wide.experts.gate_up_proj = nn.Parameter(source.dequantized(torch.bfloat16), False)
    return layer, residency, wide


def test_a_compact_call_by_keyword_sees_each_per_expert_tensor_at_its_rows() -> None:
    """A compact call whose arguments are all keywords and whose routing indices are int32
    with sentinels (-1, the expert count, past it): its forward sees the indices renumbered
    in expert order, still int32, the sentinels outside the rows; each per-expert parameter
    and buffer at the capacity's rows (the routed experts' first, a parameter still a
    parameter, a buffer not one), num_experts the capacity; its output is the wide module's,
    needs no grad, and the module is as it was after."""
    layer, residency, wide = _rich_compact()
    experts, seen = layer.experts, layer.experts.seen
    x = torch.zeros(3, dtype=torch.bfloat16)
    weights = torch.tensor([[1.0, 0.5], [2.0, 1.0], [1.0, 0.25]], dtype=torch.bfloat16)
    index = torch.tensor([[4, 5], [1, -1], [99, 1]], dtype=torch.int32)  # experts 1 and 4
    out = layer(x, index, weights)
    assert residency.split_calls == 0
    [call] = seen
    assert call["index"].dtype == torch.int32
    assert call["index"].tolist() == [[1, 3], [0, 3], [3, 0]] and call["num_experts"] == 3
    assert torch.equal(call["weights"][:2], wide.experts.gate_up_proj[[1, 4]])
    assert call["bias"].shape == (3, 8) and call["bias"][:2, 0].tolist() == [1.0, 4.0]
    assert call["expert_ids"].shape == (3,) and call["expert_ids"][:2].tolist() == [1, 4]
    assert call["kinds"] == (nn.Parameter, torch.Tensor)
    assert torch.equal(out, wide(x, index, weights)) and not out.requires_grad
    seen.clear()
    one = torch.tensor([[2, 2], [2, -1], [2, 2]], dtype=torch.int32)  # expert 2 alone
    assert torch.equal(layer(x, one, weights), wide(x, one, weights))
    assert seen[0]["bias"].shape == (3, 8) and seen[0]["bias"][0, 0] == 2.0
    assert seen[0]["expert_ids"].shape == (3,) and seen[0]["expert_ids"][0] == 2
    assert experts.num_experts == 5 and "num_experts" in vars(experts)
    assert experts.bias.shape == (5, 8) and experts.expert_ids.tolist() == list(range(5))
    assert experts.down_bias is None and experts.step.dim() == 0
    residency.close()


def test_the_rows_past_a_calls_experts_repeat_its_last_expert() -> None:
    """Fewer experts routed than the rows hold (3 of 4): every per-expert tensor still has
    the capacity's rows, the routed experts' first and the last of them again after, and
    the output is the wide module's."""
    layer, residency, wide = _rich_compact(capacity=4)
    x = torch.zeros(3, dtype=torch.bfloat16)
    weights = torch.ones(3, 2, dtype=torch.bfloat16)
    index = torch.tensor([[0, 2], [2, 3], [0, 3]])  # experts 0, 2 and 3
    out = layer(x, index, weights)
    [call] = layer.experts.seen
    assert call["num_experts"] == 4 and call["bias"].shape == (4, 8)
    assert call["bias"][:, 0].tolist() == [0.0, 2.0, 3.0, 3.0]
    assert call["expert_ids"].tolist() == [0, 2, 3, 3]
    assert torch.equal(out, wide(x, index, weights))
    residency.close()


def test_a_split_compact_call_by_keyword_gives_the_wide_modules_output() -> None:
    """A call by keyword routing to more experts than the rows hold runs in groups of rows,
    each with its own rows of every per-row argument (1-d hidden states, routing indices and
    weights), and gives the wide module's output."""
    layer, residency, wide = _rich_compact()
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16)
    weights = torch.tensor([[1.0, 0.5], [2.0, 1.0], [1.0, 0.25]], dtype=torch.bfloat16)
    index = torch.tensor([[0, 1], [2, 3], [3, 4]])
    out = layer(x, index, weights)
    assert residency.split_calls == 1
    assert [call["index"].tolist() for call in layer.experts.seen] == [[[0, 1]], [[0, 1], [1, 2]]]
    assert torch.equal(out, wide(x, index, weights))
    residency.close()


def test_a_compact_call_that_cannot_be_served_from_its_rows_is_refused() -> None:
    """Refused, naming what is wrong and the fix: a call whose routing cannot be read; a row
    routing to more experts than the rows hold (wherever it is in the call); a call to split
    with a tensor argument that is not one entry per row (of another length, or 0-d)."""
    layer, residency, _ = _rich_compact()
    x = torch.zeros(3, dtype=torch.bfloat16)
    weights = torch.ones(3, 2, dtype=torch.bfloat16)
    fix = "(StoredResidency.expert_capacity) and cannot run without knowing which; keep every "
    fix += "expert (expert_capacity 0) or the resident weights wide"
    with pytest.raises(OffloadError, match=re.escape(fix)):
        layer(x, None, weights)
    wide_row = torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]])
    with pytest.raises(
        OffloadError,
        match=re.escape(
            "'experts': a row routes to 4 experts, more than the 3 rows its experts keep on "
            "the device (StoredResidency.expert_capacity)"
        ),
    ):
        layer(x, wide_row, torch.ones(3, 4, dtype=torch.bfloat16))
    split = torch.tensor([[0, 1], [2, 3], [3, 4]])
    for other, shape in (
        (torch.ones(5, 2, dtype=torch.bfloat16), "[5, 2]"),
        (torch.tensor(1.0), "[]"),
    ):
        with pytest.raises(
            OffloadError,
            match=re.escape(
                f"tensor argument of shape {shape} that is not one entry per row (3): it cannot "
                "be split; raise StoredResidency.expert_capacity"
            ),
        ):
            layer(x, split, other)
    assert not layer.experts.seen
    residency.close()


class TwoExpertsLayer(nn.Module):
    """A layer with two experts modules (of 3 experts each), called one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Experts(), Experts()

    def forward(self, x, index):
        return self.second(self.first(x, index), index)


def test_every_experts_module_of_a_layer_runs_on_its_own_compact_rows() -> None:
    """Both experts modules of a layer keep 2 compact rows, and each call dequantizes its own
    routed experts into its own rows."""
    fmt = BlockFormat(FP8, (8, 32))
    layer = TwoExpertsLayer()
    residency = StoredResidency(torch.device("cpu"), expert_capacity=2)
    names = ("first.gate_up_proj", "second.gate_up_proj")
    [kept] = residency.keep({layer: dict.fromkeys(names, fmt)}).values()
    sources = [random_fp8((3, 8, 32), fmt, seed=20 + i) for i in range(2)]
    for name, source in zip(names, sources, strict=True):
        kept[name].copy_(source)
    assert layer(torch.zeros(1, 32), torch.tensor([[2, 0]])).shape == (1, 32)
    for module, source in zip((layer.first, layer.second), sources, strict=True):
        assert tuple(module.gate_up_proj.shape) == (2, 8, 32)
        assert torch.equal(module.gate_up_proj, source.dequantized(torch.bfloat16)[[0, 2]])
    residency.close()


def test_a_compact_call_routing_to_no_expert_gives_the_wide_modules_output() -> None:
    """A compact call whose every routing index is a sentinel (routes to no expert), and one
    of no rows, run the module's forward with each per-expert tensor at the capacity's rows,
    and give the wide module's output."""
    layer, residency, wide = _rich_compact()
    weights = torch.ones(2, 2, dtype=torch.bfloat16)
    x = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    nowhere = torch.tensor([[5, 5], [-1, 5]])
    assert torch.equal(layer(x, nowhere, weights), wide(x, nowhere, weights))
    assert layer.experts.seen[-1]["bias"].shape == (3, 8)
    empty = (x[:0], nowhere[:0], weights[:0])
    assert torch.equal(layer(*empty), wide(*empty))
    assert layer.experts.seen[-1]["bias"].shape == (3, 8)
    assert residency.split_calls == 0
    residency.close()
