"""The runtime's errors: kinds of `offload.errors.LaunchError`, each message naming what failed
and what to change."""

from __future__ import annotations

from offload.errors import LaunchError

__all__ = ["ClusterUnreachableError", "LaunchError", "WorkerLostError"]


class WorkerLostError(LaunchError):
    """A worker died (its process or its node) while the driver waited for it."""


class ClusterUnreachableError(LaunchError, ConnectionError):
    """The Ray cluster to join cannot be reached or refuses this client (its token)."""
