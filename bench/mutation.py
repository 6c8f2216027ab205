"""Mutation testing (issue 60), not in CI: mutmut changes one operator, constant or call at a
time in the modules whose mistakes cost the most (the engine, the node budgets, the pinning
policy, the last stage's token choice) and runs the tests that reach the changed function. A
mutant no test notices ("survived") is a behaviour the suite does not pin down, or a change
that keeps the behaviour (an equivalent mutant); each survivor is read and either killed by a
test or explained in bench/RESULTS.md.

The run works on a copy: the working tree's tracked and untracked (not ignored) files are
copied to --out (default: a fresh temporary directory), mutmut's configuration is written
there, and mutmut runs in it with --jobs children. Only the in-process test files (`TESTS`:
no Ray, no subprocess server) are run: a mutant in code a Ray worker runs is seen only where
an in-process test reaches the same code. It writes, in --out:

  summary.md    - per module: mutants, killed, survived, timed out, no test reaches it
  survivors.md  - each survivor's diff (`mutmut show`), grouped by module and function

    python bench/mutation.py [--out DIR [--resume]] [--jobs 2] [--only offload/policy.py ...]
        [--tests FILE_OR_NODE_ID ...] [--test-timeout 8] [--isolation fork] [--mutants NAME ...]

A Ray test (driver-side code: coordinator/engine/ray_pipeline.py) takes longer than the
in-process tests' 8 s: give --test-timeout, --isolation forkserver (mutmut forks the mutants
from a process that never ran a test, not from one that ran Ray and torch) and, to sample,
--mutants with the names of the mutants to run (the summary then counts only those).

Time: about 7 mutants/s on 2 cores for the pure-Python modules, less for decode.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = (
    "coordinator/engine/*.py",
    "coordinator/planning/budgets.py",
    "offload/policy.py",
    "worker/decode.py",
)
PACKAGES = ("offload", "worker", "coordinator")
TESTS = (
    "tests/test_policy.py",
    "tests/test_node_budget.py",
    "tests/test_job_config.py",
    "tests/test_resident_plan.py",
    "tests/test_planner.py",
    "tests/test_kv_pool.py",
    "tests/test_rebalance.py",
    "tests/test_engine.py",
    "tests/test_engine_host.py",
    "tests/test_engine_review.py",
    "tests/test_engine_steps.py",
    "tests/test_request_harm.py",
    "tests/test_sampling.py",
    "tests/test_guided.py",
    "tests/test_generation.py",
    "tests/test_context.py",
    "tests/test_errors.py",
    "tests/test_telemetry.py",
    "tests/test_worker.py",
    "tests/test_scheduler.py",
    "tests/test_engine_host_contract.py",
    "tests/test_engine_stats.py",
    "tests/test_decode_contract.py",
    "tests/test_generation_settings.py",
    "tests/test_checkpoint_settings_parity.py",
    "tests/test_engine_contract.py",
    "tests/test_request_checks.py",
    "tests/test_blocks.py",
    "tests/test_sequences.py",
)
# -x: a mutant's first failing test is its kill; --timeout: a test a mutant hangs (the
# engine's stop, a wait) fails after this many seconds (no clean test takes 3 alone)
PYTEST_ARGS = ("-p", "no:cacheprovider", "-q", "-x")
TEST_TIMEOUT_S = 8
TIMEOUT_MULTIPLIER = 3.0  # a mutant's tests may take this many times their clean time
TIMEOUT_CONSTANT_S = 10.0  # ... plus this (a busy machine's noise)
NAME = re.compile(r"^\s*([\w.]+)__mutmut_\d+: (\w[\w ]*)$")


def copy_tree(out: Path) -> None:
    """The working tree's tracked and untracked, not ignored, files (what a commit would hold
    and what is being written), under `out`."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        source = ROOT / raw.decode()
        if not source.is_file():  # deleted in the tree, not yet committed
            continue
        target = out / raw.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def write_config(
    out: Path,
    only: list[str],
    tests: list[str],
    *,
    test_timeout_s: float = TEST_TIMEOUT_S,
    isolation: str = "fork",
) -> None:
    def listing(values) -> str:
        return "".join(f"\n    {v}" for v in values)

    (out / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths ={listing(PACKAGES)}\n"
        f"only_mutate ={listing(only)}\n"
        f"pytest_add_cli_args_test_selection ={listing(tests)}\n"
        f"pytest_add_cli_args ={listing((*PYTEST_ARGS, f'--timeout={test_timeout_s:g}'))}\n"
        # a mutant that hangs the engine's stop or a wait is a kill, not a reason to wait
        # mutmut's default 15x its tests' time (minutes, for the engine's tests)
        f"timeout_multiplier = {TIMEOUT_MULTIPLIER}\n"
        f"timeout_constant = {TIMEOUT_CONSTANT_S}\n"
        f"process_isolation = {isolation}\n"
    )


