"""Our Ray worker processes import with the cyclic GC's thresholds raised, then settle back to
Python's own (worker.startup); no other process changes them. A Ray worker is told by the
raylet's `default_worker.py` and the RAY_RAYLET_PID it sets: each case runs a script of that
name, or of another, in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.startup import DEFAULT_THRESHOLDS, IMPORT_THRESHOLDS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import gc, json
{preset}
import {package}
imported = gc.get_threshold()
from worker.startup import settle
settle()
print(json.dumps([imported, gc.get_threshold()]))
"""


def thresholds(
    tmp_path: Path, script_name: str, package: str, raylet: bool, preset: tuple = ()
) -> tuple[tuple, tuple]:
    """(thresholds once `package` is imported, thresholds after settle()) in a new process."""
    preset_line = f"gc.set_threshold(*{preset})" if preset else ""
    code = SCRIPT.format(package=package, preset=preset_line)
    return run_script(tmp_path / script_name, code, raylet)


def run_script(script: Path, code: str, raylet: bool) -> tuple[tuple, tuple]:
    """The two thresholds `code` prints (a JSON pair), run as `script` in a new interpreter."""
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "RAY_RAYLET_PID"}
    env["PYTHONPATH"] = str(ROOT)
    if raylet:
        env["RAY_RAYLET_PID"] = "4242"
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    first, second = json.loads(out.stdout)
    return tuple(first), tuple(second)


@pytest.mark.parametrize("package", ["worker", "coordinator"])
def test_a_ray_worker_imports_quietly_then_settles(tmp_path, package) -> None:
    assert thresholds(tmp_path, "default_worker.py", package, raylet=True) == (
        IMPORT_THRESHOLDS,
        DEFAULT_THRESHOLDS,
    )


@pytest.mark.parametrize(
    ("script_name", "raylet"),
    [
        ("default_worker.py", False),  # not started by a raylet
        ("offloadctl", True),  # a Ray job's entrypoint: a child of a Ray worker
        ("driver.py", False),  # a user's driver
    ],
)
def test_every_other_process_keeps_its_thresholds(tmp_path, script_name, raylet) -> None:
    assert thresholds(tmp_path, script_name, "coordinator", raylet) == (
        DEFAULT_THRESHOLDS,
        DEFAULT_THRESHOLDS,
    )


def test_thresholds_someone_set_are_left_alone(tmp_path) -> None:
    mine = (1000, 5, 5)
    assert thresholds(tmp_path, "default_worker.py", "worker", True, preset=mine) == (mine, mine)


def test_a_ray_worker_that_already_imported_torch_is_left_alone(tmp_path) -> None:
    """A process running other work (a user's task that imports us late): not ours to tune."""
    assert thresholds(tmp_path, "default_worker.py", "torch, worker", raylet=True) == (
        DEFAULT_THRESHOLDS,
        DEFAULT_THRESHOLDS,
    )


def test_offloadctl_imports_quietly_and_settles_when_it_ends(tmp_path) -> None:
    """The command's own process (its imports come after main starts), whatever its end."""
    code = (
        "import gc, importlib, json\n"
        "cli = importlib.import_module('coordinator.cli.main')\n"
        "seen = []\n"
        "def command(argv):\n"
        "    seen.append(gc.get_threshold())\n"
        "    raise KeyError('a command that fails')\n"
        "cli._main = command\n"
        "try:\n"
        "    cli.main([])\n"
        "except KeyError:\n"
        "    pass\n"
        "print(json.dumps([seen[0], gc.get_threshold()]))\n"
    )
    assert run_script(tmp_path / "offloadctl", code, raylet=False) == (
        IMPORT_THRESHOLDS,
        DEFAULT_THRESHOLDS,
    )
