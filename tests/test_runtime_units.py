"""A named load's keeper (coordinator/runtime/keeper.py), its lease holder (lease.py) and its
record (record.py), each driven in process: the plain classes Ray wraps, with the cluster they
talk to stood in for (the record's actor, the registry's calls, Ray's kill and get) and, where
they pace themselves by the clock, a clock the test moves. No Ray is started.

What the callers rely on: a leased keeper unloads its load once, and only once, no renewal came
for `lease_s`, alone in the gate, and ends itself last; a holder renews exactly its loads
within each lease and goes on after a failed renewal; a step that failed is recovered unless
the workers changed since, and otherwise raised by kind; recoveries that keep failing fail the
load (in its record), a success makes it loaded again; a node that keeps losing workers is
left out; a record whose loader died mid-load removes what the load made; `stop_actor`
returns once the actor is gone, bounded."""

from __future__ import annotations

import threading
import types

import pytest
import ray

from coordinator.engine.pipelines import StepTimeoutError
from coordinator.runtime import keeper as keeper_module
from coordinator.runtime import lease as lease_module
from coordinator.runtime import record, recovery, registry
from coordinator.runtime.errors import WorkerLostError
from coordinator.runtime.keeper import MAX_FAILED_RECOVERIES, NODE_LOSS_LIMIT, NODE_LOSS_WINDOW_S

WAIT_S = 60.0  # bound on what a test waits for; never reached when the code is right
Keeper = keeper_module.LoadKeeper.__ray_metadata__.modified_class
Record = record.LoadRecord.__ray_metadata__.modified_class


def _functions_in(value) -> list:
    """The functions a class attribute runs: itself, and those its closure holds (Ray wraps
    each method of an actor class in a tracing function that holds the method)."""
    found, todo = [], [value]
    while todo:
        item = todo.pop()
        if isinstance(item, (staticmethod, classmethod)):
            item = item.__func__
        if isinstance(item, types.FunctionType) and item not in found:
            found.append(item)
            todo += [cell.cell_contents for cell in item.__closure__ or ()]
    return found


def stand_in(monkeypatch, module: types.ModuleType, name: str, value) -> None:
    """`module.name` is `value` for the test: in the module, and in each copy of its globals
    that a method of the keeper or the record reads. A copy exists once this process has
    called `ray.get_actor` on an actor of a class it exported (another test's load): Ray
    loads the class from the GCS, and cloudpickle, knowing the class, sets the unpickled
    methods on it, each with globals of its own; the module's no longer reach them."""
    monkeypatch.setattr(module, name, value)
    for actor_class in (Keeper, Record):
        for cls in actor_class.__mro__[:-1]:
            for attribute in vars(cls).values():
                for function in _functions_in(attribute):
                    globals_ = function.__globals__
                    if globals_ is vars(module) or name not in globals_:
                        continue
                    if globals_.get("__name__") == module.__name__:
                        monkeypatch.setitem(globals_, name, value)


class Clock:
    """time.monotonic and time.sleep of a module: a sleep moves the clock on at once, then
    calls `on_sleep(now)` (what happens meanwhile). Too many sleeps: the loop never ended."""

    def __init__(self, on_sleep=lambda now: None, limit: int = 10_000) -> None:
        self.now = 1000.0
        self.on_sleep, self.limit = on_sleep, limit
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        if self.sleeps > self.limit:
            raise AssertionError(f"still looping after {self.limit} sleeps (t={self.now:g})")
        self.now += seconds
        self.on_sleep(self.now)


# --- the keeper -------------------------------------------------------------------------------


