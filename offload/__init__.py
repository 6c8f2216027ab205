"""Node-local weight offloading (torch only, never ray).

Pin policy and node probe, an exact-size host arena (registered with CUDA, that is pinned, only
when the policy says so), and the prefetch / UVA / no-op offloaders. See `create_offloader` for
the entry point.
"""

# Every name loads on first use (PEP 562): `offload.errors` and `offload.policy` are imported by
# driver commands that never touch a tensor (`offloadctl list`, a load's record), and importing
# this package must not cost them torch's import. The backends load the same way, as the factory
# does.
_LAZY = {
    "HostArena": "offload.arena",
    "TensorSpec": "offload.arena",
    "BaseOffloader": "offload.base",
    "NoopOffloader": "offload.base",
    "OffloadStats": "offload.stats",
    "OffloadConfig": "offload.config",
    "OffloadCoordinatorError": "offload.errors",
    "OffloadError": "offload.errors",
    "OffloadUnavailableError": "offload.errors",
    "PinningUnavailableError": "offload.errors",
    "create_offloader": "offload.factory",
    "PIN_ENV": "offload.policy",
    "VLLM_DISABLE_PIN_ENV": "offload.policy",
    "PinDecision": "offload.policy",
    "decide_pinning": "offload.policy",
    "DeviceInfo": "offload.probe",
    "NodeProbe": "offload.probe",
    "probe_node": "offload.probe",
    "PrefetchOffloader": "offload.prefetch",
    "UVAOffloader": "offload.uva",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # found: later lookups never come here again
        return value
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


__all__ = sorted(_LAZY)  # every name the package exports, each loaded on first use