def results(out: Path, mutmut: str) -> dict[str, list[tuple[str, str]]]:
    """module -> [(mutant, status)], every mutant (killed ones too)."""
    text = subprocess.run(
        [mutmut, "results", "--all", "true"], cwd=out, check=True, capture_output=True, text=True
    ).stdout
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for line in text.splitlines():
        match = NAME.match(line)
        if match:
            mutant = line.strip().split(":")[0]
            module = match.group(1).rsplit(".x", 1)[0]  # module.x_function, module.xǁClassǁ...
            found[module].append((mutant, match.group(2).strip()))
    return found


def summarize(found: dict[str, list[tuple[str, str]]]) -> str:
    rows = [
        "| module | mutants | killed | survived | timeout | no tests | other |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    total: Counter = Counter()
    for module in sorted(found):
        counts = Counter(status for _, status in found[module])
        total.update(counts)
        other = sum(n for s, n in counts.items() if s not in KNOWN)
        rows.append(
            f"| {module} | {sum(counts.values())} | {counts['killed']} | {counts['survived']} "
            f"| {counts['timeout']} | {counts['no tests']} | {other} |"
        )
    other = sum(n for s, n in total.items() if s not in KNOWN)
    rows.append(
        f"| all | {sum(total.values())} | {total['killed']} | {total['survived']} "
        f"| {total['timeout']} | {total['no tests']} | {other} |"
    )
    return "\n".join(rows) + "\n"


KNOWN = ("killed", "survived", "timeout", "no tests")


def survivors(out: Path, mutmut: str, found) -> str:
    parts = []
    for module in sorted(found):
        names = [m for m, status in found[module] if status in ("survived", "no tests")]
        if not names:
            continue
        parts.append(f"## {module} ({len(names)})\n")
        for name in names:
            shown = subprocess.run(
                [mutmut, "show", name], cwd=out, capture_output=True, text=True
            ).stdout.strip()
            parts.append(f"### {name}\n```diff\n{shown}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the copy and the reports go")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--only", nargs="+", default=list(TARGETS), help="globs to mutate")
    parser.add_argument(
        "--tests", nargs="+", default=list(TESTS), help="test files (or node ids) to run"
    )
    parser.add_argument(
        "--test-timeout", type=float, default=TEST_TIMEOUT_S, help="seconds one test may take"
    )
    parser.add_argument(
        "--isolation",
        choices=("fork", "forkserver"),
        default="fork",
        help="mutmut's process_isolation: forkserver for Ray tests",
    )
    parser.add_argument(
        "--mutants", nargs="+", default=[], help="run only these mutants (a sample), by name"
    )
    parser.add_argument(
        "--resume", action="store_true", help="go on with --out's run (mutants not yet tested)"
    )
    args = parser.parse_args(argv)
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent))
    if mutmut is None:
        parser.error(f"mutmut is not installed beside {sys.executable}: pip install 'mutmut>=3.8'")
    out = args.out or Path(tempfile.mkdtemp(prefix="offload-mutation-"))
    if args.resume:
        if not (out / "mutants").is_dir():
            parser.error(f"--resume: {out} holds no mutmut run")
    elif out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} is not empty: give a new one, or --resume its run")
    else:
        out.mkdir(parents=True, exist_ok=True)
        copy_tree(out)
    write_config(
        out, args.only, args.tests, test_timeout_s=args.test_timeout, isolation=args.isolation
    )
    print(f"mutating {', '.join(args.only)} in {out} ({args.jobs} at once)", flush=True)
    start = time.monotonic()
    run = subprocess.run(
        [mutmut, "run", "--max-children", str(args.jobs), *args.mutants],
        cwd=out,
        stdout=(out / "run.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    took = time.monotonic() - start
    if run.returncode != 0:
        print(f"mutmut run exited {run.returncode}: see {out / 'run.log'}", file=sys.stderr)
        return run.returncode
    found = results(out, mutmut)
    if args.mutants:  # a sample: the others were never run
        sample = set(args.mutants)
        found = {m: [(n, s) for n, s in found[m] if n in sample] for m in found}
    summary = summarize(found)
    (out / "summary.md").write_text(summary + f"\n{took:.0f} s, {args.jobs} at once\n")
    (out / "survivors.md").write_text(survivors(out, mutmut, found))
    print(summary)
    print(f"{took:.0f} s; survivors' diffs in {out / 'survivors.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
