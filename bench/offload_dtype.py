"""Offloaded weights in 8 bits (issue 26): bytes per generated token, host bytes, tokens/s and
quality, against the same job with the offloaded weights at the model's width, in one run.

The model is bench/batching.py's llama in bfloat16 (and the same model written as a block-FP8
checkpoint, as DeepSeek publishes them), on one simulated GPU whose budget keeps 40% of the
decoder bytes resident (`budget_for`), 8 concurrent greedy requests of 256 new tokens each:

  bf16 none   the bf16 checkpoint, offloaded weights in bf16 (the baseline)
  bf16 fp8    the same, `--offload-dtype fp8`: offloaded matrices in float8 e4m3, 1x128 groups
  bf16 int8   the same, `--offload-dtype int8`
  fp8 none    the FP8 checkpoint, offloaded weights dequantized while read (bf16 in host memory)
  fp8 auto    the FP8 checkpoint, offloaded weights kept as published (8 bits and 128x128 scales)

For each: the plan's offloaded bytes (host memory, as stored) and their bf16 width, the bytes
copied host->device per generated token (the workers' copy counters over the generation), the
time spent dequantizing, tokens/s, and against its baseline (bf16 none, or fp8 none):
- teacher-forced agreement: one forward over the prompts followed by the baseline's 256
  tokens; the share of positions whose greedy choice is the baseline's next token, and the
  largest logit difference from the baseline's own forward over the same tokens;
- free-running agreement: tokens equal to the baseline's until a request's first difference,
  over all 8 requests (a random-weight model's logits are nearly flat, so one flipped near-tie
  ends a request's run: a pessimistic number, and batching alone can flip one).

Then, for bf16 none / int8 and fp8 none / auto, the same budget with `--max-batch auto
--objective throughput`: the batch the planner chooses, its tokens/s (32 tokens per request)
and what the plan predicted.

    .venv/bin/python bench/offload_dtype.py [--new-tokens 256] [--json F] [--quick]
                                            [--families | --formats]

`--families`: instead, the quality of fp8 and int8 per tested family (every decoder matrix
quantized, the worst case: every layer offloaded), in one process with transformers alone,
whose logits with those matrices quantized and back our stages equal bitwise
(tests/test_offload_dtype.py): a 4-layer bf16 checkpoint of hidden 256 per family, 4 prompts,
64 greedy tokens; the weights' relative error, the teacher-forced agreement with the bf16
model's tokens and the largest logit difference (against the logits' spread).

`--formats`: instead, each checkpoint format the project reads as published, against the same
random model written in bf16, on one simulated GPU with `budget_for`'s budget (the bf16
checkpoint's, for every format of a model) and a KV pool of the 8 requests at full length, as
the budget counts it (`kv_cache_tokens`), 8 greedy requests of 256 new tokens (32 with
--quick, on a model of hidden 128):

  llama    bf16 none (the baseline), fp8-block auto, fp8-compressed auto with the tensor,
           channel and block strategies
  gpt_oss  the same width, 4 experts of a quarter of llama's intermediate width: bf16 none (its
           baseline), mxfp4 auto (experts in 4 bits in host memory and on the link), mxfp4 none
           (dequantized while read: the same numbers, in bf16 on the link)

For each: the offloaded bytes in host memory against their bf16 width, bytes copied per token
against the baseline's, teacher-forced agreement and the largest logit difference against the
baseline (as above), tokens/s; for mxfp4 none, whether its logits equal mxfp4 auto's (exit 1
if not: the two must compute the same numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.batching import THREADS, budget_for, ours
from bench.generate import machine
from bench.workload import bench_shape, greedy_batch, prompts_for
from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

N = 8
PROMPT = 8
TARGET = 0.55  # 8-bit offloaded bytes (host, per token) over the same job's at 16 bits
RUNS = (("bf16", "none"), ("bf16", "fp8"), ("bf16", "int8"), ("fp8", "none"), ("fp8", "auto"))
AUTO_RUNS = (("bf16", "none"), ("bf16", "int8"), ("fp8", "none"), ("fp8", "auto"))


@contextlib.contextmanager
def own_ray():
    """A fresh embedded Ray for one job: the GPU a finished job held is free at once."""
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def copied(job) -> tuple[int, float]:
    reports = job.telemetry()
    return sum(r.stats.copied_bytes for r in reports), sum(r.stats.dequant_s for r in reports)


def one_run(
    checkpoint: str,
    offload_dtype: str,
    budget: int,
    prompts,
    new: int,
    teacher=None,
    kv_tokens: int = 0,
) -> dict:
    """`kv_tokens`: the KV pool in tokens (JobConfig.kv_cache_tokens; 0: what the plan leaves)."""
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=budget,
        max_batch=N,
        max_seq_len=PROMPT + new,
        kv_cache_tokens=kv_tokens,
        offload_dtype=offload_dtype,
        snapshot_interval_s=0,
    )
    with launch(config) as job, ThreadPoolExecutor(N) as pool:
        stages = [s for s in job.plan.stages if s.offloaded]
        bytes_before, dequant_before = copied(job)
        rate, outs, _ = ours(job, pool, prompts, new)
        bytes_after, dequant_after = copied(job)
        tokens = N * new
        texts = [out[0, PROMPT:].tolist() for out in outs]
        forced = torch.cat([torch.cat(prompts), torch.tensor(teacher or texts)], dim=1)
        logits = job.forward(forced)[:, PROMPT - 1 : -1].float()  # each scores the next token
        return {
            "offloaded_layers": sum(len(s.offloaded) for s in stages),
            "offload_units": sorted({s.offload_unit for s in stages}),
            "offloaded_bytes": sum(s.offloaded_bytes for s in stages),
            "offloaded_wide_bytes": sum(s.offloaded_wide_bytes for s in stages),
            "bytes_per_token": (bytes_after - bytes_before) / tokens,
            "dequant_s": dequant_after - dequant_before,
            "tokens_per_s": rate,
            "texts": texts,
            "logits": logits,
        }


AUTO_TOKENS = 32  # per request at the planner's batch: its rate, not its text


def auto_batch_run(checkpoint: str, offload_dtype: str, budget: int, vocab: int) -> dict:
    """The same budget with `--max-batch auto --objective throughput`: the batch the planner
    chooses (the KV cache competes with the resident weights for the budget, so cheaper
    offloaded bytes may buy a larger batch), run full with AUTO_TOKENS tokens per request."""
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=budget,
        max_batch=0,
        max_seq_len=PROMPT + AUTO_TOKENS,
        objective="throughput",
        offload_dtype=offload_dtype,
        snapshot_interval_s=0,
    )
    with launch(config) as job:
        batch = job.plan.options.max_batch
        prompts = prompts_for(batch, PROMPT, vocab, seed=11)
        with ThreadPoolExecutor(batch) as pool:
            rate, _, _ = ours(job, pool, prompts, AUTO_TOKENS)
        return {
            "batch": batch,
            "offloaded_layers": sum(len(s.offloaded) for s in job.plan.stages),
            "predicted_tokens_per_s": job.plan.tokens_per_s,
            "tokens_per_s": rate,
        }


def agreement(texts: list[list[int]], baseline: list[list[int]]) -> float:
    """Tokens equal to the baseline's before each request's first difference, over all."""
    same = 0
    for text, base in zip(texts, baseline, strict=True):
        for a, b in zip(text, base, strict=True):
            if a != b:
                break
            same += 1
    return same / sum(len(t) for t in baseline)


def family_quality(root: Path, new: int = 64) -> list[dict]:
    """fp8 and int8 against bf16 per tested family (see the module doc)."""
    import copy

    from transformers import AutoModelForCausalLM

    from coordinator.tools.make_checkpoint import CheckpointShape
    from offload.quant import quantized
    from worker.layout import TESTED_FAMILIES
    from worker.spec import parameter_formats

    rows = []
    for family in TESTED_FAMILIES:
        shape = CheckpointShape(
            arch=family,
            num_layers=4,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=4 if family in ("gpt2", "gpt_neox") else 2,
            intermediate_size=512,
            vocab_size=1024,
            dtype="bfloat16",
            max_positions=256,
        )
        try:
            index = load_index(make_checkpoint(root / family, shape))
        except Exception as exc:  # a family this shape cannot express: say so, go on
            rows.append({"family": family, "skipped": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        model = AutoModelForCausalLM.from_pretrained(str(index.root), dtype=torch.bfloat16).eval()
        prompts = torch.cat(prompts_for(4, PROMPT, index.config["vocab_size"], seed=5))
        _, _, out = greedy_batch(model, prompts, new)
        with torch.no_grad():
            base = model(out).logits[:, PROMPT - 1 : -1].float()
        # the floor: the bf16 model's own full forward against its incremental greedy tokens
        floor = float((base.argmax(-1) == out[:, PROMPT:]).float().mean())
        for dtype in ("fp8", "int8"):
            quant = copy.deepcopy(model)
            error_sq = total_sq = 0.0
            with torch.no_grad():
                for layer in index.layers:
                    for target, fmt in parameter_formats(
                        layer.unit_tensors("layer"), dtype
                    ).items():
                        param = quant.get_parameter(target)
                        back = quantized(param, fmt).dequantized(param.dtype)
                        error_sq += float((back.float() - param.float()).square().sum())
                        total_sq += float(param.float().square().sum())
                        param.copy_(back)
                logits = quant(out).logits[:, PROMPT - 1 : -1].float()
            rows.append(
                {
                    "family": family,
                    "offload_dtype": dtype,
                    "weight_error": (error_sq / total_sq) ** 0.5,
                    "floor_agreement": floor,
                    "forced_agreement": float(
                        (logits.argmax(-1) == out[:, PROMPT:]).float().mean()
                    ),
                    "max_logit_diff": float((logits - base).abs().max()),
                    "logit_scale": float(base.std()),
                }
            )
            row = rows[-1]
            print(
                f"{family} {dtype}: weight error {row['weight_error']:.2%}, teacher-forced "
                f"agreement {row['forced_agreement']:.3f} (bf16's own {floor:.3f}), largest "
                "logit difference "
                f"{row['max_logit_diff']:.4f} (logits' std {row['logit_scale']:.3f})",
                flush=True,
            )
    return rows


# --formats: (model, format, make_checkpoint's settings, offload dtype); each model's first row
# is its bf16 baseline (the teacher of the others)
FORMAT_RUNS = (
    ("llama", "bf16", {}, "none"),
    ("llama", "fp8-block", {"quantization": "fp8-block"}, "auto"),
    *(
        (
            "llama",
            f"fp8-compressed {strategy}",
            {"quantization": "fp8-compressed", "fp8_strategy": strategy},
            "auto",
        )
        for strategy in ("tensor", "channel", "block")
    ),
    ("gpt_oss", "bf16", {}, "none"),
    ("gpt_oss", "mxfp4", {"quantization": "mxfp4"}, "auto"),
    ("gpt_oss", "mxfp4", {"quantization": "mxfp4"}, "none"),
)
FORMAT_TOKENS = (32, 256)  # new tokens per request, --quick and not


def format_shapes(quick: bool) -> dict[str, CheckpointShape]:
    """The models of --formats, in bfloat16: the bench's llama, and a gpt-oss of the same width
    whose 4 experts of a quarter of llama's intermediate width hold as many bytes as its MLP
    (top-2, sliding window 128 as gpt-oss publishes). --quick: hidden 128 (bench_shape(True)'s
    hidden 64 is so small against its KV cache that the budget offloads nothing)."""
    llama = dataclasses.replace(bench_shape(quick), dtype="bfloat16")
    if quick:
        llama = dataclasses.replace(llama, hidden_size=128, intermediate_size=384)
    gpt_oss = dataclasses.replace(
        llama,
        arch="gpt_oss",
        intermediate_size=llama.intermediate_size // 4,
        num_experts=4,
        experts_per_token=2,
        sliding_window=128,
    )
    return {"llama": llama, "gpt_oss": gpt_oss}


def format_quality(root: Path, quick: bool, new: int) -> list[dict]:
    """Each checkpoint format against its model's bf16 baseline (see the module doc)."""
    shapes = format_shapes(quick)
    results: dict[tuple[str, str, str], dict] = {}
    for model, fmt, settings, dtype in FORMAT_RUNS:
        folder = root / model / fmt.replace(" ", "-")
        if not folder.exists():
            make_checkpoint(folder, dataclasses.replace(shapes[model], **settings))
        index = load_index(str(root / model / "bf16"))  # the baseline's budget for all
        budget = budget_for(index, 1, PROMPT + new)
        prompts = prompts_for(N, PROMPT, index.config["vocab_size"], seed=3)
        teacher = results[model, "bf16", "none"]["texts"] if fmt != "bf16" else None
        with own_ray():
            results[model, fmt, dtype] = one_run(
                str(folder), dtype, budget, prompts, new, teacher, kv_tokens=N * (PROMPT + new)
            )
        if not results[model, fmt, dtype]["offloaded_wide_bytes"]:
            raise SystemExit(f"{model} {fmt} {dtype}: the plan offloads nothing at this budget")
    rows = []
    for model, fmt, _, dtype in FORMAT_RUNS:
        row = results[model, fmt, dtype]
        base = results[model, "bf16", "none"]
        teacher = torch.tensor(base["texts"])
        out = {
            "model": model,
            "format": fmt,
            "offload_dtype": dtype,
            **{k: v for k, v in row.items() if k not in ("texts", "logits")},
            "host_ratio": row["offloaded_bytes"] / row["offloaded_wide_bytes"],
            "bytes_ratio": row["bytes_per_token"] / base["bytes_per_token"],
            # each generated token's share of one crossing of the offloaded bytes as stored:
            # the same in every row when the link carries them as stored
            "crossings_per_token": row["bytes_per_token"] / row["offloaded_bytes"],
            "forced_agreement": float((row["logits"].argmax(-1) == teacher).float().mean()),
            "max_logit_diff": float((row["logits"] - base["logits"]).abs().max()),
            "logit_scale": float(base["logits"].std()),
            "agreement": agreement(row["texts"], base["texts"]),
        }
        if (model, fmt, dtype) == ("gpt_oss", "mxfp4", "none"):
            auto = results["gpt_oss", "mxfp4", "auto"]
            out["logits_equal_auto"] = bool(torch.equal(row["logits"], auto["logits"]))
            out["max_logit_diff_auto"] = float((row["logits"] - auto["logits"]).abs().max())
            out["texts_equal_auto"] = row["texts"] == auto["texts"]
        rows.append(out)
        units = ", ".join(out["offload_units"])
        same = (
            f"; against mxfp4 auto: logits equal {out['logits_equal_auto']} (largest "
            f"difference {out['max_logit_diff_auto']:.4g}), texts equal {out['texts_equal_auto']}"
            if "logits_equal_auto" in out
            else ""
        )
        print(
            f"{model} {fmt}, offload {dtype}: {out['offloaded_layers']} offloaded ({units}), "
            f"{out['offloaded_bytes'] / 2**20:.2f} MiB in host memory "
            f"({out['host_ratio']:.3f}x their bf16 bytes); "
            f"{out['bytes_per_token'] / 2**20:.3f} MiB copied per token "
            f"({out['bytes_ratio']:.3f}x bf16 none's, {out['crossings_per_token']:.3f} of the "
            f"offloaded bytes); dequantizing {out['dequant_s']:.2f} s; "
            f"{out['tokens_per_s']:.1f} tokens/s; against bf16 none: teacher-forced agreement "
            f"{out['forced_agreement']:.3f}, largest logit difference "
            f"{out['max_logit_diff']:.4f} (logits' std {out['logit_scale']:.3f}), free-running "
            f"agreement {out['agreement']:.3f}{same}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--new-tokens", type=int, help="per request (default 256; 32 with --formats --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model (a smoke run)")
    parser.add_argument("--families", action="store_true", help="quality per tested family")
    parser.add_argument(
        "--formats", action="store_true", help="each published checkpoint format against bf16"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    torch.set_num_threads(THREADS)
    root = Path(tempfile.mkdtemp(prefix="bench-offload-dtype-"))
    if args.families:
        try:
            rows = family_quality(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    if args.formats:
        new = args.new_tokens or FORMAT_TOKENS[not args.quick]
        try:
            rows = format_quality(root, args.quick, new)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        # mxfp4 dequantized while read and after each copy are the same numbers: else a bug
        return 0 if all(row.get("logits_equal_auto", True) for row in rows) else 1
    if args.new_tokens is None:
        args.new_tokens = 256
    rows = []
    try:
        shape = dataclasses.replace(bench_shape(args.quick), dtype="bfloat16")
        checkpoints = {
            "bf16": str(make_checkpoint(root / "bf16", shape)),
            "fp8": str(
                make_checkpoint(root / "fp8", dataclasses.replace(shape, quantization="fp8-block"))
            ),
        }
        index = load_index(checkpoints["bf16"])
        budget = budget_for(index, 1, PROMPT + args.new_tokens)
        prompts = prompts_for(N, PROMPT, index.config["vocab_size"], seed=3)
        results = {}
        for kind, dtype in RUNS:  # each kind's "none" runs first: the teacher of the others
            teacher = results[kind, "none"]["texts"] if dtype != "none" else None
            with own_ray():
                # the KV pool the budget counts: else the plan's pool takes what it leaves
                results[kind, dtype] = one_run(
                    checkpoints[kind],
                    dtype,
                    budget,
                    prompts,
                    args.new_tokens,
                    teacher,
                    kv_tokens=N * (PROMPT + args.new_tokens),
                )
            if not results[kind, dtype]["offloaded_wide_bytes"]:
                raise SystemExit(f"{kind} {dtype}: the plan offloads nothing at this budget")
        autos = {}
        for kind, dtype in AUTO_RUNS:
            with own_ray():
                autos[kind, dtype] = auto_batch_run(
                    checkpoints[kind], dtype, budget, index.config["vocab_size"]
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for (kind, dtype), auto in autos.items():
        rows.append({"checkpoint": kind, "offload_dtype": dtype, "auto_batch": auto})
        print(
            f"{kind} checkpoint, offload {dtype}, --max-batch auto --objective throughput: "
            f"batch {auto['batch']}, {auto['offloaded_layers']} layers offloaded, "
            f"{auto['tokens_per_s']:.1f} tokens/s (plan predicted "
            f"{auto['predicted_tokens_per_s']:.1f})",
            flush=True,
        )
    ok = True
    for kind, dtype in RUNS:
        row = results[kind, dtype]
        base = results[kind, "none"]
        out = {
            "checkpoint": kind,
            "offload_dtype": dtype,
            **{k: v for k, v in row.items() if k not in ("texts", "logits")},
            "host_ratio": row["offloaded_bytes"] / row["offloaded_wide_bytes"],
            "bytes_ratio": row["bytes_per_token"] / base["bytes_per_token"],
            "forced_agreement": float(
                (row["logits"].argmax(-1) == torch.tensor(base["texts"])).float().mean()
            ),
            "max_logit_diff": float((row["logits"] - base["logits"]).abs().max()),
            "logit_scale": float(base["logits"].std()),
            "agreement": agreement(row["texts"], base["texts"]),
        }
        rows.append(out)
        if dtype != "none" and not (out["host_ratio"] <= TARGET and out["bytes_ratio"] <= TARGET):
            ok = False
        print(
            f"{kind} checkpoint, offload {dtype}: {out['offloaded_layers']} layers offloaded, "
            f"{out['offloaded_bytes'] / 2**20:.1f} MiB in host memory "
            f"({out['host_ratio']:.3f}x their bf16 bytes); "
            f"{out['bytes_per_token'] / 2**20:.2f} MiB copied per token "
            f"({out['bytes_ratio']:.3f}x {kind} none); dequantizing {out['dequant_s']:.2f} s; "
            f"{out['tokens_per_s']:.1f} tokens/s; against {kind} none: teacher-forced "
            f"agreement {out['forced_agreement']:.3f}, largest logit difference "
            f"{out['max_logit_diff']:.4f} (logits' std {out['logit_scale']:.3f}), free-running "
            f"agreement {out['agreement']:.3f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
