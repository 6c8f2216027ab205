"""Planner tests: exactness against a brute force on small instances, plan invariants, JSON,
the summary, error messages and option validation. Pure Python, no Ray."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.planning.formats import layer_range
from coordinator.planning.planner import Plan, PlanError, PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from worker.spec import LayerSpec, TensorSlice

GiB = 1 << 30
KNOB_WORDS = ("add GPUs", "--gpu-memory", "host budget", "--prefetch-step", "--reserve")


def layer(name: str, kind: str, nbytes: int, mlp: int | None = None) -> LayerSpec:
    """A layer of two fake U8 tensors (so byte sizes are exact) adding up to `nbytes`; with
    `mlp`, a decoder's second tensor is its MLP of that many bytes (an offload unit)."""
    half = nbytes // 2 if mlp is None else nbytes - mlp
    index = int(name.rsplit(".", 1)[1]) if kind == "decoder" else None
    parts = ("w0", "w1") if mlp is None else ("self_attn.w", "mlp.w")
    tensors = tuple(
        TensorSlice(
            name=f"{name}.{part}",
            dtype="U8",
            shape=(n,),
            file="x.safetensors",
            start=0,
            end=n,
            target=f"model.{name}.{part}",
        )
        for part, n in zip(parts, (half, nbytes - half), strict=True)
    )
    return LayerSpec(name=name, kind=kind, index=index, tensors=tensors)


def model(
    decoders: list[int],
    embed: int | None = None,
    head: int | None = None,
    mlps: list[int] | None = None,
) -> list[LayerSpec]:
    """Decoder layers of these sizes (with `mlps`: of which each layer's MLP, an offload unit,
    takes that many bytes), and an embedding and a head when given."""
    layers = [layer("embed", "embed", embed)] if embed is not None else []
    layers += [
        layer(f"layers.{i}", "decoder", n, None if mlps is None else mlps[i])
        for i, n in enumerate(decoders)
    ]
    return layers + ([layer("head", "head", head)] if head is not None else [])


def cluster(*nodes: dict) -> ClusterSnapshot:
    """cluster({"gpus": [40, 40], "host": 100}, ...): one dict per node."""
    return ClusterSnapshot(
        nodes=tuple(
            NodeInfo(
                node_id=f"node{n}",
                hostname=f"host{n}",
                gpus=tuple(GpuInfo(index=i, memory_bytes=m) for i, m in enumerate(spec["gpus"])),
                host_budget_bytes=spec.get("host", 0),
                pinned_budget_bytes=spec.get("pinned", 0),
                pin=spec.get("pin", False),
                link_bytes_per_s=spec.get("link"),
                compute_bytes_per_s=spec.get("compute"),
                backend=spec.get("backend", "prefetch"),
            )
            for n, spec in enumerate(nodes)
        )
    )


# -- the brute force: every split over the GPUs (empty ranges = skipped GPUs), every subset of
# decoder layers offloaded; the same cost model, written out independently of the planner.
# A prefetching GPU holds prefetch_step slots of its largest offloaded layer, a UVA GPU none.


def slot_count(node: NodeInfo, opts: PlanOptions) -> int:
    return 0 if node.backend == "uva" else opts.prefetch_step


def feasible_stage_times(layers: list[LayerSpec], snap: ClusterSnapshot, opts: PlanOptions):
    """Every placement that fits: the stage times, in pipeline order, of each."""
    decoders = [i for i, x in enumerate(layers) if x.kind == "decoder"]
    gpus = [(n, node, g) for n, node in enumerate(snap.nodes) for g in node.gpus]
    # each stage offloads its layers whole or, where the layers have one, their MLP
    units = ["layer", "mlp"] if any(layers[i].unit_bytes("mlp") for i in decoders) else ["layer"]
    # What does not depend on the placement, computed once (a layer's sizes are properties
    # computed from its tensors: read in every placement, they were most of the time here).
    sizes = [x.nbytes for x in layers]
    unit_sizes = {unit: [x.unit_bytes(unit) for x in layers] for unit in units}
    kv = [x.pool_bytes(opts.max_batch, opts.pool_tokens) for x in layers]  # never offloaded
    work = [0 if x.kind == "embed" else size for x, size in zip(layers, sizes, strict=True)]
    for cuts in itertools.combinations_with_replacement(range(len(layers) + 1), len(gpus) - 1):
        bounds = (0, *cuts, len(layers))
        for mask in range(1 << len(decoders)):
            moved = {d for j, d in enumerate(decoders) if mask >> j & 1}
            moving = [k for k in range(len(gpus)) if moved & set(range(*bounds[k : k + 2]))]
            for chosen in itertools.product(units, repeat=len(moving)):
                per_stage = dict.fromkeys(range(len(gpus)), "layer") | dict(
                    zip(moving, chosen, strict=True)
                )
                yield from _stage_times(
                    snap, opts, gpus, sizes, unit_sizes, kv, work, bounds, moved, per_stage
                )


