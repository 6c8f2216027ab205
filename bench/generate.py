"""Generation benchmark: time per new token, prefill time and tokens/s of `job.generate` (KV
caches on the workers) over 1, 2 and 3 pipeline stages, with 1 and 4 requests in flight,
against transformers' `generate` on the same checkpoint in this process with the same thread
count.

One random-weight Llama checkpoint (`make_checkpoint`: 8 layers, hidden 512, 8 heads / 4 kv
heads, intermediate 1408, vocab 4096, float32), page cache warm. For each stage count k:

  launch    - a fresh embedded Ray with k logical GPUs (the device being the CPU), then
              `launch(JobConfig(checkpoint, gpu_memory_bytes=budget, max_batch=4, max_seq_len))`
              with a per-GPU budget that holds the whole model and its KV reservation, so
              nothing is offloaded (this bench is about generation); the planner minimises the
              slowest stage, so it uses every GPU the cluster has: the number of GPUs sets the
              number of stages (the stage count actually planned is printed). 1 CPU per worker
              (JobConfig's default cpus_per_worker: each worker computes on 1 thread)
  per token - one request of batch 1, greedy, eos_token_id=None (exactly --new-tokens new
              tokens), at an 8-token and a 384-token prompt. Each token is timestamped as it
              comes (ours: `on_token`; transformers: a streamer): prefill = time to the first
              token, per token = (last token - first token) / (new tokens - 1). Target: per token
              at 384 within 2x of per token at 8; one stage within 1.3x of transformers
  prefill   - a 512-token prompt, max_new_tokens=1: time to the first token, both sides
  in flight - 1 request vs 4 requests at once (4 threads calling `job.generate`, each batch 1
              with its own 8-token prompt, batched by the engine): tokens/s = all new tokens /
              wall time. For context, transformers with the 4 prompts as one batch of 4
  ratios    - ours / transformers per token: the median, over the interleaved runs, of each of
              our runs against the transformers run right after it (robust to the machine's
              drift, which moves both of a pair alike)
  worker    - each worker's own `forward_s` / `forwards` over the 8-token runs (telemetry
              before and after): the compute of one step on each stage, the rest of a token's
              time being Ray calls, transfers and the driver's loop
  Ray       - median round trip of a no-op actor call: the engine's decode steps run in bursts
              of up to 8 driven by the first stage (`StageWorker.batch_steps`), one actor call
              per stage per step, the driver called once per burst

The transformers side is `AutoModelForCausalLM.from_pretrained` in this process with
torch.set_num_threads(1), as the workers; its runs take turns with ours (interleaved, medians of
--repeats) in every stage-count section, so drift hits both alike. Correctness: every greedy
output of ours (8-, 384- and 512-token prompts, each of the 4 requests in flight, on every stage
count) must equal transformers' `generate` for the same prompt bitwise; any mismatch is printed
and the script exits 1. About 3-4 minutes on 2 cores (--quick: 2).

    python bench/generate.py [--quick] [--stages 1,2,3] [--repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
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

from bench.workload import greedy_batch, stamping_streamer
from coordinator.config import JobConfig
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

MIB = 2**20
WORKER_THREADS = 1  # JobConfig's default cpus_per_worker; transformers runs with as many
IN_FLIGHT = 4  # requests at once (and max_batch: each is one sequence)
PER_TOKEN_TARGET = 1.3  # one stage vs transformers
CONTEXT_TARGET = 2.0  # per token at the long prompt vs the short one
WARM_READ_BYTES = 16 * MIB
BUDGET_MARGIN_BYTES = 16 * MIB  # on top of the model and its KV reservation, per GPU
PINGS = 50  # no-op actor calls timed, for the bare cost of a call


def warm_page_cache(index: CheckpointIndex) -> None:
    for name in index.files:
        with open(index.root / name, "rb", buffering=0) as f:
            while f.read(WARM_READ_BYTES):
                pass


def prompt(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def timing(start: float, stamps: list[float]) -> dict:
    """Prefill (to the first token) and per-token time from the tokens' timestamps."""
    per_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"prefill_s": stamps[0] - start, "per_token_s": per_token, "total_s": stamps[-1] - start}


