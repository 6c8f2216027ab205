"""The KV pool against resident weights (issue 59): what the pool the plan chooses does to the
bytes each token moves and to tokens/s, on an offloading stage.

One random-weight Llama (`bench_shape`: 8 layers, hidden 512, float32, 106 MiB), one simulated
GPU (the CPU) in an embedded Ray, 1 thread per worker and for transformers.

Part 1, the probe (issue 59's): a budget that keeps about half the decoder bytes resident
beside the pool of the old guess, max_batch 8, max_seq_len 33, eight requests at once of 8
prompt + 24 new tokens (threads calling `job.generate`, greedy). Two plans, each launched in
turn:
  guess    - the pool the plan took before issue 59: 8 sequences at the expected length (a
             quarter of max_seq_len) and what the weights leave beside them for free
             (`pool.largest_pool`), given as --kv-cache-tokens
  default  - the pool the cost model chooses with no lengths known (`pool.choose_pool`)
Per plan: the host->device bytes per generated token against the ideal (the offloaded bytes
once per step, shared by the 8 rows: offloaded / 8), and tokens/s against transformers'
`generate` on the 8 prompts as one batch. Target: the default plan <= 1.15x the ideal. Every
output must equal transformers on its prompt alone.

Part 2, phases: 8 requests at once of short chats (64 + 64 tokens), then long generations
(32 + 480), then short chats again; max_seq_len 512, a budget that keeps half the decoder
bytes resident beside room for the short phase. Static plans, each launched once and run
through the three phases: the default plan, and a search over pools (the cost model's choice
for each phase's lengths, and even steps up to every sequence at max_seq_len). Per phase:
the best tokens/s of `--repeats` waves, and bytes per token against the ideal (the offloaded
bytes once per step, shared by the sequences the pool holds at once at the phase's lengths, at
most 8); the best
static pool per phase is the search's. Then the re-balancing load: the default plan, which per
phase learns the lengths from one wave of its requests, re-balances for them
(`Job.rebalance`, what its own check does after --rebalance-interval), and is measured on a
second wave. Targets: >= 0.9x the best static plan's tokens/s in each phase, <= 1.15x the
ideal bytes per token.

    python bench/kv_plan.py [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import machine
from bench.workload import MIB, bench_shape, greedy_batch, prompts_for
from coordinator.cli.plan import plan_cluster
from coordinator.config import JobConfig
from coordinator.planning.batch_size import plan_job
from coordinator.planning.checkpoint import load_index
from coordinator.planning.pool import Lengths, choose_pool, largest_pool
from coordinator.planning.reserve import job_options
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import make_checkpoint
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for
from worker.node import probe_here

THREADS = 1
BATCH = 8
RESIDENT_SHARE = 0.5  # of the decoder bytes the budget keeps resident beside the guess's pool
TARGET_IDEAL = 1.15
PHASES = (("short", 64, 64), ("long", 32, 480), ("short again", 64, 64))


def budget_for(index, max_seq_len: int, pool_tokens: int) -> int:
    """Ends, RESIDENT_SHARE of the decoders, one prefetch slot and `pool_tokens` of KV."""
    decoders = [x for x in index.layers if x.kind == "decoder"]
    ends = sum(x.nbytes for x in index.layers if x.kind != "decoder")
    kv = sum(x.kv_bytes(1, pool_tokens) for x in index.layers)
    return int(
        ends
        + sum(x.nbytes for x in decoders) * RESIDENT_SHARE
        + max(x.nbytes for x in decoders)
        + kv
    )


def copied_bytes(job) -> int:
    return sum(r.stats.copied_bytes for r in job.telemetry())


def offloaded(job) -> int:
    return sum(s.offloaded_bytes for s in job.plan.stages)


def run_batch(job, pool, prompts: list[torch.Tensor], new: int) -> dict:
    """The prompts as concurrent requests: tokens/s, bytes per token, outputs."""
    before = copied_bytes(job)
    start = time.perf_counter()
    outs = list(
        pool.map(
            lambda p: job.generate(p, max_new_tokens=new, do_sample=False, eos_token_id=None),
            prompts,
        )
    )
    seconds = time.perf_counter() - start
    tokens = len(prompts) * new
    return {
        "tokens_per_s": tokens / seconds,
        "bytes_per_token": (copied_bytes(job) - before) / tokens,
        "outputs": [o[0, p.shape[1] :].tolist() for o, p in zip(outs, prompts, strict=True)],
    }


def plans_for(config: JobConfig, index) -> tuple[int, int, object, object]:
    """(the old guess's pool, the default plan's pool, the cluster, its options) on a node like
    this one, probed as `launch` probes it (the model's decoder layer timed); the launched
    default plan's own pool is what the tables report."""
    model = (index.config, index.dtype, config.cpus_per_worker)
    config = dataclasses.replace(config, gpus=1)  # one GPU, as the embedded Ray has
    cluster = plan_cluster(config, probe_here(model=model), 1)
    options = dataclasses.replace(job_options(config, index, cluster), max_batch=BATCH)
    cap = BATCH * blocks_for(config.max_seq_len) * DEFAULT_BLOCK_SIZE
    guess, _ = largest_pool(index.layers, cluster, options, cap, options.pool_for(BATCH))
    _, default = plan_job(config, index, cluster)
    return guess, default.options.kv_tokens, cluster, options


def probe(checkpoint: str, index, model, args) -> dict:
    max_seq_len, new = 33, 24 if not args.quick else 8
    vocab = index.config["vocab_size"]
    prompts = prompts_for(BATCH, 8, vocab, 1)
    expected = [
        greedy_batch(model, p, new)[2][0, p.shape[1] :].tolist() for p in prompts
    ]  # each alone
    _, hf_s, _ = greedy_batch(model, torch.cat(prompts), new)
    hf_rate = BATCH * new / hf_s
    guess_tokens = blocks_for(max_seq_len // 4) * BATCH * DEFAULT_BLOCK_SIZE
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=budget_for(index, max_seq_len, guess_tokens),
        max_batch=BATCH,
        max_seq_len=max_seq_len,
    )
    guess, _, _, _ = plans_for(config, index)
    out: dict = {"transformers_tokens_per_s": hf_rate, "budget": config.gpu_memory_bytes}
    for name, pool_tokens in (("guess", guess), ("default", 0)):
        planned = dataclasses.replace(config, kv_cache_tokens=pool_tokens)
        with launch(planned) as job, ThreadPoolExecutor(BATCH) as pool:
            pool_tokens = job.plan.options.kv_tokens
            run_batch(job, pool, prompts[:2], 4)  # warm
            runs = [run_batch(job, pool, prompts, new) for _ in range(args.repeats)]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            ideal = offloaded(job) / BATCH
            out[name] = {
                "pool_tokens": pool_tokens,
                "offloaded_bytes": offloaded(job),
                "tokens_per_s": best["tokens_per_s"],
                "over_transformers": best["tokens_per_s"] / hf_rate,
                "bytes_per_token": best["bytes_per_token"],
                "over_ideal": best["bytes_per_token"] / ideal if ideal else None,
                "equal_to_transformers": all(r["outputs"] == expected for r in runs),
            }
        print(f"  probe {name}: {out[name]}", flush=True)
    return out


def phases(checkpoint: str, index, args) -> dict:
    max_seq_len = 512
    vocab = index.config["vocab_size"]
    scale = 8 if args.quick else 1  # --quick: an eighth of each phase's new tokens
    work = [
        (name, prompts_for(BATCH, prompt, vocab, 10 + i), max(2, new // scale))
        for i, (name, prompt, new) in enumerate(PHASES)
    ]
    config = JobConfig(
        checkpoint=checkpoint,
        gpu_memory_bytes=budget_for(index, max_seq_len, BATCH * (64 + 64)),
        max_batch=BATCH,
        max_seq_len=max_seq_len,
    )
    _, default, cluster, options = plans_for(config, index)
    chosen = {}
    for name, prompts, new in work:
        lengths = Lengths(tuple((p.shape[1], new) for p in prompts))
        chosen[name] = choose_pool(index.layers, cluster, options, default, lengths).tokens
    top = BATCH * blocks_for(max_seq_len) * DEFAULT_BLOCK_SIZE
    steps = [default + (top - default) * k // 3 for k in (1, 2, 3)]
    candidates = sorted({*chosen.values(), *(s // 16 * 16 for s in steps)} - {default})
    rows = []
    for pool_tokens in [0, *candidates]:  # 0: the default plan, launched as a user would
        planned = dataclasses.replace(config, kv_cache_tokens=pool_tokens)
        try:
            with launch(planned) as job, ThreadPoolExecutor(BATCH) as pool:
                run_batch(job, pool, work[0][1][:2], 2)  # warm
                row = {
                    "plan": "default" if not pool_tokens else "static",
                    "pool_tokens": job.plan.options.kv_tokens,
                    "offloaded_bytes": offloaded(job),
                }
                for name, prompts, new in work:
                    row[name] = measured(job, pool, prompts, new, args.repeats)
        except Exception as exc:  # a pool that does not fit the budget
            row = {"pool_tokens": pool_tokens, "error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(row)
        print(f"  pool {pool_tokens}: {row}", flush=True)
    rows.append(rebalancing(config, work, args.repeats))
    return {"default_pool": default, "chosen_per_phase": chosen, "plans": rows}


def measured(job, pool, prompts: list[torch.Tensor], new: int, repeats: int) -> dict:
    """The wave of `prompts` run `repeats` times, its best tokens/s (a rate is a capacity: the
    slower runs are the machine's noise) and its bytes per token against the ideal: the
    offloaded bytes once per step, shared by the sequences the pool holds at once at these
    lengths (their footprint, `Lengths.footprint_tokens`), at most 8."""
    runs = [run_batch(job, pool, prompts, new) for _ in range(repeats)]
    best = max(runs, key=lambda r: r["tokens_per_s"])
    options = job.plan.options
    lengths = Lengths(tuple((p.shape[1], new) for p in prompts))
    held = min(BATCH, options.kv_tokens / lengths.footprint_tokens(options.max_seq_len))
    ideal = offloaded(job) / held
    return {
        "tokens_per_s": best["tokens_per_s"],
        "bytes_per_token": best["bytes_per_token"],
        "held_at_once": round(held, 2),
        "over_ideal": best["bytes_per_token"] / ideal if ideal else None,
    }


def rebalancing(config: JobConfig, work, repeats: int) -> dict:
    """The default plan that re-balances: per phase, one wave of the phase's requests teaches
    it their lengths, it re-balances for the sequences that ended in that wave (as its check
    would, at once instead of after --rebalance-interval), then the measured wave."""
    import time as clock

    row: dict = {"plan": "re-balancing", "events": []}
    with launch(config) as job, ThreadPoolExecutor(BATCH) as pool:
        run_batch(job, pool, work[0][1][:2], 2)  # warm
        row["pool_tokens"] = [job.plan.options.kv_tokens]
        for name, prompts, new in work:
            since = clock.monotonic()
            run_batch(job, pool, prompts, new)  # the wave it learns from
            stats = job.engine().local.stats
            event = job.rebalance(Lengths(stats.observed_lengths(since=since)))
            row["events"].append({"phase": name, **event})
            row["pool_tokens"].append(job.plan.options.kv_tokens)
            row[name] = {
                **measured(job, pool, prompts, new, repeats),
                "offloaded_bytes": offloaded(job),
            }
    print(f"  re-balancing: {row}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-phases", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-plan-"))
    result: dict = {"machine": machine()}
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        checkpoint = str(make_checkpoint(tmp / "llama", bench_shape(quick=False)))
        index = load_index(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        result["probe"] = probe(checkpoint, index, model, args)
        if not args.skip_phases:
            result["phases"] = phases(checkpoint, index, args)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    result["seconds"] = time.perf_counter() - started
    for row in result.get("phases", {}).get("plans", []):
        if "error" in row:
            print(f"pool {row['pool_tokens']}: {row['error']}")
            continue
        cells = [
            f"{name} {row[name]['tokens_per_s']:.1f} tokens/s, {row[name]['over_ideal']:.2f}x ideal"
            for name, _, _ in PHASES
        ]
        print(f"{row['plan']} pool {row['pool_tokens']}: " + "; ".join(cells))
    plans = result.get("phases", {}).get("plans", [])
    moving = [r for r in plans if r.get("plan") == "re-balancing" and "error" not in r]
    static = [r for r in plans if r.get("plan") != "re-balancing" and "error" not in r]
    if moving and static:
        for name, _, _ in PHASES:
            best = max(r[name]["tokens_per_s"] for r in static)
            print(
                f"{name}: re-balancing / best static tokens/s = "
                f"{moving[0][name]['tokens_per_s'] / best:.2f} (target >= 0.9), bytes "
                f"{moving[0][name]['over_ideal']:.2f}x the ideal (target <= 1.15)"
            )
    p = result["probe"]
    for name in ("guess", "default"):
        r = p[name]
        print(
            f"probe {name}: pool {r['pool_tokens']} tokens, offloaded "
            f"{r['offloaded_bytes'] / MIB:.1f} MiB, {r['bytes_per_token'] / MIB:.2f} MiB/token = "
            f"{r['over_ideal']:.2f}x the ideal, {r['tokens_per_s']:.1f} tokens/s = "
            f"{r['over_transformers']:.2f}x transformers' batch of {BATCH}, outputs equal "
            f"transformers: {r['equal_to_transformers']}"
        )
    ok = p["default"]["over_ideal"] <= TARGET_IDEAL and all(
        p[n]["equal_to_transformers"] for n in ("guess", "default")
    )
    print(
        f"target (default <= {TARGET_IDEAL}x the ideal, outputs equal): {'met' if ok else 'MISSED'}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
