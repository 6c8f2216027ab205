"""Where each checkpoint tensor of a stage lives: in its module's parameter (resident layers) or
in the offloader's host arena (offloaded layers). The loader reads into these places; a worker
that is given a new stage after a re-plan copies from the old places into the new ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from offload.base import BaseOffloader
from worker.spec import StageSpec


def local_param_name(layer_name: str, tensor_name: str) -> str:
    """The parameter name inside the layer's module for checkpoint tensor `tensor_name`."""
    if layer_name == "head" and tensor_name.startswith("model.embed_tokens."):
        tensor_name = "lm_head." + tensor_name.removeprefix("model.embed_tokens.")  # tied
    if layer_name == "embed":
        return tensor_name.removeprefix("model.embed_tokens.")
    if layer_name == "head":  # the head module is ModuleList([norm, lm_head])
        if tensor_name.startswith("model.norm."):
            return "0." + tensor_name.removeprefix("model.norm.")
        return "1." + tensor_name.removeprefix("lm_head.")
    return tensor_name.removeprefix(f"model.{layer_name}.")


@dataclass(slots=True)
class Placement:
    """A built stage's layer modules and their offloader, as the worker holds them."""

    spec: StageSpec
    modules: dict[str, nn.Module]
    offloader: BaseOffloader
    loaded: set[str] = field(default_factory=set)  # layers whose weights are in place

    def destination(self, layer_name: str, tensor_name: str) -> torch.Tensor:
        """The tensor that holds checkpoint tensor `tensor_name` of layer `layer_name`."""
        local = local_param_name(layer_name, tensor_name)
        if layer_name in self.spec.offloaded:
            index = list(self.modules).index(layer_name)
            return self.offloader.host_tensors()[f"{index}.{local}"]
        return self.modules[layer_name].get_parameter(local).data
