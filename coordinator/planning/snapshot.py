"""What the planner knows of the cluster: nodes, their GPUs and budgets. Plain frozen values,
built from Ray's view of the cluster by the runtime (probing.py) or by hand in tests and `offloadctl plan`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from offload.errors import ConfigError

if TYPE_CHECKING:  # only carried here: a snapshot is built and read without torch
    from worker.compute_probe import ComputeProfile

NODE_BACKENDS = ("prefetch", "uva")


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuInfo:
    index: int  # GPU index within its node
    memory_bytes: int  # device bytes available for this stage's weights, slots and reserve

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ConfigError(f"GpuInfo.memory_bytes={self.memory_bytes} must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    node_id: str
    hostname: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[GpuInfo, ...] = ()
    host_budget_bytes: int = 0  # host memory this job may fill with offloaded weights
    pinned_budget_bytes: int = 0  # of which may be pinned (only counts when `pin` is True)
    pin: bool = False  # the node's pin decision for the offloaded weights
    link_bytes_per_s: float | None = None  # host-to-device bandwidth, when measured
    # bfloat16 bytes its GPUs make per second from 8-bit weights, per format ("fp8", "int8"),
    # when measured: what dequantizing offloaded weights after each copy costs there
    dequant_bytes_per_s: tuple[tuple[str, float], ...] = ()
    # Weight bytes per second its host CPU computes through for a step of so many rows, per
    # rows measured (offload.probe.HOST_MATMUL_ROWS): what computing an MoE layer's experts on
    # the host costs there (PlanOptions.host_experts); empty: not measured
    host_matmul_bytes_per_s: tuple[tuple[int, float], ...] = ()
    # How fast this node's GPUs run the model: its probe's timing of the model's own decoder
    # layer (a `worker.compute_probe.ComputeProfile`: the plan takes the rate for its batch), or
    # a rate given outright (weight bytes per second); neither: the plan's default rate, and
    # `compute_source` may say why nothing was measured.
    compute: ComputeProfile | None = None
    compute_bytes_per_s: float | None = None
    compute_source: str = ""
    # Real CUDA devices (False: GPUs simulated on the CPU), and what set the GPUs' budgets when
    # it is not plain (a --gpu-memory capped by the device, say), for the plan to show.
    cuda: bool = False
    budget_note: str = ""
    # Every GPU of the node computes in FP8 (CUDA compute capability 8.9 or higher; never a
    # simulated one): where "auto" keeps a quantized checkpoint's resident weights as stored
    # (PlanOptions.resident_weights).
    fp8_compute: bool = False

    def compute_rate(self, max_batch: int) -> tuple[float | None, str]:
        """(weight bytes per second for steps of `max_batch` sequences, what it is); None when
        neither measured nor given."""
        if self.compute_bytes_per_s is not None:
            return self.compute_bytes_per_s, self.compute_source or "given"
        if self.compute is not None:
            rows = max(max_batch, 1)
            return self.compute.bytes_per_s(rows), self.compute.describe(rows)
        return None, self.compute_source

    def fixed_step_s(self, rows: int) -> float:
        """What a stage's step costs here besides its layers' compute, as measured (0.0: not
        measured, or a rate given outright)."""
        if self.compute_bytes_per_s is not None or self.compute is None:
            return 0.0
        return self.compute.fixed_step_s(max(rows, 1))

    # How many of this node's stages compute at once at full speed: None for real GPUs (each
    # its own device); where the GPUs are simulated on the node's CPU, its cores (less one for
    # the driver, Ray and the copy threads) over the workers' threads: stages beyond it share.
    concurrent_stages: float | None = None
    # How this node's GPUs reach offloaded weights: "prefetch" (slots on the device) or "uva"
    # (in place: no slots). The job's backend, with "auto" resolved by the node's probe.
    backend: str = "prefetch"
    backend_reason: str = ""  # why: the request, or what the probe found for "auto"

    def __post_init__(self) -> None:
        if self.backend not in NODE_BACKENDS:
            raise ConfigError(
                f"NodeInfo({self.node_id}).backend={self.backend!r} must be one of "
                f"{', '.join(NODE_BACKENDS)} (auto is resolved per node before planning)"
            )
        if self.host_budget_bytes < 0 or self.pinned_budget_bytes < 0:
            raise ConfigError(
                f"NodeInfo({self.node_id}): host_budget_bytes and pinned_budget_bytes must be "
                f">= 0, got {self.host_budget_bytes} and {self.pinned_budget_bytes}"
            )

    @property
    def offload_budget_bytes(self) -> int:
        """Bytes of offloaded weights this node can hold: pinned ones count against both
        budgets, pageable ones against the host budget only."""
        if self.pin:
            return min(self.host_budget_bytes, self.pinned_budget_bytes)
        return self.host_budget_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSnapshot:
    nodes: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"ClusterSnapshot: duplicate node ids in {ids}")

    @property
    def num_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)
