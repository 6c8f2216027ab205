"""Distributed load benchmark: read time, bytes read and host memory of the workers, on an
embedded local Ray with logical GPUs (workers run on the CPU when there is no CUDA).

Phases:
  baseline  - the same checkpoint read by `safetensors.torch.load_file` shard by shard, each
              tensor copied into the process's memory; once per fresh interpreter, median of
              --repeats (the same in this process is printed for reference)
  1 worker  - launch with gpus=1 and a budget that keeps everything resident; the load time is
              the worker's own `load_s` (prepare + reading, no Ray or process start), median of
              --one-worker-runs jobs. Target: worker load_s / baseline <= 1.3. The driver's
              progress calls also time the chunk reads alone (a diagnostic)
  RSS base  - a job on a tiny checkpoint (1 layer, hidden 32): the peak RSS of a worker that has
              imported torch and transformers but loaded (almost) nothing
  N workers - launch with gpus=N and a per-GPU budget a bit under 1/N of the model, so some
              layers are offloaded. Per worker: bytes read vs its share (the bytes of its
              stage's layers), target within +-1%; and (peak RSS - RSS base) / share,
              target <= 1.1, with the peak taken once the first prefetch slots are filled

Timings are with a warm page cache: dropping caches needs root, so the checkpoint is read once
before anything is timed, and every phase reads from memory. On a CPU-only machine the prefetch
slots of an offloading stage ("device" buffers) are host memory too, so they count in its RSS.

    python bench/load.py [--checkpoint DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.config import JobConfig
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from coordinator.runtime.launch import launch
from coordinator.runtime.session import connect
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

READ_TARGET = 1.3  # worker load_s / single-process safetensors
BYTES_TOLERANCE = 0.01  # bytes read vs share
RSS_TARGET = 1.1  # (peak RSS - worker baseline RSS) / share
RELEASE_TIMEOUT_S = 60.0  # ray.kill is asynchronous: wait this long for the GPUs to come back
WARM_READ_BYTES = 16 * 2**20
MIB = 2**20
# finish_load() starts copying the first offloaded layers into their slots on a thread and
# reports at once, before those pages are touched: report again this much later.
SETTLE_S = 2.0
BASELINE_TIMEOUT_S = 120.0  # one fresh-process safetensors read
# Run in a fresh interpreter: read every shard with safetensors into the process's own memory.
_FRESH_BASELINE = """
import sys, time
from safetensors.torch import load_file
start = time.perf_counter()
kept = [t.clone() for path in sys.argv[1:] for t in load_file(path).values()]
print(time.perf_counter() - start)
"""


def shard_paths(index: CheckpointIndex) -> list[Path]:
    return [index.root / name for name in index.files]


def warm_page_cache(index: CheckpointIndex) -> int:
    """Read every shard once so that every timed phase reads from the page cache."""
    total = 0
    for path in shard_paths(index):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(WARM_READ_BYTES):
                total += len(chunk)
    return total


def safetensors_baseline(index: CheckpointIndex, repeats: int) -> dict:
    """Seconds to read every shard with safetensors into a process's own memory.

    `load_file` maps the file and returns tensors backed by the mapping: no byte is read until
    used (it "reads" at tens of GB/s). A worker ends with the bytes in its own memory, so the
    baseline copies each tensor out of the mapping (`clone`), which reads every page, and keeps
    the copies until the run ends, as a worker keeps its weights.

    The baseline that the target uses runs once in each of `repeats` fresh interpreters, as a
    worker reads once in a fresh process: a long-lived process may get pages it has already
    touched back from its heap (glibc keeps freed memory), sparing the page faults a worker
    pays. The runs in this process are recorded for reference."""
    paths = [str(p) for p in shard_paths(index)]
    fresh = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", _FRESH_BASELINE, *paths],
            capture_output=True,
            text=True,
            check=True,
            timeout=BASELINE_TIMEOUT_S,
        )
        fresh.append(float(out.stdout.strip().splitlines()[-1]))
    here, lazy = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for path in paths:
            load_file(path)
        lazy.append(time.perf_counter() - start)
        start = time.perf_counter()
        kept = [t.clone() for path in paths for t in load_file(path).values()]
        here.append(time.perf_counter() - start)
        del kept
    median = statistics.median(fresh)
    return {
        "method": "load_file + clone of every tensor, once per fresh interpreter",
        "samples_s": fresh,
        "median_s": median,
        "bytes": index.total_bytes,
        "gb_per_s": index.total_bytes / median / 1e9,
        "this_process_samples_s": here,
        "this_process_median_s": statistics.median(here),
        "lazy_load_file_median_s": statistics.median(lazy),
    }


def wait_gpus_released(num_gpus: int) -> None:
    """Bounded: the next job on the same Ray needs every logical GPU back."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while ray.available_resources().get("GPU", 0) < num_gpus:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"logical GPUs not released within {RELEASE_TIMEOUT_S:.0f} s: "
                f"{ray.available_resources()}"
            )
        time.sleep(0.2)


