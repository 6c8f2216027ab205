"""A causal LM's pipeline layers, found from the model itself, and the checks that come first.

The model is the real `transformers` class, built from its config on the meta device (no memory,
no weights) in the dtype it will compute in. Its decoder blocks are the `nn.ModuleList` of the
base model whose entries are the block class the model names in `_no_split_modules` (the unit
`transformers` itself never splits across devices), one per `num_hidden_layers`. What the base
model registers before that list (token and position embeddings) is the pipeline's "embed"
layer; what it registers after it (the final norm) plus the LM head is the "head" layer. Nearly
every decoder-only model in `transformers` is written in that order, which the family tests
check; where the base model's forward first uses a module registered before the blocks only
after them (OPT's final norm), that module is in the head. Families outside the tests are
checked before launch (coordinator/family_check.py).

This is the one place that knows how checkpoint and parameter names map onto pipeline layers:
the checkpoint index, the stage and the worker's placement all ask a `ModelLayout`.
"""

from __future__ import annotations

import ast
import inspect
import logging
import math
import re
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from offload.errors import CheckpointError
from offload.host_store import owner_of
from worker.names import TESTED_FAMILIES

EMBED, HEAD = "embed", "head"
_DECODER = re.compile(r"^layers\.(\d+)$")


class UnsupportedModelError(CheckpointError):
    """A checkpoint this project cannot run; the message names the family and what is supported."""


def _supported_text() -> str:
    return f"decoder-only causal LMs; tested families: {', '.join(TESTED_FAMILIES)}"


