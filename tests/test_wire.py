"""worker.wire: tensors cross Ray as numpy arrays and come back bit for bit."""

from __future__ import annotations

import pickle

import pytest
import torch

from worker.wire import Packed, pack, unpack

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.float8_e4m3fn,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bitwise_through_pickle(dtype: torch.dtype) -> None:
    source = torch.randn(3, 5, 7) * 100
    tensor = source.to(dtype)
    packed = pack(tensor)
    assert isinstance(packed, Packed) and packed.dtype == str(dtype).removeprefix("torch.")
    back = unpack(pickle.loads(pickle.dumps(packed, protocol=5)))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))  # bits, NaN included


def test_strided_views_are_made_contiguous() -> None:
    tensor = torch.arange(24.0).reshape(4, 6)[:, 1:4].T  # neither contiguous nor at offset 0
    back = unpack(pack(tensor))
    assert back.is_contiguous() and torch.equal(back, tensor)


def test_read_only_arrays_come_back_writable_and_unshared() -> None:
    packed = pack(torch.ones(4))
    packed.array.flags.writeable = False  # as Ray hands arrays back from its object store
    back = unpack(packed)
    back += 1  # would be undefined on read-only memory
    assert torch.equal(back, torch.full((4,), 2.0)) and packed.array.tolist() == [1.0] * 4


def test_none_and_tensors_pass_through() -> None:
    tensor = torch.zeros(2)
    assert pack(None) is None and unpack(None) is None
    assert unpack(tensor) is tensor  # in-process callers hand tensors straight to `step`


@pytest.mark.parametrize("dtype", ["int64", "float32", "bool", "float16"])
def test_numpy_arrays_pack_as_the_torch_dtype_of_their_name(dtype: str) -> None:
    """The engine packs its steps' inputs as numpy arrays (it never imports torch): they come
    back as the tensor of the same values and dtype; a dtype torch lacks is refused by name."""
    import numpy as np

    array = np.arange(6).reshape(2, 3).astype(dtype)[:, ::2]  # not contiguous
    packed = pack(array)
    assert packed.dtype == dtype and packed.array.flags.c_contiguous
    back = unpack(pickle.loads(pickle.dumps(packed, protocol=5)))
    assert back.dtype == getattr(torch, dtype) and back.tolist() == array.tolist()
    with pytest.raises(TypeError, match="numpy dtype <U1"):
        pack(np.array(["a"]))
