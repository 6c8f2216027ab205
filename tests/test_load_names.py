"""What a named load holds through a keeper's start, stop and restart and a failed start
(issue 57 points 6 and 8): `unload` stops the keeper, and waits until it is gone, before it
lists what to remove, so a worker or placement group the keeper starts meanwhile is removed
too; a restarted keeper numbers new workers past every worker alive, recorded or not; a start
that fails gives back the placement group it reserved; an interrupted keeper start kills the
keeper; a clean-up sweep can keep the name claimed; the keeper's watch pings outside the gate
(and stops once the load is failed); replicas claim their names before the probe. No Ray: the cluster calls are stood in for, in the order they are made."""

from __future__ import annotations

import types

import pytest

from coordinator.runtime import record


class Cluster:
    """A cluster's named actors and placement groups of load "a"; its keeper, once asked to
    stop, still starts the replacement worker it was starting (as `ray.kill` only asks)."""

    def __init__(self) -> None:
        self.actors = {"load:a:record", "load:a:keeper", "load:a:w0", "load:a:w1"}
        self.groups = {"load:a:pg0": object()}
        self.killed: list[str] = []
        self.removed: list[object] = []

    def get_actor(self, name: str, namespace: str):
        if name not in self.actors:
            raise ValueError(name)
        return types.SimpleNamespace(name=name)

    def stop(self, actor) -> None:
        self.actors.add("load:a:w1-replacement")  # started as it was stopped
        self.groups["load:a:pg1"] = object()
        self.kill(actor)

    def remove_group(self, group) -> None:
        self.removed.append(group)
        self.groups = {name: g for name, g in self.groups.items() if g is not group}

    def kill(self, actor, no_restart: bool = True) -> None:
        self.killed.append(actor.name)
        self.actors.discard(actor.name)


def stand_in(monkeypatch, cluster: Cluster, *, stop) -> None:
    """`record`'s cluster calls answered by `cluster` (`stop`: how stopping an actor goes)."""
    monkeypatch.setattr(
        record, "ray", types.SimpleNamespace(get_actor=cluster.get_actor, kill=cluster.kill)
    )
    monkeypatch.setattr(record, "stop_actor", stop)
    monkeypatch.setattr(record, "record_name", lambda name: f"load:{name}:record")
    monkeypatch.setattr(record, "keeper_name", lambda name: f"load:{name}:keeper")
    monkeypatch.setattr(record, "worker_prefix", lambda name: f"load:{name}:w")
    monkeypatch.setattr(record, "named_actors", lambda: sorted(cluster.actors))
    monkeypatch.setattr(record, "named_groups", lambda name: dict(cluster.groups))
    monkeypatch.setattr(record, "remove_group", cluster.remove_group)
    monkeypatch.setattr(record, "release", lambda actor: cluster.actors.discard(actor.name))


def test_unload_stops_the_keeper_before_it_lists_what_to_remove(monkeypatch) -> None:
    cluster = Cluster()
    stand_in(monkeypatch, cluster, stop=cluster.stop)

    assert record.remove_all("a") == 3
    assert cluster.killed[0] == "load:a:keeper"
    assert "load:a:w1-replacement" in cluster.killed  # started by the keeper as it went
    assert len(cluster.removed) == 2  # both placement groups, the late one too
    assert cluster.actors == set()
    assert record.remove_all("a") is None  # nothing of it left


@pytest.mark.parametrize("keeper", [True, False])
def test_a_load_with_only_its_keeper_left_is_found(monkeypatch, keeper: bool) -> None:
    cluster = Cluster()
    cluster.actors = {"load:a:keeper"}
    cluster.groups = {}
    stand_in(monkeypatch, cluster, stop=cluster.kill)
    assert record.remove_all("a", keeper=keeper) == 0


def test_new_worker_names_pass_the_workers_alive_that_the_record_missed(monkeypatch) -> None:
    """A keeper restarted mid-recovery: the worker it started last (number 3) is alive but not
    in the record (which lists 0 and 2). The next name is 4, never 3 again (Ray refuses a name
    in use, forever)."""
    from coordinator.runtime import registry

    record_ = {
        "name": "a",
        "workers": [registry.worker_name("a", 0), None, registry.worker_name("a", 2)],
    }
    alive = [registry.worker_name("a", 3), registry.worker_name("b", 9), "other"]
    monkeypatch.setattr(registry, "named_actors", lambda: alive)
    assert registry.next_worker_number(record_) == 4
    monkeypatch.setattr(registry, "named_actors", lambda: [])
    assert registry.next_worker_number(record_) == 3
    assert registry.next_worker_number({"name": "a", "workers": []}) == 0


