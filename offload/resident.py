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

Those experts' rows still take the buffer at the model's width, and for DeepSeek-V3 that is
21 GiB of a GPU (256 experts' fused matrices, one parameter each), most of what keeping the
layers as stored saves. `expert_capacity` C makes the buffer compact: an experts module's
per-expert matrices view only C rows of it. A call is run by the module's own forward on the
rows of the experts it routes to, in expert order: expert e (the j-th smallest expert the call
routes to) is dequantized into row j, the routing indices are mapped to those rows in the
same order, the module's other per-expert tensors (biases) are gathered to the same rows, and
its `num_experts` reads C for the call. An order-preserving renumbering leaves every
implementation (eager loops over the experts hit, `batched_mm`, `grouped_mm`) doing the same
arithmetic in the same order on the same rows. A call that routes to more than C experts (a
prefill) is split into groups of rows, each routing to at most C (rows that share experts go
together), and each group's output is put back at its rows: each row's output is computed
from its own experts as before, and each group dequantizes again the experts it needs. A
decode step of the plan's max batch fits one call (the planner sizes C to max_batch x
experts per token); a call whose routing cannot be read cannot be served from C rows and is
refused, naming the module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from offload.arena import align_up
from offload.errors import OffloadError
from offload.host_store import owner_of
from offload.quant import QuantizedTensor, dequantize_into
from offload.routed import (
    ExpertsModule,
    RoutingUnknownError,
    experts_modules,
    routed_experts,
    routing_of,
)

if TYPE_CHECKING:
    from offload.quant import WeightFormat


_MISSING = object()


