"""Named loads: a loaded model that outlives the command that loaded it.

`offloadctl load --name NAME` starts its workers as detached, named actors in our namespace and
leaves a small detached record (config, plan) beside them; `run`, `status` and `unload` attach
to them by name, `list` shows what is loaded. On the embedded Ray they die with the process.
"""

from __future__ import annotations

import dataclasses

import ray

from coordinator.config import JobConfig, job_config_from_dict

NAMESPACE = "offload-coordinator"
ATTACH_TIMEOUT_S = 60.0
_RECORD_PREFIX = "load:"


class LoadNotFoundError(LookupError):
    """No load of that name on the cluster."""


def record_name(name: str) -> str:
    return f"{_RECORD_PREFIX}{name}"


def worker_name(name: str, stage: int) -> str:
    return f"{_RECORD_PREFIX}{name}:stage-{stage}"


@ray.remote(num_cpus=0, max_restarts=0)
class LoadRecord:
    """Holds what a later command needs to attach: the job config and the plan."""

    def __init__(self, record: dict) -> None:
        self.record = record

    def get(self) -> dict:
        return self.record


def check_name(name: str) -> None:
    if not name or ":" in name or "/" in name:
        raise ValueError(f"load name {name!r} must be non-empty, without ':' or '/'")
    try:
        ray.get_actor(record_name(name), namespace=NAMESPACE)
    except ValueError:
        return
    raise ValueError(f"a load named {name!r} already exists; unload it or choose another name")


def save(name: str, config: JobConfig, plan_json: str) -> None:
    record = {"name": name, "config": _config_dict(config), "plan": plan_json}
    LoadRecord.options(name=record_name(name), namespace=NAMESPACE, lifetime="detached").remote(
        record
    )


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


def worker_handles(name: str, num_stages: int) -> list[ray.actor.ActorHandle]:
    handles = []
    for stage in range(num_stages):
        try:
            handles.append(ray.get_actor(worker_name(name, stage), namespace=NAMESPACE))
        except ValueError:
            raise LoadNotFoundError(
                f"load {name!r} has lost its stage {stage} worker; unload it and load again"
            ) from None
    return handles


def list_loads() -> list[str]:
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        entry["name"].removeprefix(_RECORD_PREFIX)
        for entry in names
        if entry["namespace"] == NAMESPACE
        and entry["name"].startswith(_RECORD_PREFIX)
        and ":stage-" not in entry["name"]
    )


def unload(name: str) -> int:
    """Kill the load's workers and its record; returns the number of workers killed."""
    record_actor, record = load_record(name)
    from coordinator.planner import Plan

    stages = len(Plan.from_json(record["plan"]).stages)
    killed = 0
    for stage in range(stages):
        try:
            ray.kill(ray.get_actor(worker_name(name, stage), namespace=NAMESPACE), no_restart=True)
            killed += 1
        except ValueError:
            pass  # already gone
    ray.kill(record_actor, no_restart=True)
    return killed
