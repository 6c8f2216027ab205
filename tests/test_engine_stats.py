"""The engine's stats and what they export, in process: `snapshot()` (`offloadctl status`),
the Prometheus text of a server's `GET /metrics` (read back with prometheus_client's own
parser) and the Ray metrics of `EngineMetrics` (Ray's metric classes, recording what they are
given). Dashboards built for vLLM read these: the names, types, labels and histogram buckets
are vLLM's (vllm/v1/metrics/loggers.py), copied here as literals."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.engine.sequences import Request
from coordinator.engine.stats import (
    PREEMPTION_WINDOW_S,
    EngineMetrics,
    EngineStats,
    Histogram,
    percentile,
)
from worker.steps import Sampling

# vLLM's bucket bounds (seconds): vllm:time_to_first_token_seconds and the inter-token one
VLLM_TTFT_BUCKETS = [
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
]
VLLM_ITL_BUCKETS = [
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
]
# /metrics: every series of the text, by its sample name, with its family's type
SCALARS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:generation_tokens_total": "counter",
    **{f"vllm:request_success_total[{r}]": "counter" for r in ("stop", "length", "abort", "error")},
    "offload:kv_cache_blocks": "gauge",
    "offload:kv_cache_blocks_used": "gauge",
    "offload:kv_cache_tokens_used": "gauge",
    "offload:batch_occupancy": "gauge",
    "offload:kv_pool_rebalances_total": "counter",
    "offload:engine_failures_total": "counter",
    "offload:engine_restarts_total": "counter",
    "offload:engine_serving": "gauge",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": VLLM_ITL_BUCKETS,
}
N = 201  # samples 0..200: their p50, p90 and p99 are exact ranks (100, 180, 198) by any rule


def sequence(submitted_s: float = 0.0):
    return Request.of([[1, 2]], sampling=Sampling(), max_new_tokens=N + 1, submitted_s=submitted_s)


def tokens(stats: EngineStats, at: list[float], submitted_s: float = 0.0) -> None:
    """One sequence's tokens, given at the times `at` (seconds)."""
    seq = sequence(submitted_s).sequences[0]
    for now in at:
        stats.token(seq, now)


def busy_stats() -> EngineStats:
    """Stats with every field set, N time-to-first-token samples 0..N-1 s, N inter-token ones
    0..N-1 s (given out of order) and N sequences ended, prompts 1..N and generated 0..N-1."""
    stats = EngineStats(
        requests=7,
        rejected=1,
        steps=3,
        calls=2,
        step_rows=10,
        restarts=1,
        running=2,
        waiting=1,
        num_slots=4,
        num_blocks=3,
        used_blocks=1,
        used_tokens=12,
        preemptions=3,
        prefix_queries=40,
        prefix_hits=16,
        engine_failures=1,
        engine_restarts=1,
        engine_stopped="the step failed: boom",
    )
    times, now = [0.0], 0.0
    for k in range(N):
        now += float(k * 7 % N)  # every gap 0..N-1 once, not in order
        times.append(now)
    tokens(stats, times)  # the first token at 0 s: time to first token 0
    for k in range(1, N):
        tokens(stats, [float(k)])
    for k in range(N):  # one cut at its length, one cancelled, the rest at an end token
        stats.finished(k + 1, k, reason={0: "length", 1: "abort"}.get(k, "stop"))
    return stats


