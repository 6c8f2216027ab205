"""Reading tensors from safetensors files straight into their final place.

The header offsets (from the coordinator's index) say where each tensor's bytes are, so a
worker reads exactly its own bytes: into the arena for offloaded layers, into the parameter's
memory for resident ones on the CPU, and through a small staging buffer (page-locked only when
the node's decision pins) for resident ones on a GPU, for a dtype conversion (`--dtype`) and for
one expert's part of a fused MoE parameter. No full second copy of the weights exists at any point.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.arena import host_buffer
from offload.errors import CheckpointError
from offload.quant import (
    QuantizedTensor,
    dequantize_into,
    quantize_into,
    scales_as_float32,
)
from worker.node import hold_while_missing
from worker.spec import MAX_HEADER_BYTES, FileIdentity, TensorSlice, file_format

STAGING_BYTES = 64 * 2**20  # GPU loads go through this much host memory at a time


@dataclass(slots=True)
class ReadStats:
    bytes_read: int = 0
    tensors: int = 0
    files: set[str] = field(default_factory=set)
    # weights quantized at load (`--offload-dtype`): the sums of their squared entries and of
    # their squared quantization errors, for the relative error `quantization_error` reports
    quantized_sq: float = 0.0
    error_sq: float = 0.0

    @property
    def quantization_error(self) -> float:
        """Relative RMS error of the weights quantized at load: ||w - dq(q(w))|| / ||w||
        over all of them (0.0: none was)."""
        return (self.error_sq / self.quantized_sq) ** 0.5 if self.quantized_sq else 0.0


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


PIECE_BYTES = 8 * 2**20  # unit of parallel reads: big enough for one syscall to pay off


class CheckpointChangedError(CheckpointError):
    """A checkpoint file is not the file the job indexed; the message names it and the fix."""


def identify(fd: int, name: str) -> FileIdentity:
    """`name`'s identity from its open descriptor: size, modification time, header hash."""
    stat = os.fstat(fd)
    prefix = os.pread(fd, 8, 0)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    header = os.pread(fd, min(length, MAX_HEADER_BYTES), 8)
    return FileIdentity(
        name=name,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        header_sha256=hashlib.sha256(prefix + header).hexdigest(),
    )


def check_identity(fd: int, expected: FileIdentity) -> None:
    found = identify(fd, expected.name)
    if found == expected:
        return
    changes = [
        f"{what} {before} -> {after}"
        for what, before, after in (
            ("size", expected.size, found.size),
            ("mtime_ns", expected.mtime_ns, found.mtime_ns),
            ("header sha256", expected.header_sha256[:12], found.header_sha256[:12]),
        )
        if before != after
    ]
    raise CheckpointChangedError(
        f"{expected.name}: the checkpoint file changed since the job indexed it "
        f"({', '.join(changes)}); the job's other workers hold the old weights, so nothing is "
        "read from it: restore the file, or load the job again (unload, then load) to use "
        "the new one. Copies on other nodes must keep the file's mtime (rsync -a, cp -p)"
    )


