"""Continuous batching benchmark: N requests at once (threads calling `job.generate`, as a
server receives them) against transformers' `generate` on one batch of the same N prompts,
same checkpoint, same thread count, with layers offloaded; and the host->device bytes each
generated token costs.

One random-weight Llama checkpoint (`make_checkpoint`: 8 layers, hidden 512, 8 heads / 4 kv
heads, intermediate 1408, vocab 4096, float32, 106 MiB), page cache warm. For each stage count
(1, 2: a fresh embedded Ray with that many logical GPUs, the device being the CPU), one job
whose per-GPU budget keeps 40% of the decoder weights resident (the rest offloaded, printed)
beside a KV cache of max_batch 16 x 32 tokens. Per N in 1, 4, 8, 16:

  ours      - N threads, each `job.generate` of one 8-token prompt, greedy, no end token,
              --new-tokens new tokens; tokens/s = N x new / wall time
  bytes     - host->device bytes the workers copied (their offloaders' `copied_bytes`, before
              and after) / tokens generated; target <= 1.25 x offloaded bytes / N
  theirs    - transformers `generate` on the N prompts as one batch (no padding: same length)
  ratio     - ours / theirs tokens/s, the median over interleaved repeats of each of our runs
              against the transformers run right after it; target at N = 8: >= 0.8
  batch 1   - ms per token at N = 1 (first to last token, timestamped as they come) against
              transformers at batch 1; target <= 1.15x

On 2 stages with layers offloaded the engine runs one micro-batch by default (its decode
steps driven by the first stage through the second, actor to actor); one micro-batch per
stage (every stage busy) is run too: each micro-batch brings the offloaded layers in once per
step, so the split trades bytes for overlap. Then, with nothing offloaded (where the default
is one micro-batch per stage), 1 stage against 2 at N = 8 and 16: what a second stage adds.
Then the stall (not with --no-stall): 4 requests decoding while a 1024-token prompt joins, the
longest gap between two tokens of a decoding request against its median gap, with the prompt
prefilled in chunks of 256 tokens (`prefill_tokens`) and whole (4096).

Correctness: every greedy output must equal transformers' `generate` on that prompt alone; a
mismatch is printed and the script exits 1. About 2 minutes on 2 cores (--quick: 30 s).

    python bench/batching.py [--quick] [--stages 1,2] [--batches 1,4,8,16] [--repeats 3]
                             [--no-stall] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import machine
from bench.workload import MIB, bench_shape, greedy_batch, prompts_for, stamping_streamer
from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import make_checkpoint

THREADS = 1  # per worker (JobConfig's cpus_per_worker default) and for transformers
MAX_BATCH = 16
RESIDENT_SHARE = 0.4  # of the decoder bytes each GPU's budget keeps resident
STALL_PROMPT = 1024
STALL_CHUNKS = (256, 4096)  # prefill_tokens: in chunks, and the whole prompt in one step
TARGET_RATIO_AT_8 = 0.8
TARGET_BYTES = 1.25
TARGET_BATCH1 = 1.15


def copied_bytes(job) -> int:
    return sum(r.stats.copied_bytes for r in job.telemetry())


def ours(job, pool, prompts: list[torch.Tensor], new: int) -> tuple[float, list, list[float]]:
    """tokens/s of the prompts as concurrent requests; outputs; the first request's token
    timestamps."""
    stamps: list[float] = []

    def one(i: int):
        on_token = (lambda row, token: stamps.append(time.perf_counter())) if i == 0 else None
        return job.generate(
            prompts[i], max_new_tokens=new, do_sample=False, eos_token_id=None, on_token=on_token
        )

    start = time.perf_counter()
    outs = list(pool.map(one, range(len(prompts))))
    return len(prompts) * new / (time.perf_counter() - start), outs, stamps


def theirs(model, prompts: list[torch.Tensor], new: int) -> tuple[float, torch.Tensor, list[float]]:
    streamer = stamping_streamer() if len(prompts) == 1 else None
    _, seconds, out = greedy_batch(
        model, torch.cat(prompts).to(model.device), new, streamer=streamer
    )
    return len(prompts) * new / seconds, out, streamer.stamps[1:] if streamer else []


def per_token(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def stall(job, pool, vocab: int, new: int) -> dict:
    """4 requests decoding; a long prompt joins once they have made 4 tokens each. The longest
    and the median gap between two tokens of the first request."""
    stamps: list[float] = []
    joined = []
    long = prompts_for(1, STALL_PROMPT, vocab, 99)[0]

    def first(row: int, token: int) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == 4 and not joined:
            joined.append(
                pool.submit(
                    job.generate, long, max_new_tokens=2, do_sample=False, eos_token_id=None
                )
            )

    short = prompts_for(4, 8, vocab, 98)
    futures = [
        pool.submit(
            job.generate,
            short[i],
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            on_token=first if i == 0 else None,
        )
        for i in range(4)
    ]
    for f in futures:
        f.result()
    joined[0].result()
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps)}


def budget_for(index, gpus: int, max_seq_len: int) -> int:
    """A per-GPU budget that keeps RESIDENT_SHARE of the decoder bytes resident over `gpus`
    GPUs: the embedding or head each end stage holds, a prefetch slot, the stage's KV cache."""
    decoders = [x for x in index.layers if x.kind == "decoder"]
    ends = [x.nbytes for x in index.layers if x.kind != "decoder"]
    kv = sum(x.kv_bytes(MAX_BATCH, max_seq_len) for x in index.layers)
    largest = max(x.nbytes for x in decoders)
    return int(
        (sum(ends) if gpus == 1 else max(ends))
        + sum(x.nbytes for x in decoders) * RESIDENT_SHARE / gpus
        + largest
        + kv / gpus
    )


