"""`offloadctl load`, `run`, `status`, `list` and `unload`: the commands that load a
checkpoint (or attach to a named load), run and check it against transformers, and show what
its workers hold."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator.config import JobConfig
from offload.errors import ConfigError, NeverFitsError

if TYPE_CHECKING:
    from worker.snapshot import StageSnapshot

EXIT_MISMATCH = 1  # the check found logits unequal to transformers' (or a config problem)
RANDOM_INPUT = {"batch": 2, "seq_len": 16, "seed": 0}  # `run`'s input without --input-ids


def cmd_load_or_run(args: argparse.Namespace, job_config, progress) -> int:
    import torch

    from coordinator.runtime.launch import attach, launch

    name = getattr(args, "name", None)
    attached = bool(args.command == "run" and name)
    ids = _input_ids(args) if args.command == "run" else None  # a tensor, or a random one's shape
    if attached:
        job_cm = attach(name, address=args.address)
        config = job_cm.config
    else:
        config = job_config(args)
        if ids is not None:  # a learned-position model fails past it; a RoPE one says nothing
            _check_context(config.checkpoint, ids[1] if isinstance(ids, tuple) else ids.shape[1])
        started = time.perf_counter()
        job_cm = launch(config, progress=progress, name=name)
    with job_cm as job:
        if not attached:
            print(
                f"model: {job.index.family}, {job.index.dtype}, "
                f"{job.index.num_decoder_layers} blocks{_untested(job.index.family)}"
            )
            print(job.plan.summary())
            print(stage_table(job.load_reports))
            print(
                f"loaded {job.index.total_bytes / 2**20:.1f} MiB on {len(job.workers)} workers "
                f"in {time.perf_counter() - started:.1f} s"
            )
        else:
            print(f"attached to load {name!r}: {len(job.workers)} stages")
        if args.command == "load" or args.memory_json or args.plot:
            _report_memory(job, args)
        if args.command == "load":
            if job.session.owned:
                print(
                    "note: on the embedded Ray the load lives for this process only; it is "
                    "released now (use --address to keep a named load)"
                )
            elif name:
                print(f"load {name!r} stays on the cluster: offloadctl run/status/unload {name}")
            return 0
        if isinstance(ids, tuple):  # random ids, drawn now that the vocabulary is known
            seed = RANDOM_INPUT["seed"] if args.seed is None else args.seed
            generator = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, job.index.config["vocab_size"], ids, generator=generator)
        job.forward(ids)  # warm-up: first calls import and allocate
        start = time.perf_counter()
        logits = job.forward(ids)
        forward_ms = (time.perf_counter() - start) * 1e3
        # The bits themselves (numpy has no bfloat16): equal digests mean bitwise equal logits.
        digest = hashlib.sha256(logits.contiguous().view(torch.uint8).numpy()).hexdigest()[:16]
        print(
            f"logits {list(logits.shape)} {str(logits.dtype).removeprefix('torch.')}: sum {float(logits.double().sum()):.6f}, "
            f"sha256 {digest}; forward {forward_ms:.1f} ms"
        )
        if not args.check:
            return 0
        return _check(job, config, ids, logits)


def _input_ids(args: argparse.Namespace):
    """--input-ids as a (1, n) tensor; else the shape of the random input (batch, tokens), drawn
    once the vocabulary is known. --batch/--seq-len/--seed only shape random input."""
    import torch

    if args.input_ids:
        given = [
            flag
            for flag, value in (
                ("--batch", args.batch),
                ("--seq-len", args.seq_len),
                ("--seed", args.seed),
            )
            if value is not None
        ]
        if given:
            raise ConfigError(
                f"--input-ids gives the tokens; {', '.join(given)} shape random "
                "input only: drop them"
            )
        try:
            return torch.tensor([[int(t) for t in args.input_ids.split(",")]])
        except ValueError:
            raise ConfigError(
                f"--input-ids {args.input_ids!r}: expected comma-separated token "
                "ids, e.g. 1,15043,3186"
            ) from None
    return (args.batch or RANDOM_INPUT["batch"], args.seq_len or RANDOM_INPUT["seq_len"])


def _check_context(checkpoint: str, tokens: int) -> None:
    from coordinator.planning.checkpoint import read_config
    from coordinator.planning.context import beyond_context

    if context := beyond_context(read_config(checkpoint), tokens):
        raise NeverFitsError(
            f"{tokens} input tokens exceed the model's context of {context}: "
            "lower --seq-len or pass fewer --input-ids"
        )


def _untested(family: str) -> str:
    from worker.layout import TESTED_FAMILIES

    if family in TESTED_FAMILIES:
        return ""
    # launch() refuses an untested family whose split failed coordinator/family_check.py
    return (
        " (a family not tested against transformers; self-checked before launch: split "
        "into stages, a small copy gave the whole model's logits bitwise)"
    )


def quantized_weights(job) -> dict:
    """The parameters (name -> block format) the job quantized at load (`--offload-dtype fp8
    / int8` on its prefetching stages): what the reference must quantize too to compute with
    the same weights. An FP8 checkpoint kept as published needs nothing: its 8-bit weights are
    the file's, as transformers reads them."""
    from worker.spec import requantized_formats

    dtype = job.plan.options.offload_dtype
    if dtype not in ("fp8", "int8"):
        return {}
    layers = {layer.name: layer for layer in job.index.layers}
    out = {}
    for stage in job.plan.stages:
        if stage.backend != "prefetch":
            continue
        for name in stage.offloaded:
            out.update(requantized_formats(layers[name].unit_tensors(stage.offload_unit), dtype))
    return out


