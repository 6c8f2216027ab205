"""What to offload and how: a frozen, validated `OffloadConfig`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "prefetch", "uva", "none"]
BACKENDS: tuple[str, ...] = ("auto", "prefetch", "uva", "none")
MAX_PREFETCH_STEP = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Which layers go to host memory, and how they come back.

    Select layers either by explicit indices (`layers`) or vLLM-style groups: of every
    `group_size` consecutive layers, the last `num_in_group` are offloaded.

    `prefetch_step` is the number of device buffers (slots) of the prefetch backend: layer i+k
    is copied while layer i computes. 0 means no prefetch: each offloaded layer is copied in
    just before it runs (the synchronous baseline, one slot of device memory).

    `param_filter` is a regular expression searched in each parameter's name within its layer
    (e.g. `"mlp"`): only matching parameters are offloaded, the rest stay on the device.

    `routed_experts` (prefetch backend): an offloaded MoE experts module's weights cross the
    link expert by expert, only those the step's router chose, once it has (`offload.routed`);
    False: the whole layer crosses before it runs, prefetched while earlier layers compute.

    `expert_cache` (with `routed_experts`): rows of each offloaded experts module kept on the
    device across steps, whichever layer its slot holds: the most used experts of that layer
    (`offload.prefetch`'s module doc, expert cache); 0: none, a slot keeps its layer's experts
    only until it takes another layer.

    `host_expert_rows` (with `routed_experts`): an experts call of at most this many rows runs
    on the host, its routed experts read where they are in host memory (no copy): the hidden
    state goes down and the result comes back (Fiddler's choice, where the node's CPU computes
    a few rows' experts sooner than its link moves them); 0: never.
    """

    backend: Backend = "auto"
    layers: tuple[int, ...] | None = None
    group_size: int = 0
    num_in_group: int = 0
    prefetch_step: int = 1
    param_filter: str | None = None
    routed_experts: bool = False
    expert_cache: int = 0
    host_expert_rows: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.host_expert_rows, bool) or not isinstance(self.host_expert_rows, int):
            raise ValueError(
                f"OffloadConfig.host_expert_rows={self.host_expert_rows!r} must be an int"
            )
        if self.host_expert_rows < 0 or (self.host_expert_rows and not self.routed_experts):
            raise ValueError(
                f"OffloadConfig.host_expert_rows={self.host_expert_rows} must be >= 0, and "
                "needs routed_experts=True (the host computes the experts the router chose)"
            )
        if isinstance(self.expert_cache, bool) or not isinstance(self.expert_cache, int):
            raise ValueError(f"OffloadConfig.expert_cache={self.expert_cache!r} must be an int")
        if self.expert_cache < 0 or (self.expert_cache and not self.routed_experts):
            raise ValueError(
                f"OffloadConfig.expert_cache={self.expert_cache} must be >= 0, and needs "
                "routed_experts=True (the cache holds experts the router chose)"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"OffloadConfig.backend={self.backend!r} is not one of {', '.join(BACKENDS)}"
            )
        if not 0 <= self.prefetch_step <= MAX_PREFETCH_STEP:
            raise ValueError(
                f"OffloadConfig.prefetch_step={self.prefetch_step} must be in "
                f"0..{MAX_PREFETCH_STEP} (0 = copy each layer just before it runs)"
            )
        if self.param_filter is not None:
            try:
                re.compile(self.param_filter)
            except re.error as exc:
                raise ValueError(
                    f"OffloadConfig.param_filter={self.param_filter!r} is not a valid "
                    f"regular expression: {exc}"
                ) from None
        grouped = self.group_size != 0 or self.num_in_group != 0
        if self.backend == "none":
            return
        if self.layers is not None and grouped:
            raise ValueError(
                "OffloadConfig: give either layers=... or group_size/num_in_group, not both"
            )
        if self.layers is None and not grouped:
            raise ValueError(
                "OffloadConfig: choose the layers to offload with layers=(...) or "
                "group_size=G, num_in_group=K; use backend='none' to offload nothing"
            )
        if self.layers is not None:
            if not isinstance(self.layers, tuple):
                raise ValueError(
                    f"OffloadConfig.layers must be a tuple of ints, got {self.layers!r}"
                )
            if not self.layers:
                raise ValueError(
                    "OffloadConfig.layers=() selects nothing; use backend='none' to offload nothing"
                )
            bad = [i for i in self.layers if not isinstance(i, int) or i < 0]
            if bad:
                raise ValueError(f"OffloadConfig.layers has invalid indices {bad}: need ints >= 0")
            if len(set(self.layers)) != len(self.layers):
                raise ValueError(f"OffloadConfig.layers={self.layers} has duplicates")
        else:
            if self.group_size < 1:
                raise ValueError(f"OffloadConfig.group_size={self.group_size} must be >= 1")
            if not 1 <= self.num_in_group <= self.group_size:
                raise ValueError(
                    f"OffloadConfig.num_in_group={self.num_in_group} must be in "
                    f"1..group_size ({self.group_size})"
                )

    def select_layers(self, num_layers: int) -> tuple[int, ...]:
        """Sorted indices of the offloaded layers among `num_layers` layers."""
        if self.backend == "none":
            return ()
        if self.layers is not None:
            out_of_range = [i for i in self.layers if i >= num_layers]
            if out_of_range:
                raise ValueError(
                    f"OffloadConfig.layers has indices {out_of_range} but only {num_layers} "
                    f"modules were given (valid: 0..{num_layers - 1})"
                )
            return tuple(sorted(self.layers))
        first_offloaded = self.group_size - self.num_in_group
        return tuple(i for i in range(num_layers) if i % self.group_size >= first_offloaded)

    def matches_param(self, name: str) -> bool:
        return self.param_filter is None or re.search(self.param_filter, name) is not None
