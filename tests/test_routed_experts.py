"""Routed expert fetch (issue 55, point 1): an offloaded MoE layer's experts cross the link
expert by expert, only those the step's router chose (the model's own router: grouped top-k,
biases, normalisation), once it has run; the experts then run on the slot as always.

The numbers are transformers': the experts implementations read only the experts some row
routes to, so the logits are bitwise those of transformers loading the same files, in float32
and bfloat16, for every MoE family; greedy texts under continuous batching too. And the bytes
are the routed experts' only: what crossed equals the experts fetched times an expert's bytes.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import run_stack
from test_families import VOCAB, Pipeline, offloading_plan, reference
from test_generation import REQUESTS, TWO_STAGES, alone, prompts, run_joining
from torch import nn

from coordinator.config import JobConfig
from coordinator.planning.planner import PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.runtime.group import stage_specs
from coordinator.tools.make_checkpoint import MOE_ARCHITECTURES
from offload import OffloadConfig, PrefetchOffloader
from offload.routed import (
    RoutingUnknownError,
    experts_modules,
    routed_experts,
    takes_routing,
    unroutable_experts,
)
from worker.names import expected_experts

MOE_FAMILIES = MOE_ARCHITECTURES
MOVED = ("layers.0", "layers.1", "layers.3")


def expert_bytes(index, layer) -> int:
    """Host bytes of one expert of a layer's experts unit (all experts are alike)."""
    config = index.config
    count = next(
        config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in config
    )
    assert layer.unit_bytes("experts") % count == 0
    return layer.unit_bytes("experts") // count


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from test_families import family_shape

    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import make_checkpoint

    made = {}

    def get(family: str, dtype: str = "float32", **changes):
        key = (family, dtype, tuple(sorted(changes.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(f"routed-{family}-{dtype}") / "ckpt"
            shape = family_shape(family, dtype, **changes)
            made[key] = load_index(make_checkpoint(root, shape))
        return made[key]

    return get


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_routed_experts_give_transformers_logits_and_move_only_routed_bytes(
    moe, family: str, dtype: str
) -> None:
    """Three layers' experts offloaded, fetched by routing: logits bitwise transformers',
    over two passes; every byte that crossed belongs to an expert some row routed to (the
    copied bytes are the fetched experts' bytes exactly), and fewer than the whole units."""
    index = moe(family, dtype)
    names = [layer.name for layer in index.layers]
    by_name = {layer.name: layer for layer in index.layers}
    moved = tuple(n for n in MOVED if by_name[n].unit_bytes("experts"))
    assert moved, family
    ids = torch.randint(2, VOCAB, (1, 3), generator=torch.Generator().manual_seed(9))
    pipeline = Pipeline(
        index, [names[:3], names[3:]], offloaded=moved, unit="experts", expert_fetch="routed"
    )
    try:
        first, second = pipeline(ids), pipeline(ids)
        reports = [worker.report() for worker in pipeline.workers]
        stats = [report.stats for report in reports]
        # the family's router was found: a moved layer after another in its stage is
        # predicted by it (pre-gating); its predictions never change a number (below)
        pregated = [len(w.offloader.pregated_layers) for w in pipeline.workers]
    finally:
        pipeline.close()
    per_stage = [sum(n in group for n in moved) for group in (names[:3], names[3:])]
    assert pregated == [max(count - 1, 0) for count in per_stage], family
    # each moved layer's routed experts counted under its name
    assert [c[0] for r in reports for c in r.expert_layers] == list(moved)
    expected = reference(index, ids)
    assert torch.equal(first, expected) and torch.equal(second, expected), family
    misses = sum(s.expert_misses for s in stats)
    ahead = sum(s.expert_prefetched for s in stats)  # predicted, copied before the router
    copied = sum(s.copied_bytes for s in stats)
    per_expert = {expert_bytes(index, by_name[n]) for n in moved}
    assert len(per_expert) == 1, per_expert
    per_expert_bytes = per_expert.pop()
    assert misses and copied == (misses + ahead) * per_expert_bytes
    whole = 2 * sum(by_name[n].unit_bytes("experts") for n in moved)
    # what crossed for the two passes (the predicted experts copied ahead are, at the end,
    # the next pass's, as a whole-layer prefetch loads its slot's next layer)
    assert misses * per_expert_bytes < whole


def test_routed_4_bit_and_8_bit_experts_cross_as_stored(moe) -> None:
    """gpt-oss's MXFP4 experts and int8 experts (quantized at load) are fetched by routing
    too, each expert's rows of values and scales dequantized into the slot: the logits are
    those the whole-layer fetch gives (transformers', for MXFP4)."""
    names = None
    ids = torch.randint(2, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    for family, changes, offload_dtype in (
        ("gpt_oss", {"hidden_size": 64, "intermediate_size": 96, "quantization": "mxfp4"}, "auto"),
        ("qwen3_moe", {}, "int8"),
    ):
        dtype = "bfloat16"
        index = moe(family, dtype, **changes)
        names = [layer.name for layer in index.layers]
        logits = {}
        for fetch in ("layer", "routed"):
            pipeline = Pipeline(
                index,
                [names[:3], names[3:]],
                offloaded=MOVED,
                unit="experts",
                offload_dtype=offload_dtype,
                expert_fetch=fetch,
            )
            try:
                logits[fetch] = pipeline(ids)
                stats = [w.report().stats for w in pipeline.workers]
                formats = [w._placement.offload_format() for w in pipeline.workers]
            finally:
                pipeline.close()
            assert any(formats), family
            assert (sum(s.expert_misses for s in stats) > 0) == (fetch == "routed")
        assert torch.equal(logits["routed"], logits["layer"]), family
        if changes.get("quantization") == "mxfp4":
            assert torch.equal(logits["routed"], reference(index, ids))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("host_rows", [0, 4])
def test_requests_with_routed_experts_equal_transformers_alone(
    moe, family: str, host_rows: int
) -> None:
    """Continuous batching with routed experts: requests joining and leaving, each step
    fetching the experts its rows route to (or, `host_rows`, computing a step of at most that
    many rows on the host); each text equals transformers alone."""
    index = moe(family)
    pipeline = Pipeline(
        index, *TWO_STAGES, unit="experts", expert_fetch="routed", host_expert_rows=host_rows
    )
    try:
        ids = prompts(seed=4)
        ours, _ = run_joining(pipeline, ids, micro_batches=1)
        stats = [w.report().stats for w in pipeline.workers]
    finally:
        pipeline.close()
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(index, prompt, new), family
    assert sum(s.expert_misses for s in stats) > 0  # prompts of more rows copy
    assert (sum(s.expert_host for s in stats) > 0) == bool(host_rows)


# --- the offloader on its own ---------------------------------------------------------------

E, H, INNER, TOP = 8, 16, 12, 2


class Experts(nn.Module):
    """A fused experts module as transformers 5 writes them: reads only routed experts."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * INNER, H) * 0.3, requires_grad=False)
        self.down_proj = nn.Parameter(torch.randn(E, H, INNER) * 0.3, requires_grad=False)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in torch.unique(top_k_index).tolist():
            position, token = torch.where(e == top_k_index.T)
            gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, -1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, position, None])
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = Experts()

    def forward(self, x):
        weights, index = torch.topk(self.gate(x).softmax(-1), TOP, dim=-1)
        return x + self.experts(x, index, weights)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_slot_keeps_its_layers_experts_until_it_takes_another_layer(slots: int) -> None:
    """Three offloaded layers, one row: each step fetches the row's experts of each layer. With a
    slot per layer the experts stay: the second and third passes fetch nothing (all hits);
    with fewer slots, a slot that took another layer fetches again. The output is the
    resident model's every time, and each fetched expert crossed exactly once per miss."""
    torch.manual_seed(0)
    x = torch.randn(1, H)
    stats = _three_offloaded([Block() for _ in range(4)], slots, [x] * 3)
    assert stats.expert_hits + stats.expert_misses == 3 * 3 * TOP
    if slots == 3:
        assert stats.expert_misses == 3 * TOP and stats.expert_hits == 2 * 3 * TOP
    else:
        assert stats.expert_hits < 2 * 3 * TOP


def test_experts_modules_are_found_by_their_per_expert_weights() -> None:
    """The experts module is found (not the router, whose [E, hidden] weight alone is no
    experts module, nor the block that only holds it); a module with an offloaded weight that
    is not per expert is left to the whole-layer fetch."""
    block = Block()
    params = [(n, p) for n, p in block.named_parameters()]
    found = experts_modules(block, params)
    assert [f.path for f in found] == ["experts"]
    assert [params[i][0] for i in found[0].positions] == [
        "experts.gate_up_proj",
        "experts.down_proj",
    ]
    block.experts.extra = nn.Parameter(torch.zeros(3, 4, 4))  # not per expert
    params = [(n, p) for n, p in block.named_parameters()]
    assert experts_modules(block, params) == []


def test_experts_modules_not_handed_their_routing_are_left_to_cross_whole() -> None:
    """transformers' experts modules are handed the routing as their second argument
    (`top_k_index`; gpt-oss's `router_indices`), except Llama 4's (every expert computed on
    inputs the router scaled) and JetMoe's (per-expert row counts): those are no experts
    modules to route, but are named as such, and the layer's experts cross whole."""
    import transformers

    def experts_of(config_class: str, **settings) -> nn.Module:
        config = getattr(transformers, config_class)(
            hidden_size=16, intermediate_size=32, num_attention_heads=2, **settings
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        return model.model.layers[0]

    routed = {
        "mixtral": experts_of("MixtralConfig", num_local_experts=4),
        "gpt_oss": experts_of("GptOssConfig", num_local_experts=4),
    }
    whole = {
        "llama4_text": experts_of(
            "Llama4TextConfig", num_local_experts=4, intermediate_size_mlp=32, head_dim=8
        ),
        "jetmoe": experts_of("JetMoeConfig", num_local_experts=4, kv_channels=8),
    }
    for name, layer in {**routed, **whole}.items():
        params = list(layer.named_parameters())
        found, unroutable = experts_modules(layer, params), unroutable_experts(layer)
        if name in routed:
            assert [f.path for f in found] == ["mlp.experts"] and not unroutable, name
            assert takes_routing(found[0].module)
        else:
            assert found == [] and unroutable, name
            assert not any(takes_routing(layer.get_submodule(p)) for p in unroutable)
    assert unroutable_experts(whole["llama4_text"]) == ["feed_forward.experts"]
    # read from the class: a wrapper on the instance (a compact call's) changes nothing
    experts = routed["mixtral"].mlp.experts
    experts.forward = lambda *args, **kwargs: None
    assert takes_routing(experts)


def test_routing_is_read_from_the_call_or_refused() -> None:
    index = torch.tensor([[3, 1], [1, 9]])  # 9: an expert-parallel sentinel, routed nowhere
    assert routed_experts(8, (None, index, None), {}) == [1, 3]
    assert routed_experts(8, (None,), {"top_k_index": index}) == [1, 3]
    assert routed_experts(8, (None,), {"router_indices": index}) == [1, 3]
    with pytest.raises(RoutingUnknownError, match="without integer routing indices"):
        routed_experts(8, (None, index.float(), None), {})


# --- the planner's choice -------------------------------------------------------------------


def test_expected_distinct_experts_under_uniform_routing() -> None:
    assert expected_experts(64, 6, 1) == pytest.approx(6.0)
    assert expected_experts(64, 6, 2) == pytest.approx(64 * (1 - (58 / 64) ** 2))
    assert expected_experts(64, 6, 64) == pytest.approx(64 * (1 - (58 / 64) ** 64))  # 63.88
    assert expected_experts(4, 8, 1) == 4.0  # k past E: every expert
    assert expected_experts(0, 2, 4) == 0.0


def test_a_plan_asked_to_route_on_nodes_that_read_in_place_says_why_none_routes(moe) -> None:
    """Routed fetch asked for where the nodes read offloaded weights in place (uva): no stage
    routes, and the plan says it is the backend, not the model (Llama 4's case,
    tests/test_family_check.py)."""
    index = moe("qwen3_moe")
    base = offloading_plan(index, expert_fetch="layer")
    gpus = tuple(
        GpuInfo(index=i, memory_bytes=s.device_bytes + 1) for i, s in enumerate(base.stages)
    )
    notes = {}
    for backend in ("uva", "prefetch"):
        node = NodeInfo(
            node_id="node",
            gpus=gpus,
            host_budget_bytes=10**9,
            pinned_budget_bytes=10**9,
            backend=backend,
        )
        the_plan = plan(
            index.layers, ClusterSnapshot(nodes=(node,)), PlanOptions(expert_fetch="routed")
        )
        assert any(s.offloaded for s in the_plan.stages)
        routes = {s.expert_fetch for s in the_plan.stages if s.offloaded}
        assert routes == ({"layer"} if backend == "uva" else {"routed"}), backend
        notes[backend] = the_plan.summary()
    assert "no stage routes: their nodes read offloaded weights in place (uva)" in notes["uva"]
    assert "no stage routes" not in notes["prefetch"]


@pytest.mark.parametrize(("fetch", "rows"), [("auto", 1), ("auto", 64), ("routed", 64)])
def test_the_plan_fetches_experts_by_routing_where_its_cost_model_says_so(
    moe, fetch: str, rows: int
) -> None:
    """A transfer-bound stage offloading qwen3_moe's experts (4 of them, top-2): at one row a
    step the expected 2 distinct experts cross after the router, half the unit, so routed
    (compute + half the copy) beats whole-unit prefetch; at 64 rows every expert is expected,
    routed would only add the copy to compute, so auto keeps whole-layer fetch; `routed`
    forces it, its time the compute plus the whole copy. Workers get the plan's choice."""

    index = moe("qwen3_moe")
    base = offloading_plan(index, expert_fetch="layer")
    options = PlanOptions(
        expert_fetch=fetch,
        max_batch=rows,
        default_link_bytes_per_s=1e6,  # the copies dominate
        compute_bytes_per_s=1e12,
    )
    gpus = tuple(
        GpuInfo(index=i, memory_bytes=s.device_bytes + 1) for i, s in enumerate(base.stages)
    )
    node = NodeInfo(node_id="node", gpus=gpus, host_budget_bytes=10**9, pinned_budget_bytes=10**9)
    the_plan = plan(index.layers, ClusterSnapshot(nodes=(node,)), options)
    experts = [s for s in the_plan.stages if s.offloaded and s.offload_unit == "experts"]
    assert experts, [(s.offloaded, s.offload_unit) for s in the_plan.stages]
    for s in experts:
        whole = s.offloaded_bytes / 1e6
        if (fetch, rows) == ("auto", 1):
            assert s.expert_fetch == "routed"
            assert s.transfer_s == pytest.approx(whole / 2)  # 2 of 4 experts expected
            assert s.copied_bytes == s.offloaded_bytes // 2
            assert s.time_s == pytest.approx(s.compute_s + whole / 2) and s.time_s < whole
        elif fetch == "auto":
            assert s.expert_fetch == "layer" and s.time_s == pytest.approx(whole)
            assert s.copied_bytes == s.offloaded_bytes  # the whole unit, every step
        else:
            assert s.expert_fetch == "routed"
            assert s.time_s == pytest.approx(s.compute_s + whole, rel=1e-3)
    specs = stage_specs(JobConfig(checkpoint=str(index.root)), index, the_plan, {})
    assert [sp.expert_fetch for sp in specs] == [s.expert_fetch for s in the_plan.stages]
    if (fetch, rows) == ("auto", 1):
        assert ", routed)" in the_plan.summary() and "fetched by routing" in the_plan.summary()


@pytest.mark.parametrize(
    ("host", "rates", "batch", "expected"),
    [
        ("auto", ((1, 1e9), (16, 1e9)), 4, 4),  # the host far sooner: every decode step
        ("auto", ((1, 3e6), (16, 3e6)), 64, 48),  # past 16 rows it slows: 3e6 x 16 / 48 = link
        ("auto", ((1, 1e5), (16, 1e5)), 4, 0),  # the host slower than the link
        ("auto", (), 4, 0),  # not measured
        ("off", ((1, 1e9), (16, 1e9)), 4, 0),
        ("auto", None, 4, 4),  # GPUs simulated on the CPU: the host computes as they do
    ],
)
def test_the_plan_computes_small_steps_experts_on_the_host_where_its_rates_say_sooner(
    moe, host: str, rates: tuple, batch: int, expected: int
) -> None:
    """qwen3_moe's experts offloaded over a 1 MB/s link, CUDA GPUs computing 1 TB/s: a routed
    expert costs the GPU about 1 us a byte (copy and compute), the host 1/rate. Steps of as
    many rows as the host stays sooner at (its rate at the nearest measured rows at or above,
    slowing in proportion past the largest) run there: where that covers the plan's step, the
    stage copies nothing of its experts and its time counts the host's compute of the
    expected routed experts. GPUs simulated on the CPU (`rates` None) compute at the host's
    rate, so a copy never pays there. Said in the plan, given to the workers."""
    index = moe("qwen3_moe")
    base = offloading_plan(index, expert_fetch="layer")
    options = PlanOptions(
        expert_fetch="routed",
        host_experts=host,
        expert_cache=0,
        max_batch=batch,
        default_link_bytes_per_s=1e6,
        compute_bytes_per_s=1e12,
    )
    gpus = tuple(
        GpuInfo(index=i, memory_bytes=s.device_bytes + 1) for i, s in enumerate(base.stages)
    )
    node = NodeInfo(
        node_id="node",
        gpus=gpus,
        host_budget_bytes=10**9,
        pinned_budget_bytes=10**9,
        host_matmul_bytes_per_s=rates or (),
        cuda=rates is not None,
    )
    the_plan = plan(index.layers, ClusterSnapshot(nodes=(node,)), options)
    routed = [s for s in the_plan.stages if s.expert_fetch == "routed"]
    assert routed and all(s.offload_unit == "experts" for s in routed)
    for s in routed:
        assert s.host_expert_rows == expected
        if expected >= batch:  # the plan's own steps run on the host: no expert copied
            layers = {layer.name: layer for layer in index.layers}
            chosen = sum(
                layers[n].unit_bytes("experts")
                * expected_experts(layers[n].experts, layers[n].experts_per_token, batch)
                / layers[n].experts
                for n in s.offloaded
            )
            assert s.copied_bytes == 0 and s.transfer_s == 0
            host = dict(rates)[1] if rates else options.compute_bytes_per_s
            assert s.time_s == pytest.approx(s.compute_s + chosen / host)
        else:
            assert s.copied_bytes > 0
    specs = stage_specs(JobConfig(checkpoint=str(index.root)), index, the_plan, {})
    assert [sp.host_expert_rows for sp in specs] == [s.host_expert_rows for s in the_plan.stages]
    summary = the_plan.summary()
    assert ("experts on the host (host experts auto): stage" in summary) == bool(expected)
    assert ("experts on the host: none" in summary) == (host == "auto" and not expected)


@pytest.mark.parametrize(("cache", "rows"), [(-1, 2), (1, 0), (0, 0)])
def test_the_plan_gives_routed_stages_the_memory_left_as_an_expert_cache(
    tmp_path, cache: int, rows: int
) -> None:
    """qwen3_moe with 16 experts (top-2) on one GPU 1.5 experts units short of holding it: the
    plan offloads 3 layers' experts (3 units, less a slot of one), leaving half a unit: 8
    expert rows, each cache row costs one per offloaded layer and one of scratch (4), so auto
    gives 2 rows; at most 1 is fewer than a token's 2 experts, which could never serve a call:
    none, as with 0. A cached expert is expected to be hit C/E of the time, so the routed copy
    shrinks by that; the cache's bytes are in the stage's device bytes, within its GPU;
    workers get the rows."""
    from test_families import family_shape

    from coordinator.planning.checkpoint import load_index
    from coordinator.tools.make_checkpoint import make_checkpoint

    shape = family_shape("qwen3_moe", "float32", num_experts=16, experts_per_token=2)
    index = load_index(make_checkpoint(tmp_path / "moe", shape))
    unit = max(layer.unit_bytes("experts") for layer in index.layers)
    row = unit // 16
    memory = index.total_bytes - 3 * unit // 2
    node = NodeInfo(
        node_id="node",
        gpus=(GpuInfo(index=0, memory_bytes=memory),),
        host_budget_bytes=10**9,
        pinned_budget_bytes=10**9,
    )
    options = PlanOptions(
        expert_fetch="routed",
        expert_cache=cache,
        max_batch=1,
        default_link_bytes_per_s=1e6,
        compute_bytes_per_s=1e12,
    )
    [stage] = plan(index.layers, ClusterSnapshot(nodes=(node,)), options).stages
    assert stage.expert_fetch == "routed" and len(stage.offloaded) == 3
    assert stage.expert_cache == rows
    assert stage.expert_cache_bytes == rows * 4 * row
    assert memory - 8 * row <= stage.device_bytes - stage.expert_cache_bytes
    assert stage.device_bytes <= memory
    whole = stage.offloaded_bytes / 1e6
    expected = 16 * (1 - (1 - 2 / 16) ** 1)  # experts one row routes to, C of 16 cached
    assert stage.transfer_s == pytest.approx(whole * expected / 16 * (1 - rows / 16))
    the_plan = plan(index.layers, ClusterSnapshot(nodes=(node,)), options)
    specs = stage_specs(JobConfig(checkpoint=str(index.root)), index, the_plan, {})
    assert [sp.expert_cache for sp in specs] == [rows]
    assert ("expert cache: stage 0 2 rows" in the_plan.summary()) == bool(rows)
    # a step copies the experts expected routed and not cached (only experts are offloaded)
    assert stage.copied_bytes == pytest.approx(
        stage.offloaded_bytes * expected / 16 * (1 - rows / 16), abs=1
    )
    assert "predicted copy per generated token" in the_plan.summary()


def test_releasing_the_device_buffers_lets_the_slots_go() -> None:
    """A worker's re-plan frees the old offloader's slots before it allocates the new stage's:
    no copy kept from the old schedule (8-bit pieces, routed experts' rows) may hold a view of
    them."""
    import gc
    import weakref

    from offload.quant import BlockFormat

    torch.manual_seed(0)
    layers = [Block() for _ in range(3)]
    int8 = BlockFormat(torch.int8, (1, H))
    offloader = PrefetchOffloader(
        OffloadConfig(
            backend="prefetch", layers=(1, 2), param_filter=r"experts\.", routed_experts=True
        ),
        device="cpu",
        formats={
            "1.experts.gate_up_proj": int8,
            "2.experts.down_proj": BlockFormat(torch.int8, (1, INNER)),
        },
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        run_stack(layers, torch.randn(2, H))  # builds the routed experts' copies
        slots = [weakref.ref(slot) for slot in offloader._slots]
        offloader.release_device_buffers()
        gc.collect()
        assert slots and all(ref() is None for ref in slots)
    finally:
        offloader.detach(restore=False)


class ChosenBlock(Block):
    """A Block whose routing is the test's (`route`: each row's experts), with no router (so
    nothing predicts its experts but their last routing)."""

    route = torch.tensor([0, 1])

    def __init__(self) -> None:
        super().__init__()
        del self.gate

    def forward(self, x):
        index = self.route.expand(x.shape[0], -1)
        weights = torch.full(index.shape, 0.5)
        return x + self.experts(x, index, weights)


def _predicting_run(routes: list[list[int]], monkeypatch, accuracy: float):
    """`_routed_run` without a cache, experts copied ahead at a layer accuracy of `accuracy`
    (above 1: never)."""
    import offload.prefetch as prefetch

    monkeypatch.setattr(prefetch, "PREDICT_ACCURACY", accuracy)
    return _routed_run(routes, cache=0)


def test_experts_a_layer_keeps_routing_to_are_copied_before_its_router_runs(monkeypatch) -> None:
    """A layer routing to the same experts call after call: its prediction (the last routing)
    is right every time, so loading its slot copies them ahead and the router finds them
    there: fewer misses on the critical path than without prediction, the same outputs."""
    routes = [[0, 1]] * 5
    plain = _predicting_run(routes, monkeypatch, accuracy=2.0)  # never acted on
    ahead = _predicting_run(routes, monkeypatch, accuracy=0.5)
    assert plain.expert_prefetched == 0 and ahead.expert_prefetched > 0
    # measured either way: 4 of the 5 passes predicted, 3 layers, 2 experts, all right
    for stats in (plain, ahead):
        assert stats.expert_predicted == stats.expert_predicted_correct == 4 * 3 * 2
    assert ahead.expert_misses < plain.expert_misses
    assert ahead.expert_hits > plain.expert_hits
    assert ahead.expert_hits + ahead.expert_misses == 5 * 3 * 2


def test_a_layer_whose_routing_changes_is_not_predicted(monkeypatch) -> None:
    """Routing that alternates between disjoint experts: the measured accuracy is 0, so no
    expert is copied ahead (a wrong copy costs link time and saves nothing)."""
    stats = _predicting_run([[0, 1], [2, 3]] * 3, monkeypatch, accuracy=0.5)
    assert stats.expert_predicted == 5 * 3 * 2 and stats.expert_predicted_correct == 0
    assert stats.expert_prefetched == 0


class UnusableRouterBlock(Block):
    """A Block whose router's weight has a row per expert but cannot take the hidden state
    (one input too many): the offloader takes it for the router, and calling it fails."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H + 1, E, bias=False)

    def forward(self, x):
        index = torch.stack([torch.arange(TOP)] * len(x))
        return x + self.experts(x, index, torch.full(index.shape, 0.5))


def _three_offloaded(layers: list[nn.Module], slots: int, inputs: list[torch.Tensor], **config):
    """Layers 1-3 of `layers` offloaded over `slots` slots, their experts routed (`config`:
    more of the OffloadConfig); a pass per input, its output against a resident copy's; the
    stats, their bytes checked (every byte copied is one expert's) and the weights restored
    by detach."""
    resident = copy.deepcopy(layers)
    offloader = PrefetchOffloader(
        OffloadConfig(
            backend="prefetch",
            layers=(1, 2, 3),
            prefetch_step=slots,
            param_filter=r"experts\.",
            routed_experts=True,
            **config,
        ),
        device="cpu",
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        for x in inputs:
            assert torch.equal(run_stack(layers, x), run_stack(resident, x))
        stats = offloader.stats()
    finally:
        offloader.detach()
    per_expert = (2 * INNER * H + H * INNER) * 4
    assert stats.copied_bytes == (stats.expert_misses + stats.expert_prefetched) * per_expert
    for a, b in zip(resident, layers, strict=True):
        assert torch.equal(a.experts.down_proj, b.experts.down_proj)
    return stats


@pytest.mark.parametrize(("slots", "shift"), [(1, 0), (1, 3), (2, 3)])
def test_a_layers_router_predicts_its_experts_from_the_layer_before(slots, shift) -> None:
    """Pre-gating: each layer's router is the one before's with its experts renumbered
    (`shift`), and the experts change the hidden state little, so a router applied to the
    previous layer's input chooses what it will choose. A fresh input every pass, so the last
    routing predicts little. Layers 2 and 3, predicted by their routers during the call of the
    layer before, find most of their experts copied ahead; layer 1, predicted by its last
    routing, finds few. With one slot and the same experts (shift 0) the copies wait for the
    slot's load, since layer 1 still reads those rows; otherwise they start during its call.
    The output is the resident model's every pass."""
    torch.manual_seed(0)
    layers = [Block() for _ in range(4)]
    with torch.no_grad():
        for before, layer in itertools.pairwise(layers):
            layer.gate.weight.copy_(before.gate.weight.roll(shift, 0))
        for layer in layers:
            layer.experts.down_proj.mul_(1e-3)
    passes = 12
    stats = _three_offloaded(layers, slots, [torch.randn(1, H) for _ in range(passes)])
    hits = {index: found for index, found, _, _ in stats.expert_layers}
    routed = passes * TOP
    assert hits[2] >= 0.75 * routed and hits[3] >= 0.75 * routed, hits
    assert hits[1] <= 0.5 * routed, hits
    assert stats.expert_predicted_correct >= 0.6 * stats.expert_predicted
    # each predicted expert crossed once at most (those copied ahead of its layer's load stay
    # there); the last pass's predictions for the next pass are never measured
    assert stats.expert_prefetched <= stats.expert_predicted + 3 * TOP


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_computed_on_the_host_give_transformers_logits(moe, family, dtype) -> None:
    """Three layers' experts offloaded and every call (3 rows) run on the host, reading the
    experts in host memory: logits bitwise transformers', nothing copied."""
    index = moe(family, dtype)
    names = [layer.name for layer in index.layers]
    by_name = {layer.name: layer for layer in index.layers}
    moved = tuple(n for n in MOVED if by_name[n].unit_bytes("experts"))
    ids = torch.randint(2, VOCAB, (1, 3), generator=torch.Generator().manual_seed(9))
    pipeline = Pipeline(
        index,
        [names[:3], names[3:]],
        offloaded=moved,
        unit="experts",
        expert_fetch="routed",
        host_expert_rows=3,
    )
    try:
        logits = pipeline(ids)
        stats = [worker.report().stats for worker in pipeline.workers]
    finally:
        pipeline.close()
    assert torch.equal(logits, reference(index, ids)), family
    assert sum(s.expert_host for s in stats) > 0
    assert sum(s.copied_bytes + s.expert_misses + s.expert_hits for s in stats) == 0


def test_calls_of_few_rows_run_their_experts_on_the_host_without_a_copy() -> None:
    """host_expert_rows=2: the one- and two-row passes run every routed expert where it is in
    host memory (nothing copied, no hit, no miss, nothing copied ahead however right the
    predictions); a three-row pass fetches its experts into the slot as before. Every output
    is the resident model's."""
    torch.manual_seed(0)
    layers = [Block() for _ in range(4)]
    inputs = [torch.randn(1, H), torch.randn(2, H), torch.randn(1, H)]
    stats = _three_offloaded(layers, 1, inputs * 2, host_expert_rows=2)
    assert stats.copied_bytes == stats.expert_hits == stats.expert_misses == 0
    assert stats.expert_prefetched == 0
    assert 6 * 3 * TOP <= stats.expert_host <= 6 * 3 * 2 * TOP
    wide = _three_offloaded(layers, 1, [torch.randn(3, H)], host_expert_rows=2)
    assert wide.expert_host == 0 and wide.expert_misses > 0
    with pytest.raises(ValueError, match=r"host_expert_rows=1 .* needs routed_experts=True"):
        OffloadConfig(backend="prefetch", layers=(1,), host_expert_rows=1)


def test_a_host_call_leaves_the_weights_viewing_their_slot() -> None:
    """During a host call the experts' weights view host memory; after it they view their
    slot again (on a GPU the next call could not read host tensors), and the module has all
    its experts."""
    torch.manual_seed(0)
    layers = [Block() for _ in range(4)]
    offloader = PrefetchOffloader(
        OffloadConfig(
            backend="prefetch",
            layers=(1, 2, 3),
            param_filter=r"experts\.",
            routed_experts=True,
            host_expert_rows=1,
        ),
        device="cpu",
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        slot = [(b.experts.gate_up_proj.data_ptr(), b.experts.down_proj.data_ptr()) for b in layers]
        seen = []
        hook = layers[2].experts.register_forward_pre_hook(
            lambda module, args: seen.append(module.down_proj.data_ptr())
        )
        run_stack(layers, torch.randn(1, H))
        hook.remove()
        after = [
            (b.experts.gate_up_proj.data_ptr(), b.experts.down_proj.data_ptr()) for b in layers
        ]
        stats = offloader.stats()
    finally:
        offloader.detach()
    assert stats.expert_host == 3 * TOP and after == slot
    assert seen and seen[0] != slot[2][1]  # the call itself read host memory


class RouterAsideBlock(ChosenBlock):
    """A ChosenBlock with a router that does not decide its routing: its predictions are
    wrong where the last routing (always the same experts) is right."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)


def test_a_layer_acts_on_whichever_prediction_is_right_more_often() -> None:
    """Layers routing to the same experts every pass whatever their routers say: the router's
    prediction (pre-gating) is mostly wrong, the last routing always right, so after the first
    passes layers 2 and 3 act on the last routing and find their experts copied ahead; the
    totals count the prediction acted on."""
    torch.manual_seed(0)
    layers = [RouterAsideBlock() for _ in range(4)]
    stats = _three_offloaded(layers, 1, [torch.randn(1, H) for _ in range(8)])
    hits = {index: found for index, found, _, _ in stats.expert_layers}
    assert hits[2] >= 6 * TOP and hits[3] >= 6 * TOP, hits
    assert stats.expert_predicted_correct >= 0.75 * stats.expert_predicted


def test_a_router_that_fails_leaves_prediction_to_the_last_routing(caplog) -> None:
    """A layer's router that cannot be called on the layer before's input: pre-gating stops
    for that layer, said in a warning that names it; its experts are predicted from its last
    routing again (always the same experts here, so right after the first pass), and every
    output is the resident model's."""
    torch.manual_seed(0)
    layers = [UnusableRouterBlock() for _ in range(4)]
    with caplog.at_level("WARNING", logger="offload.prefetch"):
        stats = _three_offloaded(layers, 1, [torch.randn(1, H) for _ in range(6)])
    assert "pre-gating of 2.experts off: its router failed" in caplog.text
    # the last routing predicted layers 1-3 from the second pass on, rightly
    assert stats.expert_predicted == stats.expert_predicted_correct == 5 * 3 * TOP
    assert stats.expert_prefetched > 0


def _routed_run(routes: list[list[int]], cache: int, rows: int = 1):
    """Three offloaded layers sharing one slot, their experts routed (with an expert cache of
    `cache` rows each); one pass per route (`rows` rows, each routed to it), outputs against
    the resident model's; the offloader's stats, its copied bytes checked against them."""
    torch.manual_seed(0)
    layers = [ChosenBlock() for _ in range(4)]
    resident = [ChosenBlock() for _ in range(4)]
    for a, b in zip(resident, layers, strict=True):
        a.load_state_dict(b.state_dict())
    x = torch.randn(rows, H)
    offloader = PrefetchOffloader(
        OffloadConfig(
            backend="prefetch",
            layers=(1, 2, 3),
            prefetch_step=1,
            param_filter=r"experts\.",
            routed_experts=True,
            expert_cache=cache,
        ),
        device="cpu",
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        for route in routes:
            ChosenBlock.route = torch.tensor(route)
            assert torch.equal(run_stack(layers, x), run_stack(resident, x)), route
            for block in layers:  # a call's view of its cache is undone after it
                assert block.experts.num_experts == E
                assert block.experts.gate_up_proj.shape[0] == E
        stats = offloader.stats()
    finally:
        offloader.detach()
        ChosenBlock.route = torch.tensor([0, 1])
    for a, b in zip(resident, layers, strict=True):  # detach restored the weights
        assert torch.equal(a.experts.down_proj, b.experts.down_proj)
    per_expert = (2 * INNER * H + H * INNER) * 4
    assert stats.copied_bytes == (stats.expert_misses + stats.expert_prefetched) * per_expert
    # per layer: the offloaded ones, whose counts add up to the totals (only experts cross)
    assert [counts[0] for counts in stats.expert_layers] == [1, 2, 3]
    assert sum(counts[1] for counts in stats.expert_layers) == stats.expert_hits
    assert sum(counts[2] for counts in stats.expert_layers) == stats.expert_misses
    assert sum(counts[3] for counts in stats.expert_layers) == stats.copied_bytes
    return stats


def test_cached_experts_stay_on_the_device_while_the_slot_takes_other_layers(
    monkeypatch,
) -> None:
    """One slot for three offloaded layers: without a cache (or prediction) every pass
    fetches each layer's two experts again; with a cache of three rows the first pass fetches
    them and the others find them (hits), the outputs the resident model's; the cache's rows
    and its scratch are device bytes."""
    import offload.prefetch as prefetch

    monkeypatch.setattr(prefetch, "PREDICT_ACCURACY", 2.0)  # the plain run predicts nothing
    routes = [[0, 1]] * 4
    plain = _routed_run(routes, cache=0)
    cached = _routed_run(routes, cache=3)
    assert plain.expert_misses == 4 * 3 * 2
    assert cached.expert_misses == 3 * 2 and cached.expert_hits == 3 * 3 * 2
    row = (2 * INNER * H + H * INNER) * 4
    assert cached.buffer_bytes - plain.buffer_bytes == 3 * 3 * row + 3 * row


def test_the_cache_evicts_the_least_used_expert_the_call_does_not_route_to() -> None:
    """Three rows, per layer: [0, 1] fetched, then found; [2, 3] takes the free row and
    evicts 0 (0 and 1 used alike: the lower number goes first); [0, 1] finds 1, fetches 0
    into the row of 2 (2 and 3 used once, 2 the lower). Each step's outputs are the resident
    model's."""
    stats = _routed_run([[0, 1], [0, 1], [2, 3], [0, 1]], cache=3)
    # per layer: 2 misses, 2 hits, 2 misses ([2, 3]: one free row, one evicted), 1 miss
    assert (stats.expert_misses, stats.expert_hits) == (3 * 5, 3 * 3)


def test_a_call_routing_to_more_experts_than_the_cache_holds_uses_the_slot() -> None:
    """Two rows routed to four distinct experts with a cache of three: the call runs on its
    layer's slot, the same numbers; the next call of two experts runs on the cache again."""
    stats = _routed_run([[0, 1, 2, 3], [0, 1]], cache=3)
    assert stats.expert_hits + stats.expert_misses == 3 * (4 + 2)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_experts_give_transformers_logits(moe, family: str, dtype: str, monkeypatch) -> None:
    """Three layers' experts offloaded and fetched by routing with caches of 2k rows (what two
    tokens route to at most): two-token inputs run on the cache (renumbered routing, gathered
    weights), an 8-token prompt that routes to more experts on the slot; every logit bitwise
    transformers', and the second pass over the same tokens finds their experts cached."""
    index = moe(family, dtype)
    names = [layer.name for layer in index.layers]
    by_name = {layer.name: layer for layer in index.layers}
    moved = tuple(n for n in MOVED if by_name[n].unit_bytes("experts"))
    top = max(by_name[n].experts_per_token for n in moved)
    generator = torch.Generator().manual_seed(9)
    pair = torch.randint(2, VOCAB, (1, 2), generator=generator)
    prompt = torch.randint(2, VOCAB, (1, 8), generator=generator)
    calls = []
    original = PrefetchOffloader._from_cache

    def from_cache(self, layer, entry, cache, wanted, args, kwargs):
        calls.append(len(wanted))
        return original(self, layer, entry, cache, wanted, args, kwargs)

    monkeypatch.setattr(PrefetchOffloader, "_from_cache", from_cache)
    pipeline = Pipeline(
        index,
        [names[:3], names[3:]],
        offloaded=moved,
        unit="experts",
        expert_fetch="routed",
        expert_cache=2 * top,
    )
    try:
        outs = [pipeline(pair), pipeline(prompt), pipeline(pair)]
        stats = [worker.report().stats for worker in pipeline.workers]
    finally:
        pipeline.close()
    for ids, out in zip([pair, prompt, pair], outs, strict=True):
        assert torch.equal(out, reference(index, ids)), family
    # both pairs ran on the caches (every moved layer, each time)
    assert len(calls) >= 2 * len(moved) and max(calls) <= 2 * top
    # the last pass's experts were cached by the first (a cache of 2k rows holds them all)
    assert sum(s.expert_hits for s in stats) >= len(moved) * top