def _stage_times(snap, opts, gpus, sizes, unit_sizes, kv, work, bounds, moved, per_stage):
    """The stage times of one placement (GPU k runs [bounds[k], bounds[k+1]), offloading the
    `per_stage[k]` unit of its `moved` layers), if it fits. `sizes`, `unit_sizes[unit]`, `kv`
    and `work` are each layer's bytes, offloaded bytes per unit, KV pool bytes and bytes of
    compute (none for the embedding: a lookup)."""
    host = [0] * len(snap.nodes)
    times = []
    for k, (n, node, gpu) in enumerate(gpus):
        stage = range(bounds[k], bounds[k + 1])
        if not stage:
            continue
        weights = sum(sizes[i] for i in stage)
        off = [unit_sizes[per_stage[k]][i] for i in stage if i in moved]
        slots = min(slot_count(node, opts), len(off)) * max(off, default=0)
        cache = sum(kv[i] for i in stage)
        if weights - sum(off) + slots + cache + opts.reserve_bytes > gpu.memory_bytes:
            return
        host[n] += sum(off)
        link = node.link_bytes_per_s or opts.default_link_bytes_per_s
        rate = node.compute_bytes_per_s or opts.compute_bytes_per_s
        times.append(max(sum(work[i] for i in stage) / rate, sum(off) / link))
    if all(h <= node.offload_budget_bytes for h, node in zip(host, snap.nodes, strict=True)):
        yield times


def brute_force(layers: list[LayerSpec], snap: ClusterSnapshot, opts: PlanOptions) -> float | None:
    return min((max(t) for t in feasible_stage_times(layers, snap, opts)), default=None)


def check_invariants(result: Plan, layers: list[LayerSpec], snap: ClusterSnapshot) -> None:
    opts = result.options
    by_name = {x.name: x for x in layers}
    assert [n for s in result.stages for n in s.layers] == [x.name for x in layers]
    assert result.stages[0].layers[0] == layers[0].name  # embed (if any) with the first stage
    assert result.stages[-1].layers[-1] == layers[-1].name  # head (if any) with the last
    order = [(n.node_id, g.index) for n in snap.nodes for g in n.gpus]
    used = [order.index((s.node_id, s.gpu_index)) for s in result.stages]
    assert used == sorted(set(used)), "GPUs in pipeline order, each at most once"
    host: dict[str, int] = {}
    for i, s in enumerate(result.stages):
        node = next(n for n in snap.nodes if n.node_id == s.node_id)
        gpu = next(g for g in node.gpus if g.index == s.gpu_index)
        assert s.stage == i and s.layers and s.hostname == node.hostname and s.pinned == node.pin
        assert set(s.offloaded) <= {n for n in s.layers if by_name[n].kind == "decoder"}
        assert list(s.offloaded) == [n for n in s.layers if n in s.offloaded]
        off = [by_name[n].unit_bytes(s.offload_unit) for n in s.offloaded]
        assert all(off) and (s.offload_unit == "layer" or s.offloaded)
        weights = sum(by_name[n].nbytes for n in s.layers)
        assert s.offloaded_bytes == sum(off) and s.resident_bytes == weights - sum(off)
        assert (s.backend, s.prefetch_step) == (node.backend, slot_count(node, opts))
        assert s.slot_bytes == min(s.prefetch_step, len(off)) * max(off, default=0)
        kv = sum(by_name[n].pool_bytes(opts.max_batch, opts.pool_tokens) for n in s.layers)
        assert s.kv_bytes == kv
        assert s.device_bytes == s.resident_bytes + s.slot_bytes + kv + opts.reserve_bytes
        assert s.device_bytes <= gpu.memory_bytes
        link = node.link_bytes_per_s or opts.default_link_bytes_per_s
        assert s.compute_bytes_per_s == node.compute_bytes_per_s
        work = sum(by_name[n].nbytes for n in s.layers if by_name[n].kind != "embed")
        assert s.compute_s == work / (node.compute_bytes_per_s or opts.compute_bytes_per_s)
        assert s.transfer_s == s.offloaded_bytes / link
        assert s.time_s == max(s.compute_s, s.transfer_s)
        host[s.node_id] = host.get(s.node_id, 0) + s.offloaded_bytes
    for node in snap.nodes:
        assert host.get(node.node_id, 0) <= node.offload_budget_bytes
    assert result.bottleneck_s == max(s.time_s for s in result.stages)
    assert result.total_bytes == sum(x.nbytes for x in layers)
    assert Plan.from_json(result.to_json()) == result