def run_job(config: JobConfig, index: CheckpointIndex) -> dict:
    """Launch, collect the plan and the load reports with each worker's share, take the reports
    again once the prefetch slots have been filled, close."""
    by_name = {layer.name: layer for layer in index.layers}
    ticks: list[float] = []  # driver time of each progress call: 0 bytes, then every chunk
    start = time.perf_counter()
    with launch(config, progress=lambda done, total: ticks.append(time.perf_counter())) as job:
        wall_s = time.perf_counter() - start
        time.sleep(SETTLE_S)  # let the copy thread fill the first prefetch slots
        later = {r.stage: r for r in job.telemetry()}
        reports = {r.stage: r for r in job.load_reports}
        workers = []
        for stage in job.plan.stages:
            report = reports[stage.stage]
            share = sum(by_name[name].file_bytes for name in stage.layers)
            workers.append(
                {
                    "stage": stage.stage,
                    "layers": list(stage.layers),
                    "offloaded": list(stage.offloaded),
                    "share_bytes": share,
                    "resident_bytes": stage.resident_bytes,
                    "offloaded_bytes": stage.offloaded_bytes,
                    "slot_bytes": stage.slot_bytes,
                    "bytes_read": report.bytes_read,
                    "load_s": report.load_s,
                    "host_rss_bytes": report.host_rss_bytes,
                    "host_peak_rss_bytes": report.host_peak_rss_bytes,
                    "host_peak_rss_settled_bytes": later[stage.stage].host_peak_rss_bytes,
                    "backend": report.backend,
                    "device_used_bytes": report.device_used_bytes,
                    "stats": report.stats.to_dict(),
                }
            )
    wait_gpus_released(config.gpus)
    return {
        "launch_wall_s": wall_s,
        # From the first progress call (every worker prepared) to the last chunk, as the driver
        # saw it: the reading part of load_s, plus Ray round trips.
        "read_phase_s": ticks[-1] - ticks[0],
        "plan_summary": job.plan.summary(),
        "workers": workers,
    }


def layer_range(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", type=Path, help="use (or create, if empty) this checkpoint directory"
    )
    parser.add_argument("--layers", type=int, default=6, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shard-mib", type=int, default=64, help="max shard size")
    parser.add_argument("--repeats", type=int, default=5, help="safetensors baseline runs")
    parser.add_argument("--one-worker-runs", type=int, default=3, help="1-worker jobs (median)")
    parser.add_argument(
        "--worker-cpus",
        type=int,
        default=torch.get_num_threads(),
        help="CPUs (and read threads) of the single worker; default: the baseline's threads",
    )
    parser.add_argument("--workers", type=int, default=3, help="logical GPUs, offloading phase")
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.3,
        help="per-GPU budget of the offloading phase, as a fraction of the model's bytes",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="bench-load-")
    try:
        return run(args, Path(tmp.name))
    finally:
        if ray.is_initialized():  # an error between a connect and its close
            ray.shutdown()
        tmp.cleanup()


