"""`offloadctl plan`: the placement plan for nodes like this machine, without Ray: this
machine's probe (its link rate, and its timing of the model's own decoder layer) stands for
every node, budgeted by the runtime's own function."""

from __future__ import annotations

import argparse

from coordinator.config import ConfigError, JobConfig
from coordinator.planning.snapshot import ClusterSnapshot


def plan_cluster(config: JobConfig, result: dict, num_nodes: int,
                 origins: dict[str, str] | None = None) -> ClusterSnapshot:  # fmt: skip
    """`offloadctl plan`'s cluster: `num_nodes` nodes like this machine, as `probe_here()` saw
    it (`result`), with `config.gpus` GPUs each, budgeted by the runtime's own function (probing.py)."""
    from coordinator.planning.budgets import node_info

    return ClusterSnapshot(nodes=tuple(
        node_info(config, result, node_id=f"node-{n}", num_gpus=config.gpus, origins=origins)
        for n in range(num_nodes)
    ))  # fmt: skip


def cmd_plan(args: argparse.Namespace, job_config) -> int:
    """`offloadctl plan`: the plan on `args.nodes` nodes like this machine (no Ray), with the
    batch sized from memory when asked and the predicted throughput over batch sizes."""
    import socket

    from coordinator.config import node_env
    from coordinator.family_check import check_family
    from coordinator.planning.batch_size import curve_text, plan_job, throughput_curve
    from coordinator.planning.checkpoint import load_index
    from coordinator.planning.context import check_max_seq_len
    from worker.node import probe_here

    config = job_config(args)
    if not config.gpus:
        raise ConfigError(f"plan without Ray needs --gpus (GPUs per node), got {config.gpus}")
    index = load_index(config.checkpoint, dtype=config.dtype)
    check_max_seq_len(index.config, config.max_seq_len)
    check_family(index.config, attn_implementation=config.attn_implementation)  # as launch does
    # The job's overrides that match this machine (by hostname; `plan` knows no node labels
    # or ids), as the runtime gives them to each node's workers.
    env, origins = node_env(config.overrides, node_id="", hostname=socket.gethostname(),
                            labels={})  # fmt: skip
    model = (index.config, index.dtype, config.cpus_per_worker)  # its decoder layer is timed
    cluster = plan_cluster(config, probe_here(env=env, model=model), args.nodes, origins)
    sized, the_plan = plan_job(config, index, cluster)
    print(the_plan.to_json() if args.json else the_plan.summary())
    if not config.max_batch and not args.json:
        print(f"max_batch auto: {sized.max_batch} sequences of up to {sized.max_seq_len} tokens "
              "(the largest batch whose KV cache fits beside the planned weights)")  # fmt: skip
    if config.max_seq_len and not args.json:
        print(curve_text(throughput_curve(index.layers, cluster, sized.plan_options())))
    return 0
