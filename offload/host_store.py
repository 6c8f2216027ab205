"""Choosing the parameters to offload and moving them into one arena, layer by layer.

Shared by the prefetch and UVA backends: both offload the same parameters and keep them in the
same exact-size arena; they differ only in how the device reaches them. A parameter given a
`WeightFormat` (prefetch only) is kept in 8 (or 4) bits: its values under its own key and its scales
under `key + SCALE_KEY_SUFFIX`, both inside its layer's span (`offload.quant`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload.arena import HostArena, TensorSpec
from offload.base import OffloadError
from offload.config import OffloadConfig
from offload.policy import PinDecision, decide_pinning
from offload.probe import NodeProbe
from offload.quant import SCALE_KEY_SUFFIX, QuantizedTensor

if TYPE_CHECKING:
    from offload.quant import WeightFormat


@dataclass(slots=True)
class OffloadedLayer:
    """One offloaded module: its parameters in arena order and its byte span in the arena."""

    index: int  # position among the wrapped modules (execution order)
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    keys: list[str]  # arena keys, f"{index}.{name}"
    start: int = 0
    end: int = 0
    formats: dict[str, WeightFormat] = dataclasses.field(default_factory=dict)  # 8-bit keys

    @property
    def payload_bytes(self) -> int:
        """The parameters' bytes at the model's width (what they take on the device)."""
        return sum(p.numel() * p.element_size() for _, p in self.params)


def host_view(
    arena: HostArena, key: str, fmt: WeightFormat | None
) -> torch.Tensor | QuantizedTensor:
    """What holds parameter `key` in `arena`: its tensor, or its 8-bit values and scales."""
    if fmt is None:
        return arena[key]
    return QuantizedTensor(arena[key], arena[key + SCALE_KEY_SUFFIX], fmt)


def arena_specs(key: str, param: torch.Tensor, fmt: WeightFormat | None) -> list[TensorSpec]:
    """The arena entries of one parameter: itself, or its 8-bit values and its scales."""
    shape = tuple(param.shape)
    if fmt is None:
        return [TensorSpec(key, shape, param.dtype)]
    if not param.dtype.is_floating_point or not fmt.fits(shape):
        raise ValueError(
            f"offloaded parameter {key!r} ({param.dtype}{list(shape)}) cannot be kept as {fmt}: "
            "only floating weights of two dimensions or more can"
        )
    return [
        TensorSpec(key, fmt.values_shape(shape), fmt.dtype),
        TensorSpec(key + SCALE_KEY_SUFFIX, fmt.scale_shape(shape), fmt.scale_dtype),
    ]


def select_offloaded(modules: list[nn.Module], config: OffloadConfig) -> list[OffloadedLayer]:
    """The layers and parameters `config` offloads, checked for weights tied across modules."""
    layers = []
    for index in config.select_layers(len(modules)):
        params = [
            (name, param)
            for name, param in modules[index].named_parameters()
            if config.matches_param(name)
        ]
        if params:
            layers.append(
                OffloadedLayer(
                    index=index,
                    module=modules[index],
                    params=params,
                    keys=[f"{index}.{name}" for name, _ in params],
                )
            )
    if not layers:
        raise ValueError(
            f"OffloadConfig selects no parameters among {len(modules)} modules "
            f"(layers={config.select_layers(len(modules))}, param_filter={config.param_filter!r}); "
            "use backend='none' to offload nothing"
        )
    offloaded = {id(p): layer.index for layer in layers for _, p in layer.params}
    for index, module in enumerate(modules):
        for name, param in module.named_parameters():
            owner = offloaded.get(id(param))
            if owner is not None and owner != index:
                raise OffloadError(
                    f"parameter {name!r} of module {index} is the same tensor as an offloaded "
                    f"parameter of module {owner} (tied weights); exclude it with param_filter "
                    "or do not offload that layer"
                )
    return layers


def owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the submodule that holds `name`, its own name there): `mlp.up.weight` of a layer ->
    (layer.mlp.up, "weight"), where a parameter or buffer is replaced."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def set_param_data(layer: OffloadedLayer, position: int, data: torch.Tensor) -> nn.Parameter:
    """Point parameter `position` of `layer` at `data` and return the live parameter.

    A real parameter keeps its identity (`param.data = data`), so references to it stay valid.
    A meta parameter (weights still to be loaded) cannot take real data in place, so a new
    Parameter replaces it in its owner module, and in `layer.params`.
    """
    name, param = layer.params[position]
    if param.device.type != "meta":
        param.data = data
        param.requires_grad_(False)
        return param
    owner, leaf = owner_of(layer.module, name)
    new = nn.Parameter(data, requires_grad=False)
    owner._parameters[leaf] = new
    layer.params[position] = (name, new)
    return new


def decide_for_device(
    env: Mapping[str, str], probe: NodeProbe, planned_bytes: int, device: torch.device
) -> PinDecision:
    """The pin decision for offloading to `device`: a CPU device is judged as a node without
    CUDA, so `OFFLOAD_PIN_MEMORY=on` is refused there as on any node that cannot pin."""
    if device.type != "cuda":
        probe = dataclasses.replace(probe, cuda_available=False, devices=())
    return decide_pinning(env, probe, planned_bytes=planned_bytes)


def move_to_arena(
    layers: list[OffloadedLayer],
    *,
    pin: bool,
    formats: Mapping[str, WeightFormat] | None = None,
) -> HostArena:
    """Copy every selected parameter into a new arena (quantized where `formats`, by arena key,
    gives it a block format); record each layer's byte span and formats."""
    formats = dict(formats or {})
    known = {key for layer in layers for key in layer.keys}
    unknown = sorted(set(formats) - known)
    if unknown:
        raise ValueError(f"formats given for parameters that are not offloaded: {unknown[:3]}")
    for layer in layers:
        layer.formats = {key: formats[key] for key in layer.keys if key in formats}
    specs = [
        spec
        for layer in layers
        for key, (_, p) in zip(layer.keys, layer.params, strict=True)
        for spec in arena_specs(key, p, layer.formats.get(key))
    ]
    arena = HostArena(specs, pin=pin)
    try:
        with torch.no_grad():
            for layer in layers:
                for key, (_, param) in zip(layer.keys, layer.params, strict=True):
                    # A parameter on the meta device has no data yet: a loader writes it into
                    # the arena afterwards (see `host_tensors()`), with no device copy at all.
                    if param.device.type != "meta":
                        host_view(arena, key, layer.formats.get(key)).copy_(param.detach())
                names = [
                    name
                    for key in layer.keys
                    for name in ((key, key + SCALE_KEY_SUFFIX) if key in layer.formats else (key,))
                ]
                layer.start, layer.end = arena.span(names)
    except BaseException:
        arena.close()
        raise
    return arena
