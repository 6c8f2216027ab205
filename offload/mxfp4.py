"""MXFP4 as gpt-oss publishes it: 4-bit e2m1 values, one E8M0 scale per 32 of them.

gpt-oss-20b and -120b ship each layer's fused expert projections (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) as a pair of uint8 tensors (`quantization_config.quant_method`
"mxfp4"):
- `<name>_blocks` [experts, rows, groups, 16]: each byte two e2m1 values, the low nibble the
  even-numbered one; a nibble is a sign bit and an index into E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- `<name>_scales` [experts, rows, groups]: each byte x is the E8M0 scale 2^(x - 127) of the 32
  values of its group.

The stored matrix is the transpose of the model's parameter: `gate_up_proj` is [experts, hidden,
2 x intermediate] in the model, [experts, 2 x intermediate, hidden / 32, 16] in the file (the
file's rows are the parameter's columns, its groups run along the parameter's rows). So a
weight of (parameter) shape (..., cols, rows) is kept as values (..., rows, cols / 2) and scales
(..., rows, cols / 32), 4.25 bits a value: 0.27x its bfloat16 bytes.

A value is its e2m1 number times 2^(x - 127), computed in float32 (`torch.ldexp`) and rounded
once to the model's dtype: what transformers' `convert_moe_packed_tensors` computes (its table
in the model's dtype holds the same numbers, and its `ldexp` multiplies in float32 too), so a
weight dequantized on the device after its copy is bitwise the one transformers loads with
`Mxfp4Config(dequantize=True)`.

`Mxfp4Format` speaks the same language as `offload.quant.BlockFormat` (values and scales in the
arena, pieces of stored rows that cross the link through a staging buffer and are dequantized
into their place in a slot), so the host arena, the prefetch offloader and the loader keep a
weight in 4 bits the way they keep one in 8. Nothing is ever quantized into it here: it is read
as published.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from offload.arena import align_up
from offload.quant import CHUNK_ELEMENTS, STAGING_BYTES

if TYPE_CHECKING:
    from offload.quant import QuantizedTensor

# e2m1's 16 codes: a sign bit over the index into the 8 magnitudes
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per E8M0 scale
E8M0_BIAS = 127  # a scale byte x is 2^(x - E8M0_BIAS)
_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.tensor(E2M1, dtype=torch.float32, device=device)
    return table


@dataclass(frozen=True, slots=True)
class Mxfp4Format:
    """gpt-oss's MXFP4 (module doc) of a weight of shape (..., cols, rows): uint8 values
    (..., rows, cols / 2), uint8 E8M0 scales (..., rows, cols / GROUP). "Rows" below are the
    stored rows: the parameter's last dim."""

    @property
    def name(self) -> str:
        return "mxfp4"

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of `shape` can be kept so: two dims or more, whole groups along
        its second to last (the file's groups)."""
        return len(shape) >= 2 and shape[-2] > 0 and shape[-2] % GROUP == 0

    def _check(self, shape: tuple[int, ...]) -> None:
        if not self.fits(shape):
            raise ValueError(
                f"a weight of shape {list(shape)} is no {self}: it needs two dims, the second to "
                f"last a multiple of {GROUP}"
            )

    def values_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        self._check(shape)
        return (*shape[:-2], shape[-1], shape[-2] // 2)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        self._check(shape)
        return (*shape[:-2], shape[-1], shape[-2] // GROUP)

    def logical_shape(self, values_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The weight's shape, from its values' shape."""
        return (*values_shape[:-2], values_shape[-1] * 2, values_shape[-2])

    def row_bytes(self, shape: tuple[int, ...]) -> int:
        return shape[-2] // 2

    def scale_row_bytes(self, shape: tuple[int, ...]) -> int:
        return shape[-2] // GROUP

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Host bytes of a weight of `shape`: values and scales."""
        self._check(shape)
        return math.prod(shape) // 2 + math.prod(shape) // GROUP

    def row_pieces(
        self, shape: tuple[int, ...], max_rows: int
    ) -> Iterator[tuple[int, int, int, int]]:
        """(first, end, first scale row, end scale row) of the pieces a weight of `shape` is
        worked in: at most `max_rows` stored rows, never two matrices (a stacked weight's
        stored rows are its matrices' columns: `rows` views one matrix at a time). A stored
        row has its own row of scales."""
        rows, matrices = shape[-1], math.prod(shape[:-2])
        step = max(1, max_rows)
        for matrix in range(matrices):
            for first in range(0, rows, step):
                end = min(first + step, rows)
                start = matrix * rows
                yield start + first, start + end, start + first, start + end

    def rows_per_piece(self, shape: tuple[int, ...]) -> int:
        """Stored rows that cross the link in one piece at most: as many as fit STAGING_BYTES
        (one at least), never more than one matrix has."""
        per_row = self.row_bytes(shape) + self.scale_row_bytes(shape)
        return min(shape[-1], max(1, STAGING_BYTES // max(per_row, 1)))

    def scales_at(self, shape: tuple[int, ...]) -> int:
        """Where a piece's scales start in the staging buffer: after its largest values."""
        return align_up(self.rows_per_piece(shape) * self.row_bytes(shape))

    def staging_bytes(self, shape: tuple[int, ...]) -> int:
        rows = self.rows_per_piece(shape)
        return self.scales_at(shape) + align_up(rows * self.scale_row_bytes(shape))

    def rows(self, weight: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Stored rows first..end of `weight` (the parameter's shape), as a (rows, cols) view
        of it (strided: the parameter's columns); they lie in one matrix (`row_pieces`)."""
        *_, cols, rows = weight.shape
        matrix, row = divmod(first, rows)
        if end - first > rows - row:
            raise ValueError(f"stored rows {first}..{end} cross a matrix of {rows} rows")
        return weight.view(-1, cols, rows)[matrix, :, row : row + end - first].t()

    def dequantize_rows(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
        """dst (rows, cols), any strides, = the values `q` (rows, cols / 2) times their
        scales `scales` (rows, cols / GROUP), in float32, rounded once to dst's dtype; in
        chunks of rows, so the float32 temporaries stay small."""
        rows, cols = dst.shape
        if tuple(q.shape) != (rows, cols // 2) or tuple(scales.shape) != (rows, cols // GROUP):
            raise ValueError(
                f"mxfp4 values {list(q.shape)} and scales {list(scales.shape)} do not make "
                f"{list(dst.shape)}"
            )
        table = _table(q.device)
        step = max(1, CHUNK_ELEMENTS // max(cols, 1))
        for first in range(0, rows, step):
            end = min(first + step, rows)
            packed = q[first:end]
            values = torch.stack((table[(packed & 0x0F).int()], table[(packed >> 4).int()]), -1)
            exponents = (scales[first:end].int() - E8M0_BIAS).repeat_interleave(GROUP, dim=1)
            out = torch.ldexp(values.view(end - first, cols), exponents)
            dst[first:end].copy_(out.to(dst.dtype))

    def dequantize_into(self, dst: torch.Tensor, src: QuantizedTensor) -> None:
        """dst (the weight's shape) = `src` dequantized (`dequantize_rows`)."""
        shape = tuple(src.shape)
        if tuple(dst.shape) != shape:
            raise ValueError(f"dequantize {list(shape)} into {list(dst.shape)}")
        if not dst.is_contiguous():  # a strided part of a parameter: through a temporary
            dst.copy_(src.dequantized(dst.dtype, dst.device))
            return
        q = src.q.reshape(-1, self.row_bytes(shape))
        scales = src.scales.reshape(-1, self.scale_row_bytes(shape))
        max_rows = max(1, CHUNK_ELEMENTS // max(shape[-2], 1))
        for first, end, _, _ in self.row_pieces(shape, max_rows):
            self.dequantize_rows(self.rows(dst, first, end), q[first:end], scales[first:end])

    def __str__(self) -> str:
        return f"mxfp4 (e2m1, {GROUP}-value groups)"
