"""The independent reference: the same checkpoint loaded by `transformers` in one process."""

from __future__ import annotations

import torch


def reference_logits(
    checkpoint: str, input_ids: torch.Tensor, *, attn_implementation: str = "sdpa",
    num_threads: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Logits of the plain Hugging Face model. Run it with the workers' thread count: a matmul
    split over a different number of threads may sum in a different order."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation=attn_implementation
        )
        with torch.no_grad():
            return model(input_ids).logits
    finally:
        torch.set_num_threads(previous)
