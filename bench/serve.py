"""Serving benchmark: `offloadctl serve` under 1, 8, 32 and 128 concurrent clients of the
official `openai` client, as vLLM's serving benchmark runs it.

One random-weight Llama checkpoint with its tokenizer (`make_checkpoint`: 8 layers, hidden 512,
float32, 106 MiB), served on an embedded Ray with one logical GPU whose budget keeps 40% of the
decoder weights resident (the rest offloaded) and `--max-batch auto` (sized from what the
budget leaves beside the weights, for 128-token sequences), default queue (1024). For each
concurrency C, C client threads each send --requests-per-client streamed completions one after
another (distinct prompts, --max-tokens tokens, temperature 0, `stream_options.include_usage`),
all starting at once:

  output tokens/s - completion tokens of every request / wall time of the level
  TTFT            - request sent -> first streamed text (p50, p99)
  ITL             - between two streamed chunks of a request (p50, p99)
  errors          - requests that did not end with 200 and a finish reason (429 included)

Target: 0 errors at 128 clients with the default queue; tokens/s growing with clients until
memory (the batch) or compute bounds it. About 4 minutes on 2 cores (--quick: 1).

`--blocks`: the KV pool in blocks against slots of max_seq_len, in one run. Two servers, one
after the other, on the same GPU budget and the same KV pool: N x max_seq_len tokens (N = 4,
max_seq_len 1024), i.e. what N slots of max_seq_len would take. "slots" runs at most N
sequences at once (--max-batch N: what a slot per sequence allowed); "blocks" runs --max-batch
auto (what the pool holds at the expected length, a quarter of max_seq_len). 32 clients at once
send one short streamed completion each (prompt + max_tokens <= max_seq_len / 4). Reported: the
most sequences running at once (sampled from /metrics every 50 ms; target >= 3N), output
tokens/s blocks / slots (target >= 2), and at steady state (the samples where the most
sequences run) the tokens the pool's blocks hold / the positions of the blocks in use (target
>= 0.9). Each greedy text of "blocks" must equal the same request's text of "slots".

    python bench/serve.py [--quick] [--clients 1,8,32,128] [--blocks] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.batching import RESIDENT_SHARE, budget_for
from bench.workload import bench_shape
from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import make_checkpoint
from worker.spec import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

MIB = 2**20
MAX_SEQ_LEN = 128
START_TIMEOUT_S = 300.0
OFFLOADCTL = str(Path(sys.executable).with_name("offloadctl"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    checkpoint: str,
    budget: int,
    port: int,
    key: str,
    log: Path,
    *,
    max_seq_len: int = MAX_SEQ_LEN,
    max_batch: str = "auto",
    extra: tuple[str, ...] = (),
):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OFFLOAD_API_KEY"] = key
    proc = subprocess.Popen(
        [
            OFFLOADCTL,
            "serve",
            "--checkpoint",
            checkpoint,
            "--gpus",
            "1",
            "--gpu-memory",
            str(budget),
            "--port",
            str(port),
            "--max-seq-len",
            str(max_seq_len),
            "--max-batch",
            max_batch,
            *extra,
        ],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115 (the server outlives this call; closed with it)
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        match = re.search(r"KV pool of \d+ tokens for up to (\d+) sequences", log.read_text())
        if match:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}
                )
                with urllib.request.urlopen(request, timeout=5):
                    return proc, int(match.group(1))
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
        time.sleep(1)


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own process group only
            proc.wait(timeout=30)


def level(
    base: str,
    key: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    *,
    prompt=lambda c, r: f"client {c} request {r}: tell me a story about cats",
    expected=None,
    texts: dict | None = None,
) -> dict:
    """C clients at once, each sending `per_client` streamed completions of `prompt(c, r)`
    one after another. With `expected(c, r)`, each completion's text is compared with it
    ("wrong" counts those that differ); `texts` gets each one's text by (c, r)."""
    import openai

    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=600)
    ttft, itl, tokens, errors, wrong = [], [], [], [], []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def one(c: int) -> None:
        barrier.wait()
        for r in range(per_client):
            sent = time.perf_counter()
            stamps, usage, finish, text = [], None, None, []
            try:
                stream = client.completions.create(
                    model="llama",
                    prompt=prompt(c, r),
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        stamps.append(time.perf_counter())
                        text.append(chunk.choices[0].text)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
            except Exception as exc:  # counted, with its kind
                with lock:
                    errors.append(type(exc).__name__)
                continue
            with lock:
                if finish is None or usage is None:
                    errors.append("no finish")
                    continue
                if expected is not None and "".join(text) != expected(c, r):
                    wrong.append((c, r))
                if texts is not None:
                    texts[c, r] = "".join(text)
                tokens.append(usage)
                if stamps:
                    ttft.append(stamps[0] - sent)
                    itl.extend(b - a for a, b in itertools.pairwise(stamps))

    threads = [threading.Thread(target=one, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start

    def pct(values: list[float], q: float) -> float | None:
        return (
            statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values or [None])[0]
        )

    return {
        "clients": clients,
        "requests": clients * per_client,
        "wall_s": wall,
        "tokens_per_s": sum(tokens) / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "wrong": len(wrong),
    }


class MetricsSampler:
    """Polls a server's /metrics every `period_s` in a thread: each sample the gauges named."""

    NAMES = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "offload:kv_cache_blocks_used",
        "offload:kv_cache_tokens_used",
        "vllm:num_preemptions_total",
    )

    def __init__(self, base: str, key: str, period_s: float = 0.05) -> None:
        self.url = base.removesuffix("/v1") + "/metrics"
        self.key, self.period_s = key, period_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        request = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.key}"})
        while not self._stop.wait(self.period_s):
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue
            sample = {}
            for line in text.splitlines():
                name, _, value = line.partition("{")
                if name in self.NAMES:
                    sample[name] = float(value.rsplit(" ", 1)[1])
            sample["t"] = time.perf_counter()
            self.samples.append(sample)