def ours(job, ids: torch.Tensor, new_tokens: int) -> tuple[dict, torch.Tensor]:
    stamps: list[float] = []
    start = time.perf_counter()
    out = job.generate(
        ids,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        on_token=lambda row, token: stamps.append(time.perf_counter()),
    )
    assert len(stamps) == new_tokens, (len(stamps), new_tokens)
    return timing(start, stamps), out


def machine() -> str:
    """This machine in words: architecture (CPU model), CPUs, memory."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return (
        f"{platform.machine()} ({cpu}), {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    )


def theirs(model, ids: torch.Tensor, new_tokens: int) -> tuple[dict, torch.Tensor]:
    streamer = stamping_streamer()
    start, _, out = greedy_batch(model, ids, new_tokens, streamer=streamer)
    stamps = streamer.stamps[1:]
    assert len(stamps) == new_tokens, (len(stamps), new_tokens)
    return timing(start, stamps), out


def worker_steps(job) -> list[tuple[float, int]]:
    return [(r.forward_s, r.forwards) for r in job.telemetry()]


def ray_call_s(job, count: int = PINGS) -> float:
    """Median round trip of a no-op actor call (`ping`) to the first worker: the floor of the
    one call per stage a decode step makes (its ids, mask and positions go inside the call as
    `worker.wire` arrays)."""
    actor = job.workers[0].actor
    pings = []
    for _ in range(count):
        start = time.perf_counter()
        ray.get(actor.ping.remote(), timeout=60)
        pings.append(time.perf_counter() - start)
    return statistics.median(pings)


def median(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def run_stages(
    num_gpus: int, checkpoint: str, model, prompts: dict, expected: dict, args: argparse.Namespace
) -> dict:
    """One stage count: a fresh Ray with `num_gpus` logical GPUs, one job, every measurement."""
    n, repeats = args.new_tokens, args.repeats
    mismatches: list[str] = []

    def check(name: str, got: torch.Tensor) -> None:
        if not torch.equal(got, expected[name]):
            mismatches.append(name)

    row: dict = {"gpus": num_gpus, "load_average": psutil.getloadavg()[0]}
    ray.init(
        address="local",
        num_cpus=num_gpus + 1,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        start = time.perf_counter()
        config = JobConfig(
            checkpoint=checkpoint,
            gpu_memory_bytes=args.budget_bytes,
            max_batch=IN_FLIGHT,
            max_seq_len=args.max_seq_len,
        )
        with launch(config) as job, ThreadPoolExecutor(IN_FLIGHT) as pool:
            row["launch_s"] = time.perf_counter() - start
            stages = job.plan.stages
            row["stages"] = len(stages)
            row["layers"] = [f"{s.layers[0]}..{s.layers[-1]}" for s in stages]
            row["offloaded_bytes"] = sum(s.offloaded_bytes for s in stages)
            row["kv_bytes"] = sum(s.kv_bytes for s in stages)
            ours(job, prompts["short"], n)  # warm-up: first calls, caches, allocator
            theirs(model, prompts["short"], n)

            # per token at the short and the long prompt, ours and transformers taking turns
            samples: dict[str, list[dict]] = {
                k: [] for k in ("ours_short", "ours_long", "hf_short", "hf_long")
            }
            steps = [0.0] * len(stages)
            counts = [0] * len(stages)
            for _ in range(repeats):
                for size in ("short", "long"):
                    before = worker_steps(job)
                    timed, out = ours(job, prompts[size], n)
                    after = worker_steps(job)
                    if size == "short":
                        for i, ((s0, c0), (s1, c1)) in enumerate(zip(before, after, strict=True)):
                            steps[i] += s1 - s0
                            counts[i] += c1 - c0
                    samples[f"ours_{size}"].append(timed)
                    check(size, out)
                    timed, out = theirs(model, prompts[size], n)
                    samples[f"hf_{size}"].append(timed)
                    check(size, out)
            for key, values in samples.items():
                row[key] = {
                    "per_token_s": median(values, "per_token_s"),
                    "prefill_s": median(values, "prefill_s"),
                    "total_s": median(values, "total_s"),
                }
            for size in ("short", "long"):  # each run of ours against the run right after it
                row[f"ratio_{size}"] = statistics.median(
                    o["per_token_s"] / h["per_token_s"]
                    for o, h in zip(samples[f"ours_{size}"], samples[f"hf_{size}"], strict=True)
                )
            row["worker_step_s"] = [s / c for s, c in zip(steps, counts, strict=True)]
            row["ping_s"] = ray_call_s(job)

            # prefill of the long prompt: time to the first (only) token
            prefill: dict[str, list[float]] = {"ours": [], "hf": []}
            for _ in range(max(repeats // 2, 1)):
                timed, out = ours(job, prompts["prefill"], 1)
                prefill["ours"].append(timed["prefill_s"])
                check("prefill", out)
                timed, out = theirs(model, prompts["prefill"], 1)
                prefill["hf"].append(timed["prefill_s"])
                check("prefill", out)
            row["prefill_s"] = {k: statistics.median(v) for k, v in prefill.items()}

            # requests in flight: 1 vs 4 at once (threads), and transformers' batch of 4
            flight: dict[str, list[float]] = {"one": [], "four": [], "hf_batch": []}
            batch = torch.cat([prompts[f"flight{i}"] for i in range(IN_FLIGHT)])
            for _ in range(max(repeats // 2, 1)):
                start = time.perf_counter()
                _, out = ours(job, prompts["flight0"], n)
                flight["one"].append(n / (time.perf_counter() - start))
                check("flight0", out)
                start = time.perf_counter()
                outs = list(
                    pool.map(lambda i: ours(job, prompts[f"flight{i}"], n)[1], range(IN_FLIGHT))
                )
                flight["four"].append(IN_FLIGHT * n / (time.perf_counter() - start))
                for i, out in enumerate(outs):
                    check(f"flight{i}", out)
                start = time.perf_counter()
                theirs(model, batch, n)
                flight["hf_batch"].append(IN_FLIGHT * n / (time.perf_counter() - start))
            row["tokens_per_s"] = {k: statistics.median(v) for k, v in flight.items()}
    finally:
        ray.shutdown()
    row["mismatches"] = sorted(set(mismatches))
    row["load_average_end"] = psutil.getloadavg()[0]
    return row


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def tables(rows: list[dict], args: argparse.Namespace) -> str:
    short, long, pre = args.short_len, args.long_len, args.prefill_len
    head = (
        f"| stages | layers per stage | ours ms/token @{short} | ours ms/token @{long} | "
        f"ratio {long}/{short} | transformers ms/token @{short} | transformers ms/token "
        f"@{long} | ours / transformers @{short} (median of pairs) | @{long} | worker forward ms/step, per "
        f"stage | Ray no-op call ms | ours prefill {pre} ms | transformers prefill {pre} ms | "
        "greedy = transformers |"
    )
    lines = [head, "|---:|---|" + "---:|" * 11 + "---|"]
    for r in rows:
        os_, ol = r["ours_short"]["per_token_s"], r["ours_long"]["per_token_s"]
        hs, hl = r["hf_short"]["per_token_s"], r["hf_long"]["per_token_s"]
        lines.append(
            f"| {r['stages']} | {', '.join(r['layers'])} | {ms(os_)} | {ms(ol)} | "
            f"{ol / os_:.2f} | {ms(hs)} | {ms(hl)} | {r['ratio_short']:.2f} | "
            f"{r['ratio_long']:.2f} | "
            f"{' + '.join(ms(s) for s in r['worker_step_s'])} | {r['ping_s'] * 1e3:.2f} | "
            f"{ms(r['prefill_s']['ours'])} | "
            f"{ms(r['prefill_s']['hf'])} | "
            f"{'yes' if not r['mismatches'] else 'NO: ' + ', '.join(r['mismatches'])} |"
        )
    lines += [
        "",
        f"| stages | ours tokens/s, 1 request | ours tokens/s, {IN_FLIGHT} requests "
        f"in flight | {IN_FLIGHT} / 1 | transformers tokens/s, batch 1 | transformers "
        f"tokens/s, one batch of {IN_FLIGHT} | load average (1 min) start / end |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        t = r["tokens_per_s"]
        hf_one = args.new_tokens / r["hf_short"]["total_s"]
        lines.append(
            f"| {r['stages']} | {t['one']:.1f} | {t['four']:.1f} | {t['four'] / t['one']:.2f} | "
            f"{hf_one:.1f} | {t['hf_batch']:.1f} | {r['load_average']:.2f} / "
            f"{r['load_average_end']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny checkpoint, short prompts, 1 repeat"
    )
    parser.add_argument("--stages", default="1,2,3", help="logical GPU counts to run")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8, help="attention heads (kv heads: half)")
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32, help="per request")
    parser.add_argument("--short-len", type=int, default=8, help="short prompt, tokens")
    parser.add_argument("--long-len", type=int, default=384, help="long prompt, tokens")
    parser.add_argument("--prefill-len", type=int, default=512, help="prefill prompt, tokens")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs (medians)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.intermediate, args.vocab = 4, 64, 4, 128, 512
        args.new_tokens, args.long_len, args.prefill_len, args.repeats = 8, 48, 64, 1
    stage_counts = [int(s) for s in args.stages.split(",") if s.strip()]
    args.max_seq_len = max(args.prefill_len + 1, args.long_len + args.new_tokens)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(WORKER_THREADS)
    started = time.perf_counter()
    load_start = psutil.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    try:
        shape = CheckpointShape(
            arch="llama",
            dtype=args.dtype,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.heads // 2,
            intermediate_size=args.intermediate,
            vocab_size=args.vocab,
            max_positions=1024,
            max_shard_bytes=64 * MIB,
        )
        checkpoint = str(make_checkpoint(tmp / "llama", shape))
        index = load_index(checkpoint)
        warm_page_cache(index)
        kv_bytes = sum(layer.kv_bytes(IN_FLIGHT, args.max_seq_len) for layer in index.layers)
        args.budget_bytes = index.total_bytes + kv_bytes + BUDGET_MARGIN_BYTES
        vocab = index.config["vocab_size"]
        prompts = {
            "short": prompt(args.short_len, vocab, 1),
            "long": prompt(args.long_len, vocab, 2),
            "prefill": prompt(args.prefill_len, vocab, 3),
        }
        for i in range(IN_FLIGHT):
            prompts[f"flight{i}"] = prompt(args.short_len, vocab, 10 + i)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, args.dtype))
        expected = {
            name: theirs(model, ids, 1 if name == "prefill" else args.new_tokens)[1]
            for name, ids in prompts.items()
        }
        rows = []
        for num_gpus in stage_counts:
            rows.append(run_stages(num_gpus, checkpoint, model, prompts, expected, args))
            r = rows[-1]
            print(
                f"{num_gpus} GPU(s): {r['stages']} stage(s), ours "
                f"{ms(r['ours_short']['per_token_s'])} / {ms(r['ours_long']['per_token_s'])} "
                f"ms/token, transformers {ms(r['hf_short']['per_token_s'])} / "
                f"{ms(r['hf_long']['per_token_s'])}; mismatches {r['mismatches'] or 'none'} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    import transformers

    print(
        f"\nmachine: {machine()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, ray {ray.__version__}; workers and "
        f"transformers on {WORKER_THREADS} thread each"
    )
    print(
        f"model: llama {args.dtype}, {args.layers} layers, hidden {args.hidden}, {args.heads} "
        f"heads / {args.heads // 2} kv heads, intermediate {args.intermediate}, vocab "
        f"{args.vocab}: {index.total_bytes / MIB:.1f} MiB; KV reserved for {IN_FLIGHT} x "
        f"{args.max_seq_len} tokens: {kv_bytes / MIB:.1f} MiB; per-GPU budget "
        f"{args.budget_bytes / MIB:.1f} MiB (nothing offloaded: "
        f"{all(r['offloaded_bytes'] == 0 for r in rows)})"
    )
    launches = ", ".join(f"{r['launch_s']:.1f}" for r in rows)
    print(
        f"{args.new_tokens} new tokens per request, greedy, no end token; medians of "
        f"{args.repeats} interleaved runs ({max(args.repeats // 2, 1)} for prefill and in "
        f"flight); launch s: {launches}"
    )
    print(
        f"load average: start {load_start[0]:.2f}, end {psutil.getloadavg()[0]:.2f}; "
        f"total {elapsed:.0f} s\n"
    )
    print(tables(rows, args))
    if args.json:
        args.json.write_text(json.dumps({"elapsed_s": elapsed, "rows": rows}, indent=2))
    bad = [(r["stages"], r["mismatches"]) for r in rows if r["mismatches"]]
    if bad:
        print(f"\ngreedy output differs from transformers' generate: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
