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

import torch
from torch import nn

from worker.cache import StageCache
from worker.layout import EMBED, HEAD, build_meta_model, find_layout


class PassThrough(nn.Module):
    """Stands in for a module another stage holds: returns the hidden states it is given."""

    def forward(self, *args, **kwargs):
        if args:
            return args[0]
        return kwargs["hidden_states"] if "hidden_states" in kwargs else next(iter(kwargs.values()))


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding another stage holds. Only a position embedding is called on a
    later stage (GPT-2 adds it to `inputs_embeds`): it adds nothing, and the entry hook restores
    the received hidden states anyway."""

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)


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
                blocks[i] = PassThrough()
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
        self.model = model
        self.base = model.get_submodule(layout.base_path)
        self._incoming: torch.Tensor | None = None
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

    def new_cache(self) -> StageCache | None:
        """An empty KV cache for one request (None for a stage without decoder layers)."""
        held = self.decoder_indices
        return StageCache(self.model.config, held) if held else None

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
        self.model.initialize_weights()

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
        cache: StageCache | None = None,
    ) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits from the last
        stage (of the last `logits_to_keep` positions; 0: all). With `cache`, the keys and
        values of this stage's layers are appended to it and attended to (generation)."""
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": cache is not None, "past_key_values": cache}  # fmt: skip
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
