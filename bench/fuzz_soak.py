"""Fuzz soak of the HTTP front: tests/test_fuzz_serving.py's fuzzing, longer (issue 53).

One `offloadctl serve` of the tests' tiny llama (as the test serves it: one logical GPU of 8 MiB,
--max-seq-len 64, --max-batch 4) on an embedded Ray. Hypothesis draws --bodies request bodies
for /v1/completions and /v1/chat/completions (wrong types, out-of-range and non-finite numbers,
huge and empty values, unknown fields, junk messages, malformed JSON, lone surrogates, wrong
content types: the test's strategies, from a random seed unless --seed), and a pool of
--concurrency threads keeps that many in flight, while innocent greedy requests (completions,
streamed completions, chat) run beside them over and over. Reported:

  bodies/s       - fuzzed bodies answered per second of the soak
  statuses       - how many got each HTTP status ("none": no answer, a dropped connection)
  latency        - of the fuzzed bodies' answers (a stream's to its end): p50, p99, max
  broken         - bodies whose answer broke the rules: a 5xx, no answer, a 4xx not in OpenAI's
                   error shape, a stream without its [DONE] (the first few are printed)
  innocents      - requests of each kind, and whether every text equals transformers' greedy
                   text for its prompt alone
  /health        - its status afterwards

Exit status 1 when any body broke the rules, an innocent text differed, or /health failed.
About 2 minutes for 20,000 bodies on 2 cores, plus the server's start.

    python bench/fuzz_soak.py [--bodies 20000] [--concurrency 12] [--seed N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test's strategies and server, as it runs them

from test_fuzz_serving import (  # noqa: E402
    BATCH,
    CONCURRENCY,
    SERVE_FLAGS,
    Fuzzer,
    Innocents,
    chosen_bodies,
    expected_texts,
    health,
    port_of,
    send_fuzzed,
)
from test_serving import serving  # noqa: E402

from bench.generate import machine  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def soak(bodies: int, concurrency: int, random_seed: int) -> dict:
    with (
        tempfile.TemporaryDirectory(prefix="fuzz-soak-") as tmp,
        serving(Path(tmp), *SERVE_FLAGS) as server,
    ):
        expected = expected_texts(server.checkpoint)
        port = port_of(server.base)
        fuzzer = Fuzzer(port, server.key, concurrency)
        start = time.monotonic()
        with Innocents(port, server.key) as innocents:
            for sent in chosen_bodies():
                fuzzer.submit(sent)
            send_fuzzed(fuzzer, math.ceil(bodies / BATCH), random_seed)
            tally = fuzzer.drain()
        seconds = time.monotonic() - start
        status = health(server.base)
    unequal = {
        f"{kind} {prompt!r}": sorted(set(texts))
        for (kind, prompt), texts in innocents.texts.items()
        if set(texts) != {expected[kind, prompt]}
    }
    return {
        "machine": machine(),
        "seed": random_seed,
        "concurrency": concurrency,
        "bodies": tally.sent,
        "seconds": round(seconds, 1),
        "bodies_per_s": round(tally.sent / seconds, 1),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items(), key=str)},
        "latency_s": {
            "p50": round(statistics.median(tally.seconds), 3),
            "p99": round(percentile(tally.seconds, 0.99), 3),
            "max": round(max(tally.seconds), 3),
        },
        "broken": [f"{sent!r} -> {why}" for sent, why in tally.broken],
        "innocent_requests": {
            kind: sum(len(t) for (k, _), t in innocents.texts.items() if k == kind)
            for kind in Innocents.KINDS
        },
        "innocent_problems": innocents.problems,
        "innocent_texts_equal": not unequal and not innocents.problems,
        "innocent_unequal": unequal,
        "health": status,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=20_000, help="fuzzed bodies to send")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="bodies in flight")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis' seed (random)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    random_seed = args.seed if args.seed is not None else random.randrange(2**32)
    result = soak(args.bodies, args.concurrency, random_seed)
    print(f"machine: {result['machine']}; seed {result['seed']}, concurrency {args.concurrency}")
    print(
        f"{result['bodies']} bodies in {result['seconds']} s: {result['bodies_per_s']} bodies/s; "
        f"statuses {result['statuses']}"
    )
    latency = result["latency_s"]
    print(f"latency p50 {latency['p50']} s, p99 {latency['p99']} s, max {latency['max']} s")
    print(f"broken: {len(result['broken'])}")
    for line in result["broken"][:10]:
        print(f"  {line}")
    print(
        f"innocent requests {result['innocent_requests']}, texts equal: "
        f"{'yes' if result['innocent_texts_equal'] else 'NO'}"
    )
    for line in [*result["innocent_problems"][:10], *result["innocent_unequal"].items()]:
        print(f"  {line}")
    print(f"/health afterwards: {result['health']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    ok = not result["broken"] and result["innocent_texts_equal"] and result["health"] == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
