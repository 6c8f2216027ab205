"""Reading a Hugging Face safetensors checkpoint into pipeline layers, from the headers only.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Each safetensors file starts with an 8-byte little-endian header
length and a JSON header giving every tensor's dtype, shape and byte range; we read those, check
them against the file size and against the shapes `config.json` implies, and never touch the
tensor data. Pickle checkpoints (`.bin`, `.pt`) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from worker.spec import SAFETENSORS_DTYPES, LayerSpec, TensorSlice, dtype_size

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors itself refuses headers above 100 MB; a larger one is corrupt or hostile.
MAX_HEADER_BYTES = 100_000_000
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DECODER = re.compile(r"^model\.layers\.(\d+)\.")
_EMBED = ("model.embed_tokens.",)
_HEAD = ("model.norm.", "lm_head.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointIndex:
    root: Path
    config: dict
    layers: tuple[LayerSpec, ...]
    files: tuple[str, ...]
    tied_embeddings: bool

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "?")

    @property
    def total_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def num_decoder_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "decoder")


def read_header(path: Path) -> dict[str, TensorSlice]:
    """The tensors of one safetensors file, validated against the file's size."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{name}: truncated: {size} bytes, not even a header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{name}: header length {header_len} bytes exceeds the {MAX_HEADER_BYTES} "
                    "byte limit: corrupt or not a safetensors file"
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{name}: truncated: header says {header_len} bytes but the file has "
                    f"{size - 8} after the length"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot read: {exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{name}: corrupt header: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: corrupt header: expected a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorSlice] = {}
    for tensor, meta in header.items():
        if tensor == "__metadata__":
            continue
        tensors[tensor] = _tensor_slice(name, tensor, meta, data_start, data_size)
    spans = sorted(tensors.values(), key=lambda t: (t.start, t.end))
    for before, after in itertools.pairwise(spans):
        if after.start < before.end:
            raise CheckpointError(
                f"{name}: tensors {before.name!r} and {after.name!r} overlap "
                f"(bytes {before.start}-{before.end} and {after.start}-{after.end})"
            )
    return tensors


def _tensor_slice(
    file: str, tensor: str, meta: object, data_start: int, data_size: int
) -> TensorSlice:
    where = f"{file}: tensor {tensor!r}"
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
        raise CheckpointError(f"{where}: corrupt header entry {meta!r}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where}: unsupported dtype {dtype!r} (supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: invalid shape {shape!r}")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise CheckpointError(f"{where}: invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} lie outside the file's {data_size} data bytes "
            "(truncated or corrupt file)"
        )
    numel = 1
    for d in shape:
        numel *= d
    if (end - begin) != numel * dtype_size(dtype):
        raise CheckpointError(
            f"{where}: {end - begin} bytes on disk but shape {shape} of {dtype} needs "
            f"{numel * dtype_size(dtype)}"
        )
    return TensorSlice(
        name=tensor, dtype=dtype, shape=tuple(shape), file=file,
        start=data_start + begin, end=data_start + end,
    )  # fmt: skip


def _tensor_files(root: Path) -> dict[str, str]:
    """tensor name -> file name, from the index or the single file."""
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{INDEX_FILE}: invalid index ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{INDEX_FILE}: weight_map is empty or not an object")
        for tensor, file in weight_map.items():
            # Shards are plain file names beside the index: never a path out of the directory.
            if not isinstance(file, str) or Path(file).name != file or file in (".", ".."):
                raise CheckpointError(
                    f"{INDEX_FILE}: tensor {tensor!r} maps to {file!r}, which is not a file name "
                    "in the checkpoint directory"
                )
        return weight_map
    if (root / SINGLE_FILE).exists():
        return {}
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{root}: only pickle weights ({', '.join(pickles)}); they are refused because "
            "unpickling runs arbitrary code and cannot be read by offset. Convert once with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out) "
            "writes safetensors"
        )
    raise CheckpointError(f"{root}: no {SINGLE_FILE} and no {INDEX_FILE}")


def _layer_of(tensor: str, file: str) -> tuple[str, str, int | None]:
    match = _DECODER.match(tensor)
    if match:
        index = int(match.group(1))
        return f"layers.{index}", "decoder", index
    if tensor.startswith(_EMBED):
        return "embed", "embed", None
    if tensor.startswith(_HEAD):
        return "head", "head", None
    raise CheckpointError(
        f"{file}: tensor {tensor!r} belongs to no pipeline layer (expected model.embed_tokens.*, "
        "model.layers.N.*, model.norm.* or lm_head.*)"
    )


