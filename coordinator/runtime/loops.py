"""A job's background loops ("watch", "export"): an action every few seconds on a daemon
thread, one loop of a kind at a time, a failed tick said on stderr and tried again at the
next, every loop stopped by `stop_all` (a tick in flight is waited for, boundedly)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from offload.errors import ConfigError

# stop() waits this long for a tick in flight; the thread is a daemon either way.
LOOP_JOIN_TIMEOUT_S = 5.0


class Loops:
    def __init__(self) -> None:
        self.loops: dict[str, tuple[threading.Thread, threading.Event]] = {}

    def every(self, name: str, interval_s: float, action: Callable[[], object]) -> None:
        """Run `action` every `interval_s` seconds, replacing the loop called `name`."""
        if interval_s <= 0:
            raise ConfigError(f"interval_s={interval_s} must be > 0")
        self.stop(name)
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    action()
                except Exception as exc:  # a worker may be busy or gone: say so, keep going
                    print(f"{name}: {exc}", file=sys.stderr)

        thread = threading.Thread(target=loop, name=f"offload-{name}", daemon=True)
        thread.start()
        self.loops[name] = (thread, stop)

    def stop(self, name: str) -> None:
        if name in self.loops:
            thread, stop = self.loops.pop(name)
            stop.set()
            thread.join(timeout=LOOP_JOIN_TIMEOUT_S)

    def stop_all(self) -> None:
        for name in list(self.loops):
            self.stop(name)
