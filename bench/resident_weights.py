"""FP8 kept as stored on the GPU (issue 54, point 4): what the planner offloads for DeepSeek-V3
as published, with its resident FP8 weights dequantized at load (`--resident-weights wide`,
the baseline) and kept as stored (`stored`: 1 byte an entry and a float32 scale per 128x128
block, each layer dequantized just in time into one buffer), that buffer holding every
expert's rows at width ("stored-all", the planner patched in this process) or the planner's
compact rows (`stored_expert_capacity`: 64 of 256 at max_batch 1); and what the just-in-time
dequantization costs a step, measured.

1. Plan: DeepSeek-V3's real shapes (61 layers, the first 3 dense, 256 routed experts of width
   2048 and one shared, MLA with a 576-row `kv_a_proj_with_mqa`, vocab 129280) as the planner
   sees them from the checkpoint's index: block-FP8 matrices, bf16 embedding, head, norms and
   routers. One node of N GPUs of --gpu-gib each (H200: 141 GB, 90% of it), 2 TiB of host
   memory, a 50 GB/s link, 3 TB/s of compute (an H200's bandwidth-bound decode, roughly). Per N:
   the bytes each plan offloads (crossing the link every step) and its predicted bottleneck,
   both plans made in this process. The target: about half the offloaded bytes, or fewer.
2. Step: a DeepSeek-V3-shaped FP8 checkpoint shrunk to run here (`tests/test_fp8_blocks.py`'s
   sizes, 6 layers) on one in-process CPU stage holding every layer: forward time of a decode
   step and of a prefill, stored against wide, in one process (median of --repeats). On a GPU
   the same dequantization reads 1 byte and writes 2 per entry at HBM speed, against 2 bytes
   per entry at the link's speed for every layer offloaded instead; the CPU measures the
   ratio on this machine only.

    .venv/bin/python bench/resident_weights.py [--gpus 1,2,4,8] [--repeats 20] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import machine
from coordinator.planning import planner
from coordinator.planning.checkpoint import load_index
from coordinator.planning.formats import format_bytes, format_seconds
from coordinator.planning.planner import PlanOptions, plan, stored_expert_capacity
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.runtime.inputs import check_inputs
from worker.spec import LayerSpec, StageSpec, TensorSlice
from worker.worker import StageWorker

GIB = 2**30
BLOCK = 128
# DeepSeek-V3's config.json (the sizes that set the bytes)
HIDDEN, DENSE_WIDTH, EXPERT_WIDTH = 7168, 18432, 2048
LAYERS, DENSE_LAYERS, EXPERTS, TOP = 61, 3, 256, 8
HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD = 128, 1536, 512, 64, 128, 128
VOCAB = 129280


def _tensor(name: str, shape: tuple[int, ...], fp8: bool) -> TensorSlice:
    numel = 1
    for n in shape:
        numel *= n
    if not fp8:
        return TensorSlice(
            name=name, dtype="BF16", shape=shape, file="x", start=0, end=2 * numel, target=name
        )
    grid = (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))
    scales = 1
    for n in grid:
        scales *= n
    scale = TensorSlice(
        name=f"{name}_scale_inv", dtype="F32", shape=grid, file="x", start=0, end=4 * scales
    )
    return TensorSlice(
        name=name,
        dtype="F8_E4M3",
        shape=shape,
        file="x",
        start=0,
        end=numel,
        target=name,
        target_dtype="bfloat16",
        scale=scale,
        block=(BLOCK, BLOCK),
    )


def deepseek_v3() -> list[LayerSpec]:
    """DeepSeek-V3's layers as its FP8 checkpoint's index gives them: every routed expert's
    three projections their own block-FP8 tensors, as the files hold them."""
    layers = [
        LayerSpec(
            name="embed",
            kind="embed",
            index=None,
            tensors=(_tensor("model.embed_tokens.weight", (VOCAB, HIDDEN), False),),
        )
    ]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        attention = [
            _tensor(f"{p}.self_attn.q_a_proj.weight", (Q_LORA, HIDDEN), True),
            _tensor(f"{p}.self_attn.q_b_proj.weight", (HEADS * (NOPE + ROPE), Q_LORA), True),
            _tensor(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, HIDDEN), True),
            _tensor(f"{p}.self_attn.kv_b_proj.weight", (HEADS * (NOPE + V_HEAD), KV_LORA), True),
            _tensor(f"{p}.self_attn.o_proj.weight", (HIDDEN, HEADS * V_HEAD), True),
            _tensor(f"{p}.self_attn.q_a_layernorm.weight", (Q_LORA,), False),
            _tensor(f"{p}.self_attn.kv_a_layernorm.weight", (KV_LORA,), False),
            _tensor(f"{p}.input_layernorm.weight", (HIDDEN,), False),
            _tensor(f"{p}.post_attention_layernorm.weight", (HIDDEN,), False),
        ]
        if i < DENSE_LAYERS:
            mlp = [
                _tensor(f"{p}.mlp.{n}.weight", s, True)
                for n, s in (
                    ("gate_proj", (DENSE_WIDTH, HIDDEN)),
                    ("up_proj", (DENSE_WIDTH, HIDDEN)),
                    ("down_proj", (HIDDEN, DENSE_WIDTH)),
                )
            ]
            experts = (0, 0)
        else:
            mlp = [
                *(
                    _tensor(f"{p}.mlp.experts.{e}.{n}.weight", s, True)
                    for e in range(EXPERTS)
                    for n, s in (
                        ("gate_proj", (EXPERT_WIDTH, HIDDEN)),
                        ("up_proj", (EXPERT_WIDTH, HIDDEN)),
                        ("down_proj", (HIDDEN, EXPERT_WIDTH)),
                    )
                ),
                _tensor(f"{p}.mlp.gate.weight", (EXPERTS, HIDDEN), False),  # the router: bf16
                *(
                    _tensor(f"{p}.mlp.shared_experts.{n}.weight", s, True)
                    for n, s in (
                        ("gate_proj", (EXPERT_WIDTH, HIDDEN)),
                        ("up_proj", (EXPERT_WIDTH, HIDDEN)),
                        ("down_proj", (HIDDEN, EXPERT_WIDTH)),
                    )
                ),
            ]
            experts = (EXPERTS, TOP)
        layers.append(
            LayerSpec(
                name=f"layers.{i}",
                kind="decoder",
                index=i,
                tensors=tuple(attention + mlp),
                experts=experts[0],
                experts_per_token=experts[1],
            )
        )
    layers.append(
        LayerSpec(
            name="head",
            kind="head",
            index=None,
            tensors=(
                _tensor("model.norm.weight", (HIDDEN,), False),
                _tensor("lm_head.weight", (VOCAB, HIDDEN), False),
            ),
        )
    )
    return layers


def plans(num_gpus: list[int], gpu_gib: float) -> list[dict]:
    layers = deepseek_v3()
    rows = []
    for n in num_gpus:
        node = NodeInfo(
            node_id="h200",
            hostname="h200",
            gpus=tuple(GpuInfo(index=i, memory_bytes=int(gpu_gib * GIB)) for i in range(n)),
            host_budget_bytes=2048 * GIB,
            pinned_budget_bytes=2048 * GIB,
            link_bytes_per_s=50e9,
            compute_bytes_per_s=3e12,
            fp8_compute=True,
        )
        row: dict = {"gpus": n}
        for mode in ("wide", "stored-all", "stored", "auto"):
            start = time.perf_counter()
            options = PlanOptions(resident_weights=mode.removesuffix("-all"), max_batch=1)
            with contextlib.ExitStack() as stack:
                if mode == "stored-all":  # the baseline: every expert's rows at width
                    stack.enter_context(
                        mock.patch.object(planner, "stored_expert_capacity", lambda *_: 0)
                    )
                made = plan(layers, ClusterSnapshot(nodes=(node,)), options)
            row[mode] = {
                "offloaded_bytes": sum(s.offloaded_bytes for s in made.stages),
                "offloaded_wide_bytes": sum(s.offloaded_wide_bytes for s in made.stages),
                "bottleneck_s": made.bottleneck_s,
                "stored_stages": sum(s.resident_stored for s in made.stages),
                "jit_bytes": max(s.jit_bytes for s in made.stages),
                "expert_capacity": max(s.stored_expert_capacity for s in made.stages),
                "plan_s": time.perf_counter() - start,
            }
        rows.append(row)
    return rows


def step_times(repeats: int) -> dict:
    """Median forward seconds of one CPU stage of a small DeepSeek-V3-shaped FP8 checkpoint,
    dequantized at load ("wide"), kept as stored with every expert's rows in the buffer
    ("stored-all") and with the planner's compact rows at max_batch 1 (2 of its 4 experts,
    "stored": a prefill's calls split): a decode step (1 row, 1 token) and a prefill."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_fp8_blocks import deepseek_v3 as small_deepseek_v3

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        index = load_index(small_deepseek_v3(Path(tmp) / "fp8", "float32"))
        spec = StageSpec(
            stage=0,
            num_stages=1,
            checkpoint_dir=str(index.root),
            config=index.config,
            dtype=index.dtype,
            layers=index.layers,
        )
        vocab = index.config["vocab_size"]
        capacity = stored_expert_capacity(index.layers, PlanOptions(max_batch=1))
        for mode, stored, rows in (
            ("wide", False, 0),
            ("stored-all", True, 0),
            ("stored", True, capacity),
        ):
            worker = StageWorker(
                dataclasses.replace(spec, resident_stored=stored, stored_expert_capacity=rows),
                device="cpu",
                num_threads=1,
            )
            try:
                worker.load()
                for name, shape in (("decode", (1, 1)), ("prefill", (1, 64))):
                    ids = torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(0))
                    x, mask, positions, keep = check_inputs(ids, None, 0, vocab)
                    worker.forward(x, mask, positions, keep)  # warm-up
                    times = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        worker.forward(x, mask, positions, keep)
                        times.append(time.perf_counter() - start)
                    out[f"{mode} {name}"] = statistics.median(times)
                out[f"{mode} device bytes"] = worker.device_bytes()
                out[f"{mode} split calls"] = worker._placement.residency.split_calls
            finally:
                worker.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="1,2,4,8")
    parser.add_argument("--gpu-gib", type=float, default=141e9 * 0.9 / GIB)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(machine())
    rows = plans([int(n) for n in args.gpus.split(",")], args.gpu_gib)
    total = sum(layer.nbytes for layer in deepseek_v3())
    print(f"DeepSeek-V3 FP8 as published: {format_bytes(total)} at bf16 width")
    stored_total = sum(layer.resident_bytes(True) for layer in deepseek_v3())
    print(f"as stored: {format_bytes(stored_total)}")
    print(
        "gpus | offloaded wide | stored, all experts (x wide) | stored, compact (x wide) | "
        "model resident wide -> compact | buffer all -> compact | "
        "bottleneck wide -> all -> compact | auto"
    )
    for row in rows:
        wide, every, stored, auto = row["wide"], row["stored-all"], row["stored"], row["auto"]

        def ratio(of: dict, wide=wide) -> float:
            return of["offloaded_bytes"] / wide["offloaded_bytes"] if wide["offloaded_bytes"] else 0

        print(
            f"{row['gpus']:>4} | {format_bytes(wide['offloaded_bytes']):>14} | "
            f"{format_bytes(every['offloaded_bytes'])} ({ratio(every):.3f}) | "
            f"{format_bytes(stored['offloaded_bytes'])} ({ratio(stored):.3f}) | "
            f"{1 - wide['offloaded_bytes'] / stored_total:.1%} -> "
            f"{1 - stored['offloaded_bytes'] / stored_total:.1%} | "
            f"{format_bytes(every['jit_bytes'])} -> {format_bytes(stored['jit_bytes'])} "
            f"({stored['expert_capacity']} of {EXPERTS} experts) | "
            f"{format_seconds(wide['bottleneck_s'])} -> {format_seconds(every['bottleneck_s'])}"
            f" -> {format_seconds(stored['bottleneck_s'])} | "
            f"{'stored' if auto['stored_stages'] else 'wide'}"
        )
    steps = step_times(args.repeats)
    for name in ("decode", "prefill"):
        wide = steps[f"wide {name}"]
        print(
            f"CPU stage, {name}: wide {format_seconds(wide)}, "
            + ", ".join(
                f"{mode} {format_seconds(steps[f'{mode} {name}'])} "
                f"({steps[f'{mode} {name}'] / wide:.2f}x)"
                for mode in ("stored-all", "stored")
            )
        )
    print(
        f"CPU stage device bytes: wide {format_bytes(steps['wide device bytes'])}, "
        + ", ".join(
            f"{mode} {format_bytes(steps[f'{mode} device bytes'])} "
            f"({steps[f'{mode} device bytes'] / steps['wide device bytes']:.3f}x)"
            for mode in ("stored-all", "stored")
        )
        + f"; compact calls split: {steps['stored split calls']}"
    )
    if args.json:
        args.json.write_text(json.dumps({"plans": rows, "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