def run(args: argparse.Namespace, tmp: Path) -> int:
    shape = CheckpointShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_shard_bytes=args.shard_mib * MIB,
    )
    checkpoint = args.checkpoint or tmp / "ckpt"
    start = time.perf_counter()
    made = not (checkpoint / "config.json").exists()
    if made:
        make_checkpoint(checkpoint, shape)
    make_s = time.perf_counter() - start
    tiny = make_checkpoint(
        tmp / "tiny",
        CheckpointShape(
            num_layers=1,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=64,
            vocab_size=128,
        ),
    )
    index = load_index(checkpoint)
    tiny_index = load_index(tiny)
    total = index.total_bytes

    result: dict = {
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}, "
        f"ray {ray.__version__}, cuda {torch.cuda.is_available()}",
        "load_average_start": list(psutil.getloadavg()),
        "args": {k: str(v) for k, v in vars(args).items()},
        "checkpoint": {
            "path": str(checkpoint),
            "made_here": made,
            "make_s": make_s if made else None,
            "files": len(index.files),
            "layers": len(index.layers),
            "total_bytes": total,
        },
        "page_cache": "warm: the checkpoint is read once before timing (no cache drop: not root)",
    }
    result["checkpoint"]["warm_read_bytes"] = warm_page_cache(index)
    result["baseline"] = safetensors_baseline(index, args.repeats)
    base_s = result["baseline"]["median_s"]

    # One worker, everything resident: one embedded Ray for all runs (each job leaves it up).
    # Same CPU budget as the baseline, whose fresh interpreter uses torch's default threads.
    one = JobConfig(
        checkpoint=str(checkpoint),
        gpus=1,
        gpu_memory_bytes=total + 64 * MIB,
        cpus_per_worker=args.worker_cpus,
    )
    session = connect(one)
    try:
        runs = [run_job(one, index) for _ in range(args.one_worker_runs)]
    finally:
        session.close()
    load_s = [max(w["load_s"] for w in r["workers"]) for r in runs]
    read_s = [r["read_phase_s"] for r in runs]
    result["one_worker"] = {
        "cpus_per_worker": args.worker_cpus,
        "runs": runs,
        "load_s": load_s,
        "median_load_s": statistics.median(load_s),
        "launch_wall_s": [r["launch_wall_s"] for r in runs],
        "ratio_to_baseline": statistics.median(load_s) / base_s,
        "read_phase_s": read_s,
        "median_read_phase_s": statistics.median(read_s),
        "read_phase_ratio_to_baseline": statistics.median(read_s) / base_s,
    }

    # N workers: first the RSS baseline (tiny checkpoint) on the same Ray, then the real job.
    budget = int(total * args.budget_fraction)
    many = JobConfig(checkpoint=str(checkpoint), gpus=args.workers, gpu_memory_bytes=budget)
    session = connect(many)
    try:
        tiny_job = run_job(
            JobConfig(checkpoint=str(tiny), gpus=args.workers, gpu_memory_bytes=256 * MIB),
            tiny_index,
        )
        offload_job = run_job(many, index)
    finally:
        session.close()
    # Peak RSS once the first prefetch slots have been written: the load report is taken
    # before the copy thread has touched them.
    peak = "host_peak_rss_settled_bytes"
    rss_base = int(statistics.median(w[peak] for w in tiny_job["workers"]))
    for w in offload_job["workers"]:
        w["read_over_share"] = w["bytes_read"] / w["share_bytes"]
        w["rss_growth_over_share"] = (w[peak] - rss_base) / w["share_bytes"]
        w["rss_growth_at_load_over_share"] = (w["host_peak_rss_bytes"] - rss_base) / w[
            "share_bytes"
        ]
        w["rss_growth_less_slots_over_share"] = (w[peak] - rss_base - w["slot_bytes"]) / w[
            "share_bytes"
        ]
    result["rss_baseline"] = {
        "peak_rss_bytes": [w[peak] for w in tiny_job["workers"]],
        "used_bytes": rss_base,
        "rule": "median over the tiny job's workers, settled peak",
    }
    result["offload"] = {"gpu_memory_bytes": budget, **offload_job}
    result["load_average_end"] = list(psutil.getloadavg())

    workers = offload_job["workers"]
    worst_read = max(workers, key=lambda w: abs(w["read_over_share"] - 1))
    worst_rss = max(workers, key=lambda w: w["rss_growth_over_share"])
    worst_less = max(workers, key=lambda w: w["rss_growth_less_slots_over_share"])
    ratio = result["one_worker"]["ratio_to_baseline"]
    result["targets"] = {
        "load_ratio": {"value": ratio, "target": READ_TARGET, "met": ratio <= READ_TARGET},
        "bytes_read": {
            "value": worst_read["read_over_share"],
            "stage": worst_read["stage"],
            "target": BYTES_TOLERANCE,
            "met": abs(worst_read["read_over_share"] - 1) <= BYTES_TOLERANCE,
        },
        "peak_rss": {
            "value": worst_rss["rss_growth_over_share"],
            "stage": worst_rss["stage"],
            "target": RSS_TARGET,
            "met": worst_rss["rss_growth_over_share"] <= RSS_TARGET,
        },
        "peak_rss_less_slots": {
            "value": worst_less["rss_growth_less_slots_over_share"],
            "stage": worst_less["stage"],
            "target": RSS_TARGET,
            "met": worst_less["rss_growth_less_slots_over_share"] <= RSS_TARGET,
        },
    }
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def report(result: dict) -> None:
    ckpt = result["checkpoint"]
    base = result["baseline"]
    one = result["one_worker"]
    off = result["offload"]
    load = result["load_average_start"]
    print(f"machine: {result['machine']}; load average at start {load[0]:.2f}")
    print(
        f"checkpoint: {ckpt['total_bytes'] / MIB:.1f} MiB float32 in {ckpt['files']} shards, "
        f"{ckpt['layers']} pipeline layers ({ckpt['path']})"
    )
    print(f"page cache: {result['page_cache']}")

    def runs(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    total = ckpt["total_bytes"]
    print("\nread time, 1 process vs 1 worker (warm page cache; medians)")
    print(
        f"  safetensors load_file + clone, fresh process   : {base['median_s']:7.3f} s "
        f"{base['gb_per_s']:5.2f} GB/s (runs {runs(base['samples_s'])})"
    )
    print(
        f"    the same in this long-lived process          : "
        f"{base['this_process_median_s']:7.3f} s "
        f"{total / base['this_process_median_s'] / 1e9:5.2f} GB/s (runs "
        f"{runs(base['this_process_samples_s'])}; reference only: reuses touched pages)"
    )
    print(
        f"    load_file alone (lazy mmap, reads nothing)   : "
        f"{base['lazy_load_file_median_s']:7.3f} s"
    )
    print(
        f"  1 worker, {one['cpus_per_worker']} CPUs, worker-side load_s           : {one['median_load_s']:7.3f} s "
        f"{total / one['median_load_s'] / 1e9:5.2f} GB/s (runs {runs(one['load_s'])})"
    )
    print(
        f"    of which chunk reads, seen by the driver     : {one['median_read_phase_s']:7.3f} s "
        f"{total / one['median_read_phase_s'] / 1e9:5.2f} GB/s (runs {runs(one['read_phase_s'])})"
    )
    print(
        f"  1 worker, launch() wall, with Ray probe, process start, imports: "
        f"{runs(one['launch_wall_s'])} s"
    )
    print(
        f"  ratio load_s / safetensors: {one['ratio_to_baseline']:.2f}; chunk reads only: "
        f"{one['read_phase_ratio_to_baseline']:.2f} (diagnostic, not the target)"
    )

    rss_base = result["rss_baseline"]["used_bytes"]
    print(
        f"\n{len(off['workers'])} workers, gpu_memory_bytes {off['gpu_memory_bytes'] / MIB:.1f} "
        f"MiB each; worker RSS baseline (tiny checkpoint) {rss_base / MIB:.1f} MiB; "
        f"launch() wall {off['launch_wall_s']:.1f} s, chunk reads {off['read_phase_s']:.3f} s"
    )
    print(off["plan_summary"])
    print(
        f"\n{'stage':>5} {'layers':>18} {'share':>9} {'offload':>9} {'slots':>8} {'read':>9} "
        f"{'read/sh':>8} {'pk@load':>8} {'pk@set':>8} {'growth/sh':>9} {'-slots':>7} "
        f"{'load_s':>7}"
    )
    for w in off["workers"]:
        print(
            f"{w['stage']:>5} {layer_range(w['layers']):>18} "
            f"{w['share_bytes'] / MIB:>6.1f}MiB {w['offloaded_bytes'] / MIB:>6.1f}MiB "
            f"{w['slot_bytes'] / MIB:>5.1f}MiB {w['bytes_read'] / MIB:>6.1f}MiB "
            f"{w['read_over_share']:>8.4f} {w['host_peak_rss_bytes'] / MIB:>5.0f}MiB "
            f"{w['host_peak_rss_settled_bytes'] / MIB:>5.0f}MiB "
            f"{w['rss_growth_over_share']:>9.3f} {w['rss_growth_less_slots_over_share']:>7.3f} "
            f"{w['load_s']:>6.3f}s"
        )
    print(
        f"  pk@load: peak RSS in the load report; pk@set: {SETTLE_S:.0f} s later (slots filled);\n"
        "  growth/sh = (pk@set - RSS baseline) / share; -slots: the same less the prefetch\n"
        "  slots, which are host memory here only because the 'GPU' is the CPU"
    )

    t = result["targets"]
    print(
        f"\ntarget load_s / safetensors <= {READ_TARGET}: {met(t['load_ratio']['met'])} "
        f"({t['load_ratio']['value']:.2f})"
    )
    print(
        f"target bytes read within +-{BYTES_TOLERANCE:.0%} of share: "
        f"{met(t['bytes_read']['met'])} (worst {t['bytes_read']['value'] - 1:+.4%}, "
        f"stage {t['bytes_read']['stage']})"
    )
    for key, label in (("peak_rss", ""), ("peak_rss_less_slots", ", less prefetch slots")):
        print(
            f"target peak RSS <= {RSS_TARGET} x share + baseline{label}: {met(t[key]['met'])} "
            f"(worst {t[key]['value']:.3f} x, stage {t[key]['stage']})"
        )
    end = result["load_average_end"]
    print(f"load average at end {end[0]:.2f} (other processes may share this machine)")


if __name__ == "__main__":
    raise SystemExit(main())