class Group:
    """A load's WorkerGroup as the keeper uses it: the stages found lost, hung workers killed."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.handles = cluster.handles
        self.names = None

    def dead_stages(self) -> list[int]:
        self.cluster.log.append("looked")
        return list(self.cluster.dead)

    def kill_hung(self) -> None:
        self.cluster.log.append("killed hung")


class Cluster:
    """What the keeper reaches through the registry and the recovery policy: the load's record
    (read, updated), its workers (which are lost), and the recoveries it asks for (each fails
    with `failing` while set, else replaces the lost workers)."""

    def __init__(self, monkeypatch, *, state: str = "loaded", events=()) -> None:
        self.record = {"name": "a", "state": state, "events": list(events), "workers": []}
        self.handles = [
            types.SimpleNamespace(name=f"load:a:worker-{i}", node_id="n1", hostname="host-1")
            for i in range(2)
        ]
        self.dead: list[int] = []
        self.failing: Exception | None = None
        self.log: list = []
        self.recoveries: list[tuple[list[int], frozenset]] = []
        config = types.SimpleNamespace(
            watch_interval_s=0, snapshot_interval_s=0, rebalance_interval_s=0
        )
        monkeypatch.setattr(registry, "load_record", lambda name: (None, self._read(name)))
        monkeypatch.setattr(registry, "config_of", lambda rec: config)
        monkeypatch.setattr(registry, "group_of", lambda rec, index: Group(self))
        monkeypatch.setattr(registry, "update", self._update)
        monkeypatch.setattr(registry, "next_worker_number", lambda rec: 7)
        monkeypatch.setattr(recovery, "recover", self._recover)

        def no_engine(*args, **kwargs):
            raise WorkerLostError("no engine in these tests")

        stand_in(monkeypatch, keeper_module, "build_engine", no_engine)

    def _read(self, name: str) -> dict:
        assert name == "a"
        return {**self.record, "events": list(self.record["events"])}

    def _update(self, name, group, events, state=None) -> None:
        self.record["events"] = list(events)
        if state is not None:
            self.record["state"] = state
            self.log.append(("state", state))

    def _recover(self, group, record_event, *, dead, left_out) -> None:
        self.recoveries.append((list(dead), left_out))
        if self.failing is not None:
            record_event({"event": "recovery failed", "error": str(self.failing)})
            raise self.failing
        record_event({"event": "replaced workers", "stages": list(dead)})
        self.dead = []

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.record["events"] if e["event"] == kind]


def test_a_leased_keeper_unloads_once_no_renewal_came_for_lease_s(monkeypatch) -> None:
    """Renewals push the end of the lease; once none came for `lease_s` the load is unloaded
    (by name, the keeper not stopped by it: it ends itself), with no step in the gate, and
    the keeper kills itself last."""
    Cluster(monkeypatch)
    lease_s, renewals = 10.0, (1005.0, 1012.0)
    calls: list = []
    keeper = None

    def on_sleep(now: float) -> None:
        if now in renewals:
            keeper.renew()  # the holder's renewal comes in meanwhile
            calls.append(("renewed", now))

    clock = Clock(on_sleep, limit=200)
    stand_in(monkeypatch, keeper_module, "time", clock)

    def unload(name: str, *, keeper: bool) -> None:
        calls.append(("unload", name, keeper, clock.now, gate._alone == threading.get_ident()))

    monkeypatch.setattr(registry, "unload", unload)
    me = object()
    stand_in(
        monkeypatch,
        keeper_module,
        "ray",
        types.SimpleNamespace(
            get_runtime_context=lambda: types.SimpleNamespace(current_actor=me),
            kill=lambda actor, no_restart: calls.append(("kill", actor is me, no_restart)),
        ),
    )
    keeper = Keeper("a", index=None)  # its lease starts now (t=1000): run here, not on a thread
    gate = keeper.gate
    keeper._lease_loop(lease_s)

    assert calls[:2] == [("renewed", 1005.0), ("renewed", 1012.0)]
    (_, name, stops_keeper, when, alone) = calls[2]
    assert (name, stops_keeper, alone) == ("a", False, True)
    assert lease_s < when - renewals[-1] <= lease_s + keeper_module.LEASE_POLL_S
    assert calls[3:] == [("kill", True, True)]  # itself, for good, after the rest


def test_a_keeper_whose_unload_failed_still_ends_itself(monkeypatch) -> None:
    Cluster(monkeypatch)
    stand_in(monkeypatch, keeper_module, "time", Clock(limit=200))
    killed: list = []

    def unload(name: str, *, keeper: bool) -> None:
        raise RuntimeError("placement group table unavailable")

    monkeypatch.setattr(registry, "unload", unload)
    stand_in(
        monkeypatch,
        keeper_module,
        "ray",
        types.SimpleNamespace(
            get_runtime_context=lambda: types.SimpleNamespace(current_actor="me"),
            kill=lambda actor, no_restart: killed.append(actor),
        ),
    )
    keeper = Keeper("a", index=None, lease_s=None)  # no lease thread: the loop runs here
    with pytest.raises(RuntimeError, match="placement group table unavailable"):
        keeper._lease_loop(2.0)
    assert killed == ["me"]


def test_a_failed_step_is_recovered_unless_the_workers_changed_since(monkeypatch) -> None:
    """`_recover_after(exc, epoch)`: a step of an older epoch found its workers already
    replaced (nothing is looked at again); a step that timed out has its hung workers killed
    before the look; a recovery that replaced workers opens a new epoch."""
    cluster = Cluster(monkeypatch)
    keeper = Keeper("a", index=None)
    keeper.gate.epoch = 3
    keeper._recover_after(RuntimeError("stale"), 2)
    assert cluster.log == [] and keeper.gate.epoch == 3

    cluster.dead = [1]
    keeper._recover_after(StepTimeoutError("stage 1 did not answer"), 3)
    assert cluster.log == ["killed hung", "looked"]
    assert cluster.recoveries == [([1], frozenset())] and keeper.gate.epoch == 4
    assert cluster.events("replaced workers")[0]["stages"] == [1]


def test_a_step_that_failed_by_itself_is_raised_by_kind(monkeypatch) -> None:
    """Nothing lost: a Ray error of the workers is a LaunchError kind naming the hosts (a
    worker that died is WorkerLostError), any other error is raised as it is."""
    cluster = Cluster(monkeypatch)
    keeper = Keeper("a", index=None)
    with pytest.raises(WorkerLostError, match=r"a worker died \(on host-1\)"):
        keeper._recover_after(ray.exceptions.RayActorError(), 0)
    bad = ValueError("row 2 has no token to choose")
    with pytest.raises(ValueError) as caught:
        keeper._recover_after(bad, 0)
    assert caught.value is bad
    assert cluster.recoveries == [] and keeper.gate.epoch == 0


def test_recoveries_that_keep_failing_fail_the_load_and_one_that_succeeds_loads_it(
    monkeypatch,
) -> None:
    """MAX_FAILED_RECOVERIES failures in a row (a success between starts the count again) fail
    the load: its record says so with the last error, and `health` says why; a recovery that
    succeeds later makes the load loaded again."""
    cluster = Cluster(monkeypatch)
    keeper = Keeper("a", index=None)
    cluster.dead = [0]
    cluster.failing = RuntimeError("what is left cannot hold the model")
    for _ in range(MAX_FAILED_RECOVERIES - 1):
        with pytest.raises(RuntimeError):
            keeper.recover()
    cluster.failing = None
    assert keeper.recover() == [0]  # a success: the count starts again
    cluster.dead = [1]
    cluster.failing = RuntimeError("out of memory on host-1")
    for _ in range(MAX_FAILED_RECOVERIES - 1):
        with pytest.raises(RuntimeError):
            keeper.recover()
    assert keeper.failed is None and cluster.record["state"] == "loaded"
    with pytest.raises(RuntimeError):
        keeper.recover()
    reason = (
        f"{MAX_FAILED_RECOVERIES} recoveries failed in a row, the last: out of memory on host-1"
    )
    assert keeper.failed == reason and cluster.record["state"] == "failed"
    assert [e["reason"] for e in cluster.events("load failed")] == [reason]
    assert keeper.health() == f"load 'a' failed: {reason}"

    cluster.failing = None
    assert keeper.recover() == [1]
    assert keeper.failed is None and cluster.record["state"] == "loaded"
    assert [entry for entry in cluster.log if entry[0] == "state"] == [
        ("state", "failed"),
        ("state", "loaded"),
    ]


def test_a_restarted_keeper_keeps_its_loads_failure(monkeypatch) -> None:
    events = [
        {"event": "load failed", "reason": "old"},
        {"event": "load failed", "reason": "the last"},
    ]
    Cluster(monkeypatch, state="failed", events=events)
    assert Keeper("a", index=None).failed == "the last"


def test_a_node_that_keeps_losing_workers_is_left_out(monkeypatch) -> None:
    """NODE_LOSS_LIMIT losses on one node within NODE_LOSS_WINDOW_S: the next recovery plans
    without it, and an event names its host. A loss whose recovery is retried counts once,
    and losses further apart than the window do not add up."""
    clock = Clock()
    stand_in(monkeypatch, keeper_module, "time", clock)
    cluster = Cluster(monkeypatch)
    keeper = Keeper("a", index=None)

    def lose(stage: int, name: str) -> None:
        cluster.handles[stage] = types.SimpleNamespace(name=name, node_id="n1", hostname="host-1")
        cluster.dead = [stage]

    start = clock.now
    lose(0, "w0")
    cluster.failing = RuntimeError("no room yet")
    for _ in range(NODE_LOSS_LIMIT + 1):  # the same loss, its recovery retried: one loss
        with pytest.raises(RuntimeError):
            keeper.recover()
    cluster.failing = None
    keeper.recover()
    clock.now = start + 0.7 * NODE_LOSS_WINDOW_S
    for i in range(1, NODE_LOSS_LIMIT - 1):  # one loss short of the limit, within the window
        lose(i % 2, f"w{i}")
        keeper.recover()
    assert cluster.events("node left out") == []
    assert {left_out for _, left_out in cluster.recoveries} == {frozenset()}

    clock.now = start + 1.2 * NODE_LOSS_WINDOW_S  # w0's loss is out of the window now
    lose(0, "late")
    keeper.recover()
    assert cluster.events("node left out") == []
    lose(1, "later")  # the limit, within the window
    keeper.recover()
    (event,) = cluster.events("node left out")
    assert event["hosts"] == ["host-1"] and str(NODE_LOSS_LIMIT) in event["reason"]
    assert cluster.recoveries[-1][1] == frozenset({"n1"})


# --- the lease holder ------------------------------------------------------------------------


class Keepers:
    """The loads on the cluster and their keepers' renew calls; `ray.get` of those calls
    fails as `failures` says (one entry per call: an exception or None), then succeeds."""

    def __init__(self, monkeypatch, loads: list[str], *, connected: bool = True) -> None:
        self.loads = loads
        self.without_keeper: set[str] = set()
        self.found: list[str] = []
        self.renewed: list[str] = []
        self.gets: list[tuple[list, float]] = []
        self.failures: list[Exception | None] = []
        self.answered = threading.Event()
        self.answers, self.wanted_answers = 0, 0
        monkeypatch.setattr(registry, "list_loads", lambda: list(self.loads))
        monkeypatch.setattr(lease_module.keeper, "find", self._find)
        monkeypatch.setattr(
            lease_module,
            "ray",
            types.SimpleNamespace(is_initialized=lambda: connected, get=self._get),
        )

    def _find(self, name: str):
        self.found.append(name)
        if name in self.without_keeper:
            return None
        renew = types.SimpleNamespace(remote=lambda: self.renewed.append(name) or name)
        return types.SimpleNamespace(renew=renew)

    def _get(self, refs: list, timeout: float) -> list:
        self.gets.append((list(refs), timeout))
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        self.answers += 1
        if self.answers >= self.wanted_answers:
            self.answered.set()
        return [None] * len(refs)


def test_a_lease_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"lease_s=0 must be positive"):
        lease_module.LeaseHolder("m", 0)


def test_a_holder_renews_its_loads_and_only_those(monkeypatch) -> None:
    """The loads named `name` or `name-<replica>`, not another load whose name begins the same;
    a load whose keeper is not up yet is left for a later renewal; keepers found once are kept;
    the answers are waited for, bounded. Before Ray is connected, nothing."""
    keepers = Keepers(monkeypatch, ["m", "m-0", "m-1", "m-x", "mm", "m-1-0", "other"])
    keepers.without_keeper = {"m-1"}
    with lease_module.LeaseHolder("m", lease_s=3600) as holder:  # its thread never renews
        assert holder.renew(timeout_s=7.5) == 2
        assert keepers.renewed == ["m", "m-0"] and keepers.gets == [(["m", "m-0"], 7.5)]
        keepers.without_keeper = set()
        assert holder.renew(timeout_s=7.5) == 3
        assert keepers.found == ["m", "m-0", "m-1", "m-1"]  # looked up until found, once
        assert keepers.renewed[2:] == ["m", "m-0", "m-1"]
    assert not holder._thread.is_alive()  # closed: no renewal after

    unconnected = Keepers(monkeypatch, ["m"], connected=False)
    with lease_module.LeaseHolder("m", lease_s=3600) as holder:
        assert holder.renew(timeout_s=1.0) == 0
    assert unconnected.found == unconnected.gets == []


def test_a_holder_renews_within_each_lease_and_goes_on_after_a_failed_renewal(
    monkeypatch, capsys
) -> None:
    """Its thread renews every lease_s / RENEWALS_PER_LEASE, each renewal bounded by that
    interval; one that fails (a keeper restarted) is said, its keepers are looked up again,
    and the next renewal goes on."""
    keepers = Keepers(monkeypatch, ["m"])
    keepers.failures = [ray.exceptions.RayActorError()]
    keepers.wanted_answers = 2  # the failed renewal, then two that were answered
    lease_s = 0.3
    holder = lease_module.LeaseHolder("m", lease_s=lease_s)
    try:
        assert keepers.answered.wait(WAIT_S), "no renewal after the failed one"
    finally:
        holder.close()
    assert not holder._thread.is_alive()
    interval_s = lease_s / lease_module.RENEWALS_PER_LEASE
    assert {timeout for _, timeout in keepers.gets} == {interval_s}
    assert keepers.found[:2] == ["m", "m"]  # found again after the failure
    assert "lease of 'm': renewal failed" in capsys.readouterr().err


# --- the record ------------------------------------------------------------------------------


class Actor:
    """An actor that `ray.kill` only asks to go: it answers `answers` (True: ready, False:
    too busy to answer in time) first, then is gone."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.__ray_ready__ = types.SimpleNamespace(remote=lambda: "ready?")


