"""Where each checkpoint tensor of a stage lives: in its module's parameter (resident layers) or
in the offloader's host arena (offloaded layers), narrowed to the part of a fused parameter the
tensor fills. The loader reads into these places; a worker that is given a new stage after a
re-plan copies from the old places into the new ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.base import BaseOffloader
from offload.host_store import owner_of
from offload.quant import QuantizedTensor
from offload.resident import StoredResidency
from worker.layout import ModelLayout
from worker.spec import StageSpec, TensorSlice, apply_view


def held(formats: dict[str, dict], stored: dict[str, dict], layer_name: str) -> dict:
    """How a layer's parameters are held, by name within it: in a quantized format, in host
    memory (`formats`: offloaded) or on the device (`stored`); absent: at the model's width."""
    return {**formats.get(layer_name, {}), **stored.get(layer_name, {})}


@dataclass(slots=True)
class Placement:
    """A built stage's layer modules and their offloader, as the worker holds them."""

    spec: StageSpec
    layout: ModelLayout
    modules: dict[str, nn.Module]
    offloader: BaseOffloader
    loaded: set[str] = field(default_factory=set)  # layers whose weights are in place
    # offloaded parameters kept in 8 bits: layer -> name within it -> its block format
    formats: dict[str, dict] = field(default_factory=dict)
    # device-resident parameters kept as the checkpoint stores them, likewise, and where
    residency: StoredResidency = field(default_factory=lambda: StoredResidency("cpu"))
    stored: dict[str, dict] = field(default_factory=dict)

    def held_formats(self, layer_name: str) -> dict:
        return held(self.formats, self.stored, layer_name)

    def offload_format(self) -> str:
        """How the offloaded weights are kept: "" all at the model's width, else their block
        formats and how many weights take each, e.g. "fp8 (128x128 blocks) x 12"."""
        counts: dict[str, int] = {}
        for by_local in self.formats.values():
            for fmt in by_local.values():
                counts[str(fmt)] = counts.get(str(fmt), 0) + 1
        return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))

    def destination(self, layer_name: str, tensor: TensorSlice) -> torch.Tensor | QuantizedTensor:
        """The memory that holds checkpoint tensor `tensor` of layer `layer_name`: a tensor, or
        the 8-bit values and scales of a parameter the offloader keeps in 8 bits."""
        local = self.layout.local_name(layer_name, tensor.target)
        module = self.modules[layer_name]
        owner, leaf = owner_of(module, local)
        if leaf in owner._buffers:  # a persistent buffer: never offloaded, on the device
            return apply_view(owner._buffers[leaf], tensor.view)
        stored = self.residency.stored(module).get(local)
        if stored is not None:  # resident, kept as stored on the device
            return apply_view(stored, tensor.view)
        if layer_name in self.spec.offloaded:  # all of it, or its offload unit, in the arena
            index = list(self.modules).index(layer_name)
            host = self.offloader.host_tensors().get(f"{index}.{local}")
            if host is not None:
                return apply_view(host, tensor.view)
        return apply_view(owner._parameters[leaf].data, tensor.view)


def materialize(module: nn.Module, keep: Callable[[str], bool], device: torch.device) -> None:
    """Give device memory to the parameters of `module` (on the meta device) whose name within
    it `keep` accepts: the resident part of a layer the offloader takes only part of."""
    for name, param in list(module.named_parameters()):
        if param.is_meta and keep(name):
            owner, leaf = owner_of(module, name)
            owner._parameters[leaf] = nn.Parameter(
                torch.empty_like(param, device=device), requires_grad=param.requires_grad
            )
