"""What the driver tells a worker to load and run: plain, frozen, picklable values.

These types live in `worker/` because the worker must not import `coordinator/`; the
coordinator builds them from the checkpoint index and the plan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.names import (
    DEFAULT_BLOCK_SIZE,
    OFFLOAD_DTYPES,
    blocks_for,
)

if TYPE_CHECKING:
    import torch

    from offload.quant import WeightFormat

# safetensors dtype names -> torch's names of the same dtypes, and each dtype's size in bytes:
# plain values, so that an index and the specs built from it (the planner's, a named load's
# keeper's) never import torch. `torch_dtype_named` gives the torch dtype where one is needed.
SAFETENSORS_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",  # block-FP8 scales as DeepSeek's `ue8m0` stores them
}
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
}
FLOATING_DTYPES = frozenset(
    ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")
)


def dtype_size(dtype: str) -> int:
    """Bytes per element of safetensors dtype `dtype` ("BF16": 2)."""
    return DTYPE_BYTES[SAFETENSORS_NAMES[dtype]]


def torch_dtype_named(name: str) -> torch.dtype:
    """`torch.bfloat16` for "bfloat16": the names torch and transformers' configs use."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _itemsize(name: str) -> int:
    return DTYPE_BYTES[name] if name in DTYPE_BYTES else torch_dtype_named(name).itemsize


def _floating(name: str) -> bool:
    if name in DTYPE_BYTES:
        return name in FLOATING_DTYPES
    return torch_dtype_named(name).is_floating_point


# A view of a model parameter that one checkpoint tensor fills: ("select", dim, index) or
# ("narrow", dim, start, length), applied in order. Per-expert checkpoint tensors of a fused MoE
# parameter each fill one such view (see coordinator/planning/weight_map.py).
ViewOp = tuple[str, int, int] | tuple[str, int, int, int]


def apply_view(tensor: torch.Tensor, view: tuple[ViewOp, ...]) -> torch.Tensor:
    for op in view:
        if op[0] == "select":
            tensor = tensor.select(op[1], op[2])
        elif op[0] == "narrow":
            tensor = tensor.narrow(op[1], op[2], op[3])
        else:
            raise ValueError(f"unknown view op {op!r}")
    return tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSlice:
    """One tensor of a safetensors file: where its bytes are, and what they are."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint directory
    start: int  # absolute byte offsets in the file
    end: int
    # Where it goes: the model parameter (or persistent buffer) it fills, the part of it (empty:
    # all of it), and the dtype the model keeps it in (converted while reading when it differs).
    target: str = ""
    view: tuple[ViewOp, ...] = ()
    target_dtype: str = ""  # torch name, e.g. "bfloat16"; "" = as in the file
    # It fills a buffer (DeepSeek's router bias), not a parameter: offloaders move parameters
    # only, so a buffer stays on the device whatever its layer's plan.
    buffer: bool = False
    # An FP8 weight's scales (block FP8's `<name>_scale_inv`: float32, bfloat16 or E8M0;
    # compressed-tensors' `<name>_scale`), one per block, their shape that of the grid, and
    # its block (rows, cols): config.json's `quantization_config.weight_block_size` (or
    # compressed-tensors' `block_structure`; per tensor the whole matrix, per channel one row),
    # the grid ceil(shape / block), the last block of a dim partial where the dim is no
    # multiple of it. The weight is dequantized while reading, each block times its scale.
    scale: TensorSlice | None = None
    block: tuple[int, int] | None = None
    # "mxfp4": gpt-oss's 4-bit weights (`offload.mxfp4`): this slice is the file's
    # `<name>_blocks` (uint8 pairs of e2m1 values, stored transposed), `scale` its
    # `<name>_scales` (E8M0 bytes, one per 32 values), and `shape` the parameter's; "" otherwise
    packed: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes in the file (what a worker reads)."""
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the file's elements (a packed slice's: uint8, two values a byte)."""
        return torch_dtype_named(SAFETENSORS_NAMES[self.dtype])

    @property
    def target_name(self) -> str:
        """The torch name of the dtype the model keeps it in."""
        return self.target_dtype or SAFETENSORS_NAMES[self.dtype]

    @property
    def target_torch_dtype(self) -> torch.dtype:
        return torch_dtype_named(self.target_name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def loaded_bytes(self) -> int:
        """Bytes in memory once loaded, in the model's dtype."""
        return self.numel * _itemsize(self.target_name)


