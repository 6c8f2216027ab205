"""Named loads: a loaded model that outlives the command that loaded it.

`offloadctl load --name NAME` first claims the name: it creates the load's record, a detached
actor named `load:NAME`, which Ray creates once per name (a second load of that name fails at
once, whatever it was doing). Then it starts its workers as detached, named actors in our
namespace, in detached, named placement groups (`load:NAME:pg-N`), and fills the record in
(config, plan, worker names, their bundles, events); `run`, `status` and `unload` attach to them
by name, `list` shows what is loaded. A load that fails releases what it made (its group and its
record), never what another load of the name made. On the embedded Ray they die with the
process.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import ray

from coordinator.config import JobConfig, job_config_from_dict
from coordinator.runtime.record import (
    NAMESPACE,
    RECORD_PREFIX,
    LoadRecord,
    named_actors,
    named_groups,
    record_name,
    release,
    remove_all,
    worker_prefix,
)
from offload.errors import ConfigError, NotFoundError

if TYPE_CHECKING:  # `group_of` imports it: `offloadctl list` and `unload` need no worker code
    from coordinator.runtime.group import WorkerGroup

ATTACH_TIMEOUT_S = 60.0
HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class LoadNotFoundError(NotFoundError):
    """No load of that name on the cluster."""


def worker_name(name: str, number: int) -> str:
    """Actor name of worker `number` of load `name`. Numbers are never reused within a load: a
    worker keeps its name when a re-plan gives it another stage, a replacement gets a new one;
    the record lists them in stage order."""
    return f"{worker_prefix(name)}{number}"


class LoadingError(ConfigError):
    """The load of that name is still loading (its record has no plan yet)."""


def check_name(name: str) -> None:
    if not name or ":" in name or "/" in name:
        raise ConfigError(f"load name {name!r} must be non-empty, without ':' or '/'")


def claim(name: str) -> ray.actor.ActorHandle:
    """The name `name` for a new load: its record, created at once and atomically (Ray creates
    one actor per name), in state "loading" until `store` fills it in. Raises ConfigError when
    another load has the name, loaded or loading."""
    check_name(name)
    record = {
        "name": name,
        "state": "loading",
        "workers": [],
        "slots": [],
        "events": [],
        "owner_job": ray.get_runtime_context().get_job_id(),  # the loader, watched (LoadRecord)
    }
    # On the head node: a worker node may leave with the record's process, the head may not.
    try:
        actor = LoadRecord.options(
            name=record_name(name), namespace=NAMESPACE, lifetime="detached", **on_head()
        ).remote(record)
    except ValueError:  # ActorAlreadyExistsError: the name is taken
        raise ConfigError(
            f"a load named {name!r} already exists or is loading; unload it "
            f"(offloadctl unload {name}) or choose another name"
        ) from None
    try:
        ray.get(actor.get.remote(), timeout=ATTACH_TIMEOUT_S)  # it exists before anything else
    except BaseException:
        release(actor)
        raise
    return actor


def _state(group: WorkerGroup) -> dict:
    """What the record keeps of a group: plan, worker names and bundles, in stage order."""
    return {
        "plan": group.plan.to_json(),
        "workers": [h.name for h in group.handles],
        "slots": [[h.slot.group_name, h.slot.bundle] if h.slot else None for h in group.handles],
    }


def store(
    record: ray.actor.ActorHandle,
    config: JobConfig,
    group: WorkerGroup,
    events: list[dict],
    *,
    state: str,
) -> None:
    """Fill in a claimed record: the group's config, plan, workers and bundles, and `state`
    ("loading" while its workers load, "loaded" once its keeper runs)."""
    changes = {"config": _config_dict(config), **_state(group), "events": events, "state": state}
    ray.get(record.update.remote(changes), timeout=ATTACH_TIMEOUT_S)


def on_head() -> dict:
    """Actor options that place it on the head node (a sliver of its marker resource)."""
    if any(HEAD_RESOURCE in node["Resources"] for node in ray.nodes() if node["Alive"]):
        return {"resources": {HEAD_RESOURCE: 0.001}}
    return {}  # no head marker reported: anywhere


def next_worker_number(record: dict) -> int:
    """The first worker number no worker of the load has used: past those its record lists
    and those alive on the cluster (a worker a recovery started and did not get to record: a
    keeper restarted mid-recovery must not take its name again, which Ray refuses forever)."""
    prefix = worker_prefix(record["name"])
    alive = [n for n in named_actors() if n.startswith(prefix)]
    names = [n for n in record["workers"] if n] + alive
    return 1 + max((int(n.rpartition("-")[2]) for n in names), default=-1)


def update(name: str, group: WorkerGroup, events: list[dict], state: str | None = None) -> None:
    """After a recovery: the group's new plan, workers and bundles, its config (a replica's GPUs
    change with its plan), the events, and its `state` when given ("failed" when its keeper
    gave up recovering it, "loaded" again after; waits, so a later attach sees them)."""
    actor, _ = load_record(name)
    changes = {**_state(group), "config": _config_dict(group.config), "events": events}
    if state is not None:
        changes["state"] = state
    ray.get(actor.update.remote(changes), timeout=ATTACH_TIMEOUT_S)


def group_of(record: dict, index) -> WorkerGroup:
    """The named load's WorkerGroup as its record describes it: its workers (None for one that
    is gone) in their bundles, and every placement group of the load."""
    from coordinator.planning.planner import Plan
    from coordinator.runtime.group import Slot, WorkerGroup, WorkerHandle, stage_specs
    from coordinator.runtime.probing import node_envs

    config = config_of(record)
    the_plan = Plan.from_json(record["plan"])
    groups = named_groups(record["name"])
    # each worker's env as the job gives it on its node: a replacement starts with it too
    envs = node_envs(config, (s.node_id for s in the_plan.stages))
    specs = stage_specs(config, index, the_plan, envs)
    slots = record.get("slots") or [None] * len(specs)
    handles = []
    rows = zip(
        worker_handles(record), specs, the_plan.stages, record["workers"], slots, strict=True
    )
    for actor, spec, stage, actor_name, slot in rows:
        place = (
            Slot(group=groups.get(slot[0]), group_name=slot[0], bundle=slot[1]) if slot else None
        )
        handles.append(
            WorkerHandle(
                actor=actor,
                spec=spec,
                node_id=stage.node_id,
                hostname=stage.hostname,
                name=actor_name,
                slot=place,
            )
        )
    return WorkerGroup(
        config=config,
        index=index,
        plan=the_plan,
        handles=handles,
        load_name=record["name"],
        placement_groups=list(groups.items()),
    )


def _config_dict(config: JobConfig) -> dict:
    data = dataclasses.asdict(config)
    data["overrides"] = [  # the criteria given only: a job file's reader refuses a null one
        {
            "match": {k: v for k, v in dataclasses.asdict(o.match).items() if v is not None},
            "env": dict(o.env),
        }
        for o in config.overrides
    ]
    return data


def load_record(name: str, *, loading: bool = False) -> tuple[ray.actor.ActorHandle, dict]:
    """The record of load `name`; LoadingError while it has no plan yet, unless `loading`."""
    try:
        actor = ray.get_actor(record_name(name), namespace=NAMESPACE)
    except ValueError:
        raise LoadNotFoundError(
            f"no load named {name!r} on this cluster (see `offloadctl list`)"
        ) from None
    record = ray.get(actor.get.remote(), timeout=ATTACH_TIMEOUT_S)
    if not loading and "plan" not in record:
        raise LoadingError(
            f"the load named {name!r} is still loading (no plan yet); wait for its `load` "
            f"to finish, or `offloadctl unload {name}` to stop it"
        )
    return actor, record


def config_of(record: dict) -> JobConfig:
    return job_config_from_dict(record["config"], where=f"load {record['name']!r}")


def worker_handles(record: dict) -> list[ray.actor.ActorHandle | None]:
    """The load's workers in stage order; None for a worker that is gone (a lost stage)."""
    handles = []
    for actor_name in record["workers"]:
        try:
            handles.append(ray.get_actor(actor_name, namespace=NAMESPACE))
        except ValueError:
            handles.append(None)
    return handles


