"""One pipeline stage: the model's own `transformers` class, with what other stages hold passed
through.

The whole causal LM is built on the meta device (see `worker.layout`); the decoder blocks, the
embeddings and the head this stage does not hold are replaced by stand-ins that return their
input, and the stage calls the model's own forward. So masks (sliding windows included), rotary
tables, embedding scales, multipliers, soft-capping and MoE routing are the model's code, never
re-implemented here (the pattern of `transformers.distributed.pipeline_parallel`).

Later stages get the previous stage's hidden states as `inputs_embeds`. The model's forward may
transform `inputs_embeds` before the first block (Granite multiplies it by
`embedding_multiplier`, GPT-2 adds position embeddings, Gemma's scale sits in its embedding
module): right for token embeddings, wrong for hidden states. So a hook on the stage's first
module puts the received hidden states back in, exactly as they came. Stages before the last
call the base model with the head passed through, so they return the hidden states after their
last block; the last stage calls the causal LM and returns its logits (soft-capped, scaled,
`logits_to_keep`: what the model returns).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap

import torch
from torch import nn

from worker.batch_view import BatchView
from worker.layout import EMBED, HEAD, PassThrough, build_meta_model, find_layout


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding another stage holds. Only a position embedding is called on a
    later stage (GPT-2 adds `wpe(position_ids)` to `inputs_embeds`; OPT calls its learned one
    as `(attention_mask, past_length, position_ids=...)`): it adds nothing, and the entry hook
    restores the received hidden states anyway. Shaped like the positions it is given, so it
    broadcasts as the real one does."""

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.dtype = dtype

    def forward(self, *args, **kwargs) -> torch.Tensor:
        ids = kwargs.get("position_ids")
        if ids is None:
            ids = args[0] if args else next(iter(kwargs.values()))
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)


@functools.cache
def block_tuple_length(block_class: type) -> int:
    """How many values `block_class.forward` returns when it returns a tuple literal on every
    path (`return output, attn_weights`: 2); 0 when it returns a tensor (most families) or when
    its source cannot tell. Read from the source because the model is on the meta device and
    a block cannot be run to see; a wrong answer is caught by the pre-launch family check
    (coordinator/family_check.py), never silently: the model then fails or differs there."""
    try:
        source = textwrap.dedent(inspect.getsource(block_class.forward))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return 0
    returns = [node.value for node in ast.walk(function) if isinstance(node, ast.Return)]
    lengths = {len(value.elts) if isinstance(value, ast.Tuple) else 0 for value in returns}
    return lengths.pop() if len(lengths) == 1 else 0


def _stand_in_for(block: nn.Module) -> PassThrough:
    """A pass-through for decoder block `block`, returning what its kind returns and keeping
    its plain settings (an `attention_type` the model reads to pick each block's mask)."""
    stand_in = PassThrough(block_tuple_length(type(block)))
    for name, value in vars(block).items():
        if not (name.startswith("_") or hasattr(stand_in, name)) and (
            value is None or isinstance(value, str | int | float | bool)
        ):
            setattr(stand_in, name, value)
    return stand_in


