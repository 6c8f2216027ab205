"""offloadctl on a shared Ray cluster: a private head started by `ray start` (its job server on
loopback, token auth on, two GPUs), one for the module, and only the processes it started
stopped after.

- A client without the token is refused in one line naming it, before ray.init (whose retries
  take ~20 s to give up), as an address where nothing listens is.
- `offloadctl run --check` submitted as a Ray job through the Jobs API, its status and logs
  checked.
- A `serve` of its own model as two replicas (two pipelines, two named loads, one Serve deployment
whose router spreads the requests: every completion is transformers' greedy text, whichever
replica answered it, `x-offload-load`); a second `serve` of one of those named loads, on its own
port with a Serve app of its own: both answer, and Ctrl-C of the second removes its app only
while the first goes on answering; then the first, killed with -9, leaves nothing (its loads'
leases run out, its app ends with it)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import tiny_shape
from ray_head import free_ports, private_ray_head
from test_serving import STOP_TIMEOUT_S, greedy_text, serving, tiny_checkpoint

from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import make_checkpoint

OFFLOADCTL = str(Path(sys.executable).with_name("offloadctl"))
COMMAND_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 300.0
# `offloadctl` as a Python process of its own, except that ray.init, if the command reaches it,
# says so and ends the command: a refusal that must come at once has to come before it (ray.init
# retries for ~20 s before it gives up on a cluster that refuses the token). Ordered by what the
# command calls, not by how long it took (issue 60).
OFFLOADCTL_WITHOUT_RAY_INIT = (
    "import sys, ray\n"
    "def reached(*args, **kwargs):\n"
    "    print('ray.init was called', file=sys.stderr, flush=True)\n"
    "    raise SystemExit(99)\n"
    "ray.init = reached\n"
    "from coordinator.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
NUM_GPUS = 2
LEASE_S = 5.0  # the lease of the -9 serve's load
GONE_BOUND_S = 90.0  # past the lease: the keeper's poll, its unload, GCS' view of it
LOAD_FLAGS = ("--gpu-memory", "8MiB", "--max-seq-len", "64", "--max-batch", "2")


def offloadctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [OFFLOADCTL, *args], env=env, text=True, capture_output=True, timeout=COMMAND_TIMEOUT_S
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


class Observer:
    """One process of its own joined to the cluster `env` names (as an operator would look),
    asked again and again: Serve's apps, the named loads and the free GPUs. One Ray connection
    for the whole test, where a process per look cost seconds each on a busy machine."""

    CODE = (
        "import json, sys, ray\n"
        "from ray import serve\n"
        "from coordinator.runtime import registry\n"
        "ray.init(log_to_driver=False)\n"
        "for _ in sys.stdin:\n"
        "    apps = sorted(serve.status().applications)\n"
        "    print(json.dumps({'apps': apps, 'loads': registry.list_loads(),"
        " 'gpus': ray.available_resources().get('GPU', 0)}), flush=True)\n"
    )

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def state(self, timeout_s: float = 120.0) -> dict:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"the observer did not answer within {timeout_s} s"
        line = self.proc.stdout.readline()
        assert line, f"the observer ended ({self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def complete_from(served, prompt: str) -> tuple[str, str]:
    """(the load that answered, the completion's text)."""
    body = json.dumps(
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{served.base}/completions",
        data=body,
        headers={"Authorization": f"Bearer {served.key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        load = response.headers["x-offload-load"]
        return load, json.loads(response.read())["choices"][0]["text"]


def complete(served, prompt: str) -> str:
    return complete_from(served, prompt)[1]


def app_of(served) -> str:
    log = served.log_path.read_text()
    marker = "Serve app '"
    assert marker in log, log[-3000:]
    return log[log.index(marker) + len(marker) :].split("'", 1)[0]


@pytest.fixture(scope="module")
def head():
    """(dashboard address, auth headers, track, GCS address) of the module's private head."""
    with private_ray_head(num_cpus=4, num_gpus=NUM_GPUS) as started:
        yield started


def test_a_client_without_the_token_is_refused_at_once(head) -> None:
    """One line naming the token, before ray.init is reached, as an address where nothing
    listens is refused (and not after ray.init's ~20 s of retries)."""
    from ray.job_submission import JobSubmissionClient

    address, _, _, gcs = head
    with pytest.raises(Exception, match=r"(?i)auth|401"):  # token auth is really on
        JobSubmissionClient(address).list_jobs()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}

    def refused(where: str) -> str:
        run = subprocess.run(
            [sys.executable, "-c", OFFLOADCTL_WITHOUT_RAY_INIT, "list", "--address", where],
            env=env,
            text=True,
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        assert "ray.init was called" not in run.stderr, run.stderr[-2000:]
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
        return run.stderr

    assert "cannot reach a Ray cluster" in refused(f"127.0.0.1:{free_ports(1)[0]}")
    assert "uses token authentication; set RAY_AUTH_MODE=token" in refused(gcs)


def test_offloadctl_run_as_a_ray_job(head, tmp_path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    address, headers, track, _ = head
    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        tiny_shape(6),
    )
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    budget = index.total_bytes // 3 - decoder // 4  # two GPUs: layers offloaded on both
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
    assert "offloaded" in logs and "plan: 2 stages" in logs


def test_two_serves_on_one_cluster_and_one_killed(head, tmp_path) -> None:
    from transformers import AutoTokenizer

    checkpoint = tiny_checkpoint(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "two servers, one cluster"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = greedy_text(checkpoint, tokenizer, ids, 6)
    _, headers, track, gcs = head
    token = headers["Authorization"].removeprefix("Bearer ")
    ray_env = {"RAY_ADDRESS": gcs, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(ray_env)
    observer = Observer(env)
    try:
        # A serve of its own model as two replicas, which share the requests.
        (tmp_path / "own").mkdir()
        with serving(
            tmp_path / "own",
            *LOAD_FLAGS,
            "--replicas",
            "2",
            checkpoint=checkpoint,
            ray_env={**ray_env, "OFFLOAD_SERVE_LEASE_S": str(LEASE_S)},
        ) as own:
            track()
            assert "2 replicas (loads 'serve-" in own.log_path.read_text(), own.log()
            prompts = [f"request number {i} of many" for i in range(8)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(lambda p: complete_from(own, p), prompts))
            for text, (_, answer) in zip(prompts, answers, strict=True):
                ids = tokenizer(text, return_tensors="pt")["input_ids"]
                assert answer == greedy_text(checkpoint, tokenizer, ids, 6)
            loads = {load for load, _ in answers}
            assert len(loads) == 2 and all(x.endswith(("-0", "-1")) for x in loads), answers
            state = observer.state()
            assert state["apps"] == [app_of(own)] and state["gpus"] == NUM_GPUS - 2, state
            assert sorted(state["loads"]) == sorted(loads), state

            # A second serve of one of those named loads, on its own port with its own
            # app: both answer; Ctrl-C of the second removes its app only, and the first
            # goes on (the load is the first's: the second never unloads it).
            (tmp_path / "b").mkdir()
            with serving(tmp_path / "b", load=min(loads), ray_env=ray_env) as second:
                track()
                assert complete(second, prompt) == expected
                assert complete(own, prompt) == expected
                apps = {app_of(own), app_of(second)}
                assert len(apps) == 2 and all(a.startswith("offload-openai-") for a in apps)
                assert set(observer.state()["apps"]) == apps

                second.proc.send_signal(signal.SIGINT)  # Ctrl-C of the second
                assert second.proc.wait(timeout=STOP_TIMEOUT_S) == 130, second.log()
                assert "Traceback" not in second.log(), second.log()
                assert complete(own, prompt) == expected  # the first goes on
                try:
                    urllib.request.urlopen(f"{second.base}/models", timeout=10)
                    raise AssertionError("the stopped server still answers")
                except urllib.error.URLError:
                    pass
                state = observer.state()
                assert state["apps"] == [app_of(own)], state
                assert sorted(state["loads"]) == sorted(loads), state

            # The first killed with -9: no renewal from then on, so its loads are unloaded
            # when their leases run out, and its app goes with the process.
            own.proc.kill()
            own.proc.wait(timeout=STOP_TIMEOUT_S)
        killed = time.monotonic()
        while (state := observer.state()) != {"apps": [], "loads": [], "gpus": NUM_GPUS}:
            assert time.monotonic() - killed < LEASE_S + GONE_BOUND_S, state
            time.sleep(0.5)
    finally:
        track()
        try:
            for load in observer.state()["loads"]:
                offloadctl(env, "unload", load)
        finally:
            observer.close()