def list_loads() -> list[str]:
    return sorted(
        actor_name.removeprefix(RECORD_PREFIX)
        for actor_name in named_actors()
        if actor_name.startswith(RECORD_PREFIX) and ":" not in actor_name[len(RECORD_PREFIX) :]
    )


def unload(name: str, *, keeper: bool = True) -> int:
    """Kill the load's keeper, its workers and its record, and remove its placement groups;
    returns the number of workers killed. Everything of the load is found by its name (the
    prefix `load:NAME:`), also a worker a recovery started but did not get to record, and also
    when the record itself is gone (its process died): LoadNotFoundError only when nothing of
    that name is left. `keeper=False`: the keeper itself unloads (its lease ran out), and ends
    itself after."""
    check_name(name)
    killed = remove_all(name, keeper=keeper)
    if killed is None:
        raise LoadNotFoundError(f"no load named {name!r} on this cluster (see `offloadctl list`)")
    return killed


def forget(name: str, *, keep_record: bool = False) -> None:
    """`unload` without the error: whatever of load `name` exists goes (a test's or a serve's
    clean-up of loads it made itself). `keep_record`: all but its record, which keeps the
    name claimed until a later `forget` (no other load can take the name meanwhile)."""
    check_name(name)
    remove_all(name, keep_record=keep_record)
