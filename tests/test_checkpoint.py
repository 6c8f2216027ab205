"""Checkpoint index and random checkpoints, checked against an independent reading.

`load_index` parses safetensors headers itself; here every byte range, dtype and shape it reports
is compared with what the `safetensors` library reads from the same files, and every way a
checkpoint can be broken is produced by rewriting real files (8-byte length + JSON header + data)
and must give a `CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import mmap
import os
import pickle
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors import safe_open

from coordinator.planning.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    CheckpointIndex,
    load_index,
    read_header,
)
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from worker.layout import UnsupportedModelError, check_recurrent_support
from worker.spec import SAFETENSORS_NAMES, TensorSlice

TINY = dict(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=128)
LLAMA_LAYERS = 3
QWEN_LAYERS = 2
# Small enough that one llama decoder layer (~25 kB in float32) spans several shards.
SHARD_BYTES = 20_000


# --- checkpoints, shared by the module and copied before anything corrupts them ---------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "ckpt"
    shape = CheckpointShape(
        arch="llama", num_layers=LLAMA_LAYERS, max_shard_bytes=SHARD_BYTES, **TINY
    )
    return make_checkpoint(out, shape)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen") / "ckpt"
    shape = CheckpointShape(arch="qwen2", num_layers=QWEN_LAYERS, tie_embeddings=True, **TINY)
    return make_checkpoint(out, shape)


@pytest.fixture
def llama_copy(llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "llama"))


@pytest.fixture
def qwen_copy(qwen_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(qwen_dir, tmp_path / "qwen"))


# --- raw safetensors files, handled without the code under test ------------------------------


def split_safetensors(path: Path) -> tuple[dict, bytes]:
    """(header, data region) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join_safetensors(
    path: Path, header: dict | bytes, data: bytes, *, length: int | None = None
) -> None:
    """Write `header` (a dict, or raw bytes for corrupt cases) and `data` as a safetensors file;
    `length` overrides the 8-byte header length to produce lying headers."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-len(body) % 8)  # safetensors pads its header to 8 bytes; do the same
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)


def rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    header, data = split_safetensors(path)
    edit(header)
    join_safetensors(path, header, data)


def weight_map(root: Path) -> dict[str, str]:
    return json.loads((root / INDEX_FILE).read_text())["weight_map"]


def independent_tensors(root: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """tensor name -> (file, tensor), read by the safetensors library from every file present."""
    found: dict[str, tuple[str, torch.Tensor]] = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                assert name not in found, f"{name} stored twice"
                found[name] = (path.name, f.get_tensor(name))
    return found


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    # numpy has no bfloat16: go through a uint8 view of the raw storage.
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def expected_layer(tensor: str) -> str:
    match = re.match(r"model\.layers\.(\d+)\.", tensor)
    if match:
        return f"layers.{match.group(1)}"
    return "embed" if tensor.startswith("model.embed_tokens.") else "head"


def slice_in(root: Path, file: str) -> tuple[str, dict]:
    """Some tensor of `file` and its header entry."""
    header, _ = split_safetensors(root / file)
    name = sorted(k for k in header if k != "__metadata__")[0]
    return name, header[name]


# --- 1. the index agrees with the files -------------------------------------------------------


def check_against_safetensors(index: CheckpointIndex, num_layers: int, tied: bool) -> None:
    assert [layer.name for layer in index.layers] == [
        "embed",
        *(f"layers.{i}" for i in range(num_layers)),
        "head",
    ]
    assert [layer.kind for layer in index.layers] == ["embed", *["decoder"] * num_layers, "head"]
    assert [layer.index for layer in index.layers] == [None, *range(num_layers), None]
    assert index.num_decoder_layers == num_layers
    assert index.tied_embeddings is tied

    truth = independent_tensors(index.root)
    seen: dict[str, TensorSlice] = {}
    raw = {file: (index.root / file).read_bytes() for file in index.files}
    for layer in index.layers:
        for t in layer.tensors:
            file, tensor = truth[t.name]
            assert t.file == file
            assert t.shape == tuple(tensor.shape), t.name
            assert SAFETENSORS_NAMES[t.dtype] == str(tensor.dtype).removeprefix("torch."), t.name
            assert t.torch_dtype == tensor.dtype
            assert t.nbytes == tensor.numel() * tensor.element_size()
            assert raw[file][t.start : t.end] == tensor_bytes(tensor), t.name
            if t.name in seen:  # only the tied embedding may appear twice, as the same slice
                assert tied and t.name == "model.embed_tokens.weight" and layer.kind == "head"
                assert t.target == "lm_head.weight"  # read into the head's own weight
                assert seen[t.name] == dataclasses.replace(t, target=seen[t.name].target)
            else:
                assert layer.name == expected_layer(t.name), t.name
                seen[t.name] = t
    assert seen.keys() == truth.keys(), "the index lost or invented tensors"

    stored = sum(t.numel() * t.element_size() for _, t in truth.values())
    embed = truth["model.embed_tokens.weight"][1]
    extra = embed.numel() * embed.element_size() if tied else 0
    assert sum(layer.nbytes for layer in index.layers) == index.total_bytes == stored + extra
    head = [t.name for t in index.layers[-1].tensors]
    assert ("lm_head.weight" in head) is not tied
    assert ("model.embed_tokens.weight" in head) is tied


def test_sharded_llama_index_matches_safetensors(llama_dir: Path) -> None:
    index = load_index(llama_dir)
    shards = sorted(p.name for p in llama_dir.glob("*.safetensors"))
    assert len(shards) >= 3, "max_shard_bytes should have forced several shards"
    assert list(index.files) == shards == sorted(set(weight_map(llama_dir).values()))
    assert index.family == "llama"
    assert index.config == json.loads((llama_dir / "config.json").read_text())
    check_against_safetensors(index, LLAMA_LAYERS, tied=False)
    # A decoder layer larger than a shard must gather its tensors from several files.
    assert any(len({t.file for t in layer.tensors}) > 1 for layer in index.layers)


def test_single_file_tied_qwen2_index_matches_safetensors(qwen_dir: Path) -> None:
    assert not (qwen_dir / INDEX_FILE).exists()
    index = load_index(qwen_dir)
    assert index.files == (SINGLE_FILE,)
    assert index.family == "qwen2"
    check_against_safetensors(index, QWEN_LAYERS, tied=True)


def test_decoder_order_is_numeric_past_ten_layers(tmp_path: Path) -> None:
    # As text "layers.10" sorts before "layers.2"; the pipeline order must be numeric.
    shape = CheckpointShape(
        num_layers=12,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=16,
        vocab_size=32,
    )
    index = load_index(make_checkpoint(tmp_path / "deep", shape))
    assert [layer.name for layer in index.layers] == [
        "embed",
        *(f"layers.{i}" for i in range(12)),
        "head",
    ]
    assert [layer.index for layer in index.layers[1:-1]] == list(range(12))


def test_a_checkpoint_rewritten_in_place_is_indexed_as_it_is_now(tmp_path: Path) -> None:
    """load_index keeps the meta model of a config per process; a checkpoint rewritten under the
    same path (another config, or the same config with other weights) is indexed from its
    files as they are now, and one config is built once."""
    from coordinator.planning import checkpoint

    small = dict(TINY, num_layers=2)
    root = make_checkpoint(tmp_path / "ckpt", CheckpointShape(**small))
    first = load_index(root)
    make_checkpoint(root, CheckpointShape(**dict(small, num_layers=3)), force=True)
    deeper = load_index(root)
    assert [x.name for x in deeper.layers] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert [x.name for x in first.layers] == ["embed", "layers.0", "layers.1", "head"]
    built = checkpoint._meta_model.cache_info().misses
    make_checkpoint(root, CheckpointShape(**dict(small, num_layers=3, seed=5)), force=True)
    again = load_index(root)
    assert checkpoint._meta_model.cache_info().misses == built  # the same config: kept
    assert again.identities != deeper.identities  # the new files' identities
    assert again.layers == deeper.layers  # the same shapes, offsets and KV sizes
    check_against_safetensors(again, 3, tied=False)


def test_read_header_matches_safetensors(qwen_dir: Path) -> None:
    slices = read_header(qwen_dir / SINGLE_FILE)
    truth = independent_tensors(qwen_dir)
    assert slices.keys() == truth.keys()
    raw = (qwen_dir / SINGLE_FILE).read_bytes()
    for name, t in slices.items():
        tensor = truth[name][1]
        assert (t.name, t.file, t.shape, t.torch_dtype) == (
            name,
            SINGLE_FILE,
            tuple(tensor.shape),
            tensor.dtype,
        )
        assert raw[t.start : t.end] == tensor_bytes(tensor)


class _CountingFile:
    """A file object that tallies the bytes handed out by read/readinto/readline."""

    def __init__(self, f: io.IOBase, tally: dict[str, int], name: str) -> None:
        self._f, self._tally, self._name = f, tally, name

    def _count(self, n: int) -> None:
        self._tally[self._name] = self._tally.get(self._name, 0) + n

    def read(self, *args):
        data = self._f.read(*args)
        self._count(len(data))
        return data

    def readinto(self, buf):
        n = self._f.readinto(buf)
        self._count(n or 0)
        return n

    def readline(self, *args):
        data = self._f.readline(*args)
        self._count(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, attr):
        return getattr(self._f, attr)


@pytest.mark.parametrize("which", ["llama_dir", "qwen_dir"])
def test_load_index_reads_headers_only(
    which: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    root: Path = request.getfixturevalue(which)
    header_bytes = {
        p.name: 8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in root.glob("*.safetensors")
    }
    tally: dict[str, int] = {}
    real_open = builtins.open

    def spy_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        name = os.fspath(file) if not isinstance(file, int) else ""
        if str(name).endswith(".safetensors"):
            tally.setdefault(Path(name).name, 0)
            return _CountingFile(f, tally, Path(name).name)
        return f

    def refuse(*args, **kwargs):
        raise AssertionError("load_index must read headers with plain reads, not map the data")

    # builtins.open and io.open are the same function; pathlib goes through io.open.
    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr(mmap, "mmap", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    load_index(root)
    monkeypatch.undo()

    assert tally.keys() == header_bytes.keys(), "every file's header must be read, via open()"
    for name, n in tally.items():
        assert n <= header_bytes[name], f"{name}: read {n} bytes, header is {header_bytes[name]}"


def test_garbage_tensor_data_still_indexes(llama_dir: Path, llama_copy: Path) -> None:
    # Data bytes are never parsed: overwriting them (same size) must not change the index.
    for path in llama_copy.glob("*.safetensors"):
        raw = path.read_bytes()
        data_start = 8 + struct.unpack("<Q", raw[:8])[0]
        path.write_bytes(raw[:data_start] + b"\xa5" * (len(raw) - data_start))
    before, after = load_index(llama_dir), load_index(llama_copy)
    assert after.layers == before.layers
    assert after.files == before.files


def test_rewriting_helper_round_trips(qwen_dir: Path, qwen_copy: Path) -> None:
    # The corruption tests below rely on this helper; unchanged content must stay valid.
    rewrite_header(qwen_copy / SINGLE_FILE, lambda header: None)
    assert independent_tensors(qwen_copy).keys() == independent_tensors(qwen_dir).keys()
    assert load_index(qwen_copy).total_bytes == load_index(qwen_dir).total_bytes


# --- 2. every broken checkpoint is a CheckpointError naming the file and tensor ---------------


def add_tensor(path: Path, name: str) -> None:
    """Append a well-formed one-element float32 tensor `name` to safetensors file `path`."""
    header, data = split_safetensors(path)
    header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
    join_safetensors(path, header, data + b"\x00" * 4)


def load_error(root: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_index(root)
    return str(info.value)


def test_missing_shard(llama_copy: Path) -> None:
    shard = sorted(set(weight_map(llama_copy).values()))[1]
    held = sorted(t for t, f in weight_map(llama_copy).items() if f == shard)
    (llama_copy / shard).unlink()
    message = load_error(llama_copy)
    assert shard in message and INDEX_FILE in message and "missing" in message
    assert held[0] in message


def test_index_lists_tensor_absent_from_its_file(llama_copy: Path) -> None:
    shard = sorted(set(weight_map(llama_copy).values()))[-1]
    index = json.loads((llama_copy / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.0.self_attn.ghost.weight"] = shard
    (llama_copy / INDEX_FILE).write_text(json.dumps(index))
    message = load_error(llama_copy)
    assert shard in message and "'model.layers.0.self_attn.ghost.weight'" in message


@pytest.mark.parametrize(
    "target", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", 7]
)
def test_index_cannot_point_outside_the_directory(llama_copy: Path, target: object) -> None:
    index = json.loads((llama_copy / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = target
    (llama_copy / INDEX_FILE).write_text(json.dumps(index))
    message = load_error(llama_copy)
    assert "'model.norm.weight'" in message and "not a file name" in message


@pytest.mark.parametrize("content", ["not json", "{}", '{"metadata": {}}'])
def test_invalid_index_file(llama_copy: Path, content: str) -> None:
    (llama_copy / INDEX_FILE).write_text(content)
    assert INDEX_FILE in load_error(llama_copy)


def test_truncated_data(qwen_copy: Path) -> None:
    path = qwen_copy / SINGLE_FILE
    header, _ = split_safetensors(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    path.write_bytes(path.read_bytes()[:-1])
    message = load_error(qwen_copy)
    assert SINGLE_FILE in message and repr(last) in message and "truncated" in message


@pytest.mark.parametrize("keep", [5, "half header"])
def test_truncated_header(llama_copy: Path, keep: int | str) -> None:
    shard = sorted(set(weight_map(llama_copy).values()))[0]
    raw = (llama_copy / shard).read_bytes()
    if keep == "half header":
        keep = 8 + struct.unpack("<Q", raw[:8])[0] // 2
    (llama_copy / shard).write_bytes(raw[:keep])
    message = load_error(llama_copy)
    assert shard in message and "truncated" in message


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]"])
def test_corrupt_header(qwen_copy: Path, body: bytes) -> None:
    path = qwen_copy / SINGLE_FILE
    header, data = split_safetensors(path)
    original = len(json.dumps(header).encode())
    join_safetensors(path, body.ljust(original), data)  # same length: only the content lies
    message = load_error(qwen_copy)
    assert SINGLE_FILE in message and "corrupt header" in message


def test_oversized_header_length(qwen_copy: Path) -> None:
    path = qwen_copy / SINGLE_FILE
    header, data = split_safetensors(path)
    join_safetensors(path, header, data, length=100_000_001)
    message = load_error(qwen_copy)
    # Refused for its size, before any attempt to read (or allocate) 100 MB of header.
    assert SINGLE_FILE in message and "100000000" in message and "limit" in message


def _set(key: str, value: object) -> Callable[[dict, int], None]:
    def edit(entry: dict, data_size: int) -> None:
        entry[key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_set("dtype", "C64"), "unsupported dtype 'C64'"),
        (_set("dtype", "float32"), "unsupported dtype"),
        (lambda e, n: e.update(data_offsets=[n, n + 4]), "outside"),
        (lambda e, n: e.update(data_offsets=[e["data_offsets"][0], n + 1]), "outside"),
        (lambda e, n: e.update(data_offsets=[-4, e["data_offsets"][1] - 4]), "outside"),
        (lambda e, n: e.update(data_offsets=[8, 4]), "outside"),
        (lambda e, n: e.update(data_offsets=[e["data_offsets"][0]] * 2), "bytes on disk"),
        (_set("data_offsets", [0]), "invalid data_offsets"),
        (_set("shape", [-1]), "invalid shape"),
        (_set("shape", "32"), "invalid shape"),
        (lambda e, n: e.pop("dtype"), "corrupt header entry"),
    ],
    ids=[
        "dtype-c64",
        "dtype-torch-name",
        "offsets-past-end",
        "end-past-end",
        "negative-begin",
        "reversed",
        "size-vs-shape",
        "offsets-not-pair",
        "negative-dim",
        "shape-not-list",
        "no-dtype",
    ],
)
def test_bad_header_entry(llama_copy: Path, edit: Callable[[dict, int], None], words: str) -> None:
    shard = sorted(set(weight_map(llama_copy).values()))[2]
    path = llama_copy / shard
    header, data = split_safetensors(path)
    tensor, _ = slice_in(llama_copy, shard)
    edit(header[tensor], len(data))
    join_safetensors(path, header, data)
    message = load_error(llama_copy)
    assert shard in message and repr(tensor) in message and words in message


@pytest.mark.parametrize("shift_elements", [0, 1])
def test_overlapping_tensors(qwen_copy: Path, shift_elements: int) -> None:
    path = qwen_copy / SINGLE_FILE
    header, data = split_safetensors(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    begin, end = header[a]["data_offsets"]
    assert header[b]["shape"] == header[a]["shape"]  # same size: b's offsets stay shape-valid
    begin += 4 * shift_elements  # float32
    header[b]["data_offsets"] = [begin, begin + end - header[a]["data_offsets"][0]]
    join_safetensors(path, header, data)
    message = load_error(qwen_copy)
    assert SINGLE_FILE in message and "overlap" in message
    assert repr(a) in message and repr(b) in message


def test_shape_contradicts_config(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (llama_copy / "config.json").write_text(json.dumps(config))
    message = load_error(llama_copy)
    match = re.search(r"'(model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight)'", message)
    assert match, message
    # The file the message names must be the one that really holds that tensor.
    assert message.startswith(weight_map(llama_copy)[match.group(1)] + ":")
    assert "config.json" in message and "96" in message


def test_tensor_missing_from_checkpoint(qwen_copy: Path) -> None:
    gone = "model.layers.1.mlp.down_proj.weight"
    rewrite_header(qwen_copy / SINGLE_FILE, lambda header: header.pop(gone))
    message = load_error(qwen_copy)
    assert repr(gone) in message and "config.json" in message


def test_decoder_count_contradicts_config(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config["num_hidden_layers"] = LLAMA_LAYERS - 1
    (llama_copy / "config.json").write_text(json.dumps(config))
    message = load_error(llama_copy)
    assert f"num_hidden_layers={LLAMA_LAYERS - 1}" in message and "config.json" in message


def test_tensor_outside_any_layer(qwen_copy: Path) -> None:
    add_tensor(qwen_copy / SINGLE_FILE, "model.mystery.weight")  # fits no pipeline layer
    message = load_error(qwen_copy)
    assert message.startswith(f"{SINGLE_FILE}: ") and "'model.mystery.weight'" in message


def test_missing_config(qwen_copy: Path) -> None:
    (qwen_copy / "config.json").unlink()
    message = load_error(qwen_copy)
    assert str(qwen_copy) in message and "config.json" in message


def test_config_not_json(qwen_copy: Path) -> None:
    (qwen_copy / "config.json").write_text("{")
    assert "config.json" in load_error(qwen_copy)


class _Tripwire:
    """Unpickling this creates a directory: proof that someone ran the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("with_config", [False, True])
