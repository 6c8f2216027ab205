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
4-bit weight's stored rows are its parameter's columns: `rows` views them): each piece's
values and scales are copied into one small device staging buffer, and on the copy side (side
stream, copy thread) dequantized from there into their place in the layer's slot
(`WeightFormat.dequantize_rows`);
the layer's ticket is its last piece's. Such a layer's slot is laid out at the model's width,
its other parameters copied straight in.
One staging buffer serves every slot: copies and their dequantization are FIFO on the copy
side, so a piece's copy starts after the previous piece's dequantization has read the buffer.

Routed experts (`OffloadConfig.routed_experts`). An offloaded layer's experts modules
(`offload.routed`) are left out of its prefetch: when one is called, the step's router has
chosen, and only the experts it routes some row to are copied, each expert's rows of every
weight (8-bit ones in pieces, dequantized as above) into their place in the slot, then waited
for. The slot remembers which experts of its layer it holds (`_present`), so an expert used
again before the slot takes another layer is not copied again (every step, where each
offloaded layer has a slot of its own). Slots start zeroed: rows no copy wrote are never read,
and would hold finite numbers if they were.

Expert cache (`OffloadConfig.expert_cache` = C rows). Each offloaded experts module keeps
C experts on the device across steps, whichever layer its slot holds: the most used of that
layer over a window (uses halved every CACHE_WINDOW calls; the least used that the call does
not route to is evicted). A call that routes to at most C experts runs on the cache: its
misses are copied into free or evicted rows, the routed experts' rows are gathered in expert
order into one scratch buffer of C rows (a device copy), the module's weights view it, its
routing indices are renumbered 0..n-1 in that order and its `num_experts` is n for the call.
Every experts implementation then does what it does with the original weights, in the same
order, so the numbers are the same bit for bit. A call that routes to more (a prefill) uses
its layer's slot as above.

Predicted experts. Where the layer's router is resident and an earlier offloaded layer of the
same forward has experts, the layer's experts are predicted by its own router applied to that
layer's experts input (pre-gating, as Pre-gated MoE and ProMoE do: the residual stream changes
little from one layer to the next), when that earlier layer's experts are called; the copies
start then, while the earlier layer's experts and the layers between compute. In a slot the
earlier layer still holds (one slot, layers laid out alike), the experts that layer's call
reads are left for the slot's load after it. Other layers' experts are predicted to be the
ones their previous call routed to (routing statistics: consecutive tokens of a text tend to
reuse experts), copied when their slot is loaded. Each call measures its predictions against
what its router chose (`OffloadStats.expert_predicted` / `_correct` count the one acted on);
a pre-gated layer keeps a running accuracy for both and acts on the better, so it is never
predicted worse than by its last routing. The running accuracy decides whether to act: at or
above PREDICT_ACCURACY the predicted experts are copied ahead, so a correct one is a hit when
the router has chosen instead of a copy on the critical path. A wrong one cost link bytes,
never a number: what the slot holds is tracked, and the misses are fetched after the router
as before.

Experts on the host (`OffloadConfig.host_expert_rows` = R). An experts call of at most R rows
whose per-expert weights are all kept at the model's width runs on the host: its weights view
their place in the host arena for the call (no copy), its inputs go to the host and its output
comes back to the device (`_restore_experts`). The same module computes, so on the host the
numbers are those of its experts implementation there. Nothing is copied ahead for a layer
whose calls run there (`expert_host` counts the routed experts computed so).

Robustness. Each slot records which layer its latest copy brings (`_owner`). A layer whose slot
holds something else when it is called (first forward without `post_init`, an aborted forward,
layers called out of order) is loaded on demand and counted in `sync_loads`: slower, never wrong.
Copies to one slot are FIFO on one stream/thread, so the latest copy is what the slot holds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload.arena import HostArena, align_up
from offload.base import BaseOffloader, param_bytes, require_inference
from offload.config import OffloadConfig
from offload.copy_engine import CopyEngine
from offload.copy_engines import make_copy_engine
from offload.host_store import (
    OffloadedLayer,
    decide_for_device,
    host_view,
    move_to_arena,
    select_offloaded,
    set_param_data,
)
from offload.probe import DECISION_STEPS, PROBE_STEPS, NodeProbe, probe_node
from offload.quant import SCALE_KEY_SUFFIX, QuantizedTensor
from offload.routed import ExpertsModule, experts_modules, routed_experts, routing_of
from offload.stats import OffloadStats

