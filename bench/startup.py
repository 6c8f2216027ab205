"""A stage worker's imports (our `worker` package, torch, transformers and a family's modeling
module) in fresh interpreters: as a Ray worker process of ours imports them, with the GC's
thresholds raised by `worker.startup`, against the same imports in a process that keeps
Python's thresholds (any other process). Interleaved, `--repeats` each; per mode the process
CPU-seconds of the imports, the cyclic GC's own CPU-seconds (timed by `gc.callbacks`: a share
that the machine's load hardly moves) and the collections.

    .venv/bin/python bench/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import gc, json, time
spent, started, count = [0.0], [0.0], [0]

def timed(phase, info):
    if phase == "start":
        started[0] = time.process_time()
    else:
        spent[0] += time.process_time() - started[0]
        count[0] += 1

gc.callbacks.append(timed)
start = time.process_time()
import worker
thresholds = gc.get_threshold()
import torch, worker.worker, transformers.models.llama.modeling_llama
print(json.dumps({"cpu_s": time.process_time() - start, "gc_s": spent[0], "collections": count[0],
                  "thresholds": thresholds}))
"""


def run(script: Path, ray_worker: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_RAYLET_PID"}
    env["PYTHONPATH"] = str(ROOT)
    if ray_worker:
        env["RAY_RAYLET_PID"] = str(os.getpid())  # what a raylet sets for its workers
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # the raylet starts its workers as default_worker.py: worker.startup's test
        quiet = Path(tmp) / "default_worker.py"
        plain = Path(tmp) / "driver.py"
        for script in (quiet, plain):
            script.write_text(CHILD)
        results: dict[str, list[dict]] = {"Ray worker (raised)": [], "other (Python's)": []}
        for _ in range(args.repeats):
            results["Ray worker (raised)"].append(run(quiet, ray_worker=True))
            results["other (Python's)"].append(run(plain, ray_worker=False))
    print(
        f"{'process':20s} {'thresholds':16s} {'CPU-s med (min)':>16s} {'GC CPU-s med':>13s}"
        f" {'GC share':>9s} {'collections':>12s}"
    )
    for mode, rows in results.items():
        cpu = [r["cpu_s"] for r in rows]
        gc_s = [r["gc_s"] for r in rows]
        share = statistics.median(r["gc_s"] / r["cpu_s"] for r in rows)
        print(
            f"{mode:20s} {tuple(rows[0]['thresholds'])!s:16s} "
            f"{statistics.median(cpu):9.2f} ({min(cpu):.2f}) {statistics.median(gc_s):13.2f} "
            f"{share:9.0%} {rows[0]['collections']:12d}"
        )
    raised, default = (statistics.median(r["cpu_s"] for r in rows) for rows in results.values())
    print(f"median import CPU, raised / Python's: {raised / default:.2f}x")


if __name__ == "__main__":
    main()
