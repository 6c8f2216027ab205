"""What the engine counts, under the names vLLM gives the same quantities (so dashboards built
for vLLM read ours): sequences running and waiting, KV slot usage, time to first token and
inter-token latency histograms, tokens generated. `EngineStats` is plain Python (the loop
updates it, `snapshot()` reads it); `export` publishes it as Ray metrics (Prometheus)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from coordinator.engine.sequences import Finish

# vLLM's bucket bounds (seconds) for these two histograms.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# why a sequence ended, as vLLM's finished_reason label names it
FINISHED_REASONS = tuple(finish.value for finish in Finish)
RECENT = 4096  # latency samples kept for percentiles (and sequences' lengths)
# The window over which preemptions per minute are counted.
PREEMPTION_WINDOW_S = 300.0


class Histogram:
    """Cumulative bucket counts, sum and count: a Prometheus histogram's state."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[
            next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        ] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, "+Inf"), self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


def percentile(values, q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass
class EngineStats:
    requests: int = 0  # submitted
    rejected: int = 0  # queue full
    steps: int = 0
    calls: int = 0  # submits to the pipeline: a burst is one call for several steps
    step_rows: int = 0  # sequences over all steps: step_rows / steps is the mean batch
    restarts: int = 0  # caches rebuilt after workers were replaced
    cut: int = 0  # bursts cut for a step boundary (an arrival, a cancel, an end): on one stage
    # its later steps are cancelled, on several they run out and are applied
    generated: int = 0  # tokens
    # sequences ended, by why (`Finish`'s values: vLLM's finished_reason label); `ended`: all
    ended_by: dict = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))
    running: int = 0
    waiting: int = 0
    num_slots: int = 0
    num_blocks: int = 0  # the KV pool
    used_blocks: int = 0  # held by running sequences (a block partly filled counts whole)
    used_tokens: int = 0  # positions those blocks hold
    preemptions: int = 0  # running sequences sent back to the queue for want of blocks
    prefix_queries: int = 0  # tokens admitted sequences looked up in the prefix cache
    prefix_hits: int = 0  # of them, found there: their keys were not computed again
    # the load's engine itself (its host's): loops that ended on an error, new engines started
    # after one, and now "serving", "restarting" (a new engine is being started) or "failed"
    # (no more restarts: the load cannot serve), with why the last one stopped
    # the load's KV pool re-balanced against its resident weights (coordinator.runtime.rebalance),
    # and what the last check found the planner would choose, with when (time.time())
    rebalances: int = 0
    pool_advice: str = ""
    pool_advice_at: float = 0.0
    engine_failures: int = 0
    engine_restarts: int = 0
    engine_state: str = "serving"
    engine_stopped: str = ""
    # (prompt tokens, generated tokens) of the latest sequences that ended (errors aside):
    # the lengths the planner prices a KV pool for (`coordinator.planning.pool.Lengths`)
    lengths: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    # when the latest preemptions happened (time.monotonic()), for their rate
    preempted_at: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    # samples not yet given to Ray's histograms (bounded: a job that never exports them, with
    # snapshot_interval_s 0 or an engine in process, must not grow them forever)
    _new_ttft: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _new_itl: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def token(self, seq, now: float) -> None:
        with self._lock:
            self.generated += 1
            if seq.last_token_s is None:
                seq.request.first_token_s = seq.request.first_token_s or now
                sample, into, new = now - seq.request.submitted_s, self.ttft_s, self._new_ttft
            else:
                sample, into, new = now - seq.last_token_s, self.itl_s, self._new_itl
            into.append(sample)
            new.append(sample)
            (self.ttft if into is self.ttft_s else self.itl).observe(sample)
            seq.last_token_s = now

    @property
    def ended(self) -> int:
        """Sequences ended, whatever the reason."""
        return sum(self.ended_by.values())

    def finished(
        self, prompt_tokens: int | None = None, generated_tokens: int = 0, *, reason: str = "stop"
    ) -> None:
        """A sequence ended for `reason` (FINISHED_REASONS); with its lengths where they tell
        what traffic brings (not where it ended on an error)."""
        if reason not in FINISHED_REASONS:
            raise ValueError(f"finished reason {reason!r} is not one of {FINISHED_REASONS}")
        with self._lock:
            self.ended_by[reason] += 1
            if prompt_tokens:
                self.lengths.append((prompt_tokens, generated_tokens, time.monotonic()))

    def rebalanced(self, event: dict) -> None:
        """A re-balance check's event (`coordinator.runtime.rebalance.rebalance`): counted
        where the pool moved, and what it found kept for `status`."""
        with self._lock:
            self.rebalances += event.get("event") == "re-balanced"
            self.pool_advice, self.pool_advice_at = event.get("why", ""), time.time()

    def preempted(self, total: int, now: float) -> None:
        """The scheduler's preemption count is `total` at `now` (monotonic seconds)."""
        with self._lock:
            for _ in range(max(0, total - self.preemptions)):
                self.preempted_at.append(now)
            self.preemptions = total

    def preemptions_per_min(self, now: float) -> float:
        """Preemptions per minute over the last PREEMPTION_WINDOW_S seconds (or since the
        first one, where that is sooner)."""
        with self._lock:
            recent = [t for t in self.preempted_at if now - t <= PREEMPTION_WINDOW_S]
        return len(recent) * 60.0 / PREEMPTION_WINDOW_S

    def observed_lengths(self, since: float | None = None) -> tuple[tuple[int, int], ...]:
        """(prompt, generated) tokens of the latest sequences that ended; with `since`
        (time.monotonic()), of those that ended after it only (traffic since a check)."""
        with self._lock:
            return tuple((p, g) for p, g, t in self.lengths if since is None or t >= since)

    def _length_summary(self) -> dict:
        """The observed lengths in a few numbers (under the lock)."""
        if not self.lengths:
            return {"observed_sequences": 0}
        prompts = [p for p, _, _ in self.lengths]
        outputs = [g for _, g, _ in self.lengths]
        totals = [p + g for p, g, _ in self.lengths]
        return {
            "observed_sequences": len(self.lengths),
            "observed_prompt_p50": percentile(prompts, 50),
            "observed_generated_p50": percentile(outputs, 50),
            "observed_total_p90": percentile(totals, 90),
        }

    def occupancy(self) -> float:
        """Mean sequences per step over max_batch: how full the batches ran."""
        if not self.steps or not self.num_slots:
            return 0.0
        return self.step_rows / self.steps / self.num_slots

    def kv_usage(self) -> float:
        """The share of the KV pool's blocks in use (vLLM's kv_cache_usage_perc: 1 = full)."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    def snapshot(self) -> dict:
        rate = self.preemptions_per_min(time.monotonic())
        with self._lock:
            ttft, itl = list(self.ttft_s), list(self.itl_s)
            return {
                **self._length_summary(),
                "preemptions_per_min": round(rate, 3),
                "requests_running": self.running,
                "requests_waiting": self.waiting,
                "kv_slots": self.num_slots,
                "kv_blocks": self.num_blocks,
                "kv_blocks_used": self.used_blocks,
                "kv_tokens_used": self.used_tokens,
                "kv_cache_usage": round(self.kv_usage(), 4),
                "preemptions": self.preemptions,
                "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits,
                "batch_occupancy": round(self.occupancy(), 4),
                "mean_batch": round(self.step_rows / self.steps, 3) if self.steps else 0.0,
                "requests": self.requests,
                "rejected": self.rejected,
                "steps": self.steps,
                "calls": self.calls,
                "generation_tokens": self.generated,
                "restarts": self.restarts,
                "rebalances": self.rebalances,
                "pool_advice": self.pool_advice,
                "pool_advice_at": self.pool_advice_at,
                "engine_state": self.engine_state,
                "engine_failures": self.engine_failures,
                "engine_restarts": self.engine_restarts,
                "engine_stopped": self.engine_stopped,
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "itl_p50_s": percentile(itl, 50),
                "itl_p99_s": percentile(itl, 99),
            }

    def prometheus(self, model_name: str) -> str:
        """The stats in Prometheus' text format under vLLM's metric names (a server's
        `GET /metrics`)."""
        labels = f'model_name="{model_name}"'
        with self._lock:
            lines = []
            for name, kind, value in (
                ("vllm:num_requests_running", "gauge", self.running),
                ("vllm:num_requests_waiting", "gauge", self.waiting),
                ("vllm:kv_cache_usage_perc", "gauge", self.kv_usage()),
                ("vllm:num_preemptions_total", "counter", self.preemptions),
                ("vllm:prefix_cache_queries_total", "counter", self.prefix_queries),
                ("vllm:prefix_cache_hits_total", "counter", self.prefix_hits),
                ("offload:kv_cache_blocks", "gauge", self.num_blocks),
                ("offload:kv_cache_blocks_used", "gauge", self.used_blocks),
                ("offload:kv_cache_tokens_used", "gauge", self.used_tokens),
                ("offload:batch_occupancy", "gauge", self.occupancy()),
                ("vllm:generation_tokens_total", "counter", self.generated),
                ("offload:kv_pool_rebalances_total", "counter", self.rebalances),
                ("offload:engine_failures_total", "counter", self.engine_failures),
                ("offload:engine_restarts_total", "counter", self.engine_restarts),
                ("offload:engine_serving", "gauge", int(self.engine_state == "serving")),
            ):
                lines += [f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
            # ended sequences by why, as vLLM labels them (a dashboard sums over the label)
            name = "vllm:request_success_total"
            lines.append(f"# TYPE {name} counter")
            for reason, count in self.ended_by.items():
                lines.append(f'{name}{{{labels},finished_reason="{reason}"}} {count}')
            for name, histogram in (
                ("vllm:time_to_first_token_seconds", self.ttft),
                ("vllm:inter_token_latency_seconds", self.itl),
            ):
                lines += [f"# TYPE {name} histogram", *histogram.lines(name, labels)]
        return "\n".join(lines) + "\n"

    def drain_samples(self) -> tuple[list[float], list[float]]:
        """Latency samples since the last call (for the Prometheus histograms)."""
        with self._lock:
            ttft, itl = list(self._new_ttft), list(self._new_itl)
            self._new_ttft.clear()
            self._new_itl.clear()
            return ttft, itl


class EngineMetrics:
    """The stats as Ray metrics, vLLM's names with ':' spelt '_' (Ray's metric names), tagged
    with the model name."""

    def __init__(self, model_name: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = {"model_name": model_name}
        keys = ("model_name",)
        self.running = Gauge(
            "vllm_num_requests_running", tag_keys=keys, description="Sequences in the running batch"
        )
        self.waiting = Gauge(
            "vllm_num_requests_waiting",
            tag_keys=keys,
            description="Sequences waiting to run",
        )
        self.usage = Gauge(
            "vllm_kv_cache_usage_perc",
            tag_keys=keys,
            description="Fraction of the KV pool's blocks in use (1 = full)",
        )
        self.preemptions = Counter(
            "vllm_num_preemptions",
            tag_keys=keys,
            description="Running sequences preempted for want of KV blocks",
        )
        self.prefix_queries = Counter(
            "vllm_prefix_cache_queries",
            tag_keys=keys,
            description="Tokens admitted sequences looked up in the prefix cache",
        )
        self.prefix_hits = Counter(
            "vllm_prefix_cache_hits",
            tag_keys=keys,
            description="Tokens found in the prefix cache (their keys not computed again)",
        )
        self.occupancy = Gauge(
            "offload_batch_occupancy",
            tag_keys=keys,
            description="Mean sequences per step over max_batch",
        )
        self.tokens = Counter(
            "vllm_generation_tokens", tag_keys=keys, description="Tokens generated"
        )
        self.success = Counter(
            "vllm_request_success",
            tag_keys=(*keys, "finished_reason"),
            description="Sequences ended, by why (stop, length, abort, error)",
        )
        self.ttft = Histogram(
            "vllm_time_to_first_token_seconds",
            boundaries=list(TTFT_BUCKETS_S),
            tag_keys=keys,
            description="Time to first token",
        )
        self.itl = Histogram(
            "vllm_inter_token_latency_seconds",
            boundaries=list(ITL_BUCKETS_S),
            tag_keys=keys,
            description="Time between tokens of a sequence",
        )
        self._seen: dict = {}  # (counter, its tags) -> the value it was given up to

    def export(self, stats: EngineStats) -> None:
        self.running.set(stats.running, tags=self.tags)
        self.waiting.set(stats.waiting, tags=self.tags)
        self.usage.set(stats.kv_usage(), tags=self.tags)
        self.occupancy.set(stats.occupancy(), tags=self.tags)
        for counter, value in (
            (self.tokens, stats.generated),
            (self.preemptions, stats.preemptions),
            (self.prefix_queries, stats.prefix_queries),
            (self.prefix_hits, stats.prefix_hits),
        ):
            self._raise(counter, value, self.tags)
        for reason, value in stats.ended_by.items():
            self._raise(self.success, value, {**self.tags, "finished_reason": reason})
        ttft, itl = stats.drain_samples()
        for value in ttft:
            self.ttft.observe(value, tags=self.tags)
        for value in itl:
            self.itl.observe(value, tags=self.tags)

    def _raise(self, counter, value: int, tags: dict) -> None:
        """Raise `counter` (its series of `tags`) to `value`: by what it grew since the last
        export, never lowered, never by 0 (Ray refuses that)."""
        key = (counter, tuple(sorted(tags.items())))
        seen = self._seen.get(key, 0)
        if value > seen:
            counter.inc(value - seen, tags=tags)
            self._seen[key] = value