def _stand_in_ray(monkeypatch, actor: Actor | None = None, **util) -> None:
    def kill(handle, no_restart: bool) -> None:
        handle.calls.append(f"kill no_restart={no_restart}")

    def get(ref, timeout: float):
        actor.calls.append("asked")
        if not actor.answers:
            raise ray.exceptions.RayActorError()
        if not actor.answers.pop(0):
            raise ray.exceptions.GetTimeoutError("busy")
        return None

    stand_in(
        monkeypatch,
        record,
        "ray",
        types.SimpleNamespace(
            kill=kill,
            get=get,
            exceptions=ray.exceptions,
            util=types.SimpleNamespace(**util),
            PlacementGroupID=ray.PlacementGroupID,
        ),
    )


def test_stop_actor_kills_then_returns_once_the_actor_is_gone(monkeypatch) -> None:
    clock = Clock()
    stand_in(monkeypatch, record, "time", clock)
    actor = Actor([True, False, True])
    _stand_in_ray(monkeypatch, actor)
    record.stop_actor(actor)
    assert actor.calls == ["kill no_restart=True"] + ["asked"] * 4  # the 4th: gone
    assert clock.now - 1000.0 < record.STOP_WAIT_S


def test_stop_actor_gives_up_on_an_actor_that_never_goes(monkeypatch) -> None:
    clock = Clock(limit=1000)
    stand_in(monkeypatch, record, "time", clock)
    actor = Actor([True] * 10_000)
    _stand_in_ray(monkeypatch, actor)
    record.stop_actor(actor, timeout_s=3.0)
    assert 3.0 <= clock.now - 1000.0 < 3.0 + 2 * record.STOP_POLL_S
    assert actor.calls[0] == "kill no_restart=True"


