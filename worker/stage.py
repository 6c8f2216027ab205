"""One pipeline stage of a Hugging Face causal LM, built from the model's own classes.

The whole model is instantiated on the meta device (no memory, no weights); the stage keeps
only its modules (embedding if first, its decoder layers, final norm + LM head if last) and
mirrors the model's own forward for them, so its output matches the single-process model's.
"""

from __future__ import annotations

import torch
from torch import nn

# Checkpoint tensor-name prefixes of the modules a stage may hold.
EMBED_PREFIX = "model.embed_tokens."
NORM_PREFIX = "model.norm."
HEAD_PREFIX = "lm_head."


def hf_config_from_dict(config: dict, attn_implementation: str):
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**config)
    hf_config._attn_implementation = attn_implementation
    return hf_config


def model_class_for(hf_config) -> type:
    """The causal-LM class of `hf_config` (importing its modeling module)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


class Stage(nn.Module):
    """Layers `decoder_indices` of the model, plus embedding / head when asked."""

    def __init__(
        self,
        hf_config,
        decoder_indices: list[int],
        *,
        has_embed: bool,
        has_head: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = hf_config
        with torch.device("meta"):
            full = model_class_for(hf_config)(hf_config)
        inner = full.model
        self.decoder_indices = list(decoder_indices)
        self.embed_tokens = inner.embed_tokens if has_embed else None
        self.layers = nn.ModuleList(inner.layers[i] for i in self.decoder_indices)
        self.norm = inner.norm if has_head else None
        self.lm_head = full.lm_head if has_head else None
        # The rotary tables are buffers computed at construction: build them for real.
        with torch.device(device):
            self.rotary_emb = type(inner.rotary_emb)(config=hf_config)
        self.layer_types = getattr(hf_config, "layer_types", None) or (
            ["full_attention"] * hf_config.num_hidden_layers
        )
        # checkpoint tensor name -> parameter of this stage
        self.checkpoint_params: dict[str, nn.Parameter] = {}
        for name, param in full.named_parameters(remove_duplicate=False):
            if self._holds(name):
                self.checkpoint_params[name] = param
        del full, inner

    def _holds(self, name: str) -> bool:
        if name.startswith(EMBED_PREFIX):
            return self.embed_tokens is not None
        if name.startswith((NORM_PREFIX, HEAD_PREFIX)):
            return self.norm is not None
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.decoder_indices
        return False

    def layer_modules(self) -> dict[str, nn.Module]:
        """Pipeline layer name -> module, as the checkpoint index names them."""
        out: dict[str, nn.Module] = {}
        if self.embed_tokens is not None:
            out["embed"] = self.embed_tokens
        for index, layer in zip(self.decoder_indices, self.layers, strict=True):
            out[f"layers.{index}"] = layer
        if self.norm is not None:
            out["head"] = nn.ModuleList([self.norm, self.lm_head])
        return out

    def _masks(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, object]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kwargs = dict(config=self.config, inputs_embeds=hidden, attention_mask=None,
                      past_key_values=None, position_ids=position_ids)  # fmt: skip
        masks: dict[str, object] = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last) out."""
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = self._masks(hidden, position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for index, layer in zip(self.decoder_indices, self.layers, strict=True):
            hidden = layer(
                hidden,
                attention_mask=masks[self.layer_types[index]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=None,
                use_cache=False,
            )
        if self.norm is None:
            return hidden
        return self.lm_head(self.norm(hidden))
