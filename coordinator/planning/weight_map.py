"""Checkpoint tensors -> the model's parameters, through transformers' own conversion mapping.

`from_pretrained` renames checkpoint keys (legacy names, Mixtral's `block_sparse_moe`) and fuses
per-expert tensors into one parameter per layer (`experts.3.gate_proj.weight` and
`experts.3.up_proj.weight` of every expert -> `experts.gate_up_proj`) with the
`WeightRenaming` / `WeightConverter` list of `transformers.conversion_mapping`. We apply the same
list to the header names, with the same functions, and turn each converter's operations into the
view of the fused parameter that each source tensor fills: `MergeModulelist(dim=m)` stacks the
experts (expert e is `select(m, e)`), `Concatenate(dim=c)` then joins the source patterns (the
j-th is `narrow(c, offset_j, size_j)`); `Concatenate` alone joins one tensor per pattern so
(linear attention's q, k and v convolutions, Kimi Linear's and OLMo Hybrid's). A worker reads
each tensor straight into its view, so no stacked or concatenated copy is ever made. Any other
operation is refused with its name.
An FP8 checkpoint's weights (block FP8, or compressed-tensors FP8 per tensor, channel or block)
carry their scales and block, checked against the format here (`_with_fp8_scales`), and an
MXFP4 checkpoint's packed expert weights theirs (`_with_mxfp4`), so a checkpoint that would
read as other numbers never reaches a worker.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload.errors import CheckpointError
from worker.spec import TensorSlice, apply_view

if TYPE_CHECKING:
    from worker.layout import Fp8Scheme


class WeightMapError(CheckpointError):
    """A checkpoint tensor that does not fit the model; the message names it and the file."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ignored_patterns(model: nn.Module) -> re.Pattern | None:
    """Checkpoint keys `from_pretrained` drops without a word (old rotary tables, causal-mask
    buffers of GPT-2 exports), as its `_adjust_missing_and_unexpected_keys` does."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def map_tensors(
    model: nn.Module,
    tensors: dict[str, TensorSlice],
    *,
    fp8: Fp8Scheme | None = None,
    mxfp4: bool = False,
) -> tuple[list[TensorSlice], list[str]]:
    """Each checkpoint tensor with its target parameter, view and dtype (tied weights get a copy
    of their source's tensors), and the keys ignored as `from_pretrained` ignores them; FP8
    weights with their scales and blocks as `fp8` says (`worker.layout.fp8_scheme`, None for a
    checkpoint that is not FP8: see `_with_fp8_scales`); with `mxfp4` (`worker.layout.is_mxfp4`)
    each `<name>_blocks` and `<name>_scales` pair as one packed weight `<name>` (`_with_mxfp4`).
    Raises WeightMapError for a tensor the model does not own, a shape that does not fit, a
    parameter no tensor fills, a conversion we cannot apply by views, or FP8 weights and scales
    that are not the FP8 format config.json names."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    family = model.config.model_type
    expected = model.state_dict(keep_vars=True)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    ignore = _ignored_patterns(model)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})

    tensors = _with_fp8_scales(_with_mxfp4(tensors) if mxfp4 else tensors, fp8)
    plain: list[TensorSlice] = []
    fused: dict[str, dict[str, list[TensorSlice]]] = defaultdict(lambda: defaultdict(list))
    ignored: list[str] = []
    for key in sorted(tensors, key=dot_natural_key):
        target, pattern = rename_source_key(
            key, renamings, converters, model.base_model_prefix, expected
        )
        if target not in expected and key in expected:  # as from_pretrained: keep the name
            target, pattern = key, None
        if target in tied:  # from_pretrained ties it to its source after loading: source wins
            ignored.append(key)
            continue
        if target not in expected:
            if ignore is not None and ignore.search(key):
                ignored.append(key)
                continue
            raise WeightMapError(
                f"{tensors[key].file}: tensor {key!r} is not a weight of {type(model).__name__} "
                f"({family}, as config.json describes it{_layer_hint(model, key)}): the "
                "checkpoint does not match its config, or holds extra tensors (adapters, a "
                "different head)"
            )
        if pattern is None:
            plain.append(_placed(tensors[key], target, (), expected[target]))
        else:
            fused[target][pattern].append(tensors[key])
    for target, sources in fused.items():
        converter = by_pattern[next(iter(sources))]
        plain.extend(_fused_views(converter, target, sources, expected[target]))

    covered: dict[str, int] = defaultdict(int)
    for tensor in plain:
        covered[tensor.target] += tensor.numel
    for target, source in tied.items():
        if source in covered:
            copies = [dataclasses.replace(t, target=target) for t in plain if t.target == source]
            plain.extend(copies)
            covered[target] = covered[source]
    missing = sorted(n for n, t in expected.items() if covered.get(n, 0) != t.numel())
    if missing:
        raise WeightMapError(
            f"the checkpoint lacks {len(missing)} weights of {type(model).__name__} ({family}) "
            f"that config.json implies, e.g. {missing[:3]}"
        )
    return plain, ignored


