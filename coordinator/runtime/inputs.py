"""A forward's inputs, checked in the driver before anything reaches a worker: each bad value
is named; a mask gives the positions `generate` would."""

from __future__ import annotations

import torch

from offload.errors import ConfigError


class InputError(ConfigError):
    """A forward's or a request's inputs are malformed (shape, dtype, ids, mask): a 400."""


def check_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    vocab_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """Validate a forward's inputs before anything reaches a worker; returns them with the
    position ids a mask implies (None without a mask: the model's own 0..seq-1)."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.int64, torch.int32)
    ):
        shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise InputError(
            f"input_ids must be a 2-D integer tensor (batch, seq), got "
            f"{getattr(input_ids, 'dtype', '')}{shape}"
        )
    if input_ids.numel() == 0:
        raise InputError(f"input_ids is empty: shape {list(input_ids.shape)}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab_size and high >= vocab_size):
        bad = low if low < 0 else high
        known = f"0..{vocab_size - 1}" if vocab_size else "ids are >= 0"
        raise InputError(f"token id {bad} is out of the vocabulary ({known})")
    if (
        isinstance(logits_to_keep, bool)
        or not isinstance(logits_to_keep, int)
        or not (0 <= logits_to_keep <= input_ids.shape[1])
    ):
        raise InputError(
            f"logits_to_keep={logits_to_keep!r} must be an int in 0..{input_ids.shape[1]} "
            "(0: every position)"
        )
    if attention_mask is None:
        return input_ids, None, None, logits_to_keep
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise InputError(
            f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got "
            f"{list(getattr(attention_mask, 'shape', [type(attention_mask).__name__]))}"
        )
    if attention_mask.dtype.is_floating_point or not bool(
        ((attention_mask == 0) | (attention_mask == 1)).all()
    ):
        raise InputError(
            "attention_mask must hold integers or booleans, 1 for tokens, 0 for padding"
        )
    mask = attention_mask.to(torch.int64)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"attention_mask rows {empty} have no tokens")
    # As generate() numbers them (_prepare_position_ids_for_generation): padding does not count;
    # pads get position 0 (never attended).
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return input_ids, mask, positions, logits_to_keep