def load_index(root: str | os.PathLike) -> CheckpointIndex:
    """Index a checkpoint directory. Raises CheckpointError naming the file and tensor."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    # Weights first: a pickle-only directory must hear why it is refused, not that it lacks
    # config.json (adding one would only lead to the pickle refusal).
    weight_map = _tensor_files(root)
    config_path = root / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root}: config.json is missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"config.json: not valid JSON ({exc})") from None
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    tensors: dict[str, TensorSlice] = {}
    for file in files:
        path = root / file
        if not path.exists():
            listed = sorted(t for t, f in weight_map.items() if f == file)
            raise CheckpointError(
                f"{file}: shard listed in {INDEX_FILE} is missing (it holds {len(listed)} "
                f"tensors, e.g. {listed[0]!r})"
            )
        header = read_header(path)
        if weight_map:
            for tensor, owner in weight_map.items():
                if owner == file and tensor not in header:
                    raise CheckpointError(
                        f"{file}: tensor {tensor!r} is in {INDEX_FILE} but not in the file"
                    )
            header = {t: s for t, s in header.items() if weight_map.get(t) == file}
        tensors.update(header)
    layers = _group_layers(tensors)
    expected, ties_embeddings = expected_shapes(config)
    # Tied per the architecture's own default when config.json does not say.
    tied = ties_embeddings and "lm_head.weight" not in tensors
    _check_against_config(config, expected, tensors, layers, tied)
    if tied:  # the head reads the embedding matrix: give it those bytes too
        head = next(layer for layer in layers if layer.kind == "head")
        embed = tensors["model.embed_tokens.weight"]
        layers[layers.index(head)] = LayerSpec(
            name="head", kind="head", index=None, tensors=(*head.tensors, embed)
        )
    return CheckpointIndex(
        root=root, config=config, layers=tuple(layers), files=tuple(files), tied_embeddings=tied
    )


def _group_layers(tensors: dict[str, TensorSlice]) -> list[LayerSpec]:
    groups: dict[str, tuple[str, int | None, list[TensorSlice]]] = {}
    for name in sorted(tensors):
        layer, kind, index = _layer_of(name, tensors[name].file)
        groups.setdefault(layer, (kind, index, []))[2].append(tensors[name])
    order = {"embed": 0, "decoder": 1, "head": 2}
    layers = [
        LayerSpec(name=name, kind=kind, index=index, tensors=tuple(items))
        for name, (kind, index, items) in groups.items()
    ]
    layers.sort(key=lambda layer: (order[layer.kind], layer.index or 0))
    return layers


def expected_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Parameter shapes of the architecture `config` describes, from the model class itself
    built on the meta device (no memory, no weights), and whether it ties its embeddings."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.for_model(**config)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(
            f"config.json: unknown model_type {config.get('model_type')!r} ({exc})"
        ) from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    return shapes, bool(getattr(hf_config, "tie_word_embeddings", False))


def _check_against_config(
    config: dict,
    expected: dict[str, tuple[int, ...]],
    tensors: dict[str, TensorSlice],
    layers: list[LayerSpec],
    tied: bool,
) -> None:
    for name, tensor in tensors.items():
        if name not in expected:
            continue  # e.g. rotary inv_freq saved by old exports: harmless, not loaded
        if tensor.shape != expected[name]:
            raise CheckpointError(
                f"{tensor.file}: tensor {name!r} has shape {list(tensor.shape)} but config.json "
                f"implies {list(expected[name])}"
            )
    missing = sorted(
        n for n in expected if n not in tensors and not (tied and n == "lm_head.weight")
    )
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} tensors that config.json implies, e.g. {missing[:3]}"
        )
    decoders = [layer.index for layer in layers if layer.kind == "decoder"]
    if decoders != list(range(config.get("num_hidden_layers", len(decoders)))):
        raise CheckpointError(
            f"decoder layers {decoders[:3]}..{decoders[-3:]} do not match "
            f"num_hidden_layers={config.get('num_hidden_layers')} in config.json"
        )
