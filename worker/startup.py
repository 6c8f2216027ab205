"""How our Ray worker processes start: their imports run with the cyclic GC mostly held off.

A stage worker, a keeper or a probe task imports torch and transformers when Ray hands it its
first task (5-9 CPU-seconds on the 2-core CI machine). Measured there with `gc.callbacks`
(`bench/startup.py`), 13% of that import is the cyclic GC: about 940 collections over a module
heap that only grows and holds no garbage. With the first generation's threshold raised while
a process imports, 13 collections remain and the GC's share falls to 4% (~0.9 CPU-s less per
process, 0.84x; the test suite starts about a hundred such processes). Once the process is
built, `settle()` puts Python's thresholds back, so what it runs afterwards (decode steps,
re-plans that drop layers) is collected as in any process. Nothing is frozen: a stage's
layers, dropped by a re-plan, are freed as before.

Only Ray's worker processes change their thresholds (the raylet's `default_worker.py`, with
the RAY_RAYLET_PID it sets), and `offloadctl` until it connects to Ray or ends, each only
before torch is imported: a user's process, a Ray job's entrypoint that is not ours (a child of
a Ray worker) or a worker already running other work keep theirs. This module imports neither
torch nor Ray: it runs before them.
"""

from __future__ import annotations

import gc
import os
import sys

DEFAULT_THRESHOLDS = (700, 10, 10)  # CPython's own
IMPORT_THRESHOLDS = (50_000, 20, 100)


def in_ray_worker() -> bool:
    """Whether this process is a worker process a raylet started (not a driver, nor a process
    a worker started)."""
    started_as = os.path.basename(sys.argv[0]) if sys.argv else ""
    return started_as == "default_worker.py" and "RAY_RAYLET_PID" in os.environ


def quiet_imports(*, command: bool = False) -> None:
    """Raise the GC thresholds for this Ray worker process's imports (`command`: or for one of
    our commands, `offloadctl`, whose process is ours from its start), when torch is still to
    come (a process that already runs other work is left as it is); nothing elsewhere, and
    nothing where someone already set thresholds of their own."""
    ours = command or in_ray_worker()
    if ours and "torch" not in sys.modules and gc.get_threshold() == DEFAULT_THRESHOLDS:
        gc.set_threshold(*IMPORT_THRESHOLDS)


def settle() -> None:
    """The process is built: Python's own thresholds again (if `quiet_imports` raised them)."""
    if gc.get_threshold() == IMPORT_THRESHOLDS:
        gc.set_threshold(*DEFAULT_THRESHOLDS)
