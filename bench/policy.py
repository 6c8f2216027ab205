"""Throughput planner benchmark: does the plan predict what it delivers, and is its batch the
best one?

The benchmarks' 106 MiB float32 llama (bench/workload.py's `bench_shape`), max_seq_len 128
(a sequence's KV cache: 2 MiB over the 8 layers, so a larger batch pushes weights off a GPU).
Per scenario (1 stage, 2 stages: a fresh embedded Ray with that many logical GPUs, the device
being the CPU, and a per-GPU budget that holds the weights at batch 1 but not beside the KV
cache of a large batch):

  predicted - the throughput plan's tokens/s for each batch size (its best micro-batch count
              and placement, this node's measured compute and link rates, the step overhead)
  measured  - that plan launched; N = max_batch requests at once (8-token prompts, greedy, no
              end token, --new-tokens each); decode tokens/s in the window where every request
              decodes (after the last first token, until the first request ends); median of
              --repeats runs
  error     - predicted / measured - 1; target within +-25% for the chosen batch and 3 others
  chosen    - the batch the planner chooses (--objective throughput, max_batch auto) against
              the best measured one; target: its measured tokens/s within 10% of the best
  latency   - today's `--objective latency` plan with the user's max_batch 16 and the
              engine's default micro-batches, measured the same way

    python bench/policy.py [--quick] [--stages 1,2] [--batches 1,4,16,32] [--new-tokens 40]
                           [--repeats 2] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import machine
from bench.workload import bench_shape, prompts_for
from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.planning.options import DEFAULT_OPTIONS
from coordinator.planning.throughput import best_plans
from coordinator.runtime.launch import launch
from coordinator.runtime.probing import model_of, probe_cluster
from coordinator.tools.make_checkpoint import make_checkpoint

MIB = 2**20
MAX_SEQ_LEN = 128
USER_BATCH = 16  # the latency plan's max_batch, as a user would set it
BUDGETS_MIB = {1: 124, 2: 72}  # per GPU: the weights fit at batch 1, not beside a large batch
TARGET_ERROR = 0.25
TARGET_CHOICE = 0.10


def decode_rate(job, pool, prompts: list[torch.Tensor], new: int) -> float:
    """Decode tokens/s while every request decodes: from the last request's first token to
    the first request's last."""
    stamps: list[list[float]] = [[] for _ in prompts]
    lock = threading.Lock()

    def one(i: int):
        def on_token(row: int, token: int) -> None:
            with lock:
                stamps[i].append(time.perf_counter())

        return job.generate(
            prompts[i], max_new_tokens=new, do_sample=False, eos_token_id=None, on_token=on_token
        )

    list(pool.map(one, range(len(prompts))))
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    tokens = sum(1 for s in stamps for t in s if start < t <= end)
    if end <= start or tokens == 0:
        raise RuntimeError(
            f"no window where all {len(prompts)} requests decode: raise --new-tokens"
        )
    return tokens / (end - start)


def measure(config: JobConfig, prompts, args) -> dict:
    with launch(config) as job, ThreadPoolExecutor(len(prompts) + 1) as pool:
        decode_rate(job, pool, prompts[:2], 4)  # warm-up
        before = job.telemetry()
        rates = [decode_rate(job, pool, prompts, args.new_tokens) for _ in range(args.repeats)]
        after = job.telemetry()
        # each stage's own time per step (its forwards, as the worker timed them), against
        # the plan's stage time: slower = contention for the cores, not idle waiting
        stage_ms = [
            (b.forward_s - a.forward_s) / max(b.forwards - a.forwards, 1) * 1e3
            for a, b in zip(before, after, strict=True)
        ]
        plan = job.plan
        measured = statistics.median(rates)
        return {
            "measured": measured,
            "runs": rates,
            "predicted": plan.tokens_per_s,
            "micro_batches": job.config.micro_batches,
            "stages": len(plan.stages),
            "offloaded_mib": sum(s.offloaded_bytes for s in plan.stages) / MIB,
            "overhead_needed_s": overhead_needed(plan, plan.options.max_batch / measured),
            "stage_ms": stage_ms,
            "planned_stage_ms": [s.time_s * 1e3 for s in plan.stages],
        }


def overhead_needed(plan, measured_cycle_s: float) -> float:
    """The runtime overhead per stage step (PlanOptions.step_overhead_s) that would make the
    plan's cycle equal the measured one: cycle = max(sum(t) + S o, k (max t + o)) with o the
    runtime's plus the measured fixed part, increasing in o; solved for the smaller crossing."""
    times = [s.time_s for s in plan.stages]
    k, fixed = plan.options.micro_batches, plan.step_overhead_s - plan.options.step_overhead_s
    total = min((measured_cycle_s - sum(times)) / len(times), measured_cycle_s / k - max(times))
    return total - fixed


