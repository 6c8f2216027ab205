"""Which copy engine brings a prefetch offloader's weights in (`offload.copy_engine`'s, or the
copy thread of `offload.staging`, with or without its pinned bounce chunks): the choice, apart
from both, so neither imports the other back."""

from __future__ import annotations

import torch

from offload.copy_engine import CopyEngine, CudaCopyEngine, ThreadCopyEngine
from offload.probe import NodeProbe
from offload.staging import CudaStaging, StagedCopyEngine


def copy_engine_kind(
    device_type: str, *, pinned_source: bool, may_pin: bool, probe: NodeProbe | None = None
) -> str:
    """Which engine copies into a `device_type` device:
    - "thread": the CPU (a memmove on a copy thread);
    - "cuda": from pinned memory, a side stream, never blocking the host;
    - from pageable memory on CUDA, a copy thread that the driver may block
      (`offload.staging`): "staged" through pinned bounce chunks, only where the node's
      decision lets us pin (`may_pin`; with pinning off nothing is pinned, not even bounce
      chunks), or "direct" from the arena itself. Where both may serve, the faster by the
      node's measured rates (`NodeProbe.pageable_engine`), which the planner prices."""
    if device_type != "cuda":
        return "thread"
    if pinned_source:
        return "cuda"
    return (probe or NodeProbe(cuda_available=True)).pageable_engine(may_pin=may_pin)[0]


def make_copy_engine(
    device: torch.device,
    *,
    pinned_source: bool = True,
    may_pin: bool = True,
    probe: NodeProbe | None = None,
) -> CopyEngine:
    """The engine `copy_engine_kind` names for copies into `device` from host memory that is
    pinned or not, on a node whose decision pins or not (`may_pin`), with `probe`'s rates."""
    kind = copy_engine_kind(device.type, pinned_source=pinned_source, may_pin=may_pin, probe=probe)
    if kind == "staged":
        return StagedCopyEngine(CudaStaging(device))
    if kind == "direct":
        return StagedCopyEngine(CudaStaging(device), num_chunks=0)
    if kind == "cuda":
        return CudaCopyEngine(device)
    return ThreadCopyEngine()
