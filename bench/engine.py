"""What a step costs beyond its compute: 8 concurrent requests on one stage against
`transformers`' `generate` on one batch of the same 8 prompts, same checkpoint, same thread
count, in one process, interleaved repeats (the median ratio).

Two models (`make_checkpoint`, float32, page cache warm):
  tiny      - llama, 4 layers, hidden 128, nothing offloaded: a step is almost all overhead
  bench     - the 106 MiB llama of bench/batching.py, ~60% of its decoder bytes offloaded

For each, besides tokens/s and the ratio: the engine's own time per step, i.e. the wall time
of the run over its steps minus the stage's own compute per step (the worker's timed part of
each step: model forward and token choice), and that per generated token. Every greedy output
must equal transformers' on its prompt alone (exit 1 otherwise).

    .venv/bin/python bench/engine.py [--cases tiny,bench] [--new-tokens 64] [--repeats 3]
                                     [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.batching import MAX_BATCH, THREADS, budget_for, ours, theirs
from bench.generate import machine
from bench.workload import bench_shape, prompts_for, tiny_engine_shape
from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import make_checkpoint

N = 8
PROMPT = 8
MAX_SEQ_LEN = 160
TARGETS = {"tiny": 0.85, "bench": 0.9}


def shape_of(case: str):
    return tiny_engine_shape() if case == "tiny" else bench_shape(quick=False)


def engine_time(job, before: tuple[int, float], wall_s: float) -> dict:
    """Steps and the stage's compute during a run (from the worker and the engine's stats)."""
    report = job.telemetry()[0]
    steps = job.serving_stats()["steps"] - before[0]
    compute_s = report.forward_s - before[1]
    return {"steps": steps, "wall_per_step_ms": 1e3 * wall_s / steps, "compute_s": compute_s}


def run_case(case: str, root: Path, args) -> dict:
    checkpoint = str(make_checkpoint(root / case, shape_of(case)))
    index = load_index(checkpoint)
    torch.set_num_threads(THREADS)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = prompts_for(N, PROMPT, index.config["vocab_size"], seed=3)
    _, reference, _ = theirs(model, prompts, args.new_tokens)
    expected = [reference[i, PROMPT:].tolist() for i in range(N)]
    if case == "tiny":  # every layer resident
        budget = index.total_bytes + 64 * 2**20
    else:
        budget = budget_for(index, 1, MAX_SEQ_LEN)
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    row: dict = {"case": case, "model_bytes": index.total_bytes}
    try:
        config = JobConfig(
            checkpoint=checkpoint,
            gpu_memory_bytes=budget,
            max_batch=MAX_BATCH,
            max_seq_len=MAX_SEQ_LEN,
            snapshot_interval_s=0,
        )
        with launch(config) as job, ThreadPoolExecutor(N + 1) as pool:
            row["offloaded_bytes"] = sum(s.offloaded_bytes for s in job.plan.stages)
            ours(job, pool, prompts[:2], 4)  # warm-up
            ratios, rates, overheads, mismatches = [], [], [], 0
            for _ in range(args.repeats):
                before = (job.serving_stats()["steps"], job.telemetry()[0].forward_s)
                rate, outs, _ = ours(job, pool, prompts, args.new_tokens)
                wall_s = N * args.new_tokens / rate
                timing = engine_time(job, before, wall_s)
                hf_rate, _, _ = theirs(model, prompts, args.new_tokens)
                ratios.append(rate / hf_rate)
                rates.append((rate, hf_rate))
                per_step = (wall_s - timing["compute_s"]) / timing["steps"]
                overheads.append((per_step, timing["wall_per_step_ms"] / 1e3, timing["steps"]))
                mismatches += sum(
                    out[0, PROMPT:].tolist() != expected[i] for i, out in enumerate(outs)
                )
            ratio = statistics.median(ratios)
            per_step = statistics.median(o[0] for o in overheads)
            row.update(
                ours_tokens_per_s=statistics.median(r[0] for r in rates),
                hf_tokens_per_s=statistics.median(r[1] for r in rates),
                ratio=ratio,
                target=TARGETS[case],
                steps=statistics.median(o[2] for o in overheads),
                wall_per_step_ms=1e3 * statistics.median(o[1] for o in overheads),
                engine_per_step_ms=1e3 * per_step,
                engine_per_token_ms=1e3
                * per_step
                * statistics.median(o[2] for o in overheads)
                / (N * args.new_tokens),
                mismatches=mismatches,
            )
    finally:
        ray.shutdown()
    print(
        f"{case}: {row['ours_tokens_per_s']:.0f} vs transformers {row['hf_tokens_per_s']:.0f} "
        f"tokens/s = {row['ratio']:.2f}x (target >= {row['target']}); "
        f"{row['offloaded_bytes'] / 2**20:.0f} MiB offloaded; a step {row['wall_per_step_ms']:.2f} "
        f"ms, of which the engine (outside the stage's compute) {row['engine_per_step_ms']:.2f} ms "
        f"({row['engine_per_token_ms']:.3f} ms per token); mismatches {mismatches}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="tiny,bench")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    try:
        rows = [run_case(case, root, args) for case in args.cases.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
