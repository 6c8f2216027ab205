"""A named load's keeper: the one process that changes the load after it is loaded, and the
home of the load's one engine.

`load --name` leaves no driver behind, so the keeper (a detached actor on the head node, beside
the load's record) does what a driver's `Job` does for an unnamed job: every
`watch_interval_s` it pings the workers and recovers lost ones with the same policy
(`coordinator.runtime.recovery`), and it publishes the workers' latest snapshots as Ray gauges
every `snapshot_interval_s`. Drivers attached to the load (`run NAME`) never recover it
themselves: they ask the keeper, so two recoveries never race.

The load's generation engine (`coordinator.engine`) runs here too, started with the keeper and
living as long as it: every client of the load, from any process (`serve NAME`, `generate
NAME`, `attach(name)`), submits to it and fetches its tokens from it (`EngineHost`), so they all
share one queue and one KV pool. Its steps and the keeper's recoveries go through one
gate: a recovery waits for the step being sent, and the engine claims the workers again (a new
epoch) before its next step.

A node whose workers keep dying is left out: after NODE_LOSS_LIMIT losses there within
NODE_LOSS_WINDOW_S, the next recovery plans without it (an event says so) even though Ray calls
it alive. A recovery that fails (say, what is left cannot hold the model, or a replacement's
load runs out of memory each time) is retried with exponential back-off, from the watch
interval up to BACKOFF_MAX_S, at most MAX_FAILED_RECOVERIES times in a row: then the load is
failed (its record's state, a "load failed" event with the last error; `health` says so) and
the watch stops trying. A recovery asked for (`recover`: a driver's forward, `run NAME`) still
tries, and one that succeeds makes the load loaded again.

A load may be leased (`launch(..., lease_s=...)`; `serve` leases the loads it starts): its
holder calls `renew()` well within every `lease_s`, and once no renewal came for `lease_s` the
keeper unloads the load (workers, placement groups, record) and ends itself last, so a holder
killed with -9 leaves no GPU held. A keeper that Ray restarts starts its lease afresh.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import defaultdict

import ray

from coordinator.engine.host import EngineHost
from coordinator.engine.pipelines import StepTimeoutError
from coordinator.planning.checkpoint import CheckpointIndex
from coordinator.runtime import rebalance, recovery, registry
from coordinator.runtime.gate import Gate
from coordinator.runtime.group import WorkerGroup, worker_failure
from coordinator.runtime.job_engine import build_engine
from coordinator.runtime.rebalance import CHECK_S, Rebalancer
from coordinator.runtime.record import NAMESPACE, keeper_name
from worker.startup import settle

NODE_LOSS_LIMIT = 3
NODE_LOSS_WINDOW_S = 600.0
BACKOFF_MAX_S = 300.0
MAX_FAILED_RECOVERIES = 5  # in a row: then the load is failed and the watch stops trying
EXPORT_TIMEOUT_S = 30.0  # the workers' latest snapshots are in memory: they answer between calls
# Calls at once: each client process of the load keeps one fetch of its tokens waiting here,
# beside submits, cancels, stats and recoveries.
MAX_CONCURRENCY = 256
# A keeper whose process dies is started again by Ray (from its record: the load's plan and
# workers as they are), and its new engine takes the workers over from the dead one's; the
# requests that were in flight end with an error, later ones run. `unload` kills it for good.
KEEPER_RESTARTS = 3
LEASE_POLL_S = 1.0  # a leased keeper looks at its last renewal this often (or lease_s / 4)


@ray.remote(num_cpus=0, max_restarts=KEEPER_RESTARTS, max_concurrency=MAX_CONCURRENCY)
class LoadKeeper:
    def __init__(self, name: str, index: CheckpointIndex, lease_s: float | None = None) -> None:
        self.name = name
        self._renewed = time.monotonic()  # a lease starts with the keeper
        self.index = index  # passed in: the head node need not see the checkpoint files
        # One recovery at a time (the loop's or a driver's), never under a step being sent.
        self.gate = Gate()
        self._losses: dict[str, list[float]] = defaultdict(list)  # node id -> loss times
        self.left_out: set[str] = set()
        self._counted: set[str | None] = set()  # workers whose loss was counted
        record = registry.load_record(name)[1]
        config = registry.config_of(record)
        self._failures = 0  # recoveries failed in a row
        # why the load is failed (its record says so: a restarted keeper keeps it), else None
        self.failed: str | None = None
        if record.get("state") == "failed":
            reasons = [e.get("reason", "") for e in record["events"] if e["event"] == "load failed"]
            self.failed = reasons[-1] if reasons else "failed"
        self.group = registry.group_of(record, index)  # the load now: a recovery replaces it
        self._engine_lock = threading.Lock()
        self._host: EngineHost | None = None
        with contextlib.suppress(Exception):  # a worker lost now: the first request retries
            self.host()
        self._engine_metrics = None
        self._rebalancer = Rebalancer(config.rebalance_interval_s, time.monotonic())
        for target, interval_s in (
            (self._watch_loop, config.watch_interval_s),
            (self._export_loop, config.snapshot_interval_s),
            (self._rebalance_loop, min(CHECK_S, config.rebalance_interval_s)),
        ):
            if interval_s > 0:
                threading.Thread(
                    target=target,
                    args=(interval_s,),
                    daemon=True,
                    name=f"offload-{target.__name__}",
                ).start()
        if lease_s is not None:
            threading.Thread(
                target=self._lease_loop, args=(lease_s,), daemon=True, name="offload-lease"
            ).start()
        settle()  # imports done: the GC's own thresholds again (worker.startup)

    # the lease of a load that its holder's process keeps alive (serve)
    def renew(self) -> None:
        self._renewed = time.monotonic()

    def _lease_loop(self, lease_s: float) -> None:
        while time.monotonic() - self._renewed <= lease_s:
            time.sleep(min(LEASE_POLL_S, lease_s / 4))
        print(
            f"load {self.name!r}: no renewal of its lease within {lease_s:g} s (its holder is "
            "gone): unloading it",
            file=sys.stderr,
        )
        # No recovery or step runs meanwhile (the engine's steps wait at the gate, then fail
        # on the dead workers); the keeper goes last, itself, so the rest is done first.
        with self.gate.alone():
            try:
                registry.unload(self.name, keeper=False)
            finally:
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # recovery
    def recover(self) -> list[int]:
        """Check every stage now and recover the lost ones; returns the lost stages. Raises
        what the recovery raised (a PlanError with the numbers when what is left cannot hold
        the model), after recording it in the load's events."""
        with self.gate.alone():
            dead = self._recover()
            if dead:
                self.gate.epoch += 1
            return dead

    def _recover_after(self, exc: BaseException, epoch: int) -> None:
        """The engine's step sent in `epoch` failed with `exc`: recover (unless the workers
        changed since), or raise the clear error of a step that failed by itself. A step that
        timed out: the workers that do not answer are killed first (hung), then replaced."""
        with self.gate.alone():
            if self.gate.epoch != epoch:
                return
            if isinstance(exc, StepTimeoutError):  # a hung worker is a lost one
                self.group.kill_hung()
            if self._recover():
                self.gate.epoch += 1
                return
        if isinstance(exc, ray.exceptions.RayError):
            raise worker_failure(exc, self.group.handles) from None
        raise exc

    def _recover(self) -> list[int]:
        _, record = registry.load_record(self.name)
        events = list(record["events"])
        group = registry.group_of(record, self.index)
        group.names = _namer(record)
        dead = group.dead_stages()
        if not dead:
            return []
        newly_left_out = self._count_losses(group, dead)
        if newly_left_out:
            hosts = sorted({h.hostname for h in group.handles if h.node_id in newly_left_out})
            recovery.add_event(
                events,
                {
                    "event": "node left out",
                    "hosts": hosts,
                    "reason": f"{NODE_LOSS_LIMIT} worker losses within {NODE_LOSS_WINDOW_S:.0f} s",
                },
            )

        def record_event(event: dict) -> None:
            recovery.add_event(events, event)
            registry.update(self.name, group, events)

        try:
            recovery.recover(group, record_event, dead=dead, left_out=frozenset(self.left_out))
        except Exception as exc:
            self._failures += 1
            if self._failures >= MAX_FAILED_RECOVERIES and self.failed is None:
                self.failed = f"{self._failures} recoveries failed in a row, the last: {exc}"
                recovery.add_event(events, {"event": "load failed", "reason": self.failed})
                registry.update(self.name, group, events, state="failed")
            raise
        finally:
            self.group = group  # what the workers are now, even after a failed recovery
        self._failures = 0
        if self.failed is not None:  # recovered after all: loaded again
            self.failed = None
            registry.update(self.name, group, events, state="loaded")
        return dead

    def _count_losses(self, group: WorkerGroup, dead: list[int]) -> set[str]:
        """Count each lost worker once on its node (a recovery retried for the same loss is
        not another loss); returns the nodes that reach the limit now."""
        now = time.monotonic()
        newly: set[str] = set()
        for stage in dead:
            handle = group.handles[stage]
            if handle.name in self._counted:
                continue
            self._counted.add(handle.name)
            node = handle.node_id
            recent = [t for t in self._losses[node] if now - t < NODE_LOSS_WINDOW_S] + [now]
            self._losses[node] = recent
            if len(recent) >= NODE_LOSS_LIMIT and node not in self.left_out:
                self.left_out.add(node)
                newly.add(node)
        return newly

    def _watch_once(self) -> None:
        """One look of the watch: the record read and every worker pinged outside the gate, so
        the engine's steps never wait on these cluster-wide calls; the gate only for a
        recovery, which looks again inside it (the loss may be recovered meanwhile)."""
        if self.failed is not None:  # given up: only a recovery asked for tries again
            return
        _, record = registry.load_record(self.name)
        if registry.group_of(record, self.index).dead_stages():
            self.recover()

    def _watch_loop(self, interval_s: float) -> None:
        delay = interval_s
        while True:
            time.sleep(delay)
            try:
                self._watch_once()
                delay = interval_s
            except Exception as exc:  # recorded as an event; try again, later each time
                delay = min(delay * 2, BACKOFF_MAX_S)
                print(
                    f"load {self.name!r}: recovery failed, next try in {delay:.0f} s: {exc}",
                    file=sys.stderr,
                )

    # the KV pool against the resident weights (coordinator.runtime.rebalance)
    def rebalance(self, sequences: tuple[tuple[int, int], ...] | None = None) -> dict:
        """Re-balance the load's KV pool for `sequences` ((prompt, generated) tokens each; by
        default what its engine observed); returns the event. Requests in flight go on."""
        host = self._host
        if sequences is None:
            sequences = host.engine.stats.observed_lengths() if host is not None else ()
        lengths = rebalance.observed(sequences)
        epoch = self.gate.epoch  # before the record: a recovery after it makes this stale
        _, record = registry.load_record(self.name)
        events = list(record["events"])
        group = registry.group_of(record, self.index)
        group.names = _namer(record)

        def record_event(event: dict) -> None:
            recovery.add_event(events, event)
            registry.update(self.name, group, events)

        def adopt() -> None:  # in the gate: the engine takes the new pool once it opens
            self.group = group

        event = rebalance.rebalance(group, self.gate, lengths, record_event, epoch, adopt)
        if host is not None:
            host.engine.stats.rebalanced(event)
        return event

    def _rebalance_loop(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            host = self._host
            if self.failed or host is None:
                continue
            self._rebalancer.check(
                self.group.plan,
                host.engine.stats,
                lambda lengths: self.rebalance(lengths.sequences),
                lambda exc: print(f"load {self.name!r}: re-balance failed: {exc}", file=sys.stderr),
            )

    # metrics
    def _export_loop(self, interval_s: float) -> None:
        from coordinator.planning.planner import Plan
        from coordinator.runtime.telemetry import MetricsExporter, collect

        exporter = MetricsExporter()
        while True:
            time.sleep(interval_s)
            try:
                _, record = registry.load_record(self.name)
                stages = Plan.from_json(record["plan"]).stages
                refs = [
                    a.latest.remote() if a is not None else None
                    for a in registry.worker_handles(record)
                ]
                exporter.export(collect(stages, refs, EXPORT_TIMEOUT_S), record["events"])
                self._export_engine()
            except Exception as exc:  # keep publishing; say why this tick was skipped
                print(f"load {self.name!r}: export skipped: {exc}", file=sys.stderr)

    def _export_engine(self) -> None:
        from coordinator.engine.stats import EngineMetrics

        if self._engine_metrics is None:
            self._engine_metrics = EngineMetrics(self.index.root.name)
        if self._host is not None:
            self._engine_metrics.export(self._host.engine.stats)

    # the load's engine (coordinator.engine.host): every client of the load comes here
    def host(self) -> EngineHost:
        """The load's engine, started now if it is not yet (it claims the workers: it fails
        while one is lost, and starts with the first request after the recovery)."""
        with self._engine_lock:
            if self._host is None:
                self._host = EngineHost(
                    self._build_engine(), rebuild=self._build_engine, on_failed=self._engine_failed
                )
            return self._host

    def _build_engine(self, stats=None):
        return build_engine(
            lambda: self.group.handles,
            lambda: self.group.config,
            lambda: self.group.plan,
            recover=self._recover_after,
            gate=self.gate.inside,
            name=f"load-{self.name}",
            index=self.index,
            # the load's one engine (its keeper is a named actor): a restarted keeper's, or a
            # new one after this one's loop stopped, takes the workers over
            take_over=True,
            stats=stats,
        )

    def _engine_failed(self, why: str) -> None:
        """The load's engine stopped too often: the load is failed, its record says so."""
        _, record = registry.load_record(self.name)
        events = list(record["events"])
        recovery.add_event(events, {"event": "engine failed", "reason": why})
        registry.update(self.name, self.group, events)

    def health(self) -> str | None:
        """None while the load's engine serves; else why not."""
        if self.failed is not None:
            return f"load {self.name!r} failed: {self.failed}"
        try:
            return self.host().health()
        except Exception as exc:  # no engine could start (a worker lost, say)
            return f"the load's engine is not running: {exc}"

    def submit(self, client: str, rid: int, prompts: list[list[int]], **settings) -> None:
        self.host().submit(client, rid, prompts, **settings)

    def cancel(self, client: str, rid: int) -> None:
        self.host().cancel(client, rid)

    def fetch(self, client: str, wait_s: float):
        return self.host().fetch(client, wait_s)

    def stats(self) -> dict | None:
        if self._host is None:
            return None
        return {**self._host.stats(), "time": time.time()}

    def prometheus(self, model_name: str) -> str:
        return self.host().prometheus(model_name)

    def ping(self) -> bool:
        return True


def _namer(record: dict):
    """Actor names for new workers of the load: numbers after the last one the record lists."""
    counter = {"next": registry.next_worker_number(record)}

    def names(count: int) -> list[str]:
        first = counter["next"]
        counter["next"] += count
        return [registry.worker_name(record["name"], n) for n in range(first, first + count)]

    return names


def start(name: str, index: CheckpointIndex, lease_s: float | None = None) -> ray.actor.ActorHandle:
    """The keeper of load `name`, started once its record exists and its workers are loaded;
    with `lease_s`, it unloads the load when no `renew()` came for that long. Atomic: a start
    that is interrupted, or whose keeper does not come up, kills it (a detached, named actor
    left behind would hold the load's keeper name)."""
    keeper = LoadKeeper.options(
        name=keeper_name(name), namespace=NAMESPACE, lifetime="detached", **registry.on_head()
    ).remote(name, index, lease_s)
    try:
        ray.get(keeper.ping.remote(), timeout=registry.ATTACH_TIMEOUT_S)
    except BaseException:  # interrupted, or it never came up: no orphan keeps the name
        ray.kill(keeper, no_restart=True)
        raise
    return keeper


def find(name: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(keeper_name(name), namespace=NAMESPACE)
    except ValueError:
        return None
