"""`create_offloader`: one entry point that picks and builds a backend.

Backends are imported lazily, so `import offload` stays cheap and a backend's own imports (the
CUDA driver for UVA) are only touched when it is chosen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from offload.base import BaseOffloader, NoopOffloader
from offload.config import OffloadConfig
from offload.probe import NodeProbe, probe_node


def choose_backend(
    config: OffloadConfig, device: torch.device, probe: NodeProbe
) -> tuple[str, str]:
    """(backend, reason) for `config.backend`, resolving "auto"."""
    if config.backend != "auto":
        return config.backend, f"backend={config.backend} requested"
    if device.type == "cuda" and probe.any_coherent_unified_memory:
        return "uva", (
            "auto: the GPU reads host memory through its page tables (coherent unified memory), "
            "so zero-copy access beats copying weights in"
        )
    if device.type == "cuda":
        return "prefetch", "auto: discrete GPU, weights are copied in ahead of use on a side stream"
    return "prefetch", "auto: CPU device, weights are copied in ahead of use on a copy thread"


def create_offloader(
    config: OffloadConfig,
    *,
    device: torch.device | str,
    env: Mapping[str, str] | None = None,
    probe: NodeProbe | None = None,
) -> BaseOffloader:
    """Build the offloader `config` asks for on `device`. `env` defaults to os.environ and
    `probe` to a fresh `probe_node()`; pass both to decide for a node other than this process.
    The chosen backend and why are in `offloader.backend_reason`."""
    device = torch.device(device)
    env = dict(os.environ if env is None else env)
    if config.backend == "none":
        offloader: BaseOffloader = NoopOffloader()
        offloader.backend_reason = "backend=none requested: nothing is offloaded"
        return offloader
    probe = probe if probe is not None else probe_node()
    backend, reason = choose_backend(config, device, probe)
    if backend == "uva":
        from offload.uva import UVAOffloader

        offloader = UVAOffloader(config, device=device, env=env, probe=probe)
    else:
        from offload.prefetch import PrefetchOffloader

        offloader = PrefetchOffloader(config, device=device, env=env, probe=probe)
    offloader.backend_reason = reason
    return offloader
