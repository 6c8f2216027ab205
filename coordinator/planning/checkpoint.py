"""Reading a Hugging Face safetensors checkpoint into pipeline layers, from the headers only.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Each safetensors file starts with an 8-byte little-endian header
length and a JSON header giving every tensor's dtype, shape and byte range; we read those, check
them against the file size and against the model `config.json` describes (built on the meta
device: which parameter each tensor fills, through transformers' own weight conversion, see
`coordinator.planning.weight_map`; which pipeline layer holds it, see `worker.layout`), and never touch
the tensor data. What cannot run is refused here, before any worker starts. Pickle checkpoints (`.bin`, `.pt`) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from offload.errors import CheckpointError
from worker.names import COMPUTE_DTYPE_NAMES
from worker.spec import (
    MAX_HEADER_BYTES,
    SAFETENSORS_NAMES,
    FileIdentity,
    LayerSpec,
    TensorSlice,
    dtype_size,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointIndex:
    root: Path
    config: dict
    layers: tuple[LayerSpec, ...]
    files: tuple[str, ...]
    identities: tuple[FileIdentity, ...]  # each file as indexed; workers read only these
    tied_embeddings: bool
    dtype: str  # what the model loads and computes in (torch name)
    ignored: tuple[str, ...] = ()  # checkpoint keys from_pretrained ignores too
    # a model with recurrent state whose code continues it over a second prompt chunk
    # (`family_check.continues_chunks`); True where there is no such state
    chunks_continue: bool = True

    @property
    def family(self) -> str:
        return self.config.get("model_type", "?")

    @property
    def total_bytes(self) -> int:
        """Bytes of the loaded model, in `dtype`."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def file_bytes(self) -> int:
        """Bytes read from the files to load it (tied weights twice when on two stages)."""
        return sum(layer.file_bytes for layer in self.layers)

    @property
    def num_decoder_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "decoder")

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a recurrent state per sequence (a mamba or linear-attention
        hybrid): every row of a generation step must feed equally many tokens."""
        return any(layer.state_bytes for layer in self.layers)


def shown(path: str | Path) -> str:
    """A path as an error names it on one line: as given, or quoted with its control characters
    escaped (a path the user typed may hold a newline)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


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
    if dtype not in SAFETENSORS_NAMES:
        raise CheckpointError(
            f"{where}: unsupported dtype {dtype!r} (supported: {', '.join(SAFETENSORS_NAMES)})"
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
        name=tensor,
        dtype=dtype,
        shape=tuple(shape),
        file=file,
        start=data_start + begin,
        end=data_start + end,
    )


def read_config(root: str | os.PathLike) -> dict:
    """The checkpoint's config.json, as a dict (CheckpointError when missing or not JSON)."""
    path = Path(root) / "config.json"
    if not (path.exists() or path.is_symlink()):
        raise CheckpointError(f"{shown(root)}: config.json is missing")
    return _read_json(path, "config.json")