def is_block_fp8(quant) -> bool:
    """`quantization_config` of the fine-grained FP8 format (DeepSeek-V3, Kimi-K2, the Qwen3
    -FP8 checkpoints): float8_e4m3fn weights with a `weight_scale_inv` per block of
    `weight_block_size` (the checkpoint index checks each weight's grid against it)."""
    return (
        isinstance(quant, dict)
        and quant.get("quant_method") == "fp8"
        and quant.get("fmt", "e4m3") == "e4m3"
        and "weight_block_size" in quant
    )


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The (rows, cols) block of config.json's block-FP8 `quantization_config`
    (`weight_block_size`); None where the checkpoint is not block-FP8. UnsupportedModelError
    for a block that is not two sizes >= 1."""
    quant = config.get("quantization_config")
    if not is_block_fp8(quant):
        return None
    block = quant["weight_block_size"]
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in block)
    ):
        raise UnsupportedModelError(
            f"config.json: quantization_config.weight_block_size={block!r} is not two block "
            "sizes >= 1 (rows, cols), as block-FP8 checkpoints give it (e.g. [128, 128])"
        )
    return block[0], block[1]


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 weights read (config.json's `quantization_config`): each
    F8_E4M3 `<name>` times its `<name><suffix>` scales, one per block of `block` (rows, cols),
    or per `strategy` "tensor" (one scale: the whole matrix is one block) or "channel" (one
    per row: blocks of one row), in float32, then cast to the model's dtype. `ignore`: the
    modules (names, or `re:` patterns) compressed-tensors stores unquantized."""

    method: str  # "fp8" (block FP8) or "compressed-tensors"
    suffix: str  # "_scale_inv" or "_scale" (`weight_scale`)
    strategy: str  # "block", "tensor" or "channel"
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    def block_of(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The block of a weight of `shape` (rows, cols)."""
        if self.strategy == "tensor":
            return shape[0], shape[1]
        if self.strategy == "channel":
            return 1, shape[1]
        return self.block

    def ignores(self, module: str) -> bool:
        return any(
            re.fullmatch(entry[3:], module) if entry.startswith("re:") else entry == module
            for entry in self.ignore
        )


# compressed-tensors: the one scheme read (FP8 weights, float scales per tensor, channel or
# block; see `_compressed_fp8`)
_CT_FP8 = (
    "compressed-tensors FP8 (format float-quantized: 8-bit float symmetric weights, strategy "
    "tensor, channel or block)"
)
_CT_FORMATS = ("float-quantized", "naive-quantized")


def _ct_refused(field: str, value) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"config.json: quantization_config.{field}={value!r} is not supported; supported: {_CT_FP8}, "
        "besides unquantized and block-FP8 checkpoints"
    )


def _compressed_fp8(quant: dict) -> Fp8Scheme:
    """The FP8 scheme of a compressed-tensors `quantization_config`, or UnsupportedModelError
    in one line naming the field: another format (pack-quantized, int-quantized, sparse ones,
    nvfp4 / mxfp4), weights that are not 8-bit symmetric floats in tensor, channel or block
    strategy, config groups with different weight schemes, quantized outputs or KV cache.
    Activations are never quantized here (the weights are dequantized, as transformers does
    when it decompresses): a static scheme's `input_scale` tensors are dropped at indexing."""
    fmt = quant.get("format")
    if fmt not in _CT_FORMATS:
        raise _ct_refused("format", fmt)
    for field in ("sparsity_config", "kv_cache_scheme"):
        if quant.get(field):
            raise _ct_refused(field, quant[field])
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _ct_refused("config_groups", groups)
    schemes = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise _ct_refused(where, group)
        if group.get("format", fmt) not in _CT_FORMATS:
            raise _ct_refused(f"{where}.format", group.get("format"))
        if group.get("output_activations"):
            raise _ct_refused(f"{where}.output_activations", group["output_activations"])
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise _ct_refused(f"{where}.weights", weights)
        # compressed-tensors' defaults where a field is absent (its `type` defaults to int)
        wanted = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        for field, value in wanted.items():
            if weights.get(field, "int" if field == "type" else value) != value:
                raise _ct_refused(f"{where}.weights.{field}", weights.get(field))
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _ct_refused(f"{where}.weights.strategy", strategy)
        block = None
        if strategy == "block":
            block = weights.get("block_structure")
            if not (
                isinstance(block, list)
                and len(block) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in block)
            ):
                raise _ct_refused(f"{where}.weights.block_structure", block)
            block = (block[0], block[1])
        activations = group.get("input_activations")
        if activations is not None and not isinstance(activations, dict):
            raise _ct_refused(f"{where}.input_activations", activations)
        schemes.add((strategy, block))
    if len(schemes) > 1:
        raise _ct_refused(
            "config_groups", f"{len(groups)} groups of weight schemes {sorted(schemes, key=str)}"
        )
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise _ct_refused("ignore", ignore)
    strategy, block = schemes.pop()
    return Fp8Scheme("compressed-tensors", "_scale", strategy, block, tuple(ignore))


def fp8_scheme(config: dict) -> Fp8Scheme | None:
    """How config.json's `quantization_config` says FP8 weights read: block FP8 (`fp8_block_size`)
    or compressed-tensors FP8 (`_compressed_fp8`); None for a checkpoint with neither.
    UnsupportedModelError, in one line naming the field, for a config of either method that
    would read as other numbers."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors":
        return _compressed_fp8(quant)
    block = fp8_block_size(config)
    return None if block is None else Fp8Scheme("fp8", "_scale_inv", "block", block)


def is_mxfp4(config: dict) -> bool:
    """Whether config.json's `quantization_config` is gpt-oss's MXFP4 (`quant_method`
    "mxfp4"): its experts' `<name>_blocks` and `<name>_scales` read as `offload.mxfp4`
    defines them (`modules_to_not_convert` only names what has no such pair)."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def check_supported(config: dict) -> None:
    """Refuse, from config.json alone, what cannot run: quantized checkpoints other than block
    FP8 and compressed-tensors FP8 (`fp8_scheme`) and MXFP4 (`is_mxfp4`), encoder-decoder
    and vision/audio models, and model types transformers has no causal LM for."""
    family = config.get("model_type")
    if not family:
        raise UnsupportedModelError(
            f"config.json has no model_type; supported: {_supported_text()}"
        )
    if not isinstance(family, str):
        raise UnsupportedModelError(
            f"config.json: model_type must be a string, got {family!r}; supported: "
            f"{_supported_text()}"
        )
    quant = config.get("quantization_config")
    if quant and fp8_scheme(config) is None and not is_mxfp4(config):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelError(
            f"{family}: the checkpoint is quantized (quantization_config.quant_method={method!r});"
            f" supported: unquantized checkpoints (float32, bfloat16, float16), block-FP8 "
            "ones as DeepSeek-V3 publishes them (quant_method 'fp8', e4m3, weight_block_size), "
            f"{_CT_FP8}, and MXFP4 as gpt-oss publishes it (quant_method 'mxfp4')"
        )
    if config.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"{family} is an encoder-decoder model; supported: {_supported_text()}"
        )
    towers = sorted(
        k
        for k in config
        if k.endswith("_config")
        and k.split("_")[0] in ("vision", "audio", "speech", "image", "video", "encoder")
    )
    if towers:
        raise UnsupportedModelError(
            f"{family} is a multimodal model ({', '.join(towers)}); supported: "
            f"{_supported_text()} (for Gemma 3 text, use a gemma3_text checkpoint)"
        )
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        AutoConfig.for_model(family)
    except (KeyError, ValueError):
        raise UnsupportedModelError(
            f"model_type {family!r} is unknown to this transformers; supported: {_supported_text()}"
        ) from None
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{family} has no causal-LM class in transformers; supported: {_supported_text()}"
        )


