"""A running load's KV pool re-balanced against its resident weights as traffic changes
(issue 59 point 2).

The policy (`decide`): every worker answers for its own GPU as in a re-plan (its stage's bytes
counted as free), then the pool is chosen by the cost model for the lengths the engine observed
(`coordinator.planning.pool.choose_pool`), with every stage kept where it is (`plan(keep=...)`:
only what each offloads and the pool change). It moves only when the new pool is predicted at
least GAIN faster for those lengths than the current one, priced on the same measurements.

`apply` then goes through the gate (`WorkerGroup.apply` with every worker matched to its own
stage: each reconfigures in memory, layers moving between the GPU and host memory with no read
from disk) and loads what is left; the engine sees the new epoch at its next step, puts every
running sequence back at the head of its queue to feed its prompt and tokens so far again, and
takes the new pool's blocks. Nothing is dropped and no request starts over: a sequence's
tokens are a function of its tokens so far.

Bounded churn is the caller's (`Rebalancer`): at most one re-balance per `interval_s`, none
while requests wait (a burst), and none before MIN_OBSERVED sequences have ended.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.planning.planner import Plan, plan
from coordinator.planning.pool import Lengths, PoolChoice, PoolPrice, choose_pool, price
from coordinator.planning.reserve import job_options
from coordinator.runtime import recovery
from coordinator.runtime.gate import Gate
from coordinator.runtime.group import WorkerGroup
from coordinator.runtime.probing import model_of, probe_cluster
from offload.errors import PlanError
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for

GAIN = 0.10  # the least predicted gain in tokens/s that moves a running load
MIN_OBSERVED = 16  # sequences ended before their lengths are trusted


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """What a re-balance would do: the pool chosen for the lengths, and the current pool priced
    on the same measurements. `plan` is None where it keeps the current pool."""

    choice: PoolChoice
    current: PoolPrice
    plan: Plan | None
    envs: dict
    probe_s: float

    @property
    def gain(self) -> float:
        best = next(p for p in self.choice.weighed if p.tokens == self.choice.tokens)
        return best.tokens_per_s / self.current.tokens_per_s - 1 if self.current.tokens_per_s else 0

    def text(self) -> str:
        pool = self.current.tokens
        if self.plan is None:
            return (
                f"the KV pool of {pool} tokens stays: the best for the lengths observed is "
                f"{self.choice.tokens} tokens, {self.gain:+.1%} predicted tokens/s (moves at "
                f"{GAIN:+.0%})"
            )
        return (
            f"KV pool {pool} -> {self.choice.tokens} tokens: {self.gain:+.1%} predicted "
            f"tokens/s for the lengths observed"
        )


def decide(group: WorkerGroup, lengths: Lengths) -> Proposal:
    """The pool for `lengths` on the group's GPUs as they stand (module doc)."""
    start = time.perf_counter()
    held, probers = recovery.holdings(group.handles)
    snapshot, envs = probe_cluster(
        group.config,
        held_bytes=held,
        probers=probers,
        model=model_of(group.index, group.config),
        own=[h.node_id for h in group.handles],
    )
    probe_s = time.perf_counter() - start
    config, running = group.config, group.plan
    options = dataclasses.replace(
        job_options(config, group.index, snapshot),
        max_batch=config.max_batch,
        micro_batches=running.options.micro_batches,
        objective=running.options.objective,
    )
    layers = group.index.layers
    now = plan(
        layers,
        snapshot,
        dataclasses.replace(options, kv_tokens=config.kv_cache_tokens),
        keep=running,
    )
    current = price(now, lengths, config.max_batch, config.max_seq_len)
    least = blocks_for(config.max_seq_len) * DEFAULT_BLOCK_SIZE
    choice = choose_pool(layers, snapshot, options, least, lengths, keep=running)
    proposal = Proposal(choice=choice, current=current, plan=None, envs=envs, probe_s=probe_s)
    if choice.tokens != current.tokens and proposal.gain >= GAIN:
        proposal = dataclasses.replace(
            proposal, plan=dataclasses.replace(choice.plan, pool_note=choice.text())
        )
    return proposal