def test_a_loads_actors_and_groups_are_found_by_its_name_alone(monkeypatch) -> None:
    """Our namespace only; a load's placement groups, not another load's whose name begins the
    same, nor removed ones; a group's load read back from its name."""
    ids = {name: bytes([i + 1]) * 18 for i, name in enumerate(["a0", "a1", "ab", "gone", "x"])}
    table = {
        ids["a0"].hex(): {"name": "load:a:pg-0", "state": "CREATED"},
        ids["a1"].hex(): {"name": "load:a:pg-1", "state": "PENDING"},
        ids["ab"].hex(): {"name": "load:ab:pg-0", "state": "CREATED"},
        ids["gone"].hex(): {"name": "load:a:pg-2", "state": "REMOVED"},
        ids["x"].hex(): {"state": "CREATED"},  # unnamed
    }
    actors = [
        {"name": "load:a", "namespace": record.NAMESPACE},
        {"name": "load:a:keeper", "namespace": record.NAMESPACE},
        {"name": "load:a:worker-0", "namespace": "someone-else"},
    ]
    _stand_in_ray(
        monkeypatch,
        placement_group_table=lambda: table,
        list_named_actors=lambda all_namespaces: actors if all_namespaces else [],
    )
    groups = record.named_groups("a")
    assert sorted(groups) == ["load:a:pg-0", "load:a:pg-1"]
    assert groups["load:a:pg-1"].id.binary() == ids["a1"]
    assert record.named_actors() == ["load:a", "load:a:keeper"]
    assert [record.load_of_group(n) for n in ("load:a:pg-0", "load:a-1:pg-12")] == ["a", "a-1"]
    assert [record.load_of_group(n) for n in ("load:a", "other:pg-1", "pg-1")] == [None] * 3


