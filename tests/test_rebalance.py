"""When a load re-balances its KV pool on its own (issue 59 point 2, bounded churn): the policy
(`Rebalancer`) and the in-process engine's loop check that applies it. The re-balance itself
runs on Ray in test_pipeline.py (mid-generation, against transformers) and through a named
load's keeper in test_named_loads.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import Plan
from coordinator.runtime.job_engine import JobEngine
from coordinator.runtime.rebalance import MIN_OBSERVED, Rebalancer

CHOSEN = Plan(stages=(), options=PlanOptions(), bottleneck_s=0.0, total_bytes=0, pool_note="x")
GIVEN = dataclasses.replace(CHOSEN, pool_note="")  # --kv-cache-tokens, or all the budget left
QUIET = {"requests_waiting": 0, "observed_sequences": MIN_OBSERVED}


@pytest.mark.parametrize(
    ("plan", "stats", "elapsed", "due"),
    [
        (CHOSEN, QUIET, 600.0, True),
        (CHOSEN, QUIET, 599.0, False),  # at most one per interval
        (CHOSEN, {**QUIET, "requests_waiting": 1}, 600.0, False),  # a burst
        (CHOSEN, {**QUIET, "observed_sequences": MIN_OBSERVED - 1}, 600.0, False),
        (GIVEN, QUIET, 600.0, False),  # the user's pool, or the largest there is
        (CHOSEN, None, 600.0, False),  # no engine yet
    ],
)
def test_a_rebalance_is_due_only_between_bursts_once_an_interval(plan, stats, elapsed, due):
    rebalancer = Rebalancer(600.0, now=100.0)
    assert rebalancer.due(plan, stats, 100.0 + elapsed) is due
    assert not Rebalancer(0.0, now=100.0).due(plan, stats, 10**9)  # 0: never on its own


def test_the_engines_loop_rebalances_when_due_and_records_a_failure() -> None:
    calls: list[str] = []
    events: list[dict] = []

    def rebalance():
        calls.append("rebalance")
        if len(calls) == 2:
            raise RuntimeError("the pool does not fit")
        return {"event": "re-balanced"}

    job = SimpleNamespace(plan=CHOSEN, rebalance=rebalance, record_event=events.append)
    engines = JobEngine(job)
    stats = dict(QUIET)
    engines._host = SimpleNamespace(stats=lambda: stats)
    engines._rebalancer = Rebalancer(600.0, now=-(10**9))  # long ago: due at once
    engines.rebalance_due()
    assert calls == ["rebalance"] and events == []
    engines.rebalance_due()  # attempted just now: not again within the interval
    assert calls == ["rebalance"]
    engines._rebalancer.last = -(10**9)
    engines.rebalance_due()
    assert calls == ["rebalance"] * 2
    assert events == [{"event": "re-balance failed", "error": "the pool does not fit"}]
    engines._rebalancer.last = -(10**9)
    stats["requests_waiting"] = 3  # a burst: not now
    engines.rebalance_due()
    assert len(calls) == 2
