"""A node's budgets for the planner, from what the node said about itself.

One function for `offloadctl plan` (this machine, probed in-process) and for the runtime probing (every
Ray node, probed by a task on it), so the plan printed is the plan loaded. No Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.config import ConfigError, JobConfig
from coordinator.planning.formats import format_bytes
from coordinator.planning.snapshot import GpuInfo, NodeInfo
from offload.policy import PIN_HEADROOM_FRACTION, resolve_backend
from offload.probe import DeviceInfo, NodeProbe
from offload.simulated import simulated_device

# Default share of a node's available host memory the job may fill with offloaded weights.
HOST_BUDGET_FRACTION = 0.8
# Default share of a real GPU's memory the planner may use (the rest: CUDA context, allocator).
GPU_BUDGET_FRACTION = 0.9
# The CUDA compute capability from which a GPU has FP8 tensor cores (Ada, Hopper and later).
FP8_CAPABILITY = (8, 9)


def node_info(
    config: JobConfig,
    result: Mapping[str, Any],
    *,
    node_id: str,
    num_gpus: int,
    labels: Mapping[str, str] | None = None,
    held_bytes: int = 0,
    origins: Mapping[str, str] | None = None,
    reserved_bytes: int = 0,
) -> NodeInfo:
    """The planner's view of one node with `num_gpus` GPUs.

    `result` is what `worker.node.probe_here()` returned on the node: its hostname, its
    `NodeProbe`, its pin decision and the error that prevented one. `held_bytes` is host memory
    this job's own workers hold there (their arenas), counted as available because a re-plan
    replaces them; `reserved_bytes`, host memory other loads planned there and do not hold
    yet (`coordinator.runtime.desk`), counted as taken. `origins`: where the variables set for
    the node's workers come from (job override, node label), named in an error they caused.

    Budgets: per real GPU, GPU_BUDGET_FRACTION of the memory its probe found free, capped by
    `--gpu-memory` (a cap, never more than the device has); the same per simulated GPU with a
    size (`offload.simulated`), else `--gpu-memory`. A probe sees only the GPUs it holds; the
    runtime merges a node's probes (`coordinator.runtime.probing`: its free GPUs, each surviving
    worker's own) into one result, and GPUs none of them saw are taken to be like the smallest
    seen (said in the budget note). Host: HOST_BUDGET_FRACTION
    of available host memory, or `--host-memory` capped by what is available; pinned,
    PIN_HEADROOM_FRACTION of it (the pin policy's own limit). The link rate is the one measured
    from the memory the node will offload to (pinned or pageable); None when not measured. A
    node that has NVIDIA GPUs whose CUDA does not start is refused (never simulated).
    """
    hostname = result["hostname"]
    where = f"node {hostname} ({node_id[:8]})"
    if result["error"]:
        causes = [
            f"{name} is set by the {origin} for this node"
            for name, origin in (origins or {}).items()
            if name in result["error"]
        ]
        said = f" ({'; '.join(causes)}: change it there)" if causes else ""
        raise ConfigError(f"{where}: {result['error']}{said}")
    probe: NodeProbe = result["probe"]
    notes: list[str] = []
    if probe.devices:
        budgets = _device_budgets(config, probe.devices, num_gpus, notes)
    elif probe.nvidia_gpus_present:
        raise ConfigError(
            f"{where} has {probe.nvidia_gpus_present} NVIDIA GPU(s) but CUDA does not start "
            f"in its processes ({'; '.join(probe.errors) or 'torch.cuda.is_available() is False'}"
            "): fix its driver, CUDA runtime or CUDA_VISIBLE_DEVICES, or take it out of the "
            "cluster; it is never run as simulated GPUs"
        )
    elif probe.simulated_gpu_memory_bytes is not None:  # sized: budgeted as real ones
        total = probe.simulated_gpu_memory_bytes
        seen = probe.simulated_devices or tuple(simulated_device(i, total) for i in range(num_gpus))
        budgets = _device_budgets(config, seen, num_gpus, notes)
    elif config.gpu_memory_bytes is not None:
        budgets = [config.gpu_memory_bytes] * num_gpus
    else:
        raise ConfigError(
            f"{where} has {num_gpus} GPUs that are not CUDA devices (simulated); give their "
            "memory with --gpu-memory"
        )
    available = max(0, (probe.host_available_bytes or 0) + held_bytes - reserved_bytes)
    host_budget = int(available * HOST_BUDGET_FRACTION)
    if config.host_memory_bytes is not None:
        host_budget = config.host_memory_bytes
        if probe.host_available_bytes is not None and host_budget > available:
            notes.append(
                f"--host-memory {format_bytes(host_budget)} capped at the "
                f"{format_bytes(available)} of host memory available"
            )
            host_budget = available
    pin = bool(result["pin"]["pin"])
    backend, backend_reason = resolve_backend(
        config.backend, probe, device_type="cuda" if probe.cuda_available else "cpu"
    )
    return NodeInfo(
        node_id=node_id,
        hostname=hostname,
        labels=dict(labels or {}),
        gpus=tuple(GpuInfo(index=i, memory_bytes=b) for i, b in enumerate(budgets)),
        host_budget_bytes=host_budget,
        pinned_budget_bytes=int(available * PIN_HEADROOM_FRACTION),
        pin=pin,
        link_bytes_per_s=probe.link_bytes_per_s(pin=pin),
        dequant_bytes_per_s=probe.dequant_bytes_per_s,
        host_matmul_bytes_per_s=probe.host_matmul_bytes_per_s,
        backend=backend,
        backend_reason=backend_reason,
        concurrent_stages=None
        if probe.devices or not probe.cpu_count
        else max(1, (probe.cpu_count - 1) // config.cpus_per_worker),
        cuda=bool(probe.devices),
        fp8_compute=bool(probe.devices)
        and all(d.capability >= FP8_CAPABILITY for d in probe.devices),
        budget_note="; ".join(notes),
        **_compute(result.get("compute"), config),
    )


def _device_budgets(
    config: JobConfig, seen: Sequence[DeviceInfo], num_gpus: int, notes: list[str]
) -> list[int]:
    """Per GPU the probes saw (real, or simulated with a size): GPU_BUDGET_FRACTION of its
    free memory (total when not measured), capped by --gpu-memory."""
    devices = list(seen[:num_gpus])
    if len(devices) < num_gpus:  # the probes held fewer: the others are like the smallest
        smallest = min(devices, key=lambda d: d.free_memory_bytes or d.total_memory_bytes)
        devices += [smallest] * (num_gpus - len(devices))
        notes.append(
            f"{num_gpus} GPUs, {len(seen)} seen by the probes: the others taken to be "
            f"like GPU {smallest.index} ({smallest.name})"
        )
    budgets = []
    for d in devices:
        free = d.free_memory_bytes if d.free_memory_bytes is not None else d.total_memory_bytes
        measured = int(free * GPU_BUDGET_FRACTION)
        cap = config.gpu_memory_bytes
        if cap is not None and cap <= measured:
            budgets.append(cap)
            continue
        budgets.append(measured)
        if cap is not None:
            note = (
                f"--gpu-memory {format_bytes(cap)} capped at {format_bytes(measured)} "
                f"({GPU_BUDGET_FRACTION:.0%} of the {format_bytes(free)} free on {d.name})"
            )
            if note not in notes:
                notes.append(note)
    return budgets


def _compute(measured, config: JobConfig) -> dict:
    """The probe's timing of the model's decoder layer (`worker.compute_probe`), from which the
    planner takes the node's rate for the plan's batch, or why there is none (the plan's
    default rate then)."""
    if measured is None:
        return {}
    if isinstance(measured, str):  # the reason it could not be measured
        return {"compute_source": measured}
    return {"compute": measured}
