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
an integer `num_experts`, its offloaded weights all lead with that many rows, and its forward is
handed the routing indices (`takes_routing`). One that is not (Llama 4's experts compute every
expert on inputs the router scaled) needs every expert at every call: its experts cross whole.
"""

from __future__ import annotations

import inspect
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
    expert, a matrix (or more) each, and whose forward is handed the routing (`takes_routing`).
    A module with an offloaded parameter that does not lead so is left out (it is copied whole
    with its layer), and so is one that only holds another, and one that is not told which
    experts a call routes to (`unroutable_experts`: it needs every expert)."""
    return [entry for entry in _shaped_experts(layer, params) if takes_routing(entry.module)]


def unroutable_experts(layer: nn.Module) -> list[str]:
    """The paths of `layer`'s modules shaped as experts modules (a matrix per expert) whose
    forward is not handed the routing indices: Llama 4's experts compute every expert on inputs
    the router has scaled, JetMoe's take per-expert row counts. No call of theirs can run on
    some experts' rows, so their experts cross and stay whole."""
    params = list(layer.named_parameters())
    return [e.path for e in _shaped_experts(layer, params) if not takes_routing(e.module)]


# The parameter an experts module's forward takes its routing indices in, after the hidden
# states (`routing_of` reads it there or by keyword): transformers 5's, gpt-oss's
ROUTING_PARAMETERS = ("top_k_index", "router_indices")


def takes_routing(module: nn.Module) -> bool:
    """Whether `module`'s forward is handed the experts each row routes to, where `routing_of`
    reads them: a parameter `ROUTING_PARAMETERS` names, second after the hidden states. Read
    from its class's forward, not the instance's, which a wrapper may have replaced
    (`offload.resident`'s compact calls)."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: nothing known, nothing routed
        return False
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(positional) > 2 and positional[2] in ROUTING_PARAMETERS  # after self, hidden


def _shaped_experts(
    layer: nn.Module, params: Sequence[tuple[str, nn.Parameter]]
) -> list[ExpertsModule]:
    """`layer`'s submodules with an integer `num_experts` whose parameters among `params` all
    lead with that many rows, a matrix (or more) among them; not one that only holds another."""
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
    for key in ROUTING_PARAMETERS:
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
