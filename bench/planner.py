"""How fast the planner is, and how its plans compare with Hugging Face Accelerate's.

1. Planning time: `plan()` for 1,000 decoder layers on 64 nodes x 8 GPUs (512 GPUs), median
   of --repeats runs, for a model that fits resident and for one that must offload under
   heterogeneous GPUs, links and host budgets (some of which bind); and the throughput
   objective's `choose()` (every batch and micro-batch count planned or bounded) on the
   offloading case with KV caches and each decoder's MLP an offload unit of its own.
   Target: < 1 s each. (The tests check these plans' invariants, not their time.)
2. Plan quality: a Llama-like model built on the meta device with transformers, three GPUs of
   different sizes plus CPU overflow. Accelerate's `infer_auto_device_map` and our planner get
   the same layers, the same per-GPU byte budgets and the same host budget; both placements
   are then timed under OUR cost model (stage time = max(weight bytes / compute rate,
   offloaded bytes / link rate), bottleneck = slowest stage).
   Convention for Accelerate's map: modules on GPU i form stage i; modules on "cpu" or "disk"
   are offloaded weights of the stage that runs them, which under `dispatch_model` is the
   main device (the first GPU in the map): their bytes count in that stage's compute and
   transfer. Embedding = model.embed_tokens; head = model.norm + lm_head.

Needs `accelerate` (not a dependency of the package: `pip install accelerate`).

    python bench/planner.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.planning.formats import format_bytes, format_seconds
from coordinator.planning.planner import Plan, PlanOptions, plan
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.planning.throughput import choose
from worker.spec import LayerSpec, TensorSlice

GiB, MiB = 1 << 30, 1 << 20


def synthetic_layer(name: str, kind: str, nbytes: int) -> LayerSpec:
    index = int(name.split(".")[1]) if kind == "decoder" else None
    tensor = TensorSlice(
        name=f"{name}.weight", dtype="BF16", shape=(nbytes // 2,), file="x", start=0, end=nbytes
    )
    return LayerSpec(name=name, kind=kind, index=index, tensors=(tensor,))


def synthetic_model(num_layers: int, layer_bytes: int, end_bytes: int) -> list[LayerSpec]:
    return [
        synthetic_layer("embed", "embed", end_bytes),
        *(synthetic_layer(f"layers.{i}", "decoder", layer_bytes) for i in range(num_layers)),
        synthetic_layer("head", "head", end_bytes),
    ]


def with_mlps(layers: list[LayerSpec], mlp_bytes: int, kv_per_token: int) -> list[LayerSpec]:
    """Each decoder split into attention and an MLP of `mlp_bytes` (an offload unit of its
    own), with `kv_per_token` bytes of KV cache per token."""
    out = []
    for x in layers:
        if x.kind != "decoder":
            out.append(x)
            continue
        tensors = tuple(
            TensorSlice(
                name=f"{x.name}.{part}.weight",
                dtype="BF16",
                shape=(n // 2,),
                file="x",
                start=0,
                end=n,
                target=f"model.{x.name}.{part}.weight",
            )
            for part, n in (("self_attn", x.nbytes - mlp_bytes), ("mlp", mlp_bytes))
        )
        out.append(replace(x, tensors=tensors, kv_bytes_per_token=kv_per_token))
    return out


def big_cluster(gpu_bytes, host_bytes=lambda n: 0, link=lambda n: None) -> ClusterSnapshot:
    """64 nodes x 8 GPUs; GPU g's memory, node n's host budget and link from the functions."""
    return ClusterSnapshot(
        nodes=tuple(
            NodeInfo(
                node_id=f"n{n}",
                gpus=tuple(GpuInfo(index=g, memory_bytes=gpu_bytes(g)) for g in range(8)),
                host_budget_bytes=host_bytes(n),
                link_bytes_per_s=link(n),
            )
            for n in range(64)
        )
    )


def scale_scenarios() -> dict[str, tuple[list[LayerSpec], ClusterSnapshot, PlanOptions]]:
    """1,000 decoder layers x 64 nodes x 8 GPUs: resident, and offloading on mixed hardware."""
    resident = (
        synthetic_model(1000, 400 * MiB, 1 * GiB),
        big_cluster(lambda g: 80 * GiB),
        PlanOptions(reserve_bytes=4 * GiB),
    )
    # 3 GiB layers on 8 and 6 GiB GPUs: the GPUs hold 768 of the 1,000 layers resident, so at
    # least ~700 GiB must be offloaded; host budgets of 8 to 32 GiB per node (some bind),
    # links of 25 or 50 GB/s.
    offload = (
        synthetic_model(1000, 3 * GiB, 4 * GiB),
        big_cluster(
            lambda g: (6 if g % 2 else 8) * GiB,
            host_bytes=lambda n: (n % 4 + 1) * 8 * GiB,
            link=lambda n: 50e9 if n % 3 == 0 else None,
        ),
        PlanOptions(reserve_bytes=GiB // 2),
    )
    throughput = (
        with_mlps(offload[0], 2 * GiB, 256 * 1024),
        offload[1],
        PlanOptions(reserve_bytes=GiB // 2, max_seq_len=64),
    )
    return {"resident": resident, "offload": offload, "throughput": throughput}


def time_plans(repeats: int) -> list[dict]:
    rows = []
    for name, (layers, cluster, options) in scale_scenarios().items():
        times, result = [], None
        planner = choose if name == "throughput" else plan
        for _ in range(repeats):
            start = time.perf_counter()
            result = planner(layers, cluster, options)
            times.append(time.perf_counter() - start)
        assert result is not None
        rows.append(
            {
                "scenario": name,
                "num_layers": len(layers),
                "num_gpus": cluster.num_gpus,
                "median_s": statistics.median(times),
                "max_s": max(times),
                "num_stages": len(result.stages),
                "offloaded_bytes": sum(s.offloaded_bytes for s in result.stages),
                "bottleneck_s": result.bottleneck_s,
            }
        )
    return rows


# -- what the backend changes in a plan ---------------------------------------------------------


def backend_rows() -> list[dict]:
    """A Llama-3-70B-shaped model (80 decoder layers of 1.63 GiB bf16, embedding and head of
    1.96 GiB) on one 96 GB GPU (86 GiB planned, 4 GiB reserve), planned for the prefetch backend
    (2 slots of the largest offloaded layer) and for uva (read in place, no slots), over a
    GH200's NVLink-C2C (450 GB/s) and over PCIe 5 x16 (64 GB/s). Same layers, budgets and cost
    model: the difference is only the slots."""
    layers = synthetic_model(80, int(1.63 * GiB), int(1.96 * GiB))
    rows = []
    for link in (450e9, 64e9):
        for backend in ("prefetch", "uva"):
            cluster = ClusterSnapshot(
                nodes=(
                    NodeInfo(
                        node_id="gpu",
                        gpus=(GpuInfo(index=0, memory_bytes=86 * GiB),),
                        host_budget_bytes=400 * GiB,
                        link_bytes_per_s=link,
                        backend=backend,
                    ),
                )
            )
            result = plan(layers, cluster, PlanOptions(prefetch_step=2, reserve_bytes=4 * GiB))
            rows.append(
                {
                    "link_bytes_per_s": link,
                    "backend": backend,
                    "offloaded_bytes": sum(s.offloaded_bytes for s in result.stages),
                    "slot_bytes": sum(s.slot_bytes for s in result.stages),
                    "resident_bytes": sum(s.resident_bytes for s in result.stages),
                    "bottleneck_s": result.bottleneck_s,
                }
            )
    return rows


# -- plan quality against Accelerate --------------------------------------------------------------


def llama_on_meta(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.num_layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def unit_of(module_name: str) -> str:
    """Our layer name for an Accelerate module name."""
    if module_name.startswith("model.layers."):
        return "layers." + module_name.split(".")[2]
    if module_name.startswith("model.embed_tokens"):
        return "embed"
    return "head"  # model.norm, lm_head (model.rotary_emb has no parameters)


def layer_specs(model) -> list[LayerSpec]:
    tensors: dict[str, list[TensorSlice]] = defaultdict(list)
    offset = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        tensors[unit_of(name)].append(
            TensorSlice(
                name=name,
                dtype="BF16",
                shape=tuple(param.shape),
                file="meta",
                start=offset,
                end=offset + nbytes,
            )
        )
        offset += nbytes
    order = ["embed", *(f"layers.{i}" for i in range(model.config.num_hidden_layers)), "head"]
    kinds = {"embed": "embed", "head": "head"}
    return [
        LayerSpec(
            name=n,
            kind=kinds.get(n, "decoder"),
            index=None if n in kinds else int(n.split(".")[1]),
            tensors=tuple(tensors[n]),
        )
        for n in order
    ]


def accelerate_stages(
    device_map: dict, layers: list[LayerSpec], options: PlanOptions
) -> list[dict]:
    """Accelerate's placement as stages, timed with our cost model (convention: module doc)."""
    size = {layer.name: layer.nbytes for layer in layers}
    gpus = sorted({d for d in device_map.values() if isinstance(d, int)})
    on: dict[object, set[str]] = defaultdict(set)
    for module, device in device_map.items():
        if module == "model.rotary_emb":
            continue
        if module in ("model", ""):
            raise SystemExit("Accelerate put the whole model on one device; lower the budgets")
        on[device].add(unit_of(module))
    order = [layer.name for layer in layers]
    stages = []
    for gpu in gpus:
        names = [n for n in order if n in on[gpu]]
        offloaded = [n for n in order if n in on["cpu"] | on["disk"]] if gpu == gpus[0] else []
        weights = sum(size[n] for n in names + offloaded)
        moved = sum(size[n] for n in offloaded)
        compute_s = weights / options.compute_bytes_per_s
        transfer_s = moved / options.default_link_bytes_per_s
        stages.append(
            {
                "gpu": gpu,
                "layers": names,
                "offloaded": offloaded,
                "resident_bytes": weights - moved,
                "offloaded_bytes": moved,
                "compute_s": compute_s,
                "transfer_s": transfer_s,
                "time_s": max(compute_s, transfer_s),
            }
        )
    return stages


