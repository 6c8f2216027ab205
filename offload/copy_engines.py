"""Which copy engine brings a prefetch offloader's weights in (`offload.copy_engine`'s, or the
pinned bounce chunks of `offload.staging`): the choice, apart from both, so neither imports the
other back."""

from __future__ import annotations

import torch

from offload.copy_engine import CopyEngine, CudaCopyEngine, ThreadCopyEngine
from offload.staging import CudaStaging, StagedCopyEngine


def copy_engine_kind(device_type: str, *, pinned_source: bool, may_pin: bool) -> str:
    """Which engine copies into a `device_type` device: "thread" (the CPU: a memmove on a copy
    thread), "cuda" (a side stream; from pinned memory it never blocks the host, from pageable
    memory each copy blocks it) or "staged" (pageable memory through pinned chunks on a copy
    thread, `offload.staging`: only where the node's decision lets us pin, `may_pin`; with
    pinning off nothing is pinned, not even bounce chunks)."""
    if device_type != "cuda":
        return "thread"
    if not pinned_source and may_pin:
        return "staged"
    return "cuda"


def make_copy_engine(
    device: torch.device, *, pinned_source: bool = True, may_pin: bool = True
) -> CopyEngine:
    """The engine `copy_engine_kind` names for copies into `device` from host memory that is
    pinned or not, on a node whose decision pins or not (`may_pin`)."""
    kind = copy_engine_kind(device.type, pinned_source=pinned_source, may_pin=may_pin)
    if kind == "staged":
        return StagedCopyEngine(CudaStaging(device))
    if kind == "cuda":
        return CudaCopyEngine(device)
    return ThreadCopyEngine()
