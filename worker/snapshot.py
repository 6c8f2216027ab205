"""What a worker reports about itself: `StageSnapshot`, the value `StageWorker.report()`,
`latest()` and `history()` return across Ray, and that the driver's telemetry, the CLI and the
benchmarks read by attribute. `to_dict()` is its JSON form (for files and scripts); nothing
reads that back, so there is no `from_dict`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from offload.policy import PinDecision
from offload.stats import OffloadStats


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyCounters:
    """How much the offloader's copy counters grew over the `interval_s` seconds before a
    snapshot (since the previous one, or since the stage started): a series of snapshots
    shows rates."""

    interval_s: float = 0.0
    copies: int = 0
    copied_bytes: int = 0
    copy_s: float = 0.0
    stall_s: float = 0.0

    @classmethod
    def between(
        cls, before: OffloadStats, after: OffloadStats, *, interval_s: float
    ) -> CopyCounters:
        return cls(
            interval_s=interval_s,
            copies=after.copies - before.copies,
            copied_bytes=after.copied_bytes - before.copied_bytes,
            copy_s=after.copy_s - before.copy_s,
            stall_s=after.stall_s - before.stall_s,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSnapshot:
    """One worker's stage at one moment: where it runs, what it holds in device and host
    memory, how its offloaded layers reach the device, and its load and run times.

    Every field is always set: a stage that offloads nothing has zero `stats` of backend
    "none", and `pin` is the decision its node's policy would make (see
    `worker.reporting.pin_decision`), so readers need no fallbacks."""

    stage: int
    hostname: str
    node_id: str = ""  # Ray's node id, added by the driver (telemetry.collect); "" in the worker
    pid: int
    cpu_arch: str
    device: str  # "cuda", "cuda:1", "cpu" (a simulated GPU)
    gpu: str = ""  # CUDA_VISIBLE_DEVICES as Ray set it for the worker ("" when unset)
    layers: tuple[str, ...]
    offloaded: tuple[str, ...] = ()
    offload_unit: str = "layer"  # what of each offloaded layer is in host memory (OFFLOAD_UNITS)
    # how the offloaded weights are kept in host memory: "" at the model's width, else their
    # 8-bit block formats, e.g. "fp8 (128x128 blocks)"
    offload_format: str = ""
    # how resident quantized matrices are kept on the device: "" at the model's width
    # (dequantized at load), else their formats as stored, e.g. "fp8 (128x128 blocks) x 40",
    # dequantized just in time (`offload.resident`; stats.resident_bytes counts them as stored,
    # stats.buffer_bytes the buffer they are dequantized into)
    resident_format: str = ""
    # routed experts per offloaded layer: (layer name, hits, misses, expert bytes copied)
    expert_layers: tuple[tuple[str, int, int, int], ...] = ()
    # relative RMS error of the weights quantized at load (--offload-dtype fp8 / int8): what
    # keeping them in 8 bits changed, measured on this stage's own weights (0.0: none was)
    quantization_error: float = 0.0
    backend: str = "none"  # how offloaded layers reach the device: prefetch, uva, none
    backend_reason: str = ""
    pin: PinDecision
    pin_origin: str  # who set the variable behind `pin`: see worker.reporting.pin_origin
    env: dict[str, str] = field(default_factory=dict)  # the pin variables in the worker's env
    device_total_bytes: int
    device_used_bytes: int
    device_free_bytes: int
    host_rss_bytes: int
    host_peak_rss_bytes: int
    host_available_bytes: int
    bytes_read: int = 0  # checkpoint bytes this worker read, over its life
    init_s: float = 0.0
    load_s: float = 0.0
    forward_s: float = 0.0
    forwards: int = 0
    kv_cache_bytes: int = 0
    requests: int = 0  # sequences in the last generation step (the KV slots in use then)
    stats: OffloadStats  # the offloader's counters since the stage was built
    since_last: CopyCounters = field(default_factory=CopyCounters)
    time: float  # seconds since the epoch
    probe_errors: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready: the same keys as the fields, nested values as dicts, tuples as lists."""
        return _lists(dataclasses.asdict(self))


def _lists(value):
    """`value` with every tuple in it a list (JSON's arrays), at any depth."""
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(item) for item in value]
    return value