def test_pickle_checkpoint_refused(qwen_dir: Path, tmp_path: Path, with_config: bool) -> None:
    root = tmp_path / "pickled"
    root.mkdir()
    marker = tmp_path / "unpickled"
    (root / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))
    if with_config:
        shutil.copy(qwen_dir / "config.json", root / "config.json")
    message = load_error(root)
    assert "pytorch_model.bin" in message
    assert "arbitrary code" in message and "safetensors" in message
    assert not marker.exists(), "the pickle was loaded"


def test_empty_directory(tmp_path: Path) -> None:
    message = load_error(tmp_path)
    assert str(tmp_path) in message and SINGLE_FILE in message and INDEX_FILE in message


def test_not_a_directory(qwen_dir: Path) -> None:
    message = load_error(qwen_dir / SINGLE_FILE)
    assert SINGLE_FILE in message and "not a directory" in message


# --- 3. make_checkpoint -----------------------------------------------------------------------


def test_refuses_non_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone's real model")
    (out / "notes.txt").write_text("keep me")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="--force"):
        make_checkpoint(out, CheckpointShape(num_layers=1, **TINY))
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_force_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "scratch"
    out.mkdir()
    (out / "notes.txt").write_text("stale")
    make_checkpoint(out, CheckpointShape(num_layers=1, **TINY), force=True)
    assert load_index(out).num_decoder_layers == 1


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("arch", {"arch": "bert"}),
        ("dtype", {"dtype": "int8"}),
        ("dtype", {"dtype": "bf16"}),
        ("num_layers", {"num_layers": 0}),
        ("hidden_size", {"hidden_size": 0}),
        ("num_heads", {"num_heads": 0}),
        ("num_kv_heads", {"num_kv_heads": -1}),
        ("intermediate_size", {"intermediate_size": 0}),
        ("vocab_size", {"vocab_size": 0}),
        ("max_shard_bytes", {"max_shard_bytes": 0}),
        ("hidden_size", {"hidden_size": 30, "num_heads": 4}),
        ("num_heads", {"num_heads": 4, "num_kv_heads": 3}),
    ],
)
def test_invalid_shape(field: str, changes: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=") as info:
        CheckpointShape(**{**TINY, **changes})
    assert repr(changes[field]) in str(info.value) or str(changes[field]) in str(info.value)


def test_bfloat16_checkpoint(tmp_path: Path) -> None:
    out = make_checkpoint(
        tmp_path / "bf16", CheckpointShape(num_layers=2, dtype="bfloat16", **TINY)
    )
    index = load_index(out)
    slices = [t for layer in index.layers for t in layer.tensors]
    assert slices and {t.dtype for t in slices} == {"BF16"}
    truth = independent_tensors(out)
    raw = (out / SINGLE_FILE).read_bytes()
    for t in slices:
        assert truth[t.name][1].dtype == torch.bfloat16
        assert t.nbytes == 2 * truth[t.name][1].numel()
        assert raw[t.start : t.end] == tensor_bytes(truth[t.name][1])


# --- what cannot run is refused before any worker starts -------------------------------------


def rewrite_config(root: Path, **changes: object) -> None:
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            r"quantized \(quantization_config.quant_method='gptq'\).*unquantized",
        ),
        (  # compressed-tensors in another format than FP8 (tests/test_fp8_compressed.py)
            {
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                }
            },
            r"quantization_config.format='pack-quantized' is not supported; supported: "
            "compressed-tensors FP8",
        ),
        (  # FP8 without blocks, or another float8 format: not the block format read here
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e5m2",
                    "weight_block_size": [128, 128],
                }
            },
            r"quant_method='fp8'\).*\(quant_method 'fp8', e4m3, weight_block_size\)",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
            r"quant_method='fp8'\).*\(quant_method 'fp8', e4m3, weight_block_size\)",
        ),
        ({"model_type": "t5", "is_encoder_decoder": True}, r"t5 is an encoder-decoder model"),
        (
            {"model_type": "gemma3", "vision_config": {}, "text_config": {}},
            r"gemma3 is a multimodal model \(vision_config\).*gemma3_text",
        ),
        ({"model_type": "no-such-family"}, r"model_type 'no-such-family' is unknown"),
        ({"model_type": "vit"}, r"vit has no causal-LM class"),
        (
            {"model_type": "bert"},
            r"bert: its input embedding \(bert.embeddings.word_embeddings\) "
            r"is not a module registered before its blocks",
        ),
    ],
)
def test_unsupported_models_are_refused_naming_what_is_supported(
    llama_copy: Path, changes: dict, expected: str
) -> None:
    rewrite_config(llama_copy, **changes)
    message = load_error(llama_copy)
    assert re.search(expected, message), message
    assert "tested families: llama, mistral" in message or "unquantized" in message


