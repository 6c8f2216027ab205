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
from offload.errors import OffloadError
from offload.policy import resolve_backend
from offload.probe import DECISION_STEPS, NodeProbe, probe_node
from offload.quant import BlockFormat


def choose_backend(
    config: OffloadConfig, device: torch.device, probe: NodeProbe
) -> tuple[str, str]:
    """(backend, reason) for `config.backend`, resolving "auto"."""
    return resolve_backend(config.backend, probe, device_type=torch.device(device).type)


def create_offloader(
    config: OffloadConfig,
    *,
    device: torch.device | str,
    env: Mapping[str, str] | None = None,
    probe: NodeProbe | None = None,
    formats: Mapping[str, BlockFormat] | None = None,
) -> BaseOffloader:
    """Build the offloader `config` asks for on `device`. `env` defaults to os.environ and
    `probe` to a fresh probe of what the decisions read (`DECISION_STEPS`: not the link and
    dequantization rates, which are the planner's and cost ~0.2 s to measure); pass both to
    decide for a node other than this process.
    `formats`: offloaded parameters (by arena key) kept in 8 bits, dequantized on the device
    after their copy: the prefetch backend only (UVA computes on host memory as it is stored).
    The chosen backend and why are in `offloader.backend_reason`."""
    device = torch.device(device)
    env = dict(os.environ if env is None else env)
    if config.backend == "none":
        offloader: BaseOffloader = NoopOffloader()
        offloader.backend_reason = "backend=none requested: nothing is offloaded"
        return offloader
    probe = probe if probe is not None else probe_node(DECISION_STEPS)
    backend, reason = choose_backend(config, device, probe)
    if formats and backend != "prefetch":
        raise OffloadError(
            f"8-bit offloaded weights ({len(formats)} parameters) need the prefetch backend, "
            f"which dequantizes them on the device after each copy; this offloader is {backend} "
            f"({reason}): use backend=prefetch, or keep the weights at the model's width"
        )
    if backend == "uva":
        from offload.uva import UVAOffloader

        offloader = UVAOffloader(config, device=device, env=env, probe=probe)
    else:
        from offload.prefetch import PrefetchOffloader

        offloader = PrefetchOffloader(config, device=device, env=env, probe=probe, formats=formats)
    offloader.backend_reason = reason
    return offloader
