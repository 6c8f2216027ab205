"""What an offloader reports: its backend, the bytes it keeps where, and what its copies cost.
Plain values without torch: the worker's snapshots carry them to the driver and to a named
load's keeper, processes that never import torch for them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadStats:
    backend: str
    offloaded_layers: int = 0
    offloaded_bytes: int = 0  # weight bytes living in host memory, as stored (8 bits where so)
    resident_bytes: int = 0  # weight bytes of wrapped modules that stay on the device
    buffer_bytes: int = 0  # device bytes of prefetch slots
    host_bytes: int = 0  # host bytes allocated for the offloaded weights (arena + page slack)
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    # How the copies reach the device (`offload.copy_engines.copy_engine_kind`: "cuda",
    # "staged", "direct", "thread"; "" where nothing is copied), and the pinned bytes of its
    # own bounce chunks ("staged"), apart from the weights' `pinned_bytes`
    copy_engine: str = ""
    engine_pinned_bytes: int = 0
    copies: int = 0  # host-to-device copies issued
    copied_bytes: int = 0
    copy_s: float = 0.0  # time the copy engine spent copying
    stall_s: float = 0.0  # time the compute side waited for a copy
    dequant_s: float = 0.0  # time spent dequantizing 8-bit weights after their copies
    sync_loads: int = 0  # copies issued on demand because no prefetch was in flight
    # routed experts (`OffloadConfig.routed_experts`): experts a step routed to that were in
    # their slot already (hits) or were copied then (misses)
    expert_hits: int = 0
    expert_misses: int = 0
    # the experts predicted for a call (its router's ahead, or its previous routing), and of
    # those the ones it routed to: the prediction's accuracy is their ratio (`offload.prefetch` module doc)
    expert_predicted: int = 0
    expert_predicted_correct: int = 0
    # predicted experts copied ahead (where the layer's accuracy was high enough): right or
    # wrong, their bytes are in copied_bytes; the right ones count as hits when routed to
    expert_prefetched: int = 0
    # routed experts computed on the host, in place in host memory (`host_expert_rows`): no
    # hit, no miss, no byte copied
    expert_host: int = 0
    # per offloaded layer whose experts are routed: (its index among the wrapped modules,
    # hits, misses, expert bytes copied), in layer order
    expert_layers: tuple[tuple[int, int, int, int], ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready: the fields, `expert_layers` as lists."""
        data = dataclasses.asdict(self)
        data["expert_layers"] = [list(counts) for counts in self.expert_layers]
        return data
