"""Node-local weight offloading (torch only, never ray).

Pin policy and node probe, an exact-size host arena (registered with CUDA, that is pinned, only
when the policy says so), and the prefetch / UVA / no-op offloaders. See `create_offloader` for
the entry point.
"""

from offload.arena import HostArena, TensorSpec
from offload.base import BaseOffloader, NoopOffloader, OffloadStats
from offload.config import OffloadConfig
from offload.errors import (
    OffloadCoordinatorError,
    OffloadError,
    OffloadUnavailableError,
    PinningUnavailableError,
)
from offload.factory import create_offloader
from offload.policy import (
    PIN_ENV,
    VLLM_DISABLE_PIN_ENV,
    PinDecision,
    decide_pinning,
)
from offload.probe import DeviceInfo, NodeProbe, probe_node

# The backends load on first use (PEP 562), as the factory does.
_LAZY = {
    "PrefetchOffloader": "offload.prefetch",
    "UVAOffloader": "offload.uva",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


__all__ = [
    "PIN_ENV",
    "VLLM_DISABLE_PIN_ENV",
    "BaseOffloader",
    "DeviceInfo",
    "HostArena",
    "NodeProbe",
    "NoopOffloader",
    "OffloadConfig",
    "OffloadCoordinatorError",
    "OffloadError",
    "OffloadStats",
    "OffloadUnavailableError",
    "PinDecision",
    "PinningUnavailableError",
    "PrefetchOffloader",
    "TensorSpec",
    "UVAOffloader",
    "create_offloader",
    "decide_pinning",
    "probe_node",
]