def _read_json(path: Path, name: str) -> dict:
    """A JSON object from `path`; anything else (a directory, a link loop, not JSON, not an
    object) is a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{name}: expected a JSON object, got a {type(value).__name__}")
    return value


def _tensor_files(root: Path) -> dict[str, str]:
    """tensor name -> file name, from the index or the single file."""
    index = root / INDEX_FILE
    if index.exists() or index.is_symlink():
        raw = _read_json(index, INDEX_FILE)
        weight_map = raw.get("weight_map")
        if weight_map is None:
            raise CheckpointError(f"{INDEX_FILE}: invalid index (no 'weight_map' key)")
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
            f"{shown(root)}: only pickle weights ({', '.join(pickles)}); they are refused because "
            "unpickling runs arbitrary code and cannot be read by offset. Convert once with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out) "
            "writes safetensors"
        )
    raise CheckpointError(f"{shown(root)}: no {SINGLE_FILE} and no {INDEX_FILE}")


def _identity(path: Path) -> FileIdentity:
    from worker.loader import identify  # torch: an index's users (a keeper) never build one

    fd = os.open(path, os.O_RDONLY)
    try:
        return identify(fd, path.name)
    finally:
        os.close(fd)


def checkpoint_dtype(config: dict, tensors: dict[str, TensorSlice], requested: str = "auto") -> str:
    """The dtype the model loads and computes in: `requested` unless "auto", else config.json's
    `dtype` (`torch_dtype` in older files), else the floating dtype holding most bytes."""
    if requested != "auto":
        if requested not in COMPUTE_DTYPE_NAMES:
            raise CheckpointError(
                f"dtype={requested!r} is not one of auto, {', '.join(COMPUTE_DTYPE_NAMES)}"
            )
        return requested
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and named in COMPUTE_DTYPE_NAMES:
        return named
    by_dtype: Counter[str] = Counter()
    for tensor in tensors.values():
        torch_name = SAFETENSORS_NAMES[tensor.dtype]
        if torch_name in COMPUTE_DTYPE_NAMES:
            by_dtype[torch_name] += tensor.nbytes
    return by_dtype.most_common(1)[0][0] if by_dtype else "float32"


# A process indexes the same few configs again and again (the driver at each launch and attach,
# the reference, the tests: ~400 times in three test modules). Built from config.json and the
# dtype alone, the meta model (no storage, only read here: by find_layout, map_tensors) and the
# KV facts its layers measure are kept per process: they were ~27 and ~16 ms of each ~70 ms index.
# The tensors, their files and identities are read each time, so a rewritten file is seen.
@functools.lru_cache(maxsize=8)
def _meta_model(described: str, dtype: str):
    from worker.layout import build_meta_model, hf_config_from_dict
    from worker.spec import torch_dtype_named

    config = json.loads(described)
    return build_meta_model(hf_config_from_dict(config, dtype=torch_dtype_named(dtype)))


@functools.lru_cache(maxsize=8)
def _kv_per_layer(described: str, dtype: str) -> tuple[tuple[int, int | None, int], ...]:
    from worker.layout import kv_per_layer

    return tuple(kv_per_layer(_meta_model(described, dtype)))


def load_index(root: str | os.PathLike, *, dtype: str = "auto") -> CheckpointIndex:
    """Index a checkpoint directory for a model computing in `dtype` ("auto": the checkpoint's).
    Raises CheckpointError naming the file and tensor, before any worker starts."""
    from worker.layout import (
        UnsupportedModelError,
        check_recurrent_support,
        check_supported,
        find_layout,
        fp8_scheme,
        is_mxfp4,
    )

    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{shown(root)}: not a directory")
    # Weights first: a pickle-only directory must hear why it is refused, not that it lacks
    # config.json (adding one would only lead to the pickle refusal).
    weight_map = _tensor_files(root)
    config = read_config(root)
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    tensors: dict[str, TensorSlice] = {}
    identities: list[FileIdentity] = []
    for file in files:
        path = root / file
        if not path.exists():
            listed = sorted(t for t, f in weight_map.items() if f == file)
            raise CheckpointError(
                f"{file}: shard listed in {INDEX_FILE} is missing (it holds {len(listed)} "
                f"tensors, e.g. {listed[0]!r})"
            )
        header = read_header(path)
        identities.append(_identity(path))
        if weight_map:
            for tensor, owner in weight_map.items():
                if owner == file and tensor not in header:
                    raise CheckpointError(
                        f"{file}: tensor {tensor!r} is in {INDEX_FILE} but not in the file"
                    )
            header = {t: s for t, s in header.items() if weight_map.get(t) == file}
        tensors.update(header)
    compute_dtype = checkpoint_dtype(config, tensors, dtype)
    try:
        check_supported(config)
    except UnsupportedModelError as exc:
        raise CheckpointError(str(exc)) from None
    described = json.dumps(config, sort_keys=True)  # the cache's key: what the model is built from
    try:
        model = _meta_model(described, compute_dtype)
    except Exception as exc:  # transformers rejects the config (with its own error types)
        lines = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in lines[:3])[:500]
        raise CheckpointError(
            f"config.json: transformers cannot build {config.get('model_type')!r} from it: "
            f"{type(exc).__name__}: {detail}"
        ) from None
    from coordinator.planning.weight_map import WeightMapError, map_tensors  # torch

    try:
        layout = find_layout(model)
        placed, ignored = map_tensors(
            model, tensors, fp8=fp8_scheme(config), mxfp4=is_mxfp4(config)
        )
    except (UnsupportedModelError, WeightMapError) as exc:
        raise CheckpointError(str(exc)) from None
    by_layer: dict[str, list[TensorSlice]] = {name: [] for name in layout.layer_names()}
    for tensor in placed:
        layer = layout.layer_of(tensor.target)
        if layer is None:
            raise CheckpointError(
                f"{tensor.file}: tensor {tensor.name!r} fills {tensor.target!r}, which is in no "
                f"pipeline layer of {layout.family} (embeddings {list(layout.embed_paths)}, "
                f"blocks {layout.layers_path}.N, head {list(layout.head_paths)})"
            )
        by_layer[layer].append(tensor)
    kv = _kv_per_layer(described, compute_dtype)
    layers = tuple(
        _with_routing(
            LayerSpec(
                name=name,
                kind=_kind(name),
                index=_index(name),
                tensors=tuple(items),
                **_kv_fields(kv, _index(name)),
            ),
            config,
            _unroutable(model, layout, name),
        )
        for name, items in by_layer.items()
    )
    index = CheckpointIndex(
        root=root,
        config=config,
        layers=layers,
        files=tuple(files),
        identities=tuple(identities),
        tied_embeddings=bool(getattr(model, "all_tied_weights_keys", None)),
        dtype=compute_dtype,
        ignored=tuple(ignored),
    )
    if not index.recurrent:
        return index
    check_recurrent_support(index.family)
    from coordinator.family_check import continues_chunks

    return replace(index, chunks_continue=continues_chunks(config))


# config.json's names of an MoE model's routed experts and of the experts each token goes to
_EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token", "moe_topk")


def _unroutable(model, layout, name: str) -> list[str]:
    """The experts modules of decoder layer `name` of the meta model that are not handed their
    routing (`offload.routed.unroutable_experts`); none for the embedding and head."""
    if _kind(name) != "decoder":
        return []
    from offload.routed import unroutable_experts  # torch

    (path,) = layout.module_paths(name)
    return unroutable_experts(model.get_submodule(path))


def _with_routing(layer: LayerSpec, config: dict, unroutable: list[str] = ()) -> LayerSpec:
    """A decoder layer with experts (`unit_bytes("experts")`) with its routing fan-out from
    config.json (its text config's, for a model that nests one): what the planner's routed
    fetch expects a step to move. None where its experts modules are not told the routing
    (`unroutable`, Llama 4's: they compute every expert), so the plan moves every expert, as
    the workers do (`offload.routed.experts_modules` leaves such modules out)."""
    if layer.kind != "decoder" or not layer.unit_bytes("experts") or unroutable:
        return layer
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    count = next((text[k] for k in _EXPERT_COUNTS if isinstance(text.get(k), int)), 0)
    per_token = next((text[k] for k in _EXPERTS_PER_TOKEN if isinstance(text.get(k), int)), 0)
    if count < 1 or per_token < 1:
        return layer
    return replace(layer, experts=count, experts_per_token=per_token)


def _kv_fields(kv: tuple[tuple[int, int | None, int], ...], index: int | None) -> dict:
    """A decoder layer's KV cache bytes per token, and its recurrent state's per sequence. No
    window: the workers' KV blocks keep every position of a sequence for every layer, sliding
    ones included (worker/batch_cache.py), so the plan reserves that much, never less than they
    use."""
    if index is None:
        return {}
    per_token, _window, state = kv[index]
    return {"kv_bytes_per_token": per_token, "state_bytes": state}


def _kind(layer: str) -> str:
    return layer if layer in ("embed", "head") else "decoder"


def _index(layer: str) -> int | None:
    return int(layer.split(".")[1]) if layer.startswith("layers.") else None