def scenario(num_gpus: int, checkpoint: str, index, args) -> dict:
    budget = BUDGETS_MIB[num_gpus] * MIB
    base = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=budget,
        max_seq_len=MAX_SEQ_LEN,
        objective="throughput",
        max_batch=0,
    )
    row: dict = {
        "gpus": num_gpus,
        "budget_mib": BUDGETS_MIB[num_gpus],
        "batches": {},
        "load_average": psutil.getloadavg()[0],
    }
    ray.init(
        address="local",
        num_cpus=num_gpus + 1,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        snapshot, _ = probe_cluster(base, model=model_of(index, base))
        curve = best_plans(index.layers, snapshot, base.plan_options(), prune=False)
        chosen = max(curve.values(), key=lambda p: (p.tokens_per_s, -p.options.max_batch))
        row["chosen"] = chosen.options.max_batch
        row["curve"] = {b: p.tokens_per_s for b, p in curve.items()}
        prompts = prompts_for(
            max([*args.batches, row["chosen"], USER_BATCH]), 8, index.config["vocab_size"], 1
        )
        for batch in sorted({*args.batches, row["chosen"]}):
            if batch not in curve:
                continue
            config = dataclasses.replace(base, max_batch=batch)
            got = measure(config, prompts[:batch], args)
            row["batches"][batch] = got
            print(
                f"  {num_gpus} GPU(s), max_batch {batch} (k={got['micro_batches']}): predicted "
                f"{got['predicted']:.1f}, measured {got['measured']:.1f} tokens/s",
                flush=True,
            )
        latency = dataclasses.replace(base, objective="latency", max_batch=USER_BATCH)
        row["latency"] = measure(latency, prompts[:USER_BATCH], args)
        print(
            f"  {num_gpus} GPU(s), latency plan, max_batch {USER_BATCH}: measured "
            f"{row['latency']['measured']:.1f} tokens/s",
            flush=True,
        )
    finally:
        ray.shutdown()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 stage, batches 1,8, 1 repeat")
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.stages, args.batches, args.repeats = "1", "1,8", 1
    args.batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-policy-"))
    rows = []
    try:
        checkpoint = str(make_checkpoint(tmp / "llama", bench_shape(False)))
        index = load_index(checkpoint)
        for name in index.files:
            (index.root / name).read_bytes()  # page cache warm
        for gpus in sorted(int(s) for s in args.stages.split(",")):
            rows.append(scenario(gpus, checkpoint, index, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(rows, args, index, started)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0


def report(rows: list[dict], args, index, started: float) -> None:
    print(
        f"\nmachine: {machine()}; torch {torch.__version__}, "
        f"ray {ray.__version__}; total {time.perf_counter() - started:.0f} s"
    )
    print(
        f"model: {index.total_bytes / MIB:.1f} MiB, max_seq_len {MAX_SEQ_LEN}; "
        f"{args.new_tokens} new tokens per request; medians of {args.repeats} runs\n"
    )
    print(
        "| stages | budget/GPU | max_batch | micro-batches | offloaded MiB | predicted tokens/s "
        "| measured tokens/s | predicted / measured | overhead that fits | stage step ms: "
        "planned / worker-timed |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        for batch, c in sorted(r["batches"].items()):
            mark = " (chosen)" if batch == r["chosen"] else ""
            print(
                f"| {r['gpus']} | {r['budget_mib']} MiB | {batch}{mark} | {c['micro_batches']} | "
                f"{c['offloaded_mib']:.1f} | {c['predicted']:.1f} | {c['measured']:.1f} | "
                f"{c['predicted'] / c['measured']:.2f} | "
                f"{c['overhead_needed_s'] * 1e3:.2f} ms | "
                + ", ".join(
                    f"{p:.1f} / {t:.1f}"
                    for p, t in zip(c["planned_stage_ms"], c["stage_ms"], strict=True)
                )
                + " |"
            )
    for r in rows:
        measured = {b: c["measured"] for b, c in r["batches"].items()}
        best = max(measured, key=measured.get)
        share = measured[r["chosen"]] / measured[best]
        errors = [abs(c["predicted"] / c["measured"] - 1) for c in r["batches"].values()]
        lat = r["latency"]
        print(
            f"\n{r['gpus']} stage(s): chosen max_batch {r['chosen']} measures "
            f"{share:.2f} of the best measured (max_batch {best}; target >= "
            f"{1 - TARGET_CHOICE:.2f}); worst prediction error {max(errors):.0%} (target "
            f"<= {TARGET_ERROR:.0%}); latency plan (max_batch {USER_BATCH}, "
            f"{lat['micro_batches'] or 'auto'} micro-batches): {lat['measured']:.1f} tokens/s, "
            f"the throughput plan {measured[r['chosen']] / lat['measured']:.2f}x that"
        )
        curve = ", ".join(f"{b}: {t:.0f}" for b, t in sorted(r["curve"].items()))
        print(f"  predicted curve: {curve}")
    needed = [c["overhead_needed_s"] for r in rows for c in [*r["batches"].values(), r["latency"]]]
    print(
        f"\nruntime overhead per stage step that would make each prediction exact: median "
        f"{statistics.median(needed) * 1e3:.2f} ms (min {min(needed) * 1e3:.2f}, max "
        f"{max(needed) * 1e3:.2f}); the planner assumed "
        f"{DEFAULT_OPTIONS.step_overhead_s * 1e3:.2f} ms (PlanOptions.step_overhead_s)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