def test_the_keepers_watch_pings_outside_the_gate(monkeypatch) -> None:
    """Issue 57 point 8: the keeper's 5 s watch held the gate while it read the record and
    pinged every worker, so the engine's steps waited behind cluster-wide calls. It looks
    outside the gate now, and takes it only to recover what it found lost."""
    from coordinator.runtime import keeper as keeper_module
    from coordinator.runtime import registry
    from coordinator.runtime.gate import Gate

    gate = Gate()
    looked, recovered = [], []

    def stepping() -> bool:
        """Whether a step could pass the gate now (from another thread)."""
        import threading

        passed = []

        def step() -> None:
            with gate.inside():
                passed.append(True)

        thread = threading.Thread(target=step)
        thread.start()
        thread.join(timeout=2)
        return bool(passed)

    class Group:
        def __init__(self, dead) -> None:
            self.dead = dead

        def dead_stages(self):
            looked.append(stepping())  # a step passes while the watch pings
            return self.dead

    given_up = types.SimpleNamespace(failed="5 recoveries failed in a row")
    keeper_module.LoadKeeper.__ray_metadata__.modified_class._watch_once(given_up)  # no look
    for dead in ([], [1]):
        monkeypatch.setattr(registry, "load_record", lambda name: (None, {"name": name}))
        monkeypatch.setattr(registry, "group_of", lambda record, index, d=dead: Group(d))
        fake = types.SimpleNamespace(name="a", index=None, gate=gate, failed=None)
        fake.recover = lambda: recovered.append(True)
        keeper_module.LoadKeeper.__ray_metadata__.modified_class._watch_once(fake)
    assert looked == [True, True] and recovered == [True]  # recovered only what was lost


def test_a_failed_start_gives_back_the_gpus_it_reserved(monkeypatch) -> None:
    """Issue 57 point 6: a placement group reserved before a start that failed was never used
    nor removed (it held its GPUs from every later load). It is removed at once now, and the
    group forgets it."""
    from coordinator.runtime import group as group_module

    removed = []
    monkeypatch.setattr(group_module, "remove_group", removed.append)
    placement = object()
    workers = group_module.WorkerGroup.__new__(group_module.WorkerGroup)
    workers.config = workers.index = None
    workers.plan = types.SimpleNamespace(stages=(object(), object()))
    workers.placement_groups = [("load:a:pg-0", placement)]
    slots = [group_module.Slot(group=placement, bundle=i, group_name="load:a:pg-0") for i in (0, 1)]
    monkeypatch.setattr(group_module, "stage_specs", lambda *args: ["s0", "s1"])
    monkeypatch.setattr(workers, "_reserve", lambda stages: slots, raising=False)

    def failing(specs, stages, slots):
        raise RuntimeError("the actor could not be created")

    monkeypatch.setattr(workers, "_start", failing, raising=False)
    with pytest.raises(RuntimeError, match="could not be created"):
        workers.start({})
    assert removed == [placement] and workers.placement_groups == []


def test_a_sweep_that_keeps_the_record_keeps_the_name_claimed(monkeypatch) -> None:
    """Issue 57 point 6: launch_replicas stops a failed launch's loads by name, then sweeps
    again once its threads are done. The first sweep keeps each record, so no other load can
    claim the name in between and lose what it made to the second sweep."""
    cluster = Cluster()
    stand_in(monkeypatch, cluster, stop=cluster.kill)
    assert record.remove_all("a", keep_record=True) == 2
    assert cluster.actors == {"load:a:record"}  # the name: still claimed
    assert record.remove_all("a") == 0 and cluster.actors == set()


@pytest.mark.parametrize("failure", [KeyboardInterrupt, TimeoutError])
def test_a_keeper_start_that_is_interrupted_kills_the_keeper(monkeypatch, failure) -> None:
    """Issue 57 point 6: an interrupted keeper start left a detached keeper holding the
    load's keeper name. The start kills it, then raises."""
    from coordinator.runtime import keeper as keeper_module

    killed = []
    made = types.SimpleNamespace(ping=types.SimpleNamespace(remote=lambda: "ref"))
    options = types.SimpleNamespace(remote=lambda *args: made)
    monkeypatch.setattr(
        keeper_module, "LoadKeeper", types.SimpleNamespace(options=lambda **kw: options)
    )
    monkeypatch.setattr(keeper_module.registry, "on_head", lambda: {})

    def waited(ref, timeout):
        raise failure()

    monkeypatch.setattr(
        keeper_module,
        "ray",
        types.SimpleNamespace(get=waited, kill=lambda actor, no_restart: killed.append(actor)),
    )
    with pytest.raises(failure):
        keeper_module.start("a", index=None)
    assert killed == [made]


