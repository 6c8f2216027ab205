"""The last stage's token choice: `worker.decode.sample_rows` (every row at once on the logits'
device, a sampled draw keyed by seed and position) against what it replaced, a loop over the
rows, each copying its logits to the CPU and drawing from its own torch.Generator whose state
(~5 KB) crossed Ray with every step. Same logits, same process, best of 5.

    .venv/bin/python bench/sampling.py
"""

from __future__ import annotations

import time

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.decode import RowSettings, sample_rows
from worker.steps import Sampling

ROWS, VOCAB, REPEATS = 64, 32000, 5


def per_row_loop(logits: torch.Tensor, samplings, states: list[torch.Tensor]) -> torch.Tensor:
    """The replaced path: per row, its logits to the CPU, transformers' warpers, a draw from
    the row's own generator, whose state goes back afterwards."""
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    after = []
    for r, (sampling, state) in enumerate(zip(samplings, states, strict=True)):
        generator = torch.Generator()
        generator.set_state(state.clone())
        scores = logits[r : r + 1].to(dtype=torch.float32, copy=True).cpu()
        if sampling.temperature != 1.0:
            scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
        if sampling.top_k:
            scores = TopKLogitsWarper(top_k=sampling.top_k)(None, scores)
        if sampling.top_p < 1.0:
            scores = TopPLogitsWarper(top_p=sampling.top_p)(None, scores)
        probs = torch.softmax(scores, dim=-1)
        tokens[r] = torch.multinomial(probs, num_samples=1, generator=generator)[0, 0]
        after.append(generator.get_state())
    torch.stack(after)
    return tokens


def best(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3).to(
        torch.bfloat16
    )
    cases = {
        "t=0.8 top_k=50 top_p=0.9": Sampling(do_sample=True, temperature=0.8, top_k=50, top_p=0.9),
        "t=0.8 top_p=0.9": Sampling(do_sample=True, temperature=0.8, top_p=0.9),
        "t=1 (no warpers)": Sampling(do_sample=True),
    }
    states = [torch.Generator().manual_seed(r).get_state() for r in range(ROWS)]
    print(f"{ROWS} rows x {VOCAB} vocab, CPU, {torch.get_num_threads()} thread(s), best of 5:")
    for name, sampling in cases.items():
        samplings = [sampling] * ROWS
        settings = RowSettings.of(samplings, list(range(ROWS)), [100] * ROWS)
        new = best(lambda settings=settings: sample_rows(logits, settings))
        old = best(lambda samplings=samplings: per_row_loop(logits, samplings, states))
        print(
            f"  {name:26s} sample_rows {new * 1e3:7.2f} ms   per-row loop {old * 1e3:7.2f} ms"
            f"   x{old / new:.1f}"
        )


if __name__ == "__main__":
    main()
