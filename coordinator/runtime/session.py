"""The Ray session: an embedded local Ray (token authentication on, logical GPUs simulated on
the CPU), or a bounded join of a running cluster that says why it failed."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import threading
from dataclasses import dataclass

import psutil
import ray

from coordinator.config import ConfigError, JobConfig
from coordinator.runtime.errors import ClusterUnreachableError
from worker.startup import settle

CONNECT_TIMEOUT_S = 30.0  # a TCP connect to the head before ray.init, which retries for minutes
STOP_TIMEOUT_S = 15.0  # an embedded Ray's processes, after ray.shutdown asked them to stop


@dataclass(slots=True)
class RaySession:
    """A connection to Ray; `owned` when we started an embedded local cluster."""

    owned: bool

    def close(self) -> None:
        if self.owned:
            release_embedded()
            if ray.is_initialized():  # one the guard did not get to know
                ray.shutdown()


class EmbeddedGuard:
    """The embedded Ray this process started, known by its session directory, which the command
    line of each of its processes (GCS, raylet, dashboard, monitors) names; Ray's workers are
    their children. `release` shuts it down and then makes sure that none of those processes is
    left: each still running STOP_TIMEOUT_S after ray.shutdown is killed. RaySession.close
    releases it, and so does an atexit hook, whatever ended the process's Python code (an
    error, a signal, a handler of Ray's own that exits)."""

    def __init__(self) -> None:
        self.session_dir: str | None = None
        self._hooked = False

    def started(self) -> None:
        self.session_dir = _session_dir()
        if not self._hooked:
            atexit.register(self.release)  # after Ray's own atexit hook is registered: runs first
            self._hooked = True

    def processes(self) -> list[psutil.Process]:
        """This process's descendants that belong to the embedded Ray."""
        if not self.session_dir:
            return []
        roots, found = [], {}
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any(self.session_dir in arg for arg in child.cmdline()):
                    roots.append(child)
        for root in roots:
            found[root.pid] = root
            with contextlib.suppress(psutil.Error):
                found.update((p.pid, p) for p in root.children(recursive=True))
        return list(found.values())

    def release(self) -> None:
        if self.session_dir is None:
            return
        left = self.processes()  # before the shutdown: its workers are still the raylet's
        try:
            if ray.is_initialized() and _session_dir() == self.session_dir:
                ray.shutdown()
        finally:
            self.session_dir = None
            _, alive = psutil.wait_procs(left, timeout=STOP_TIMEOUT_S)
            for process in alive:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(alive, timeout=STOP_TIMEOUT_S)


def _session_dir() -> str | None:
    """The session directory of the Ray this process started or joined (None: none)."""
    node = getattr(ray._private.worker, "_global_node", None)
    with contextlib.suppress(Exception):
        return node.get_session_dir_path() if node is not None else None
    return None


_embedded = EmbeddedGuard()


def release_embedded(unless: str | None = None) -> None:
    """Stop the embedded Ray this process started, if one runs (see EmbeddedGuard), unless its
    session directory is `unless` (one that an earlier caller started and still uses)."""
    if _embedded.session_dir != unless:
        _embedded.release()


def embedded_session() -> str | None:
    """The session directory of the embedded Ray this process started and runs, if any."""
    return _embedded.session_dir


def connect(config: JobConfig) -> RaySession:
    """Join the cluster at config.address / RAY_ADDRESS, or start an embedded one. The
    process's own SIGINT and SIGTERM handlers survive ray.init, which installs a SIGTERM
    handler of its own that ends the process at once (the CLI's handlers release workers and
    placement groups first)."""
    settle()  # a command's imports are done when it connects (worker.startup)
    with keeping_handlers():
        return _connect(config)


@contextlib.contextmanager
def keeping_handlers():
    """Put the process's own SIGINT and SIGTERM handlers back after the body (ray.init, Serve's
    start), whatever handlers it installed."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if callable(handler):
                signal.signal(signum, handler)


def _connect(config: JobConfig) -> RaySession:
    address = config.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return RaySession(owned=False)
    if address:
        if config.gpus:
            raise ConfigError(
                f"gpus={config.gpus} creates logical GPUs on an embedded Ray, but RAY_ADDRESS="
                f"{address!r} joins a cluster whose GPUs are real: unset RAY_ADDRESS, or drop "
                "--gpus"
            )
        _join(address)
        return RaySession(owned=False)
    # Embedded: logical GPUs when asked for (CPU-simulated), enough CPUs for one per worker.
    num_gpus = config.gpus or None
    cpus = max(os.cpu_count() or 1, (config.gpus or 1) * config.cpus_per_worker)
    # address="local": always a new cluster. A bare ray.init() joins a Ray that another process
    # on this machine started (/tmp/ray/ray_current_cluster), then refuses num_cpus/num_gpus.
    try:
        ray.init(
            address="local",
            num_cpus=cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    finally:
        _embedded.started()  # also when a signal interrupts ray.init: what it started is known
    return RaySession(owned=True)


def _join(address: str) -> None:
    """ray.init(address), bounded: an address where nothing listens fails at once (Ray itself
    retries for minutes), a cluster that wants a token says so (Ray says "Failed to connect")."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(address)
    except ConnectionError as exc:  # "auto" with no cluster on this machine
        raise ClusterUnreachableError(
            f"no Ray cluster to join at address={address!r}: {exc}"
        ) from None
    except Exception:  # a private helper that moved: leave the address to ray.init
        resolved = None
    host, _, port = (resolved or "").rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ClusterUnreachableError(
                f"cannot reach a Ray cluster at {address} ({resolved}): {exc}; check that its "
                "head is up (ray status on it) and the address (--address or RAY_ADDRESS)"
            ) from None
    if resolved and _refuses_token(resolved):  # at once; ray.init takes ~20 s to give up
        raise _token_refused(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:
        chain: list[BaseException] = []
        link: BaseException | None = exc
        while link is not None and link not in chain:
            chain.append(link)
            link = link.__cause__ or link.__context__
        if not any(_is_token_refusal(e) for e in chain):
            raise ClusterUnreachableError(
                f"cannot join the Ray cluster at {address}: {exc}"
            ) from None
        raise _token_refused(address) from None


def _is_token_refusal(exc: BaseException) -> bool:
    return isinstance(exc, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(exc)


def _refuses_token(gcs_address: str) -> bool:
    """Whether the GCS at `gcs_address` refuses this process's token (or its lack of one):
    one GCS client, which asks for the cluster id with the token as ray.init would send it.
    Anything else that goes wrong is left to ray.init, which says what it is."""
    try:
        from ray._raylet import GcsClient

        GcsClient(address=gcs_address)
    except Exception as exc:
        return _is_token_refusal(exc)
    return False


def _token_refused(address: str) -> ClusterUnreachableError:
    return ClusterUnreachableError(
        f"the Ray cluster at {address} refused this client's token (RAY_AUTH_MODE="
        f"{os.environ.get('RAY_AUTH_MODE', 'unset')}): it uses token authentication; set "
        "RAY_AUTH_MODE=token and give the cluster's token in ~/.ray/auth_token, "
        "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (see docs/cluster-and-pinning.md)"
    )
