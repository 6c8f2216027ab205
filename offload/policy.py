"""Whether this node should pin the host memory that holds offloaded weights, and why.

`decide_pinning` is a pure function of the environment and a `NodeProbe`, so the same rules
can be evaluated for a remote node by the coordinator and tested table by table.

Rules, first match wins:
1. `OFFLOAD_PIN_MEMORY` = on/off (also 1/0, true/false, yes/no): the operator decided.
   `on` where pinning is impossible (no CUDA) is an error, never a silent downgrade.
2. vLLM's `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY` truthy: off, so deployments that already
   set it keep their behaviour.
3. `auto` (the default): off without CUDA, under WSL, on integrated GPUs, on coherent unified
   memory (GH200/GB200: the GPU reads pageable memory through the host page tables, and pinned
   pages are carved out of memory the GPU shares), and when the planned pinned bytes exceed
   `PIN_HEADROOM_FRACTION` of available host memory. Otherwise on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.errors import ConfigError, PinningUnavailableError

if TYPE_CHECKING:  # a probe is only read here: the driver validates pin settings without torch
    from offload.probe import NodeProbe

PIN_ENV = "OFFLOAD_PIN_MEMORY"
VLLM_DISABLE_PIN_ENV = "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"

# Pinned pages cannot be swapped or reclaimed. Pinning more than half of what is available
# leaves too little for the page cache, the loader's read buffers and the other workers.
PIN_HEADROOM_FRACTION = 0.5

_TRUE = frozenset({"1", "on", "true", "yes"})
_FALSE = frozenset({"0", "off", "false", "no"})
PIN_ENV_ALLOWED = ("auto", "on", "off", "1", "0", "true", "false", "yes", "no")


@dataclass(frozen=True, kw_only=True, slots=True)
class PinDecision:
    pin: bool
    reason: str
    source: str  # the variable or the probe that decided, e.g. "OFFLOAD_PIN_MEMORY", "probe.wsl"

    def to_dict(self) -> dict:
        return {"pin": self.pin, "reason": self.reason, "source": self.source}


def parse_pin_mode(value: str | None, *, variable: str = PIN_ENV) -> str:
    """Normalise a pin setting to "auto", "on" or "off". Unset or blank means "auto"."""
    if value is None or not value.strip():
        return "auto"
    token = value.strip().lower()
    if token == "auto":
        return "auto"
    if token in _TRUE:
        return "on"
    if token in _FALSE:
        return "off"
    raise ConfigError(
        f"{variable}={value!r} is not a valid pin setting; "
        f"allowed values (case-insensitive): {', '.join(PIN_ENV_ALLOWED)}"
    )


def _parse_vllm_disable(value: str | None) -> bool:
    if value is None or not value.strip():
        return False
    token = value.strip().lower()
    if token in _TRUE:
        return True
    if token in _FALSE:
        return False
    raise ConfigError(
        f"{VLLM_DISABLE_PIN_ENV}={value!r} is not a boolean; use 1 to disable pinning or 0"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _probe_rule(probe: NodeProbe, planned_bytes: int) -> PinDecision | None:
    """The first probe finding that rules pinning out, or None."""
    if not probe.cuda_available:
        return PinDecision(
            pin=False, reason="no CUDA device: nothing to pin for", source="probe.cuda"
        )
    if probe.is_wsl:
        return PinDecision(
            pin=False,
            reason="running under WSL, where pinned memory is capped and registration fails",
            source="probe.wsl",
        )
    integrated = [d.name for d in probe.devices if d.integrated]
    if integrated:
        return PinDecision(
            pin=False,
            reason=f"integrated GPU shares host memory ({', '.join(integrated)}): pinning only "
            "takes memory away from it",
            source="probe.integrated_gpu",
        )
    coherent = [d.name for d in probe.devices if d.coherent_unified_memory]
    if coherent:
        return PinDecision(
            pin=False,
            reason=f"coherent unified memory ({', '.join(coherent)}): the GPU reads pageable "
            "memory through the host page tables, so pinning costs memory and buys nothing",
            source="probe.unified_memory",
        )
    if planned_bytes > 0 and probe.host_available_bytes is not None:
        limit = int(probe.host_available_bytes * PIN_HEADROOM_FRACTION)
        if planned_bytes > limit:
            return PinDecision(
                pin=False,
                reason=f"planned pinned bytes {_gib(planned_bytes)} exceed "
                f"{PIN_HEADROOM_FRACTION:.0%} of available host memory "
                f"({_gib(probe.host_available_bytes)})",
                source="probe.host_memory",
            )
    return None


def decide_pinning(
    env: Mapping[str, str], probe: NodeProbe, *, planned_bytes: int = 0
) -> PinDecision:
    """Decide pinning for one node. Raises ConfigError (a ValueError) on a bad env value and
    PinningUnavailableError when pinning is forced on where it cannot work."""
    if planned_bytes < 0:
        raise ValueError(f"planned_bytes must be >= 0, got {planned_bytes}")
    mode = parse_pin_mode(env.get(PIN_ENV))
    vllm_off = _parse_vllm_disable(env.get(VLLM_DISABLE_PIN_ENV))
    explicit = f"{PIN_ENV}={env.get(PIN_ENV, '').strip()}"
    overrides_vllm = f" (overrides {VLLM_DISABLE_PIN_ENV}=1)" if vllm_off else ""

    if mode == "off":
        return PinDecision(pin=False, reason=f"{explicit}{overrides_vllm}", source=PIN_ENV)
    if mode == "on":
        if not probe.cuda_available:
            raise PinningUnavailableError(
                f"{explicit} forces pinned host memory, but this node has no CUDA device to "
                f"pin for; unset {PIN_ENV} or set it to auto/off on this node"
            )
        unsupported = [d.name for d in probe.devices if d.host_register_supported is False]
        if unsupported:
            raise PinningUnavailableError(
                f"{explicit} forces pinned host memory, but {', '.join(unsupported)} cannot "
                f"register host memory; set {PIN_ENV}=auto or off on this node"
            )
        finding = _probe_rule(probe, planned_bytes)
        caveat = f"; the probe would not pin: {finding.reason}" if finding else ""
        return PinDecision(pin=True, reason=f"{explicit}{overrides_vllm}{caveat}", source=PIN_ENV)
    if vllm_off:
        return PinDecision(
            pin=False,
            reason=f"{VLLM_DISABLE_PIN_ENV}=1 (vLLM setting)",
            source=VLLM_DISABLE_PIN_ENV,
        )
    finding = _probe_rule(probe, planned_bytes)
    if finding is not None:
        return finding
    return PinDecision(
        pin=True,
        reason="discrete CUDA GPU with host memory headroom: pinned copies are fastest",
        source="probe",
    )


def resolve_backend(requested: str, probe: NodeProbe, *, device_type: str) -> tuple[str, str]:
    """(backend, reason) for a requested backend on a node with `probe`, for a worker computing
    on a `device_type` ("cuda", or "cpu" where the CPU stands in for the GPU). A pure function,
    so the planner resolves "auto" per node exactly as that node's workers will."""
    if requested != "auto":
        return requested, f"backend={requested} requested"
    if probe.any_coherent_unified_memory:
        what = "the GPU" if device_type == "cuda" else "the simulated coherent GPU"
        return "uva", (
            f"auto: {what} reads host memory through its page tables (coherent unified "
            "memory), so zero-copy access beats copying weights in"
        )
    if device_type == "cuda":
        return "prefetch", "auto: discrete GPU, weights are copied in ahead of use on a side stream"
    return "prefetch", "auto: CPU device, weights are copied in ahead of use on a copy thread"
