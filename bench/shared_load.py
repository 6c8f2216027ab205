"""One named load, two kinds of client in other processes at once: 128 concurrent `openai`
clients through `serve NAME` (the Ray Serve replica is one process) and a loop of
`attach(NAME).generate` in a Ray task (another process). Both go through the load's one engine
(in its keeper): one queue, one set of KV slots. Every text must be right: each streamed
completion equals `transformers`' greedy text for its prompt alone (same files, float32, one
process), and each of the loop's outputs its greedy tokens.

A small random-weight Llama with its tokenizer (`make_checkpoint`, the benchmarks' --quick
shape), on an embedded Ray with one logical GPU, `max_batch` 8, 16 distinct prompts.

  errors     - requests that did not end with 200 and a finish reason (429 included)
  wrong      - completions or loop outputs whose text or tokens differ from transformers'
  tokens/s   - completion tokens of the clients / wall time, and the TTFT and ITL percentiles
  engine     - the load's engine's own count of requests: clients + the loop's, one engine

    .venv/bin/python bench/shared_load.py [--clients 128] [--requests-per-client 2]
                                          [--max-tokens 24] [--json F]
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generate import machine
from bench.serve import free_port, level
from bench.workload import bench_shape
from coordinator.config import JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime import registry
from coordinator.runtime.launch import attach, launch
from coordinator.serving import app
from coordinator.serving.bridge import bind
from coordinator.serving.text import end_ids, load_tokenizer
from coordinator.tools.make_checkpoint import make_checkpoint

NAME = "shared"
PROMPTS = [f"request {i}: tell me a story about cats and {i} dogs" for i in range(16)]
LOOP_ROUNDS = 3  # the loop generates every prompt this many times


def references(checkpoint: str, tokenizer, eos: tuple[int, ...], max_tokens: int):
    """Each prompt's ids, greedy new tokens (up to and without an end token) and their text,
    from transformers alone."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            new = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
            )[0, len(ids) :].tolist()
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))
        out.append((ids, new[:cut], tokenizer.decode(new[:cut], skip_special_tokens=True)))
    return out


@ray.remote(num_cpus=0)
def generate_loop(name: str, prompts: list[list[int]], max_tokens: int, eos: list[int]):
    """Another process: attach to the load and generate every prompt, LOOP_ROUNDS times."""
    outs = []
    with attach(name) as job:
        for _ in range(LOOP_ROUNDS):
            for ids in prompts:
                new = job.generate(
                    torch.tensor([ids]),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                )[0, len(ids) :].tolist()
                cut = next((i for i, t in enumerate(new) if t in eos), len(new))
                outs.append(new[:cut])
    return outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    try:
        checkpoint = str(make_checkpoint(tmp / "llama", bench_shape(quick=True)))
        index = load_index(checkpoint)
        tokenizer = load_tokenizer(checkpoint)
        eos = end_ids(tokenizer, index)
        refs = references(checkpoint, tokenizer, eos, args.max_tokens)
        ray.init(
            address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False
        )
        try:
            config = JobConfig(
                checkpoint=checkpoint,
                gpu_memory_bytes=index.total_bytes * 2,
                max_batch=8,
                max_seq_len=64,
                snapshot_interval_s=0,
            )
            launch(config, name=NAME).close()  # stays loaded (this process holds the Ray)
            port, key = free_port(), secrets.token_hex(16)
            served = app.start(
                [NAME], "llama", app_id="bench", sock=bind("127.0.0.1", port), api_key=key
            )
            loop = generate_loop.remote(NAME, [r[0] for r in refs], args.max_tokens, list(eos))
            per = args.requests_per_client
            row = level(
                f"http://127.0.0.1:{port}/v1",
                key,
                args.clients,
                per,
                args.max_tokens,
                prompt=lambda c, r: PROMPTS[(c * per + r) % len(PROMPTS)],
                expected=lambda c, r: refs[(c * per + r) % len(PROMPTS)][2],
            )
            looped = ray.get(loop, timeout=1800)
            row["loop_requests"] = len(looped)
            row["loop_wrong"] = sum(
                out != refs[i % len(PROMPTS)][1] for i, out in enumerate(looped)
            )
            with attach(NAME) as job:
                stats = job.serving_stats()
            row["engine_requests"] = stats["requests"]
            row["engine_tokens"] = stats["generation_tokens"]
            served.stop()
            registry.unload(NAME)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{row['clients']} openai clients ({row['requests']} streamed requests) + a generate "
        f"loop ({row['loop_requests']} requests) in other processes, one load: errors "
        f"{row['errors']} {row['error_kinds']}, wrong texts {row['wrong']}, wrong loop outputs "
        f"{row['loop_wrong']}; {row['tokens_per_s']:.0f} tokens/s to the clients, TTFT p50/p99 "
        f"{row['ttft_p50_s']:.3f}/{row['ttft_p99_s']:.3f} s, ITL p50/p99 "
        f"{row['itl_p50_s']:.4f}/{row['itl_p99_s']:.4f} s; the load's one engine counted "
        f"{row['engine_requests']} requests",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 1 if row["errors"] or row["wrong"] or row["loop_wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