def _check(job, config: JobConfig, ids, logits) -> int:
    """Compare with transformers loading the same files in the same dtype, in one process with
    the workers' thread count: bitwise equal is expected (same code, same weights); in
    bfloat16 / float16 a difference within two units of rounding at the logits' scale passes."""
    import torch

    from coordinator.tools.reference import reference_logits

    quantized = quantized_weights(job)
    expected = reference_logits(
        config.checkpoint,
        ids,
        dtype=job.index.dtype,
        attn_implementation=config.attn_implementation,
        num_threads=config.cpus_per_worker,
        quantized=quantized,
    )
    where = f"transformers in one process ({job.index.dtype})"
    if quantized:
        where += (
            f", with the {len(quantized)} weights the job keeps in {config.offload_dtype} "
            "quantized and back as its workers hold them"
        )
    if torch.equal(logits, expected):
        print(f"check: logits are bitwise equal to {where}")
        return 0
    diff = float((logits.float() - expected.float()).abs().max())
    tolerance = 0.0
    if expected.dtype != torch.float32:
        tolerance = 2 * torch.finfo(expected.dtype).eps * float(expected.float().abs().max())
    if diff <= tolerance:
        print(
            f"check: logits within {job.index.dtype} rounding of {where} "
            f"(max abs difference {diff:.3e} <= {tolerance:.3e})"
        )
        return 0
    print(f"check FAILED: max abs difference {diff:.3e} from {where}")
    return EXIT_MISMATCH


def stage_table(reports: Sequence[StageSnapshot]) -> str:
    from coordinator.planning.formats import format_bytes, layer_range

    rows = [
        (
            "stage",
            "host",
            "gpu",
            "device",
            "layers",
            "resident",
            "offloaded",
            "backend",
            "pin",
            "decided by",
        )
    ]
    for r in reports:
        rows.append(
            (
                str(r.stage),
                r.hostname,
                r.gpu or "-",
                r.device,
                layer_range(r.layers),
                format_bytes(r.stats.resident_bytes),
                f"{format_bytes(r.stats.offloaded_bytes)} ({len(r.offloaded)}"
                f"{'' if r.offload_unit == 'layer' else ' x ' + r.offload_unit})"
                + (f", {r.offload_format}" if r.offload_format else "")
                + (
                    f", quantization error {r.quantization_error:.2%} (relative RMS)"
                    if r.quantization_error
                    else ""
                ),
                r.backend,
                "on" if r.pin.pin else "off",
                f"{r.pin_origin}: {r.pin.source}: {r.pin.reason}",
            )
        )
    from coordinator.tables import render

    return render(rows)


def _report_memory(job, args: argparse.Namespace) -> None:
    import json

    from coordinator.runtime import telemetry

    reports = job.telemetry()
    print(telemetry.render(reports, job.events))
    if args.memory_json:
        with open(args.memory_json, "w") as f:
            json.dump(telemetry.summary(reports, job.events), f, indent=1)
        print(f"memory snapshot written to {args.memory_json}")
    if args.plot:
        telemetry.plot(reports, args.plot)
        print(f"memory plot written to {args.plot}")


def cmd_named(args: argparse.Namespace) -> int:
    if args.command == "status":
        import json

        from coordinator.runtime import telemetry
        from coordinator.runtime.launch import attach

        with attach(args.name, address=args.address) as job:
            reports, events = job.telemetry(), job.events
            serving = job.serving_stats()
        if args.json:
            print(json.dumps({**telemetry.summary(reports, events), "serving": serving}, indent=1))
        else:
            print(telemetry.render(reports, events, (serving or {}).get("generation_tokens")))
            print(telemetry.serving_line(serving))
        if args.plot:
            telemetry.plot(reports, args.plot)
            print(f"memory plot written to {args.plot}", file=sys.stderr)
        return 0
    # `list` and `unload` only read and remove records and actors: no worker code, no torch
    # (test_named_loads runs `list` in a process of its own and checks it).
    from coordinator.runtime import registry
    from coordinator.runtime.session import connect

    session = connect(JobConfig(checkpoint="-", address=args.address or "auto"))
    try:
        if args.command == "list":
            names = registry.list_loads()
            print("\n".join(names) if names else "no named loads")
            return 0
        killed = registry.unload(args.name)
        print(f"unloaded {args.name!r}: {killed} workers released")
        return 0
    finally:
        session.close()
