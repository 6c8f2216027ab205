"""Families benchmark: for each tested model family and dtype, the pipeline's logits against
transformers' on the same checkpoint, the plan it got, and its load time against
`from_pretrained`'s.

Cases: every family of `worker.layout.TESTED_FAMILIES` in float32, and llama, qwen3 and mixtral
in bfloat16 too. For each case:

  checkpoint - a random-weight checkpoint written by transformers (`make_checkpoint`): 8 layers,
               hidden 512, intermediate 1024 (each expert's, 4 experts in the MoE families),
               vocab 8192, 20 MiB shards; deleted when the case is done
  launch     - `launch(JobConfig(checkpoint, gpu_memory_bytes=budget))` on one embedded Ray for
               the whole bench (3 logical GPUs, the device being the CPU, 1 CPU per worker).
               budget = total // 3 - largest decoder layer // 4 (as tests/test_pipeline.py), so
               the 3 GPUs cannot hold the model resident and some stage offloads; raised to
               the largest embedding/head + the largest decoder layer if the planner refuses.
               Timed two ways: the wall time of `launch()` (Ray probe, 3 worker processes
               started, their imports, plan, load) and the workers' own `load_s` (building the
               stage, reading its bytes, the first prefetch into the slot; no process start or
               imports), max over the workers since they load in parallel. --launches jobs per
               case (default 2): every one's logits are checked, the smallest load counts
  forward    - `job.forward(ids)`, ids of shape (2, 16), longer than every sliding window
  reference  - `reference_logits` (from_pretrained in the checkpoint's dtype, 1 thread as the
               workers); max |diff| of the logits, and whether they are bitwise equal
  from_pretrained - `AutoModelForCausalLM.from_pretrained(checkpoint, dtype=...)`, best of
               --repeats in this process (torch's default threads). transformers leaves every
               tensor it does not convert as a view of the memory-mapped file (the bytes left so
               are printed), so this reads (almost) nothing, while a worker reads its bytes into
               its own buffers, as any move to a device must. Hence also "fresh process": in a
               new interpreter (the model class imported first, as a worker does before its
               load_s), from_pretrained and then a copy of every parameter into the process's
               memory; this one includes from_pretrained's first-call costs

Page cache warm on both sides: each checkpoint's files are read once before the launch (and
were just written). ratio = worker load_s (max) / from_pretrained s; ratio to fresh = the same
/ (fresh from_pretrained + copy). Our workers each read only their share, in parallel, while
from_pretrained maps everything in one process. About 10 minutes on 2 cores.

    python bench/families.py [--families llama,mixtral] [--quick] [--launches 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import wait_gpus_released  # bench/load.py, beside this script

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from coordinator.planning.planner import PlanError
from coordinator.runtime.launch import launch
from coordinator.tools.make_checkpoint import NO_KV_HEADS, CheckpointShape, make_checkpoint
from coordinator.tools.reference import reference_logits
from worker.layout import TESTED_FAMILIES

MIB = 2**20
BFLOAT16_FAMILIES = ("llama", "qwen3", "mixtral")
NUM_GPUS = 3
RAY_CPUS = 4  # one per worker, and one to spare for the probe tasks
WORKER_THREADS = 1  # JobConfig's default cpus_per_worker: the reference runs with as many
BATCH, SEQ_LEN = 2, 16  # longer than make_checkpoint's sliding windows (4)
WARM_READ_BYTES = 16 * MIB
TRACEBACK_LINES = 4  # of a failed case, in the report
FRESH_TIMEOUT_S = 300.0  # one fresh-interpreter from_pretrained
# A fresh interpreter, as a worker is: import the model's class first (building it on the meta
# device), as a worker does before its load_s starts; then from_pretrained, then a copy of
# every parameter into the process's own memory, reading what from_pretrained left mapped.
_FRESH_FROM_PRETRAINED = """
import json, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging
logging.disable_progress_bar()
logging.set_verbosity_error()
path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
with torch.device("meta"):
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
loaded = time.perf_counter()
with torch.no_grad():
    for param in model.parameters():
        param.data = param.data.clone()