# safetensors itself refuses headers above 100 MB; a larger one is corrupt or hostile.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class FileIdentity:
    """A checkpoint file as the job indexed it. A worker reads from the file only while it still
    is this file: a checkpoint rewritten under a running job (same shapes, new weights) would
    otherwise give a replacement worker new layers beside the survivors' old ones, silently."""

    name: str
    size: int
    mtime_ns: int
    header_sha256: str  # of the 8-byte length and the JSON header: names, dtypes, offsets


# What a stage may offload of each of its offloaded decoder layers, the rest staying resident:
# a regular expression on a parameter's name within its layer (`OffloadConfig.param_filter`),
# None for the whole layer. Experts and MLPs are most of a layer's bytes and the least of its
# time per byte (an MoE step reads a few experts of many), attention and norms the opposite.
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")  # a decoder layer's MLP child
OFFLOAD_UNITS: dict[str, str | None] = {
    "experts": r"(^|\.)experts\.",
    "mlp": rf"^({'|'.join(MLP_NAMES)})\.",
    "layer": None,
}


# OFFLOAD_DTYPES (worker.names): how offloaded weights are kept; fp8 and int8 quantize in
# groups of QUANT_GROUP entries of a row.
QUANT_GROUP = 128
_QUANT_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}


def file_format(tensor: TensorSlice) -> WeightFormat | None:
    """The format a quantized checkpoint stores `tensor` in (None: not quantized): gpt-oss's
    MXFP4 for a packed slice, else an FP8 block format whose block is the config's
    (`TensorSlice.block`), never what the grid of scales divides the shape into (a 192-row
    weight in 128-row blocks has a grid of 2 rows, not blocks of 96). A dim no longer than
    its block is one block of its own size: the same numbers, and the parts of a fused
    parameter (each expert of a small MoE) stay whole blocks of it."""
    if tensor.scale is None:
        return None
    if tensor.packed == "mxfp4":
        from offload.mxfp4 import Mxfp4Format

        return Mxfp4Format()
    from offload.quant import BlockFormat  # torch: only a quantized checkpoint's tensors

    assert tensor.block is not None, f"{tensor.name}: scales without a block"
    block = tuple(max(1, min(b, n)) for b, n in zip(tensor.block, tensor.shape, strict=True))
    return BlockFormat(tensor.torch_dtype, block)


def _view_fits(fmt: WeightFormat, tensor: TensorSlice) -> bool:
    """Whether `tensor`'s part of its parameter (`tensor.view`) is whole blocks of `fmt`
    (a packed format's: the whole parameter, which it stores transposed):
    a narrow along one of the parameter's last two dims must start and end on a block edge
    (the narrows come before the selects, as `weight_map` builds the views). A part whose own
    last block is partial is never placed beside another: the parameter's grid would not be
    the parts' grids side by side (it is then kept at the model's width)."""
    if not fmt.fits(tensor.shape):
        return False
    if tensor.packed:
        return not tensor.view
    ndim = len(tensor.shape) + sum(op[0] == "select" for op in tensor.view)
    for op in tensor.view:
        if op[0] == "select":
            if op[1] % ndim >= ndim - 2:
                return False
            ndim -= 1
        else:
            dim = op[1] % ndim
            block = fmt.block[dim - ndim + 2] if dim >= ndim - 2 else 1
            if op[2] % block or op[3] % block:
                return False
    return True


# Modules whose weights decide where a token goes (an MoE router, a shared expert's gate, a
# gating network): kept at the model's width whatever `offload_dtype` asks. Rounding them to 8
# bits could change which experts a token is sent to: another computation, not a slightly
# different number. (A dense MLP's `gate_proj` is a projection, not a router.)
ROUTING_MODULES = frozenset({"gate", "router", "shared_expert_gate", "gating_network"})