class Stage(nn.Module):
    """Pipeline layers `layer_names` ("embed", "layers.N", "head") of the model `hf_config`
    describes, built on the meta device: the worker gives the held modules memory."""

    def __init__(self, hf_config, layer_names: list[str]) -> None:
        super().__init__()
        model = build_meta_model(hf_config)
        self.layout = layout = find_layout(model)
        held = set(layer_names)
        unknown = held - set(layout.layer_names())
        if unknown:
            raise ValueError(f"{layout.family} has no pipeline layers {sorted(unknown)}")
        # Model order, whatever order the caller gave.
        self.layer_names = [name for name in layout.layer_names() if name in held]
        self.is_first, self.is_last = EMBED in held, HEAD in held
        blocks = model.get_submodule(layout.layers_path)
        for i in range(layout.num_layers):
            if f"layers.{i}" not in held:
                blocks[i] = _stand_in_for(blocks[i])
        if not self.is_first:
            for path in layout.embed_paths:
                module = model.get_submodule(path)
                stand_in = (
                    ZeroEmbedding(module.embedding_dim, module.weight.dtype)
                    if isinstance(module, nn.Embedding)
                    else PassThrough()
                )
                model.set_submodule(path, stand_in)
        if not self.is_last:
            for path in layout.head_paths:
                model.set_submodule(path, PassThrough())
        _untie(model)
        _route_masks(type(model.get_submodule(layout.base_path)))
        self.model = model
        self.base = model.get_submodule(layout.base_path)
        self._incoming: torch.Tensor | None = None
        # Llama 4's NoPE layers scale queries by a temperature of each position, which they
        # compute from the cache's length (the lowest row's in a batch): one for every
        # position below floor_scale - 1, so batched rows are exact up to there only
        text = hf_config.get_text_config()
        self.batched_positions = (
            getattr(text, "floor_scale", 0) - 1
            if getattr(text, "attn_temperature_tuning", False)
            else None
        )
        if not self.is_first:
            entry = model.get_submodule(layout.module_paths(self.layer_names[0])[0])
            entry.register_forward_pre_hook(self._restore_incoming, with_kwargs=True)

    def layer_modules(self) -> dict[str, nn.Module]:
        """Pipeline layer name -> its module (a ModuleList for the embed and head layers, which
        may be several modules), in model order."""
        out: dict[str, nn.Module] = {}
        for name in self.layer_names:
            paths = self.layout.module_paths(name)
            modules = [self.model.get_submodule(path) for path in paths]
            out[name] = modules[0] if name not in (EMBED, HEAD) else nn.ModuleList(modules)
        return out

    @property
    def decoder_indices(self) -> list[int]:
        return [int(n.split(".")[1]) for n in self.layer_names if n.startswith("layers.")]

    def init_buffers(self, device: torch.device) -> None:
        """Give every buffer still on the meta device memory and initialise the non-persistent
        ones (rotary tables, embedding scales) the way `from_pretrained` does: everything loaded
        or to be loaded is marked initialised, then the model's own `initialize_weights` runs,
        which only touches what is not marked."""
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=device)
        for tensor in self.model.state_dict(keep_vars=True).values():
            tensor._is_hf_initialized = True
        for param in self.model.parameters():
            param._is_hf_initialized = True
        try:
            self.model.initialize_weights()
        except AttributeError:
            # The model's own init reaches into every block (Falcon-H1 gives each mamba mixer a
            # buffer): run it over the blocks this stage holds, the stand-ins out of the list.
            blocks = self.model.get_submodule(self.layout.layers_path)
            held = nn.ModuleList(b for b in blocks if not isinstance(b, PassThrough))
            self.model.set_submodule(self.layout.layers_path, held)
            try:
                self.model.initialize_weights()
            finally:
                self.model.set_submodule(self.layout.layers_path, blocks)

    def _restore_incoming(self, module, args, kwargs):
        if self._incoming is None:  # not called through forward(): leave the call alone
            return None
        incoming, self._incoming = self._incoming, None
        if args:
            return (incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": incoming}

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        cache: BatchView | None = None,
    ) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits from the last
        stage (of the last `logits_to_keep` positions; 0: all). With `cache` (a `BatchView` of
        the stage's KV pool: generation), the keys and values of this stage's layers are
        written to it and attended to, each row at its own positions and with its own masks
        (the mask argument is then unused)."""
        limit = self.batched_positions
        if cache is not None and limit is not None and cache.kv_length > limit:
            raise ValueError(
                f"a batched step reaches position {cache.kv_length - 1}, but this model's "
                "NoPE layers scale queries by a temperature of the position, which they read "
                "from the cache as one number for every row: exact below floor_scale - 1 = "
                f"{self.batched_positions} positions only; generate with max_seq_len <= "
                f"{self.batched_positions}"
            )
        kwargs = {
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "use_cache": cache is not None,
            "past_key_values": cache,
        }
        if self.is_first:
            kwargs["input_ids"] = x
        else:
            kwargs["inputs_embeds"] = x
            self._incoming = x
        try:
            if self.is_last:
                return self.model(**kwargs, logits_to_keep=logits_to_keep).logits
            return self.base(**kwargs).last_hidden_state
        finally:
            self._incoming = None


def avoid_per_shape_attention_graphs(device: torch.device) -> bool:
    """On a CUDA device, turn off cuDNN's attention for this process (torch's SDPA then takes
    its flash or memory-efficient kernel); returns whether it was on.

    cuDNN's SDPA (the first choice of torch 2.11 for bf16 on Hopper) builds a graph for every
    new shape of its inputs (rows, heads, positions), ~17 ms each on an H200, and caches it per
    thread. A serving stage meets a new shape at almost every step: rows join and leave, every
    sequence grows by one position, prefills come in every length. Measured on the H200 (0.7B
    bf16 llama, 8 requests x 48 tokens, bench/RESULTS.md): the engine's first pass over those
    lengths ran at 100 tokens/s with cuDNN and 592 without it, warm 551-665 and 643-648. The
    flash kernel builds nothing per shape. Process-wide, because the flag is torch's and a
    worker's process is its stage's; a stage driven in-process changes its caller's torch too
    (stated in docs/formats-and-families.md)."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def _route_masks(base_class: type) -> None:
    """Let the model's own code ask a `BatchView` for its masks: the module defining
    `base_class` calls `create_causal_mask` / `create_sliding_window_causal_mask` /
    `create_chunked_causal_mask` for each kind of layer it has (one mask, or one per kind in
    gemma2's alternation); those names in that module become wrappers that answer from the
    step's `BatchView` (each row its own length, the config's window for the sliding kind, its
    `attention_chunk_size` for the chunked one) and call transformers' function for anything
    else, so the model in every other use is unchanged. Once per module."""
    module = sys.modules[base_class.__module__]
    for name, kind in (
        ("create_causal_mask", None),
        ("create_sliding_window_causal_mask", "sliding_window"),
        ("create_chunked_causal_mask", "attention_chunk_size"),
    ):
        original = getattr(module, name, None)
        if original is None or getattr(original, "_routes_batches", False):
            continue
        setattr(module, name, _mask_router(original, kind))


def _mask_router(original, kind: str | None):
    @functools.wraps(original)
    def route(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, BatchView):
            return original(*args, **kwargs)
        config, embeds = kwargs["config"], kwargs["inputs_embeds"]
        size = getattr(config, kind, None) if kind is not None else None
        return cache.mask(
            sliding_window=size if kind == "sliding_window" else None,
            chunk=size if kind == "attention_chunk_size" else None,
            dtype=embeds.dtype,
            implementation=config._attn_implementation,
        )

    route._routes_batches = True
    return route


def _untie(model: nn.Module) -> None:
    """A parameter shared by two held modules (tied embeddings on a one-stage model) gets a
    second tensor: each pipeline layer owns its weights, loaded from the same checkpoint bytes."""
    seen: set[int] = set()
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in seen:
                copy = torch.empty_like(param, device="meta")
                setattr(module, name, nn.Parameter(copy, requires_grad=param.requires_grad))
            seen.add(id(param))
