"""offloadctl as users run it, stopped by Ctrl-C in the middle of a load on its embedded Ray: it
exits with 130 within a bound, says so in one line, and leaves no process of its embedded Ray
behind (found by the session directory its raylet was started for, and by the processes the
command had spawned). Started with SIGINT ignored, as a shell script's background job is: the
command takes Ctrl-C all the same. The load is held at its first chunk until a file appears
that no one creates (worker.loader.HOLD_ENV), so the signal certainly lands mid-load. The
SIGTERM of `offloadctl serve` is tested with the server (test_serving.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from helpers import names_of, ray_session_processes, session_dir_of, still_running

from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from worker.loader import HOLD_ENV

OFFLOADCTL = str(Path(sys.executable).with_name("offloadctl"))
START_TIMEOUT_S = 240.0  # imports, the embedded Ray, a worker: ~25 s on a quiet 2-core machine
STOP_BOUND_S = 30.0  # the signal to the exit, the embedded Ray stopped on the way


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.2)


def test_ctrl_c_mid_load_ends_the_command_and_its_embedded_ray(tmp_path) -> None:
    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        CheckpointShape(
            num_layers=2,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=64,
            vocab_size=64,
        ),
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[HOLD_ENV] = str(tmp_path / "never")  # the embedded Ray's workers inherit it
    log_path = tmp_path / "load.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            "sh",
            "-c",
            'trap "" INT; exec "$0" "$@"',
            OFFLOADCTL,
            "load",
            "--checkpoint",
            str(checkpoint),
            "--gpus",
            "1",
            "--gpu-memory",
            "8MiB",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def loading() -> bool:  # the progress bar: the chunks are asked for, and held
            assert proc.poll() is None, f"exited: {log_path.read_text()[-3000:]}"
            return "loading:" in log_path.read_text()

        wait_for(loading, START_TIMEOUT_S, "no progress bar")
        spawned = psutil.Process(proc.pid).children(recursive=True)
        session = session_dir_of(spawned)
        assert {"gcs_server", "raylet"} <= names_of(spawned)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=STOP_BOUND_S + 30) == 130, log_path.read_text()[-3000:]
        assert time.monotonic() - sent < STOP_BOUND_S
        out = log_path.read_text()
        assert "interrupted: every worker and Ray this command started was released" in out
        assert "Traceback" not in out, out[-3000:]
        wait_for(
            lambda: not ray_session_processes(session), 10, f"processes of {session} still run"
        )
        wait_for(lambda: not still_running(spawned), 10, "processes the command spawned still run")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only this test's own process group
            proc.wait(timeout=30)
        log.close()
