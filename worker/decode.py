"""Choosing the next token, as `transformers`' `generate` does (its warpers, in its order): the
last stage applies it to each row of a batched step (`worker.batched.choose_rows`) with the
row's own settings and generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Sampling:
    """Greedy unless `do_sample`; then temperature, top-k (0 or None: off) and top-p (1: off)
    applied in generate's order before drawing."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0


def next_tokens(
    logits: torch.Tensor,
    sequences: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token of each row (batch,) from the last position's logits (batch, n, vocab)."""
    scores = logits[:, -1, :].to(dtype=torch.float32, copy=True)
    if not sampling.do_sample:
        return torch.argmax(scores, dim=-1)
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if sampling.temperature != 1.0:
        scores = TemperatureLogitsWarper(sampling.temperature)(sequences, scores)
    if sampling.top_k:
        scores = TopKLogitsWarper(top_k=sampling.top_k)(sequences, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=sampling.top_p)(sequences, scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
