"""Which offloaded weights belong to an MoE experts module, and which experts a step routes to.

An MoE layer's experts are most of its bytes, and a step uses few of them: at batch 1 a token
of a 32-expert, top-4 layer reads 4 experts, an eighth of the layer. The model's own router
decides which (grouped top-k, biases, normalisation: each family its own), and transformers 5
hands its choice to the experts module: `experts(hidden_states, top_k_index, top_k_weights)`,
the fused weights `gate_up_proj` [E, ...], `down_proj` [E, ...] (and biases [E, ...]) indexed
by expert. Every experts implementation reads only the experts some row routes to (eager loops
over the experts hit, `batched_mm` gathers `weight[top_k_index]`, `grouped_mm` skips empty
groups), so only those need to be on the device when it runs.

`experts_modules` finds those modules in an offloaded layer, with the offloaded weights that
are per expert; `routed_experts` reads the experts a call routes to from its arguments. The
prefetch offloader (`offload.prefetch`, `OffloadConfig.routed_experts`) then copies just those
experts' rows of each weight into the layer's slot, after the router has run and before the
experts compute, and keeps track of what the slot already holds.

Torch only; nothing here depends on a model family: a module is an experts module when it has
an integer `num_experts` and its offloaded weights all lead with that many rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class ExpertsModule:
    """An experts module of an offloaded layer: where it is in the layer (`path`), its expert
    count, and the positions (in the layer's parameter list) of its offloaded per-expert
    weights."""

    path: str
    module: nn.Module
    num_experts: int
    positions: tuple[int, ...]


def experts_modules(
    layer: nn.Module, params: Sequence[tuple[str, nn.Parameter]]
) -> list[ExpertsModule]:
    """The experts modules among `layer`'s submodules whose offloaded parameters (`params`:
    (name within the layer, parameter), as the offloader lists them) lead with one row per
    expert, a matrix (or more) each. A module with an offloaded parameter that does not is
    left out (it is copied whole with its layer), and so is one that only holds another."""
    found = []
    for path, module in layer.named_modules():
        count = getattr(module, "num_experts", None)
        if not path or not isinstance(count, int) or isinstance(count, bool) or count < 1:
            continue
        prefix = path + "."
        positions = [i for i, (name, _) in enumerate(params) if name.startswith(prefix)]
        own = [params[i][1] for i in positions]
        # a matrix per expert (a router's [E, hidden] weight alone is no experts module)
        if any(p.dim() >= 3 for p in own) and all(p.shape[0] == count for p in own):
            found.append(ExpertsModule(path, module, count, tuple(positions)))
    # an outer module that only holds an inner experts module is not one itself
    paths = [f.path for f in found]
    return [
        f
        for f in found
        if not any(other != f.path and other.startswith(f.path + ".") for other in paths)
    ]


class RoutingUnknownError(ValueError):
    """An experts module was called without routing indices this module can read."""


def routing_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, str | None]:
    """An experts call's routing indices and where they are: the second positional argument
    (`top_k_index`, gpt-oss's `router_indices`; None) or the keyword of that name."""
    index, name = (args[1] if len(args) > 1 else None), None
    for key in ("top_k_index", "router_indices"):
        if index is None and key in kwargs:
            index, name = kwargs[key], key
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point:
        got = type(index).__name__ + (f" {index.dtype}" if isinstance(index, torch.Tensor) else "")
        raise RoutingUnknownError(
            f"an experts module was called without integer routing indices (got {got})"
        )
    return index, name


def routed_experts(num_experts: int, args: tuple, kwargs: dict) -> list[int]:
    """The experts (sorted) a call of an experts module routes some row to, from its routing
    indices (`routing_of`). Indices outside 0..num_experts-1 (an expert-parallel sentinel)
    route nowhere. Reading them waits for the router's kernels: the copies cannot start
    sooner."""
    index, _ = routing_of(args, kwargs)
    hit = torch.unique(index).tolist()
    return [e for e in hit if 0 <= e < num_experts]
