"""When a load re-balances its KV pool on its own (issue 59 point 2, bounded churn): the policy
(`Rebalancer`) and the in-process engine's loop check that applies it. The re-balance itself
runs on Ray in test_pipeline.py (mid-generation, against transformers) and through a named
load's keeper in test_named_loads.py."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from coordinator.engine.stats import EngineStats
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import Plan
from coordinator.runtime.job_engine import JobEngine
from coordinator.runtime.rebalance import MIN_OBSERVED, Rebalancer

CHOSEN = Plan(stages=(), options=PlanOptions(), bottleneck_s=0.0, total_bytes=0, pool_note="x")
GIVEN = dataclasses.replace(CHOSEN, pool_note="")  # --kv-cache-tokens, or all the budget left


def stats_with(ended: int, waiting: int = 0) -> EngineStats:
    stats = EngineStats(waiting=waiting)
    for i in range(ended):
        stats.finished(8, 100 + i)
    return stats


@pytest.mark.parametrize(
    ("plan", "ended", "elapsed", "due"),
    [
        (CHOSEN, (MIN_OBSERVED, 0), 600.0, True),
        (CHOSEN, (MIN_OBSERVED, 0), 599.0, False),  # at most one per interval
        (CHOSEN, (MIN_OBSERVED, 1), 600.0, False),  # in a burst (one waiting)
        (CHOSEN, (MIN_OBSERVED - 1, 0), 600.0, False),  # too few lengths
        (GIVEN, (MIN_OBSERVED, 0), 600.0, False),  # the user's pool, or the largest
        (CHOSEN, None, 600.0, False),  # no engine yet
    ],
)
def test_a_rebalance_is_due_only_between_bursts_once_an_interval(plan, ended, elapsed, due):
    start = time.monotonic() - 1000
    # the lengths end after `start`, in the test (made at collection, a busy run's twenty
    # minutes before, they had ended before it and counted for nothing)
    stats = None if ended is None else stats_with(*ended)
    lengths = Rebalancer(600.0, now=start).lengths(plan, stats, start + elapsed)
    assert (lengths is not None) is due
    if due:
        assert lengths.sequences == tuple((8, 100 + i) for i in range(MIN_OBSERVED))
    assert Rebalancer(0.0, now=start).lengths(plan, stats, start + 10**9) is None  # 0: never


def test_only_the_lengths_since_the_last_check_count() -> None:
    """A load whose traffic shifted re-balances for what it gets now: the sequences that ended
    before the last attempt are left out (and too few after it: not yet)."""
    stats = stats_with(MIN_OBSERVED)  # before the check
    rebalancer = Rebalancer(600.0, now=time.monotonic() - 1000)
    rebalancer.attempted(time.monotonic())
    later = rebalancer.last + 600
    assert rebalancer.lengths(CHOSEN, stats, later) is None
    for _ in range(MIN_OBSERVED):
        stats.finished(30, 480)
    assert rebalancer.lengths(CHOSEN, stats, later).sequences == ((30, 480),) * MIN_OBSERVED


def test_the_engines_loop_rebalances_when_due_and_records_a_failure() -> None:
    calls: list = []
    events: list[dict] = []

    def rebalance(lengths):
        calls.append(lengths.sequences)
        if len(calls) == 2:
            raise RuntimeError("the pool does not fit")
        return {"event": "re-balanced"}

    job = SimpleNamespace(plan=CHOSEN, rebalance=rebalance, record_event=events.append)
    engines = JobEngine(job)
    stats = stats_with(MIN_OBSERVED)
    engines._host = SimpleNamespace(engine=SimpleNamespace(stats=stats))
    engines._rebalancer = Rebalancer(600.0, now=time.monotonic() - 10**6)  # long ago: due
    engines.rebalance_due()
    assert len(calls) == 1 and len(calls[0]) == MIN_OBSERVED and events == []
    engines.rebalance_due()  # attempted just now: not again within the interval
    assert len(calls) == 1
    engines._rebalancer.last -= 10**6  # long ago again, every length after it
    engines.rebalance_due()
    assert len(calls) == 2
    assert events == [{"event": "re-balance failed", "error": "the pool does not fit"}]
    engines._rebalancer.last -= 10**6
    stats.waiting = 3  # a burst: not now
    engines.rebalance_due()
    assert len(calls) == 2


def test_a_rebalance_decided_before_a_recovery_is_not_applied(monkeypatch) -> None:
    """The workers changed while the re-balance probed (a recovery moved the gate's epoch): its
    decision is stale, so nothing is applied or adopted; with no change it is."""
    from coordinator.runtime import rebalance as module
    from coordinator.runtime.gate import Gate

    gate, applied, adopted = Gate(), [], []
    proposal = SimpleNamespace(plan=object(), text=lambda: "KV pool 32 -> 96 tokens")

    def recovered_meanwhile(group, lengths):
        gate.epoch += 1  # as a recovery does, alone in the gate
        return proposal

    monkeypatch.setattr(module, "apply", lambda *a: applied.append(a) or {"event": "re-balanced"})
    monkeypatch.setattr(module, "decide", recovered_meanwhile)
    event = module.rebalance(object(), gate, None, print, adopt=lambda: adopted.append(1))
    assert event == {"event": "kept the KV pool", "why": "the workers changed meanwhile"}
    assert applied == [] and adopted == []
    monkeypatch.setattr(module, "decide", lambda group, lengths: proposal)
    recorded: list[dict] = []
    before = gate.epoch
    event = module.rebalance(object(), gate, None, recorded.append, adopt=lambda: adopted.append(1))
    assert event == {"event": "re-balanced"} and recorded == [event]
    assert len(applied) == 1 and adopted == [1] and gate.epoch == before + 1
