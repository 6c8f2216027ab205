"""A node's budgets for the planner, from what the node said about itself.

One function for `offloadctl plan` (this machine, probed in-process) and for the runtime probing (every
Ray node, probed by a task on it), so the plan printed is the plan loaded. No Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.config import ConfigError, JobConfig
from coordinator.planning.snapshot import GpuInfo, NodeInfo
from offload.factory import resolve_backend
from offload.policy import PIN_HEADROOM_FRACTION
from offload.probe import NodeProbe

# Default share of a node's available host memory the job may fill with offloaded weights.
HOST_BUDGET_FRACTION = 0.8
# Default share of a real GPU's memory the planner may use (the rest: CUDA context, allocator).
GPU_BUDGET_FRACTION = 0.9


def node_info(
    config: JobConfig,
    result: Mapping[str, Any],
    *,
    node_id: str,
    num_gpus: int,
    labels: Mapping[str, str] | None = None,
    held_bytes: int = 0,
    origins: Mapping[str, str] | None = None,
) -> NodeInfo:
    """The planner's view of one node with `num_gpus` GPUs.

    `result` is what `worker.node.probe_here()` returned on the node: its hostname, its
    `NodeProbe`, its pin decision and the error that prevented one. `held_bytes` is host memory
    this job's own workers hold there (their arenas), counted as available because a re-plan
    replaces them. `origins`: where the variables set for the node's workers come from (job
    override, node label), named in an error they caused. Budgets: per GPU `--gpu-memory`, else GPU_BUDGET_FRACTION of each CUDA
    device; host `--host-memory`, else HOST_BUDGET_FRACTION of available host memory; pinned,
    PIN_HEADROOM_FRACTION of it (the pin policy's own limit). The link rate is the one measured
    from the memory the node will offload to (pinned or pageable); None when not measured.
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
    if config.gpu_memory_bytes is not None:
        budgets = [config.gpu_memory_bytes] * num_gpus
    elif not probe.devices:
        raise ConfigError(
            f"{where} has {num_gpus} GPUs that are not CUDA devices (simulated); give their "
            "memory with --gpu-memory"
        )
    elif len(probe.devices) < num_gpus:
        raise ConfigError(
            f"{where} has {num_gpus} GPUs but its probe sees {len(probe.devices)} CUDA "
            "device(s); give the GPUs' memory with --gpu-memory, or ask for at most "
            f"{len(probe.devices)} GPUs"
        )
    else:
        budgets = [
            int(d.total_memory_bytes * GPU_BUDGET_FRACTION) for d in probe.devices[:num_gpus]
        ]
    available = (probe.host_available_bytes or 0) + held_bytes
    pin = bool(result["pin"]["pin"])
    backend, backend_reason = resolve_backend(
        config.backend, probe, device_type="cuda" if probe.cuda_available else "cpu"
    )
    return NodeInfo(
        node_id=node_id,
        hostname=hostname,
        labels=dict(labels or {}),
        gpus=tuple(GpuInfo(index=i, memory_bytes=b) for i, b in enumerate(budgets)),
        host_budget_bytes=config.host_memory_bytes or int(available * HOST_BUDGET_FRACTION),
        pinned_budget_bytes=int(available * PIN_HEADROOM_FRACTION),
        pin=pin,
        link_bytes_per_s=probe.link_bytes_per_s(pin=pin),
        backend=backend,
        backend_reason=backend_reason,
        concurrent_stages=None
        if probe.devices or not probe.cpu_count
        else max(1, (probe.cpu_count - 1) // config.cpus_per_worker),
        **_compute(result.get("compute"), config),
    )


def _compute(measured, config: JobConfig) -> dict:
    """The probe's timing of the model's decoder layer (`worker.compute_probe`), from which the
    planner takes the node's rate for the plan's batch, or why there is none (the plan's
    default rate then)."""
    if measured is None:
        return {}
    if isinstance(measured, str):  # the reason it could not be measured
        return {"compute_source": measured}
    return {"compute": measured}
