"""Offloaded weights kept in 8 bits: block formats, and quantizing into / dequantizing out of them.

An offloaded weight crosses the link once per step for every sequence of the batch, so its bytes
in host memory are the bytes that cost time. A `BlockFormat` keeps a weight of shape
(..., rows, cols) as 8-bit values (float8 e4m3 or int8) and one float32 scale per block of
`block` = (block_rows, block_cols) entries of its last two dimensions: the block-FP8 layout
DeepSeek-V3 and the Qwen3 `-FP8` checkpoints publish (128 x 128 blocks, `weight_scale_inv`), or
groups of one row (1 x 128) for weights quantized at load (`--offload-dtype`). A weight takes
1 byte per entry plus 4 bytes per block: 0.50x-0.52x its bfloat16 bytes.

A value is its 8-bit entry times its block's scale, computed in float32 and rounded once to the
model's dtype: `(q.float() * scale).to(dtype)`, what transformers computes when it loads a
block-FP8 checkpoint on a machine without FP8 matmuls. So a weight dequantized after its copy to
the device is bitwise the weight transformers loads from the same file. Work goes in row chunks
(`CHUNK_ELEMENTS`), so the float32 temporaries of a large fused expert tensor stay small.

`QuantizedTensor` is the pair (values, scales) of one weight in host memory, with `select` and
`narrow` as a tensor has them, so a loader reads one expert's tensor into its part of a fused
parameter exactly as it does for a plain one (`worker.spec.apply_view`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.arena import align_up

# The largest magnitude each 8-bit dtype holds: a block's scale maps its largest entry there.
QMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
FORMAT_NAMES: dict[torch.dtype, str] = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
SCALE_DTYPE = torch.float32
# Entries per chunk of a quantize or dequantize: 4 Mi entries, 16 MiB per float32 temporary.
CHUNK_ELEMENTS = 4 * 2**20
# A quantized weight's scales beside its values in a host arena: f"{key}{SCALE_KEY_SUFFIX}".
SCALE_KEY_SUFFIX = "#scale"
# An 8-bit weight crosses the link in pieces of whole block rows of at most this many bytes
# (values and their scales), each dequantized into place on the device after its copy: the
# device holds one such piece beside the slots, not a whole layer. 32 MiB take ~0.6 ms at PCIe
# 5 speed, so the ~10 us a copy costs to issue is ~2% of it.
STAGING_BYTES = 32 * 2**20


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """8-bit `dtype` values, one float32 scale per `block` (rows, cols) of the last two dims."""

    dtype: torch.dtype
    block: tuple[int, int]

    def __post_init__(self) -> None:
        if self.dtype not in QMAX:
            raise ValueError(
                f"BlockFormat.dtype={self.dtype} is not one of {', '.join(str(d) for d in QMAX)}"
            )
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"BlockFormat.block={self.block} must be two sizes >= 1")

    @property
    def name(self) -> str:
        return FORMAT_NAMES[self.dtype]

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of `shape` splits into whole blocks."""
        rows, cols = self.block
        return len(shape) >= 2 and shape[-2] % rows == 0 and shape[-1] % cols == 0

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.fits(shape):
            raise ValueError(f"a weight of shape {list(shape)} does not split into {self} blocks")
        return (*shape[:-2], shape[-2] // self.block[0], shape[-1] // self.block[1])

    def rows_per_piece(self, shape: tuple[int, ...]) -> int:
        """Rows (of the weight seen as (rows, cols)) that cross the link in one piece: whole
        block rows, as many as fit STAGING_BYTES (one block row at least)."""
        rows, cols = math.prod(shape[:-1]), shape[-1]
        group = self.block[0] * cols + (cols // self.block[1]) * SCALE_DTYPE.itemsize
        return min(rows, max(1, STAGING_BYTES // group) * self.block[0])

    def staging_bytes(self, shape: tuple[int, ...]) -> int:
        """Device bytes of the staging buffer one piece of a weight of `shape` needs: its
        values, then its scales from `staging_offsets`, each aligned as the arena aligns."""
        rows, cols = self.rows_per_piece(shape), shape[-1]
        scales = rows // self.block[0] * (cols // self.block[1]) * SCALE_DTYPE.itemsize
        return staging_offsets(self, shape) + align_up(scales)

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Host bytes of a weight of `shape` in this format: values and scales."""
        return math.prod(shape) + math.prod(self.scale_shape(shape)) * SCALE_DTYPE.itemsize

    def __str__(self) -> str:
        return f"{self.name} ({self.block[0]}x{self.block[1]} blocks)"


class QuantizedTensor:
    """The 8-bit values and float32 scales of one weight (or of a part of it: `select` and
    `narrow` take whole blocks), as they sit in host memory."""

    __slots__ = ("fmt", "q", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat) -> None:
        if q.dtype != fmt.dtype or scales.dtype != SCALE_DTYPE:
            raise ValueError(
                f"a {fmt} weight needs {fmt.dtype} values and float32 scales, got {q.dtype} "
                f"and {scales.dtype}"
            )
        if tuple(scales.shape) != fmt.scale_shape(tuple(q.shape)):
            raise ValueError(
                f"scales {list(scales.shape)} do not match a {fmt} weight of shape {list(q.shape)}"
            )
        self.q, self.scales, self.fmt = q, scales, fmt

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def _block_of(self, dim: int) -> tuple[int, int]:
        """(dim normalised, the block size along it: 1 outside the last two dims)."""
        ndim = self.q.dim()
        dim %= ndim
        if dim == ndim - 2:
            return dim, self.fmt.block[0]
        if dim == ndim - 1:
            return dim, self.fmt.block[1]
        return dim, 1

    def select(self, dim: int, index: int) -> QuantizedTensor:
        dim, _ = self._block_of(dim)
        if dim >= self.q.dim() - 2:
            raise ValueError(f"cannot select along dim {dim} of a {self.fmt} weight: it is blocked")
        return QuantizedTensor(self.q.select(dim, index), self.scales.select(dim, index), self.fmt)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        dim, block = self._block_of(dim)
        if start % block or length % block:
            raise ValueError(
                f"rows {start}..{start + length} of dim {dim} are not whole {self.fmt} blocks"
            )
        return QuantizedTensor(
            self.q.narrow(dim, start, length),
            self.scales.narrow(dim, start // block, length // block),
            self.fmt,
        )

    def copy_(self, src: torch.Tensor | QuantizedTensor) -> QuantizedTensor:
        """Take `src`: the same format's values and scales as they are, or a full-width
        weight quantized (`quantize_into`)."""
        if isinstance(src, QuantizedTensor):
            if src.fmt != self.fmt:
                raise ValueError(f"cannot copy a {src.fmt} weight into a {self.fmt} one")
            self.q.copy_(src.q)
            self.scales.copy_(src.scales)
        else:
            quantize_into(self, src)
        return self

    def dequantized(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        out = torch.empty(self.q.shape, dtype=dtype, device=device)
        dequantize_into(out, self)
        return out

    def __repr__(self) -> str:
        return f"QuantizedTensor({list(self.q.shape)}, {self.fmt})"


def staging_offsets(fmt: BlockFormat, shape: tuple[int, ...]) -> int:
    """Where a piece's scales start in the staging buffer: after its largest values."""
    return align_up(fmt.rows_per_piece(shape) * shape[-1])


def _rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """`t` as (rows, cols), a view: the chunked loops write through it."""
    if not t.is_contiguous():
        raise ValueError(f"a blocked weight must be contiguous (shape {list(t.shape)})")
    return t.view(-1, cols)


def _row_chunks(total_rows: int, cols: int, block_rows: int):
    """[first, end) row ranges of whole blocks, about CHUNK_ELEMENTS entries each."""
    step = max(block_rows, CHUNK_ELEMENTS // max(cols, 1) // block_rows * block_rows)
    for first in range(0, total_rows, step):
        yield first, min(first + step, total_rows)


def _factors(scales: torch.Tensor, first: int, end: int, block: tuple[int, int]) -> torch.Tensor:
    """Each entry's scale for rows [first, end) (whole blocks), as (end - first, cols)."""
    block_rows, block_cols = block
    rows = scales[first // block_rows : end // block_rows]
    return rows.repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)


def dequantize_into(dst: torch.Tensor, src: QuantizedTensor) -> None:
    """dst = each value times its block's scale in float32, rounded once to dst's dtype."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"dequantize {list(src.shape)} into {list(dst.shape)}")
    if not dst.is_contiguous():  # a strided part of a parameter: through a temporary
        dst.copy_(src.dequantized(dst.dtype, dst.device))
        return
    cols = src.shape[-1]
    q, scales, out = (
        _rows(src.q, cols),
        _rows(src.scales, cols // src.fmt.block[1]),
        _rows(dst, cols),
    )
    for first, end in _row_chunks(q.shape[0], cols, src.fmt.block[0]):
        factors = _factors(scales, first, end, src.fmt.block)
        out[first:end].copy_((q[first:end].float() * factors).to(dst.dtype))


def quantize_into(dst: QuantizedTensor, src: torch.Tensor) -> None:
    """Quantize the full-width weight `src` into `dst`: each block's scale maps its largest
    magnitude to the dtype's largest (QMAX), values rounded to nearest (saturating)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"quantize {list(src.shape)} into {list(dst.shape)}")
    fmt = dst.fmt
    block_rows, block_cols = fmt.block
    cols = src.shape[-1]
    qmax = QMAX[fmt.dtype]
    weights = src.reshape(-1, cols)
    q, scales = _rows(dst.q, cols), _rows(dst.scales, cols // block_cols)
    for first, end in _row_chunks(weights.shape[0], cols, block_rows):
        chunk = weights[first:end].to(device=q.device, dtype=torch.float32)
        blocks = chunk.view((end - first) // block_rows, block_rows, cols // block_cols, block_cols)
        amax = blocks.abs().amax(dim=(1, 3))
        # divided by a tensor: CUDA divides by a host scalar as a product with its reciprocal
        # (a bit off IEEE division), and a weight must quantize alike wherever it is
        scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
        scales[first // block_rows : end // block_rows].copy_(scale)
        scaled = chunk / _factors(scale, 0, end - first, fmt.block)
        if fmt.dtype == torch.int8:
            scaled = scaled.round()
        q[first:end].copy_(scaled.clamp(-qmax, qmax).to(fmt.dtype))


def quantized(src: torch.Tensor, fmt: BlockFormat) -> QuantizedTensor:
    """A new QuantizedTensor of `src` (on src's device)."""
    shape = tuple(src.shape)
    out = QuantizedTensor(
        torch.empty(shape, dtype=fmt.dtype, device=src.device),
        torch.empty(fmt.scale_shape(shape), dtype=SCALE_DTYPE, device=src.device),
        fmt,
    )
    quantize_into(out, src)
    return out
