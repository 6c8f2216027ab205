"""The cluster path end to end on this machine: a private Ray head with its job server on
loopback (token auth on), `offloadctl run --check` submitted as a Ray job through the Jobs
API, its status and logs checked; then only the processes this test started are stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_head import private_ray_head

from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

JOB_TIMEOUT_S = 300.0
CONNECT_BOUND_S = 15.0  # the CLI's own start (imports); the token refusal itself is immediate
OFFLOADCTL = str(Path(sys.executable).with_name("offloadctl"))


def test_offloadctl_run_as_a_ray_job(tmp_path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        CheckpointShape(
            num_layers=6,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=128,
        ),
    )
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    budget = index.total_bytes // 3 - decoder // 4  # three logical GPUs, some offloading
    with private_ray_head(num_cpus=4, num_gpus=3) as (address, headers, track, gcs):
        with pytest.raises(Exception, match=r"(?i)auth|401"):  # token auth is really on
            JobSubmissionClient(address).list_jobs()
        # A client without the token: one line naming the token, within the connect bound.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        start = time.monotonic()
        joined = subprocess.run(
            [OFFLOADCTL, "list", "--address", gcs],
            env=env,
            text=True,
            capture_output=True,
            timeout=120,
        )
        assert time.monotonic() - start < CONNECT_BOUND_S
        assert joined.returncode == 2 and "Traceback" not in joined.stderr, joined.stderr[-2000:]
        assert "uses token authentication; set RAY_AUTH_MODE=token" in joined.stderr
        client = JobSubmissionClient(address, headers=headers)
        job_id = client.submit_job(
            entrypoint=f"offloadctl run --checkpoint {checkpoint} --gpu-memory {budget} --check"
        )
        deadline = time.monotonic() + JOB_TIMEOUT_S
        terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
        while (status := client.get_job_status(job_id)) not in terminal:
            track()
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                pytest.fail(f"job {job_id} still {status} after {JOB_TIMEOUT_S} s")
            time.sleep(1)
        logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "check: logits are bitwise equal to transformers in one process" in logs
    assert "offloaded" in logs and "plan: 3 stages" in logs