def _pread_exact(fd: int, view: memoryview, offset: int, where: str) -> None:
    """Fill `view` from `offset` of `fd` (pread: no shared file position, so threads can share
    the descriptor)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise CheckpointError(f"{where}: file ended after {done} of {len(view)} bytes")
        done += n


# Tests only: a file path; every chunk a worker loads waits until that file exists (at most
# HOLD_MAX_S), so a test can act while a load is certainly under way (a signal, a kill) instead
# of racing it.
HOLD_ENV = "OFFLOAD_TEST_HOLD_LOAD"
HOLD_MAX_S = 60.0


def hold_if_asked() -> None:
    hold_while_missing(HOLD_ENV, HOLD_MAX_S)


# Tests only: a file path; a worker whose process id that file holds blocks each generation
# step while it does (at most HANG_MAX_S): a hung worker, which the engine must find and replace.
HANG_ENV = "OFFLOAD_TEST_HANG_STEP"
HANG_MAX_S = 300.0


def hang_if_asked() -> None:
    path = os.environ.get(HANG_ENV)
    deadline = time.monotonic() + HANG_MAX_S
    while path and time.monotonic() < deadline:
        try:
            with open(path) as f:
                if f.read().strip() != str(os.getpid()):
                    return
        except OSError:
            return
        time.sleep(0.05)


class TensorReader:
    """Reads tensor bytes of one checkpoint directory into given tensors.

    CPU destinations are filled by `threads` threads in 8 MiB pieces: filling fresh memory is
    bound by page faults, which a second core nearly halves (~1.0 GB/s per thread here:
    bench/RESULTS.md, distributed load). GPU destinations go through a staging buffer,
    page-locked when the node's decision pins (`pin`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        threads: int = 1,
        identities: Sequence[FileIdentity] = (),
        pin: bool = False,
    ) -> None:
        self.root = Path(root)
        self.threads = max(1, threads)
        self.pin = pin  # the node's pin decision: whether the staging buffer is page-locked
        self._identities = {identity.name: identity for identity in identities}
        self._fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._staging: torch.Tensor | None = None
        self.stats = ReadStats()

    def _fd(self, name: str) -> int:
        """The file's descriptor; on first open, checked against its indexed identity."""
        if name not in self._fds:
            fd = os.open(self.root / name, os.O_RDONLY)
            try:
                if name in self._identities:
                    check_identity(fd, self._identities[name])
            except BaseException:
                os.close(fd)
                raise
            self._fds[name] = fd
        return self._fds[name]

    def read_into(self, tensor: TensorSlice, dst: torch.Tensor) -> None:
        """Fill `dst` (same dtype and shape as `tensor`) with the tensor's bytes from disk."""
        self.read_many([(tensor, dst)])

    def read_many(
        self, items: Sequence[tuple[TensorSlice, torch.Tensor | QuantizedTensor]]
    ) -> None:
        """Fill each destination with its tensor's bytes; pieces of all of them in parallel.
        A destination of another dtype (the model's, when it differs from the file's), on a GPU,
        or not contiguous (part of a fused parameter) is filled through the staging buffer. An
        8-bit destination (`QuantizedTensor`, an offloaded weight kept in 8 bits) takes a
        block-FP8 tensor of its format as stored (in host memory, or on the GPU for a
        resident matrix kept as stored: `offload.resident`), and any other tensor quantized."""
        pieces: list[tuple[int, memoryview, int, str]] = []
        for tensor, dst in items:
            if tuple(dst.shape) != tensor.shape:
                raise ValueError(
                    f"{tensor.file}: tensor {tensor.name!r} is {tensor.dtype}{list(tensor.shape)} "
                    f"but its destination is {dst.dtype}{list(dst.shape)}"
                )
            where = f"{tensor.file}: tensor {tensor.name!r}"
            fd = self._fd(tensor.file)
            if isinstance(dst, QuantizedTensor):
                self._read_quantized(fd, tensor, dst, where)
            elif tensor.scale is not None:
                self._read_dequantized(fd, tensor, dst, where)
            elif (
                dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == tensor.torch_dtype
            ):
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
        """Rows of the tensor (its first dimension) at a time through the staging buffer, each
        copied into `dst` with `copy_`, which converts the dtype and crosses to the GPU."""
        rows = dst.reshape(1) if not tensor.shape else dst
        for first, source in self._staged_rows(fd, tensor, where):
            rows[first : first + len(source)].copy_(source)  # synchronous: the buffer is reused

    def _read_scales(self, tensor: TensorSlice, into: torch.Tensor | None = None) -> torch.Tensor:
        """An FP8 weight's scales, as float32: each the number its dtype defines
        (`offload.quant.scales_as_float32`: E8M0 bytes are 2^(x - 127)); a packed (MXFP4)
        weight's as the E8M0 bytes they are (uint8). Into `into` when given (straight from the
        file where the file's are of its dtype)."""
        scale = tensor.scale
        raw_dtype = torch.uint8 if tensor.packed else scale.torch_dtype
        direct = (
            into is not None
            and into.dtype == raw_dtype
            and into.is_contiguous()
            and into.device.type == "cpu"
        )
        raw = into if direct else torch.empty(scale.shape, dtype=raw_dtype)
        _pread_exact(
            self._fd(scale.file),
            memoryview(_as_bytes(raw).numpy()),
            scale.start,
            f"{scale.file}: tensor {scale.name!r}",
        )
        self.stats.bytes_read += scale.nbytes
        if direct:
            return into
        scales = raw if tensor.packed else scales_as_float32(raw)
        if into is not None:
            into.copy_(scales)
            return into
        return scales

    def _read_dequantized(
        self, fd: int, tensor: TensorSlice, dst: torch.Tensor, where: str
    ) -> None:
        """An FP8 weight (block FP8, or compressed-tensors FP8), rows at a time through the staging buffer (whole blocks of the
        config's `weight_block_size`, the last one partial where the rows are no multiple of
        it), each entry times its block's scale in float32, then in `dst`'s dtype
        (`offload.quant.dequantize_into`): DeepSeek's `weight_dequant`, so the weights are
        bitwise the ones the format defines, and the ones an 8-bit offloaded copy of it
        becomes on the device."""
        if tensor.packed:
            self._read_packed(fd, tensor, dst, where)
            return
        fmt = file_format(tensor)
        scales = self._read_scales(tensor)
        block_rows = fmt.block[0]
        # one block row (a per-tensor scale): any rows at a time, each piece a part of it
        multiple = block_rows if scales.shape[0] > 1 else 1
        for first, source in self._staged_rows(fd, tensor, where, multiple):
            count = len(source)
            part = scales[first // block_rows : -(-(first + count) // block_rows)]
            dequantize_into(dst[first : first + count], QuantizedTensor(source, part, fmt))

    def _read_packed(self, fd: int, tensor: TensorSlice, dst: torch.Tensor, where: str) -> None:
        """gpt-oss's MXFP4 weight (`offload.mxfp4`), dequantized into `dst` (the parameter's
        shape) in pieces of stored rows through the staging buffer, values and their scales
        read side by side: bitwise what transformers' `Mxfp4Config(dequantize=True)` loads."""
        fmt, shape, scale = file_format(tensor), tensor.shape, tensor.scale
        row, scale_row = fmt.row_bytes(shape), fmt.scale_row_bytes(shape)
        target = dst if dst.is_contiguous() else torch.empty(shape, dtype=dst.dtype)
        max_rows = max(1, STAGING_BYTES // (row + scale_row))
        buffer = self._buffer(max_rows * (row + scale_row))
        scale_fd, scale_where = self._fd(scale.file), f"{scale.file}: tensor {scale.name!r}"
        for first, end, _, _ in fmt.row_pieces(shape, max_rows):
            count = end - first
            q, s = buffer[: count * row], buffer[count * row : count * (row + scale_row)]
            _pread_exact(fd, memoryview(q.numpy()), tensor.start + first * row, where)
            _pread_exact(
                scale_fd, memoryview(s.numpy()), scale.start + first * scale_row, scale_where
            )
            fmt.dequantize_rows(
                fmt.rows(target, first, end), q.view(count, row), s.view(count, scale_row)
            )
        if target is not dst:
            dst.copy_(target)
        self.stats.bytes_read += scale.nbytes

    def _read_quantized(
        self, fd: int, tensor: TensorSlice, dst: QuantizedTensor, where: str
    ) -> None:
        """Into an 8-bit destination (or a 4-bit one): a tensor of the same format byte for
        byte (values and scales as the file has them; on a GPU through the staging buffer),
        anything else read at the model's width (FP8 dequantized) into a temporary of one
        tensor and quantized into `dst`."""
        if file_format(tensor) == dst.fmt:  # as stored: the file's bytes, no arithmetic
            if dst.q.device.type == "cpu" and dst.q.is_contiguous():
                _pread_exact(fd, memoryview(_as_bytes(dst.q).numpy()), tensor.start, where)
            elif dst.q.is_contiguous():  # on a GPU: through the staging buffer
                self._read_bytes_staged(fd, tensor, _as_bytes(dst.q), where)
            else:  # a strided part of a parameter: through a temporary of this tensor
                values = torch.empty(dst.q.shape, dtype=dst.q.dtype)
                _pread_exact(fd, memoryview(_as_bytes(values).numpy()), tensor.start, where)
                dst.q.copy_(values)
            self._read_scales(tensor, into=dst.scales)
            return
        wide = torch.empty(tensor.shape, dtype=tensor.target_torch_dtype)
        if tensor.scale is not None:
            self._read_dequantized(fd, tensor, wide, where)
        else:
            self._read_staged(fd, tensor, wide, where)
        quantize_into(dst, wide)
        # what quantizing lost, measured on the weight itself (the quality `status` shows)
        back = dst.dequantized(torch.float32)
        reference = wide.float()
        self.stats.quantized_sq += float(reference.square().sum())
        self.stats.error_sq += float((back - reference).square().sum())

    def _read_bytes_staged(
        self, fd: int, tensor: TensorSlice, dst: torch.Tensor, where: str
    ) -> None:
        """The tensor's bytes as they are into `dst` (uint8, as many, on a GPU), as many at a
        time as the staging buffer holds."""
        size = min(STAGING_BYTES, tensor.nbytes)
        staging = self._buffer(size)
        for begin in range(0, tensor.nbytes, size):
            end = min(begin + size, tensor.nbytes)
            chunk = staging[: end - begin]
            _pread_exact(fd, memoryview(chunk.numpy()), tensor.start + begin, where)
            dst[begin:end].copy_(chunk)  # synchronous: the buffer is reused

    def _staged_rows(
        self, fd: int, tensor: TensorSlice, where: str, multiple: int = 1
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, the rows read from there) of the tensor, in its own dtype, as many rows
        at a time as the staging buffer holds (a `multiple` of rows: whole blocks, but for the
        last rows); each view is overwritten by the next one."""
        shape = tensor.shape or (1,)
        row_bytes = tensor.nbytes // shape[0] if shape[0] else 0
        if not row_bytes:
            return
        size = max(STAGING_BYTES, row_bytes * multiple)
        staging = self._buffer(size)
        per_piece = size // row_bytes // multiple * multiple
        for first in range(0, shape[0], per_piece):
            count = min(per_piece, shape[0] - first)
            chunk = staging[: count * row_bytes]
            _pread_exact(fd, memoryview(chunk.numpy()), tensor.start + first * row_bytes, where)
            yield first, chunk.view(tensor.torch_dtype).view(count, *shape[1:])

    def _buffer(self, size: int) -> torch.Tensor:
        """The staging buffer, `size` bytes at least; what it held is overwritten."""
        if self._staging is None or self._staging.numel() < size:
            self._staging = host_buffer(size, pin=self.pin)
        return self._staging

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