def test_a_driver_is_alive_unless_the_job_table_says_it_is_dead(monkeypatch) -> None:
    from ray._private import state

    jobs = [{"JobID": "01", "IsDead": True}, {"JobID": "02", "IsDead": False}]
    monkeypatch.setattr(state, "jobs", lambda: jobs)
    assert [record.driver_alive(j) for j in ("01", "02", "03")] == [False, True, True]


def test_a_record_whose_loader_died_mid_load_removes_what_the_load_made(monkeypatch, capsys):
    """The record owns a load while it loads: once the loading process is gone (the job table
    says so) it removes the load, once; a check that fails is said and made again later; a
    load that finished is its keeper's, and the record's watch ends."""
    removed: list[str] = []
    alive = iter([True, RuntimeError("GCS unavailable"), False])

    def driver_alive(job_id: str) -> bool:
        answer = next(alive)
        if isinstance(answer, Exception):
            raise answer
        return answer

    stand_in(monkeypatch, record, "driver_alive", driver_alive)
    stand_in(monkeypatch, record, "remove_all", removed.append)
    stand_in(monkeypatch, record, "time", Clock(limit=50))
    loading = Record({"name": "a", "state": "loading"})  # no owner: no watch thread
    loading.update({"owner_job": "01"})
    loading._watch_loader()
    assert removed == ["a"]
    assert "load 'a': cannot check its loader: GCS unavailable" in capsys.readouterr().err

    loaded = Record({"name": "b", "state": "loading"})
    loaded.update({"owner_job": "02"})
    clock = Clock(lambda now: loaded.update({"state": "loaded"}), limit=50)
    stand_in(monkeypatch, record, "time", clock)
    # its loader finished the load, then ended: not a loader that died mid-load
    stand_in(monkeypatch, record, "driver_alive", lambda job_id: False)
    loaded._watch_loader()  # once loaded, the watch ends
    assert removed == ["a"] and loaded.get()["state"] == "loaded"


