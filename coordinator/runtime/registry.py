"""Named loads: a loaded model that outlives the command that loaded it.

`offloadctl load --name NAME` starts its workers as detached, named actors in our namespace, in
detached, named placement groups (`load:NAME:pg-N`), and leaves a small detached record (config,
plan, worker names, their bundles, events) beside them; `run`, `status` and `unload` attach to
them by name, `list` shows what is loaded. On the embedded Ray they die with the process.
"""

from __future__ import annotations

import contextlib
import dataclasses

import ray
from ray.util.placement_group import PlacementGroup

from coordinator.config import JobConfig, job_config_from_dict
from coordinator.runtime.group import NAMESPACE, Slot, WorkerGroup, WorkerHandle, remove_group
from offload.errors import ConfigError, NotFoundError

ATTACH_TIMEOUT_S = 60.0
_RECORD_PREFIX = "load:"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class LoadNotFoundError(NotFoundError):
    """No load of that name on the cluster."""


def record_name(name: str) -> str:
    return f"{_RECORD_PREFIX}{name}"


def worker_name(name: str, number: int) -> str:
    """Actor name of worker `number` of load `name`. Numbers are never reused within a load: a
    worker keeps its name when a re-plan gives it another stage, a replacement gets a new one;
    the record lists them in stage order."""
    return f"{_worker_prefix(name)}{number}"


def _worker_prefix(name: str) -> str:
    return f"{_RECORD_PREFIX}{name}:worker-"


@ray.remote(num_cpus=0, max_restarts=0)
class LoadRecord:
    """Holds what a later command needs to attach: the job config, the plan, the workers'
    names and bundles in stage order, and the recovery events. A store only: the load's
    keeper (coordinator.runtime.keeper) watches the workers and publishes their metrics."""

    def __init__(self, record: dict) -> None:
        self.record = record

    def get(self) -> dict:
        return self.record

    def update(self, changes: dict) -> None:
        self.record.update(changes)


def check_name(name: str) -> None:
    if not name or ":" in name or "/" in name:
        raise ConfigError(f"load name {name!r} must be non-empty, without ':' or '/'")
    try:
        ray.get_actor(record_name(name), namespace=NAMESPACE)
    except ValueError:
        return
    raise ConfigError(f"a load named {name!r} already exists; unload it or choose another name")


def _state(group: WorkerGroup) -> dict:
    """What the record keeps of a group: plan, worker names and bundles, in stage order."""
    return {
        "plan": group.plan.to_json(),
        "workers": [h.name for h in group.handles],
        "slots": [[h.slot.group_name, h.slot.bundle] if h.slot else None for h in group.handles],
    }


def save(name: str, config: JobConfig, group: WorkerGroup, events: list[dict]) -> None:
    record = {"name": name, "config": _config_dict(config), **_state(group), "events": events}
    # On the head node: a worker node may leave with the record's process, the head may not.
    actor = LoadRecord.options(
        name=record_name(name), namespace=NAMESPACE, lifetime="detached", **on_head()
    ).remote(record)
    ray.get(actor.get.remote(), timeout=ATTACH_TIMEOUT_S)  # it exists before anything else runs


def on_head() -> dict:
    """Actor options that place it on the head node (a sliver of its marker resource)."""
    if any(HEAD_RESOURCE in node["Resources"] for node in ray.nodes() if node["Alive"]):
        return {"resources": {HEAD_RESOURCE: 0.001}}
    return {}  # no head marker reported: anywhere


def next_worker_number(record: dict) -> int:
    """The first worker number not used yet by the load."""
    return 1 + max((int(n.rpartition("-")[2]) for n in record["workers"] if n), default=-1)


def update(name: str, group: WorkerGroup, events: list[dict]) -> None:
    """After a recovery: the group's new plan, workers and bundles, its config (a replica's GPUs
    change with its plan), and the events (waits, so a later attach sees them)."""
    actor, _ = load_record(name)
    changes = {**_state(group), "config": _config_dict(group.config), "events": events}
    ray.get(actor.update.remote(changes), timeout=ATTACH_TIMEOUT_S)


def group_of(record: dict, index) -> WorkerGroup:
    """The named load's WorkerGroup as its record describes it: its workers (None for one that
    is gone) in their bundles, and every placement group of the load."""
    from coordinator.planning.planner import Plan
    from coordinator.runtime.group import stage_specs

    config = config_of(record)
    the_plan = Plan.from_json(record["plan"])
    groups = named_groups(record["name"])
    specs = stage_specs(config, index, the_plan, {})
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


def named_groups(name: str) -> dict[str, PlacementGroup]:
    """The placement groups of load `name` that exist (not removed), by name."""
    prefix = f"{_RECORD_PREFIX}{name}:pg-"
    found = {}
    for group_id, entry in ray.util.placement_group_table().items():
        if entry.get("name", "").startswith(prefix) and entry.get("state") != "REMOVED":
            found[entry["name"]] = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    return found


def _config_dict(config: JobConfig) -> dict:
    data = dataclasses.asdict(config)
    data["overrides"] = [
        {"match": dataclasses.asdict(o.match), "env": dict(o.env)} for o in config.overrides
    ]
    return data


def load_record(name: str) -> tuple[ray.actor.ActorHandle, dict]:
    try:
        actor = ray.get_actor(record_name(name), namespace=NAMESPACE)
    except ValueError:
        raise LoadNotFoundError(
            f"no load named {name!r} on this cluster (see `offloadctl list`)"
        ) from None
    return actor, ray.get(actor.get.remote(), timeout=ATTACH_TIMEOUT_S)


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


def _named_actors() -> list[str]:
    return [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE
    ]


def list_loads() -> list[str]:
    return sorted(
        actor_name.removeprefix(_RECORD_PREFIX)
        for actor_name in _named_actors()
        if actor_name.startswith(_RECORD_PREFIX) and ":" not in actor_name[len(_RECORD_PREFIX) :]
    )


def unload(name: str, *, keeper: bool = True) -> int:
    """Kill the load's keeper, its workers and its record, and remove its placement groups;
    returns the number of workers killed. Every worker of the load is found by its name
    prefix, also one a recovery started but did not get to record. `keeper=False`: the keeper
    itself unloads (its lease ran out), and ends itself after."""
    record_actor, _ = load_record(name)
    with contextlib.suppress(ValueError):  # the keeper first: it must not start replacements
        if keeper:
            ray.kill(
                ray.get_actor(f"{record_name(name)}:keeper", namespace=NAMESPACE), no_restart=True
            )
    killed = 0
    for actor_name in _named_actors():
        if actor_name.startswith(_worker_prefix(name)):
            try:
                ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE), no_restart=True)
                killed += 1
            except ValueError:
                pass  # gone since it was listed
    for group in named_groups(name).values():
        remove_group(group)
    ray.kill(record_actor, no_restart=True)
    return killed


def forget(name: str) -> None:
    """`unload` for a load that failed midway: whatever of it exists goes, also placement
    groups reserved before its record was written."""
    with contextlib.suppress(LoadNotFoundError):
        unload(name)
        return
    for group in named_groups(name).values():
        remove_group(group)