@st.composite
def instances(draw, max_gpus: int = 4):
    """Up to 7 layers on up to 4 GPUs of up to 2 nodes. Devices are mostly tight and host
    budgets small, so that offloading and the node budgets matter. With `big`, every size gets
    a 10**12 offset: stage times of different plans then differ by a part in 10**12, which
    only an exact search over the floats tells apart."""
    big = draw(st.sampled_from([0, 0, 10**12]))
    pool = st.sampled_from([4, 6, 9]) if draw(st.booleans()) else st.integers(1, 30)
    decoders = draw(st.lists(pool, min_size=2, max_size=5))
    ends = st.none() | st.integers(1, 8)
    embed, head = draw(ends), draw(ends)
    # a third of the models have MLPs, an offload unit of a quarter to three quarters of a layer
    mlps = draw(st.sampled_from([None, None, [1, 2, 3]]))
    layers = model(
        [big + n for n in decoders],
        None if embed is None else big + embed,
        None if head is None else big + head,
        None if mlps is None else [(big + n) * draw(st.sampled_from(mlps)) // 4 for n in decoders],
    )
    kv_tokens = draw(st.sampled_from([0, 0, 1, 3]))  # KV cache of max_batch x kv_tokens
    if kv_tokens:  # decoder layers get KV caches
        layers = [
            dataclasses.replace(x, kv_bytes_per_token=draw(st.integers(1, 3)))
            if x.kind == "decoder"
            else x
            for x in layers
        ]
    sizes = [x.nbytes + x.kv_bytes(2, kv_tokens) for x in layers]
    num_nodes = draw(st.integers(1, 2))
    gpus_left = max_gpus
    nodes = []
    for n in range(num_nodes):
        count = draw(st.integers(1, gpus_left - (num_nodes - n - 1)))
        gpus_left -= count
        tight = st.integers(max(sizes), max(max(sizes), sum(sizes) // count))
        memory = st.one_of(tight, tight, tight, st.integers(1, max(sizes) * 3))
        budget = st.integers(0, sum(sizes) // 2)
        nodes.append(
            {
                "gpus": draw(st.lists(memory, min_size=count, max_size=count)),
                "host": draw(budget),
                "pinned": draw(budget),
                "pin": draw(st.booleans()),
                "link": draw(st.sampled_from([None, 1.0, 3.0, 10.0, 40.0])),
                # a node's measured compute rate (None: the options' default), nodes unalike
                "compute": draw(st.sampled_from([None, None, 2.0, 5.0])),
                "backend": draw(st.sampled_from(["prefetch", "prefetch", "uva"])),
            }
        )
    opts = PlanOptions(
        reserve_bytes=draw(st.sampled_from([0, 0, 1, 3])),
        prefetch_step=draw(st.sampled_from([1, 1, 2])),
        compute_bytes_per_s=draw(st.sampled_from([1.0, 3.0, 4.0, 10.0])),
        default_link_bytes_per_s=draw(st.sampled_from([0.5, 2.5, 20.0])),
        max_batch=draw(st.sampled_from([1, 2])) if kv_tokens else 0,
        max_seq_len=kv_tokens,
    )
    return layers, cluster(*nodes), opts


def assert_optimal(
    layers: list[LayerSpec], snap: ClusterSnapshot, opts: PlanOptions
) -> Plan | None:
    expected = brute_force(layers, snap, opts)
    if expected is None:
        with pytest.raises(PlanError):
            plan(layers, snap, opts)
        return None
    result = plan(layers, snap, opts)
    assert result.bottleneck_s == expected
    check_invariants(result, layers, snap)
    return result


FAST = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@FAST
@given(instances())
def test_matches_brute_force(instance) -> None:
    assert_optimal(*instance)


@settings(FAST, max_examples=150)
@given(
    decoders=st.lists(st.sampled_from([3, 5, 7, 8, 13, 21, 40]), min_size=2, max_size=10),
    fraction=st.floats(0.3, 1.0),
    host=st.integers(0, 200),
    step=st.integers(1, 3),
    link=st.sampled_from([1.0, 5.0, 20.0]),
    backend=st.sampled_from(["prefetch", "uva"]),
)
def test_one_gpu_offload_choice_is_optimal(decoders, fraction, host, step, link, backend) -> None:
    """One GPU, up to 10 decoders of mixed sizes: the offload subset (a knapsack) is exact,
    with prefetch slots and without them (uva)."""
    layers = model(decoders)
    memory = max(max(decoders), int(sum(decoders) * fraction))
    snap = cluster({"gpus": [memory], "host": host, "link": link, "backend": backend})
    assert_optimal(layers, snap, PlanOptions(prefetch_step=step, compute_bytes_per_s=10.0))


@settings(FAST, max_examples=100)
@given(
    extra=st.lists(st.integers(0, 1000), min_size=2, max_size=14),
    num_gpus=st.integers(2, 6),
    rate=st.sampled_from([1.0, 3.0, 200e9]),
)
def test_near_ties_resolved_exactly(extra, num_gpus, rate) -> None:
    """Layers of 10**12 + a few bytes on GPUs that hold everything: the best split (a linear
    partition, solved here by its textbook DP) differs from others by a part in 10**12."""
    sizes = [10**12 + e for e in extra]
    total = sum(sizes)
    best = [0.0] + [math.inf] * len(sizes)  # best[i]: layers [0, i) on the GPUs so far
    for _ in range(num_gpus):
        best = [
            min(max(best[k], (sum(sizes[k:i]) / rate) if i > k else 0.0) for k in range(i + 1))
            for i in range(len(sizes) + 1)
        ]
    result = plan(
        model(sizes), cluster({"gpus": [total] * num_gpus}), PlanOptions(compute_bytes_per_s=rate)
    )
    assert result.bottleneck_s == best[-1]


# Found by a search for cases where placing GPU by GPU, each taking all it can within the
# node's remaining budget, is infeasible or slower than the optimum.
COUPLED = [
    ([20, 10, 10, 10, 5], [20, 20], 30),
    ([20, 5, 10, 5, 10, 5], [20, 20], 30),
    ([20, 10, 20, 20, 10, 10], [20, 50], 40),
    ([20, 5, 20, 20, 5], [20, 40], 40),
    ([20, 10, 10, 10, 5], [20, 20], 40),
    ([20, 10, 5, 10, 5, 20], [20, 30], 40),
    ([10, 10, 20, 10, 20, 5], [40, 20], 40),
]


@pytest.mark.parametrize(("decoders", "memory", "host"), COUPLED)
def test_host_budget_couples_the_gpus_of_a_node(decoders, memory, host) -> None:
    layers = model(decoders)
    snap = cluster({"gpus": memory, "host": host})
    assert assert_optimal(
        layers, snap, PlanOptions(compute_bytes_per_s=1.0, default_link_bytes_per_s=1.0)
    )


def test_budget_goes_to_the_gpu_that_needs_it() -> None:
    """Greedy GPU by GPU, GPU 0 would take layers 0-1 by offloading both (30 bytes: all of the
    node's budget), and GPU 1 could then hold only 20 of the remaining 25 bytes. The exact plan
    keeps GPU 0 resident and lets GPU 1 offload 25 bytes instead."""
    layers = model([20, 10, 10, 10, 5])
    snap = cluster({"gpus": [20, 20], "host": 30})
    result = assert_optimal(layers, snap, PlanOptions(compute_bytes_per_s=1.0))
    assert result is not None and result.bottleneck_s == 35.0
    assert [s.offloaded_bytes for s in result.stages] == [0, 25]


def test_balanced_split_without_offload() -> None:
    layers = model([10] * 8, embed=5, head=5)
    snap = cluster({"gpus": [100] * 4, "host": 0}, {"gpus": [100] * 4, "host": 0})
    result = plan(layers, snap, PlanOptions(compute_bytes_per_s=10.0))
    assert result.bottleneck_s == 1.5  # 15 bytes per stage: the best of 90 bytes over 8 GPUs
    assert all(not s.offloaded for s in result.stages)
    check_invariants(result, layers, snap)


def test_a_gpu_that_holds_nothing_is_skipped() -> None:
    layers = model([10] * 4)
    snap = cluster({"gpus": [25, 5, 25], "host": 0})
    result = assert_optimal(layers, snap, PlanOptions(reserve_bytes=5, compute_bytes_per_s=1.0))
    assert result is not None and [s.gpu_index for s in result.stages] == [0, 2]


def test_offloaded_layers_are_spread_and_use_default_link() -> None:
    layers = model([10] * 10)
    snap = cluster({"gpus": [70], "host": 1000})  # 100 bytes: offload 4, one slot of 10
    result = plan(layers, snap, PlanOptions(compute_bytes_per_s=1.0, default_link_bytes_per_s=2.0))
    (stage,) = result.stages
    assert len(stage.offloaded) == 4 and stage.slot_bytes == 10 and stage.device_bytes == 70
    indices = [int(n.split(".")[1]) for n in stage.offloaded]
    assert min(b - a for a, b in itertools.pairwise(indices)) >= 2  # never back to back
    assert stage.transfer_s == 40 / 2.0


def test_a_uva_gpu_offloads_only_its_deficit() -> None:
    """The same 100 bytes on a 70-byte GPU: prefetch must free 30 bytes plus a 10-byte slot
    (4 layers offloaded), UVA reads offloaded layers in place (3 layers, no slot)."""
    layers = model([10] * 10)
    options = PlanOptions(compute_bytes_per_s=1.0, default_link_bytes_per_s=2.0)
    prefetch = plan(layers, cluster({"gpus": [70], "host": 1000}), options).stages[0]
    uva = plan(layers, cluster({"gpus": [70], "host": 1000, "backend": "uva"}), options).stages[0]
    assert (len(prefetch.offloaded), prefetch.slot_bytes, prefetch.backend) == (4, 10, "prefetch")
    assert (len(uva.offloaded), uva.slot_bytes, uva.prefetch_step, uva.backend) == (3, 0, 0, "uva")
    assert uva.device_bytes == 70 and uva.transfer_s == 30 / 2.0
    assert (
        "uva"
        in plan(layers, cluster({"gpus": [70], "host": 1000, "backend": "uva"}), options).summary()
    )


def test_a_uva_gpu_smaller_than_a_layer_still_runs_it() -> None:
    """A decoder layer larger than the GPU: refused with prefetch (its slot cannot fit), placed
    with UVA (read in place), and the mixed cluster puts the decoders on the UVA node."""
    layers = model([50, 50], embed=5, head=5)
    with pytest.raises(PlanError, match="needs a device slot of its size"):
        plan(layers, cluster({"gpus": [40], "host": 1000}), PlanOptions())
    result = assert_optimal(
        layers, cluster({"gpus": [40], "host": 1000, "backend": "uva"}), PlanOptions()
    )
    assert result is not None and result.stages[0].offloaded == ("layers.0", "layers.1")
    mixed = cluster({"gpus": [40], "host": 1000}, {"gpus": [40], "host": 1000, "backend": "uva"})
    result = assert_optimal(layers, mixed, PlanOptions())
    assert result is not None
    assert {s.backend for s in result.stages if s.offloaded} == {"uva"}


def test_measured_link_rate_sets_transfer_time() -> None:
    """The same offloaded bytes take longer on a node whose measured link is slower; the rate
    used is recorded in the stage."""
    layers = model([10] * 10)
    opts = PlanOptions(compute_bytes_per_s=1e9, default_link_bytes_per_s=2.0)
    stages = {
        link: plan(layers, cluster({"gpus": [70], "host": 1000, "link": link}), opts).stages[0]
        for link in (None, 4.0, 8.0)
    }
    assert {s.offloaded_bytes for s in stages.values()} == {40}  # what fits decides the bytes
    assert {link: s.transfer_s for link, s in stages.items()} == {None: 20.0, 4.0: 10.0, 8.0: 5.0}
    assert {link: s.link_bytes_per_s for link, s in stages.items()} == {
        None: None,
        4.0: 4.0,
        8.0: 8.0,
    }


def test_json_without_link_rate_still_loads() -> None:
    """Plans saved before the link was measured (a named load's record) have no link field."""
    result = plan(model([10] * 4), cluster({"gpus": [100], "host": 0, "link": 4.0}))
    data = json.loads(result.to_json())
    for stage in data["stages"]:
        del stage["link_bytes_per_s"]
    old = Plan.from_json(json.dumps(data))
    assert old.stages[0].link_bytes_per_s is None
    assert old == dataclasses.replace(
        result, stages=tuple(dataclasses.replace(s, link_bytes_per_s=None) for s in result.stages)
    )


def test_pinned_node_uses_the_smaller_budget() -> None:
    layers = model([10] * 4)
    opts = PlanOptions(compute_bytes_per_s=1e9)
    with pytest.raises(PlanError):  # needs 30 bytes offloaded (k - p = 2 layers with p = 1)
        plan(layers, cluster({"gpus": [20], "host": 100, "pinned": 20, "pin": True}), opts)
    result = plan(layers, cluster({"gpus": [20], "host": 100, "pinned": 30, "pin": True}), opts)
    assert result.stages[0].pinned and result.stages[0].offloaded_bytes == 30


def test_json_round_trip_and_summary() -> None:
    layers = model([GiB // 4] * 12, embed=GiB // 2, head=GiB // 2)
    snap = cluster(
        {"gpus": [GiB, 2 * GiB], "host": 4 * GiB, "link": 12.5e9}, {"gpus": [GiB], "host": 0}
    )
    result = plan(layers, snap, PlanOptions(reserve_bytes=64 << 20, prefetch_step=2))
    assert Plan.from_json(result.to_json()) == result
    text = result.summary()
    for s in result.stages:
        assert f"{s.hostname} ({s.node_id[:8]})" in text and layer_range(s.layers) in text
        # each stage's row shows the link rate its transfer time used; unmeasured: the default
        link = "12.5 GB/s" if s.node_id == "node0" else "25.0 GB/s (default)"
        row = next(line for line in text.splitlines() if line.startswith(f"{s.stage} "))
        assert link in row, (link, row)
    assert text.count("<- bottleneck") == 1 and "GiB" in text and "MiB" in text


def test_layer_range() -> None:
    assert layer_range(["embed", *(f"layers.{i}" for i in range(6))]) == "embed,layers.0-5"
    assert layer_range(["layers.7"]) == "layers.7"
    assert layer_range(["layers.30", "layers.31", "head"]) == "layers.30-31,head"


def test_error_when_a_layer_fits_no_gpu() -> None:
    layers = model([10, 10], embed=50, head=5)
    with pytest.raises(PlanError) as err:
        plan(layers, cluster({"gpus": [40, 30], "host": 1000}), PlanOptions(reserve_bytes=2))
    msg = str(err.value)
    assert "'embed'" in msg and "52" in msg and "40" in msg and "node0" in msg
    assert "--gpu-memory" in msg and "reserve_bytes" in msg


def test_error_when_the_host_budget_is_too_small() -> None:
    layers = model([10] * 10)
    with pytest.raises(PlanError) as err:
        plan(layers, cluster({"gpus": [50], "host": 20}), PlanOptions())
    msg = str(err.value)
    assert "100" in msg and "50" in msg and "20" in msg  # needed, GPU and host bytes
    assert all(word in msg for word in KNOB_WORDS)
    assert isinstance(err.value, ValueError)


def test_error_on_bad_inputs() -> None:
    snap = cluster({"gpus": [100]})
    with pytest.raises(PlanError, match="no layers"):
        plan([], snap)
    with pytest.raises(PlanError, match="no GPUs"):
        plan(model([1]), cluster({"gpus": []}))
    with pytest.raises(PlanError, match="position"):
        plan([*model([1]), layer("embed", "embed", 1)], snap)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reserve_bytes", -1),
        ("reserve_bytes", 1.5),
        ("prefetch_step", 0),
        ("prefetch_step", 65),
        ("prefetch_step", True),
        ("compute_bytes_per_s", 0.0),
        ("compute_bytes_per_s", float("inf")),
        ("default_link_bytes_per_s", -1.0),
        ("default_link_bytes_per_s", float("nan")),
        ("resident_weights", "fp4"),
    ],
)
def test_invalid_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"PlanOptions.{field}={value!r}"):
        PlanOptions(**{field: value})


def large_cluster() -> ClusterSnapshot:
    """64 nodes x 8 GPUs of 8 or 6 GiB, host budgets of 8 to 32 GiB, a third with a measured
    link: the planner's speed case."""
    return cluster(
        *(
            {
                "gpus": [8 * GiB, 6 * GiB] * 4,
                "host": (n % 4 + 1) * 8 * GiB,
                "link": 50e9 if n % 3 == 0 else None,
            }
            for n in range(64)
        )
    )


def test_thousand_layers_on_512_gpus() -> None:
    """64 nodes x 8 GPUs of 8 or 6 GiB hold 768 of 1,000 layers of 3 GiB: ~700 GiB must be
    offloaded, under host budgets of 8 to 32 GiB per node, several of which bind. Its time:
    bench/planner.py (target < 1 s), not a timed test."""
    layers = model([3 * GiB] * 1000, embed=4 * GiB, head=4 * GiB)
    snap = large_cluster()
    result = plan(layers, snap, PlanOptions(reserve_bytes=GiB // 2))
    check_invariants(result, layers, snap)
    assert sum(s.offloaded_bytes for s in result.stages) >= 232 * 3 * GiB


def test_a_faster_node_takes_more_layers() -> None:
    """Nodes with measured compute rates: the plan balances stage times, not bytes. Four equal
    layers on two nodes, one three times as fast: it takes three of them."""
    layers = model([10, 10, 10, 10])
    snap = cluster({"gpus": [100], "compute": 3.0}, {"gpus": [100], "compute": 1.0})
    result = assert_optimal(layers, snap, PlanOptions(compute_bytes_per_s=1.0))
    assert [len(s.layers) for s in result.stages] == [3, 1]
    assert result.bottleneck_s == 10.0
    rows = result.summary().splitlines()[2:]
    assert "3.0 B/s" in rows[0] and "1.0 B/s" in rows[1]
    with pytest.raises(PlanError, match=r"compute_bytes_per_s=0.0 must be a finite number"):
        plan(layers, cluster({"gpus": [100], "compute": 0.0}), PlanOptions())


def test_a_stage_offloads_mlps_when_that_moves_fewer_bytes() -> None:
    """Four layers of 100 bytes whose MLPs are 75, on a GPU 50 bytes short: whole layers need
    two moved (200 bytes, one 100-byte slot), MLPs two of 75 (150 bytes, a 75-byte slot)."""
    layers = model([100] * 4, mlps=[75] * 4)
    snap = cluster({"gpus": [350], "host": 1000})
    result = assert_optimal(layers, snap, PlanOptions(compute_bytes_per_s=1000.0))
    (stage,) = result.stages
    assert (stage.offload_unit, len(stage.offloaded), stage.offloaded_bytes) == ("mlp", 2, 150)
    assert (stage.slot_bytes, stage.resident_bytes) == (75, 250)
    assert "150 B (2 x mlp)" in result.summary()
    whole = plan(model([100] * 4), snap, PlanOptions(compute_bytes_per_s=1000.0))
    assert (whole.stages[0].offload_unit, whole.stages[0].offloaded_bytes) == ("layer", 200)
