"""A forward's inputs are checked in the driver, before anything reaches a worker: each bad value
is named; a mask gives the positions `generate` would."""

from __future__ import annotations

import pytest
import torch

from coordinator.runtime.inputs import check_inputs

IDS = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]])


@pytest.mark.parametrize(
    ("ids", "mask", "keep", "message"),
    [
        (torch.zeros(4), None, 0, r"2-D integer tensor \(batch, seq\), got torch.float32\[4\]"),
        ([[1, 2]], None, 0, r"2-D integer tensor"),
        (torch.zeros(1, 0, dtype=torch.int64), None, 0, r"input_ids is empty"),
        (torch.tensor([[1, -1]]), None, 0, r"token id -1 is out of the vocabulary \(0..9\)"),
        (torch.tensor([[1, 10]]), None, 0, r"token id 10 is out of the vocabulary \(0..9\)"),
        (IDS, None, 5, r"logits_to_keep=5 must be an int in 0..4"),
        (IDS, None, True, r"logits_to_keep=True"),
        (IDS, torch.ones(2, 3), 0, r"shape of input_ids \[2, 4\], got \[2, 3\]"),
        (IDS, torch.ones(2, 4), 0, r"integers or booleans"),
        (IDS, torch.full((2, 4), 2), 0, r"integers or booleans"),
        (IDS, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), 0, r"rows \[1\] have no tokens"),
    ],
)
def test_bad_inputs_are_named(ids, mask, keep, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_inputs(ids, mask, keep, 10)


def test_a_mask_numbers_positions_as_generate_does() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    ids, mask_out, positions, keep = check_inputs(IDS, mask, 1, 10)
    assert ids is IDS and keep == 1 and mask_out.dtype == torch.int64
    assert positions.tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]  # pads get 0 (never attended)
    assert check_inputs(IDS, None, 0, 10)[1:3] == (None, None)  # the model's own 0..seq-1
