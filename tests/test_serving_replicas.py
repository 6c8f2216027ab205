"""`offloadctl serve` with two replicas: two pipelines on their own GPUs, two named loads, one
Ray Serve deployment of two replicas whose router spreads the requests; every completion is
transformers' greedy text, whichever replica answered it (`x-offload-load`)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from test_serving import greedy_text, serving


def test_two_replicas_share_the_requests(tmp_path) -> None:
    from transformers import AutoTokenizer

    with serving(
        tmp_path,
        "--gpus",
        "2",
        "--gpu-memory",
        "8MiB",
        "--max-seq-len",
        "64",
        "--max-batch",
        "2",
        "--replicas",
        "2",
    ) as served:
        deadline = time.monotonic() + 60  # said once every replica is up
        while "2 replicas (loads 'serve-" not in served.log_path.read_text():
            assert time.monotonic() < deadline, served.log()
            time.sleep(0.5)
        tokenizer = AutoTokenizer.from_pretrained(served.checkpoint)
        prompts = [f"request number {i} of many" for i in range(8)]

        def complete(prompt: str) -> tuple[str, str]:
            body = json.dumps(
                {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            ).encode()
            request = urllib.request.Request(
                f"{served.base}/completions",
                data=body,
                headers={
                    "Authorization": f"Bearer {served.key}",
                    "Content-Type": "application/json",
                },
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                load = response.headers["x-offload-load"]
                return load, json.loads(response.read())["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        for prompt, (_, text) in zip(prompts, answers, strict=True):
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            assert text == greedy_text(served.checkpoint, tokenizer, ids, 6)
        loads = {load for load, _ in answers}
        assert len(loads) == 2 and all(load.endswith(("-0", "-1")) for load in loads), answers