def run(
    num_gpus: int,
    checkpoint: str,
    model,
    args,
    expected: dict,
    index,
    *,
    batches: list[int],
    max_seq_len: int,
    micro_batches: int = 0,
    prefill_tokens: int = 512,
    measure_stall: bool = False,
    resident: bool = False,
) -> dict:
    budget = budget_for(index, num_gpus, max_seq_len)
    if resident:  # room for every layer on every GPU: nothing offloaded
        budget = (
            index.total_bytes
            + sum(x.kv_bytes(MAX_BATCH, max_seq_len) for x in index.layers)
            + 64 * MIB
        )
    row: dict = {
        "gpus": num_gpus,
        "micro_batches": micro_batches,
        "batches": batches,
        "prefill_tokens": prefill_tokens,
        "load_average": psutil.getloadavg()[0],
    }
    mismatches: list[str] = []
    ray.init(
        address="local",
        num_cpus=num_gpus + 1,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        config = JobConfig(
            checkpoint=checkpoint,
            gpu_memory_bytes=budget,
            max_batch=MAX_BATCH,
            max_seq_len=max_seq_len,
            micro_batches=micro_batches,
            prefill_tokens=prefill_tokens,
        )
        with launch(config) as job, ThreadPoolExecutor(MAX_BATCH + 1) as pool:
            row["stages"] = len(job.plan.stages)
            row["offloaded_bytes"] = sum(s.offloaded_bytes for s in job.plan.stages)
            warm = expected["prompts"][:2]
            ours(job, pool, warm, 4)
            for n in batches:
                prompts = expected["prompts"][:n]
                rates, ratios, per_byte, batch1 = [], [], [], []
                for _ in range(args.repeats):
                    before = copied_bytes(job)
                    rate, outs, stamps = ours(job, pool, prompts, args.new_tokens)
                    per_byte.append((copied_bytes(job) - before) / (n * args.new_tokens))
                    hf_rate, _, hf_stamps = theirs(model, prompts, args.new_tokens)
                    rates.append((rate, hf_rate))
                    ratios.append(rate / hf_rate)
                    if n == 1:
                        batch1.append(per_token(stamps) / per_token(hf_stamps))
                    for i, out in enumerate(outs):
                        if out[0, prompts[i].shape[1] :].tolist() != expected["tokens"][i]:
                            mismatches.append(f"N={n} request {i}")
                row[n] = {
                    "ours_tokens_per_s": statistics.median(r[0] for r in rates),
                    "hf_tokens_per_s": statistics.median(r[1] for r in rates),
                    "ratio": statistics.median(ratios),
                    "bytes_per_token": statistics.median(per_byte),
                    "batch1_ratio": statistics.median(batch1) if batch1 else None,
                }
                print(
                    f"  {num_gpus} GPU(s), micro_batches {micro_batches or 'per stage'}, N={n}: "
                    f"{row[n]['ours_tokens_per_s']:.1f} vs {row[n]['hf_tokens_per_s']:.1f} "
                    f"tokens/s, {row[n]['bytes_per_token'] / MIB:.2f} MiB/token",
                    flush=True,
                )
            if measure_stall:
                row["stall"] = stall(job, pool, expected["vocab"], args.new_tokens)
    finally:
        ray.shutdown()
    row["mismatches"] = mismatches
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, N in 1,4, 1 repeat")
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-stall", action="store_true", help="skip the long-prompt stall runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shape = bench_shape(args.quick)
    if args.quick:
        args.batches, args.repeats, args.new_tokens = "1,4", 1, 8
    args.batches = [int(b) for b in args.batches.split(",")]
    args.stall = not (args.quick or args.no_stall)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-batching-"))
    rows = []
    try:
        checkpoint = str(make_checkpoint(tmp / "llama", shape))
        index = load_index(checkpoint)
        for name in index.files:
            (index.root / name).read_bytes()  # page cache warm
        # on the workers' device: the GPU where there is one (the baseline must not be a CPU)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        vocab = index.config["vocab_size"]
        prompts = prompts_for(max(args.batches), 8, vocab, 1)
        expected = {
            "prompts": prompts,
            "vocab": vocab,
            "tokens": [theirs(model, [p], args.new_tokens)[1][0, 8:].tolist() for p in prompts],
        }
        sweep = 8 + args.new_tokens
        for gpus in sorted(int(s) for s in args.stages.split(",")):
            rows.append(
                run(
                    gpus,
                    checkpoint,
                    model,
                    args,
                    expected,
                    index,
                    batches=args.batches,
                    max_seq_len=sweep,
                )
            )
            if (
                gpus > 1
            ):  # one micro-batch per stage: every stage busy, the weights brought in twice
                rows.append(
                    run(
                        gpus,
                        checkpoint,
                        model,
                        args,
                        expected,
                        index,
                        batches=args.batches,
                        max_seq_len=sweep,
                        micro_batches=gpus,
                    )
                )
        if not args.quick:  # nothing offloaded: does a second stage add throughput?
            for gpus in sorted(int(s) for s in args.stages.split(",")):
                rows.append(
                    run(
                        gpus,
                        checkpoint,
                        model,
                        args,
                        expected,
                        index,
                        batches=[8, 16],
                        max_seq_len=sweep,
                        resident=True,
                    )
                )
        if args.stall:  # a long prompt joining: in chunks, and whole
            for chunk in STALL_CHUNKS:
                rows.append(
                    run(
                        1,
                        checkpoint,
                        model,
                        args,
                        expected,
                        index,
                        batches=[],
                        max_seq_len=STALL_PROMPT + 8,
                        prefill_tokens=chunk,
                        measure_stall=True,
                    )
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(rows, args, index, started)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    bad = [m for r in rows for m in r["mismatches"]]
    if bad:
        print(f"\ngreedy output differs from transformers' generate alone: {bad}", file=sys.stderr)
    return 1 if bad else 0


def report(rows: list[dict], args, index, started: float) -> None:
    import transformers

    print(
        f"\nmachine: {machine()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, ray {ray.__version__}; {THREADS} thread per "
        f"worker and for transformers; total {time.perf_counter() - started:.0f} s"
    )
    print(
        f"model: {index.total_bytes / MIB:.1f} MiB; {args.new_tokens} new tokens per request, "
        f"greedy; medians of {args.repeats} interleaved runs\n"
    )
    print(
        "| stages | micro-batches | offloaded MiB | N | ours tokens/s | transformers batch of N "
        "tokens/s | ours / transformers | H2D MiB per token | x (offloaded / N) | "
        "batch-1 ms/token ratio | greedy = transformers |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        off = r["offloaded_bytes"]
        for n in r["batches"]:
            c = r[n]
            b1 = f"{c['batch1_ratio']:.2f}" if c["batch1_ratio"] else "-"
            micro = r["micro_batches"] or ("auto: 1" if off else f"auto: {r['stages']}")
            print(
                f"| {r['stages']} | {micro} | {off / MIB:.1f} | "
                f"{n} | {c['ours_tokens_per_s']:.1f} | {c['hf_tokens_per_s']:.1f} | "
                f"{c['ratio']:.2f} | {c['bytes_per_token'] / MIB:.2f} | "
                f"{c['bytes_per_token'] / (off / n) if off else 0:.2f} | {b1} | "
                f"{'yes' if not r['mismatches'] else 'NO'} |"
            )
    for r in rows:
        if "stall" in r:
            s = r["stall"]
            print(
                f"\nstall ({r['stages']} stage, prefill_tokens {r['prefill_tokens']}): a "
                f"{STALL_PROMPT}-token prompt joining 4 decoding requests: longest gap between "
                f"two tokens {s['max_gap_s'] * 1e3:.0f} ms, median gap "
                f"{s['median_gap_s'] * 1e3:.0f} ms"
            )


if __name__ == "__main__":
    raise SystemExit(main())
