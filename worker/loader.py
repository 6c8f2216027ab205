"""Reading tensors from safetensors files straight into their final place.

The header offsets (from the coordinator's index) say where each tensor's bytes are, so a
worker reads exactly its own bytes: into the arena for offloaded layers, into the parameter's
memory for resident ones on the CPU, and through a small pinned staging buffer for resident ones
on a GPU. No full second copy of the weights exists at any point.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

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


PIECE_BYTES = 8 * 2**20  # unit of parallel reads: big enough for one syscall to pay off


def _pread_exact(fd: int, view: memoryview, offset: int, where: str) -> None:
    """Fill `view` from `offset` of `fd` (pread: no shared file position, so threads can share
    the descriptor)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise OSError(f"{where}: file ended after {done} of {len(view)} bytes")
        done += n


class TensorReader:
    """Reads tensor bytes of one checkpoint directory into given tensors.

    CPU destinations are filled by `threads` threads in 8 MiB pieces: filling fresh memory is
    bound by page faults, which a second core nearly halves (1.0 -> 1.7 GB/s here, see
    bench/RESULTS.md). GPU destinations go through a pinned staging buffer.
    """

    def __init__(self, root: str | os.PathLike, *, threads: int = 1) -> None:
        self.root = Path(root)
        self.threads = max(1, threads)
        self._fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._staging: torch.Tensor | None = None
        self.stats = ReadStats()

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = os.open(self.root / name, os.O_RDONLY)
        return self._fds[name]

    def read_into(self, tensor: TensorSlice, dst: torch.Tensor) -> None:
        """Fill `dst` (same dtype and shape as `tensor`) with the tensor's bytes from disk."""
        self.read_many([(tensor, dst)])

    def read_many(self, items: Sequence[tuple[TensorSlice, torch.Tensor]]) -> None:
        """Fill each destination with its tensor's bytes; pieces of all of them in parallel."""
        pieces: list[tuple[int, memoryview, int, str]] = []
        for tensor, dst in items:
            if tuple(dst.shape) != tensor.shape or dst.dtype != tensor.torch_dtype:
                raise ValueError(
                    f"{tensor.file}: tensor {tensor.name!r} is {tensor.dtype}{list(tensor.shape)} "
                    f"but its destination is {dst.dtype}{list(dst.shape)}"
                )
            where = f"{tensor.file}: tensor {tensor.name!r}"
            fd = self._fd(tensor.file)
            if dst.device.type == "cpu" and dst.is_contiguous():
                view = memoryview(_as_bytes(dst).numpy())
                for begin in range(0, tensor.nbytes, PIECE_BYTES):
                    end = min(begin + PIECE_BYTES, tensor.nbytes)
                    pieces.append((fd, view[begin:end], tensor.start + begin, where))
            else:
                self._read_staged(fd, tensor, dst, where)
            self.stats.bytes_read += tensor.nbytes
            self.stats.tensors += 1
            self.stats.files.add(tensor.file)
        if self.threads == 1 or len(pieces) < 2:
            for piece in pieces:
                _pread_exact(*piece)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="offload-read")
        for future in [self._pool.submit(_pread_exact, *piece) for piece in pieces]:
            future.result()  # re-raises the first failed read

    def _read_staged(self, fd: int, tensor: TensorSlice, dst: torch.Tensor, where: str) -> None:
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
            _pread_exact(fd, memoryview(chunk.numpy()), tensor.start + begin, where)
            out[begin : begin + n].copy_(chunk)  # synchronous: the staging buffer is reused

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._staging = None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