if TYPE_CHECKING:
    from offload.quant import WeightFormat

logger = logging.getLogger(__name__)


# Predicted experts (module doc): a layer's last routing is copied ahead while its running
# accuracy (an exponential average, this weight on each call's) is at least this. Below it, a
# wrong copy costs more link time than the right ones save on the critical path.
PREDICT_ACCURACY = 0.5
PREDICT_SMOOTHING = 0.25
# Expert cache (module doc): every this many calls of an experts module, its experts' use
# counts are halved, so the cache follows what the text routes to now.
CACHE_WINDOW = 64


@dataclass(slots=True)
class _ExpertCache:
    """One offloaded experts module's cached experts: per per-expert weight (in the order of
    its `ExpertsModule.positions`) C rows on the device, which expert each row holds, and how
    much each expert was used lately."""

    rows: list[torch.Tensor]
    row_of: dict[int, int] = field(default_factory=dict)  # expert -> its row
    uses: Counter = field(default_factory=Counter)
    calls: int = 0

    @property
    def size(self) -> int:
        return len(self.rows[0])

    def place(self, wanted: list[int]) -> list[tuple[int, int]]:
        """Rows for the experts of `wanted` not cached yet, (expert, row) each: free rows
        first, then those of the least used experts the call does not route to. Counts the
        call's uses. `wanted` holds at most `size` experts."""
        self.calls += 1
        if self.calls % CACHE_WINDOW == 0:
            self.uses = Counter({e: n // 2 for e, n in self.uses.items() if n // 2})
        self.uses.update(wanted)
        missing = [e for e in wanted if e not in self.row_of]
        taken = set(self.row_of.values())
        free = [r for r in range(self.size) if r not in taken]
        keep = set(wanted)
        victims = sorted((e for e in self.row_of if e not in keep), key=lambda e: (self.uses[e], e))
        placed = []
        for expert in missing:
            row = free.pop() if free else self.row_of.pop(victims.pop(0))
            self.row_of[expert] = row
            placed.append((expert, row))
        return placed


def _router_choice(routed: object, num_experts: int, routing: torch.Tensor) -> torch.Tensor | None:
    """The experts a router's output (`routed`: a tensor or a tuple of them) chooses per row:
    its integer tensor (transformers 5's routers return their top-k indices), else its top-k of
    a logit per expert (a router that is one linear map), k as in `routing` (the routing of the
    call being predicted from); None: neither."""
    outputs = routed if isinstance(routed, tuple | list) else (routed,)
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    for t in tensors:
        if not t.dtype.is_floating_point and t.dtype != torch.bool:
            return t
    for t in tensors:
        if t.dtype.is_floating_point and t.dim() >= 1 and t.shape[-1] == num_experts:
            top = min(routing.shape[-1] if routing.dim() else 1, num_experts)
            return t.reshape(-1, num_experts).topk(top, dim=-1).indices
    return None


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
        # routed experts: each layer's experts modules, what each slot holds of its layer's
        # experts ((module path, expert)), each expert's copies (built on first use)
        self._experts: dict[int, list[ExpertsModule]] = {}
        self._present: list[set[tuple[str, int]]] = []
        self._expert_copies: dict[tuple[int, int, int], list] = {}
        self._expert_hits = 0
        self._expert_misses = 0
        # per offloaded layer (its index): [hits, misses, expert bytes copied]
        self._by_layer: dict[int, list[int]] = {}
        # predicted experts (module doc): each layer's last routing by experts module, its
        # running accuracy, and the totals measured
        self._last_routed: dict[int, dict[str, list[int]]] = {}
        # running accuracy by (layer index, predictor: "router" or "routing")
        self._accuracy: dict[tuple[int, str], float] = {}
        self._predicted = 0
        self._predicted_correct = 0
        self._prefetched = 0
        # pre-gating (module doc): per layer its resident routers by experts path; which layer
        # each layer's experts calls predict (by layer index); the routers' predictions not
        # measured yet; per slot the experts copied into it ahead of its next layer's load
        self._routers: dict[int, dict[str, nn.Module]] = {}
        self._ahead: dict[int, OffloadedLayer] = {}
        self._gated: dict[int, dict[str, list[int]]] = {}
        self._early: dict[int, tuple[int, set[tuple[str, int]]]] = {}
        self._gated_layers: set[int] = set()  # the layers `_ahead` points to
        # expert caches (module doc) by (layer index, experts module path), and the scratch
        # buffers a call's experts are gathered into, by (row shape, dtype)
        self._caches: dict[tuple[int, str], _ExpertCache] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}
        # experts modules running on their cache or on the host: their layer, the slot views
        # to restore, and the device their output goes back to (None: where it is)
        self._active: dict[
            nn.Module, tuple[OffloadedLayer, ExpertsModule, list, torch.device | None]
        ] = {}
        self._host_computed = 0
        self._host_layers: set[int] = set()  # layers with an experts module on the host

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def pregated_layers(self) -> frozenset[int]:
        """The offloaded layers (by index) whose experts their own router predicts, applied to
        the input of the layer before's experts (pre-gating, module doc)."""
        return frozenset(self._gated_layers)

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
            if self.config.routed_experts:
                self._experts = {
                    layer.index: found for layer in layers if (found := self._routable(layer))
                }
                self._find_routers(layers)
                self._host_layers = {
                    layer.index
                    for layer in layers
                    if any(self._on_host(layer, e) for e in self._experts.get(layer.index, ()))
                }
            new = torch.zeros if self._experts else torch.empty  # module doc: routed experts
            self._slots = [
                new(align_up(max(sizes)), dtype=torch.uint8, device=self.device)
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
            if self.config.expert_cache:
                self._make_caches(layers)
            if self._engine is None:
                self._engine = self._copy_engine(arena.pinned, probe)
        except BaseException:
            self._slots, self._staging = [], None
            self._caches, self._scratch = {}, {}
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
        self._present = [set() for _ in range(num_slots)]
        for j, layer in enumerate(layers):
            slot = j % num_slots
            self._slot_of[layer.index] = slot
            successor = j + num_slots if j + num_slots < len(layers) else slot
            self._next[layer.index] = layers[successor]
            self._point_params_at_slot(layer, self._slots[slot])
            routed = {i for entry in self._experts.get(layer.index, ()) for i in entry.positions}
            if layer.formats or routed:
                self._copies[layer.index] = self._piecewise(layer, self._slots[slot], routed)
            self._hooks.append(
                layer.module.register_forward_pre_hook(self._make_pre_hook(layer), with_kwargs=True)
            )
            self._hooks.append(layer.module.register_forward_hook(self._make_post_hook(layer)))
            for entry in self._experts.get(layer.index, ()):
                self._hooks.append(
                    entry.module.register_forward_pre_hook(
                        self._make_experts_hook(layer, entry), with_kwargs=True
                    )
                )
                if (layer.index, entry.path) in self._caches or self._on_host(layer, entry):
                    self._hooks.append(entry.module.register_forward_hook(self._restore_experts))

    def _find_routers(self, layers: list[OffloadedLayer]) -> None:
        """Pre-gating (module doc): each offloaded layer's routers, one per experts module (the
        one other child of its parent whose 2-D `weight` has a row per expert) and resident
        (an offloaded router's weights are not on the device before its layer's load), and for
        each layer with experts the next offloaded layer of the forward whose routers it runs."""
        for layer in layers:
            offloaded = {id(param) for _, param in layer.params}
            found = {}
            for entry in self._experts.get(layer.index, ()):
                parent = layer.module.get_submodule(entry.path.rpartition(".")[0])
                routers = [
                    child
                    for child in parent.children()
                    if child is not entry.module
                    and isinstance(weight := getattr(child, "weight", None), torch.Tensor)
                    and weight.dim() == 2
                    and weight.shape[0] == entry.num_experts
                ]
                if len(routers) == 1 and not any(
                    id(param) in offloaded for param in routers[0].parameters()
                ):
                    found[entry.path] = routers[0]
            if found:
                self._routers[layer.index] = found
        for before, layer in itertools.pairwise(layers):
            if before.index in self._experts and layer.index in self._routers:
                self._ahead[before.index] = layer
        self._gated_layers = {layer.index for layer in self._ahead.values()}

    def _make_caches(self, layers: list[OffloadedLayer]) -> None:
        """The expert caches of the layers' experts modules (`expert_cache` rows each, never
        more than the module's experts) and the scratch buffers their calls gather into."""
        for layer in layers:
            for entry in self._experts.get(layer.index, ()):
                size = min(self.config.expert_cache, entry.num_experts)
                rows = []
                for position in entry.positions:
                    param = layer.params[position][1]
                    shape = (size, *param.shape[1:])
                    rows.append(torch.zeros(shape, dtype=param.dtype, device=self.device))
                    key = (tuple(param.shape[1:]), param.dtype)
                    held = self._scratch.get(key)
                    if held is None or len(held) < size:
                        self._scratch[key] = torch.zeros(
                            shape, dtype=param.dtype, device=self.device
                        )
                self._caches[layer.index, entry.path] = _ExpertCache(rows)

    def _copy_engine(self, pinned: bool, probe: NodeProbe) -> CopyEngine:
        """The engine for this arena (`offload.copy_engines`). A pageable arena on a node whose
        decision pins small buffers (it ruled out pinning only the arena's bytes) may take the
        pinned bounce chunks: staged or direct by this node's link rates, measured here where
        the probe given did not carry them."""
        may_pin = self.pin_decision.pin
        if not pinned and not may_pin and self.device.type == "cuda":
            may_pin = decide_for_device(self._env, probe, 0, self.device).pin
            if may_pin and probe.link_pageable_bytes_per_s is None:
                with torch.cuda.device(self.device):
                    rates = probe_node({"link": PROBE_STEPS["link"]})
                probe = dataclasses.replace(
                    probe,
                    link_pageable_bytes_per_s=rates.link_pageable_bytes_per_s,
                    link_staged_bytes_per_s=rates.link_staged_bytes_per_s,
                )
        return make_copy_engine(self.device, pinned_source=pinned, may_pin=may_pin, probe=probe)

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

    def _piecewise(
        self, layer: OffloadedLayer, slot: torch.Tensor, skip: set[int] | frozenset = frozenset()
    ) -> list:
        """The copies that bring layer `layer` (8-bit, or with routed experts) into `slot`, in
        order: (dst, src, work after it), but for the parameters at positions `skip` (routed
        experts: `_copies_of_expert`). A parameter at the model's width goes straight to its
        place; an 8-bit one piece by piece (`_quantized_pieces`)."""
        arena = self._arena
        copies = []
        for position, (key, (_, param), offset) in enumerate(
            zip(layer.keys, layer.params, self._slot_offsets[layer.index], strict=True)
        ):
            if position in skip:
                continue
            nbytes = param.numel() * param.element_size()
            fmt = layer.formats.get(key)
            if fmt is None:
                start = arena.offset(key)
                source = arena.bytes(start, start + nbytes)
                copies.append((slot[offset : offset + nbytes], source, None))
                continue
            dst = slot[offset : offset + nbytes].view(param.dtype).view(param.shape)
            values, scales = arena.offset(key), arena.offset(key + SCALE_KEY_SUFFIX)
            copies += self._quantized_pieces(dst, fmt, values, scales)
        return copies

    def _quantized_pieces(
        self, dst: torch.Tensor, fmt: WeightFormat, values: int, scales: int
    ) -> list:
        """The copies that bring an 8-bit (or 4-bit) weight into `dst` (its place in a slot, the
        weight's shape) from its values and scales at arena offsets `values` and `scales`: piece
        by piece (values, then scales, into the staging buffer), each piece dequantized into its
        rows of `dst` after its copy."""
        staging, arena, shape = self._staging, self._arena, tuple(dst.shape)
        row, scale_row = fmt.row_bytes(shape), fmt.scale_row_bytes(shape)
        at = fmt.scales_at(shape)
        copies = []
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
            copies.append((staging[at : at + s_bytes], arena.bytes(s_src, s_src + s_bytes), work))
        return copies

    def _routable(self, layer: OffloadedLayer) -> list[ExpertsModule]:
        """`layer`'s experts modules whose every per-expert weight can cross expert by expert:
        at the model's width, or in a format whose one expert's part is a weight of it."""
        found = []
        for entry in experts_modules(layer.module, layer.params):
            fits = True
            for position in entry.positions:
                fmt = layer.formats.get(layer.keys[position])
                shape = tuple(layer.params[position][1].shape)
                fits &= fmt is None or fmt.fits(shape[1:])
            if fits:
                found.append(entry)
        return found

    def _copies_of_expert(self, layer: OffloadedLayer, entry: ExpertsModule, expert: int) -> list:
        """The copies that bring expert `expert` of experts module `entry` of `layer` into the
        layer's slot: its rows of each per-expert weight (built once, then kept)."""
        copies = []
        for position in entry.positions:
            key = (layer.index, position, expert)
            if key not in self._expert_copies:
                self._expert_copies[key] = self._build_expert_copies(layer, position, expert)
            copies += self._expert_copies[key]
        return copies

    @torch.inference_mode(False)  # views written on the copy side, outside inference mode
    def _build_expert_copies(self, layer: OffloadedLayer, position: int, expert: int) -> list:
        """Expert `expert`'s rows of the weight at `position` of `layer`, into their place in
        the layer's slot (`_copies_into`)."""
        slot = self._slots[self._slot_of[layer.index]]
        param = layer.params[position][1]
        offset = self._slot_offsets[layer.index][position]
        shape = tuple(param.shape)
        row = math.prod(shape[1:]) * param.element_size()
        weight = slot[offset : offset + row * shape[0]].view(param.dtype).view(shape)
        return self._copies_into(layer, position, expert, weight[expert])

    @torch.inference_mode(False)  # views written on the copy side, outside inference mode
    def _copies_into(
        self, layer: OffloadedLayer, position: int, expert: int, dst: torch.Tensor
    ) -> list:
        """The copies that bring expert `expert`'s rows of the weight at `position` of `layer`
        into `dst` (its row's shape, the model's dtype): one copy at the model's width, or the
        pieces of its values and scales (`_quantized_pieces`)."""
        arena, param, key = self._arena, layer.params[position][1], layer.keys[position]
        shape = tuple(param.shape)
        fmt = layer.formats.get(key)
        if fmt is None:
            row = math.prod(shape[1:]) * param.element_size()
            start = arena.offset(key) + expert * row
            return [(dst.reshape(-1).view(torch.uint8), arena.bytes(start, start + row), None)]
        values = math.prod(fmt.values_shape(shape)[1:]) * fmt.dtype.itemsize
        scales = math.prod(fmt.scale_shape(shape)[1:]) * fmt.scale_dtype.itemsize
        return self._quantized_pieces(
            dst,
            fmt,
            arena.offset(key) + expert * values,
            arena.offset(key + SCALE_KEY_SUFFIX) + expert * scales,
        )

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
        # the copies' destinations are views of the slots and the staging buffer: they would
        # keep that device memory alive
        self._copies.clear()
        self._expert_copies.clear()
        self._caches.clear()
        self._scratch.clear()

    def unviewed_device_bytes(self) -> int:
        """The staging buffer, the expert caches and their scratch rows."""
        staging = self._staging.numel() if self._staging is not None else 0
        caches = sum(r.nbytes for cache in self._caches.values() for r in cache.rows)
        return staging + caches + sum(t.nbytes for t in self._scratch.values())

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
        # none of its routed experts yet, but those copied ahead of this load (pre-gating)
        early = self._early.pop(slot, None)
        self._present[slot] = early[1] if early is not None and early[0] == layer.index else set()
        if self._acting(layer.index):  # module doc
            for entry in self._experts.get(layer.index, ()):
                if (layer.index, entry.path) in self._caches:  # its decode steps use the cache
                    continue
                for expert in self._prediction(layer.index, entry.path):
                    if (entry.path, expert) in self._present[slot]:
                        continue
                    for dst, src, work in self._copies_of_expert(layer, entry, expert):
                        self._ticket[slot] = self._engine.submit(dst, src, after=after, then=work)
                        self._count(layer.index, nbytes=src.nbytes)
                        after = None
                    self._present[slot].add((entry.path, expert))
                    self._prefetched += 1

    def _pregated(self, index: int) -> bool:
        """Whether layer `index`'s experts are predicted by its router (pre-gating)."""
        return index in self._gated_layers

    def _predictor(self, index: int) -> str:
        """Which prediction of layer `index` is acted on: its router's ("router", pre-gated
        layers) unless its last routing ("routing") has been right more often lately."""
        if self._pregated(index) and self._accuracy.get(
            (index, "router"), 0.0
        ) >= self._accuracy.get((index, "routing"), 0.0):
            return "router"
        return "routing"

    def _acting(self, index: int) -> bool:
        """Whether layer `index`'s prediction is right often enough to copy it ahead (never
        where its small calls run on the host: they need no copy)."""
        if index in self._host_layers:
            return False
        return self._accuracy.get((index, self._predictor(index)), 0.0) >= PREDICT_ACCURACY

    def _prediction(self, index: int, path: str) -> list[int]:
        """Layer `index`'s predicted experts for experts module `path` (module doc), by its
        predictor: its router's on an earlier layer's input of this forward (none yet where
        that layer has not run), or its last routing."""
        if self._predictor(index) == "router":
            return self._gated.get(index, {}).get(path, [])
        return self._last_routed.get(index, {}).get(path, [])

    def _make_pre_hook(self, layer: OffloadedLayer):
        slot = self._slot_of[layer.index]

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            require_inference(layer.index, args, kwargs)
            if self._owner[slot] is not layer:
                self._sync_loads += 1
                self._load(layer, after=self._engine.fence())
            if self._ticket[slot] is not None:  # None: nothing copied into it yet
                self._engine.wait(self._ticket[slot])

        return pre_hook

    def _make_experts_hook(self, layer: OffloadedLayer, entry: ExpertsModule):
        """Before experts module `entry` of `layer` runs: copy the experts its call routes to
        that the slot lacks, and wait for them (module doc: routed experts)."""
        slot = self._slot_of[layer.index]

        cache = self._caches.get((layer.index, entry.path))
        host = self._on_host(layer, entry)

        def experts_hook(module: nn.Module, args: tuple, kwargs: dict):
            if self._owner[slot] is not layer:  # called outside its layer's forward
                self._sync_loads += 1
                self._load(layer, after=self._engine.fence())
            wanted = routed_experts(entry.num_experts, args, kwargs)
            self._measure_prediction(layer.index, entry.path, wanted)
            if host and len(routing_of(args, kwargs)[0]) <= self.config.host_expert_rows:
                return self._from_host(layer, entry, wanted, args, kwargs)
            if cache is not None and len(wanted) <= cache.size:
                called = self._from_cache(layer, entry, cache, wanted, args, kwargs)
                self._predict_ahead(layer, entry, args, kwargs, ())
                return called
            present = self._present[slot]
            missing = [e for e in wanted if (entry.path, e) not in present]
            self._count(layer.index, hits=len(wanted) - len(missing), misses=len(missing))
            # the slot's previous layer may still be read by compute issued before: after it
            after = self._engine.fence() if missing else None
            for expert in missing:
                for dst, src, work in self._copies_of_expert(layer, entry, expert):
                    self._ticket[slot] = self._engine.submit(dst, src, after=after, then=work)
                    self._count(layer.index, nbytes=src.nbytes)
                    after = None
                present.add((entry.path, expert))
            if self._ticket[slot] is not None:
                self._engine.wait(self._ticket[slot])
            self._predict_ahead(layer, entry, args, kwargs, wanted)

        return experts_hook

    def _predict_ahead(
        self,
        layer: OffloadedLayer,
        entry: ExpertsModule,
        args: tuple,
        kwargs: dict,
        reading: list[int] | tuple,
    ) -> None:
        """Pre-gating (module doc), after experts module `entry` of `layer` has what it reads
        (`reading`: the experts of its slot it reads): the next layer's router applied to this
        call's input predicts that layer's experts, and while its accuracy holds they are
        copied now, into its slot where that is free, else into the rows of this slot the call
        does not read (identical layouts only), the rest left to that layer's load."""
        nxt = self._ahead.get(layer.index)
        if nxt is None:
            return
        router = self._routers[nxt.index].get(entry.path)
        target = next((e for e in self._experts[nxt.index] if e.path == entry.path), None)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if router is None or target is None or not isinstance(hidden, torch.Tensor):
            return
        try:
            index = _router_choice(router(hidden), target.num_experts, routing_of(args, kwargs)[0])
        except Exception as exc:  # a prediction never fails a step: this layer stops making it
            index, why = None, f"its router failed: {exc}"
        else:
            why = "its router gives neither expert indices nor a logit per expert"
        if index is None:  # the layer's experts are predicted from its last routing again
            logger.warning("pre-gating of %s.%s off: %s", nxt.index, entry.path, why)
            del self._ahead[layer.index]
            self._gated_layers.discard(nxt.index)
            return
        predicted = [e for e in torch.unique(index).tolist() if 0 <= e < target.num_experts]
        self._gated.setdefault(nxt.index, {})[entry.path] = predicted
        if (
            self._predictor(nxt.index) != "router"
            or not self._acting(nxt.index)
            or ((nxt.index, entry.path) in self._caches)
        ):
            return
        slot, slot_next = self._slot_of[layer.index], self._slot_of[nxt.index]
        busy: set[int] = set()
        if slot_next != slot:
            if self._owner[slot_next] is not nxt:
                return
            present = self._present[slot_next]
        else:
            if not self._alike(layer, nxt):
                return
            early = self._early.get(slot)
            present = early[1] if early is not None and early[0] == nxt.index else set()
            self._early[slot] = (nxt.index, present)
            busy = set(reading)
        after = self._engine.fence()
        for expert in predicted:
            if expert in busy or (entry.path, expert) in present:
                continue
            for dst, src, work in self._copies_of_expert(nxt, target, expert):
                self._ticket[slot_next] = self._engine.submit(dst, src, after=after, then=work)
                self._count(nxt.index, nbytes=src.nbytes)
                after = None
            present.add((entry.path, expert))
            if slot_next == slot:  # this layer's copy of that expert is gone
                self._present[slot].discard((entry.path, expert))
            self._prefetched += 1

    def _alike(self, a: OffloadedLayer, b: OffloadedLayer) -> bool:
        """Whether two offloaded layers sit alike in a slot: the same parameters (by name,
        shape and dtype) at the same offsets, so an expert's rows are the same bytes."""
        return self._slot_offsets[a.index] == self._slot_offsets[b.index] and [
            (name, p.shape, p.dtype) for name, p in a.params
        ] == [(name, p.shape, p.dtype) for name, p in b.params]

    def _from_cache(
        self,
        layer: OffloadedLayer,
        entry: ExpertsModule,
        cache: _ExpertCache,
        wanted: list[int],
        args: tuple,
        kwargs: dict,
    ) -> tuple[tuple, dict]:
        """Run experts module `entry` of `layer` on its cache (module doc): copy the missing
        experts into their rows and wait, gather the routed ones in expert order into the
        scratch buffers, point the module's weights there and renumber the call's routing;
        `_restore_experts` undoes it after the call. Returns the call's new arguments."""
        placed = cache.place(wanted)
        self._count(layer.index, hits=len(wanted) - len(placed), misses=len(placed))
        if placed:
            # a row may still be read by compute issued before (an earlier gather): after it
            after, ticket = self._engine.fence(), None
            for expert, row in placed:
                for i, position in enumerate(entry.positions):
                    dst = cache.rows[i][row]
                    for dst_, src, work in self._copies_into(layer, position, expert, dst):
                        ticket = self._engine.submit(dst_, src, after=after, then=work)
                        self._count(layer.index, nbytes=src.nbytes)
                        after = None
            self._engine.wait(ticket)
        count = len(wanted)
        slot_views = [layer.params[position][1].data for position in entry.positions]
        with torch.inference_mode(False), torch.no_grad():  # the weights' views outlive the call
            rows = torch.tensor([cache.row_of[e] for e in wanted], device=self.device)
            for i, position in enumerate(entry.positions):
                param = layer.params[position][1]
                scratch = self._scratch[tuple(param.shape[1:]), param.dtype][:count]
                torch.index_select(cache.rows[i], 0, rows, out=scratch)
                set_param_data(layer, position, scratch)
        # `wanted` is sorted: expert wanted[j] becomes j, the order every implementation
        # iterates in stays the same
        index, name = routing_of(args, kwargs)
        renumber = torch.full(
            (entry.num_experts + 1,), count, dtype=index.dtype, device=index.device
        )
        renumber[torch.tensor(wanted, dtype=torch.long, device=index.device)] = torch.arange(
            count, dtype=index.dtype, device=index.device
        )
        entry.module.num_experts = count
        self._active[entry.module] = (layer, entry, slot_views, None)
        if name is None:
            return (args[0], renumber[index], *args[2:]), kwargs
        return args, {**kwargs, name: renumber[index]}

    def _on_host(self, layer: OffloadedLayer, entry: ExpertsModule) -> bool:
        """Whether experts module `entry`'s small calls run on the host (module doc): asked
        for, every per-expert weight at the model's width in the arena, and no other weight of
        the module left on the device (the host could not read it)."""
        own = {id(param) for param in entry.module.parameters()}
        return (
            self.config.host_expert_rows > 0
            and own == {id(layer.params[position][1]) for position in entry.positions}
            and all(layer.keys[position] not in layer.formats for position in entry.positions)
        )

    def _from_host(
        self,
        layer: OffloadedLayer,
        entry: ExpertsModule,
        wanted: list[int],
        args: tuple,
        kwargs: dict,
    ) -> tuple[tuple, dict]:
        """Run experts module `entry` of `layer` on the host (module doc): its per-expert
        weights view the arena, its tensor arguments go to the host; `_restore_experts` points
        the weights back at the slot and brings the output to the device. Returns the call's
        new arguments."""
        host = torch.device("cpu")
        slot_views = [layer.params[position][1].data for position in entry.positions]
        for position in entry.positions:
            set_param_data(layer, position, self._host[layer.keys[position]])
        self._active[entry.module] = (layer, entry, slot_views, self.device)
        self._host_computed += len(wanted)

        def down(value: object) -> object:
            return value.to(host) if isinstance(value, torch.Tensor) else value

        return tuple(down(a) for a in args), {k: down(v) for k, v in kwargs.items()}

    def _restore_experts(self, module: nn.Module, args: tuple, output: object) -> object:
        """After an experts call run on its cache or on the host: the module's weights view its
        layer's slot again, it has all its experts, and a host call's output is brought back
        to the device."""
        active = self._active.pop(module, None)
        if active is None:
            return None
        layer, entry, slot_views, device = active
        for position, view in zip(entry.positions, slot_views, strict=True):
            set_param_data(layer, position, view)
        module.num_experts = entry.num_experts
        if device is not None and isinstance(output, torch.Tensor):
            return output.to(device)
        return None

    def _count(self, index: int, *, hits: int = 0, misses: int = 0, nbytes: int = 0) -> None:
        """Count routed experts of offloaded layer `index` found on the device (`hits`),
        copied when routed to (`misses`), and expert bytes copied (`nbytes`)."""
        self._expert_hits += hits
        self._expert_misses += misses
        counts = self._by_layer.setdefault(index, [0, 0, 0])
        counts[0] += hits
        counts[1] += misses
        counts[2] += nbytes

    def _measure_prediction(self, index: int, path: str, wanted: list[int]) -> None:
        """Score layer `index`'s predictions for experts module `path` against the experts
        this call routes to: its last routing, and on a pre-gated layer its router's on an
        earlier input. Each keeps a running accuracy (`_predictor` acts on the better); the
        totals count the one acted on. Keeps this routing for the next call."""
        last = self._last_routed.setdefault(index, {})
        used = self._predictor(index)
        guesses = {"routing": last.get(path)}
        if self._pregated(index):
            guesses["router"] = self._gated.get(index, {}).pop(path, None)
        for kind, predicted in guesses.items():
            if not predicted:
                continue
            correct = len(set(predicted) & set(wanted))
            right = correct / len(predicted)
            if kind == used:
                self._predicted += len(predicted)
                self._predicted_correct += correct
            previous = self._accuracy.get((index, kind), right)
            self._accuracy[index, kind] = (
                1 - PREDICT_SMOOTHING
            ) * previous + PREDICT_SMOOTHING * right
        last[path] = wanted

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
        self._experts.clear()
        self._expert_copies.clear()
        self._last_routed.clear()
        self._accuracy.clear()
        self._routers.clear()
        self._ahead.clear()
        self._gated.clear()
        self._early.clear()
        self._gated_layers = set()
        self._host_layers = set()
        self._caches.clear()
        self._scratch.clear()
        self._present = []
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
        return OffloadStats(
            backend=self.backend,
            offloaded_layers=len(self._layers),
            offloaded_bytes=offloaded,
            resident_bytes=sum(param_bytes(m) for m in self._modules) - wide,
            buffer_bytes=sum(s.numel() for s in self._slots) + self.unviewed_device_bytes(),
            host_bytes=self._arena.host_bytes,
            pinned_bytes=offloaded if self._arena.pinned else 0,
            pageable_bytes=0 if self._arena.pinned else offloaded,
            copy_engine=self._engine.kind,
            engine_pinned_bytes=self._engine.pinned_bytes,
            copies=totals.copies,
            copied_bytes=totals.copied_bytes,
            copy_s=totals.copy_s,
            stall_s=totals.stall_s,
            dequant_s=totals.dequant_s,
            sync_loads=self._sync_loads,
            expert_hits=self._expert_hits,
            expert_misses=self._expert_misses,
            expert_predicted=self._predicted,
            expert_predicted_correct=self._predicted_correct,
            expert_prefetched=self._prefetched,
            expert_host=self._host_computed,
            expert_layers=tuple((i, *counts) for i, counts in sorted(self._by_layer.items())),
        )
