"""The GPU check's dry run: every section of scripts/gpu_check.py on the CPU with tiny sizes, so
the script cannot rot between lent GPUs. The sections run in one process (`--one-process`: 8
against 27 CPU-s for one process each, sampled); the launch of a section in its own process, as
on the GPU machine, is tested on its own (passing, and killed at its time limit)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_runs_every_section_and_writes_the_summary(tmp_path: Path) -> None:
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n")
    done = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--dry-run",
            "--one-process",
            "--out",
            str(tmp_path / "out"),
            "--results-md",
            str(results_md),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = json.loads((tmp_path / "out" / "results.json").read_text())
    sections = list(gpu_check().SECTIONS)
    assert [r["name"] for r in records] == sections
    for record in records:
        if record["name"] == "pytest_gpu":
            assert record["status"] == "skip" and "dry run" in record["error"]
            continue
        assert record["status"] == "pass" and record["checks"], record
        assert all(check["ok"] for check in record["checks"]), record
        assert (tmp_path / "out" / f"{record['name']}.log").exists()
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert all(f"| {name} |" in summary for name in sections)
    text = results_md.read_text()
    assert text.startswith("# Benchmark results") and summary.strip() in text


def test_a_section_runs_in_its_own_process_and_saves_its_record(tmp_path: Path) -> None:
    record = gpu_check()._launch("offloaders", tmp_path, "cpu", True, limit_s=120)
    assert record["status"] == "pass" and record["limit_s"] == 120, record
    assert record["checks"] and all(check["ok"] for check in record["checks"]), record
    assert "== offloaders: pass" in (tmp_path / "offloaders.log").read_text()


def test_a_section_past_its_limit_is_killed_and_reported(tmp_path: Path) -> None:
    record = gpu_check()._launch("stage", tmp_path, "cpu", True, limit_s=0.5)
    assert record["status"] == "fail" and "time limit" in record["error"]


def test_the_summary_replaces_its_block_in_results_md(tmp_path: Path) -> None:
    module = gpu_check()
    path = tmp_path / "RESULTS.md"
    path.write_text("head\n")
    module.write_results_md(path, "first")
    path.write_text(path.read_text() + "tail\n")
    module.write_results_md(path, "second")
    text = path.read_text()
    assert "first" not in text and text.startswith("head\n") and text.endswith("tail\n")
    assert text.count(module.RESULTS_BEGIN) == 1 and "second" in text


def test_an_unknown_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gpu_check().main(["--dry-run", "--out", str(tmp_path), "--sections", "env,nope"])
