"""Resident quantized weights kept as stored on the device, each layer's dequantized just in time.

An FP8 checkpoint's weights dequantized at load take twice their stored bytes on the GPU
(bf16 from 1-byte entries); gpt-oss's MXFP4 ones four times. Where device memory is what
forces layers off the GPU, that is twice as many layers crossing the link every step. So
`StoredResidency` keeps each resident quantized matrix as the checkpoint stores it (its values
and scales, a `QuantizedTensor` on the device) and gives every such parameter a view into one
shared buffer at the model's width, as large as the largest layer needs. A forward pre-hook on
each layer dequantizes that layer's matrices into the buffer just before it runs; the next
layer's overwrites them. The device holds the stored bytes plus one layer at width.

The numbers are those of dequantizing at load: the same `dequantize_into` (each entry times
its block's scale in float32, rounded once to the model's dtype), on the same stored values.
What it costs is the dequantization each step: reading the stored bytes and writing the wide
ones, on the device's memory, which is far faster than the link that an offloaded layer's
bytes would cross instead. Layers run one at a time on a stage, so one buffer serves them
all; the parameters of layers that are not running hold whatever the last one left there.

An MoE layer's experts are most of its bytes and a step uses few of them (8 of DeepSeek-V3's
256 at batch 1), so an experts module's per-expert matrices (`offload.routed`) are not
dequantized with the rest of the layer: a pre-hook on the experts module, once the router has
chosen, dequantizes the rows of the experts the call routes some row to. Every experts
implementation reads only those (`offload.routed`'s module doc); the others' rows hold
finite numbers (the buffer starts zeroed, and is only ever written with weights). A call
whose routing cannot be read dequantizes every expert: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload.arena import align_up
from offload.host_store import owner_of
from offload.quant import QuantizedTensor, dequantize_into
from offload.routed import RoutingUnknownError, experts_modules, routed_experts

if TYPE_CHECKING:
    from offload.quant import WeightFormat


class StoredResidency:
    """The stored (quantized) resident matrices of a stage's layers, on `device`, and the one
    buffer at the model's width that each layer's are dequantized into before it runs."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        # layer module -> its parameters kept as stored: name within it -> values and scales
        self._stored: dict[nn.Module, dict[str, QuantizedTensor]] = {}
        # of those, the ones its layer's pre-hook dequantizes whole (the rest: per expert)
        self._whole: dict[nn.Module, list[str]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._buffer: torch.Tensor | None = None

    def keep(
        self, layers: Mapping[nn.Module, Mapping[str, WeightFormat]]
    ) -> dict[nn.Module, dict[str, QuantizedTensor]]:
        """Keep the named parameters of each layer module (on the meta device) as stored, in
        the given formats: device memory for their values and scales (returned, for the loader
        to read the checkpoint's bytes into), and for each parameter a view of the shared
        buffer, which its layer's pre-hook fills. Called once, before any forward."""
        if self._stored:
            raise RuntimeError("StoredResidency.keep is called once per stage")
        sizes = []
        for module, formats in layers.items():
            kept: dict[str, QuantizedTensor] = {}
            for name, fmt in formats.items():
                shape = tuple(module.get_parameter(name).shape)
                kept[name] = QuantizedTensor(
                    torch.empty(fmt.values_shape(shape), dtype=fmt.dtype, device=self.device),
                    torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype, device=self.device),
                    fmt,
                )
            if kept:
                self._stored[module] = kept
                sizes.append(sum(align_up(self._wide_bytes(module, n)) for n in kept))
        if not self._stored:
            return {}
        self._buffer = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        for module, kept in self._stored.items():
            offset = 0
            for name in kept:
                owner, leaf = owner_of(module, name)
                param = owner._parameters[leaf]
                nbytes = self._wide_bytes(module, name)
                view = self._buffer[offset : offset + nbytes].view(param.dtype).view(param.shape)
                owner._parameters[leaf] = nn.Parameter(view, requires_grad=param.requires_grad)
                offset += align_up(nbytes)
            self._route(module, kept)
        return self._stored

    def _route(self, module: nn.Module, kept: dict[str, QuantizedTensor]) -> None:
        """Hook `module`'s dequantization: its experts modules' per-expert matrices when the
        router has chosen (`_dequantize_experts`), the rest before the layer runs."""
        names = list(kept)
        params = [(name, module.get_parameter(name)) for name in names]
        routed = set()
        for entry in experts_modules(module, params):
            own = [names[i] for i in entry.positions]
            routed.update(own)
            hook = self._dequantize_experts(module, entry.num_experts, own)
            self._hooks.append(entry.module.register_forward_pre_hook(hook, with_kwargs=True))
        self._whole[module] = [name for name in names if name not in routed]
        self._hooks.append(module.register_forward_pre_hook(self._dequantize_layer))

    def _dequantize_experts(self, layer: nn.Module, count: int, names: list[str]):
        """The pre-hook of an experts module of `layer`: dequantize the rows of its matrices
        `names` (names within the layer, each [count, ...]) of the experts the call routes
        to."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            try:
                wanted = routed_experts(count, args, kwargs)
            except RoutingUnknownError:
                wanted = range(count)
            with torch.no_grad():
                for name in names:
                    data, stored = layer.get_parameter(name).data, self._stored[layer][name]
                    for expert in wanted:
                        dequantize_into(data[expert], stored.select(0, expert))

        return hook

    @staticmethod
    def _wide_bytes(module: nn.Module, name: str) -> int:
        param = module.get_parameter(name)
        return param.numel() * param.dtype.itemsize

    def _dequantize_layer(self, module: nn.Module, args) -> None:
        with torch.no_grad():
            for name in self._whole[module]:
                dequantize_into(module.get_parameter(name).data, self._stored[module][name])

    def stored(self, module: nn.Module) -> dict[str, QuantizedTensor]:
        """`module`'s parameters kept as stored, by name within it (empty: none)."""
        return self._stored.get(module, {})

    @property
    def stored_bytes(self) -> int:
        """Device bytes of the stored values and scales."""
        return sum(q.nbytes for kept in self._stored.values() for q in kept.values())

    @property
    def wide_bytes(self) -> int:
        """Bytes of the stored parameters at the model's width (what they would take
        dequantized at load; they view the buffer instead)."""
        return sum(
            self._wide_bytes(module, name) for module, kept in self._stored.items() for name in kept
        )

    def describe(self) -> str:
        """The stored parameters' formats and how many take each, e.g. "fp8 (128x128 blocks)
        x 12"; "" where none is."""
        counts: dict[str, int] = {}
        for kept in self._stored.values():
            for stored in kept.values():
                counts[str(stored.fmt)] = counts.get(str(stored.fmt), 0) + 1
        return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the buffer the running layer's matrices are dequantized into."""
        return 0 if self._buffer is None else self._buffer.numel()

    def close(self) -> None:
        """Remove the hooks and let go of the device memory (the parameters that view the
        buffer go to the meta device)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for module, kept in self._stored.items():
            for name in kept:
                owner, leaf = owner_of(module, name)
                param = owner._parameters[leaf]
                owner._parameters[leaf] = nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
                )
        self._stored.clear()
        self._whole.clear()
        self._buffer = None