def parse(text: str) -> dict:
    """{sample name: (family type, labels, value)} of a /metrics text, the histograms' buckets
    as a list of (le, labels, value) under NAME_bucket."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.endswith("_bucket"):
                le = labels.pop("le")
                out.setdefault(sample.name, (family.type, []))[1].append((le, labels, sample.value))
            else:
                name = sample.name
                if "finished_reason" in labels:  # one series per reason: NAME[reason]
                    name = f"{name}[{labels.pop('finished_reason')}]"
                assert name not in out, f"{name} twice"
                out[name] = (family.type, labels, sample.value)
    return out


# --- percentiles, the histogram's text ---------------------------------------------------------


def test_percentiles_are_the_samples_at_their_rank() -> None:
    values = [float(v) for v in reversed(range(N))]
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (
        100.0,
        180.0,
        198.0,
    )
    assert percentile(values, 100) == 200.0 and percentile(values, 0) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_a_histogram_writes_cumulative_buckets_then_inf_sum_and_count() -> None:
    """Prometheus' exposition format: `le` is inclusive, each bucket counts every sample at or
    below its bound, the last bucket is `+Inf` (spelt so) and equals `_count`."""
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    assert histogram.lines("h", 'model_name="m"') == [
        'h_bucket{model_name="m",le="1.0"} 2',
        'h_bucket{model_name="m",le="2.0"} 3',
        'h_bucket{model_name="m",le="+Inf"} 4',
        'h_sum{model_name="m"} 6.0',
        'h_count{model_name="m"} 4',
    ]
    assert Histogram((1.0,)).lines("h", 'a="b"') == [
        'h_bucket{a="b",le="1.0"} 0',
        'h_bucket{a="b",le="+Inf"} 0',
        'h_sum{a="b"} 0.0',
        'h_count{a="b"} 0',
    ]


# --- snapshot ----------------------------------------------------------------------------------


def test_the_snapshot_has_every_key_with_its_value() -> None:
    """What `offloadctl status` (and --json) reads: every key, the ratios rounded as they
    are shown, the latency and length percentiles."""
    assert busy_stats().snapshot() == {
        "observed_sequences": N,
        "observed_prompt_p50": 101,
        "observed_generated_p50": 100,
        "observed_total_p90": 361,  # prompt + generated: 1, 3, .., 401
        "preemptions_per_min": 0.0,  # none seen lately (the count was set, not preempted())
        "requests_running": 2,
        "requests_waiting": 1,
        "kv_slots": 4,
        "kv_blocks": 3,
        "kv_blocks_used": 1,
        "kv_tokens_used": 12,
        "kv_cache_usage": 0.3333,
        "preemptions": 3,
        "prefix_cache_queries": 40,
        "prefix_cache_hits": 16,
        "batch_occupancy": 0.8333,  # 10 rows / 3 steps / 4 slots
        "mean_batch": 3.333,
        "requests": 7,
        "rejected": 1,
        "steps": 3,
        "calls": 2,
        "generation_tokens": 2 * N,
        "restarts": 1,
        "rebalances": 0,
        "pool_advice": "",
        "pool_advice_at": 0.0,
        "engine_state": "serving",
        "engine_failures": 1,
        "engine_restarts": 1,
        "engine_stopped": "the step failed: boom",
        "ttft_p50_s": 100.0,
        "ttft_p99_s": 198.0,
        "itl_p50_s": 100.0,
        "itl_p99_s": 198.0,
    }


def test_an_idle_engine_snapshots_zeros_and_no_percentiles() -> None:
    """No steps, no slots, no blocks: ratios are 0 (never a division by zero), no latency."""
    snap = EngineStats().snapshot()
    assert snap["observed_sequences"] == 0 and "observed_prompt_p50" not in snap
    assert (snap["mean_batch"], snap["batch_occupancy"], snap["kv_cache_usage"]) == (0.0,) * 3
    assert [snap[k] for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")] == [None] * 4
    stepped = EngineStats(steps=4, step_rows=6)  # steps but no slots
    assert stepped.occupancy() == 0.0 and stepped.snapshot()["mean_batch"] == 1.5
    assert EngineStats(steps=4, step_rows=6, num_slots=3).occupancy() == 0.5
    assert EngineStats(used_blocks=0, num_blocks=0).kv_usage() == 0.0
    assert EngineStats(used_blocks=4, num_blocks=4).kv_usage() == 1.0


def test_rebalance_checks_count_only_the_moves_and_keep_the_last_advice() -> None:
    stats = EngineStats()
    before = time.time()
    stats.rebalanced({"event": "re-balanced", "why": "KV pool 64 -> 256 tokens"})
    stats.rebalanced({"event": "re-balanced", "why": "KV pool 256 -> 512 tokens"})
    stats.rebalanced({"event": "kept the KV pool", "why": "the KV pool of 512 tokens stays"})
    assert stats.rebalances == 2
    assert stats.pool_advice == "the KV pool of 512 tokens stays"
    assert before <= stats.pool_advice_at <= time.time()
    stats.rebalanced({"event": "kept the KV pool"})  # nothing to say: no advice, not "None"
    assert stats.pool_advice == "" and stats.snapshot()["pool_advice"] == ""
    assert stats.rebalances == 2


def test_a_preemption_counts_for_the_whole_window_then_no_more() -> None:
    """Preemptions per minute over the last PREEMPTION_WINDOW_S seconds, the window closed:
    one exactly that old still counts."""
    stats = EngineStats()
    first, later = 1000.0, 1000.0 + PREEMPTION_WINDOW_S / 2
    stats.preempted(1, first)
    stats.preempted(3, later)  # two more
    stats.preempted(3, later)  # the same total: none more
    per_one = 60.0 / PREEMPTION_WINDOW_S
    assert stats.preemptions_per_min(first + PREEMPTION_WINDOW_S) == pytest.approx(3 * per_one)
    assert stats.preemptions_per_min(first + PREEMPTION_WINDOW_S + 1) == pytest.approx(2 * per_one)
    assert stats.preemptions_per_min(later + PREEMPTION_WINDOW_S) == pytest.approx(2 * per_one)
    assert stats.preemptions_per_min(later + PREEMPTION_WINDOW_S + 1) == 0.0


def test_latency_samples_are_drained_once() -> None:
    """`drain_samples` hands each new sample out once (to Ray's histograms)."""
    stats = EngineStats()
    tokens(stats, [0.5, 0.75, 1.75], submitted_s=0.25)
    assert stats.drain_samples() == ([0.25], [0.25, 1.0])
    assert stats.drain_samples() == ([], [])
    tokens(stats, [2.0], submitted_s=1.0)
    assert stats.drain_samples() == ([1.0], [])
    assert list(stats.ttft_s) == [0.25, 1.0]  # the percentiles keep theirs


# --- /metrics: Prometheus text -----------------------------------------------------------------


def test_metrics_text_has_vllms_names_types_and_labels_and_the_stats_values() -> None:
    stats = busy_stats()
    text = stats.prometheus("tiny-llama")
    assert text.endswith("\n") and not text.endswith("\n\n")  # one line each, each ended
    for line in text.splitlines():  # every line a TYPE comment or a sample, nothing else
        assert line.startswith("# TYPE ") or "{" in line.split(" ")[0], line
    series = parse(text)
    expected_names = {
        *SCALARS,
        *(f"{name}_{part}" for name in HISTOGRAMS for part in ("bucket", "sum", "count")),
    }
    assert set(series) == expected_names
    for name, kind in SCALARS.items():
        assert series[name][:2] == (kind, {"model_name": "tiny-llama"}), name
    values = {name: series[name][2] for name in SCALARS}
    assert values == {
        "vllm:num_requests_running": 2,
        "vllm:num_requests_waiting": 1,
        "vllm:kv_cache_usage_perc": pytest.approx(1 / 3),
        "vllm:num_preemptions_total": 3,
        "vllm:prefix_cache_queries_total": 40,
        "vllm:prefix_cache_hits_total": 16,
        "vllm:generation_tokens_total": 2 * N,
        "vllm:request_success_total[stop]": N - 2,
        "vllm:request_success_total[length]": 1,
        "vllm:request_success_total[abort]": 1,
        "vllm:request_success_total[error]": 0,
        "offload:kv_cache_blocks": 3,
        "offload:kv_cache_blocks_used": 1,
        "offload:kv_cache_tokens_used": 12,
        "offload:batch_occupancy": pytest.approx(10 / 3 / 4),
        "offload:kv_pool_rebalances_total": 0,
        "offload:engine_failures_total": 1,
        "offload:engine_restarts_total": 1,
        "offload:engine_serving": 1,
    }
    samples = {
        "vllm:time_to_first_token_seconds": [float(k) for k in range(N)],
        "vllm:inter_token_latency_seconds": [float(k) for k in range(N)],
    }
    for name, bounds in HISTOGRAMS.items():
        kind, buckets = series[f"{name}_bucket"]
        assert kind == "histogram"
        assert [le for le, _, _ in buckets] == [*(str(b) for b in bounds), "+Inf"]
        assert all(labels == {"model_name": "tiny-llama"} for _, labels, _ in buckets)
        counts = [value for _, _, value in buckets]
        assert counts == [sum(s <= b for s in samples[name]) for b in bounds] + [N], name
        assert series[f"{name}_count"][1:] == ({"model_name": "tiny-llama"}, N)
        assert series[f"{name}_sum"][1:] == ({"model_name": "tiny-llama"}, sum(samples[name]))


def test_metrics_counters_only_grow_and_the_engine_state_is_a_gauge() -> None:
    stats = EngineStats(num_slots=2, num_blocks=8)
    first = parse(stats.prometheus("m"))
    assert first["vllm:kv_cache_usage_perc"][2] == 0.0
    tokens(stats, [0.001])  # time to first token 0.001 s: on a bound
    tokens(stats, [1.0, 1.5, 1.75])  # 1 s, then inter-token 0.5 s (a bound) and 0.25 s
    stats.finished(2, 3)
    stats.finished(reason="error")  # it ended, all the same
    stats.preempted(1, 5.0)
    stats.rebalanced({"event": "re-balanced", "why": "grown"})
    stats.engine_failures, stats.engine_restarts, stats.engine_state = 1, 1, "restarting"
    second = parse(stats.prometheus("m"))
    for name, (kind, *_rest) in first.items():
        if kind == "counter":
            assert second[name][2] >= first[name][2], name
    grew = {
        name: second[name][2] - first[name][2]
        for name, kind in SCALARS.items()
        if kind == "counter" and second[name][2] != first[name][2]
    }
    assert grew == {
        "vllm:generation_tokens_total": 4,
        "vllm:request_success_total[stop]": 1,
        "vllm:request_success_total[error]": 1,
        "vllm:num_preemptions_total": 1,
        "offload:kv_pool_rebalances_total": 1,
        "offload:engine_failures_total": 1,
        "offload:engine_restarts_total": 1,
    }
    assert second["offload:engine_serving"][2] == 0
    ttft = dict((le, v) for le, _, v in second["vllm:time_to_first_token_seconds_bucket"][1])
    itl = dict((le, v) for le, _, v in second["vllm:inter_token_latency_seconds_bucket"][1])
    # `le`: a sample on a bound is in that bound's bucket
    assert [ttft[le] for le in ("0.001", "0.75", "1.0", "2560.0", "+Inf")] == [1, 1, 2, 2, 2]
    assert [itl[le] for le in ("0.2", "0.3", "0.4", "0.5", "80.0", "+Inf")] == [0, 1, 1, 2, 2, 2]
    stats.engine_state = "failed"
    assert parse(stats.prometheus("m"))["offload:engine_serving"][2] == 0
    stats.engine_state = "serving"
    assert parse(stats.prometheus("m"))["offload:engine_serving"][2] == 1


# --- Ray metrics (EngineMetrics) ---------------------------------------------------------------


@pytest.fixture
def ray_metrics(monkeypatch):
    """Ray's own Gauge, Counter and Histogram (their checks of names, tags and values run),
    each also recording what it was made with and given: {name: metric} with `.calls`."""
    import ray.util.metrics as metrics

    made: dict = {}

    def recording(base, method: str):
        def record(self, value, tags=None):
            self.calls.append((value, tags))
            getattr(base, method)(self, value, tags=tags)

        def init(self, name, **kwargs):
            base.__init__(self, name, **kwargs)
            self.kind, self.kwargs, self.calls = base.__name__, kwargs, []
            assert name not in made, f"{name} made twice"
            made[name] = self

        return type(base.__name__, (base,), {"__init__": init, method: record})

    monkeypatch.setattr(metrics, "Gauge", recording(metrics.Gauge, "set"))
    monkeypatch.setattr(metrics, "Counter", recording(metrics.Counter, "inc"))
    monkeypatch.setattr(metrics, "Histogram", recording(metrics.Histogram, "observe"))
    return made


def test_ray_metrics_are_vllms_with_underscores_tagged_with_the_model(ray_metrics) -> None:
    EngineMetrics("tiny-llama")
    assert {name: m.kind for name, m in ray_metrics.items()} == {
        "vllm_num_requests_running": "Gauge",
        "vllm_num_requests_waiting": "Gauge",
        "vllm_kv_cache_usage_perc": "Gauge",
        "offload_batch_occupancy": "Gauge",
        "vllm_num_preemptions": "Counter",  # Prometheus adds _total, as vLLM's counters
        "vllm_prefix_cache_queries": "Counter",
        "vllm_prefix_cache_hits": "Counter",
        "vllm_generation_tokens": "Counter",
        "vllm_request_success": "Counter",
        "vllm_time_to_first_token_seconds": "Histogram",
        "vllm_inter_token_latency_seconds": "Histogram",
    }
    for name, metric in ray_metrics.items():
        reason = ("finished_reason",) if name == "vllm_request_success" else ()  # vLLM's label
        assert tuple(metric.kwargs["tag_keys"]) == ("model_name", *reason), name
        description = metric.kwargs.get("description")
        assert isinstance(description, str) and description.strip(), name  # Prometheus' HELP
    assert ray_metrics["vllm_time_to_first_token_seconds"].kwargs["boundaries"] == (
        VLLM_TTFT_BUCKETS
    )
    assert ray_metrics["vllm_inter_token_latency_seconds"].kwargs["boundaries"] == (
        VLLM_ITL_BUCKETS
    )


def test_ray_metrics_export_gauges_counter_increments_and_each_sample_once(ray_metrics) -> None:
    """Each export: the gauges set to the stats' values; each counter raised by what its count
    grew since the last export (its total is the stats' count: never lowered, never counted
    twice; Ray refuses an increment of 0); each new latency sample observed once."""
    exporter = EngineMetrics("m")
    tags = {"model_name": "m"}
    stats = EngineStats(running=2, waiting=1, num_slots=2, num_blocks=4, used_blocks=1)
    stats.steps, stats.step_rows = 2, 3
    stats.preempted(3, 1.0)
    stats.prefix_queries, stats.prefix_hits = 10, 4
    tokens(stats, [0.5, 0.75], submitted_s=0.0)
    stats.finished(3, 2, reason="length")

    def totals() -> dict:
        return {
            name: sum(value for value, _ in m.calls)
            for name, m in ray_metrics.items()
            if m.kind == "Counter"
        }

    def gauges() -> dict:
        return {name: m.calls[-1] for name, m in ray_metrics.items() if m.kind == "Gauge"}

    exporter.export(stats)
    success = ray_metrics["vllm_request_success"]
    assert success.calls == [(1, {**tags, "finished_reason": "length"})]  # no increment of 0
    assert gauges() == {
        "vllm_num_requests_running": (2, tags),
        "vllm_num_requests_waiting": (1, tags),
        "vllm_kv_cache_usage_perc": (0.25, tags),
        "offload_batch_occupancy": (0.75, tags),
    }
    assert totals() == {
        "vllm_generation_tokens": 2,
        "vllm_num_preemptions": 3,
        "vllm_prefix_cache_queries": 10,
        "vllm_prefix_cache_hits": 4,
        "vllm_request_success": 1,
    }
    ttft = ray_metrics["vllm_time_to_first_token_seconds"]
    itl = ray_metrics["vllm_inter_token_latency_seconds"]
    assert (ttft.calls, itl.calls) == ([(0.5, tags)], [(0.25, tags)])
    assert all(
        call_tags == tags
        for m in ray_metrics.values()
        if m is not success
        for _, call_tags in m.calls
    )

    exporter.export(stats)  # nothing new: no increment, no sample
    assert totals()["vllm_generation_tokens"] == 2 and len(ttft.calls) == len(itl.calls) == 1
    assert all(len(m.calls) == 1 for m in ray_metrics.values() if m.kind == "Counter")

    stats.running, stats.used_blocks = 1, 4
    tokens(stats, [1.0, 1.5], submitted_s=0.875)  # a second sequence: 0.125 s, then 0.5 s
    stats.prefix_hits += 2
    stats.finished(3, 2, reason="stop")
    stats.finished(reason="error")
    exporter.export(stats)
    assert gauges()["vllm_num_requests_running"] == (1, tags)
    assert gauges()["vllm_kv_cache_usage_perc"] == (1.0, tags)
    assert totals() == {
        "vllm_generation_tokens": 4,
        "vllm_num_preemptions": 3,
        "vllm_prefix_cache_queries": 10,
        "vllm_prefix_cache_hits": 6,
        "vllm_request_success": 3,
    }
    assert success.calls[1:] == [
        (1, {**tags, "finished_reason": "stop"}),
        (1, {**tags, "finished_reason": "error"}),
    ]
    assert ray_metrics["vllm_prefix_cache_hits"].calls[-1] == (2, tags)
    assert ttft.calls == [(0.5, tags), (0.125, tags)]
    assert itl.calls == [(0.25, tags), (0.5, tags)]

    exporter.export(EngineStats())  # counts lower than exported (other stats): not lowered
    assert totals()["vllm_generation_tokens"] == 4
    stats.prefix_hits += 1
    exporter.export(stats)
    assert totals()["vllm_prefix_cache_hits"] == 7