def compare_with_accelerate(args: argparse.Namespace) -> dict:
    from accelerate import infer_auto_device_map

    model = llama_on_meta(args)
    layers = layer_specs(model)
    budgets = [int(x * MiB) for x in args.gpu_mib]
    host = int(args.cpu_gib * GiB)
    options = PlanOptions()  # no reserve: Accelerate's max_memory is all weights too
    device_map = infer_auto_device_map(
        model,
        max_memory={**dict(enumerate(budgets)), "cpu": host},
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    theirs = accelerate_stages(dict(device_map), layers, options)
    cluster = ClusterSnapshot(
        nodes=(
            NodeInfo(
                node_id="node0",
                hostname="bench",
                gpus=tuple(GpuInfo(index=i, memory_bytes=b) for i, b in enumerate(budgets)),
                host_budget_bytes=host,
            ),
        )
    )
    ours = plan(layers, cluster, options)
    theirs_s = max(s["time_s"] for s in theirs)
    return {
        "model": f"Llama {args.num_layers} layers, hidden {args.hidden}, bf16",
        "total_bytes": sum(layer.nbytes for layer in layers),
        "gpu_budget_bytes": budgets,
        "cpu_budget_bytes": host,
        "compute_bytes_per_s": options.compute_bytes_per_s,
        "link_bytes_per_s": options.default_link_bytes_per_s,
        "ours": json.loads(ours.to_json()),
        "ours_summary": ours.summary(),
        "accelerate": theirs,
        "ours_bottleneck_s": ours.bottleneck_s,
        "accelerate_bottleneck_s": theirs_s,
        "accelerate_over_ours": theirs_s / ours.bottleneck_s,
    }


def print_comparison(result: dict, ours: Plan) -> None:
    from coordinator.planning.formats import layer_range

    print(
        f"\n{result['model']}: {format_bytes(result['total_bytes'])} of weights; GPU budgets "
        f"{', '.join(format_bytes(b) for b in result['gpu_budget_bytes'])}; CPU "
        f"{format_bytes(result['cpu_budget_bytes'])}; cost model: compute "
        f"{result['compute_bytes_per_s'] / 1e9:.0f} GB/s, link {result['link_bytes_per_s'] / 1e9:.0f} GB/s"
    )
    print(f"{'':<10} {'gpu':>3}  {'layers':<24} {'resident':>10} {'offloaded':>15} {'time':>11}")
    rows = [
        (
            "ours",
            s.gpu_index,
            layer_range(s.layers),
            s.resident_bytes,
            s.offloaded_bytes,
            len(s.offloaded),
            s.time_s,
        )
        for s in ours.stages
    ]
    rows += [
        (
            "accelerate",
            s["gpu"],
            layer_range(s["layers"]),
            s["resident_bytes"],
            s["offloaded_bytes"],
            len(s["offloaded"]),
            s["time_s"],
        )
        for s in result["accelerate"]
    ]
    for who, gpu, names, resident, moved, count, t in rows:
        print(
            f"{who:<10} {gpu:>3}  {names:<24} {format_bytes(resident):>10} "
            f"{format_bytes(moved) + f' ({count})':>15} {format_seconds(t):>11}"
        )
    print(
        f"bottleneck: ours {format_seconds(result['ours_bottleneck_s'])}, accelerate "
        f"{format_seconds(result['accelerate_bottleneck_s'])}: accelerate / ours = "
        f"{result['accelerate_over_ours']:.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="plan() runs per scenario")
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--gpu-mib", type=float, nargs="+", default=[1000, 700, 400])
    parser.add_argument("--cpu-gib", type=float, default=8)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    result: dict = {"plan_time": time_plans(args.repeats)}
    print(f"plan() time, median of {args.repeats}:")
    print(
        f"{'scenario':<10} {'layers':>6} {'gpus':>5} {'median':>9} {'max':>9} {'stages':>6} "
        f"{'offloaded':>11} {'bottleneck':>11}"
    )
    for r in result["plan_time"]:
        print(
            f"{r['scenario']:<10} {r['num_layers']:>6} {r['num_gpus']:>5} "
            f"{r['median_s'] * 1e3:>7.1f}ms {r['max_s'] * 1e3:>7.1f}ms {r['num_stages']:>6} "
            f"{format_bytes(r['offloaded_bytes']):>11} {format_seconds(r['bottleneck_s']):>11}"
        )

    result["backends"] = backend_rows()
    print("\nprefetch (2 slots) vs uva (none), Llama-70B shape on one 86 GiB GPU:")
    print(
        f"{'link':>9} {'backend':<8} {'offloaded':>11} {'slots':>10} {'resident':>11} "
        f"{'bottleneck':>11}"
    )
    for r in result["backends"]:
        link = f"{r['link_bytes_per_s'] / 1e9:.0f} GB/s"
        print(
            f"{link:>9} {r['backend']:<8} {format_bytes(r['offloaded_bytes']):>11} "
            f"{format_bytes(r['slot_bytes']):>10} {format_bytes(r['resident_bytes']):>11} "
            f"{format_seconds(r['bottleneck_s']):>11}"
        )

    try:
        import accelerate  # noqa: F401
    except ImportError:
        result["accelerate"] = "skipped: pip install accelerate"
        print(f"\naccelerate comparison {result['accelerate']}")
    else:
        comparison = compare_with_accelerate(args)
        ours = Plan.from_json(json.dumps(comparison["ours"]))
        print_comparison(comparison, ours)
        print("\nour plan:\n" + comparison.pop("ours_summary"))
        result["accelerate"] = comparison
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
