"""The last stage's token choice: `worker.decode.sample_rows` (every row at once on the logits'
device, a sampled draw keyed by seed and position) against what it replaced, a loop over the
rows, each copying its logits to the CPU and drawing from its own torch.Generator whose state
(~5 KB) crossed Ray with every step. Same logits, same process, best of 5. Then what the
logits processors add to a step of sampled rows: penalties over each row's 1,024 tokens so
far, a logit bias, min-p, a guide's bitmask, each alone and all at once (interleaved rounds,
medians: this machine's noise is larger than the best-of-5 gaps).

    .venv/bin/python bench/sampling.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.decode import RowSettings, sample_rows
from worker.guided import words_for
from worker.steps import Sampling

ROWS, VOCAB, REPEATS = 64, 32000, 5
ROUNDS = 21  # of the processors' cases
HISTORY = 1024  # each row's tokens so far (prompt and output), for the penalties


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


def processed() -> None:
    """Each processor's cost on top of plain sampled rows (t=0.8, top_p=0.9), same logits."""
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(1)) * 3).to(
        torch.bfloat16
    )
    g = torch.Generator().manual_seed(2)
    histories = [torch.randint(0, VOCAB, (HISTORY,), generator=g).tolist() for _ in range(ROWS)]
    bias = tuple((t, 2.0) for t in range(0, VOCAB, VOCAB // 10))
    masks = torch.randint(-(2**31), 2**31 - 1, (ROWS, words_for(VOCAB)), dtype=torch.int32)
    base = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}
    cases = {
        "plain": (Sampling(**base), None),
        "repetition_penalty 1.1": (Sampling(**base, repetition_penalty=1.1), None),
        "frequency + presence": (
            Sampling(**base, frequency_penalty=0.5, presence_penalty=0.5),
            None,
        ),
        "logit_bias (10 tokens)": (Sampling(**base, logit_bias=bias), None),
        "min_p 0.05": (Sampling(**base, min_p=0.05), None),
        "guide bitmask": (Sampling(**base, guide="x"), masks),
        "all of them": (
            Sampling(
                **base,
                repetition_penalty=1.1,
                frequency_penalty=0.5,
                presence_penalty=0.5,
                logit_bias=bias,
                min_p=0.05,
                guide="x",
            ),
            masks,
        ),
    }
    settings = {
        name: RowSettings.of(
            [sampling] * ROWS,
            list(range(ROWS)),
            [HISTORY] * ROWS,
            histories=histories,
            output_from=[HISTORY // 2] * ROWS,
            allowed=allowed,
        )
        for name, (sampling, allowed) in cases.items()
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):  # the cases in turn, round after round: drift hits them alike
        for name, one in settings.items():
            start = time.perf_counter()
            sample_rows(logits, one)
            times[name].append(time.perf_counter() - start)
    print(
        f"what processing adds: {ROWS} sampled rows, {HISTORY} tokens each so far, median of "
        f"{ROUNDS} interleaved rounds:"
    )
    plain = statistics.median(times["plain"])
    for name, taken in times.items():
        took = statistics.median(taken)
        print(f"  {name:26s} {took * 1e3:7.2f} ms   x{took / plain:.2f} of plain")


if __name__ == "__main__":
    main()
    processed()