print(json.dumps({"from_pretrained_s": loaded - start, "copy_s": time.perf_counter() - loaded}))
"""


def cases(families: list[str]) -> list[tuple[str, str]]:
    rows = [(arch, "float32") for arch in TESTED_FAMILIES if arch in families]
    return rows + [(arch, "bfloat16") for arch in BFLOAT16_FAMILIES if arch in families]


def shape_for(arch: str, dtype: str, args: argparse.Namespace) -> CheckpointShape:
    return CheckpointShape(
        arch=arch,
        dtype=dtype,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.heads if arch in NO_KV_HEADS else args.heads // 2,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        num_experts=args.experts,
        max_positions=512,
        max_shard_bytes=args.shard_mib * MIB,
    )


def warm_page_cache(index: CheckpointIndex) -> int:
    """Read every shard once so that the workers and from_pretrained both read from memory."""
    total = 0
    for name in index.files:
        with open(index.root / name, "rb", buffering=0) as f:
            while chunk := f.read(WARM_READ_BYTES):
                total += len(chunk)
    return total


def budgets(index: CheckpointIndex) -> tuple[int, int]:
    """(budget, fallback): a per-GPU budget below a third of the model (tests/test_pipeline.py's
    budget_forcing_offload), and what an embedding or head plus one decoder slot needs, for a
    model whose embedding does not fit the first."""
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    other = max(layer.nbytes for layer in index.layers if layer.kind != "decoder")
    budget = index.total_bytes // NUM_GPUS - decoder // 4
    return budget, max(budget, other + decoder)


def run_job(checkpoint: str, budget: int, ids: torch.Tensor) -> dict:
    start = time.perf_counter()
    with launch(JobConfig(checkpoint=checkpoint, gpu_memory_bytes=budget)) as job:
        launch_wall_s = time.perf_counter() - start
        logits = job.forward(ids)
        stages = job.plan.stages
        result = {
            "gpu_memory_bytes": budget,
            "stages": len(stages),
            "layers_offloaded": sum(len(s.offloaded) for s in stages),
            "offloaded_bytes": sum(s.offloaded_bytes for s in stages),
            "plan_summary": job.plan.summary(),
            "launch_wall_s": launch_wall_s,
            "load_s": [r.load_s for r in job.load_reports],
            "init_s": [r.init_s for r in job.load_reports],
            "bytes_read": [r.bytes_read for r in job.load_reports],
            "logits": logits,
        }
    wait_gpus_released(NUM_GPUS)
    return result


def file_backed_bytes(model: torch.nn.Module) -> int:
    """Bytes of `model`'s parameters that are views of a memory-mapped .safetensors file
    (Linux: /proc/self/maps; 0 elsewhere)."""
    ranges = []
    maps = Path("/proc/self/maps")
    for line in maps.read_text().splitlines() if maps.exists() else []:
        parts = line.split()
        if len(parts) >= 6 and parts[5].endswith(".safetensors"):
            low, high = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((low, high))
    return sum(
        p.nbytes for p in model.parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)
    )


def time_from_pretrained(checkpoint: str, dtype: str, repeats: int) -> dict:
    """Best of `repeats` from_pretrained calls in this process, how much of the model it left
    memory-mapped, and the same in a fresh interpreter followed by a copy of every parameter."""
    from transformers import AutoModelForCausalLM

    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
        samples.append(time.perf_counter() - start)
        mapped = file_backed_bytes(model)
        del model
    command = [sys.executable, "-c", _FRESH_FROM_PRETRAINED, checkpoint, dtype]
    out = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=FRESH_TIMEOUT_S
    )
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "samples_s": samples,
        "best_s": min(samples),
        "file_backed_bytes": mapped,
        "fresh_s": fresh["from_pretrained_s"],
        "fresh_copy_s": fresh["copy_s"],
    }


def run_case(arch: str, dtype: str, args: argparse.Namespace, tmp: Path) -> dict:
    row: dict = {"family": arch, "dtype": dtype, "load_average": psutil.getloadavg()[0]}
    checkpoint = tmp / f"{arch}-{dtype}"
    try:
        start = time.perf_counter()
        make_checkpoint(checkpoint, shape_for(arch, dtype, args))
        row["make_s"] = time.perf_counter() - start
        index = load_index(checkpoint)
        row["total_bytes"] = index.total_bytes
        row["files"] = len(index.files)
        warm_page_cache(index)
        vocab = index.config["vocab_size"]
        ids = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        budget, fallback = budgets(index)
        jobs = []
        for _ in range(args.launches):
            try:
                jobs.append(run_job(str(checkpoint), budget, ids))
            except PlanError as exc:
                row["plan_error_at_budget"] = f"{budget}: {exc}"
                budget = fallback
                jobs.append(run_job(str(checkpoint), budget, ids))
        expected = reference_logits(str(checkpoint), ids, num_threads=WORKER_THREADS)
        logits = [job.pop("logits") for job in jobs]
        row |= {k: v for k, v in jobs[0].items() if k not in ("launch_wall_s", "load_s")}
        row["launches"] = [
            {"launch_wall_s": j["launch_wall_s"], "load_s": j["load_s"]} for j in jobs
        ]
        if not row["layers_offloaded"]:
            row["note"] = "the plan offloads nothing"
        row["logits_dtype"] = f"{logits[0].dtype} / {expected.dtype}"
        row["max_abs_diff"] = max(float((x.float() - expected.float()).abs().max()) for x in logits)
        row["bitwise"] = all(torch.equal(x, expected) for x in logits)
        row["from_pretrained"] = time_from_pretrained(str(checkpoint), dtype, args.repeats)
        row["launch_wall_s"] = min(j["launch_wall_s"] for j in jobs)
        row["worker_load_s"] = min(max(j["load_s"]) for j in jobs)
        fp = row["from_pretrained"]
        row["ratio"] = row["worker_load_s"] / fp["best_s"]
        row["ratio_fresh"] = row["worker_load_s"] / (fp["fresh_s"] + fp["fresh_copy_s"])
    except Exception:
        lines = traceback.format_exc().strip().splitlines()
        row["error"] = "\n".join(lines[-TRACEBACK_LINES:])
        print(f"{arch} {dtype}: FAILED\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    head = (
        "| family | dtype | MiB | stages | layers offloaded | offloaded MiB | max abs diff | "
        "bitwise | launch wall s | worker load s (max) | from_pretrained s | ratio | "
        "fresh process: from_pretrained + copy s | ratio to fresh |"
    )
    lines = [head, "|---|---|" + "---:|" * 12]
    for r in rows:
        if "error" in r:
            last = r["error"].splitlines()[-1]
            lines.append(f"| {r['family']} | {r['dtype']} | FAILED: {last} |" + " |" * 11)
            continue
        fp = r["from_pretrained"]
        lines.append(
            f"| {r['family']} | {r['dtype']} | {r['total_bytes'] / MIB:.1f} | {r['stages']} | "
            f"{r['layers_offloaded']} | {r['offloaded_bytes'] / MIB:.1f} | "
            f"{r['max_abs_diff']:.3g} | {'yes' if r['bitwise'] else 'no'} | "
            f"{r['launch_wall_s']:.1f} | {r['worker_load_s']:.3f} | {fp['best_s']:.3f} | "
            f"{r['ratio']:.2f} | {fp['fresh_s']:.3f} + {fp['fresh_copy_s']:.3f} | "
            f"{r['ratio_fresh']:.2f} |"
        )
    return "\n".join(lines)


def details(rows: list[dict]) -> str:
    def seconds(values: list[float], digits: int = 3) -> str:
        return ", ".join(f"{v:.{digits}f}" for v in values)

    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['family']} {r['dtype']}: FAILED")
            lines.append("  " + r["error"].replace("\n", "\n  "))
            continue
        fp = r["from_pretrained"]
        launches = "; ".join(
            f"wall {j['launch_wall_s']:.1f} s, load_s {seconds(j['load_s'])}" for j in r["launches"]
        )
        lines.append(
            f"{r['family']} {r['dtype']}: {r['files']} shards, budget "
            f"{r['gpu_memory_bytes'] / MIB:.1f} MiB/GPU; launches: {launches}; init_s (imports, "
            f"not in load_s) {seconds(r['init_s'], 2)}; from_pretrained {seconds(fp['samples_s'])}"
            f", leaving {fp['file_backed_bytes'] / MIB:.0f} of {r['total_bytes'] / MIB:.0f} MiB "
            f"memory-mapped; load average {r['load_average']:.2f}"
        )
        if "plan_error_at_budget" in r:
            lines.append(f"  plan error at the first budget: {r['plan_error_at_budget']}")
        if "note" in r:
            lines.append(f"  note: {r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        default=",".join(TESTED_FAMILIES),
        help="comma-separated families to run (both dtypes where a family has two)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny checkpoints (4 layers, hidden 64)"
    )
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8, help="attention heads (kv heads: half)")
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=4, help="MoE families")
    parser.add_argument("--shard-mib", type=int, default=20, help="max shard size")
    parser.add_argument("--repeats", type=int, default=3, help="from_pretrained runs (best)")
    parser.add_argument(
        "--launches", type=int, default=2, help="jobs per case; the best worker load_s counts"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(TESTED_FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(TESTED_FAMILIES)}")
    if args.quick:
        args.layers, args.hidden, args.heads, args.intermediate = 4, 64, 4, 128
        args.vocab, args.shard_mib, args.repeats, args.launches = 512, 1, 1, 1

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    load_start = psutil.getloadavg()
    tmp = tempfile.TemporaryDirectory(prefix="bench-families-")
    # address="local": a Ray of our own even when another one on this machine (a test suite's
    # ray.cluster_utils.Cluster) is recorded in /tmp/ray/ray_current_cluster, which a bare
    # ray.init() would join (and refuse, given num_cpus/num_gpus).
    ray.init(
        address="local",
        num_cpus=RAY_CPUS,
        num_gpus=NUM_GPUS,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        rows = []
        for arch, dtype in cases(families):
            rows.append(run_case(arch, dtype, args, Path(tmp.name)))
            r = rows[-1]
            status = (
                "FAILED"
                if "error" in r
                else (
                    f"diff {r['max_abs_diff']:.3g}, load_s {r['worker_load_s']:.3f}, "
                    f"from_pretrained {r['from_pretrained']['best_s']:.3f}"
                )
            )
            print(f"{arch} {dtype}: {status} ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        ray.shutdown()
        tmp.cleanup()
    elapsed = time.perf_counter() - started
    import transformers

    print(
        f"\nmachine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, ray {ray.__version__}; from_pretrained with "
        f"{torch.get_num_threads()} threads, workers and reference with {WORKER_THREADS}"
    )
    print(
        f"shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate "
        f"{args.intermediate}, vocab {args.vocab}, {args.experts} experts, {args.shard_mib} MiB "
        f"shards; input ({BATCH}, {SEQ_LEN})"
    )
    print(
        f"load average: start {load_start[0]:.2f}, end {psutil.getloadavg()[0]:.2f}; "
        f"total {elapsed:.0f} s\n"
    )
    print(table(rows))
    print()
    print(details(rows))
    if args.json:
        args.json.write_text(json.dumps({"elapsed_s": elapsed, "rows": rows}, indent=2))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