def routes(target: str) -> bool:
    """Whether parameter `target` (e.g. `model.layers.3.mlp.gate.weight`) belongs to a module
    that routes tokens (ROUTING_MODULES)."""
    return any(part in ROUTING_MODULES for part in target.split(".")[:-1])


def offload_format(tensor: TensorSlice, offload_dtype: str) -> WeightFormat | None:
    """How checkpoint tensor `tensor` of an offloaded unit is kept in host memory under
    `offload_dtype` (OFFLOAD_DTYPES): a block format, or None for the model's width. Only
    matrices are quantized: never norms, biases, buffers, or the weights of what routes
    tokens (`routes`), which stay as the checkpoint has them (a block-FP8 file's own 8 bits
    stay 8 bits). gpt-oss's 4-bit weights stay 4 bits under every offload dtype but "none":
    fewer bytes than 8, and the very numbers the checkpoint holds."""
    if offload_dtype not in OFFLOAD_DTYPES:
        raise ValueError(
            f"offload_dtype={offload_dtype!r} is not one of {', '.join(OFFLOAD_DTYPES)}"
        )
    if (
        offload_dtype == "none"
        or tensor.buffer
        or len(tensor.shape) < 2
        or (tensor.target or tensor.name).endswith("bias")  # gpt-oss's [experts, width] too
        or not _floating(tensor.target_name)
        or (routes(tensor.target or tensor.name) and file_format(tensor) is None)
    ):
        return None
    fmt = file_format(tensor)
    requantized = offload_dtype == "int8" or (offload_dtype == "fp8" and fmt is None)
    if requantized and not tensor.packed:
        cols = tensor.shape[-1]
        group = QUANT_GROUP if cols % QUANT_GROUP == 0 else cols
        from offload.quant import BlockFormat  # torch: only where weights are kept in 8 bits

        fmt = BlockFormat(torch_dtype_named(_QUANT_DTYPES[offload_dtype]), (1, group))
    return fmt if fmt is not None and _view_fits(fmt, tensor) else None


def parameter_formats(
    tensors: Sequence[TensorSlice], offload_dtype: str
) -> dict[str, WeightFormat]:
    """The parameters (by target) that `tensors` fill whose every tensor takes the same block
    format under `offload_dtype`: the ones an offloader keeps in 8 bits."""
    found: dict[str, set] = {}
    for tensor in tensors:
        found.setdefault(tensor.target or tensor.name, set()).add(
            offload_format(tensor, offload_dtype)
        )
    return {
        target: next(iter(formats))
        for target, formats in found.items()
        if len(formats) == 1 and None not in formats
    }


def requantized_formats(
    tensors: Sequence[TensorSlice], offload_dtype: str
) -> dict[str, WeightFormat]:
    """Of `parameter_formats`, the parameters whose 8 bits are not the file's own (a block-FP8
    file's 8-bit weights are its numbers as published): the ones a reference must round the
    same way to compute with the offloader's weights."""
    return {
        target: fmt
        for target, fmt in parameter_formats(tensors, offload_dtype).items()
        if any(file_format(t) != fmt for t in tensors if (t.target or t.name) == target)
    }


def stored_formats(tensors: Sequence[TensorSlice]) -> dict[str, WeightFormat]:
    """The parameters (by target) that `tensors` fill which a GPU keeps as the checkpoint
    stores them when resident weights are "stored" (worker.names.RESIDENT_WEIGHTS): its
    quantized matrices (FP8 blocks, MXFP4), each whole in one format; never buffers."""
    return parameter_formats([t for t in tensors if not t.buffer], "auto")


