"""offloadctl: plan, load and run a checkpoint across a Ray cluster's GPUs with offloading.

    offloadctl make-checkpoint ckpt/ --arch llama --layers 8
    offloadctl plan --checkpoint ckpt/ --gpus 3 --gpu-memory 8MiB
    offloadctl run  --checkpoint ckpt/ --gpus 3 --gpu-memory 8MiB --check
    offloadctl check-cluster cluster.yaml   # validate a launcher config offline
    offloadctl node-demo          # the node-local offloader alone, timed

Every job flag can also come from a YAML file (--config job.yaml; flags win). An error the
project raises on purpose (a kind of `offload.errors.OffloadCoordinatorError`: config,
checkpoint, plan, capacity, launch) or one of the file system or network (OSError: a path the
user gave, a cluster address) is one line and exit 2; anything else is a bug, reported as one
with its traceback and exit 1.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import traceback

import coordinator.cli.ending as ending
from coordinator.cli.loads import EXIT_MISMATCH, RANDOM_INPUT
from coordinator.config import ConfigError, JobConfig, load_job_config, parse_bytes
from coordinator.tools.make_checkpoint import (
    ARCHITECTURES,
    DTYPES,
    FP8_BLOCK,
    FP8_CT_STRATEGIES,
    FP8_SCALE_DTYPES,
    MOE_ARCHITECTURES,
    NO_KV_HEADS,
    QUANTIZATIONS,
    SLIDING_ARCHITECTURES,
)
from offload.errors import OffloadCoordinatorError
from worker.names import (
    COMPUTE_DTYPE_NAMES,
    EXPERT_FETCHES,
    HOST_EXPERTS,
    OFFLOAD_DTYPES,
    RESIDENT_WEIGHTS,
)
from worker.startup import quiet_imports, settle

EXIT_ERROR = 2
EXIT_BUG = 1  # an exception that is not one of our kinds
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM
RELEASED = "every worker and Ray this command started was released (named loads stay)"
# Commands that start no Ray session: `main` imports the runtime, and Ray with it, only for the
# others, so that `offloadctl plan` never imports Ray.
RAY_FREE_COMMANDS = ("make-checkpoint", "plan", "check-cluster", "node-demo")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _batch(text: str) -> int:
    """--max-batch and --replicas: a count >= 1, or auto (0: chosen when the job is planned)."""
    return 0 if text == "auto" else _positive(text)


def _expert_cache(text: str) -> int:
    """--expert-cache: auto (-1), or a count of rows >= 0."""
    if text == "auto":
        return -1
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto or >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _wait_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"must be a number of seconds in 0..1, got {text}")
    return value


def _prefetch_step(text: str) -> int:
    from offload.config import MAX_PREFETCH_STEP

    value = int(text)
    if not 1 <= value <= MAX_PREFETCH_STEP:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_PREFETCH_STEP}, got {value}")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_job_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML job file; flags override its values")
    parser.add_argument("--checkpoint", help="checkpoint directory (safetensors + config.json)")
    parser.add_argument(
        "--address",
        help="join a Ray cluster ('auto' or host:port); "
        "default: RAY_ADDRESS, else an embedded local Ray",
    )
    parser.add_argument("--gpus", type=int, help="embedded Ray: logical GPUs to create")
    parser.add_argument(
        "--gpu-memory",
        type=_size,
        dest="gpu_memory_bytes",
        help="per-GPU budget, e.g. 8MiB (required without CUDA)",
    )
    parser.add_argument(
        "--host-memory",
        type=_size,
        dest="host_memory_bytes",
        help="per-node host budget for offloaded weights",
    )
    parser.add_argument(
        "--reserve",
        type=_size,
        dest="reserve_bytes",
        help="per-GPU bytes kept free for activations",
    )
    parser.add_argument("--prefetch-step", type=_prefetch_step, dest="prefetch_step")
    parser.add_argument("--backend", choices=("auto", "prefetch", "uva"))
    parser.add_argument(
        "--offload-dtype",
        choices=OFFLOAD_DTYPES,
        dest="offload_dtype",
        help="how offloaded weights are kept in host memory and copied: auto (as the "
        "checkpoint stores them: block FP8 in 8 bits), none (the model's dtype), fp8 or int8 "
        "(8 bits, dequantized on the GPU after each copy: half the bytes per step)",
    )
    parser.add_argument(
        "--expert-fetch",
        choices=EXPERT_FETCHES,
        dest="expert_fetch",
        help="how an offloaded MoE layer's experts reach the GPU: auto (default: the plan's "
        "choice per stage at its batch), layer (with the whole layer, prefetched while "
        "earlier layers compute) or routed (only the experts the step's router chose, copied "
        "once it has: fewer bytes at small batches)",
    )
    parser.add_argument(
        "--expert-cache",
        type=_expert_cache,
        dest="expert_cache",
        help="rows each offloaded MoE experts module of a routed stage keeps on the GPU across "
        "steps, its most used experts: auto (default: as many as the memory the plan leaves "
        "holds), 0 (none) or a number (at most that many)",
    )
    parser.add_argument(
        "--host-experts",
        choices=HOST_EXPERTS,
        dest="host_experts",
        help="where a routed MoE stage computes the experts of a step of few rows: off "
        "(default: on the GPU, copied in) or auto (on the host, reading them in host memory, "
        "where the node's measured host rate beats copying them over its link)",
    )
    parser.add_argument(
        "--resident-weights",
        choices=RESIDENT_WEIGHTS,
        dest="resident_weights",
        help="how a quantized checkpoint's (FP8 blocks, MXFP4) resident weights sit on the "
        "GPUs: auto (default: stored where every node's GPUs compute in FP8, compute "
        "capability 8.9 or higher, the plan at width would offload and the stored plan is "
        "faster), stored (as the "
        "checkpoint stores them, each layer dequantized just before it runs: half the device "
        "bytes of FP8 at width) or wide (dequantized at load, at the model's width)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *COMPUTE_DTYPE_NAMES),
        help="dtype to load and compute in (default auto: the checkpoint's); "
        "converted while reading",
    )
    parser.add_argument("--cpus-per-worker", type=_positive, dest="cpus_per_worker")
    parser.add_argument(
        "--max-batch",
        type=_batch,
        dest="max_batch",
        help="sequences running at once (vLLM's max_num_seqs); 'auto' "
        "(the default with --objective throughput): the batch with the most "
        "tokens/s, or for latency as many as the KV pool holds at --expected-seq-len",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        dest="max_seq_len",
        help="tokens per sequence (prompt + new) the KV cache is planned for "
        "(0: none, no generation)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        dest="kv_cache_tokens",
        help="the KV pool on each GPU, in tokens (blocks of 16), shared by every running "
        "sequence as it grows (default: what the plan leaves beside the weights); it must hold "
        "one sequence of --max-seq-len",
    )
    parser.add_argument(
        "--expected-seq-len",
        type=int,
        dest="expected_seq_len",
        help="the length a sequence is expected to reach (prompt + new; default a quarter of "
        "--max-seq-len): what auto --max-batch and the throughput planner size the pool by",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_const",
        const=False,
        dest="prefix_caching",
        help="compute every sequence's keys, even where an earlier sequence's tokens started "
        "the same (default: reuse its full KV blocks)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        dest="max_queue",
        help="sequences that may wait to run (default 1024); beyond, busy (HTTP 429)",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=_positive,
        dest="prefill_tokens",
        help="prompt tokens per prefill step (default 512): a long prompt goes "
        "in chunks, the decodes of others between them",
    )
    parser.add_argument(
        "--batch-wait",
        type=_wait_seconds,
        dest="batch_wait_s",
        metavar="SECONDS",
        help="an idle engine given a request waits this long for others to "
        "start with it (default 0.005; 0: never): requests sent together "
        "share their first step and decode in step",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        dest="micro_batches",
        help="micro-batches the running sequences are split into (default 0: "
        "for throughput the plan's choice; for latency one when layers are "
        "offloaded, each offloaded layer brought in once per step for all, "
        "else one per stage, every stage busy)",
    )
    parser.add_argument(
        "--objective",
        choices=("latency", "throughput"),
        help="what the plan maximises: latency (default for load, run, "
        "generate: the slowest stage of one step) or throughput (serve's "
        "default: decode tokens/s; also chooses --max-batch auto and "
        "--micro-batches 0)",
    )
    parser.add_argument(
        "--max-token-latency",
        type=_seconds,
        dest="max_token_latency_s",
        metavar="SECONDS",
        help="throughput objective: each sequence's time "
        "between two tokens at most this (e.g. 0.05)",
    )
    parser.add_argument(
        "--replicas",
        type=_batch,
        dest="replicas",
        help="throughput: pipelines on disjoint GPUs, each serving its own "
        "requests (plan and serve; 'auto', their default: the count with the "
        "most tokens/s)",
    )
    parser.add_argument(
        "--rebalance-interval",
        type=float,
        dest="rebalance_interval_s",
        metavar="SECONDS",
        help="a load whose KV pool the plan chose re-balances it against the resident "
        "weights for the lengths its requests come to, at most this often (default 600; 0: "
        "never on its own)",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=float,
        dest="snapshot_interval_s",
        metavar="SECONDS",
        help="each worker snapshots its memory this often "
        "(default 10; 0: on request only); a named load publishes them as Ray "
        "gauges",
    )


# JobConfig field -> the flag that sets it (every one defaults to None: "not given")
_JOB_FLAGS = {
    "checkpoint": "--checkpoint",
    "address": "--address",
    "gpus": "--gpus",
    "gpu_memory_bytes": "--gpu-memory",
    "host_memory_bytes": "--host-memory",
    "reserve_bytes": "--reserve",
    "prefetch_step": "--prefetch-step",
    "backend": "--backend",
    "offload_dtype": "--offload-dtype",
    "expert_fetch": "--expert-fetch",
    "resident_weights": "--resident-weights",
    "expert_cache": "--expert-cache",
    "host_experts": "--host-experts",
    "dtype": "--dtype",
    "cpus_per_worker": "--cpus-per-worker",
    "snapshot_interval_s": "--snapshot-interval",
    "rebalance_interval_s": "--rebalance-interval",
    "max_batch": "--max-batch",
    "max_seq_len": "--max-seq-len",
    "kv_cache_tokens": "--kv-cache-tokens",
    "expected_seq_len": "--expected-seq-len",
    "prefix_caching": "--no-prefix-caching",
    "max_queue": "--max-queue",
    "prefill_tokens": "--prefill-tokens",
    "batch_wait_s": "--batch-wait",
    "micro_batches": "--micro-batches",
    "objective": "--objective",
    "max_token_latency_s": "--max-token-latency",
    "replicas": "--replicas",
}


def _job_config(
    args: argparse.Namespace, defaults: dict | None = None, throughput_defaults: dict | None = None
) -> JobConfig:
    """The job the flags and --config describe; `defaults` (a command's own) fill what
    neither sets, and `throughput_defaults` too when the objective is throughput (max_batch
    auto always: for throughput the batch is the plan's to choose)."""
    values = {name: getattr(args, name) for name in _JOB_FLAGS}
    if args.config:
        config = load_job_config(args.config, defaults, **values)
    else:
        from coordinator.config import job_config_from_dict

        given = {k: v for k, v in values.items() if v is not None}
        config = job_config_from_dict({**(defaults or {}), **given}, where="command line")
    wanted = {"max_batch": 0, **(throughput_defaults or {})}
    missing = {k: v for k, v in wanted.items() if k not in (defaults or {})}
    if config.objective == "throughput" and missing:
        # Unless the flags or the file set them: they are the plan's to choose.
        return _job_config(args, {**(defaults or {}), **missing})
    return config


def _refuse_load_flags(args: argparse.Namespace) -> None:
    """A named load runs as it was loaded: flags that describe loading have nothing to act on."""
    given = [
        flag
        for name, flag in _JOB_FLAGS.items()
        if name != "address" and getattr(args, name, None) is not None
    ]
    if getattr(args, "config", None):
        given.append("--config")
    if given:
        raise ConfigError(
            f"{', '.join(given)} set how a model is loaded, but {args.name!r} is a load that "
            f"exists: it runs as loaded (offloadctl status {args.name} shows how); drop them, "
            "or unload it and load it again with them"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offloadctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make-checkpoint", help="write a random-weight HF checkpoint")
    make.add_argument("out", help="output directory (must be empty unless --force)")
    make.add_argument(
        "--arch",
        default="llama",
        choices=ARCHITECTURES,
        metavar="MODEL_TYPE",
        help=f"the Hugging Face model_type: {', '.join(ARCHITECTURES)}",
    )
    make.add_argument("--layers", type=_positive, default=8, dest="num_layers")
    make.add_argument("--hidden-size", type=_positive, default=256)
    make.add_argument("--heads", type=_positive, default=8, dest="num_heads")
    make.add_argument(
        "--kv-heads",
        type=_positive,
        default=4,
        dest="num_kv_heads",
        help=f"ignored by {', '.join(NO_KV_HEADS)} (no grouped-query attention: they use --heads)",
    )
    make.add_argument(
        "--intermediate-size",
        type=_positive,
        default=512,
        help="MLP width; in MoE families each expert's (and qwen2_moe's shared expert's)",
    )
    make.add_argument("--vocab", type=_positive, default=1024, dest="vocab_size")
    moe = ", ".join(MOE_ARCHITECTURES)
    make.add_argument(
        "--experts",
        type=_positive,
        default=4,
        dest="num_experts",
        help=f"experts per MoE layer ({moe} only)",
    )
    make.add_argument(
        "--experts-per-token",
        type=_positive,
        default=2,
        dest="experts_per_token",
        help=f"experts routed to per token ({moe} only)",
    )
    make.add_argument(
        "--sliding-window",
        type=_positive,
        default=4,
        help=f"attention window in tokens ({', '.join(SLIDING_ARCHITECTURES)} "
        "only); small so a short test sequence outruns it",
    )
    make.add_argument(
        "--max-positions",
        type=_positive,
        default=2048,
        dest="max_positions",
        help="longest sequence (gpt2 learns an embedding row per position)",
    )
    make.add_argument("--dtype", default="float32", choices=DTYPES)
    make.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="as each format is published (with --dtype bfloat16): fp8-block, the decoder "
        "layers' linear weights in float8_e4m3fn with a scale per --fp8-block square block "
        "(DeepSeek-V3, Kimi-K2, Qwen3-FP8); fp8-compressed, compressed-tensors FP8 with a "
        "scale per --fp8-strategy; mxfp4, gpt-oss's experts in 4 bits (--arch gpt_oss)",
    )
    make.add_argument(
        "--fp8-block",
        type=_positive,
        default=FP8_BLOCK,
        help="rows and cols of an FP8 block (weight_block_size); the last block of a dim is "
        "partial where the dim is no multiple of it",
    )
    make.add_argument(
        "--fp8-scales",
        default="float32",
        choices=FP8_SCALE_DTYPES,
        help="how FP8 block scales are stored (e8m0, uint8: powers of two, 2^(x-127)); "
        "fp8-compressed: float32 or bfloat16",
    )
    make.add_argument(
        "--fp8-strategy",
        default="block",
        choices=FP8_CT_STRATEGIES,
        help="fp8-compressed: a scale per tensor, per channel (row), or per --fp8-block block",
    )
    make.add_argument("--tie-embeddings", action="store_true")
    make.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="write no tokenizer (default: a small byte-level BPE with a chat "
        "template, which needs --vocab >= 32)",
    )
    make.add_argument("--shard-size", type=_size, default=2 * 2**20, dest="max_shard_bytes")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--force", action="store_true", help="write into a non-empty directory")

    plan = commands.add_parser("plan", help="show the placement plan (no Ray needed)")
    _add_job_flags(plan)
    plan.add_argument("--nodes", type=_positive, default=1, help="identical nodes to plan for")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw the predicted tokens/s over batch sizes into this PNG file",
    )

    for name, text in (
        ("load", "load the model across the cluster and report each stage"),
        ("run", "load, run a forward pass, print a logits checksum"),
    ):
        sub = commands.add_parser(name, help=text)
        _add_job_flags(sub)
        sub.add_argument(
            "--memory-json",
            metavar="FILE",
            help="write each GPU's and node's memory snapshot as JSON",
        )
        sub.add_argument(
            "--plot", metavar="FILE.png", help="draw per-GPU and per-node memory as stacked bars"
        )
        if name == "load":
            sub.add_argument("--name", help="keep the load on the cluster under this name")
        if name == "run":
            sub.add_argument("name", nargs="?", help="a named load to run (default: load one)")
            sub.add_argument("--input-ids", help="comma-separated token ids (default: random)")
            sub.add_argument(
                "--batch",
                type=_positive,
                help=f"random input: sequences (default {RANDOM_INPUT['batch']})",
            )
            sub.add_argument(
                "--seq-len",
                type=_positive,
                help=f"random input: tokens each (default {RANDOM_INPUT['seq_len']})",
            )
            sub.add_argument(
                "--seed", type=int, help=f"random input: its seed (default {RANDOM_INPUT['seed']})"
            )
            sub.add_argument(
                "--check",
                action="store_true",
                help="compare with transformers in one process; exit 1 on mismatch",
            )

    import coordinator.cli.text as text_commands

    text_commands.add_parsers(commands, _add_job_flags, _positive)
    text_commands.add_serve_parser(commands, _add_job_flags)

    for name, text in (
        ("status", "memory of every GPU and node of a named load"),
        ("unload", "release a named load's workers"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("name")
        sub.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else auto)")
        if name == "status":
            sub.add_argument("--json", action="store_true", help="print the snapshot as JSON")
            sub.add_argument("--plot", metavar="FILE.png")
    listing = commands.add_parser("list", help="the named loads on the cluster")
    listing.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else auto)")

    check = commands.add_parser("check-cluster", help="validate a Ray cluster-launcher config")
    check.add_argument("path", help="e.g. cluster.yaml")

    demo = commands.add_parser("node-demo", help="the node-local offloader alone, timed")
    demo.add_argument("--layers", type=_positive, default=8)
    demo.add_argument("--hidden", type=_positive, default=1024)
    demo.add_argument("--batch", type=_positive, default=16)
    demo.add_argument("--step", type=_prefetch_step, default=2, help="prefetch slots")
    demo.add_argument("--repeats", type=_positive, default=15)
    for name, sub in commands.choices.items():
        sub.epilog = f"More: docs/{DOCS_PAGES[name]}; its errors: docs/troubleshooting.md."
    pages = sorted({*DOCS_PAGES.values(), "troubleshooting.md", "benchmarks.md"})
    parser.epilog = "More: README.md, then " + ", ".join(f"docs/{p}" for p in pages) + "."

    return parser