def test_a_load_that_finished_while_its_loader_was_looked_at_is_not_removed(monkeypatch):
    """The loader finishes the load and exits while the record asks the job table about it:
    its state is read again once the loader is known gone, and a loaded load stays. Found by
    this file: the load was removed, keeper and all."""
    removed: list[str] = []
    finishing = Record({"name": "a", "state": "loading"})
    finishing.update({"owner_job": "01"})

    def driver_alive(job_id: str) -> bool:
        finishing.update({"state": "loaded"})  # meanwhile: loaded, and its loader ended
        return False

    stand_in(monkeypatch, record, "driver_alive", driver_alive)
    stand_in(monkeypatch, record, "remove_all", removed.append)
    stand_in(monkeypatch, record, "time", Clock(limit=50))
    finishing._watch_loader()
    assert removed == []


def test_a_record_made_by_a_loader_watches_it_on_a_thread(monkeypatch) -> None:
    gone = threading.Event()
    stand_in(monkeypatch, record, "time", Clock(limit=50))
    stand_in(monkeypatch, record, "driver_alive", lambda job_id: False)
    stand_in(monkeypatch, record, "remove_all", lambda name: gone.set())
    Record({"name": "a", "state": "loading", "owner_job": "01"})
    assert gone.wait(WAIT_S), "the record never looked at its loader"


def test_releasing_what_is_already_gone_is_no_error(monkeypatch, capsys) -> None:
    def fails(*args, **kwargs):
        raise ValueError("no such placement group")

    stand_in(monkeypatch, record, "remove_placement_group", fails)
    stand_in(monkeypatch, record, "ray", types.SimpleNamespace(kill=fails))
    record.remove_group(types.SimpleNamespace(id=types.SimpleNamespace(hex=lambda: "abcdef0123")))
    record.release(object())
    assert "note: could not remove placement group abcdef01" in capsys.readouterr().err
