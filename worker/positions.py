"""Where each token of a step's rows sits in its sequence: the position ids of rows left-padded
to one width (a decode step's: each row's one token at its start). Shared by the batch runner
(`worker.batched`) and the step's cache view (`worker.batch_view`)."""

from __future__ import annotations

import torch


def row_positions(starts: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Position ids (rows, width) of rows left-padded to `width`: each real token its place in
    its sequence (row r's `counts[r]` tokens from `starts[r]` on), padding 0."""
    if width == 1:  # one token a row (a decode step): at its start
        return starts[:, None]
    column = torch.arange(width, device=starts.device)
    return (starts[:, None] + column - (width - counts[:, None])).clamp(min=0)
