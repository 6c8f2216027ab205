"""A private Ray head for tests: its own temp dir, its own loopback ports, token auth on, and a
clean stop of exactly the processes it started (never `ray stop`, which would stop every Ray on
the machine)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# The head of a test's `ray.cluster_utils.Cluster`: no dashboard (nothing asks it), no
# autoscaler monitor (the tests add and remove the nodes themselves; it polls the GCS for as
# long as the cluster lives), and no log monitor (every driver of the tests connects with
# log_to_driver=False, so nothing reads what it publishes; it scans the session's log files
# every 0.1 s, ~0.015 CPU-s a second: 2-3 CPU-s over a module's cluster).
HEAD_ARGS = {"include_dashboard": False, "no_monitor": True, "include_log_monitor": False}


@contextmanager
def metrics_head(*, num_gpus: int, metrics_port: int):
    """A `Cluster` of one head with `num_gpus` logical GPUs (4 CPUs, `HEAD_ARGS`) that exports
    metrics on `metrics_port` every second, this process connected to it: yields the Cluster,
    then disconnects and stops it. Not `ray.init(address="local")`, which cannot leave out the
    autoscaler's monitor."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            **HEAD_ARGS,  # no dashboard: the node's agent still exports the metrics
            "num_cpus": 4,
            "num_gpus": num_gpus,
            "metrics_export_port": metrics_port,
            # metrics on (conftest turns them off elsewhere), exported every second: each
            # process's report costs CPU for as long as the module's cluster lives (an idle
            # one with 4 actors: 6.3 CPU-s a minute at 0.5 s, 4.3 at Ray's 10 s, sampled)
            "_system_config": {
                "metrics_report_interval_ms": 1000,
                "enable_metrics_collection": True,
            },
        },
    )
    try:
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (free when asked; bound right after)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@contextmanager
def private_ray_head(*, num_cpus: int = 4, num_gpus: int = 3):
    """Yields (dashboard address, auth headers, track, GCS address). The job server listens on
    127.0.0.1 only; `track()` records the head's processes so they are all stopped."""
    temp_dir = Path(tempfile.mkdtemp(prefix="oc-ray-", dir="/tmp"))  # short: AF_UNIX path limit
    gcs, dash, agent_http, agent_grpc, rt_env, metrics, client, nm, om = free_ports(9)
    token = secrets.token_hex(32)
    token_file = temp_dir / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_file),
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        RAY_USAGE_STATS_ENABLED="0",
        # Job entrypoints run through a shell with the raylet's PATH: put this venv first.
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    ray_bin = str(Path(sys.executable).with_name("ray"))
    command = [
        ray_bin,
        "start",
        "--head",
        "--block",
        "--temp-dir",
        str(temp_dir),
        "--port",
        str(gcs),
        "--include-dashboard",
        "true",
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dash),
        "--dashboard-agent-listen-port",
        str(agent_http),
        "--dashboard-agent-grpc-port",
        str(agent_grpc),
        "--runtime-env-agent-port",
        str(rt_env),
        "--metrics-export-port",
        str(metrics),
        "--ray-client-server-port",
        str(client),
        "--node-manager-port",
        str(nm),
        "--object-manager-port",
        str(om),
        "--num-cpus",
        str(num_cpus),
        "--num-gpus",
        str(num_gpus),
        "--disable-usage-stats",
        # its drivers connect with log_to_driver=False: nothing reads what a log monitor
        # publishes (HEAD_ARGS); job logs come from the job's own log file
        "--include-log-monitor",
        "false",
    ]
    log = open(temp_dir / "ray_start.log", "w")  # noqa: SIM115 - closed in finally
    head = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    started: dict[int, psutil.Process] = {}

    def track() -> None:
        try:
            for child in psutil.Process(head.pid).children(recursive=True):
                started.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    address = f"http://127.0.0.1:{dash}"
    headers = {"Authorization": f"Bearer {token}"}
    try:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if head.poll() is not None:
                raise RuntimeError(f"ray start exited with {head.returncode}; see {log.name}")
            try:
                JobSubmissionClient(address, headers=headers).list_jobs()
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"job server not up after {START_TIMEOUT_S} s: {exc}"
                    ) from exc
                time.sleep(0.5)
        track()
        yield address, headers, track, f"127.0.0.1:{gcs}"
    finally:
        track()
        alive = [p for p in started.values() if p.is_running()]
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
            try:
                head.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait(timeout=STOP_TIMEOUT_S)
        _, stragglers = psutil.wait_procs(alive, timeout=10)
        for process in stragglers:  # seen: agents orphaned by the SIGTERM path
            with suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(stragglers, timeout=5)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
