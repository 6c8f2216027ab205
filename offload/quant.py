"""Offloaded weights kept in 8 bits: block formats, and quantizing into / dequantizing out of them.

An offloaded weight crosses the link once per step for every sequence of the batch, so its bytes
in host memory are the bytes that cost time. A `BlockFormat` keeps a weight of shape
(..., rows, cols) as 8-bit values (float8 e4m3 or int8) and one float32 scale per block of
`block` = (block_rows, block_cols) entries of its last two dimensions: the block-FP8 layout
DeepSeek-V3, Kimi-K2 and the Qwen3 `-FP8` checkpoints publish (128 x 128 blocks,
`weight_scale_inv`), or groups of one row (1 x 128) for weights quantized at load
(`--offload-dtype`). A weight takes 1 byte per entry plus 4 bytes per block: 0.50x-0.52x its
bfloat16 bytes.

As the format defines it, the blocks start at row 0 and column 0 and the last block of each of
the two dimensions is partial where the dimension is no multiple of the block: the grid of
scales is ceil(rows / block_rows) x ceil(cols / block_cols) (DeepSeek-V3's 576-row
`kv_a_proj_with_mqa` has 5 block rows, the last of 64 rows). The block is never what the grid
divides the shape into: a 192-row weight in 128-row blocks has 2 block rows of 128 and 64.

A value is its 8-bit entry times its block's scale, computed in float32 and rounded once to the
model's dtype: `(q.float() * scale).to(dtype)`, what DeepSeek's `weight_dequant` computes (and
transformers, where its blocks divide the weight). So a weight dequantized after its copy to the
device is bitwise the weight dequantized while read from the same file. Work goes in row chunks
(`CHUNK_ELEMENTS`), so the float32 temporaries of a large fused expert tensor stay small.
Checkpoint scales stored in other dtypes become float32 exactly (`scales_as_float32`).

`QuantizedTensor` is the pair (values, scales) of one weight in host memory, with `select` and
`narrow` as a tensor has them, so a loader reads one expert's tensor into its part of a fused
parameter exactly as it does for a plain one (`worker.spec.apply_view`). It holds a weight of
either format: a `BlockFormat`, or gpt-oss's 4-bit `offload.mxfp4.Mxfp4Format`, which speaks
the same language (`WeightFormat`: values and scales shapes and dtypes, the pieces of stored
rows a weight crosses the link in, the rows of the parameter a piece dequantizes into).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from offload.arena import align_up

# The largest magnitude each 8-bit dtype holds: a block's scale maps its largest entry there.
QMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
FORMAT_NAMES: dict[torch.dtype, str] = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
SCALE_DTYPE = torch.float32
# What a checkpoint's block scales may be stored as (`scales_as_float32`); in memory they are
# SCALE_DTYPE
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)
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
        """Whether a weight of `shape` is blocked in this format: it has the two dimensions the
        blocks cover (the last block of each may be partial)."""
        return len(shape) >= 2

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The grid of scales of a weight of `shape`: ceil(rows / block) x ceil(cols / block)
        over its last two dimensions."""
        if not self.fits(shape):
            raise ValueError(f"a weight of shape {list(shape)} has no two dims for {self} blocks")
        rows, cols = self.block
        return (*shape[:-2], _cdiv(shape[-2], rows), _cdiv(shape[-1], cols))

    def row_pieces(
        self, shape: tuple[int, ...], max_rows: int
    ) -> Iterator[tuple[int, int, int, int]]:
        """(first, end, first scale row, end scale row) of the pieces a weight of `shape` is
        worked in, seen as (rows, cols) with its scales as (scale rows, scale cols): whole block
        rows, at most `max_rows` rows (one block row at least), each with the scale rows it
        takes. A stacked weight (..., rows, cols) whose rows end in a partial block is worked
        one matrix at a time: there its rows and its scale rows no longer run in step."""
        matrix_rows, block_rows = shape[-2], self.block[0]
        total = math.prod(shape[:-1])
        if not total:
            return
        step = max(block_rows, max_rows // block_rows * block_rows)
        span = total if matrix_rows % block_rows == 0 else matrix_rows
        grid = _cdiv(matrix_rows, block_rows)
        for start in range(0, total, span):
            stop = min(start + span, total)
            for first in range(start, stop, step):
                end = min(first + step, stop)
                scale_first = first // matrix_rows * grid + first % matrix_rows // block_rows
                yield first, end, scale_first, scale_first + _cdiv(end - first, block_rows)

    def rows_per_piece(self, shape: tuple[int, ...]) -> int:
        """Rows (of the weight seen as (rows, cols)) that cross the link in one piece at most:
        whole block rows, as many as fit STAGING_BYTES (one block row at least)."""
        rows, cols = math.prod(shape[:-1]), shape[-1]
        group = self.block[0] * cols + _cdiv(cols, self.block[1]) * SCALE_DTYPE.itemsize
        return min(rows, max(1, STAGING_BYTES // group) * self.block[0])

    def scales_at(self, shape: tuple[int, ...]) -> int:
        """Where a piece's scales start in the staging buffer: after its largest values."""
        return align_up(self.rows_per_piece(shape) * self.row_bytes(shape))

    def staging_bytes(self, shape: tuple[int, ...]) -> int:
        """Device bytes of the staging buffer one piece of a weight of `shape` needs: its
        values, then its scales from `scales_at`, each aligned as the arena aligns."""
        rows, cols = self.rows_per_piece(shape), shape[-1]
        scales = _cdiv(rows, self.block[0]) * _cdiv(cols, self.block[1]) * SCALE_DTYPE.itemsize
        return self.scales_at(shape) + align_up(scales)

    @property
    def scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPE

    def values_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a weight's values in this format: its own."""
        return tuple(shape)

    def logical_shape(self, values_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The weight's shape, from its values' shape: the same."""
        return tuple(values_shape)

    def row_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of one row of values (the weight seen as (rows, cols))."""
        return shape[-1] * self.dtype.itemsize

    def scale_row_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of one row of scales: one block row's."""
        return _cdiv(shape[-1], self.block[1]) * SCALE_DTYPE.itemsize

    def rows(self, weight: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Rows first..end of `weight` seen as (rows, cols): a view, written through."""
        return _rows(weight, weight.shape[-1])[first:end]

    def dequantize_rows(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
        """dst (rows, cols) = the piece of values `q` (rows, cols) and its scale rows."""
        _dequantize_blocks(dst, QuantizedTensor(q, scales, self))

    def dequantize_into(self, dst: torch.Tensor, src: QuantizedTensor) -> None:
        _dequantize_blocks(dst, src)

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Host bytes of a weight of `shape` in this format: values and scales."""
        return math.prod(shape) + math.prod(self.scale_shape(shape)) * SCALE_DTYPE.itemsize

    def __str__(self) -> str:
        return f"{self.name} ({self.block[0]}x{self.block[1]} blocks)"


class QuantizedTensor:
    """The 8-bit values and float32 scales of one weight (or of a part of it: `select` and
    `narrow` take whole blocks, or the partial last one), as they sit in host memory."""

    __slots__ = ("fmt", "q", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, fmt: WeightFormat) -> None:
        if q.dtype != fmt.dtype or scales.dtype != fmt.scale_dtype:
            raise ValueError(
                f"a {fmt} weight needs {fmt.dtype} values and {fmt.scale_dtype} scales, got "
                f"{q.dtype} and {scales.dtype}"
            )
        shape = fmt.logical_shape(tuple(q.shape))
        if tuple(scales.shape) != fmt.scale_shape(shape):
            raise ValueError(
                f"scales {list(scales.shape)} do not match a {fmt} weight of shape {list(shape)}"
            )
        self.q, self.scales, self.fmt = q, scales, fmt

    @property
    def shape(self) -> torch.Size:
        """The weight's shape (its values' too, but for a packed format)."""
        return torch.Size(self.fmt.logical_shape(tuple(self.q.shape)))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def _block_of(self, dim: int) -> tuple[int, int]:
        """(dim normalised, the block size along it: 1 outside the last two dims). A packed
        format's last two dims are stored transposed: no part of them is taken."""
        ndim = self.q.dim()
        dim %= ndim
        if dim >= ndim - 2 and not isinstance(self.fmt, BlockFormat):
            raise ValueError(f"cannot take a part of dim {dim} of a {self.fmt} weight")
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
        ends_partial = start + length == self.q.shape[dim]  # the dim's partial last block
        if start % block or (length % block and not ends_partial):
            raise ValueError(
                f"rows {start}..{start + length} of dim {dim} are not whole {self.fmt} blocks"
            )
        return QuantizedTensor(
            self.q.narrow(dim, start, length),
            self.scales.narrow(dim, start // block, _cdiv(length, block)),
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
        out = torch.empty(self.shape, dtype=dtype, device=device)
        dequantize_into(out, self)
        return out

    def __repr__(self) -> str:
        return f"QuantizedTensor({list(self.shape)}, {self.fmt})"


def scales_as_float32(raw: torch.Tensor) -> torch.Tensor:
    """A checkpoint's block scales as float32, each the number its dtype defines: float32 as
    it is, bfloat16 and float16 exactly, E8M0 (`float8_e8m0fnu`, or its bytes as uint8, as
    MXFP8 checkpoints ship them) 2^(x - 127), never the byte's value."""
    if raw.dtype == torch.uint8:
        raw = raw.view(torch.float8_e8m0fnu)
    if raw.dtype not in SCALE_DTYPES:
        raise ValueError(f"block scales of dtype {raw.dtype} are not one of {SCALE_DTYPES}")
    return raw.to(SCALE_DTYPE)


def _rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """`t` as (rows, cols), a view: the chunked loops write through it."""
    if not t.is_contiguous():
        raise ValueError(f"a blocked weight must be contiguous (shape {list(t.shape)})")
    return t.view(-1, cols)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _factors(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Each entry's scale for a piece of `rows` x `cols` starting at a block edge, from its
    scale rows `scales`: the last block of each dim cut to what the piece has of it."""
    block_rows, block_cols = block
    by_row = scales.repeat_interleave(block_rows, dim=0)[:rows]
    return by_row.repeat_interleave(block_cols, dim=1)[:, :cols]


def dequantize_into(dst: torch.Tensor, src: QuantizedTensor) -> None:
    """dst = `src` dequantized as its format defines (rounded once to dst's dtype)."""
    src.fmt.dequantize_into(dst, src)


def _dequantize_blocks(dst: torch.Tensor, src: QuantizedTensor) -> None:
    """dst = each value times its block's scale in float32, rounded once to dst's dtype."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"dequantize {list(src.shape)} into {list(dst.shape)}")
    if not dst.is_contiguous():  # a strided part of a parameter: through a temporary
        dst.copy_(src.dequantized(dst.dtype, dst.device))
        return
    fmt, shape = src.fmt, tuple(src.shape)
    cols = shape[-1]
    q, scales, out = (
        _rows(src.q, cols),
        _rows(src.scales, _cdiv(cols, fmt.block[1])),
        _rows(dst, cols),
    )
    for first, end, s_first, s_end in fmt.row_pieces(shape, CHUNK_ELEMENTS // max(cols, 1)):
        factors = _factors(scales[s_first:s_end], end - first, cols, fmt.block)
        out[first:end].copy_((q[first:end].float() * factors).to(dst.dtype))


def quantize_into(dst: QuantizedTensor, src: torch.Tensor) -> None:
    """Quantize the full-width weight `src` into `dst`: each block's scale maps its largest
    magnitude to the dtype's largest (QMAX), values rounded to nearest (saturating). A partial
    block's scale is its own entries' (zeros pad it to a whole block for the maximum)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"quantize {list(src.shape)} into {list(dst.shape)}")
    if not isinstance(dst.fmt, BlockFormat):
        raise ValueError(f"nothing is quantized into {dst.fmt}: it is read as published")
    fmt, shape = dst.fmt, tuple(dst.shape)
    block_rows, block_cols = fmt.block
    cols = shape[-1]
    grid_cols = _cdiv(cols, block_cols)
    qmax = QMAX[fmt.dtype]
    weights = src.reshape(-1, cols)
    q, scales = _rows(dst.q, cols), _rows(dst.scales, grid_cols)
    for first, end, s_first, s_end in fmt.row_pieces(shape, CHUNK_ELEMENTS // max(cols, 1)):
        chunk = weights[first:end].to(device=q.device, dtype=torch.float32)
        whole = chunk
        if (s_end - s_first) * block_rows != end - first or grid_cols * block_cols != cols:
            whole = chunk.new_zeros((s_end - s_first) * block_rows, grid_cols * block_cols)
            whole[: end - first, :cols] = chunk
        blocks = whole.view(s_end - s_first, block_rows, grid_cols, block_cols)
        amax = blocks.abs().amax(dim=(1, 3))
        # divided by a tensor: CUDA divides by a host scalar as a product with its reciprocal
        # (a bit off IEEE division), and a weight must quantize alike wherever it is
        scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
        scales[s_first:s_end].copy_(scale)
        scaled = chunk / _factors(scale, end - first, cols, fmt.block)
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


if TYPE_CHECKING:
    from offload.mxfp4 import Mxfp4Format

    # how an offloaded weight is kept: 8 bits in blocks, or gpt-oss's 4 bits
    WeightFormat = BlockFormat | Mxfp4Format
