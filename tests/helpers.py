"""Small models and independent measurements shared by the offload tests."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from coordinator.tools.make_checkpoint import CheckpointShape


def tiny_shape(num_layers: int, **changes) -> CheckpointShape:
    """The tests' tiny decoder checkpoint (llama unless `arch` says otherwise): hidden 64, 4
    heads (2 KV), intermediate 128, vocab 128; `changes` sets any other field."""
    fields = dict(
        hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128
    )
    return CheckpointShape(num_layers=num_layers, **{**fields, **changes})


def block_stack(num_layers: int, hidden: int = 16, *, seed: int = 0) -> list[nn.Module]:
    """Linear/GELU/LayerNorm blocks with deterministic random weights."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        block = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        with torch.no_grad():  # LayerNorm starts at 1/0: make its weights matter too
            block[2].weight.normal_()
            block[2].bias.normal_()
        layers.append(block.eval())
    return layers


def run_stack(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


def storage_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the distinct storages behind the modules' parameters: the memory they hold,
    measured from the tensors themselves rather than from the offloader's own accounting."""
    storages = {}
    for module in modules:
        for param in module.parameters():
            storage = param.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def expected_offloaded_bytes(
    modules: list[nn.Module], layers: tuple[int, ...], pattern=None
) -> int:
    import re

    return sum(
        p.numel() * p.element_size()
        for i in layers
        for name, p in modules[i].named_parameters()
        if pattern is None or re.search(pattern, name)
    )


def wait_gpus_free(expected: int, timeout_s: float = 60.0) -> None:
    """ray.kill is asynchronous: wait (bounded) until `expected` logical GPUs are free."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) != expected:
        assert time.monotonic() < deadline, f"GPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def kill_actor(actor, timeout_s: float = 60.0) -> None:
    """ray.kill, then wait (bounded) until the actor is dead: ray.kill only asks, and the actor
    may answer more calls meanwhile. A test that asserts on what a kill causes (a recovery, an
    error) kills with this, so the work it races cannot finish first."""
    import time

    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, f"actor still alive {timeout_s} s after ray.kill"
        time.sleep(0.1)


def ray_session_processes(session_dir: str) -> list:
    """Processes on this machine whose command line names Ray session `session_dir` (its GCS,
    raylet, dashboard and monitors do)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(session_dir in arg for arg in process.info["cmdline"] or ()):
            found.append(process)
    return found


def still_running(processes) -> list:
    """Those of `processes` (psutil) that still run: neither ended nor a zombie."""
    import psutil

    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.Error:
            pass
    return running


def names_of(processes) -> set[str]:
    """The names of those of `processes` (psutil) that still exist: a short-lived one (a Ray
    worker that came and went) may have ended since it was listed."""
    import contextlib

    import psutil

    names = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            names.add(process.name())
    return names


def session_dir_of(processes) -> str:
    """The Ray session directory that the raylet among `processes` was started for."""
    import re

    import psutil

    for process in processes:
        try:
            if process.name() != "raylet":
                continue
            match = re.search(r"(/\S*?/session_[^/\s]+)", " ".join(process.cmdline()))
        except psutil.Error:  # ended since it was listed
            continue
        if match:
            return match.group(1)
    raise AssertionError(f"no raylet among {sorted(names_of(processes))}")


def scrape_gauges(
    name: str, expected: dict[str, float], port: int, *, tag: str = "stage", timeout_s: float = 30.0
) -> dict[str, float]:
    """`tag` value -> value of Ray gauge `name` on this node's Prometheus endpoint at `port`, polled
    (bounded) until it shows `expected`: Ray exports every metrics_report_interval_ms, and an
    earlier job may have set the same gauge."""
    import re
    import time
    import urllib.request

    import ray

    ip = ray.util.get_node_ip_address()
    pattern = re.compile(r"^ray_" + name + r"\{[^}]*" + tag + r'="([^"]*)"[^}]*\} (\S+)$', re.M)
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10) as r:
            found = {stage: float(v) for stage, v in pattern.findall(r.read().decode())}
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def assert_probe_decided_pin(device: str, pin: dict) -> None:
    """The pin decision of a worker with no pin setting in its environment: the probe's, and
    what the probe decides depends on whether the worker's process sees a CUDA device. On an
    embedded Ray or a `ray.cluster_utils.Cluster`, Ray gives each logical GPU
    CUDA_VISIBLE_DEVICES=<its id>: on a GPU host that names a real device when the id is below
    the host's GPU count, and nothing otherwise; the worker runs on "cuda" or on "cpu"
    accordingly (`StageWorker.__init__`). So the expectation follows the worker's device."""
    if device == "cpu":
        assert (pin["pin"], pin["source"]) == (False, "probe.cuda"), pin
        return
    assert device.startswith("cuda"), device
    # CUDA is there: a later probe rule (WSL, integrated or coherent memory, host headroom) may
    # still rule pinning out, and only the plain "probe" source means pin.
    assert pin["source"].startswith("probe") and pin["source"] != "probe.cuda", pin
    assert pin["pin"] == (pin["source"] == "probe"), pin


def stage_table_rows(out: str) -> list[tuple[str, dict]]:
    """(device, {"pin", "source"}) of each row of offloadctl's per-stage table, whose columns
    are: stage host gpu device layers resident offloaded backend pin, then "origin: source:
    reason"."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith("decided by"))
    rows = []
    for line in itertools.takewhile(lambda line: line[:1].isdigit(), lines[header + 1 :]):
        cells, decided = line.rsplit("  ", 1)
        _origin, source, _reason = decided.split(": ", 2)
        rows.append((cells.split()[3], {"pin": cells.split()[-1] == "on", "source": source}))
    return rows
