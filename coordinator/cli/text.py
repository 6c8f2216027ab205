"""`offloadctl generate` and `offloadctl serve`: the commands that take text in and give text
out, through the checkpoint's own tokenizer (coordinator/serving/text.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

DEFAULT_MAX_NEW_TOKENS = 64


def add_parsers(commands, add_job_flags, positive) -> None:
    gen = commands.add_parser("generate", help="generate text from a prompt, streamed")
    add_job_flags(gen)
    gen.add_argument("name", nargs="?", help="a named load (default: load --checkpoint now)")
    gen.add_argument("--prompt", required=True, help="the text to continue (or the user turn)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the tokenizer's chat template as a user turn",
    )
    gen.add_argument(
        "--max-new-tokens", type=positive, default=DEFAULT_MAX_NEW_TOKENS, dest="max_new_tokens"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        help="sample at this temperature (0: greedy; default: the checkpoint's "
        "generation_config.json, greedy if it says nothing)",
    )
    gen.add_argument("--top-p", type=float, dest="top_p")
    gen.add_argument("--top-k", type=int, dest="top_k")
    gen.add_argument("--seed", type=int, help="seed for sampling (reproducible output)")
    gen.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the text where TEXT begins (repeatable)",
    )


def cmd_generate(args: argparse.Namespace, job_config, progress) -> int:
    from coordinator.config import ConfigError
    from coordinator.engine import generation
    from coordinator.planning.checkpoint import read_config
    from coordinator.runtime.launch import attach, launch
    from coordinator.serving.text import TextStream, end_ids, load_tokenizer, prompt_ids

    if any(not text for text in args.stop or ()):
        raise ConfigError("--stop needs a non-empty text")
    if args.name:
        job_cm = attach(args.name, address=args.address)
        checkpoint = job_cm.config.checkpoint
    else:
        config = job_config(args)
        checkpoint = config.checkpoint
    tokenizer = load_tokenizer(checkpoint)
    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    ids = prompt_ids(tokenizer, args.prompt, messages=messages)
    options = generation.sampling_options(args.temperature, args.top_p, args.top_k, args.seed)
    if not args.name:
        # What the request could never do is said before anything starts, in its own terms:
        # a bad setting, past the model's context, past an explicit --max-seq-len.
        generation.resolve(
            checkpoint,
            read_config(checkpoint),
            ids.shape[1],
            max_new_tokens=args.max_new_tokens,
            **options,
        )
        needed = ids.shape[1] + args.max_new_tokens
        if config.max_seq_len == 0:  # reserve the KV cache this request needs
            config = dataclasses.replace(config, max_seq_len=needed)
        elif config.max_seq_len < needed:
            raise ConfigError(
                f"the prompt ({ids.shape[1]} tokens) + --max-new-tokens {args.max_new_tokens} "
                f"need a KV cache of {needed} tokens per sequence, more than --max-seq-len "
                f"{config.max_seq_len}: raise it, or leave it out (generate then plans what the "
                "request needs)"
            )
        job_cm = launch(config, progress=progress)
    with job_cm as job:
        stream = TextStream(tokenizer, end_ids(tokenizer, job.index), tuple(args.stop or ()))
        times: list[float] = []

        def show(row: int, token: int) -> None:
            times.append(time.perf_counter())
            print(stream.push(token), end="", flush=True)

        start = time.perf_counter()
        out = job.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            on_token=show,
            cancelled=lambda: stream.stopped,
            **options,
        )
    new = out.shape[1] - ids.shape[1]
    print(stream.finish())
    first = times[0] - start if times else 0.0
    rate = (new - 1) / (times[-1] - times[0]) if new > 1 and times[-1] > times[0] else 0.0
    print(f"{new} tokens; first after {first:.2f} s, then {rate:.1f} tokens/s", file=sys.stderr)
    return 0


DEFAULT_SERVE_SEQ_LEN = 512  # KV cache planned per sequence when serving and none was asked for
DEFAULT_SERVE_BATCH = 0  # auto: chosen by the plan (for throughput, serve's objective)
DEFAULT_SERVE_OBJECTIVE = "throughput"  # decode tokens/s of the whole cluster
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve_parser(commands, add_job_flags) -> None:
    srv = commands.add_parser("serve", help="serve OpenAI-style completions over HTTP")
    add_job_flags(srv)
    srv.add_argument("name", nargs="?", help="a named load (default: load --checkpoint now)")
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; others need an API key)",
    )
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key-file", help="file holding the API key (default: OFFLOAD_API_KEY)")
    srv.add_argument(
        "--metrics-key-file",
        help="file holding a key /metrics asks for (default: OFFLOAD_METRICS_KEY; neither: "
        "/metrics is open, as vLLM's)",
    )
    srv.add_argument(
        "--model-name", help="the model id clients name (default: the checkpoint directory's name)"
    )
    srv.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (a Jinja template the server runs, "
        "sandboxed; refused by default, as vLLM's)",
    )


def _api_key(
    path: str | None, flag: str = "--api-key-file", env: str = "OFFLOAD_API_KEY"
) -> str | None:
    """The key in the file `path` (given with `flag`), else in the environment's `env`."""
    import os

    from coordinator.config import ConfigError

    if path:
        try:
            key = open(path).read().strip()  # noqa: SIM115 - read at once
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror}") from None
        if not key:
            raise ConfigError(f"{flag} {path} is empty")
        return key
    return os.environ.get(env) or None