def apply(group: WorkerGroup, proposal: Proposal, record: recovery.Record) -> dict:
    """Take the proposal's plan (inside the caller's gate: no step runs meanwhile): every worker
    keeps its stage and reconfigures in memory, then loads what moved. Returns the event."""
    if proposal.plan is None:
        raise PlanError(f"nothing to re-balance: {proposal.text()}")
    before = group.config.kv_cache_tokens
    start = time.perf_counter()
    group.config = dataclasses.replace(group.config, kv_cache_tokens=proposal.choice.tokens)
    try:
        _, reconfigure_s = group.apply(
            proposal.plan, proposal.envs, {i: i for i in range(len(group.handles))}
        )
        recovery.load_recovering(group, record)
    except BaseException:
        group.config = dataclasses.replace(group.config, kv_cache_tokens=before)
        raise
    return {
        "event": "re-balanced",
        "why": proposal.text(),
        "kv_pool_tokens": [before, proposal.choice.tokens],
        "offloaded_bytes": sum(s.offloaded_bytes for s in proposal.plan.stages),
        "predicted_gain": round(proposal.gain, 4),
        "probe_s": round(proposal.probe_s, 3),
        "reconfigure_s": round(reconfigure_s, 3),
        "rebalance_s": round(time.perf_counter() - start, 3),
    }


def rebalance(
    group: WorkerGroup,
    gate: Gate,
    lengths: Lengths,
    record: recovery.Record,
    epoch: int | None = None,
    adopt: Callable[[], None] | None = None,
) -> dict:
    """`decide` (outside the gate: it only probes), then `apply` alone in the gate, the epoch
    moved on so that the engine feeds its sequences again into the new pool. Returns the event,
    recorded where the pool moved ("kept the KV pool", with why, where it did not). `epoch`:
    the gate's when `group` was taken (now, by default); the workers changed since (a recovery)
    means the decision is stale: nothing is applied, the next check decides again. `adopt()`:
    called alone in the gate before `apply`, where the caller makes `group` the one its engine
    reads (a keeper's group is rebuilt from the load's record)."""
    epoch = gate.epoch if epoch is None else epoch
    proposal = decide(group, lengths)
    if proposal.plan is None:  # not recorded: a load checks every interval (stats show it)
        return {"event": "kept the KV pool", "why": proposal.text()}
    with gate.alone():
        if gate.epoch != epoch:  # changed meanwhile (a recovery): next time
            return {"event": "kept the KV pool", "why": "the workers changed meanwhile"}
        if adopt is not None:
            adopt()
        try:
            event = apply(group, proposal, record)
        finally:
            gate.epoch += 1  # the workers' pools changed (or went), whatever happened
    record(event)
    return event


# How often a load asks whether a re-balance is due (the interval itself bounds how often one
# happens): at most this, or the interval where it is shorter.
CHECK_S = 30.0


class Rebalancer:
    """When a load re-balances on its own (bounded churn), and for which lengths: once
    `interval_s` has passed since its start or its last attempt (moved or kept), with no request
    waiting (never in a burst: the queue is what a burst fills), for the sequences that ended
    since the last attempt (traffic as it is now, not as it was), at least MIN_OBSERVED of
    them; only where the plan chose the pool (`Plan.pool_note`: not one given with
    --kv-cache-tokens, nor all the budget leaves). Times are time.monotonic()'s."""

    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self.last = now

    def lengths(self, the_plan: Plan, engine_stats, now: float) -> Lengths | None:
        """The lengths to re-balance for now (`engine_stats`: the load's `EngineStats`), or
        None where no re-balance is due."""
        if self.interval_s <= 0 or not the_plan.pool_note or engine_stats is None:
            return None
        if now - self.last < self.interval_s or engine_stats.waiting:
            return None
        observed = engine_stats.observed_lengths(since=self.last)
        return Lengths(observed) if len(observed) >= MIN_OBSERVED else None

    def attempted(self, now: float) -> None:
        self.last = now

    def check(
        self,
        the_plan: Plan,
        engine_stats,
        rebalance: Callable[[Lengths], object],
        failed: Callable[[Exception], None],
    ) -> None:
        """A load's periodic check: where one is due (`lengths`), `rebalance(lengths)`, once
        for this interval whatever comes of it; its error goes to `failed` (the next check
        tries again, an interval later)."""
        now = time.monotonic()
        lengths = self.lengths(the_plan, engine_stats, now)
        if lengths is None:
            return
        self.attempted(now)
        try:
            rebalance(lengths)
        except Exception as exc:
            failed(exc)


def observed(sequences) -> Lengths:
    """The lengths an engine observed ((prompt, generated) tokens each), as the planner prices
    them; PlanError where none has ended yet."""
    if not sequences:
        raise PlanError("no sequence has ended yet: no lengths to re-balance the pool for")
    return Lengths(tuple(sequences))
