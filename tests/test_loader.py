"""The worker's tensor reader: bytes equal safetensors' own reading, in parallel or not; short
files and wrong destinations are errors naming the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.errors import CheckpointError
from worker.loader import PIECE_BYTES, TensorReader
from worker.spec import TensorSlice


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "shard.safetensors"
    torch.manual_seed(0)
    tensors = {
        "big": torch.randn(3 * PIECE_BYTES // 4 + 5),  # several pieces, an odd tail
        "small": torch.randn(7, 3).to(torch.bfloat16),
        "ints": torch.arange(11, dtype=torch.int64),
    }
    save_file(tensors, str(path))
    return path


def slices(path) -> dict[str, TensorSlice]:
    from coordinator.planning.checkpoint import read_header

    return read_header(path)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_read_many_matches_safetensors(shard, threads: int) -> None:
    expected = load_file(str(shard))
    items = [(s, torch.empty(s.shape, dtype=s.torch_dtype)) for s in slices(shard).values()]
    with TensorReader(shard.parent, threads=threads) as reader:
        reader.read_many(items)
        assert reader.stats.bytes_read == sum(s.nbytes for s, _ in items)
    for tensor, dst in items:
        assert torch.equal(dst, expected[tensor.name]), tensor.name


def test_short_file_and_wrong_destination(shard, tmp_path) -> None:
    big = slices(shard)["big"]
    cut = tmp_path / shard.name
    cut.write_bytes(shard.read_bytes()[: big.end - 10])
    with TensorReader(tmp_path, threads=2) as reader, pytest.raises(CheckpointError, match="'big'"):
        reader.read_into(big, torch.empty(big.shape))
    with TensorReader(shard.parent) as reader, pytest.raises(ValueError, match="'big' is F32"):
        reader.read_into(big, torch.empty(3))
