"""The planner's knobs and its cost model's rates: a frozen, validated `PlanOptions`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from offload.config import MAX_PREFETCH_STEP  # the offloader's own bound, not a second copy
from offload.errors import ConfigError
from worker.names import (
    DEFAULT_BLOCK_SIZE,
    EXPERT_FETCHES,
    HOST_EXPERTS,
    OFFLOAD_DTYPES,
    RESIDENT_WEIGHTS,
    blocks_for,
)

OBJECTIVES = ("latency", "throughput")
DEFAULT_STEP_OVERHEAD_S = 3e-3
# The largest batch "auto" sizes (coordinator/planning/batch_size.py), and what the reserve of
# an auto-sized job is computed for.
AUTO_MAX_BATCH = 64


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_rate(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """The planner's knobs and its cost model's rates."""

    reserve_bytes: int = 0  # per GPU, kept free for activations and workspace
    reserve_source: str = ""  # what the reserve is made of (coordinator/planning/reserve.py)
    prefetch_step: int = 1  # device slots per offloading stage
    compute_bytes_per_s: float = 200e9  # weight bytes a stage computes through per second
    default_link_bytes_per_s: float = 25e9  # host-to-device, for nodes that did not measure it
    # KV cache reserved on each GPU for its decoder layers: max_batch sequences of up to
    # max_seq_len tokens each (0: none; the job cannot generate).
    max_batch: int = 0
    max_seq_len: int = 0
    # The KV pool's positions on each GPU (whole blocks); 0: max_batch x max_seq_len of them
    kv_tokens: int = 0
    # The length a sequence is expected to reach (prompt + new; 0: a quarter of max_seq_len):
    # what the throughput search sizes each batch's pool for, and what the plan says its pool
    # holds. Sequences take blocks as they grow, so a pool holds more of them than of
    # max_seq_len ones; past it, the youngest is preempted.
    expected_seq_len: int = 0
    # The max_batch sequences are split into this many micro-batches, in flight at once: a
    # stage steps ceil(max_batch / micro_batches) rows at a time (its compute rate is read there).
    micro_batches: int = 1
    # What the placement minimises: "latency", the slowest stage's time (one sequence's step
    # through a pipeline that streams micro-batches); "throughput", the cycle in which every
    # micro-batch makes one token (coordinator/planning/cycle.py), which is what tokens/s is.
    objective: str = "latency"
    # Fixed cost of one stage's step of one micro-batch besides its compute and copies (the
    # call, the hand-over to the next stage, sampling's bookkeeping): measured on this
    # project's runtime by bench/policy.py (bench/RESULTS.md, "Throughput planner").
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    # How offloaded weights are kept in host memory and copied (worker.spec.OFFLOAD_DTYPES):
    # "auto" as the checkpoint stores them, "none" at the model's width, "fp8" / "int8" every
    # offloaded matrix in 8 bits; on the nodes whose backend dequantizes after each copy
    # (prefetch), a copy moves those bytes.
    offload_dtype: str = "auto"
    # How an offloaded MoE layer's experts cross the link (worker.names.EXPERT_FETCHES): "auto"
    # per stage, routed where the cost model says it is faster at `rows_per_step` rows (the
    # expected distinct experts' bytes, copied after the router, against the whole unit
    # prefetched under compute); "layer" or "routed" for every stage.
    expert_fetch: str = "auto"
    # How a quantized checkpoint's resident weights sit on the GPUs (worker.names.
    # RESIDENT_WEIGHTS): "stored" as the checkpoint stores them, each layer's dequantized just
    # in time into one buffer; "wide" at the model's width; "auto" stored where every node's
    # GPUs compute in FP8 and the plan at width offloads or does not fit, if that plan is
    # then faster or copies fewer bytes (planner.plan).
    resident_weights: str = "auto"
    # Routed experts' cache (`OffloadConfig.expert_cache`): rows each offloaded experts module
    # of a routed stage keeps on the device across steps. -1 (auto): as many as the memory the
    # plan leaves on that GPU (after weights, slots, KV and reserve) holds; 0: none; N: at most N.
    expert_cache: int = -1
    # Routed stages' experts computed on the host (`OffloadConfig.host_expert_rows`, Fiddler's
    # choice): "auto" where the node's measured host rate (`NodeInfo.host_matmul_bytes_per_s`)
    # computes an expert for a step's rows sooner than its link copies it and its GPU computes
    # it (`_host_rows`), for steps of up to the rows where that holds; "off" never.
    host_experts: str = "off"

    @property
    def pool_tokens(self) -> int:
        """The KV pool's positions on each GPU: `kv_tokens`, or room for max_batch sequences of
        max_seq_len in whole blocks (0: no generation)."""
        if not self.max_seq_len:
            return 0
        return self.kv_tokens or self.max_batch * blocks_for(self.max_seq_len) * DEFAULT_BLOCK_SIZE

    @property
    def expected_len(self) -> int:
        """`expected_seq_len`, or a quarter of max_seq_len (at least 1)."""
        return self.expected_seq_len or max(1, self.max_seq_len // 4)

    def sequences_held(self, length: int, pool_tokens: int | None = None) -> int:
        """Sequences of `length` tokens the pool (`pool_tokens`, or this plan's) holds at once,
        each in whole blocks."""
        pool = self.pool_tokens if pool_tokens is None else pool_tokens
        return (pool // DEFAULT_BLOCK_SIZE) // blocks_for(max(1, length))

    def pool_for(self, max_batch: int) -> int:
        """The pool (whole blocks) the throughput search gives `max_batch` sequences: room for
        each at the expected length, and always one sequence of max_seq_len (`kv_tokens` when
        given)."""
        if not self.max_seq_len:
            return 0
        if self.kv_tokens:
            return self.kv_tokens
        blocks = max(max_batch * blocks_for(self.expected_len), blocks_for(self.max_seq_len))
        return blocks * DEFAULT_BLOCK_SIZE

    @property
    def rows_per_step(self) -> int:
        """Rows of the largest micro-batch: what one stage step computes."""
        return max(1, -(-self.max_batch // self.micro_batches))

    def __post_init__(self) -> None:
        if not is_int(self.reserve_bytes) or self.reserve_bytes < 0:
            raise ConfigError(
                f"PlanOptions.reserve_bytes={self.reserve_bytes!r} must be an int >= 0"
            )
        for name in ("max_batch", "max_seq_len", "kv_tokens", "expected_seq_len"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"PlanOptions.{name}={getattr(self, name)!r} must be an int >= 0")
        if not is_int(self.prefetch_step) or not 1 <= self.prefetch_step <= MAX_PREFETCH_STEP:
            raise ConfigError(
                f"PlanOptions.prefetch_step={self.prefetch_step!r} must be an int in "
                f"1..{MAX_PREFETCH_STEP}"
            )
        if not is_int(self.micro_batches) or self.micro_batches < 1:
            raise ConfigError(
                f"PlanOptions.micro_batches={self.micro_batches!r} must be an int >= 1"
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"PlanOptions.objective={self.objective!r} must be one of {', '.join(OBJECTIVES)}"
            )
        overhead = self.step_overhead_s
        if (
            isinstance(overhead, bool)
            or not isinstance(overhead, int | float)
            or not (math.isfinite(overhead) and overhead >= 0)
        ):
            raise ConfigError(
                f"PlanOptions.step_overhead_s={overhead!r} must be a finite number of seconds >= 0"
            )
        if self.offload_dtype not in OFFLOAD_DTYPES:
            raise ConfigError(
                f"PlanOptions.offload_dtype={self.offload_dtype!r} must be one of "
                f"{', '.join(OFFLOAD_DTYPES)}"
            )
        if self.expert_fetch not in EXPERT_FETCHES:
            raise ConfigError(
                f"PlanOptions.expert_fetch={self.expert_fetch!r} must be one of "
                f"{', '.join(EXPERT_FETCHES)}"
            )
        if not is_int(self.expert_cache) or self.expert_cache < -1:
            raise ConfigError(
                f"PlanOptions.expert_cache={self.expert_cache!r} must be an int >= -1 (-1: as "
                "many rows as the memory left holds, 0: none)"
            )
        if self.host_experts not in HOST_EXPERTS:
            raise ConfigError(
                f"PlanOptions.host_experts={self.host_experts!r} must be one of "
                f"{', '.join(HOST_EXPERTS)}"
            )
        if self.resident_weights not in RESIDENT_WEIGHTS:
            raise ConfigError(
                f"PlanOptions.resident_weights={self.resident_weights!r} must be one of "
                f"{', '.join(RESIDENT_WEIGHTS)}"
            )
        for name in ("compute_bytes_per_s", "default_link_bytes_per_s"):
            value = getattr(self, name)
            if not is_rate(value):
                raise ConfigError(f"PlanOptions.{name}={value!r} must be a finite number > 0")


DEFAULT_OPTIONS = PlanOptions()
