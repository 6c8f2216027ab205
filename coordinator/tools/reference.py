"""The independent reference: the same checkpoint loaded by `transformers` in one process."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from offload.quant import BlockFormat
from offload.quant import quantized as quantize

# Models `from_pretrained` loaded, kept for the next call on the same files (`keep`); none by
# default: a process checking one large model must not hold it after its check.
_kept: OrderedDict[tuple, torch.nn.Module] = OrderedDict()
_keep_count = 0


def keep(count: int) -> int:
    """Keep up to `count` loaded reference models for later calls on the same files, dtype and
    attention (the tests call the reference hundreds of times on a few small checkpoints, each
    load ~0.1 s); 0 (the default) keeps none. A file rewritten since (size or modification
    time) is loaded again; models with 8-bit round-tripped weights are never kept. Returns the
    count before."""
    global _keep_count
    previous, _keep_count = _keep_count, count
    _trim()
    return previous


def _trim() -> None:
    while len(_kept) > _keep_count:
        _kept.popitem(last=False)  # the least recently used


def _key(checkpoint: str, dtype: str, attn_implementation: str | None) -> tuple | None:
    """What a kept model is found by; None when nothing is kept (or not a directory: loaded,
    and refused, by `from_pretrained` as always)."""
    root = Path(checkpoint).resolve()
    if not _keep_count or not root.is_dir():
        return None
    files = tuple(
        (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
        for entry in sorted(os.scandir(root), key=lambda e: e.name)
        if entry.is_file()
    )
    return (str(root), files, dtype, attn_implementation)


def _kept_model(key: tuple | None) -> torch.nn.Module | None:
    model = _kept.get(key) if key is not None else None
    if model is not None:
        _kept.move_to_end(key)  # the most recently used
    return model


def _keep(key: tuple | None, model: torch.nn.Module) -> None:
    if key is not None:
        _kept[key] = model
        _trim()


@contextmanager
def _reference_model(
    checkpoint: str,
    dtype: str,
    num_threads: int | None,
    attn_implementation: str | None = None,
    quantized: Mapping[str, BlockFormat] | None = None,
) -> Iterator[torch.nn.Module]:
    """The plain Hugging Face model, loaded by `from_pretrained` in `dtype` ("auto": the
    checkpoint's, as our loader resolves it), run on `num_threads` threads (the workers'
    count: a matmul split over another number of threads may sum in another order). With
    `quantized` (parameter name -> block format), those parameters are replaced by their
    8-bit round trip: the weights a job with `--offload-dtype fp8 / int8` computes with."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if dtype == "auto":
        from coordinator.planning.checkpoint import load_index

        dtype = load_index(checkpoint).dtype
    hf_logging.disable_progress_bar()
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        key = None if quantized else _key(checkpoint, dtype, attn_implementation)
        model = _kept_model(key)
        if model is None:
            with _as_transformers_reads_it(checkpoint) as files:
                model = AutoModelForCausalLM.from_pretrained(
                    files,
                    dtype=getattr(torch, dtype),
                    attn_implementation=attn_implementation,
                    **_dequantizing(checkpoint),
                )
            _keep(key, model)
        with torch.no_grad():
            for name, fmt in (quantized or {}).items():
                param = model.get_parameter(name)
                param.copy_(quantize(param, fmt).dequantized(param.dtype))
            yield model
    finally:
        torch.set_num_threads(previous)


def _dequantizing(checkpoint: str) -> dict:
    """`from_pretrained`'s arguments that make it dequantize an MXFP4 checkpoint with its own
    code (`Mxfp4Config(dequantize=True)`: transformers' `convert_moe_packed_tensors`, the
    reference for `offload.mxfp4`), whatever kernels or device this process has; none for
    other checkpoints."""
    import json

    config_path = Path(checkpoint) / "config.json"
    if not config_path.is_file():
        return {}
    quant = json.loads(config_path.read_text()).get("quantization_config") or {}
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


@contextmanager
def _as_transformers_reads_it(checkpoint: str) -> Iterator[str]:
    """`checkpoint`, or where transformers' own loader would read it with other numbers than
    its format defines, a copy it reads right. transformers dequantizes block FP8 with the block
    it infers from the grid of scales (192 rows in 2 block rows: blocks of 96), where the
    format's block is `weight_block_size` with a partial last one (128 and 64): for such a
    checkpoint the copy holds each weight dequantized here, in plain torch (the entries times
    their block's scale in float32, then cast to the model's dtype, as
    DeepSeek's `weight_dequant`), independent of the loader under test."""
    import json
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size") if quant.get("quant_method") == "fp8" else None
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    partial = False
    if block:
        for path in files:
            with safe_open(path, "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no iteration
                    if name.endswith("_scale_inv"):
                        shape = f.get_slice(name[: -len("_scale_inv")]).get_shape()
                        partial |= any(n % b for n, b in zip(shape, block, strict=False))
    if not partial:
        yield checkpoint
        return
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    with tempfile.TemporaryDirectory(prefix="offload-reference-") as out:
        for path in files:
            tensors = {}
            with safe_open(path, "pt") as f:
                names = set(f.keys())
                for name in names:
                    if name.endswith("_scale_inv"):
                        continue
                    tensor = f.get_tensor(name)
                    if name + "_scale_inv" in names:
                        scales = f.get_tensor(name + "_scale_inv")
                        tensor = _dequantized(tensor, scales, block, dtype)
                    tensors[name] = tensor
            save_file(tensors, str(Path(out) / path.name), metadata={"format": "pt"})
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        (Path(out) / "config.json").write_text(json.dumps(plain))
        for extra in Path(checkpoint).iterdir():  # the index, generation config, tokenizer
            if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
                (Path(out) / extra.name).write_bytes(extra.read_bytes())
        yield out


def _dequantized(q: torch.Tensor, scales: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
    """Block FP8 as its format defines it: each entry times its block's scale (blocks of
    `block` from the top left, the last ones partial), in float32, then `dtype`. E8M0 scales
    (uint8 bytes or float8_e8m0fnu) are 2^(x - 127)."""
    if scales.dtype == torch.uint8:
        scales = torch.pow(2.0, scales.to(torch.float32) - 127)
    scales = scales.to(torch.float32)
    rows, cols = q.shape
    full = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (q.to(torch.float32) * full).to(dtype)


def reference_logits(
    checkpoint: str,
    input_ids: torch.Tensor,
    *,
    dtype: str = "auto",
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int = 0,
    attn_implementation: str | None = None,
    num_threads: int | None = None,
    quantized: Mapping[str, BlockFormat] | None = None,
    use_cache: bool | None = None,
) -> torch.Tensor:
    """Logits of the plain Hugging Face model (see `_reference_model`); `use_cache` as its
    forward takes it (None: the config's, as a plain call does). It changes the numbers of one
    family we know of: CodeGen rounds its rotated keys to the model's dtype only when it caches
    them, and a plain call caches."""
    with _reference_model(checkpoint, dtype, num_threads, attn_implementation, quantized) as model:
        return model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
            **({} if use_cache is None else {"use_cache": use_cache}),
        ).logits


def reference_generate(
    checkpoint: str,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    dtype: str = "auto",
    num_threads: int | None = None,
    quantized: Mapping[str, BlockFormat] | None = None,
    **kwargs,
) -> torch.Tensor:
    """`generate`'s sequences from the plain Hugging Face model in one process (same dtype and
    thread count as the workers; `quantized` weights as in `_reference_model`), for the
    generation parity tests."""
    with _reference_model(checkpoint, dtype, num_threads, quantized=quantized) as model:
        return model.generate(input_ids, attention_mask=attention_mask, **kwargs)