def _pool_words(config, plan) -> str:
    """The KV pool in words; where it holds fewer sequences of the expected length than
    max_batch (a cap: the budget left no more), how many it holds."""
    words = (
        f"KV pool of {config.kv_cache_tokens} tokens for up to {config.max_batch} sequences "
        f"of up to {config.max_seq_len} tokens"
    )
    options = plan.options
    held = options.sequences_held(options.expected_len)
    if options.max_seq_len and held < config.max_batch:
        words += (
            f" (it holds {held} of the expected {options.expected_len} tokens at once: "
            "more wait in the queue, or are preempted as they grow)"
        )
    return words


def _serving_what(jobs: list, auto: bool) -> str:
    """The served loads in words: stages, KV cache, queue, and what the plan chose."""
    job = jobs[0]
    plan = job.plan
    what = f"load {job.name!r}, {len(plan.stages)} stages, {_pool_words(job.config, plan)}"
    if len(jobs) > 1:
        total = sum(j.plan.tokens_per_s for j in jobs)
        what = (
            f"{len(jobs)} replicas (loads {', '.join(repr(j.name) for j in jobs)}), each "
            f"{len(plan.stages)} stage(s) with a {_pool_words(job.config, plan)}; {total:.1f} "
            "tokens/s predicted in all"
        )
    elif auto and plan.options.objective == "throughput":
        what += (
            f" and {plan.options.micro_batches} micro-batch(es), chosen for throughput: "
            f"{plan.tokens_per_s:.1f} tokens/s predicted"
        )
    elif auto:
        what += " (auto: as many as fit beside the weights)"
    return f"{what}, up to {job.config.max_queue} waiting"


def cmd_serve(args: argparse.Namespace, job_config, progress) -> int:
    """Serve on host:port with a Serve app of this command's own, removed when it ends (other
    `serve` commands on the cluster go on). Loads it starts itself are leased (SERVE_LEASE_S):
    killed with -9, this command leaves no GPU held for longer than the lease."""
    import uuid
    from pathlib import Path

    from coordinator.config import ConfigError
    from coordinator.planning.checkpoint import read_config
    from coordinator.planning.context import model_context
    from coordinator.runtime import registry
    from coordinator.runtime.launch import attach, launch_replicas
    from coordinator.runtime.lease import LeaseHolder
    from coordinator.serving import app as serving
    from coordinator.serving.bridge import bind

    key = _api_key(args.api_key_file)
    metrics_key = _api_key(args.metrics_key_file, "--metrics-key-file", "OFFLOAD_METRICS_KEY")
    if args.host not in LOOPBACK and key is None:
        raise ConfigError(
            f"serving on {args.host} without an API key would let anyone who reaches it use the "
            "GPUs: set OFFLOAD_API_KEY or --api-key-file, or serve on 127.0.0.1"
        )
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} must be in 1..65535")
    serve_id = uuid.uuid4().hex[:8]  # names this command's loads and its Serve app
    auto = False
    jobs: list = []
    served = None
    holder = None
    ours = False
    sock = bind(args.host, args.port)  # a port in use is said now, before any load
    try:
        if args.name:
            jobs, ours = [attach(args.name, address=args.address)], False
        else:
            # serve's own defaults, for what neither the flags nor the job file set
            config = job_config(
                args,
                defaults={"max_batch": DEFAULT_SERVE_BATCH, "objective": DEFAULT_SERVE_OBJECTIVE},
                throughput_defaults={"replicas": 0},
            )
            auto = config.max_batch == 0
            if config.max_seq_len == 0:  # 512 tokens, within the model's context
                context = model_context(read_config(config.checkpoint))
                seq_len = min(
                    DEFAULT_SERVE_SEQ_LEN, context.tokens if context else DEFAULT_SERVE_SEQ_LEN
                )
                config = dataclasses.replace(config, max_seq_len=seq_len)
            ours = True
            lease_s = _serve_lease_s()
            holder = LeaseHolder(f"serve-{serve_id}", lease_s)  # renews from the first load on
            jobs = launch_replicas(config, f"serve-{serve_id}", progress=progress, lease_s=lease_s)
        job = jobs[0]
        model = args.model_name or Path(job.config.checkpoint).resolve().name
        from coordinator.serving.text import load_tokenizer

        load_tokenizer(job.config.checkpoint)  # a checkpoint without one fails here, not later
        served = serving.start(
            [j.name for j in jobs],
            model,
            app_id=serve_id,
            sock=sock,
            api_key=key,
            metrics_key=metrics_key,
            max_ongoing_requests=job.config.max_queue + job.config.max_batch,
            trust_request_chat_template=args.trust_request_chat_template,
        )
        print(
            f"serving {model!r} on http://{args.host}:{args.port}/v1 ({_serving_what(jobs, auto)}"
            f"; Serve app {served.name!r}); Ctrl-C stops it",
            flush=True,
        )
        while True:
            time.sleep(3600)
    finally:
        try:
            if served is not None:
                served.stop()  # this command's app and server only
        finally:
            sock.close()  # closed already where the server ran
            if holder is not None:
                holder.close()
            for j in reversed(jobs):  # the first owns an embedded Ray: it goes last
                if ours:
                    registry.forget(j.name)
                j.close()
    return 0  # unreachable: Ctrl-C or SIGTERM ends the command


SERVE_LEASE_S = 30.0  # the loads serve starts go this long after its last renewal


def _serve_lease_s() -> float:
    """SERVE_LEASE_S, or OFFLOAD_SERVE_LEASE_S where set (tests: a short lease)."""
    import os

    from coordinator.config import ConfigError

    text = os.environ.get("OFFLOAD_SERVE_LEASE_S")
    if not text:
        return SERVE_LEASE_S
    try:
        lease_s = float(text)
    except ValueError:
        lease_s = 0.0
    if not lease_s > 0:
        raise ConfigError(f"OFFLOAD_SERVE_LEASE_S={text!r} must be a positive number of seconds")
    return lease_s
