"""The independent reference: the same checkpoint loaded by `transformers` in one process."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from offload.quant import BlockFormat
from offload.quant import quantized as quantize


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
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        )
        with torch.no_grad():
            for name, fmt in (quantized or {}).items():
                param = model.get_parameter(name)
                param.copy_(quantize(param, fmt).dequantized(param.dtype))
            yield model
    finally:
        torch.set_num_threads(previous)


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
) -> torch.Tensor:
    """Logits of the plain Hugging Face model (see `_reference_model`)."""
    with _reference_model(checkpoint, dtype, num_threads, attn_implementation, quantized) as model:
        return model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
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