def test_an_extra_tensor_is_refused_with_its_name(qwen_copy: Path) -> None:
    """A tensor the model does not own (an adapter, another head) is an error in the index, not
    a raw AttributeError inside a worker."""
    add_tensor(qwen_copy / SINGLE_FILE, "model.layers.0.self_attn.lora_A.weight")
    message = load_error(qwen_copy)
    assert "'model.layers.0.self_attn.lora_A.weight' is not a weight of Qwen2ForCausalLM" in message


def test_keys_transformers_ignores_are_ignored(qwen_copy: Path) -> None:
    """Old exports carry rotary tables; from_pretrained drops them silently and so do we (they
    are listed, never loaded)."""
    add_tensor(qwen_copy / SINGLE_FILE, "model.layers.0.self_attn.rotary_emb.inv_freq")
    index = load_index(qwen_copy)
    assert index.ignored == ("model.layers.0.self_attn.rotary_emb.inv_freq",)
    assert all("inv_freq" not in t.name for layer in index.layers for t in layer.tensors)


def test_deepseek_v3s_multi_token_prediction_layer_is_skipped_as_from_pretrained_skips_it(
    tmp_path: Path,
) -> None:
    """DeepSeek-V3 checkpoints as published carry layer 61, the multi-token prediction module,
    which `from_pretrained` ignores (`_keys_to_ignore_on_load_unexpected`): so does the index,
    listing its tensors, and no layer reads them."""
    shape = CheckpointShape(
        arch="deepseek_v3",
        num_layers=61,
        hidden_size=16,
        num_heads=2,
        intermediate_size=8,
        vocab_size=128,
        max_shard_bytes=10**8,
        tokenizer=False,
    )
    root = make_checkpoint(tmp_path / "dsv3", shape)
    mtp = ["model.layers.61.eh_proj.weight", "model.layers.61.mlp.experts.0.up_proj.weight"]
    for name in mtp:
        add_tensor(root / SINGLE_FILE, name)
    index = load_index(root)
    assert index.ignored == tuple(mtp)
    assert not [t for layer in index.layers for t in layer.tensors if "layers.61." in t.name]
    assert len([x for x in index.layers if x.kind == "decoder"]) == 61


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_dtype_counts_the_bytes_loaded(llama_dir: Path, dtype: str) -> None:
    """A float32 checkpoint loaded in another dtype: the plan's bytes are the loaded ones, the
    read ones stay the file's."""
    index = load_index(llama_dir, dtype=dtype)
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    assert index.dtype == dtype
    assert index.file_bytes == load_index(llama_dir).total_bytes
    assert index.total_bytes == index.file_bytes * size // 4
    assert {t.target_dtype for layer in index.layers for t in layer.tensors} == {dtype}