# The docs page that covers each command (`offloadctl COMMAND --help` names it)
DOCS_PAGES = {
    "make-checkpoint": "formats-and-families.md",
    "plan": "loading-and-planning.md",
    "load": "loading-and-planning.md",
    "run": "loading-and-planning.md",
    "generate": "serving.md",
    "serve": "serving.md",
    "status": "operations.md",
    "unload": "operations.md",
    "list": "operations.md",
    "check-cluster": "cluster-and-pinning.md",
    "node-demo": "architecture.md",
}


_bar: dict[str, object] = {}  # the load's progress bar while it runs


def _progress(done: int, total: int) -> None:
    """Bytes loaded so far, as a tqdm bar on stderr; closed (its line ended) when complete."""
    from tqdm import tqdm

    bar = _bar.get("load")
    if bar is None:
        bar = _bar["load"] = tqdm(
            total=total,
            desc="loading",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            leave=True,
        )
    bar.update(done - bar.n)
    if done >= total:
        _end_progress()


def _end_progress() -> None:
    bar = _bar.pop("load", None)
    if bar is not None:
        bar.close()  # ends its line: what follows starts on a new one


def _fail(message: str, code: int) -> int:
    _end_progress()
    print(message, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    quiet_imports(command=True)  # the command's imports; Ray's connect (or the end) settles
    try:
        return _main(argv)
    finally:
        settle()


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    expected: tuple[type[Exception], ...] = (
        OffloadCoordinatorError,
        OSError,  # a path the user gave: missing, a directory, unreadable; a cluster address
    )
    main_thread = threading.current_thread() is threading.main_thread()
    previous = ending.install_handlers() if main_thread else {}
    running = ending.embedded_ray()  # one the caller started (tests): not this command's to stop
    try:
        return _run(args, expected)
    except KeyboardInterrupt:  # Terminated too; Ray raises a KeyboardInterrupt of its own
        if ending.first_signal() == signal.SIGTERM:
            return _fail(f"terminated: {RELEASED}", EXIT_TERMINATED)
        return _fail(f"interrupted: {RELEASED}", EXIT_INTERRUPTED)
    finally:
        try:
            ending.release_embedded_ray(unless=running)
        finally:
            ending.restore_handlers(previous)


def _run(args: argparse.Namespace, expected: tuple[type[Exception], ...]) -> int:
    try:
        if args.command == "make-checkpoint":
            from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

            fields = (
                "arch",
                "num_layers",
                "hidden_size",
                "num_heads",
                "num_kv_heads",
                "intermediate_size",
                "vocab_size",
                "num_experts",
                "experts_per_token",
                "sliding_window",
                "max_positions",
                "dtype",
                "max_shard_bytes",
                "seed",
                "quantization",
                "fp8_block",
                "fp8_scales",
                "fp8_strategy",
            )
            shape = CheckpointShape(
                **{f: getattr(args, f) for f in fields},
                tie_embeddings=args.tie_embeddings,
                tokenizer=not args.no_tokenizer,
            )
            out = make_checkpoint(args.out, shape, force=args.force)
            print(f"wrote a random-weight {shape.arch} checkpoint to {out}")
            return 0
        if args.command == "plan":
            import coordinator.cli.plan as plan_command

            return plan_command.cmd_plan(args, _job_config)
        if args.command in ("run", "generate", "serve") and getattr(args, "name", None):
            _refuse_load_flags(args)
        if args.command == "generate":
            import coordinator.cli.text as text_commands

            return text_commands.cmd_generate(args, _job_config, _progress)
        if args.command == "serve":
            import coordinator.cli.text as text_commands

            return text_commands.cmd_serve(args, _job_config, _progress)
        if args.command in ("load", "run"):
            import coordinator.cli.loads as load_commands

            return load_commands.cmd_load_or_run(args, _job_config, _progress)
        if args.command in ("status", "unload", "list"):
            import coordinator.cli.loads as load_commands

            return load_commands.cmd_named(args)
        if args.command == "check-cluster":
            from coordinator.tools.cluster_yaml import check_cluster_config

            result = check_cluster_config(args.path)
            for warning in result.warnings:
                print(f"warning: {warning}")
            for error in result.errors:
                print(f"error: {error}")
            print(f"{args.path}: {'ok' if result.ok else f'{len(result.errors)} problem(s)'}")
            return 0 if result.ok else EXIT_MISMATCH
        if args.command == "node-demo":
            from coordinator.tools.demo import run_demo

            return run_demo(
                num_layers=args.layers,
                hidden=args.hidden,
                batch=args.batch,
                step=args.step,
                repeats=args.repeats,
            )
    except expected as exc:
        return _fail(f"error: {exc}", EXIT_ERROR)
    except Exception:  # not a kind we raise: a bug, with what it needs to be fixed
        _end_progress()
        traceback.print_exc()
        print(
            f"offloadctl {args.command}: internal error (a bug: please report it with the "
            "traceback above)",
            file=sys.stderr,
        )
        return EXIT_BUG
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
