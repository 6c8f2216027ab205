"""Simulated GPUs that hold memory as real ones do.

Without CUDA the CPU stands in for each GPU of a node (Ray's logical GPUs). By default such a
GPU has no size of its own: `--gpu-memory` is its budget, whatever runs beside it. With
`OFFLOAD_SIMULATED_GPU_MEMORY` set on a node (its environment, or a job override through
`runtime_env`), each simulated GPU there has that total, and its free memory is the total less
what the processes on it hold, as `torch.cuda.mem_get_info` answers on a real GPU:

- a worker writes what its stage holds on its GPU (resident weights, slots, KV pool) to the
  node's `DeviceLedger` once loaded, and takes it back when it closes;
- a probe reads the ledger for the GPUs it holds, and a surviving worker asked on a re-plan
  credits its own entry (`credit`), as its stage is replaced.

So the planner's real-GPU budget path (free memory, capped by `--gpu-memory`; the survivors'
own bytes credited) runs in CI. An entry of a process that has exited counts nothing (and is
removed), as the driver frees a dead process's memory. Node-local: the ledger is a directory of
small files, one per process and GPU, under the node's temp directory and its Ray node id.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from offload.errors import ConfigError
from offload.probe import DeviceInfo
from offload.sizes import parse_bytes

SIMULATED_GPU_MEMORY_ENV = "OFFLOAD_SIMULATED_GPU_MEMORY"
SIMULATED_DEVICE_NAME = "simulated GPU"


def simulated_gpu_memory(env: Mapping[str, str]) -> int | None:
    """The total of each simulated GPU of this node (`OFFLOAD_SIMULATED_GPU_MEMORY`, a size
    such as 16GiB), or None where it is not set."""
    value = env.get(SIMULATED_GPU_MEMORY_ENV, "").strip()
    if not value:
        return None
    total = parse_bytes(value, field_name=SIMULATED_GPU_MEMORY_ENV)
    if total <= 0:
        raise ConfigError(f"{SIMULATED_GPU_MEMORY_ENV}={value!r}: a GPU holds more than 0 bytes")
    return total


def _default_root() -> Path:
    return Path(tempfile.gettempdir()) / "offload-simulated-gpus"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@dataclass(frozen=True)
class DeviceLedger:
    """What each process holds on the simulated GPUs of one node (`node`: its Ray node id)."""

    node: str
    root: Path = field(default_factory=_default_root)

    def _entry(self, index: int, pid: int) -> Path:
        return self.root / self.node / f"gpu{index}" / str(pid)

    def hold(self, index: int, nbytes: int, pid: int | None = None) -> None:
        """Process `pid` (this one) now holds `nbytes` on GPU `index` (replacing what it held)."""
        path = self._entry(index, pid or os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(str(int(nbytes)))
        os.replace(partial, path)  # a reader sees the old value or the new one

    def release(self, index: int, pid: int | None = None) -> None:
        """Process `pid` (this one) holds nothing on GPU `index` any more."""
        self._entry(index, pid or os.getpid()).unlink(missing_ok=True)

    def holders(self, index: int) -> dict[int, int]:
        """Bytes held on GPU `index`, per live process."""
        held = {}
        directory = self.root / self.node / f"gpu{index}"
        for path in directory.glob("[0-9]*") if directory.is_dir() else ():
            pid = int(path.name)
            if not _alive(pid):
                path.unlink(missing_ok=True)  # its memory went with it
                continue
            with contextlib.suppress(OSError, ValueError):  # removed meanwhile: holds nothing
                held[pid] = int(path.read_text())
        return held

    def free(self, index: int, total: int, credit: Iterable[int] = ()) -> int:
        """GPU `index`'s free bytes: `total` less what live processes hold, those in `credit`
        (pids whose memory the caller counts as its own to replace) excepted."""
        credited = set(credit)
        held = sum(n for pid, n in self.holders(index).items() if pid not in credited)
        return max(0, total - held)

    def devices(
        self, indexes: Iterable[int], total: int, credit: Iterable[int] = ()
    ) -> tuple[DeviceInfo, ...]:
        """The simulated GPUs `indexes` as a probe reports devices: total and free."""
        credit = tuple(credit)
        return tuple(simulated_device(i, total, self.free(i, total, credit)) for i in indexes)


def simulated_device(index: int, total: int, free: int | None = None) -> DeviceInfo:
    """A simulated GPU of `total` bytes, `free` of them free (all when not given)."""
    return DeviceInfo(
        index=index,
        name=SIMULATED_DEVICE_NAME,
        capability=(0, 0),
        total_memory_bytes=total,
        integrated=False,
        free_memory_bytes=total if free is None else free,
    )
