"""`offloadctl plan`: the placement plan for nodes like this machine, without Ray: this
machine's probe (its link rate, and its timing of the model's own decoder layer) stands for
every node, budgeted by the runtime's own function."""

from __future__ import annotations

import argparse
import dataclasses

from coordinator.config import ConfigError, JobConfig
from coordinator.planning.snapshot import ClusterSnapshot


def plan_cluster(
    config: JobConfig, result: dict, num_nodes: int, origins: dict[str, str] | None = None
) -> ClusterSnapshot:
    """`offloadctl plan`'s cluster: `num_nodes` nodes like this machine, as `probe_here()` saw
    it (`result`), with `config.gpus` GPUs each, budgeted by the runtime's own function (probing.py)."""
    from coordinator.planning.budgets import node_info

    return ClusterSnapshot(
        nodes=tuple(
            node_info(config, result, node_id=f"node-{n}", num_gpus=config.gpus, origins=origins)
            for n in range(num_nodes)
        )
    )


def cmd_plan(args: argparse.Namespace, job_config) -> int:
    """`offloadctl plan`: the plan on `args.nodes` nodes like this machine (no Ray), with the
    batch chosen when asked and the predicted tokens/s over batch sizes (text; a PNG with
    --plot)."""
    import socket

    from coordinator.config import node_env
    from coordinator.family_check import check_family
    from coordinator.planning.batch_size import plan_job, plan_replicas
    from coordinator.planning.checkpoint import load_index
    from coordinator.planning.context import check_max_seq_len
    from coordinator.planning.reserve import job_options
    from coordinator.planning.throughput import best_plans, curve_text
    from worker.node import probe_here

    config = job_config(args, throughput_defaults={"replicas": 0})
    if not config.gpus:
        raise ConfigError(f"plan without Ray needs --gpus (GPUs per node), got {config.gpus}")
    if args.plot and not config.max_seq_len:
        raise ConfigError(
            "--plot draws tokens/s over batch sizes, whose KV caches need "
            "--max-seq-len (tokens per sequence)"
        )
    index = load_index(config.checkpoint, dtype=config.dtype)
    check_max_seq_len(index.config, config.max_seq_len)
    check_family(index.config, attn_implementation=config.attn_implementation)  # as launch does
    # The job's overrides that match this machine (by hostname; `plan` knows no node labels
    # or ids), as the runtime gives them to each node's workers.
    env, origins = node_env(config.overrides, node_id="", hostname=socket.gethostname(), labels={})
    model = (index.config, index.dtype, config.cpus_per_worker)  # its decoder layer is timed
    cluster = plan_cluster(config, probe_here(env=env, model=model), args.nodes, origins)
    if config.replicas != 1:
        chosen = plan_replicas(config, index, cluster)
        if len(chosen.plans) > 1:
            if args.json:
                print("[" + ",\n".join(p.to_json() for p in chosen.plans) + "]")
            else:
                print(chosen.summary())
            return 0
        config = dataclasses.replace(config, replicas=1)  # one pipeline: as below
    sized, the_plan = plan_job(config, index, cluster)
    if args.json:
        print(the_plan.to_json())
        return 0
    print(the_plan.summary())
    for note in sorted({n.budget_note for n in cluster.nodes if n.budget_note}):
        print(f"budgets: {note}")
    if the_plan.pool_note:
        print(the_plan.pool_note)
    if config.max_batch == 0 or config.objective == "throughput":
        why = (
            "chosen for the most decode tokens/s"
            if config.objective == "throughput"
            else "the sequences the KV pool holds at the expected length"
        )
        print(f"max_batch {sized.max_batch}, micro-batches {sized.micro_batches or 'auto'}: {why}")
    if config.max_seq_len:
        curve = best_plans(
            index.layers,
            cluster,
            job_options(config, index, cluster),
            prune=False,
            max_token_latency_s=config.max_token_latency_s,
        )
        print(curve_text(curve))
        if args.plot:
            plot_curve(curve, the_plan, args.plot)
            print(f"wrote {args.plot}")
    return 0


def plot_curve(curve: dict, chosen, path: str) -> None:
    """Predicted decode tokens/s over max_batch (each at its best micro-batch count), the
    chosen plan marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(curve)
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        ax.plot(batches, [curve[b].tokens_per_s for b in batches], marker="o")
        ax.plot(
            [chosen.options.max_batch],
            [chosen.tokens_per_s],
            marker="*",
            markersize=16,
            linestyle="",
            label=f"plan: max_batch {chosen.options.max_batch}, "
            f"{chosen.options.micro_batches} micro-batch(es)",
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_batch (sequences decoding at once)")
        ax.set_ylabel("predicted decode tokens/s")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
