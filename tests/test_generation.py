"""Continuous batching on the real models: requests of different prompt lengths join the
running batch at different steps and leave at different steps, and each request's greedy
tokens equal transformers' `generate` on that prompt alone (same files, same dtype, one
process). In-process workers driven by the engine (`LocalPipeline`), on one stage and on two
with offloaded layers; the Ray path is in test_pipeline.py, the server's in test_serving.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_families import VOCAB, Pipeline, family_shape

from coordinator.engine import Engine, EngineConfig, generation
from coordinator.engine.engine import model_steps
from coordinator.engine.pipelines import LocalPipeline
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.errors import WorkerLostError
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_generate, reference_logits
from worker.spec import DEFAULT_BLOCK_SIZE, blocks_for
from worker.steps import Sampling
from worker.worker import StageWorker

FAMILIES = (
    "llama",
    "mistral",
    "qwen3",
    "gemma2",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "bamba",
    "jamba",
)
WAIT_S = 120.0
MAX_SEQ_LEN = 40
# (prompt length, new tokens, joins when the previous request has this many tokens)
REQUESTS = ((7, 14, 0), (4, 6, 2), (11, 10, 3), (3, 9, 1))
TWO_STAGES = (
    [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]],
    ("layers.1", "layers.3"),
)
ONE_STAGE = (
    [["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]],
    ("layers.0", "layers.2"),
)


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    made = {}

    def get(family: str, dtype: str = "float32", quantization: str = "none"):
        if (family, dtype, quantization) not in made:
            shape = family_shape(family, dtype, quantization=quantization)
            root = tmp_path_factory.mktemp(f"gen-{family}-{dtype}-{quantization}") / "ckpt"
            made[family, dtype, quantization] = load_index(make_checkpoint(root, shape))
        return made[family, dtype, quantization]

    return get


def prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n, _, _ in REQUESTS]


def run_joining(
    pipeline: Pipeline,
    prompt_ids: list[list[int]],
    *,
    num_slots: int = 3,
    samplings=None,
    seeds=None,
    **config,
) -> tuple[list[list[int]], Engine]:
    """Submit request i+1 when request i has made its `joins` tokens (from the engine's own
    callback, so the step it joins at is exact); returns each request's new tokens."""
    engine = Engine(
        LocalPipeline(pipeline.workers),
        EngineConfig(
            num_slots=num_slots,
            max_seq_len=MAX_SEQ_LEN,
            prefill_tokens=8,
            **model_steps(pipeline.index),
            **config,
        ),
    )
    requests = []
    samplings = samplings or [Sampling()] * len(REQUESTS)
    seeds = seeds or [None] * len(REQUESTS)

    def submit(i: int) -> None:
        counts = [0]

        def on_token(row: int, token: int) -> None:
            counts[0] += 1
            if i + 1 < len(REQUESTS) and counts[0] == REQUESTS[i + 1][2]:
                submit(i + 1)

        requests.append(
            engine.submit(
                [prompt_ids[i]],
                sampling=samplings[i],
                max_new_tokens=REQUESTS[i][1],
                seed=seeds[i],
                on_token=on_token,
            )
        )
        if i + 1 < len(REQUESTS) and REQUESTS[i + 1][2] == 0:
            submit(i + 1)

    try:
        submit(0)
        while len(requests) < len(REQUESTS):
            requests[-1].wait(0.05)
            if requests[-1].done() and len(requests) < len(REQUESTS):
                raise AssertionError("a request ended before the next one joined")
        return [r.result(WAIT_S)[0] for r in requests], engine
    finally:
        engine.close()


def generate_each(pipeline: Pipeline, prompt_ids: list[list[int]], new: int) -> list[list[int]]:
    """Greedy tokens of each prompt, all submitted at once to an engine over `pipeline`."""
    engine = Engine(
        LocalPipeline(pipeline.workers),
        EngineConfig(
            num_slots=len(prompt_ids),
            max_seq_len=MAX_SEQ_LEN,
            **model_steps(pipeline.index),
        ),
    )
    try:
        requests = [engine.submit([p], sampling=Sampling(), max_new_tokens=new) for p in prompt_ids]
        return [r.result(WAIT_S)[0] for r in requests]
    finally:
        engine.close()