def _stand_in_launch(monkeypatch, claim, plans: int, started: list) -> list:
    """`launch_replicas` with the cluster stood in for: no Ray, no checkpoint; `claim` answers
    for the records; the search makes `plans` pipelines. Returns the calls, in order."""
    from coordinator.runtime import launch as launch_module

    calls: list = []

    def claimed(name):
        calls.append(("claim", name))
        return claim(name)

    def probe(*args, **kwargs):
        calls.append(("probe",))
        return None, {}

    def search(config, index, snapshot):
        calls.append(("plan",))
        options = types.SimpleNamespace(max_batch=1, micro_batches=1, pool_tokens=0)
        return types.SimpleNamespace(plans=[types.SimpleNamespace(options=options)] * plans)

    def start(config, index, plan, envs, session, load, progress, record, lease_s, turn, abandoned):
        started.append(load)
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(launch_module, "_checked_index", lambda config: object())
    session = types.SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(launch_module, "connect", lambda config: session)
    monkeypatch.setattr(launch_module, "RaySession", lambda owned: session)
    monkeypatch.setattr(launch_module, "model_of", lambda index, config: None)
    monkeypatch.setattr(launch_module.registry, "claim", claimed)
    monkeypatch.setattr(
        launch_module.registry, "release", lambda rec: calls.append(("release", rec.name))
    )
    monkeypatch.setattr(
        launch_module.registry,
        "forget",
        lambda load, keep_record=False: calls.append(("forget", load, keep_record)),
    )
    monkeypatch.setattr(launch_module, "probe_cluster", probe)
    monkeypatch.setattr(launch_module, "plan_replicas", search)
    monkeypatch.setattr(launch_module.recovery, "nodes_of", lambda plan: "n=1")
    monkeypatch.setattr(launch_module, "_start", start)

    class Turn:  # the desk's turn, without Ray's key-value store
        def __init__(self, what: str) -> None:
            self.parts = 1

        def __enter__(self):
            calls.append(("turn",))
            return self

        def __exit__(self, *exc) -> None:
            pass

        def reserved_elsewhere(self) -> dict:
            return {}

    monkeypatch.setattr(launch_module, "Turn", Turn)
    return calls


def test_replicas_claim_their_names_before_the_probe(monkeypatch) -> None:
    """Issue 57 point 6: `launch_replicas` probed and planned before it claimed its names, so
    a clash was found only after the cluster was probed, and another load could take a name
    meanwhile. Now every name is claimed first; one taken fails before any probe, and what
    was claimed goes back."""
    from coordinator.config import ConfigError, JobConfig
    from coordinator.runtime.launch import launch_replicas

    def claim(name):
        if name == "m-1":
            raise ConfigError("a load named 'm-1' exists")
        return types.SimpleNamespace(name=name)

    calls = _stand_in_launch(monkeypatch, claim, plans=2, started=[])
    with pytest.raises(ConfigError, match="'m-1' exists"):
        launch_replicas(JobConfig(checkpoint="c", replicas=2, objective="throughput"), "m")
    assert calls == [
        ("claim", "m-0"),
        ("claim", "m-1"),
        ("forget", "m-0", True),
        ("forget", "m-0", False),
    ]


def test_an_automatic_replica_count_holds_the_name_until_it_is_known(monkeypatch) -> None:
    """With replicas 0 the search sets the count: the name itself is claimed before the probe,
    then each replica's, and the name is given back (by its handle) once they are held."""
    from coordinator.config import JobConfig
    from coordinator.runtime.launch import launch_replicas

    started: list = []
    calls = _stand_in_launch(monkeypatch, lambda n: types.SimpleNamespace(name=n), 2, started)
    launch_replicas(JobConfig(checkpoint="c", replicas=0, objective="throughput"), "m")
    assert calls == [
        ("claim", "m"),
        ("turn",),
        ("probe",),
        ("plan",),
        ("claim", "m-0"),
        ("claim", "m-1"),
        ("release", "m"),
    ]
    assert sorted(started) == ["m-0", "m-1"]
    calls.clear()
    started.clear()
    monkeypatch.setattr(  # one pipeline: the name itself is the load
        __import__("coordinator.runtime.launch", fromlist=["x"]),
        "plan_replicas",
        lambda *a: types.SimpleNamespace(
            plans=[
                types.SimpleNamespace(
                    options=types.SimpleNamespace(max_batch=1, micro_batches=1, pool_tokens=0)
                )
            ]
        ),
    )
    launch_replicas(JobConfig(checkpoint="c", replicas=0, objective="throughput"), "m")
    assert calls == [("claim", "m"), ("turn",), ("probe",)] and started == ["m"]
