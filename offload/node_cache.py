"""What a node measured about itself, kept on its own disk: measurements that only change with
the hardware and the torch build are taken once per node, not by every probe.

One directory per node (`OFFLOAD_COMPUTE_CACHE`, default ~/.cache/offload-coordinator), one JSON
file per measurement, named by a digest of everything the measurement depends on. A file that
is missing or does not parse is measured again and rewritten; a directory that cannot be written
leaves every probe measuring, as it would without a cache. Nothing here imports torch: a probe
on a node without GPUs reads its cached numbers without paying for torch's import.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "OFFLOAD_COMPUTE_CACHE"


def torch_version() -> str:
    """The installed torch's version, read from its package metadata (no import of torch); the
    imported module's where the metadata is missing (a source tree on the path)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def cache_file(kind: str, key: object) -> Path:
    """The file of the measurement `kind` whose inputs are `key` (anything JSON can write;
    reprs for the rest)."""
    text = json.dumps(key, sort_keys=True, default=repr)
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "offload-coordinator")
    return root / kind / f"{digest}.json"


def read(path: Path) -> dict | None:
    """The JSON object at `path`; None where there is none or it does not parse."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write(path: Path, data: dict) -> None:
    """`data` at `path`, whole or not at all (a reader never sees half a file); nothing where
    the directory cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass


@contextlib.contextmanager
def measuring(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s measurement while one process takes it: processes probing
    one host at once (its Ray nodes, simulated GPUs on a laptop or CI) take it once, never two
    of them side by side timing each other. None where the directory cannot be written.
    An flock ends with its process, so a probe that dies measuring never blocks the next."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