def processors(sampling: Sampling) -> dict:
    """`generate`'s arguments for a greedy request's processors: its repetition penalty, bad
    words and logit bias (one-token `sequence_bias`)."""
    return dict(
        repetition_penalty=sampling.repetition_penalty,
        bad_words_ids=[list(w) for w in sampling.bad_words] or None,
        sequence_bias={(t,): b for t, b in sampling.logit_bias} or None,
    )


def alone(index, prompt: list[int], new: int, quantized=None) -> list[int]:
    out = reference_generate(
        str(index.root),
        torch.tensor([prompt]),
        num_threads=1,
        quantized=quantized,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("stages", ["one stage", "two stages", "two stages, one micro-batch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_joining_and_leaving_requests_equal_transformers_alone(
    indexes, family: str, stages: str
) -> None:
    """Four requests, three slots: one waits for a slot, the 11-token prompt goes in two
    chunks, every request leaves at its own step; sliding windows (4) are outrun. Two stages
    run two micro-batches (steps from the driver), or one (decode bursts driven by the first
    stage through the second)."""
    index = indexes(family)
    groups, offloaded = ONE_STAGE if stages == "one stage" else TWO_STAGES
    pipeline = Pipeline(index, groups, offloaded=offloaded)
    try:
        ids = prompts(seed=1)
        ours, engine = run_joining(pipeline, ids, micro_batches=1 if "one micro" in stages else 0)
        reports = [w.report() for w in pipeline.workers]
    finally:
        pipeline.close()
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(index, prompt, new), (family, stages)
    stats = engine.stats
    if index.recurrent:  # no padding, no cut burst: every step a worker ran was applied
        assert stats.cut == 0 and all(r.forwards == stats.steps for r in reports)
    else:
        assert stats.step_rows > stats.steps  # sequences shared steps
    # one forward per stage per step, whatever the number of sequences in it, and every step
    # that ran applied (a burst of k micro-batches cut short yields the k - 1 steps it had
    # sent on, instead of dropping them)
    assert all(r.forwards == stats.steps for r in reports), (
        [r.forwards for r in reports],
        stats.steps,
        stats.cut,
    )
    assert any(r.stats.copies > 0 for r in reports)  # layers were offloaded


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_next"])
def test_a_pool_of_one_sequence_preempts_and_every_text_equals_transformers_alone(
    indexes, family: str
) -> None:
    """The joining requests in a KV pool of blocks of 4 positions that holds exactly one
    sequence of max_seq_len (10 blocks), one step per call (so that requests join while the
    others run): every sequence crosses many blocks, the pool runs out, the youngest is
    preempted and fed again from its start (recurrent states too), and each text equals
    transformers alone."""
    index = indexes(family)
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        ids = prompts(seed=5)
        ours, engine = run_joining(
            pipeline, ids, num_blocks=10, block_size=4, micro_batches=1, burst_steps=1
        )
    finally:
        pipeline.close()
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(index, prompt, new), family
    assert engine.stats.preemptions >= 1
    assert engine.scheduler.used_blocks == 0  # every block back in the pool


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_next"])
def test_requests_sharing_a_prompt_prefix_reuse_its_blocks_and_equal_transformers(
    indexes, family: str
) -> None:
    """The joining requests with one 9-token prefix (a system prompt), blocks of 4: each later
    request reuses the prefix's full blocks the first one filled (never computed again), and
    each text equals transformers alone. A model with recurrent state reuses nothing."""
    index = indexes(family)
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        tails = prompts(seed=6)
        ids = [tails[0][:9] + tail for tail in tails]
        ours, engine = run_joining(pipeline, ids, block_size=4)
    finally:
        pipeline.close()
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(index, prompt, new), family
    if index.recurrent:
        assert engine.stats.prefix_hits == 0
    else:  # the prefix's 2 full blocks, for a later request at least (some join before the
        # first has filled them)
        assert engine.stats.prefix_hits >= 8


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_a_replaced_worker_gets_each_recurrent_state_fed_again(indexes, family: str) -> None:
    """A worker is lost mid-generation and replaced by a fresh one (no slot pool, no state):
    every running sequence is fed again from its start, each prompt and its tokens so far in a
    step of their own (no padding), and every request's tokens equal transformers' `generate`
    on its prompt alone."""
    index = indexes(family)
    pipeline = Pipeline(index, *TWO_STAGES)
    epoch, lose = [0], []

    class LosingOnce(LocalPipeline):
        def submit(self, steps):
            if lose == [True]:
                lose.append(False)
                raise WorkerLostError("stage 1's worker died")
            return super().submit(steps)

    def replace_the_worker(exc: BaseException, sent_in: int) -> None:
        if not isinstance(exc, WorkerLostError):
            raise exc
        if sent_in == epoch[0]:
            old = pipeline.workers[1]
            pipeline.workers[1] = StageWorker(old.spec, device="cpu", num_threads=1)
            pipeline.workers[1].load()
            old.close()
            epoch[0] += 1

    engine = Engine(
        LosingOnce(pipeline.workers),
        EngineConfig(
            num_slots=3, max_seq_len=MAX_SEQ_LEN, burst_steps=1, **model_steps(pipeline.index)
        ),
        recover=replace_the_worker,
        gate=lambda: contextlib.nullcontext(epoch[0]),
    )
    ids = prompts(seed=6)[:3]
    try:

        def on_token(row: int, token: int) -> None:
            if len(requests[0].sequences[0].generated) == 4 and not lose:
                lose.append(True)

        requests = [
            engine.submit([p], sampling=Sampling(), max_new_tokens=9, on_token=on_token)
            for p in ids
        ]
        ours = [r.result(WAIT_S)[0] for r in requests]
        restarts = engine.stats.restarts
    finally:
        engine.close()
        pipeline.close()
    assert restarts == 1 and lose == [True, False]
    assert ours == [alone(index, prompt, 9) for prompt in ids]


@pytest.mark.parametrize(
    ("family", "unit"), [("mixtral", "experts"), ("deepseek_v3", "experts"), ("llama", "mlp")]
)
def test_requests_with_part_of_each_layer_offloaded_equal_transformers_alone(
    indexes, family: str, unit: str
) -> None:
    """Sub-layer offload under continuous batching: the experts (or MLPs) of the offloaded
    layers come in through the slot once per step for every sequence in it."""
    index = indexes(family)
    pipeline = Pipeline(index, *TWO_STAGES, unit=unit)
    try:
        ids = prompts(seed=4)
        ours, _ = run_joining(pipeline, ids, micro_batches=1)
        stats = [w.report().stats for w in pipeline.workers]
    finally:
        pipeline.close()
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(index, prompt, new), (family, unit)
    by_name = {layer.name: layer for layer in index.layers}
    assert (
        sum(s.offloaded_bytes for s in stats)
        == sum(by_name[n].unit_bytes(unit) for n in TWO_STAGES[1])
        > 0
    )
    assert all(s.copies > 0 for s in stats)


@pytest.mark.parametrize(
    ("family", "offload_dtype"), [("llama", "fp8"), ("llama", "int8"), ("mixtral", "int8")]
)
def test_8bit_offloaded_requests_equal_transformers_alone_with_those_weights(
    indexes, family: str, offload_dtype: str
) -> None:
    """`--offload-dtype fp8 / int8` over the planner's offloading stages: requests joining and
    leaving, each equal to transformers alone on its prompt computing with exactly the weights
    the workers keep in 8 bits (quantized and back, as `run --check` compares). For fp8 on
    llama the quantization changes the text, so the test tells the two references apart."""
    from types import SimpleNamespace

    from coordinator.cli.loads import quantized_weights

    index = indexes(family)
    pipeline = Pipeline(index, offload_dtype=offload_dtype)
    try:
        ids = prompts(seed=4)
        ours, _ = run_joining(pipeline, ids)
        assert any(w.report().quantization_error > 0 for w in pipeline.workers)
    finally:
        pipeline.close()
    quantized = quantized_weights(SimpleNamespace(plan=pipeline.plan, index=index))
    assert quantized
    for prompt, (_, new, _), tokens in zip(ids, REQUESTS, ours, strict=True):
        assert tokens == alone(index, prompt, new, quantized), (family, offload_dtype)
    if offload_dtype == "fp8" and family == "llama":
        plain = [alone(index, p, new) for p, (_, new, _) in zip(ids, REQUESTS, strict=True)]
        assert plain != ours


@pytest.mark.parametrize(
    ("family", "quantization"),
    [("llama", "none"), ("qwen3", "none"), ("qwen3", "fp8-block"), ("deepseek_v3", "fp8-block")],
)
def test_bf16_requests_match_transformers_as_closely_as_its_own_batches(
    indexes, family: str, quantization: str
) -> None:
    """In bf16 a batch and a lone prompt may round differently. Each request's tokens agree
    with transformers alone for at least as long as transformers' own left-padded batch of the
    same prompts agrees with it alone (here: all of them but llama's first request, 11 of 14).
    Block-FP8 checkpoints too, against transformers reading the same FP8 files (dequantized
    to bf16 on the CPU): every token of every request."""
    if quantization == "fp8-block":
        pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    index = indexes(family, "bfloat16", quantization)
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        ids = prompts(seed=2)
        ours, _ = run_joining(pipeline, ids)
    finally:
        pipeline.close()
    width = max(len(p) for p in ids)
    batch = torch.tensor([[0] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    longest = max(new for _, new, _ in REQUESTS)
    batched = reference_generate(
        str(index.root),
        batch,
        attention_mask=mask,
        num_threads=1,
        max_new_tokens=longest,
        do_sample=False,
        eos_token_id=None,
    )
    for r, (prompt, (_, new, _), tokens) in enumerate(zip(ids, REQUESTS, ours, strict=True)):
        reference = alone(index, prompt, new)
        theirs = batched[r, width : width + new].tolist()
        agree = next(
            (i for i, (a, b) in enumerate(zip(theirs, reference, strict=True)) if a != b), new
        )
        # never an empty comparison: transformers' own batch agrees with it alone for a while
        assert agree > 0, (family, r, theirs, reference)
        assert tokens[:agree] == reference[:agree], (family, r)
        assert quantization == "none" or agree == new  # FP8: the whole request agreed


def test_seeded_sampling_is_the_same_whatever_else_is_in_the_batch(indexes) -> None:
    """A seeded request draws from its own generator: the same tokens alone and next to three
    other requests (greedy and sampled); another seed, other tokens."""
    index = indexes("qwen3")
    pipeline = Pipeline(index, *ONE_STAGE)
    sampled = Sampling(do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    ids = prompts(seed=3)
    try:
        in_batch, _ = run_joining(
            pipeline, ids, samplings=[sampled, Sampling(), sampled, sampled], seeds=[7, None, 8, 7]
        )
        engine = Engine(
            LocalPipeline(pipeline.workers), EngineConfig(num_slots=3, max_seq_len=MAX_SEQ_LEN)
        )
        try:
            lone = engine.submit(
                [ids[0]], sampling=sampled, max_new_tokens=REQUESTS[0][1], seed=7
            ).result(WAIT_S)[0]
        finally:
            engine.close()
    finally:
        pipeline.close()
    assert in_batch[0] == lone
    assert in_batch[1] == alone(index, ids[1], REQUESTS[1][1])  # greedy beside sampled rows
    assert in_batch[2] != lone[: len(in_batch[2])]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_kv_pool_holds_only_the_stage_layers_exactly_as_planned(indexes, family: str) -> None:
    """Each stage's KV pool: its own decoder layers only, blocks for 3 sequences of
    max_seq_len positions (whole blocks of 16), exactly what the plan reserves for those layers
    (sliding layers too: a sequence's blocks hold every position)."""
    index = indexes(family)
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        run_joining(pipeline, prompts(seed=4), num_slots=3)
        pools = [w.kv_cache_bytes() for w in pipeline.workers]
        held = [w.stage.decoder_indices for w in pipeline.workers]
    finally:
        pipeline.close()
    config = index.config
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    positions = 3 * blocks_for(MAX_SEQ_LEN) * DEFAULT_BLOCK_SIZE
    per_layer = 2 * config["num_key_value_heads"] * positions * head_dim * 4  # k+v, fp32
    assert pools == [per_layer * len(h) for h in held] and all(pools)
    by_name = {layer.name: layer for layer in index.layers}
    for pool, layers in zip(pools, held, strict=True):
        assert pool == sum(by_name[f"layers.{i}"].kv_bytes(3, MAX_SEQ_LEN) for i in layers)


def test_settings_come_from_generation_config(indexes, tmp_path) -> None:
    import json
    import shutil

    root = shutil.copytree(indexes("llama").root, tmp_path / "ckpt")
    config = json.loads((root / "config.json").read_text())
    (root / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "eos_token_id": [1, 2],
                "max_new_tokens": 5,
            }
        )
    )
    settings = generation.resolve(root, config, 7)
    sampling = settings.sampling
    assert (sampling.do_sample, sampling.temperature, sampling.top_p, sampling.top_k) == (
        True,
        0.7,
        0.8,
        50,
    )
    assert settings.eos_token_ids == (1, 2) and settings.pad_token_id == 1
    assert settings.max_new_tokens == 5
    assert generation.resolve(root, config, 7, eos_token_id=None).eos_token_ids == ()
    # the processors generate applies are applied (Qwen2.5 ships repetition_penalty 1.05)
    (root / "generation_config.json").write_text(
        json.dumps(
            {
                "repetition_penalty": 1.05,
                "min_p": 0.1,
                "bad_words_ids": [[5], [7, 8], [2]],  # [2] alone is an end token: dropped
                "suppress_tokens": [9],
                "sequence_bias": [[[4], 1.5]],
                "eos_token_id": 2,
            }
        )
    )
    sampling = generation.resolve(root, config, 7).sampling
    assert (sampling.repetition_penalty, sampling.min_p) == (1.05, 0.1)
    assert sampling.bad_words == ((5,), (7, 8), (9,)) and sampling.logit_bias == ((4, 1.5),)
    own = generation.resolve(root, config, 7, repetition_penalty=1.0, bad_words_ids=[[6]])
    assert own.sampling.repetition_penalty == 1.0 and own.sampling.bad_words == ((6,), (9,))
    # what generate would apply and this loop does not is refused, never ignored
    (root / "generation_config.json").write_text(json.dumps({"no_repeat_ngram_size": 3}))
    with pytest.raises(generation.GenerationError, match=r"no_repeat_ngram_size=3.*set it to 0"):
        generation.resolve(root, config, 7)
    (root / "generation_config.json").write_text(json.dumps({"sequence_bias": [[[4, 5], 1.0]]}))
    with pytest.raises(generation.GenerationError, match=r"2-token sequence \[4, 5\]"):
        generation.resolve(root, config, 7)


def test_vllm_style_takes_what_vllm_takes_from_generation_config(indexes, tmp_path) -> None:
    """A server's defaults (style="vllm"): vLLM's neutral values where the file sets
    nothing (temperature 1.0, so it samples; top_k, top_p, min_p, penalties off), the file's
    repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens where it sets
    them, and its other keys ignored, as vLLM's get_diff_sampling_param reads it."""
    import json
    import shutil

    root = shutil.copytree(indexes("llama").root, tmp_path / "ckpt")
    config = json.loads((root / "config.json").read_text())
    (root / "generation_config.json").unlink(missing_ok=True)
    neutral = generation.resolve(root, config, 7, style="vllm").sampling
    assert (neutral.do_sample, neutral.temperature, neutral.top_k, neutral.top_p) == (
        True,
        1.0,
        None,
        1.0,
    )
    assert neutral.min_p == 0 and not neutral.processed
    qwen = {  # Qwen2.5-Instruct's generation_config.json, with keys vLLM does not read
        "do_sample": True,
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "no_repeat_ngram_size": 4,
        "bad_words_ids": [[5]],
        "eos_token_id": [3, 4],
    }
    (root / "generation_config.json").write_text(json.dumps(qwen))
    resolved = generation.resolve(root, config, 7, style="vllm")
    served = resolved.sampling
    assert (served.temperature, served.top_p, served.top_k, served.repetition_penalty) == (
        0.7,
        0.8,
        20,
        1.05,
    )
    assert served.bad_words == () and resolved.eos_token_ids == (3, 4)
    # the file's max_new_tokens caps what a request asks, as vLLM's get_max_tokens does
    (root / "generation_config.json").write_text(json.dumps({**qwen, "max_new_tokens": 5}))
    assert generation.resolve(root, config, 7, style="vllm", max_new_tokens=9).max_new_tokens == 5
    assert generation.resolve(root, config, 7, style="vllm", max_new_tokens=3).max_new_tokens == 3
    (root / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    assert generation.resolve(root, config, 7, max_new_tokens=9).max_new_tokens == 9  # generate's
    (root / "generation_config.json").write_text(json.dumps(qwen))
    greedy = generation.resolve(root, config, 7, style="vllm", temperature=0, top_k=0).sampling
    assert not greedy.do_sample and greedy.top_k == 0
    with pytest.raises(generation.GenerationError, match="style='hf'"):
        generation.resolve(root, config, 7, style="hf")


PREEMPTING = {"num_blocks": 10, "block_size": 4, "micro_batches": 1, "burst_steps": 1}
BURSTS = {"micro_batches": 2, "burst_steps": 4}


@pytest.mark.parametrize(
    ("family", "steps"),
    [("llama", PREEMPTING), ("qwen3_next", PREEMPTING), ("llama", BURSTS)],
    ids=["llama-preempting", "qwen3_next-preempting", "llama-bursts"],
)
def test_penalties_and_bad_words_equal_transformers_generate_through_preemptions(
    indexes, family: str, steps: dict
) -> None:
    """Greedy requests with a repetition penalty, bad words (one token, and two: banned
    after the first) and a logit bias, joining and leaving a KV pool of one sequence, so
    that sequences are preempted and fed again (the last stage gets their tokens so far
    again), or running in bursts of steps the last stage chains itself: each text equals
    transformers' `generate` with the same settings alone, and the settings change the text
    (the test could fail)."""
    index = indexes(family)
    ids = prompts(seed=8)
    plain = [alone(index, p, new) for p, (_, new, _) in zip(ids, REQUESTS, strict=True)]
    samplings = [
        Sampling(repetition_penalty=1.8),
        Sampling(repetition_penalty=0.7, bad_words=((plain[1][0],),)),
        Sampling(
            repetition_penalty=1.3,
            bad_words=((plain[2][1], plain[2][2]),),
            logit_bias=((plain[2][3], -3.0),),
        ),
        Sampling(logit_bias=((11, 8.0),)),
    ]
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        ours, engine = run_joining(pipeline, ids, samplings=samplings, **steps)
    finally:
        pipeline.close()
    if steps is PREEMPTING:
        assert engine.stats.preemptions >= 1
    else:  # bursts ran: fewer calls to the pipeline than steps
        assert engine.stats.calls < engine.stats.steps
    for i, (prompt, (_, new, _), sampling) in enumerate(zip(ids, REQUESTS, samplings, strict=True)):
        expected = reference_generate(
            str(index.root),
            torch.tensor([prompt]),
            num_threads=1,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            **processors(sampling),
        )[0, len(prompt) :].tolist()
        assert ours[i] == expected, (family, i)
        assert ours[i] != plain[i], (family, i)


def test_the_kv_budget_refuses_what_never_fits() -> None:
    """What can never fit (longer than max_seq_len, more sequences than max_batch) is refused
    before a server starts streaming; what fits waits in the engine's queue."""
    budget = generation.KvBudget(max_batch=2, max_seq_len=10)
    with pytest.raises(
        generation.GenerationError, match=r"11 tokens per sequence .* max_seq_len=10"
    ):
        budget.check(1, 11)
    with pytest.raises(generation.GenerationError, match=r"3 sequence\(s\) exceed .* max_batch=2"):
        budget.check(3, 5)
    budget.check(2, 10)


def test_min_new_tokens_holds_back_each_rows_end_tokens_inside_a_batch(indexes) -> None:
    """Two rows of one prompt in one batch, the token greedy makes at step `end_at` taken as
    their end token: the row without min_new_tokens ends there; the row with it cannot choose
    it (nor a second end id) before its min_new_tokens, and makes what transformers' generate
    makes with min_new_tokens (its MinNewTokensLengthLogitsProcessor), to the token."""
    index = indexes("llama")
    prompt = prompts(seed=5)[0]
    free = alone(index, prompt, 12)
    end_at = next(i for i in range(2, 12) if free[i] not in free[:i])
    end = free[end_at]
    other_end = next(t for t in range(3, VOCAB) if t not in free)
    minimum = end_at + 3
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        engine = Engine(
            LocalPipeline(pipeline.workers),
            EngineConfig(num_slots=3, max_seq_len=MAX_SEQ_LEN, micro_batches=1),
        )
        try:
            ends = (end, other_end)
            held = engine.submit(
                [prompt],
                sampling=Sampling(),
                max_new_tokens=12,
                eos_token_ids=ends,
                min_new_tokens=minimum,
            )
            plain = engine.submit(
                [prompt], sampling=Sampling(), max_new_tokens=12, eos_token_ids=ends
            )
            ours_held, ours_plain = held.result(WAIT_S)[0], plain.result(WAIT_S)[0]
        finally:
            engine.close()
    finally:
        pipeline.close()
    assert ours_plain == free[: end_at + 1] and plain.finish_reasons[0].value == "stop"
    expected = reference_generate(
        str(index.root),
        torch.tensor([prompt]),
        num_threads=1,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=list(ends),
        pad_token_id=0,
        min_new_tokens=minimum,
    )[0, len(prompt) :].tolist()
    stop = next((i + 1 for i, t in enumerate(expected) if t in ends), len(expected))
    assert ours_held == expected[:stop]
    assert len(ours_held) >= minimum and not set(ours_held[:minimum]) & set(ends)
    assert ours_held[:end_at] == free[:end_at] and ours_held[end_at] != end


def test_logprobs_equal_transformers_log_softmax_of_the_same_logits(indexes) -> None:
    """A greedy row and a sampled row (temperature and top-k: raw log-probabilities all the
    same) ask for their tokens' log-probabilities with the top 3, the greedy one for its
    prompt's too (two chunks: the second's first token is scored by the first's last logits);
    a third row asks for nothing. All equal transformers' log_softmax of its float32 logits
    over prompt + generated tokens. Two stages, decode bursts (the scores ride the ring)."""
    index = indexes("llama")
    long, short, third = prompts(seed=6)[2], prompts(seed=6)[1], prompts(seed=6)[0]
    pipeline = Pipeline(index, *TWO_STAGES)
    got: dict[int, list] = {0: [], 1: []}
    try:
        engine = Engine(
            LocalPipeline(pipeline.workers),
            EngineConfig(num_slots=3, max_seq_len=MAX_SEQ_LEN, micro_batches=1, prefill_tokens=8),
        )
        try:
            greedy = engine.submit(
                [long],
                sampling=Sampling(),
                max_new_tokens=6,
                logprobs=3,
                prompt_logprobs=2,
                on_logprobs=lambda row, lp: got[0].append(lp),
                on_token=lambda row, token: None,
            )
            sampled = engine.submit(
                [short],
                sampling=Sampling(do_sample=True, temperature=0.6, top_k=5),
                seed=11,
                max_new_tokens=6,
                logprobs=3,
                on_logprobs=lambda row, lp: got[1].append(lp),
                on_token=lambda row, token: None,
            )
            bystander = engine.submit([third], sampling=Sampling(), max_new_tokens=6)
            tokens = [r.result(WAIT_S)[0] for r in (greedy, sampled, bystander)]
        finally:
            engine.close()
    finally:
        pipeline.close()
    assert tokens[2] == alone(index, third, 6)
    for prompt, new, scores, prompt_top in (
        (long, tokens[0], got[0], 2),
        (short, tokens[1], got[1], None),
    ):
        full = torch.tensor([prompt + new])
        logits = reference_logits(str(index.root), full, num_threads=1)[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        if prompt_top is not None:
            first, *scores = scores
            assert (first.start, len(first)) == (1, len(prompt) - 1)
            assert list(first.token_ids) == prompt[1:]
            want = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
            assert torch.allclose(torch.tensor(first.logprobs), want, atol=1e-5, rtol=0)
            top = torch.topk(logp[: len(prompt) - 1], prompt_top, dim=-1)
            assert [list(t) for t in first.top_ids] == top.indices.tolist()
            assert torch.allclose(torch.tensor(first.top_logprobs), top.values, atol=1e-5, rtol=0)
        assert [s.start for s in scores] == list(range(len(prompt), len(prompt) + len(new)))
        assert [s.token_ids[0] for s in scores] == new
        rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(new))
        want = logp[rows, torch.tensor(new)]
        assert torch.allclose(
            torch.tensor([s.logprobs[0] for s in scores]), want, atol=1e-5, rtol=0
        )
        top = torch.topk(logp[rows], 3, dim=-1)
        assert [list(s.top_ids[0]) for s in scores] == top.indices.tolist()
        assert torch.allclose(
            torch.tensor([s.top_logprobs[0] for s in scores]), top.values, atol=1e-5, rtol=0
        )