def blocks_against_slots(checkpoint: str, index, tmp: Path, quick: bool) -> dict:
    """The `--blocks` comparison (see the module doc): one server per mode, in turn."""
    n, max_seq_len, clients = (2, 256, 16) if quick else (4, 1024, 32)
    pool = n * max_seq_len
    decoders = [x for x in index.layers if x.kind == "decoder"]
    budget = int(
        sum(x.nbytes for x in index.layers if x.kind != "decoder")
        + sum(x.nbytes for x in decoders) * RESIDENT_SHARE
        + max(x.nbytes for x in decoders)
        + sum(x.pool_bytes(n, pool) for x in index.layers)
    )
    max_tokens = max_seq_len // 4 - 32  # + a prompt of fewer than 32 tokens: a quarter at most
    out: dict = {"n": n, "max_seq_len": max_seq_len, "pool_tokens": pool, "clients": clients}
    texts: dict[str, dict] = {}
    for mode, batch in (("slots", str(n)), ("blocks", "auto")):
        port, key = free_port(), secrets.token_hex(16)
        proc, chosen = start_server(
            checkpoint,
            budget,
            port,
            key,
            tmp / f"{mode}.log",
            max_seq_len=max_seq_len,
            max_batch=batch,
            extra=("--kv-cache-tokens", str(pool)),
        )
        try:
            base = f"http://127.0.0.1:{port}/v1"
            level(base, key, 2, 1, 4)  # warm-up
            got: dict = {}
            with MetricsSampler(base, key) as sampler:
                row = level(
                    base,
                    key,
                    clients,
                    1,
                    max_tokens,
                    prompt=lambda c, r: f"client {c}: tell me a story about cats",
                    texts=got,
                )
            texts[mode] = got
        finally:
            stop_server(proc)
        samples = sampler.samples
        running = [s.get("vllm:num_requests_running", 0) for s in samples]
        # steady state: the batch at its largest, the pool in use
        steady = [
            s["offload:kv_cache_tokens_used"] / (s["offload:kv_cache_blocks_used"] * BLOCK_SIZE)
            for s in samples
            if s.get("offload:kv_cache_blocks_used")
            and s.get("vllm:num_requests_running", 0) >= max(running, default=0)
        ]
        out[mode] = {
            **row,
            "max_batch": chosen,
            "most_running": max(running, default=0),
            "fill_median": statistics.median(steady) if steady else None,
            "fill_samples": len(steady),
            "samples": samples,
            "preemptions": max(
                (s.get("vllm:num_preemptions_total", 0) for s in samples), default=0
            ),
        }
    out["ratio"] = out["blocks"]["tokens_per_s"] / out["slots"]["tokens_per_s"]
    out["differ"] = sum(texts["blocks"][k] != texts["slots"].get(k) for k in texts["blocks"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 and 8 clients")
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--blocks", action="store_true", help="only the KV blocks against slots comparison"
    )
    args = parser.parse_args(argv)
    shape = bench_shape(args.quick)
    if args.blocks:
        return main_blocks(shape, args)
    if args.quick:
        args.clients, args.max_tokens = "1,8", 16
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    rows, proc = [], None
    try:
        checkpoint = str(make_checkpoint(tmp / "llama", shape))
        index = load_index(checkpoint)
        budget = budget_for(index, 1, MAX_SEQ_LEN)  # sized for 16 sequences of MAX_SEQ_LEN
        port, key = free_port(), secrets.token_hex(16)
        proc, batch = start_server(checkpoint, budget, port, key, tmp / "serve.log")
        base = f"http://127.0.0.1:{port}/v1"
        level(base, key, 2, 1, 4)  # warm-up
        for clients in (int(c) for c in args.clients.split(",")):
            rows.append(level(base, key, clients, args.requests_per_client, args.max_tokens))
            r = rows[-1]
            print(
                f"{clients} clients: {r['tokens_per_s']:.1f} tokens/s, errors {r['errors']}",
                flush=True,
            )
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\nmachine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB; model {index.total_bytes / MIB:.1f} "
        f"MiB, GPU budget {budget / MIB:.1f} MiB, max_batch auto = {batch}, max_seq_len "
        f"{MAX_SEQ_LEN}; {args.requests_per_client} streamed requests per client, "
        f"{args.max_tokens} tokens each; total {time.perf_counter() - started:.0f} s\n"
    )

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    print(
        "| clients | requests | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
        "ITL p99 ms | errors |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
            f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {ms(r['itl_p50_s'])} | "
            f"{ms(r['itl_p99_s'])} | {r['errors']} {' '.join(r['error_kinds'])} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if any(r["errors"] for r in rows) else 0


def main_blocks(shape, args) -> int:
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        checkpoint = str(make_checkpoint(tmp / "llama", shape))
        index = load_index(checkpoint)
        out = blocks_against_slots(checkpoint, index, tmp, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = out["n"]
    print(
        f"\nmachine: {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB; model {index.total_bytes / MIB:.1f} "
        f"MiB; KV pool {out['pool_tokens']} tokens (N = {n} slots of max_seq_len "
        f"{out['max_seq_len']}); {out['clients']} clients, one streamed request each; total "
        f"{time.perf_counter() - started:.0f} s\n"
    )
    print(
        "| mode | max_batch | most running at once | output tokens/s | TTFT p50 ms | "
        "ITL p50 ms | pool fill (steady) | preemptions | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in ("slots", "blocks"):
        r = out[mode]
        fill = "-" if r["fill_median"] is None else f"{r['fill_median']:.3f}"
        print(
            f"| {mode} | {r['max_batch']} | {r['most_running']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['ttft_p50_s'] * 1e3:.0f} | {r['itl_p50_s'] * 1e3:.0f} | {fill} | "
            f"{r['preemptions']:.0f} | {r['errors']} |"
        )
    blocks = out["blocks"]
    print(
        f"\nrunning at once: {blocks['most_running']:.0f} (target >= 3N = {3 * n}); tokens/s "
        f"blocks / slots = {out['ratio']:.2f} (target >= 2); pool fill at steady state "
        f"{blocks['fill_median'] or 0:.3f} over {blocks['fill_samples']} samples (target >= "
        f"0.9); texts that differ between the modes: {out['differ']}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    failed = out["differ"] or out["slots"]["errors"] or blocks["errors"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
