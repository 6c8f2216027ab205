"""The engine where its bookkeeping could give a wrong answer without an error, against
transformers on the same files (float32, one process, in-process workers on two stages):
log-probabilities of a sequence preempted and fed again (each once, the values of its
logits), a prompt's log-probabilities where its prefix is in the cache, the blocks a cancelled request freed (reused by the next request, and
its cached prefix read by another), and a request of rows of different lengths."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, Pipeline, family_shape
from test_generation import MAX_SEQ_LEN, PREEMPTING, REQUESTS, TWO_STAGES, WAIT_S, alone

from coordinator.engine import Engine, EngineConfig
from coordinator.engine.engine import model_steps
from coordinator.engine.pipelines import LocalPipeline
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_logits
from worker.steps import Sampling


@pytest.fixture(scope="module")
def index_of(tmp_path_factory):
    """family -> its float32 test checkpoint's index (written once per module)."""
    cache: dict[str, CheckpointIndex] = {}

    def get(family: str) -> CheckpointIndex:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"edges-{family}") / "ckpt"
            cache[family] = load_index(make_checkpoint(root, family_shape(family)))
        return cache[family]

    return get


def prompt_of(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def log_softmax_of(index: CheckpointIndex, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities (positions, vocab) over `tokens`."""
    logits = reference_logits(str(index.root), torch.tensor([tokens]), num_threads=1)[0]
    return torch.log_softmax(logits.float(), dim=-1)


class Running:
    """An engine over two in-process stages of `index`; closed (engine, then workers) on exit."""

    def __init__(self, index: CheckpointIndex, **config) -> None:
        self.pipeline = Pipeline(index, *TWO_STAGES)
        settings = {"num_slots": 3, "max_seq_len": MAX_SEQ_LEN, **model_steps(index), **config}
        try:
            self.engine = Engine(LocalPipeline(self.pipeline.workers), EngineConfig(**settings))
        except BaseException:
            self.pipeline.close()
            raise

    def __enter__(self) -> Engine:
        return self.engine

    def __exit__(self, *exc) -> None:
        try:
            self.engine.close()
        finally:
            self.pipeline.close()


def assert_scored_as_transformers(index, prompt, tokens, scores, top: int, prompt_top) -> None:
    """`scores` (Logprobs, as they came) hold each generated token's log-probability once, in
    order, with its `top` most likely, and with `prompt_top` each prompt position's once
    (from 1): all transformers' log_softmax values and top ids."""
    logp = log_softmax_of(index, prompt + tokens)
    prompt_part = [s for s in scores if s.start < len(prompt)]
    token_part = [s for s in scores if s.start >= len(prompt)]
    if prompt_top is None:
        assert prompt_part == []
    else:
        positions = [s.start + i for s in prompt_part for i in range(len(s))]
        assert positions == list(range(1, len(prompt)))  # each once, in order
        values = torch.tensor([v for s in prompt_part for v in s.logprobs])
        rows = torch.arange(len(prompt) - 1)
        assert torch.allclose(values, logp[rows, torch.tensor(prompt[1:])], atol=1e-5, rtol=0)
        want = torch.topk(logp[rows], prompt_top, dim=-1).indices.tolist()
        assert [list(t) for s in prompt_part for t in s.top_ids] == want
    assert [s.start for s in token_part] == list(range(len(prompt), len(prompt) + len(tokens)))
    assert [s.token_ids[0] for s in token_part] == tokens
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    values = torch.tensor([s.logprobs[0] for s in token_part])
    assert torch.allclose(values, logp[rows, torch.tensor(tokens)], atol=1e-5, rtol=0)
    want = torch.topk(logp[rows], top, dim=-1).indices.tolist()
    assert [list(s.top_ids[0]) for s in token_part] == want


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_preempted_sequence_gets_each_log_probability_once_with_transformers_values(
    index_of, family: str
) -> None:
    """test_generation's joining requests (each joins when the one before has made a few
    tokens) in a pool that holds one sequence (10 blocks of 4), one step per call: sequences
    are preempted and fed again from their start. Each request's text is transformers'
    alone, and its prompt's and tokens' log-probabilities come once each, with transformers'
    values, however often it was fed."""
    index = index_of(family)
    prompts = [prompt_of(seed, n) for seed, (n, _, _) in enumerate(REQUESTS)]
    scores: list[list] = [[] for _ in REQUESTS]
    requests = []
    with Running(index, **PREEMPTING) as engine:

        def submit(i: int) -> None:
            made = [0]

            def on_token(row: int, token: int) -> None:
                made[0] += 1
                if i + 1 < len(REQUESTS) and made[0] == REQUESTS[i + 1][2]:
                    submit(i + 1)  # from the engine's thread: it joins at this very step

            requests.append(
                engine.submit(
                    [prompts[i]],
                    sampling=Sampling(),
                    max_new_tokens=REQUESTS[i][1],
                    logprobs=2,
                    prompt_logprobs=1,
                    on_logprobs=lambda row, lp: scores[i].append(lp),
                    on_token=on_token,
                )
            )

        submit(0)
        assert requests[0].wait(WAIT_S)
        tokens = [r.result(WAIT_S)[0] for r in requests]  # all joined before the first ended
        assert len(tokens) == len(REQUESTS) and engine.stats.preemptions >= 1
    for prompt, (_, new, _), made, scored in zip(prompts, REQUESTS, tokens, scores, strict=True):
        assert made == alone(index, prompt, new)
        assert_scored_as_transformers(index, prompt, made, scored, top=2, prompt_top=1)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_prompt_whose_prefix_is_cached_gets_all_its_log_probabilities_from_transformers(
    index_of, family: str
) -> None:
    """A first request leaves its 12-token prompt's blocks in the prefix cache. A second
    whose prompt starts with the same 8 tokens asks for its prompt's log-probabilities: it
    computes its whole prompt (as vLLM does: a cached position has no logits) and gets every
    position's, transformers' values, and its text. A third with that prefix and no such
    ask reads the two cached blocks, and its text is transformers' too."""
    index = index_of(family)
    first = prompt_of(4, 12)
    second, third = first[:8] + prompt_of(5, 5), first[:8] + prompt_of(6, 4)
    scored: list = []
    with Running(index, block_size=4) as engine:
        engine.submit([first], sampling=Sampling(), max_new_tokens=3).result(WAIT_S)
        hits = engine.stats.prefix_hits
        request = engine.submit(
            [second],
            sampling=Sampling(),
            max_new_tokens=5,
            logprobs=1,
            prompt_logprobs=3,
            on_logprobs=lambda row, lp: scored.append(lp),
            on_token=lambda row, token: None,
        )
        tokens = request.result(WAIT_S)[0]
        assert engine.stats.prefix_hits == hits  # computed whole
        reader = engine.submit([third], sampling=Sampling(), max_new_tokens=5).result(WAIT_S)
        assert engine.stats.prefix_hits == hits + 8  # the two full blocks of the prefix
    assert tokens == alone(index, second, 5)
    assert_scored_as_transformers(index, second, tokens, scored, top=1, prompt_top=3)
    assert reader[0] == alone(index, third, 5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_next"])
def test_blocks_a_cancelled_request_freed_give_later_requests_transformers_text(
    index_of, family: str
) -> None:
    """A request cancelled at its fourth token, in a pool of 10 blocks of 4: a later request
    needs its blocks (all of the pool but one sequence's), another starts with its prompt
    (its cached prefix, if any was kept, must be its prompt's). Both texts are transformers'
    alone."""
    index = index_of(family)
    cancelled_prompt = prompt_of(6, 11)
    other = prompt_of(7, 9)
    shared = cancelled_prompt[:8] + prompt_of(8, 3)
    with Running(index, num_blocks=10, block_size=4, micro_batches=1) as engine:
        made: list[int] = []

        def cancel_at_fourth(row: int, token: int) -> None:
            made.append(token)
            if len(made) == 4:
                engine.cancel(victim)

        victim = engine.submit(
            [cancelled_prompt], sampling=Sampling(), max_new_tokens=25, on_token=cancel_at_fourth
        )
        assert victim.wait(WAIT_S) and victim.finish_reasons[0].value == "abort"
        assert 4 <= len(made) < 25
        later = [
            engine.submit([p], sampling=Sampling(), max_new_tokens=20) for p in (other, shared)
        ]
        tokens = [r.result(WAIT_S)[0] for r in later]
    assert tokens == [alone(index, other, 20), alone(index, shared, 20)]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_next", "mixtral"])
def test_a_request_of_rows_of_different_lengths_gives_each_row_transformers_text(
    index_of, family: str
) -> None:
    """One request of three prompts (3, 9 and 6 tokens: its rows run together, padded to
    each other in a step): each row's text is what transformers makes of its prompt alone."""
    index = index_of(family)
    prompts = [prompt_of(9, 3), prompt_of(10, 9), prompt_of(11, 6)]
    with Running(index, prefill_tokens=64) as engine:
        rows = engine.submit(prompts, sampling=Sampling(), max_new_tokens=7).result(WAIT_S)
    assert rows == [alone(index, p, 7) for p in prompts]
