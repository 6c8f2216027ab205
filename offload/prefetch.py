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

Robustness. Each slot records which layer its latest copy brings (`_owner`). A layer whose slot
holds something else when it is called (first forward without `post_init`, an aborted forward,
layers called out of order) is loaded on demand and counted in `sync_loads`: slower, never wrong.
Copies to one slot are FIFO on one stream/thread, so the latest copy is what the slot holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from offload.arena import ARENA_ALIGNMENT_BYTES, HostArena
from offload.base import BaseOffloader, OffloadStats, param_bytes, require_inference
from offload.config import OffloadConfig
from offload.copy_engine import CopyEngine, make_copy_engine
from offload.host_store import (
    OffloadedLayer,
    decide_for_device,
    move_to_arena,
    select_offloaded,
    set_param_data,
)
from offload.probe import NodeProbe, probe_node


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
    ) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self._env = dict(os.environ if env is None else env)
        self._probe = probe
        self._engine = copy_engine
        self._layers: list[OffloadedLayer] = []
        self._arena: HostArena | None = None
        self._slots: list[torch.Tensor] = []
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
        probe = self._probe if self._probe is not None else probe_node()
        self.pin_decision = decide_for_device(self._env, probe, planned, self.device)
        # Everything that can fail (host and device allocation) happens before any module is
        # touched, so a failure leaves the modules exactly as they were.
        arena = move_to_arena(layers, pin=self.pin_decision.pin)
        try:
            num_slots = min(max(self.config.prefetch_step, 1), len(layers))
            slot_bytes = max(layer.end - layer.start for layer in layers)
            slot_bytes = -(-slot_bytes // ARENA_ALIGNMENT_BYTES) * ARENA_ALIGNMENT_BYTES
            self._slots = [
                torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(num_slots)
            ]
            if self._engine is None:  # from a pageable arena on CUDA: a pinned bounce buffer
                self._engine = make_copy_engine(self.device, pinned_source=arena.pinned)
        except BaseException:
            self._slots = []
            arena.close()
            raise
        self._arena = arena
        self._layers = layers
        self._owner = [None] * num_slots
        self._ticket = [None] * num_slots
        for j, layer in enumerate(layers):
            slot = j % num_slots
            self._slot_of[layer.index] = slot
            successor = j + num_slots if j + num_slots < len(layers) else slot
            self._next[layer.index] = layers[successor]
            self._point_params_at_slot(layer, self._slots[slot])
            self._hooks.append(
                layer.module.register_forward_pre_hook(self._make_pre_hook(layer), with_kwargs=True)
            )
            self._hooks.append(layer.module.register_forward_hook(self._make_post_hook(layer)))

    def _point_params_at_slot(self, layer: OffloadedLayer, slot: torch.Tensor) -> None:
        for position, (key, (_, param)) in enumerate(zip(layer.keys, layer.params, strict=True)):
            # Offsets within a layer are the same in the arena and in its slot.
            offset = self._arena.offset(key) - layer.start
            view = slot[offset : offset + param.numel() * param.element_size()]
            # The parameter becomes a fixed view into the slot; the original device tensor is
            # freed (see set_param_data for parameters still on the meta device).
            set_param_data(layer, position, view.view(param.dtype).view(param.shape))

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
        self._slots = []

    def _load(self, layer: OffloadedLayer, *, after: object | None) -> None:
        slot = self._slot_of[layer.index]
        src = self._arena.bytes(layer.start, layer.end)
        dst = self._slots[slot][: layer.end - layer.start]
        self._ticket[slot] = self._engine.submit(dst, src, after=after)
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
                    set_param_data(layer, position, self._arena[key].to(self.device, copy=True))
        self._engine.close()
        self._engine = None  # the offloader owns its engine; a later wrap makes a new one
        self._arena.close()
        self._arena = None
        self._slots = []
        self._layers = []
        self._owner = []
        self._ticket = []
        self._slot_of.clear()
        self._next.clear()

    def stats(self) -> OffloadStats:
        if self._arena is None:
            return OffloadStats(
                backend=self.backend, resident_bytes=sum(param_bytes(m) for m in self._modules)
            )
        totals = self._engine.read_totals()
        offloaded = self._arena.payload_bytes
        return OffloadStats(
            backend=self.backend,
            offloaded_layers=len(self._layers),
            offloaded_bytes=offloaded,
            resident_bytes=sum(param_bytes(m) for m in self._modules) - offloaded,
            buffer_bytes=sum(s.numel() for s in self._slots),
            host_bytes=self._arena.host_bytes,
            pinned_bytes=offloaded if self._arena.pinned else 0,
            pageable_bytes=0 if self._arena.pinned else offloaded,
            copies=totals.copies,
            copied_bytes=totals.copied_bytes,
            copy_s=totals.copy_s,
            stall_s=totals.stall_s,
            sync_loads=self._sync_loads,
        )
