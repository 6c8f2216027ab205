"""The cluster's planning desk: one load at a time probes, plans and reserves its GPUs, and the
host memory a load planned on each node stays reserved until its workers hold it.

Two loads launched together raced: each one's probe task holds the free GPUs it measures, so
the other saw none free and failed ("every GPU ... is held"), or both planned the same free
GPUs and one waited out its placement timeout; and both planned the same host memory, since a
node's available memory drops only once a load's workers allocate their arenas. So a load
takes its **turn** before it probes and leaves it once its placement groups are reserved (the
GPUs are then held for it), and it leaves a **reservation** of the host bytes its plan puts on
each node, which the next loads' budgets subtract until its workers have loaded (their arenas
then show in the probes' available memory) or it failed.

Both live in Ray's internal key-value store (in the GCS: shared by every driver, keeper and
server of the cluster; its create-if-absent is atomic). Each carries a lease that its holder
renews every RENEW_S while it lives: a turn or a reservation whose holder died (killed with -9)
expires within TURN_LEASE_S or RESERVATION_LEASE_S, and never blocks the cluster longer.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable

from ray.experimental import internal_kv

from coordinator.runtime.errors import LaunchError

KV_NAMESPACE = "offload-coordinator"
TURN_KEY = "planning-turn"
RESERVATION_PREFIX = "host-reservation:"
TURN_WAIT_S = 300.0  # a load waits this long for its turn, then fails naming the holder
TURN_LEASE_S = 20.0  # a turn not renewed for this long is a dead holder's
RESERVATION_LEASE_S = 60.0  # the same for a reservation
RENEW_S = 2.0
POLL_S = 0.2


def _get(key: str) -> dict | None:
    raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None


class Turn:
    """One load's turn at the desk (`with Turn(what) as turn:`), and its host reservation.

    Entering waits for the turn; `leave(host_bytes)` reserves the host bytes per node and
    leaves the turn, once the caller's GPUs are reserved (`parts` callers each leave once: the
    turn is left when the last has); exiting leaves it if still held and drops the
    reservation."""

    def __init__(self, what: str, parts: int = 1, wait_s: float = TURN_WAIT_S) -> None:
        self.what = what
        self.key = f"{what} ({socket.gethostname()}, pid {os.getpid()}, {uuid.uuid4().hex[:8]})"
        self.parts = parts
        self._wait_s = wait_s
        self._reserved: Counter = Counter()
        self._holding = False
        self._lock = threading.Lock()  # leaves (replicas' threads) and the renewals
        self._stop = threading.Event()

    def _turn_value(self) -> str:
        return json.dumps({"holder": self.key, "until": time.time() + TURN_LEASE_S})

    def __enter__(self) -> Turn:
        start = time.monotonic()
        while internal_kv._internal_kv_put(
            TURN_KEY, self._turn_value(), overwrite=False, namespace=KV_NAMESPACE
        ):
            held = _get(TURN_KEY)
            if held is not None and held["until"] < time.time():  # its holder died
                internal_kv._internal_kv_del(TURN_KEY, namespace=KV_NAMESPACE)
                continue
            if time.monotonic() - start > self._wait_s:
                holder = held["holder"] if held else "another load"
                raise LaunchError(
                    f"{self.what}: waited {self._wait_s:.0f} s (TURN_WAIT_S) for {holder} to "
                    "finish probing and reserving its GPUs; try again, or unload it"
                )
            time.sleep(POLL_S)
        self._holding = True
        threading.Thread(target=self._renew_loop, daemon=True, name="offload-turn").start()
        return self

    def reserved_elsewhere(self) -> dict[str, int]:
        """Host bytes per node that other loads planned and do not hold yet."""
        return reserved_host(exclude=self.key)

    def leave(self, host_bytes: Iterable[tuple[str, int]] = ()) -> None:
        """Reserve `host_bytes` ((node id, bytes) pairs) and, once every part has left, leave
        the turn."""
        with self._lock:
            for node, nbytes in host_bytes:
                self._reserved[node] += int(nbytes)
            if self._reserved:
                self._write_reservation()
            self.parts -= 1
            if self.parts <= 0:
                self._leave_turn()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        with self._lock:
            self._leave_turn()
            self._reserved.clear()
            internal_kv._internal_kv_del(RESERVATION_PREFIX + self.key, namespace=KV_NAMESPACE)

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            with contextlib.suppress(Exception):  # the GCS away a moment: the next tick
                self._renew()

    def _renew(self) -> None:
        """Extend the leases of what this holder still holds."""
        with self._lock:
            if self._holding and self._holds_turn():
                internal_kv._internal_kv_put(
                    TURN_KEY, self._turn_value(), overwrite=True, namespace=KV_NAMESPACE
                )
            if self._reserved:
                self._write_reservation()

    def _holds_turn(self) -> bool:
        held = _get(TURN_KEY)
        return held is not None and held["holder"] == self.key

    def _leave_turn(self) -> None:
        if not self._holding:
            return
        self._holding = False
        if self._holds_turn():  # ours, not a later holder's (had ours expired)
            internal_kv._internal_kv_del(TURN_KEY, namespace=KV_NAMESPACE)

    def _write_reservation(self) -> None:
        entry = {"nodes": dict(self._reserved), "until": time.time() + RESERVATION_LEASE_S}
        internal_kv._internal_kv_put(
            RESERVATION_PREFIX + self.key, json.dumps(entry), namespace=KV_NAMESPACE
        )


def reserved_host(exclude: str | None = None) -> dict[str, int]:
    """Host bytes per node reserved by loads that do not hold them yet (but `exclude`'s)."""
    total: Counter = Counter()
    for key in internal_kv._internal_kv_list(RESERVATION_PREFIX, namespace=KV_NAMESPACE):
        name = key.decode()
        if name == RESERVATION_PREFIX + (exclude or ""):
            continue
        entry = _get(name)
        if entry is None:
            continue
        if entry["until"] < time.time():  # its holder died
            internal_kv._internal_kv_del(name, namespace=KV_NAMESPACE)
            continue
        total.update(entry["nodes"])
    return dict(total)


def host_bytes_of(the_plan) -> list[tuple[str, int]]:
    """The host bytes a plan's workers allocate, per node: their arenas (offloaded bytes)."""
    return [(s.node_id, s.offloaded_bytes) for s in the_plan.stages if s.offloaded_bytes]