class StoredResidency:
    """The stored (quantized) resident matrices of a stage's layers, on `device`, and the one
    buffer at the model's width that each layer's are dequantized into before it runs."""

    def __init__(self, device: torch.device, expert_capacity: int = 0) -> None:
        """`expert_capacity`: the rows of each experts module's per-expert matrices the buffer
        holds (the module doc); 0, or at least a module's expert count: all of them."""
        if (
            not isinstance(expert_capacity, int)
            or isinstance(expert_capacity, bool)
            or expert_capacity < 0
        ):
            raise ValueError(
                f"StoredResidency.expert_capacity={expert_capacity!r} must be an integer >= 0 "
                "(0: every expert)"
            )
        self.device = torch.device(device)
        self.expert_capacity = expert_capacity
        # layer module -> its parameters kept as stored: name within it -> values and scales
        self._stored: dict[nn.Module, dict[str, QuantizedTensor]] = {}
        # their shapes at the model's width (a compact experts matrix views fewer rows)
        self._shapes: dict[tuple[nn.Module, str], tuple[int, ...]] = {}
        # of those, the ones its layer's pre-hook dequantizes whole (the rest: per expert)
        self._whole: dict[nn.Module, list[str]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # experts modules whose forward runs on compact rows (their own forward is replaced)
        self._compact: list[nn.Module] = []
        self._buffer: torch.Tensor | None = None
        self.split_calls = 0  # compact calls split into groups of rows (more than C experts)

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
        views: dict[nn.Module, dict[str, tuple[int, ...]]] = {}  # the shape each views
        entries: dict[nn.Module, list[tuple[ExpertsModule, list[str], int]]] = {}
        for module, formats in layers.items():
            kept: dict[str, QuantizedTensor] = {}
            for name, fmt in formats.items():
                shape = tuple(module.get_parameter(name).shape)
                self._shapes[module, name] = shape
                kept[name] = QuantizedTensor(
                    torch.empty(fmt.values_shape(shape), dtype=fmt.dtype, device=self.device),
                    torch.empty(fmt.scale_shape(shape), dtype=fmt.scale_dtype, device=self.device),
                    fmt,
                )
            if not kept:
                continue
            self._stored[module] = kept
            names = list(kept)
            params = [(name, module.get_parameter(name)) for name in names]
            views[module] = {name: self._shapes[module, name] for name in names}
            entries[module] = []
            for entry in experts_modules(module, params):
                own = [names[i] for i in entry.positions]
                rows = self._rows(entry.num_experts)
                entries[module].append((entry, own, rows))
                for name in own:
                    views[module][name] = (rows, *views[module][name][1:])
            sizes.append(sum(align_up(self._nbytes(module, n, views[module][n])) for n in kept))
        if not self._stored:
            return {}
        self._buffer = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        for module, kept in self._stored.items():
            offset = 0
            for name in kept:
                owner, leaf = owner_of(module, name)
                param = owner._parameters[leaf]
                shape = views[module][name]
                nbytes = self._nbytes(module, name, shape)
                view = self._buffer[offset : offset + nbytes].view(param.dtype).view(shape)
                owner._parameters[leaf] = nn.Parameter(view, requires_grad=param.requires_grad)
                offset += align_up(nbytes)
            self._route(module, kept, entries[module])
        return self._stored

    def _rows(self, num_experts: int) -> int:
        """The rows an experts module of `num_experts` experts views of the buffer."""
        capacity = self.expert_capacity
        return num_experts if not capacity else min(capacity, num_experts)

    def _route(
        self,
        module: nn.Module,
        kept: dict[str, QuantizedTensor],
        entries: list[tuple[ExpertsModule, list[str], int]],
    ) -> None:
        """Hook `module`'s dequantization: its experts modules' per-expert matrices when the
        router has chosen (`_dequantize_experts`; on compact rows `_compact_forward`), the
        rest before the layer runs."""
        routed = set()
        for entry, own, rows in entries:
            routed.update(own)
            if rows < entry.num_experts:
                entry.module.forward = self._compact_forward(module, entry, own, rows)
                self._compact.append(entry.module)
                continue
            hook = self._dequantize_experts(module, entry.num_experts, own)
            self._hooks.append(entry.module.register_forward_pre_hook(hook, with_kwargs=True))
        self._whole[module] = [name for name in kept if name not in routed]
        self._hooks.append(module.register_forward_pre_hook(self._dequantize_layer))

    def _compact_forward(self, layer: nn.Module, entry: ExpertsModule, names: list[str], rows: int):
        """The forward of an experts module whose matrices `names` (within `layer`) view
        `rows` rows of the buffer: its own forward, on the experts its call routes to, or
        on each group of its rows (`_groups`) where they route to more (the module doc)."""
        forward = entry.module.forward  # its class's, bound
        views = {id(layer.get_parameter(name)) for name in names}  # set by keep, then fixed

        def compact(*args, **kwargs):
            try:
                index, key = routing_of(args, kwargs)
            except RoutingUnknownError as exc:
                raise OffloadError(
                    f"{exc}: '{entry.path}' keeps {rows} of its {entry.num_experts} experts' "
                    "rows on the device (StoredResidency.expert_capacity) and cannot run "
                    "without knowing which; keep every expert (expert_capacity 0) or the "
                    "resident weights wide"
                ) from None
            groups = _groups(index, entry.num_experts, rows, entry.path)
            if len(groups) <= 1:  # none: a call of no rows
                experts = groups[0][1] if groups else []
                return self._compact_call(
                    layer, entry, names, views, rows, experts, forward, args, kwargs, key
                )
            self.split_calls += 1
            out = None
            for picked, experts in groups:
                where = torch.tensor(picked, dtype=torch.long, device=index.device)
                part = _rows_of(args, kwargs, index.shape[0], where)
                got = self._compact_call(
                    layer, entry, names, views, rows, experts, forward, *part, key
                )
                if out is None:
                    out = got.new_empty((index.shape[0], *got.shape[1:]))
                out[where] = got
            return out

        return compact

    def _compact_call(self, layer, entry, names, views, rows, experts, forward, args, kwargs, key):
        """A compact call, or one group of its rows: `experts` (sorted) dequantized into rows
        0.., the routing indices renumbered to them, the module's other per-expert tensors
        (all but `views`, the ids of its compact matrices) gathered to them, its num_experts
        `rows`; then its own forward."""
        module, count = entry.module, entry.num_experts
        with torch.no_grad():
            for name in names:
                data, stored = layer.get_parameter(name).data, self._stored[layer][name]
                for row, expert in enumerate(experts):
                    dequantize_into(data[row], stored.select(0, expert))
        index = args[1] if key is None else kwargs[key]
        # expert e -> its row; an index outside 0..count-1 (a sentinel) stays outside: `rows`
        mapping = torch.full((count + 1,), rows, dtype=index.dtype)
        mapping[experts] = torch.arange(len(experts), dtype=index.dtype)
        mapping = mapping.to(index.device)
        renumbered = mapping[torch.where((index >= 0) & (index < count), index, count)]
        if key is None:
            args = (args[0], renumbered, *args[2:])
        else:
            kwargs = {**kwargs, key: renumbered}
        # the rows past the experts' (all of them where the call routes nowhere): a copy of one
        pad = (experts[-1:] or [0]) * (rows - len(experts))
        picked = torch.tensor(experts + pad, dtype=torch.long)
        swapped = _gather_rows(module, count, picked, views)
        own = module.__dict__.get("num_experts", _MISSING)
        module.num_experts = rows
        try:
            return forward(*args, **kwargs)
        finally:
            if own is _MISSING:
                del module.num_experts
            else:
                module.num_experts = own
            for table, leaf, tensor in swapped:
                table[leaf] = tensor

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
    def _nbytes(module: nn.Module, name: str, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * module.get_parameter(name).dtype.itemsize

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
            self._nbytes(module, name, self._shapes[module, name])
            for module, kept in self._stored.items()
            for name in kept
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
        for module in self._compact:
            del module.forward  # its class's own again
        self._compact.clear()
        for module, kept in self._stored.items():
            for name in kept:
                owner, leaf = owner_of(module, name)
                param = owner._parameters[leaf]
                owner._parameters[leaf] = nn.Parameter(
                    torch.empty(self._shapes[module, name], dtype=param.dtype, device="meta"),
                    requires_grad=param.requires_grad,
                )
        self._stored.clear()
        self._shapes.clear()
        self._whole.clear()
        self._buffer = None


def _groups(index: torch.Tensor, count: int, rows: int, path: str) -> list[tuple[list, list]]:
    """A call's rows (the first dim of its routing `index`) in groups that each route to at
    most `rows` experts: (its rows ascending, its experts sorted), one group when they all
    fit. Greedy: each pass takes, in order, every row left whose experts still fit, so rows
    that share experts go together (a prompt's rows mostly do) and each group's experts are
    dequantized once. Indices outside 0..count-1 route nowhere. Reading them waits for the
    router's kernels."""
    per_row = [
        {e for e in row if 0 <= e < count}
        for row in index.reshape(index.shape[0], math.prod(index.shape[1:])).tolist()
    ]
    widest = max(per_row, key=len, default=set())
    if len(widest) > rows:
        raise OffloadError(
            f"'{path}': a row routes to {len(widest)} experts, more than the {rows} rows its "
            "experts keep on the device (StoredResidency.expert_capacity)"
        )
    groups, left = [], list(range(len(per_row)))
    while left:
        hit, taken, rest = set(), [], []
        for i in left:
            union = hit | per_row[i]
            if len(union) <= rows:
                hit = union
                taken.append(i)
            else:
                rest.append(i)
        groups.append((taken, sorted(hit)))
        left = rest
    return groups


def _rows_of(args: tuple, kwargs: dict, total: int, where: torch.Tensor):
    """An experts call's arguments for its rows `where`: every tensor argument that leads with
    one entry per row (hidden states, routing indices and weights) indexed by them; a tensor
    argument of any other length cannot be split, and is refused."""

    def part(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0 or value.shape[0] != total:
            raise OffloadError(
                f"an experts call routes to more experts than its compact rows hold and has a "
                f"tensor argument of shape {list(value.shape)} that is not one entry per row "
                f"({total}): it cannot be split; raise StoredResidency.expert_capacity"
            )
        return value[where]

    return tuple(part(a) for a in args), {k: part(v) for k, v in kwargs.items()}


def _gather_rows(module: nn.Module, count: int, picked: torch.Tensor, skip: set[int]) -> list:
    """Swap each per-expert parameter or buffer of `module` (leading with `count` rows), but
    those in `skip` (the compact stored matrices), for its rows `picked`: what was swapped,
    (table, name, tensor), to put back."""
    swapped = []
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for leaf, tensor in list(table.items()):
                if tensor is None or id(tensor) in skip or tensor.dim() == 0:
                    continue
                if tensor.shape[0] != count:
                    continue
                rows = tensor.detach()[picked.to(tensor.device)]
                table[leaf] = (
                    nn.Parameter(rows, requires_grad=False) if table is owner._parameters else rows
                )
                swapped.append((table, leaf, tensor))
    return swapped