FP8_SCALE = "_scale_inv"  # block FP8's scales: `<weight>_scale_inv`
CT_SCALE = "_scale"  # compressed-tensors': `<module>.weight_scale`
CT_INPUT_SCALE = ".input_scale"  # a static activation scheme's: not applied (dropped)
FP8_WEIGHT = "F8_E4M3"
# The dtypes a block-FP8 weight's scales are read in (as float32, `offload.quant`): E8M0 as
# DeepSeek's `ue8m0` stores it, or its bytes as U8 (2^(x - 127) either way)
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")
CT_SCALE_DTYPES = ("F32", "BF16", "F16")
_BLOCK_FP8 = (
    "block-FP8 as DeepSeek-V3, Kimi-K2 and Qwen3-FP8 publish it (F8_E4M3 weights, each with a "
    "2-D `<name>_scale_inv` of one scale per block of quantization_config.weight_block_size)"
)
_CT_FP8 = (
    "compressed-tensors FP8 (F8_E4M3 `<module>.weight`, each with a `<module>.weight_scale` "
    "of the config group's strategy: [1] per tensor, [rows, 1] per channel, ceil(shape / "
    "block_structure) per block)"
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _with_fp8_scales(
    tensors: dict[str, TensorSlice], scheme: Fp8Scheme | None
) -> dict[str, TensorSlice]:
    """Each FP8 weight with its scales (`<name>_scale_inv` for block FP8, `<name>_scale` for
    compressed-tensors) and its block attached (the scales are not weights of the model: they
    are read with their weight, which is dequantized while read). The format fixes the
    numbers, so whatever would read as other numbers is refused here, naming the tensor:
    scales whose grid is not the scheme's (block: ceil(shape / block), the last block of a dim
    partial, never a block the grid divides the shape into; per tensor: one; per channel: one
    per row), scales of a dtype without a defined reading, scales beside a weight that is not
    FP8, FP8 without scales or without a scheme in config.json, FP8 in a module
    compressed-tensors' `ignore` lists, and F8_E5M2 weights (no FP8 checkpoint of either
    format is published in E5M2). A compressed-tensors static activation scheme's
    `input_scale` tensors are dropped: activations are not quantized here."""
    supported = (
        _CT_FP8 if scheme is not None and scheme.method == "compressed-tensors" else _BLOCK_FP8
    )
    suffix = scheme.suffix if scheme is not None else FP8_SCALE
    e5m2 = next((t for t in tensors.values() if t.dtype == "F8_E5M2"), None)
    if e5m2 is not None:
        raise WeightMapError(
            f"{e5m2.file}: tensor {e5m2.name!r} is F8_E5M2 {list(e5m2.shape)}; supported: "
            f"{supported}"
        )
    kind = "block scales" if supported == _BLOCK_FP8 else "scales"
    out: dict[str, TensorSlice] = {}
    for key, tensor in tensors.items():
        if key.endswith(suffix) and key[: -len(suffix)] in tensors:
            weight = tensors[key[: -len(suffix)]]
            if weight.dtype != FP8_WEIGHT:
                raise WeightMapError(
                    f"{tensor.file}: tensor {key!r} holds {kind}, but its weight "
                    f"{weight.name!r} is {weight.dtype}, not {FP8_WEIGHT}: scales beside a weight "
                    "that is not FP8 mean nothing (a checkpoint dequantized without dropping "
                    f"them?); supported: {supported}. Remove the {suffix} tensors of "
                    "weights that are not FP8"
                )
            continue
        if (
            scheme is not None
            and scheme.method == "compressed-tensors"
            and key.endswith(CT_INPUT_SCALE)
            and key[: -len(CT_INPUT_SCALE)] + ".weight" in tensors
        ):
            continue  # activations are not quantized: dequantized weights, as transformers
        if tensor.dtype == FP8_WEIGHT:
            tensor = _fp8_scaled(tensor, tensors.get(key + suffix), scheme)
        out[key] = tensor
    return out


def _fp8_scaled(
    tensor: TensorSlice, scale: TensorSlice | None, scheme: Fp8Scheme | None
) -> TensorSlice:
    """`tensor` with its scales (shaped as their grid) and block, checked against its shape and
    `scheme` (see `_with_fp8_scales`)."""
    where = f"{tensor.file}: FP8 tensor {tensor.name!r} {list(tensor.shape)}"
    if scheme is None:
        raise WeightMapError(
            f"{where}: config.json has no block-FP8 quantization_config (quant_method 'fp8', "
            "weight_block_size) nor a compressed-tensors FP8 one, so its scales have no "
            f"defined block; supported: {_BLOCK_FP8}; {_CT_FP8}"
        )
    if scheme.method == "fp8":
        return _block_fp8_scaled(tensor, scale, scheme.block, where)
    module = tensor.name.removesuffix(".weight")
    if scheme.ignores(module):
        raise WeightMapError(
            f"{where} is in quantization_config.ignore ({module!r}), whose modules "
            f"compressed-tensors stores unquantized; supported: {_CT_FP8}"
        )
    if scale is None or len(tensor.shape) != 2:
        raise WeightMapError(
            f"{where} has no {tensor.name + CT_SCALE!r} (found "
            f"{list(scale.shape) if scale else 'none'}) or is not a matrix; supported: {_CT_FP8}"
        )
    if scale.dtype not in CT_SCALE_DTYPES:
        raise WeightMapError(
            f"{where}: its scales {scale.name!r} are {scale.dtype}, which has no defined reading "
            f"as compressed-tensors FP8 scales; supported: {', '.join(CT_SCALE_DTYPES)}"
        )
    rows, cols = tensor.shape
    block = scheme.block_of(tensor.shape)
    grid = (_cdiv(rows, block[0]), _cdiv(cols, block[1]))
    stored = {
        "tensor": ((), (1,), (1, 1)),
        "channel": ((rows, 1),),
        "block": (grid,),
    }[scheme.strategy]
    if scale.shape not in stored:
        raise WeightMapError(
            f"{where} has a {list(scale.shape)} {scale.name!r}, but strategy "
            f"{scheme.strategy!r}"
            + (f" with block_structure={list(scheme.block)}" if scheme.block else "")
            + f" makes {' or '.join(str(list(s)) for s in stored)} (ceil(shape / block)): the "
            "scales do not match the weight in the format config.json names"
        )
    # read as their grid: one row per block row ([1] and [] hold the same one scale)
    return dataclasses.replace(tensor, scale=dataclasses.replace(scale, shape=grid), block=block)


def _block_fp8_scaled(
    tensor: TensorSlice, scale: TensorSlice | None, block: tuple[int, int], where: str
) -> TensorSlice:
    if scale is None or len(scale.shape) != 2 or len(tensor.shape) != 2:
        raise WeightMapError(
            f"{where} has no 2-D {tensor.name + FP8_SCALE!r} of block scales (found "
            f"{list(scale.shape) if scale else 'none'}); supported: {_BLOCK_FP8}"
        )
    if scale.dtype not in FP8_SCALE_DTYPES:
        raise WeightMapError(
            f"{where}: its scales {scale.name!r} are {scale.dtype}, which has no defined reading "
            f"as block scales; supported: {', '.join(FP8_SCALE_DTYPES)} (U8: E8M0 exponents)"
        )
    grid = tuple(_cdiv(n, b) for n, b in zip(tensor.shape, block, strict=True))
    if scale.shape != grid:
        raise WeightMapError(
            f"{where} has a {list(scale.shape)} grid of block scales, but blocks of "
            f"weight_block_size={list(block)} make a {list(grid)} grid (ceil(shape / block), "
            "the last block of a dim partial): the scales do not match the weight in the "
            "format config.json names; fix weight_block_size or the checkpoint's scales"
        )
    return dataclasses.replace(tensor, scale=scale, block=block)


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
MXFP4_SCALE_DTYPES = ("U8", "F8_E8M0")  # E8M0 exponents, 2^(x - 127)
_MXFP4 = (
    "MXFP4 as gpt-oss publishes it (a U8 `<name>_blocks` [..., rows, groups, 16] of packed e2m1 "
    "pairs with a U8 `<name>_scales` [..., rows, groups] of E8M0 exponents, one per 32 values)"
)


def _with_mxfp4(tensors: dict[str, TensorSlice]) -> dict[str, TensorSlice]:
    """An MXFP4 checkpoint's tensors, each `<name>_blocks` and `<name>_scales` pair as one
    packed weight `<name>` (`TensorSlice.packed`) of the parameter's shape (..., groups x 32,
    rows): the file stores the parameter transposed (`offload.mxfp4`). Refused here, naming
    the tensor: blocks without scales or scales without blocks, blocks that are not U8 with
    16 bytes (32 values) a group, scales of another dtype or not one per group."""
    out: dict[str, TensorSlice] = {}
    for key, tensor in tensors.items():
        name = key.removesuffix(MXFP4_BLOCKS).removesuffix(MXFP4_SCALES)
        blocks, scales = tensors.get(name + MXFP4_BLOCKS), tensors.get(name + MXFP4_SCALES)
        if name == key:
            out[key] = tensor
            continue
        if blocks is None or scales is None:
            raise WeightMapError(
                f"{tensor.file}: tensor {key!r} {tensor.dtype}{list(tensor.shape)} has no "
                f"{name + (MXFP4_SCALES if scales is None else MXFP4_BLOCKS)!r} beside it; "
                f"supported: {_MXFP4}"
            )
        if key == scales.name:
            continue  # read with its blocks
        where = f"{blocks.file}: MXFP4 tensor {key!r} {blocks.dtype}{list(blocks.shape)}"
        if blocks.dtype != "U8" or len(blocks.shape) < 3 or blocks.shape[-1] != 16:
            raise WeightMapError(
                f"{where} is not U8 with 16 bytes (32 packed values) a group; supported: {_MXFP4}"
            )
        if scales.dtype not in MXFP4_SCALE_DTYPES or scales.shape != blocks.shape[:-1]:
            raise WeightMapError(
                f"{where}: its scales {scales.name!r} are {scales.dtype}{list(scales.shape)}, "
                f"not {' or '.join(MXFP4_SCALE_DTYPES)}{list(blocks.shape[:-1])} (one E8M0 "
                f"exponent per group of 32 values); supported: {_MXFP4}"
            )
        *lead, rows, groups, _ = blocks.shape
        out[name] = dataclasses.replace(
            blocks, shape=(*lead, groups * 32, rows), scale=scales, packed="mxfp4"
        )
    return out


def _layer_hint(model: nn.Module, key: str) -> str:
    """Where a key names a block past the config's count, say so: the usual mismatch."""
    num_layers = model.config.get_text_config().num_hidden_layers
    numbers = [int(n) for n in re.findall(r"\.(\d+)\.", key)]
    if numbers and numbers[0] >= num_layers:
        return f" with num_hidden_layers={num_layers}"
    return ""


def _placed(tensor: TensorSlice, target: str, view: tuple, param: torch.Tensor) -> TensorSlice:
    want = tuple(apply_view(param, view).shape)
    if tensor.shape != want:
        what = f"shape {list(tensor.shape)}"
        if tensor.packed:  # the file's shape is the transpose's, packed
            what = f"the MXFP4 values of a {list(tensor.shape)} weight (the file's transposed)"
        raise WeightMapError(
            f"{tensor.file}: tensor {tensor.name!r} has {what} but config.json implies "
            f"{list(want)} for {target!r}"
        )
    return dataclasses.replace(
        tensor,
        target=target,
        view=view,
        target_dtype=_dtype_name(param.dtype),
        buffer=not isinstance(param, nn.Parameter),
    )


def _fused_views(
    converter, target: str, sources: dict[str, list[TensorSlice]], param: torch.Tensor
) -> list[TensorSlice]:
    """The view of `param` each source tensor fills (see the module doc)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    kinds = [type(op) for op in ops]
    sharded = any(getattr(op, "num_shards_attribute", None) for op in ops)
    if sharded or kinds not in ([Concatenate], [MergeModulelist], [MergeModulelist, Concatenate]):
        raise WeightMapError(
            f"{target!r}: conversion {[k.__name__ for k in kinds]} is not supported (only "
            "MergeModulelist, optionally followed by Concatenate: fused MoE experts; or "
            "Concatenate alone: parts joined, as linear attention's q/k/v convolutions)"
        )
    if kinds == [Concatenate]:
        return _joined_views(ops[0].dim, converter, target, sources, param)
    merge_dim = ops[0].dim
    out: list[TensorSlice] = []
    offset = 0
    for pattern in converter.source_patterns:  # their order is the concatenation order
        experts = sources.get(pattern, [])
        if not experts:
            continue
        view_prefix: tuple = ()
        if len(ops) == 2:
            dim = ops[1].dim
            stacked = list(experts[0].shape)
            stacked.insert(merge_dim, len(experts))
            view_prefix = (("narrow", dim, offset, stacked[dim]),)
            offset += stacked[dim]
        count = apply_view(param, view_prefix).shape[merge_dim]
        if len(experts) > count:  # numbered past config.json's count
            extra = experts[count]
            raise WeightMapError(
                f"{extra.file}: tensor {extra.name!r} is one of {len(experts)} experts, but "
                f"config.json implies {count} for {target!r}"
            )
        for e, tensor in enumerate(experts):
            out.append(_placed(tensor, target, (*view_prefix, ("select", merge_dim, e)), param))
    return out


def _joined_views(
    dim: int, converter, target: str, sources: dict[str, list[TensorSlice]], param: torch.Tensor
) -> list[TensorSlice]:
    """`Concatenate(dim)` alone: each source pattern's one tensor fills the next part of `param`
    along `dim` (`narrow(dim, offset, its size)`), in the patterns' order. A part the
    checkpoint lacks leaves `param` short, which `map_tensors` refuses naming it."""
    out: list[TensorSlice] = []
    offset = 0
    for pattern in converter.source_patterns:  # their order is the concatenation order
        parts = sources.get(pattern, [])
        if len(parts) > 1:
            raise WeightMapError(
                f"{target!r}: {len(parts)} tensors match its part {pattern!r} "
                f"({', '.join(repr(t.name) for t in parts[:3])}); it takes one"
            )
        for tensor in parts:
            if tensor.packed or dim >= len(tensor.shape):
                raise WeightMapError(
                    f"{tensor.file}: tensor {tensor.name!r} of shape {list(tensor.shape)} "
                    f"cannot be part {pattern!r} of {target!r} (joined along dim {dim})"
                )
            size = tensor.shape[dim]
            if offset + size > param.shape[dim]:
                raise WeightMapError(
                    f"{tensor.file}: tensor {tensor.name!r} of shape {list(tensor.shape)} "
                    f"goes past {target!r}'s {list(param.shape)} (parts joined along dim {dim})"
                )
            out.append(_placed(tensor, target, (("narrow", dim, offset, size),), param))
            offset += size
    return out
