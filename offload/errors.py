"""The project's errors: one root, and the kinds a user acts on.

They live here, in the lowest layer, because every layer raises them: `offload/` (a pin setting
that cannot hold), `worker/` (a checkpoint that changed under a worker), `coordinator/` (a plan
that never fits, a request that must wait). This module imports nothing, so any module can
import it without a cycle.

Each kind is what the user does about it, and the CLI and the HTTP server map kinds, never
message texts, to exit codes and status codes:

| kind | the user | offloadctl | HTTP |
|---|---|---|---|
| ConfigError | changes a flag, a job key or a node's environment | 2 | 400 |
| NotFoundError | names something that exists (a named load, a model) | 2 | 404 |
| CheckpointError | fixes or replaces the checkpoint | 2 | 400 |
| PlanError | gives the job more memory or asks for less | 2 | 400 |
| NeverFitsError | sends a smaller request: this one can never run here | 2 | 400 |
| BusyError | retries later: the request fits, but not now | 2 | 429 |
| LaunchError | looks at the cluster: workers could not start or were lost | 2 | 503 |
| OffloadError | fixes the calling code: the library was misused | 2 | 500 |

Anything that is not an `OffloadCoordinatorError` is a bug, reported with its traceback.
The kinds also derive from the builtin a caller would catch (`ValueError` for bad input,
`RuntimeError` for failures, `LookupError` for names), so code written against those keeps
working.
"""

from __future__ import annotations


class OffloadCoordinatorError(Exception):
    """Root of every error this project raises on purpose; the message says what to change."""


class ConfigError(OffloadCoordinatorError, ValueError):
    """A setting is invalid: a flag, a job-file key, a node's environment variable."""


class NotFoundError(OffloadCoordinatorError, LookupError):
    """A name the user gave (a named load, a served model) does not exist."""


class CheckpointError(OffloadCoordinatorError, ValueError):
    """The checkpoint cannot be read, is not supported, or changed while it was being read."""


class PlanError(OffloadCoordinatorError, ValueError):
    """The model cannot be placed on this cluster under its budgets; the message has the
    numbers and the knobs that make it fit."""


class CapacityError(OffloadCoordinatorError):
    """A request cannot run: never (`NeverFitsError`) or not now (`BusyError`)."""


class NeverFitsError(CapacityError, ValueError):
    """The request could never run on this job (past the context window or the planned KV
    cache, a setting the job cannot apply): retrying cannot help."""


class BusyError(CapacityError, RuntimeError):
    """The request fits, but the capacity it needs is taken by others in flight: retry later."""


class LaunchError(OffloadCoordinatorError, RuntimeError):
    """Starting, loading or running the workers failed; what was started has been released."""


class StageBrokenError(LaunchError):
    """A worker that answers but whose stage failed to load or reconfigure (out of memory, a
    timeout, a read that failed): unusable until replaced, so it counts as lost."""


class OffloadError(OffloadCoordinatorError, RuntimeError):
    """Misuse of an offloader: wrapping twice, a module already offloaded, a shared weight."""


class PinningUnavailableError(ConfigError, RuntimeError):
    """Pinning was forced on (`OFFLOAD_PIN_MEMORY=on`) where this node cannot pin."""


class OffloadUnavailableError(ConfigError, RuntimeError):
    """The requested backend cannot run on this node; the message names the alternative."""
