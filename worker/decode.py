"""Choosing the next token, as `transformers`' `generate` does: shared by the driver's decoding
loop (coordinator/generation.py) and a worker that runs several decode steps itself
(`StageWorker.decode`, for a job of one stage), so both choose the same tokens from the same
logits and the same generator state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


def next_tokens(logits: torch.Tensor, sequences: torch.Tensor, sampling: Sampling,
                generator: torch.Generator | None) -> torch.Tensor:  # fmt: skip
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


def choose(logits: torch.Tensor, sequences: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None, unfinished: torch.Tensor,
           pad_token_id: int) -> torch.Tensor:  # fmt: skip
    """The next tokens, `pad_token_id` in rows that have ended (as generate pads them)."""
    tokens = next_tokens(logits, sequences, sampling, generator).to(sequences.dtype)
    return torch.where(unfinished, tokens, pad_token_id)


def advance(attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """The mask and positions of the next decode step: one more token per row."""
    ones = attention_mask.new_ones((attention_mask.shape[0], 1))
    return torch.cat([attention_mask, ones], -1), position_ids[:, -1:] + 1


def steps(forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
          tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
          unfinished: torch.Tensor, count: int, sampling: Sampling,
          eos_token_ids: tuple[int, ...], pad_token_id: int,
          generator: torch.Generator | None) -> Iterator[torch.Tensor]:  # fmt: skip
    """Up to `count` decode steps: feed `tokens` (batch, 1) through `forward(tokens, mask,
    positions)` (the last position's logits), choose the next tokens as the driver's loop
    would and feed them back. Yields each step's tokens; ends early once every row has ended
    (an end-of-sequence token, or `unfinished` false)."""
    eos = torch.tensor(eos_token_ids, dtype=tokens.dtype)
    for _ in range(count):
        logits = forward(tokens, attention_mask, position_ids)
        chosen = choose(logits, tokens, sampling, generator, unfinished, pad_token_id)
        yield chosen
        if len(eos):
            unfinished = unfinished & ~torch.isin(chosen, eos)
        if not bool(unfinished.any()):
            return
        attention_mask, position_ids = advance(attention_mask, position_ids)
        tokens = chosen[:, None]
