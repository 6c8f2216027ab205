"""How an offloadctl command ends on a signal or any other way: Ctrl-C and SIGTERM become
exceptions in the main thread (so every `finally` and `with` releases what it holds), and an
embedded Ray the command started is stopped however it ended."""

from __future__ import annotations

import signal
import sys


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so every `finally` and `with` releases what it holds,
    as Ctrl-C's KeyboardInterrupt does. A KeyboardInterrupt on purpose: Ray's waits (ray.get,
    ray.wait) end at once on a KeyboardInterrupt from a signal handler, raising one of their own,
    but hold any other exception until the wait is over (then as a SystemError): a SIGTERM
    during a load went unheard for as long as the load took."""


_received: list[int] = []  # the signals this command received, first first


def _on_signal(signum: int, frame: object) -> None:
    _received.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def install_handlers() -> dict[int, object]:
    """Ctrl-C and SIGTERM end any command with 130 / 143 after releasing what it holds. SIGINT
    is taken even where it was inherited ignored (a background job of a shell script): Python
    then installs no handler for it, and Ctrl-C or `kill -INT` was lost."""
    _received.clear()
    return {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}


def first_signal() -> int | None:
    """The first signal this command received since `install_handlers`, if any."""
    return _received[0] if _received else None


def restore_handlers(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        if handler is not None:  # None: installed outside Python, cannot be put back
            signal.signal(signum, handler)


def embedded_ray() -> str | None:
    session = sys.modules.get("coordinator.runtime.session")  # imported with Ray, if at all
    return session.embedded_session() if session is not None else None


def release_embedded_ray(unless: str | None) -> None:
    """However the command ended (an error, a signal, a handler of Ray's own), an embedded Ray
    it started is stopped before it returns (see coordinator.runtime.session.EmbeddedGuard)."""
    session = sys.modules.get("coordinator.runtime.session")
    if session is not None:
        session.release_embedded(unless=unless)
