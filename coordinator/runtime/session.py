"""The Ray session: an embedded local Ray (token authentication on, logical GPUs simulated on
the CPU), or a bounded join of a running cluster that says why it failed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from dataclasses import dataclass

import ray

from coordinator.config import ConfigError, JobConfig

CONNECT_TIMEOUT_S = 30.0  # a TCP connect to the head before ray.init, which retries for minutes


@dataclass(slots=True)
class RaySession:
    """A connection to Ray; `owned` when we started an embedded local cluster."""

    owned: bool

    def close(self) -> None:
        if self.owned and ray.is_initialized():
            ray.shutdown()


def connect(config: JobConfig) -> RaySession:
    """Join the cluster at config.address / RAY_ADDRESS, or start an embedded one. The
    process's own SIGTERM handler survives ray.init, which installs a handler of its own that
    ends the process at once (the CLI's handler releases workers and placement groups first)."""
    with _keeping_sigterm():
        return _connect(config)


@contextlib.contextmanager
def _keeping_sigterm():
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(handler):
            signal.signal(signal.SIGTERM, handler)


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
    ray.init(address="local", num_cpus=cpus, num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    return RaySession(owned=True)


def _join(address: str) -> None:
    """ray.init(address), bounded: an address where nothing listens fails at once (Ray itself
    retries for minutes), a cluster that wants a token says so (Ray says "Failed to connect")."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(address)
    except ConnectionError as exc:  # "auto" with no cluster on this machine
        raise ConnectionError(f"no Ray cluster to join at address={address!r}: {exc}") from None
    except Exception:  # a private helper that moved: leave the address to ray.init
        resolved = None
    host, _, port = (resolved or "").rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ConnectionError(
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
            raise ConnectionError(f"cannot join the Ray cluster at {address}: {exc}") from None
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


def _token_refused(address: str) -> ConnectionError:
    return ConnectionError(
        f"the Ray cluster at {address} refused this client's token (RAY_AUTH_MODE="
        f"{os.environ.get('RAY_AUTH_MODE', 'unset')}): it uses token authentication; set "
        "RAY_AUTH_MODE=token and give the cluster's token in ~/.ray/auth_token, "
        "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (see README: Run on a cluster)"
    )
