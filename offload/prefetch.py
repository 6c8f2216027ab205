"""Prefetch offloading: weights live in host memory; a fixed pool of device slots receives the
next offloaded layers while the current one computes.

Layout. The M offloaded layers, in execution order o_0..o_{M-1}, share K = min(prefetch_step, M)
slots; o_j always uses slot j % K, so every parameter is a fixed view into a fixed buffer
(static addresses: safe to capture in a CUDA graph). Each layer's weights are one contiguous
span of the arena laid out exactly like its slot, so loading a layer is one copy.

Schedule. When o_j finishes, its slot is free and the copy of the slot's *next occupant* starts
(o_{j+K}, or after the last one, the slot's first occupant for the next forward). vLLM's
wrap-around instead loads o_{(j+K) mod M}, which for M % K != 0 lands in a slot whose current
layer has not run yet. Here a copy never targets a slot before the layer holding it has run.

8-bit weights. A parameter given a `BlockFormat` (`formats`, by arena key) stays 8 bits in the
arena and crosses the link so (gpt-oss's 4-bit `Mxfp4Format` the same way), in pieces of whole
block rows (a matrix's partial last one included: `row_pieces`, at most `STAGING_BYTES`; a
4-bit weight's stored rows are its parameter's columns: `rows` views them): each piece's values and scales are
copied into one small device staging buffer, and on the copy side (side stream, copy thread)
dequantized from there into their place in the layer's slot (`offload.quant.dequantize_into`);
the layer's ticket is its last piece's. Such a layer's slot is laid out at the model's width,
its other parameters copied straight in.
One staging buffer serves every slot: copies and their dequantization are FIFO on the copy
side, so a piece's copy starts after the previous piece's dequantization has read the buffer.

Robustness. Each slot records which layer its latest copy brings (`_owner`). A layer whose slot
holds something else when it is called (first forward without `post_init`, an aborted forward,
layers called out of order) is loaded on demand and counted in `sync_loads`: slower, never wrong.
Copies to one slot are FIFO on one stream/thread, so the latest copy is what the slot holds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload.arena import HostArena, align_up
from offload.base import BaseOffloader, param_bytes, require_inference
from offload.config import OffloadConfig
from offload.copy_engine import CopyEngine, make_copy_engine
from offload.host_store import (
    OffloadedLayer,
    decide_for_device,
    host_view,
    move_to_arena,
    select_offloaded,
    set_param_data,
)
from offload.probe import DECISION_STEPS, NodeProbe, probe_node
from offload.quant import SCALE_KEY_SUFFIX, QuantizedTensor
from offload.stats import OffloadStats

if TYPE_CHECKING:
    from offload.quant import WeightFormat


class PrefetchOffloader(BaseOffloader):
    backend = "prefetch"

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device: torch.device | str,
        env: Mapping[str, str] | None = None,
        probe: NodeProbe | None = None,
        copy_engine: CopyEngine | None = None,
        formats: Mapping[str, WeightFormat] | None = None,
    ) -> None:
        """`formats`: parameters (by arena key, f"{module index}.{name}") kept in 8 bits."""
        super().__init__()
        self.config = config
        self._formats = dict(formats or {})
        self.device = torch.device(device)
        self._env = dict(os.environ if env is None else env)
        self._probe = probe
        self._engine = copy_engine
        self._layers: list[OffloadedLayer] = []
        self._arena: HostArena | None = None
        self._slots: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None  # 8-bit weights' pieces land here first
        # 8-bit layers: the copies that bring each in (dst, src, work after it), in order
        self._copies: dict[int, list[tuple[torch.Tensor, torch.Tensor, object]]] = {}
        self._host: dict[str, torch.Tensor | QuantizedTensor] = {}
        # layer index -> each parameter's byte offset in its slot
        self._slot_offsets: dict[int, list[int]] = {}
        self._slot_of: dict[int, int] = {}  # layer index -> slot
        self._next: dict[int, OffloadedLayer] = {}  # layer index -> next occupant of its slot
        self._owner: list[OffloadedLayer | None] = []
        self._ticket: list[object | None] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._sync_loads = 0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    # lifecycle
    def _wrap(self, modules: list[nn.Module]) -> None:
        layers = select_offloaded(modules, self.config)
        planned = sum(layer.payload_bytes for layer in layers)
        probe = self._probe if self._probe is not None else probe_node(DECISION_STEPS)
        self.pin_decision = decide_for_device(self._env, probe, planned, self.device)
        # Everything that can fail (host and device allocation) happens before any module is
        # touched, so a failure leaves the modules exactly as they were.
        arena = move_to_arena(layers, pin=self.pin_decision.pin, formats=self._formats)
        try:
            num_slots = min(max(self.config.prefetch_step, 1), len(layers))
            sizes = [self._lay_out_slot(layer, arena) for layer in layers]
            self._slots = [
                torch.empty(align_up(max(sizes)), dtype=torch.uint8, device=self.device)
                for _ in range(num_slots)
            ]
            staging = max(
                (
                    fmt.staging_bytes(tuple(param.shape))
                    for layer in layers
                    for key, (_, param) in zip(layer.keys, layer.params, strict=True)
                    if (fmt := layer.formats.get(key)) is not None
                ),
                default=0,
            )
            if staging:
                self._staging = torch.empty(staging, dtype=torch.uint8, device=self.device)
            if self._engine is None:  # from a pageable arena on CUDA: a pinned bounce buffer
                self._engine = make_copy_engine(self.device, pinned_source=arena.pinned)
        except BaseException:
            self._slots, self._staging = [], None
            arena.close()
            raise
        self._arena = arena
        self._host = {
            key: host_view(arena, key, layer.formats.get(key))
            for layer in layers
            for key in layer.keys
        }
        self._layers = layers
        self._owner = [None] * num_slots
        self._ticket = [None] * num_slots
        for j, layer in enumerate(layers):
            slot = j % num_slots
            self._slot_of[layer.index] = slot
            successor = j + num_slots if j + num_slots < len(layers) else slot
            self._next[layer.index] = layers[successor]
            self._point_params_at_slot(layer, self._slots[slot])
            if layer.formats:
                self._copies[layer.index] = self._piecewise(layer, self._slots[slot])
            self._hooks.append(
                layer.module.register_forward_pre_hook(self._make_pre_hook(layer), with_kwargs=True)
            )
            self._hooks.append(layer.module.register_forward_hook(self._make_post_hook(layer)))

    def _lay_out_slot(self, layer: OffloadedLayer, arena: HostArena) -> int:
        """Each parameter's offset in the layer's slot; returns the bytes the slot needs. A
        layer at the model's width is laid out as in the arena (its copy is one copy); an
        8-bit one at the model's width, its parameters aligned as the arena aligns them."""
        if not layer.formats:
            self._slot_offsets[layer.index] = [arena.offset(k) - layer.start for k in layer.keys]
            return layer.end - layer.start
        offsets, offset = [], 0
        for _, param in layer.params:
            offsets.append(offset)
            offset = align_up(offset + param.numel() * param.element_size())
        self._slot_offsets[layer.index] = offsets
        return offset

    def _slot_views(self, layer: OffloadedLayer, slot: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter of `layer` as it sits in `slot`."""
        return [
            slot[offset : offset + param.numel() * param.element_size()]
            .view(param.dtype)
            .view(param.shape)
            for offset, (_, param) in zip(
                self._slot_offsets[layer.index], layer.params, strict=True
            )
        ]

    def _point_params_at_slot(self, layer: OffloadedLayer, slot: torch.Tensor) -> None:
        for position, view in enumerate(self._slot_views(layer, slot)):
            # The parameter becomes a fixed view into the slot; the original device tensor is
            # freed (see set_param_data for parameters still on the meta device).
            set_param_data(layer, position, view)

    def _piecewise(self, layer: OffloadedLayer, slot: torch.Tensor) -> list:
        """The copies that bring 8-bit layer `layer` into `slot`, in order: (dst, src, work
        after it). A parameter at the model's width goes straight to its place; an 8-bit one
        piece by piece (values, then scales, into the staging buffer), each piece dequantized
        into its rows of the slot after its copy."""
        arena, staging = self._arena, self._staging
        copies = []
        for key, (_, param), offset in zip(
            layer.keys, layer.params, self._slot_offsets[layer.index], strict=True
        ):
            nbytes = param.numel() * param.element_size()
            fmt = layer.formats.get(key)
            if fmt is None:
                start = arena.offset(key)
                source = arena.bytes(start, start + nbytes)
                copies.append((slot[offset : offset + nbytes], source, None))
                continue
            shape = tuple(param.shape)
            dst = slot[offset : offset + nbytes].view(param.dtype).view(shape)
            values, scales = arena.offset(key), arena.offset(key + SCALE_KEY_SUFFIX)
            row, scale_row = fmt.row_bytes(shape), fmt.scale_row_bytes(shape)
            at = fmt.scales_at(shape)
            for first, end, s_first, s_end in fmt.row_pieces(shape, fmt.rows_per_piece(shape)):
                q_bytes, s_bytes = (end - first) * row, (s_end - s_first) * scale_row
                q_src = values + first * row
                s_src = scales + s_first * scale_row
                work = functools.partial(
                    self._dequantize_piece,
                    fmt.rows(dst, first, end),
                    fmt,
                    q_bytes,
                    (at, s_end - s_first, s_bytes),
                )
                copies.append((staging[:q_bytes], arena.bytes(q_src, q_src + q_bytes), None))
                copies.append(
                    (staging[at : at + s_bytes], arena.bytes(s_src, s_src + s_bytes), work)
                )
        return copies

    def _dequantize_piece(
        self, dst: torch.Tensor, fmt: WeightFormat, q_bytes: int, scales: tuple[int, int, int]
    ) -> None:
        """Rows `dst` (rows, cols) of a slot from the piece just copied into the staging
        buffer: `q_bytes` of values first, then from byte `at` its `scale_rows` rows of scales
        (`scales` = (at, scale_rows, bytes)). Runs on the copy side after the copy (module
        doc)."""
        at, scale_rows, s_bytes = scales
        q = self._staging[:q_bytes].view(fmt.dtype).view(len(dst), -1)
        s = self._staging[at : at + s_bytes].view(fmt.scale_dtype).view(scale_rows, -1)
        fmt.dequantize_rows(dst, q, s)

    def post_init(self) -> None:
        """Start copying the first K offloaded layers, so the first forward does not stall."""
        for slot in range(self.num_slots):
            layer = self._layers[slot]
            if self._owner[slot] is not layer:
                self._load(layer, after=self._engine.fence())

    def synchronize(self) -> None:
        if self._engine is not None:
            self._engine.synchronize()

    def release_device_buffers(self) -> None:
        """The slots go: no copy into them is in flight, and no parameter views them."""
        if self._engine is None:
            return
        self._engine.synchronize()
        for layer in self._layers:
            for position, (_, param) in enumerate(layer.params):
                set_param_data(layer, position, param.new_empty(0))
        self._slots, self._staging = [], None

    def host_tensors(self) -> Mapping[str, torch.Tensor | QuantizedTensor]:
        """As `BaseOffloader.host_tensors`; an 8-bit parameter's entry is a `QuantizedTensor`
        (its values and scales), which a loader fills as stored or quantizes into."""
        return self._host

    def _load(self, layer: OffloadedLayer, *, after: object | None) -> None:
        slot = self._slot_of[layer.index]
        copies = self._copies.get(layer.index)
        if copies is None:  # one copy of the layer's span, laid out as its slot
            src = self._arena.bytes(layer.start, layer.end)
            dst = self._slots[slot][: layer.end - layer.start]
            self._ticket[slot] = self._engine.submit(dst, src, after=after)
        else:  # piece by piece, 8-bit pieces dequantized on arrival; FIFO after the first
            for dst, src, work in copies:
                self._ticket[slot] = self._engine.submit(dst, src, after=after, then=work)
                after = None
        self._owner[slot] = layer

    def _make_pre_hook(self, layer: OffloadedLayer):
        slot = self._slot_of[layer.index]

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            require_inference(layer.index, args, kwargs)
            if self._owner[slot] is not layer:
                self._sync_loads += 1
                self._load(layer, after=self._engine.fence())
            self._engine.wait(self._ticket[slot])

        return pre_hook

    def _make_post_hook(self, layer: OffloadedLayer):
        successor = self._next[layer.index]

        def post_hook(module: nn.Module, args: tuple, output: object) -> None:
            if successor is not layer and self.config.prefetch_step > 0:
                self._load(successor, after=self._engine.fence())

        return post_hook

    def _detach(self, *, restore: bool) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._engine.synchronize()
        with torch.no_grad():
            for layer in self._layers if restore else ():
                for position, key in enumerate(layer.keys):
                    host = self._host[key]
                    if isinstance(host, QuantizedTensor):
                        dtype = layer.params[position][1].dtype
                        data = host.dequantized(dtype, self.device)
                    else:
                        data = host.to(self.device, copy=True)
                    set_param_data(layer, position, data)
        self._engine.close()
        self._engine = None  # the offloader owns its engine; a later wrap makes a new one
        self._arena.close()
        self._arena = None
        self._slots, self._staging = [], None
        self._copies.clear()
        self._host = {}
        self._layers = []
        self._owner = []
        self._ticket = []
        self._slot_offsets.clear()
        self._slot_of.clear()
        self._next.clear()

    def stats(self) -> OffloadStats:
        if self._arena is None:
            return OffloadStats(
                backend=self.backend, resident_bytes=sum(param_bytes(m) for m in self._modules)
            )
        totals = self._engine.read_totals()
        offloaded = self._arena.payload_bytes  # as stored: 8-bit values and scales where so
        wide = sum(layer.payload_bytes for layer in self._layers)
        staging = self._staging.numel() if self._staging is not None else 0
        return OffloadStats(
            backend=self.backend,
            offloaded_layers=len(self._layers),
            offloaded_bytes=offloaded,
            resident_bytes=sum(param_bytes(m) for m in self._modules) - wide,
            buffer_bytes=sum(s.numel() for s in self._slots) + staging,
            host_bytes=self._arena.host_bytes,
            pinned_bytes=offloaded if self._arena.pinned else 0,
            pageable_bytes=0 if self._arena.pinned else offloaded,
            copies=totals.copies,
            copied_bytes=totals.copied_bytes,
            copy_s=totals.copy_s,
            stall_s=totals.stall_s,
            dequant_s=totals.dequant_s,
            sync_loads=self._sync_loads,
        )
