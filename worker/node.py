"""What a node says about itself: its probe and the pin decision its environment leads to.

Run by the runtime's probe task on every GPU node before planning (`probe_task`,
`probe_unless_cuda`), and by a live worker when the driver re-plans (that saves starting a
process per node: the worker runs on the node, with the job's environment for it). On a node
without GPUs the probe task never imports torch once the node has measured its model
(`offload.probe`, `worker.compute_probe`): it starts as light as any process of ours."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from collections.abc import Iterable

from offload import decide_pinning, probe_node
from offload.errors import ConfigError
from offload.probe import cuda_available, simulated_gpu_kind
from offload.simulated import DeviceLedger, simulated_gpu_memory
from worker.startup import settle

# Tests only: a file path; a probe task waits until that file exists (at most
# PROBE_HOLD_MAX_S), holding the GPUs it measures: a load's probe caught mid-measure, as a
# second load launched at that moment finds it (on CUDA a probe holds them for seconds).
PROBE_HOLD_ENV = "OFFLOAD_TEST_HOLD_PROBE"
PROBE_HOLD_MAX_S = 120.0


def hold_while_missing(variable: str, max_s: float) -> None:
    """Tests only: wait while the file that environment `variable` names does not exist (at
    most `max_s`); at once where it is not set. A test's hook to act while the work it holds is
    certainly under way (`PROBE_HOLD_ENV`, `worker.loader.HOLD_ENV`)."""
    path = os.environ.get(variable)
    deadline = time.monotonic() + max_s
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def probe_task(planned_bytes: int = 0, model: tuple[dict, str, int] | None = None) -> dict:
    """The probe as a Ray task runs it: `probe_here`, then the GC's own thresholds back
    (`worker.startup`: the process's imports are done)."""
    try:
        hold_while_missing(PROBE_HOLD_ENV, PROBE_HOLD_MAX_S)
        return probe_here(planned_bytes, model=model)
    finally:
        settle()


def probe_unless_cuda(
    planned_bytes: int = 0, model: tuple[dict, str, int] | None = None
) -> dict | None:
    """The probe, in a process that stays for the next one; None, without touching a device,
    where CUDA has devices (`offload.probe.cuda_available` creates no context, and imports no
    torch on a node without GPU device files)."""
    if cuda_available():
        settle()
        return None
    return probe_task(planned_bytes, model)


def probe_here(
    planned_bytes: int = 0,
    env: dict[str, str] | None = None,
    model: tuple[dict, str, int] | None = None,
    *,
    cached_only: bool = False,
    credit: Iterable[int] = (),
) -> dict:
    """This node's probe and pin decision; `env` set over this process's environment (what a
    job's overrides would give its workers here). With `model` (config.json, dtype, worker
    threads), also how fast this node's device runs its decoder layer (`compute`: a
    `worker.compute_probe.ComputeProfile`, or the reason it could not be measured);
    `cached_only`: only what this node measured before. Simulated GPUs with a size
    (`offload.simulated`) report the ones this process holds, what the processes in `credit`
    (pids) hold there counted as free."""
    probe = probe_node()
    try:
        environ = {**os.environ, **(env or {})}
        if not probe.cuda_available:  # `env` may set it (a job override, in `offloadctl plan`)
            probe = _simulated(probe, environ, credit)
        decision = decide_pinning(environ, probe, planned_bytes=planned_bytes).to_dict()
        error = None
    except ConfigError as exc:
        decision, error = None, str(exc)
    result = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),  # which process answered (a probe task's is reused where no CUDA)
        "probe": probe,
        "pin": decision,
        "error": error,
    }
    if model is not None:
        result["compute"] = _compute(probe, *model, cached_only=cached_only)
    return result


def _simulated(probe, environ: dict[str, str], credit: Iterable[int]):
    """`probe` with the kind of GPU the CPU stands in for and, where the simulated GPUs have a
    size, the ones this process holds (none outside a Ray worker: `offloadctl plan`)."""
    probe = dataclasses.replace(probe, simulated_gpu=simulated_gpu_kind(environ))
    total = simulated_gpu_memory(environ)
    if total is None:
        return probe
    place = simulated_place()
    devices = place[0].devices(place[1], total, credit) if place is not None else ()
    return dataclasses.replace(probe, simulated_gpu_memory_bytes=total, simulated_devices=devices)


def simulated_place() -> tuple[DeviceLedger, list[int]] | None:
    """This node's ledger of simulated GPU memory and the GPUs Ray gave this process (a task's
    or an actor's); None outside a Ray worker."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    node = ray.get_runtime_context().get_node_id()
    return DeviceLedger(node), [int(i) for i in ray.get_gpu_ids()]


def _compute(probe, config: dict, dtype: str, threads: int, *, cached_only: bool):
    """The model's decoder layer timed on this node's first device (the CPU stands in for a
    simulated GPU), or a one-line reason it could not be."""
    from worker.compute_probe import measure

    device = "cuda" if probe.cuda_available else "cpu"
    try:
        profile = measure(
            config,
            dtype,
            device,
            threads=threads if device == "cpu" else None,
            cached_only=cached_only,
        )
    except Exception as exc:  # a model the probe cannot build here: the plan says so
        return f"not measured: {type(exc).__name__}: {exc}"
    return profile if profile is not None else "not measured (a worker answered for its node)"
