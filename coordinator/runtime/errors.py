"""The runtime's errors: each message names what failed and what to change."""

from __future__ import annotations


class LaunchError(RuntimeError):
    """Starting, loading or running the workers failed; what was started has been released."""


class WorkerLostError(LaunchError):
    """A worker died (its process or its node) while the driver waited for it."""
