"""A named load on the cluster, by its name: its record, the detached actor `load:NAME` that
holds what a later command needs to attach (the job config, the plan, the workers' names and
bundles, the events) and owns the load while it loads; the names of everything else the load
makes (`load:NAME:worker-N`, `load:NAME:keeper`, placement groups `load:NAME:pg-N`); and
`remove_all(name)`, which finds all of it by those names and removes it.
`coordinator.runtime.registry` creates, reads and updates the record.

One record runs per named load for as long as the load, so its process imports Ray and this
module only: no torch, no transformers (~0.2 GiB and ~2 s of CPU less per load)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from worker.startup import settle

NAMESPACE = "offload-coordinator"  # named loads' actors and placement groups
RECORD_PREFIX = "load:"
LOADER_CHECK_S = 2.0  # a loading record checks this often that its loader still runs
STOP_WAIT_S = 10.0  # how long `stop_actor` waits for a killed actor to be gone
STOP_POLL_S = 0.2


def record_name(name: str) -> str:
    return f"{RECORD_PREFIX}{name}"


def worker_prefix(name: str) -> str:
    return f"{RECORD_PREFIX}{name}:worker-"


def keeper_name(name: str) -> str:
    return f"{record_name(name)}:keeper"


def named_actors() -> list[str]:
    """The names of every actor in our namespace (every named load's)."""
    return [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE
    ]


def named_groups(name: str) -> dict[str, PlacementGroup]:
    """The placement groups of load `name` that exist (not removed), by name."""
    prefix = f"{RECORD_PREFIX}{name}:pg-"
    found = {}
    for group_id, entry in ray.util.placement_group_table().items():
        if entry.get("name", "").startswith(prefix) and entry.get("state") != "REMOVED":
            found[entry["name"]] = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    return found


def remove_group(group: PlacementGroup) -> None:
    try:
        remove_placement_group(group)
    except Exception as exc:  # already removed (a named load's unload): nothing held
        print(
            f"note: could not remove placement group {group.id.hex()[:8]}: {exc}", file=sys.stderr
        )


def stop_actor(actor: ray.actor.ActorHandle, timeout_s: float = STOP_WAIT_S) -> None:
    """Kill `actor` (no restart) and wait, up to `timeout_s`, until it is gone: `ray.kill`
    only asks, and an actor still running may start others meanwhile."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=STOP_POLL_S)
        except ray.exceptions.GetTimeoutError:
            continue  # busy, or going: ask again
        except ray.exceptions.RayActorError:
            return  # gone
        time.sleep(STOP_POLL_S)


def release(actor: ray.actor.ActorHandle) -> None:
    """Kill, for good, an actor of a load that this process created and holds the handle of (its
    record: the name goes back; its keeper), never one found by name."""
    with contextlib.suppress(Exception):  # already gone: nothing held
        ray.kill(actor, no_restart=True)


def remove_all(name: str, *, keeper: bool = True, keep_record: bool = False) -> int | None:
    """Kill load `name`'s keeper, its workers and its record, and remove its placement groups,
    all found by name (also a worker a recovery started but did not record, and also when the
    record is gone); returns how many workers were killed, None when nothing of that name
    exists. `keeper=False`: the keeper itself removes the load, and ends itself after.
    `keep_record`: the record stays, so the name stays claimed (by whoever claimed it) while
    what is still starting under it is stopped; a later call removes it."""
    record_actor = None
    with contextlib.suppress(ValueError):
        record_actor = ray.get_actor(record_name(name), namespace=NAMESPACE)
    kept = False
    if keeper:  # the keeper first, and gone, before anything is listed: a keeper recovering a
        # worker would otherwise start one (or a placement group) after the list, an orphan
        with contextlib.suppress(ValueError):
            stop_actor(ray.get_actor(keeper_name(name), namespace=NAMESPACE))
            kept = True
    groups = named_groups(name)
    actors = named_actors()
    workers = [n for n in actors if n.startswith(worker_prefix(name))]
    there = kept or keeper_name(name) in actors
    if record_actor is None and not groups and not workers and not there:
        return None
    killed = 0
    for actor_name in workers:
        try:
            ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE), no_restart=True)
            killed += 1
        except ValueError:
            pass  # gone since it was listed
    for group in groups.values():
        remove_group(group)
    if record_actor is not None and not keep_record:
        release(record_actor)
    return killed


def driver_alive(job_id: str) -> bool:
    """Whether the Ray job (driver) `job_id` still runs, as the GCS's job table says: a driver
    killed with -9 is marked dead there when its node sees it gone. Unknown: alive."""
    from ray._private import state

    for job in state.jobs():
        if job["JobID"] == job_id:
            return not job["IsDead"]
    return True


@ray.remote(num_cpus=0, max_restarts=0)
class LoadRecord:
    """Holds what a later command needs to attach: the job config, the plan, the workers'
    names and bundles in stage order, and the recovery events. A store, and the load's owner
    while it loads: if the process that claimed the name dies before the load is done (killed
    with -9 mid-load), the record unloads what the load made and ends itself. Once loaded, the
    load's keeper (coordinator.runtime.keeper) watches the workers and publishes their
    metrics."""

    def __init__(self, record: dict) -> None:
        self.record = record
        if record.get("owner_job"):
            threading.Thread(target=self._watch_loader, daemon=True, name="loader").start()
        settle()  # imports done: the GC's own thresholds again (worker.startup)

    def _watch_loader(self) -> None:
        while self.record.get("state") == "loading":
            time.sleep(LOADER_CHECK_S)
            try:
                if self.record.get("state") != "loading" or driver_alive(self.record["owner_job"]):
                    continue
                # its state again, now that its loader is known gone: a loader that finished
                # the load (state "loaded") and then exited while the job table was asked is
                # gone too, and its load is not to be removed
                if self.record.get("state") != "loading":
                    continue
            except Exception as exc:  # look again later
                print(
                    f"load {self.record['name']!r}: cannot check its loader: {exc}", file=sys.stderr
                )
                continue
            print(
                f"load {self.record['name']!r}: the process loading it is gone: unloading it",
                file=sys.stderr,
            )
            remove_all(self.record["name"])  # kills this record last
            return

    def get(self) -> dict:
        return self.record

    def update(self, changes: dict) -> None:
        self.record.update(changes)


def load_of_group(group_name: str) -> str | None:
    """The load a placement group named `load:NAME:pg-N` belongs to (None: not a load's)."""
    if not group_name.startswith(RECORD_PREFIX) or ":pg-" not in group_name:
        return None
    return group_name[len(RECORD_PREFIX) :].rpartition(":pg-")[0]
