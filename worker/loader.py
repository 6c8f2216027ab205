"""Reading tensors from safetensors files straight into their final place.

The header offsets (from the coordinator's index) say where each tensor's bytes are, so a
worker reads exactly its own bytes: into the arena for offloaded layers, into the parameter's
memory for resident ones on the CPU, and through a small pinned staging buffer for resident ones
on a GPU. No full second copy of the weights exists at any point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from worker.spec import TensorSlice

STAGING_BYTES = 64 * 2**20  # GPU loads go through this much host memory at a time


@dataclass(slots=True)
class ReadStats:
    bytes_read: int = 0
    tensors: int = 0
    files: set[str] = field(default_factory=set)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _read_exact(f: BinaryIO, view: memoryview, where: str) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{where}: file ended after {done} of {len(view)} bytes")
        done += n


class TensorReader:
    """Open files of one checkpoint directory, read tensor bytes into given tensors."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._files: dict[str, BinaryIO] = {}
        self._staging: torch.Tensor | None = None
        self.stats = ReadStats()

    def _file(self, name: str) -> BinaryIO:
        if name not in self._files:
            self._files[name] = open(self.root / name, "rb", buffering=0)  # noqa: SIM115
        return self._files[name]

    def read_into(self, tensor: TensorSlice, dst: torch.Tensor) -> None:
        """Fill `dst` (same dtype and shape as `tensor`) with the tensor's bytes from disk."""
        if tuple(dst.shape) != tensor.shape or dst.dtype != tensor.torch_dtype:
            raise ValueError(
                f"{tensor.file}: tensor {tensor.name!r} is {tensor.dtype}{list(tensor.shape)} "
                f"but its destination is {dst.dtype}{list(dst.shape)}"
            )
        f = self._file(tensor.file)
        f.seek(tensor.start)
        where = f"{tensor.file}: tensor {tensor.name!r}"
        if dst.device.type == "cpu" and dst.is_contiguous():
            _read_exact(f, memoryview(_as_bytes(dst).numpy()), where)
        else:
            self._read_staged(f, tensor, dst, where)
        self.stats.bytes_read += tensor.nbytes
        self.stats.tensors += 1
        self.stats.files.add(tensor.file)

    def _read_staged(self, f: BinaryIO, tensor: TensorSlice, dst: torch.Tensor, where: str) -> None:
        if not dst.is_contiguous():
            raise ValueError(f"{where}: destination must be contiguous")
        if self._staging is None:
            self._staging = torch.empty(
                STAGING_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
        out = _as_bytes(dst)
        for begin in range(0, tensor.nbytes, STAGING_BYTES):
            n = min(STAGING_BYTES, tensor.nbytes - begin)
            chunk = self._staging[:n]
            _read_exact(f, memoryview(chunk.numpy()), where)
            out[begin : begin + n].copy_(chunk)  # synchronous: the staging buffer is reused

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._staging = None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
