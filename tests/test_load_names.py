"""What a named load holds through a keeper's start, stop and restart and a failed start
(issue 57 points 6 and 8): `unload` stops the keeper, and waits until it is gone, before it
lists what to remove, so a worker or placement group the keeper starts meanwhile is removed
too; a restarted keeper numbers new workers past every worker alive, recorded or not; a start
that fails gives back the placement group it reserved; an interrupted keeper start kills the
keeper; a clean-up sweep can keep the name claimed; the keeper's watch pings outside the gate.
No Ray: the cluster calls are stood in for, in the order they are made."""

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

    for dead in ([], [1]):
        monkeypatch.setattr(registry, "load_record", lambda name: (None, {"name": name}))
        monkeypatch.setattr(registry, "group_of", lambda record, index, d=dead: Group(d))
        fake = types.SimpleNamespace(name="a", index=None, gate=gate)
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
