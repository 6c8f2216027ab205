"""The holder's side of leased loads (`launch(..., lease_s=...)`): while this process runs, a
daemon thread renews the lease of every load it holds every `lease_s / RENEWALS_PER_LEASE`, so
a process killed with -9 stops renewing and the loads' keepers unload them (see
coordinator/runtime/keeper.py). `serve` holds the loads it starts this way.

The loads are known by name (`name`, or `name-<replica>` as `launch_replicas` names them) and
looked up on each renewal, so the holder renews from before their launch: the first replica's
lease runs while the next ones load."""

from __future__ import annotations

import re
import sys
import threading

import ray

from coordinator.runtime import keeper, registry

RENEWALS_PER_LEASE = 3  # renewals sent within each lease: one late or lost renewal is harmless


class LeaseHolder:
    """Renews the leases of the loads named `name` or `name-<r>` until `close()`."""

    def __init__(self, name: str, lease_s: float) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s} must be positive")
        self.name, self.lease_s = name, lease_s
        self._pattern = re.compile(re.escape(name) + r"(-\d+)?")
        self._keepers: dict[str, ray.actor.ActorHandle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="offload-lease")
        self._thread.start()

    def _loop(self) -> None:
        interval_s = self.lease_s / RENEWALS_PER_LEASE
        while not self._stop.wait(interval_s):
            try:
                self.renew(timeout_s=interval_s)
            except Exception as exc:  # say it, and try again: the lease has other renewals
                self._keepers.clear()  # one that ended: looked up again
                print(f"lease of {self.name!r}: renewal failed: {exc}", file=sys.stderr)

    def renew(self, *, timeout_s: float) -> int:
        """Renew every held load's lease now (waits for the keepers' answers, bounded);
        returns how many were renewed. Nothing before Ray is connected."""
        if not ray.is_initialized():
            return 0
        names = [n for n in registry.list_loads() if self._pattern.fullmatch(n)]
        refs = []
        for name in names:
            handle = self._keepers.get(name) or keeper.find(name)
            if handle is not None:  # none yet: the load's keeper starts once it is loaded
                self._keepers[name] = handle
                refs.append(handle.renew.remote())
        ray.get(refs, timeout=timeout_s)
        return len(refs)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.lease_s)

    def __enter__(self) -> LeaseHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