def test_dtype_auto_is_the_checkpoints(tmp_path: Path) -> None:
    shape = CheckpointShape(arch="llama", num_layers=2, dtype="bfloat16", **TINY)
    root = make_checkpoint(tmp_path / "bf16", shape)
    assert load_index(root).dtype == "bfloat16"
    rewrite_config(root, dtype=None, torch_dtype=None)  # no dtype in config.json: the tensors'
    assert load_index(root).dtype == "bfloat16"
    with pytest.raises(CheckpointError, match="dtype='int8' is not one of auto, float32"):
        load_index(root, dtype="int8")


def test_the_dtype_tables_agree_with_torch() -> None:
    """worker.spec names dtypes and their sizes without torch (an index never imports it):
    every name is torch's, with torch's size and floating-point kind."""
    from worker.spec import DTYPE_BYTES, FLOATING_DTYPES, dtype_size

    assert set(SAFETENSORS_NAMES.values()) <= set(DTYPE_BYTES)
    for name, size in DTYPE_BYTES.items():
        dtype = getattr(torch, name)
        assert dtype.itemsize == size and dtype.is_floating_point == (name in FLOATING_DTYPES)
    assert dtype_size("BF16") == 2 and dtype_size("F8_E4M3") == 1


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("5.17.0", True),
        ("5.20.3", True),
        ("4.57.1", True),
        ("5.21.0", False),
        ("5.22.0.dev0", False),
        ("6.0.0", False),
    ],
)
def test_a_recurrent_model_under_a_transformers_older_than_its_cache_methods_is_refused(
    version: str, refused: bool
) -> None:
    """The release found and the fix are named; from 5.21 on (what the suite passes on)
    nothing is refused."""
    if not refused:
        check_recurrent_support("jamba", version)
        return
    with pytest.raises(UnsupportedModelError) as caught:
        check_recurrent_support("jamba", version)
    message = str(caught.value)
    assert message.startswith("jamba keeps a recurrent state per sequence")
    assert f"this is transformers {version}" in message
    assert "pip install -U 'transformers>=5.21'" in message


def test_load_index_refuses_a_recurrent_model_only_under_an_older_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any worker starts, a hybrid (jamba: mamba and attention layers) is refused in
    one line where its layers would fail mid-step; a model without recurrent state loads. The
    installed transformers is made too old by asking for a release after it."""
    import transformers

    from worker import layout

    hybrid = make_checkpoint(
        tmp_path / "jamba", CheckpointShape(arch="jamba", num_layers=2, **TINY)
    )
    plain = make_checkpoint(tmp_path / "llama", CheckpointShape(arch="llama", num_layers=2, **TINY))
    assert load_index(hybrid).recurrent  # the suite's transformers is new enough
    monkeypatch.setattr(layout, "RECURRENT_CACHE_TRANSFORMERS", (999, 0))
    installed = re.escape(transformers.__version__)
    with pytest.raises(UnsupportedModelError, match=rf"this is transformers {installed}: .*999\.0"):
        load_index(hybrid)
    assert not load_index(plain).recurrent