def local_name(index: int, target: str) -> str:
    """A decoder layer's parameter name within the layer: `model.layers.3.mlp.up.weight` ->
    `mlp.up.weight` (the name the offloader's filter sees)."""
    _, sep, rest = target.partition(f".{index}.")
    return rest if sep else target


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSpec:
    """One pipeline unit: the embedding, a decoder layer, or the final norm + LM head."""

    name: str  # "embed", "layers.7", "head"
    kind: str  # "embed" | "decoder" | "head"
    index: int | None  # decoder layer index
    tensors: tuple[TensorSlice, ...]
    # KV cache of a decoder layer: bytes per cached token of one sequence
    kv_bytes_per_token: int = 0
    # recurrent state of one sequence (convolution and SSM / linear-attention states: mamba
    # and hybrid layers), whatever its length
    state_bytes: int = 0
    # an MoE decoder layer's routed experts and how many each token goes to (0: no experts)
    experts: int = 0
    experts_per_token: int = 0

    def pool_bytes(self, sequences: int, pool_tokens: int) -> int:
        """This layer's part of a KV pool of `pool_tokens` positions (every sequence's, in
        blocks: a sliding-window layer keeps them all too) with the recurrent states of
        `sequences` sequences running at once."""
        if pool_tokens <= 0:  # no generation (max_seq_len 0): no cache at all
            return 0
        return pool_tokens * self.kv_bytes_per_token + sequences * self.state_bytes

    def kv_bytes(self, sequences: int, tokens: int) -> int:
        """KV cache and recurrent state bytes for `sequences` sequences of up to `tokens`
        tokens each, each in whole blocks."""
        return self.pool_bytes(sequences, sequences * blocks_for(tokens) * DEFAULT_BLOCK_SIZE)

    @property
    def nbytes(self) -> int:
        """Bytes in memory once loaded: what the plan places on a GPU or in host memory."""
        return sum(t.loaded_bytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        """Bytes read from the checkpoint for this layer (FP8 weights' scales too)."""
        return sum(t.nbytes + (t.scale.nbytes if t.scale else 0) for t in self.tensors)

    def unit_tensors(self, unit: str) -> list[TensorSlice]:
        """The tensors offloading this decoder layer by `unit` (OFFLOAD_UNITS) moves to host
        memory; none for the embedding and head."""
        pattern = OFFLOAD_UNITS[unit]
        if self.kind != "decoder":
            return []
        return [
            t
            for t in self.tensors
            if not t.buffer
            and (pattern is None or re.search(pattern, local_name(self.index, t.target or t.name)))
        ]

    def unit_bytes(self, unit: str) -> int:
        """The device bytes offloading this decoder layer by `unit` frees (at the model's
        width); 0 where the unit matches nothing (or for the embedding and head)."""
        return sum(t.loaded_bytes for t in self.unit_tensors(unit))

    def resident_bytes(self, stored: bool = False) -> int:
        """Device bytes of this layer resident: at the model's width, or with its quantized
        matrices as stored (`stored_formats`: values and scales) when `stored`."""
        return self._device_bytes(list(self.tensors), stored)

    def freed_bytes(self, unit: str, stored: bool = False) -> int:
        """The device bytes offloading this layer by `unit` frees: `unit_bytes`, or with its
        quantized matrices as stored when resident weights are `stored`. (Its prefetch slot
        holds it at the model's width either way: `unit_bytes`.)"""
        return self._device_bytes(self.unit_tensors(unit), stored)

    def jit_bytes(self, expert_capacity: int = 0) -> int:
        """Bytes at the model's width of this layer's matrices kept as stored when resident
        (`stored_formats`): what the buffer they are dequantized into just in time holds. Its
        experts' matrices hold `expert_capacity` experts' rows of it where that is fewer than
        the layer has (`offload.resident`'s compact rows; 0: all of them)."""
        formats = stored_formats(self.tensors)
        kept = [t for t in self.tensors if (t.target or t.name) in formats]
        if not (self.experts and 0 < expert_capacity < self.experts):
            return sum(t.loaded_bytes for t in kept)
        experts = re.compile(OFFLOAD_UNITS["experts"])
        per_expert = [t for t in kept if experts.search(local_name(self.index, t.target or t.name))]
        rest = sum(t.loaded_bytes for t in kept if t not in per_expert)
        return rest + sum(t.loaded_bytes for t in per_expert) * expert_capacity // self.experts

    def _device_bytes(self, tensors: list[TensorSlice], stored: bool) -> int:
        formats = stored_formats(self.tensors) if stored else {}
        return sum(
            formats[t.target or t.name].stored_bytes(t.shape)
            if (t.target or t.name) in formats
            else t.loaded_bytes
            for t in tensors
        )

    def staging_bytes(self, unit: str, offload_dtype: str = "none") -> int:
        """Device bytes the staging buffer needs for this layer's `unit` offloaded under
        `offload_dtype`: one piece of its largest 8-bit weight (`BlockFormat.staging_bytes`);
        0 where nothing is kept in 8 bits."""
        tensors = self.unit_tensors(unit)
        formats = parameter_formats(tensors, offload_dtype)
        shapes: dict[str, tuple[int, ...]] = {}
        for t in tensors:
            target = t.target or t.name
            if target not in formats:
                continue
            if not t.view:  # the whole parameter
                shapes[target] = t.shape
            else:  # a part: the parameter seen as (rows, cols) of a block format
                rows = shapes.get(target, (0,))[0] + math.prod(t.shape[:-1])
                shapes[target] = (rows, t.shape[-1])
        return max(
            (formats[target].staging_bytes(shape) for target, shape in shapes.items()),
            default=0,
        )

    def stored_bytes(self, unit: str, offload_dtype: str = "none") -> int:
        """The host bytes of this layer's `unit` offloaded under `offload_dtype`: what its
        copy moves each step (8-bit values and scales where so, `parameter_formats`)."""
        tensors = self.unit_tensors(unit)
        formats = parameter_formats(tensors, offload_dtype)
        return sum(
            formats[t.target or t.name].stored_bytes(t.shape)
            if (t.target or t.name) in formats
            else t.loaded_bytes
            for t in tensors
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """Everything one worker needs: its layers, which of them are offloaded, and how."""

    stage: int
    num_stages: int
    checkpoint_dir: str
    config: dict  # the checkpoint's config.json
    dtype: str = "float32"  # the dtype the model is built and computes in (torch name)
    layers: tuple[LayerSpec, ...]
    files: tuple[FileIdentity, ...] = ()  # the checkpoint's files as indexed: checked on open
    offloaded: tuple[str, ...] = ()  # layer names kept in host memory
    offload_unit: str = "layer"  # what of each offloaded layer (OFFLOAD_UNITS); the rest stays
    prefetch_step: int = 1
    backend: str = "auto"
    backend_reason: str = ""  # why the plan chose `backend` for this node (reported)
    offload_dtype: str = "auto"  # how offloaded weights are kept (OFFLOAD_DTYPES)
    expert_fetch: str = "layer"  # how offloaded experts cross the link: "layer" or "routed"
    # routed: rows each offloaded experts module keeps on the device across steps (0: none)
    expert_cache: int = 0
    # routed: an experts call of at most this many rows runs on the host, reading its experts
    # in host memory (OffloadConfig.host_expert_rows; 0: never)
    host_expert_rows: int = 0
    # Device-resident quantized matrices kept as stored (`stored_formats`), each layer's
    # dequantized just in time (`offload.resident`); False: dequantized at load
    resident_stored: bool = False
    # Of those, an experts module's per-expert matrices hold this many experts' rows at width
    # at once (`offload.resident`: a call's experts dequantized into compact rows; 0: all)
    stored_expert_capacity: int = 0
    # The KV pool the plan reserved, allocated at load inside the budget check: `kv_blocks`
    # blocks of `kv_block_size` positions, and recurrent states for `kv_slots` sequences (the
    # plan's max_batch); 0: allocated at the first generation step (no KV planned)
    kv_slots: int = 0
    kv_blocks: int = 0
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    # Device bytes the plan keeps free for a step's activations and workspace: on a real GPU,
    # checked free once the stage is loaded (coordinator/planning/reserve.py).
    reserve_bytes: int = 0
    env: dict[str, str] = field(default_factory=dict)  # set on this worker by the job
    env_origins: dict[str, str] = field(default_factory=dict)  # "job override" | "node label"