def hf_config_from_dict(
    config: dict, *, dtype: torch.dtype, attn_implementation: str | None = None
):
    """The transformers config of config.json, computing in `dtype`; `attn_implementation`
    None leaves the choice to transformers, as `from_pretrained` does (sdpa where the model
    supports it, eager for Gemma 2)."""
    from transformers import AutoConfig

    # a quantized checkpoint's model is the unquantized one: its weights are dequantized while
    # read (worker.loader), or after each copy where kept quantized in host memory, as
    # transformers does without an FP8 GPU (or with `Mxfp4Config(dequantize=True)`)
    dropped = ("dtype", "torch_dtype", "quantization_config")
    values = {k: _json_floats(v) for k, v in config.items() if k not in dropped}
    hf_config = AutoConfig.for_model(**values)
    hf_config.dtype = dtype
    if attn_implementation is not None:
        hf_config._attn_implementation = attn_implementation
    return hf_config


_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _json_floats(value):
    """`value` with the floats JSON cannot spell back: `save_pretrained` writes infinity and
    NaN as `{"__float__": "Infinity"}` (Bamba's `time_step_limit`), as `from_pretrained` reads
    them."""
    if isinstance(value, dict):
        if value.keys() == {"__float__"} and value["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: _json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_floats(v) for v in value]
    return value


def model_class_for(hf_config) -> type:
    """The causal-LM class of `hf_config` (importing its modeling module)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


def build_meta_model(hf_config) -> nn.Module:
    """The model's causal-LM class on the meta device, each tensor in the dtype `from_pretrained`
    gives it: the config's dtype, except what the class keeps in float32 (its dtype plan)."""
    from transformers.core_model_loading import build_glob_alternation

    with torch.device("meta"):
        model = model_class_for(hf_config)._from_config(hf_config, dtype=hf_config.dtype)
    plan = model._get_dtype_plan(hf_config.dtype)
    if plan:
        alternation, group_names, _ = build_glob_alternation(list(plan))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            match = alternation.search(name)
            if match is not None and tensor.dtype != plan[group_names[match.lastgroup]]:
                wanted = plan[group_names[match.lastgroup]]
                owner, leaf = owner_of(model, name)
                if isinstance(tensor, nn.Parameter):
                    setattr(owner, leaf, nn.Parameter(tensor.to(wanted), requires_grad=False))
                else:
                    owner._buffers[leaf] = tensor.to(wanted)
    return model.eval()


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelLayout:
    """Module paths of the pipeline layers in one model class."""

    family: str
    layers_path: str  # the decoder ModuleList, e.g. "model.layers", "transformer.h"
    num_layers: int
    embed_paths: tuple[str, ...]  # modules with weights before the blocks
    head_paths: tuple[str, ...]  # modules with weights after them, and the LM head

    @property
    def base_path(self) -> str:
        return self.layers_path.rpartition(".")[0]

    def module_paths(self, layer: str) -> tuple[str, ...]:
        """The model's modules that make up pipeline layer `layer`."""
        if layer == EMBED:
            return self.embed_paths
        if layer == HEAD:
            return self.head_paths
        match = _DECODER.match(layer)
        if match is None or int(match.group(1)) >= self.num_layers:
            raise KeyError(f"{self.family} has no pipeline layer {layer!r}")
        return (f"{self.layers_path}.{match.group(1)}",)

    def local_name(self, layer: str, name: str) -> str:
        """The name of parameter `name` inside `Stage.layer_modules()[layer]`."""
        paths = self.module_paths(layer)
        for i, path in enumerate(paths):
            if name.startswith(path + "."):
                rest = name[len(path) + 1 :]
                return f"{i}.{rest}" if layer in (EMBED, HEAD) else rest
        raise KeyError(f"{name!r} is not in pipeline layer {layer!r} of {self.family}")

    def layer_names(self) -> list[str]:
        return [EMBED, *(f"layers.{i}" for i in range(self.num_layers)), HEAD]

    def layer_of(self, name: str) -> str | None:
        """The pipeline layer that holds parameter (or buffer) `name`, None for none."""
        prefix = self.layers_path + "."
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            return f"layers.{index}" if index.isdigit() else None
        for layer, paths in ((EMBED, self.embed_paths), (HEAD, self.head_paths)):
            if any(name.startswith(path + ".") for path in paths):
                return layer
        return None


def kv_per_layer(model: nn.Module) -> list[tuple[int, int | None, int]]:
    """(KV bytes per token of one sequence, sliding window or None, recurrent-state bytes of one
    sequence) of each decoder layer, from the cache `generate` builds for the model
    (`DynamicCache(config=...)`: which layers slide) and what the model's own layers write to
    it (`measure_cache_writes`)."""
    from transformers import DynamicCache

    text = model.config.get_text_config()
    writes = measure_cache_writes(model.config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    # Measured: a layer that wrote nothing caches nothing (a mamba layer; a layer sharing
    # another's keys). Not measured: the config's heads stand in for every layer.
    assumed = 0 if writes.measured else 2 * kv_heads * head_dim * model.config.dtype.itemsize
    cache = DynamicCache(config=model.config)
    windows: list[int | None] = [None] * text.num_hidden_layers
    if len(cache.layers) == text.num_hidden_layers:
        windows = [
            getattr(layer, "sliding_window", None) if sliding else None
            for layer, sliding in zip(cache.layers, cache.is_sliding, strict=True)
        ]
    return [
        (writes.per_token.get(i, assumed), window, writes.per_sequence.get(i, 0))
        for i, window in enumerate(windows)
    ]


@dataclass(frozen=True)
class CacheWrites:
    """What each decoder layer's own code writes to its cache for one sequence: keys and values
    per token (`per_token`), and fixed-size convolution and recurrent states (`per_sequence`:
    mamba mixers, linear attention, short convolutions), in bytes by layer index."""

    per_token: dict[int, int]
    per_sequence: dict[int, int]
    measured: bool  # False: the forward could not run on the meta device (nothing known)

    @property
    def recurrent(self) -> bool:
        return bool(self.per_sequence)


# The oldest transformers whose recurrent layers (mamba mixers, gated delta-nets, short
# convolutions) read and write their states only through the cache's methods
# (`get_conv_state`, `update_recurrent_state`...), which the stage's per-slot pool answers
# (`worker.batch_view`). Up to 5.20 some read `cache.layers[i].conv_states` directly, which a
# pool has not: jamba, bamba, qwen3_next and lfm2 failed mid-step with an IndexError (the suite
# run on 5.17 and 5.20 against 5.21 and 5.22: bench/RESULTS.md, "torch and transformers
# releases").
RECURRENT_CACHE_TRANSFORMERS = (5, 21)


def check_recurrent_support(family: str, version: str | None = None) -> None:
    """Refuse a model with recurrent state per sequence under a transformers older than
    `RECURRENT_CACHE_TRANSFORMERS`, naming the release found and the fix; `version` defaults
    to the installed one."""
    from packaging.version import Version  # transformers' own dependency

    if version is None:
        import transformers

        version = transformers.__version__
    if Version(version).release >= RECURRENT_CACHE_TRANSFORMERS:
        return
    needed = ".".join(map(str, RECURRENT_CACHE_TRANSFORMERS))
    raise UnsupportedModelError(
        f"{family} keeps a recurrent state per sequence, which its layers reach through the "
        f"cache methods of transformers {needed} and later; this is transformers {version}: "
        f"pip install -U 'transformers>={needed}'"
    )


def measure_cache_writes(hf_config) -> CacheWrites:
    """What the model's own layers write to their cache: its forward over two tokens on the
    meta device (no memory, no arithmetic), its MLPs and experts passed through (their routing
    needs values), into a cache that records each write's shape and dtype. That is what the slot
    pools hold (`tests/test_family_check.py` checks the slots a generation fills against it):
    DeepSeek's multi-head latent attention caches its compressed latent and rotated key, one
    head each (1152 bytes a token in bfloat16 for DeepSeek-V3, not 80 KiB of 128 heads' keys and
    values); Falcon-7B's multi-query attention one head; Falcon-40B's every query head; a mamba
    layer no keys but a convolution state (kernel positions) and a recurrent one per sequence.
    `measured` False when the forward cannot run on the meta device (the config's KV heads x
    head dim then stand in). Kept per config in this process (the forward costs ~50 ms, a plan's
    index is read often)."""
    key = hf_config.to_json_string()
    if key not in _MEASURED:
        _MEASURED[key] = _measure_cache_writes(hf_config)
    return _MEASURED[key]


class PassThrough(nn.Module):
    """Stands in for a module another stage holds: returns the hidden states it is given. In
    place of a decoder block whose forward returns a tuple (Falcon, GPT-J, Bloom: `(hidden,
    attn_weights)`, the model taking `outputs[0]`), it returns a tuple of as many entries, the
    hidden states first: a bare tensor would be indexed by the model, losing its batch dim."""

    def __init__(self, tuple_length: int = 0) -> None:
        super().__init__()
        self.tuple_length = tuple_length

    def forward(self, *args, **kwargs):
        if args:
            hidden = args[0]
        elif "hidden_states" in kwargs:
            hidden = kwargs["hidden_states"]
        else:
            hidden = next(iter(kwargs.values()))
        if self.tuple_length:
            return (hidden, *(None,) * (self.tuple_length - 1))
        return hidden


_MEASURED: dict[str, CacheWrites] = {}  # config.json text -> measure_cache_writes
# An MLP or MoE block by its class (Nemotron-H calls every block's one child `mixer`)
_MLP_CLASS = re.compile(r"(MLP|Mlp|MoE|Moe|Experts)(Block)?$")


def _measure_cache_writes(hf_config) -> CacheWrites:
    from transformers import DynamicCache

    from worker.spec import MLP_NAMES

    written: dict[int, int] = {}
    states: dict[tuple[str, int, int], int] = {}  # (kind, layer, state index) -> bytes

    def row_bytes(tensor: torch.Tensor, last: int | None = None) -> int:
        shape = (*tensor.shape[1:-1], last) if last is not None else tensor.shape[1:]
        return math.prod(shape) * tensor.element_size()

    class Recording(DynamicCache):
        def update(self, keys, values, layer_idx, *args, **kwargs):
            written[layer_idx] = row_bytes(keys[:, :, :1]) + row_bytes(values[:, :, :1])
            return super().update(keys, values, layer_idx, *args, **kwargs)

        def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
            kernel = kwargs.get("conv_kernel_size") or conv_states.shape[-1]
            states["conv", layer_idx, state_idx] = row_bytes(conv_states, kernel)
            return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

        def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
            states["recurrent", layer_idx, state_idx] = row_bytes(recurrent_states)
            return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    model = build_meta_model(hf_config)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            mlp = name in MLP_NAMES or _MLP_CLASS.search(type(child).__name__)
            if mlp and not isinstance(child, nn.ModuleList):
                setattr(module, name, PassThrough())
    # transformers tells, once per process, that a mamba kernel falls back to PyTorch: this
    # forward computes nothing, and a user running `offloadctl plan` need not read that
    quiet = logging.getLogger("transformers.integrations.hub_kernels")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.no_grad():
            ids = torch.zeros((1, 2), dtype=torch.long, device="meta")
            model(input_ids=ids, past_key_values=Recording(config=hf_config), use_cache=True)
    except Exception:  # a family whose forward needs values: the config's shape stands in
        return CacheWrites({}, {}, measured=False)
    finally:
        quiet.setLevel(level)
    per_sequence: dict[int, int] = {}
    for (_, layer, _), nbytes in states.items():
        per_sequence[layer] = per_sequence.get(layer, 0) + nbytes
    # nothing written at all (the model ignored the cache): nothing known either
    return CacheWrites(written, per_sequence, measured=bool(written or states))


def find_layout(model: nn.Module) -> ModelLayout:
    """Where `model`'s embedding, decoder blocks and head are (see the module doc)."""
    family = model.config.model_type
    num_layers = model.config.get_text_config().num_hidden_layers
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == num_layers
        and all(type(block).__name__ in block_names for block in module)
    ]
    if len(candidates) != 1:
        found = [name for name, _ in candidates]
        raise UnsupportedModelError(
            f"{family}: cannot find its decoder blocks (a ModuleList of {num_layers} "
            f"{'/'.join(sorted(block_names)) or '?'}; found {found or 'none'}); supported: "
            f"{_supported_text()}"
        )
    layers_path = candidates[0][0]
    base_path = layers_path.rpartition(".")[0]
    base = model.get_submodule(base_path) if base_path else model
    before: list[str] = []
    after: list[str] = []
    seen_layers = False
    # Registration order, corrected by where the base model's forward first uses a module: OPT
    # registers its final norm (and project_out) before its blocks but runs them after.
    first_use = _first_uses(base)
    blocks_at = first_use.get(layers_path.rpartition(".")[2])
    for name, child in base.named_children():
        path = f"{base_path}.{name}" if base_path else name
        if path == layers_path:
            seen_layers = True
        else:
            used_after = blocks_at is not None and first_use.get(name, blocks_at) > blocks_at
            if _has_weights(child):
                (after if seen_layers or used_after else before).append(path)
            elif used_after:  # a norm without weights (OLMo's): passed through before the end
                after.append(path)
    # Modules outside the base model (the LM head): after the blocks.
    for name, child in model.named_children():
        if name != base_path.split(".")[0] and _has_weights(child):
            after.append(name)
    embeddings = model.get_input_embeddings()
    if not any(model.get_submodule(path) is embeddings for path in before):
        where = next((n for n, m in model.named_modules() if m is embeddings), "?")
        raise UnsupportedModelError(
            f"{family}: its input embedding ({where}) is not a module registered before its "
            f"blocks ({layers_path}) in the same base model, so it cannot be split into "
            f"pipeline stages; supported: {_supported_text()}"
        )
    return ModelLayout(
        family=family,
        layers_path=layers_path,
        num_layers=num_layers,
        embed_paths=tuple(before),
        head_paths=tuple(after),
    )


def _first_uses(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Child name -> (line, column) of the first `self.<name>` in `module`'s forward source;
    empty when the source cannot be read (then registration order alone decides)."""
    try:
        source = textwrap.dedent(inspect.getsource(type(module).forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    first: dict[str, tuple[int, int]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            at = (node.lineno, node.col_offset)
            first[node.attr] = min(first.get(node.attr, at), at)
    return first


def _has_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(
        True for name, _ in module.named_buffers() if _is_persistent(module, name)
    )


def _is_persistent(module: nn.Module, name: str) -> bool:
    owner, leaf = owner_of(module, name)
    return leaf not in owner._non_persistent_buffers_set
