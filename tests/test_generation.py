"""Generation through the stages, each worker keeping the KV cache of its own layers: greedy
output equal to transformers' `generate` on left-padded batches (sliding windows outrun), seeded
sampling reproducible, caches freed when the request ends. In-process workers, as in
test_families.py; the Ray path is in test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, Pipeline

from coordinator import generation
from coordinator.make_checkpoint import CheckpointShape, make_checkpoint
from coordinator.planning.checkpoint import load_index
from coordinator.reference import reference_generate
from worker.wire import unpack

FAMILIES = ("llama", "mistral", "qwen3", "gemma2", "mixtral")


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    made = {}

    def get(family: str, dtype: str = "float32"):
        if (family, dtype) not in made:
            shape = CheckpointShape(arch=family, num_layers=4, hidden_size=32, num_heads=4,
                                    num_kv_heads=2, intermediate_size=48, vocab_size=VOCAB,
                                    dtype=dtype, max_positions=64, max_shard_bytes=40_000)  # fmt: skip
            root = tmp_path_factory.mktemp(f"gen-{family}-{dtype}") / "ckpt"
            made[family, dtype] = load_index(make_checkpoint(root, shape))
        return made[family, dtype]

    return get


def left_padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1: four tokens, left-padded
    return ids, mask


def run(pipeline: Pipeline, ids, mask, **options) -> torch.Tensor:
    """`generation.generate` over the in-process stages, one request id, caches freed after."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    settings = generation.resolve(pipeline.index.root, pipeline.index.config, ids.shape[1],
                                  **options)  # fmt: skip

    def step(x, step_mask, step_positions):
        for worker in pipeline.workers:
            x = worker.forward(x, step_mask, step_positions, 1, "request")
        return x

    try:
        return generation.generate(step, ids, mask, positions, settings)
    finally:
        for worker in pipeline.workers:
            worker.end_request("request")


@pytest.mark.parametrize(("family", "dtype"),
                         [(f, "float32") for f in FAMILIES] + [("llama", "bfloat16")])  # fmt: skip
def test_greedy_equals_transformers_generate(indexes, family: str, dtype: str) -> None:
    index = indexes(family, dtype)
    ids, mask = left_padded_batch(seed=1)
    pipeline = Pipeline(index)
    try:
        ours = run(pipeline, ids, mask, max_new_tokens=12, do_sample=False)
        kv_after = [w.report() for w in pipeline.workers]
    finally:
        pipeline.close()
    expected = reference_generate(str(index.root), ids, attention_mask=mask, num_threads=1,
                                  max_new_tokens=12, do_sample=False)  # fmt: skip
    assert torch.equal(ours, expected), (ours, expected)
    assert ours.shape[1] > ids.shape[1] + 4  # past every sliding window (4)
    assert all(r.requests == 0 and r.kv_cache_bytes == 0 for r in kv_after)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_greedy_with_stages_that_miss_layer_0_and_a_layer_kind(indexes, family: str) -> None:
    """The model sizes its masks from the cache's first full and first sliding layer and its
    positions from layer 0: stages that hold none of them (gemma2 alternates sliding and full
    layers) still get the right sizes from the layers they hold."""
    index = indexes(family)
    groups = [["embed", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "head"]]
    ids, mask = left_padded_batch(seed=5)
    pipeline = Pipeline(index, groups, offloaded=("layers.1", "layers.3"))
    try:
        ours = run(pipeline, ids, mask, max_new_tokens=12, do_sample=False)
    finally:
        pipeline.close()
    expected = reference_generate(str(index.root), ids, attention_mask=mask, num_threads=1,
                                  max_new_tokens=12, do_sample=False)  # fmt: skip
    assert torch.equal(ours, expected)


def test_no_eos_generates_exactly_max_new_tokens(indexes) -> None:
    index = indexes("llama")
    ids, mask = left_padded_batch(seed=2)
    pipeline = Pipeline(index)
    try:
        out = run(pipeline, ids, mask, max_new_tokens=9, eos_token_id=None)
    finally:
        pipeline.close()
    assert out.shape == (2, 7 + 9)


def test_seeded_sampling_is_reproducible(indexes) -> None:
    index = indexes("qwen3")
    ids, mask = left_padded_batch(seed=3)
    pipeline = Pipeline(index)
    try:
        options = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=20, top_p=0.9,
                       eos_token_id=None)  # fmt: skip
        first = run(pipeline, ids, mask, seed=7, **options)
        again = run(pipeline, ids, mask, seed=7, **options)
        other = run(pipeline, ids, mask, seed=8, **options)
        greedy = run(pipeline, ids, mask, max_new_tokens=10, eos_token_id=None)
    finally:
        pipeline.close()
    assert torch.equal(first, again)
    assert not torch.equal(first, other) and not torch.equal(first, greedy)


def test_the_kv_cache_lives_on_the_stages_and_grows_by_one_position(indexes) -> None:
    """Each worker caches only its own layers; a decode step adds one position per sequence."""
    index = indexes("llama")
    ids, mask = left_padded_batch(seed=4)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    pipeline = Pipeline(index)
    try:
        x = ids
        for worker in pipeline.workers:
            x = worker.forward(x, mask, positions, 1, "r")
        assert x.shape == (2, 1, VOCAB)  # only the last position's logits come back
        prefill = [w.kv_cache_bytes() for w in pipeline.workers]
        x = torch.tensor([[5], [6]])
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
        for worker in pipeline.workers:
            x = worker.forward(x, mask, positions[:, -1:] + 1, 1, "r")
        decoded = [w.kv_cache_bytes() for w in pipeline.workers]
        for worker, before, after in zip(pipeline.workers, prefill, decoded, strict=True):
            layers = len(worker.stage.decoder_indices)
            assert (before > 0) == (layers > 0)
            assert after * 7 == before * 8  # 7 positions, then 8
        assert [w.end_request("r") for w in pipeline.workers] == [True] * len(pipeline.workers)
        assert sum(w.kv_cache_bytes() for w in pipeline.workers) == 0
    finally:
        pipeline.close()


def test_settings_come_from_generation_config(indexes, tmp_path) -> None:
    import json
    import shutil

    root = shutil.copytree(indexes("llama").root, tmp_path / "ckpt")
    config = json.loads((root / "config.json").read_text())
    (root / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "eos_token_id": [1, 2],
         "max_new_tokens": 5}))  # fmt: skip
    settings = generation.resolve(root, config, 7)
    assert (settings.do_sample, settings.temperature, settings.top_p, settings.top_k) == (
        True, 0.7, 0.8, 50)  # fmt: skip
    assert settings.eos_token_ids == (1, 2) and settings.pad_token_id == 1
    assert settings.max_new_tokens == 5
    assert generation.resolve(root, config, 7, eos_token_id=None).eos_token_ids == ()
    (root / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.2}))
    with pytest.raises(generation.GenerationError, match=r"repetition_penalty=1.2.*set it to 1.0"):
        generation.resolve(root, config, 7)


class OneStageBursts:
    """A one-stage pipeline whose worker runs the decode steps itself, `limit` per burst, as a
    one-stage job's worker does over Ray (`StageWorker.decode`, `generation.Burst`)."""

    def __init__(self, pipeline: Pipeline, limit: int) -> None:
        [self.worker] = pipeline.workers
        self.limit, self.bursts = limit, 0

    def __call__(self, x, mask, positions):
        return self.worker.forward(x, mask, positions, 1, "request")

    def burst(self, tokens, mask, positions, unfinished, count, settings, generator):
        self.bursts += 1
        start = generator.get_state() if generator is not None else None
        for chosen, state in self.worker.decode(
            "request", tokens, mask, positions, unfinished, min(count, self.limit),
            settings.sampling, settings.eos_token_ids, settings.pad_token_id, start,
        ):  # fmt: skip
            if generator is not None:
                generator.set_state(unpack(state))
            yield unpack(chosen)


def run_bursts(pipeline: Pipeline, ids, mask, limit: int, **options) -> tuple[torch.Tensor, int]:
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    settings = generation.resolve(pipeline.index.root, pipeline.index.config, ids.shape[1],
                                  **options)  # fmt: skip
    step = OneStageBursts(pipeline, limit)
    try:
        return generation.generate(step, ids, mask, positions, settings), step.bursts
    finally:
        pipeline.workers[0].end_request("request")


@pytest.mark.parametrize(("family", "dtype"), [("llama", "float32"), ("mistral", "float32"),
                                               ("llama", "bfloat16"), ("qwen3", "bfloat16")])  # fmt: skip
def test_bursts_on_the_worker_equal_transformers_generate(indexes, family: str, dtype: str) -> None:
    """Decode steps run by a one-stage job's worker itself, 3 per burst: the same tokens as
    transformers' generate (same files, same dtype), a row that ends early padded while the
    other goes on."""
    index = indexes(family, dtype)
    ids, mask = left_padded_batch(seed=11)
    one_stage = [[layer.name for layer in index.layers]]
    plain = reference_generate(str(index.root), ids, attention_mask=mask, num_threads=1,
                               max_new_tokens=12, do_sample=False, eos_token_id=None)  # fmt: skip
    new0, new1 = plain[0, ids.shape[1] :].tolist(), plain[1, ids.shape[1] :].tolist()
    # an end token that ends row 0 after a few tokens while row 1 goes on past it
    at = next(i for i in range(2, 11) if new0[i] not in new0[:i] + new1[: i + 1])
    eos = new0[at]
    expected = reference_generate(str(index.root), ids, attention_mask=mask, num_threads=1,
                                  max_new_tokens=12, do_sample=False, eos_token_id=eos)  # fmt: skip
    pipeline = Pipeline(index, one_stage)
    try:
        ours, bursts = run_bursts(pipeline, ids, mask, 3, max_new_tokens=12, do_sample=False,
                                  eos_token_id=eos)  # fmt: skip
        report = pipeline.workers[0].report()
    finally:
        pipeline.close()
    assert torch.equal(ours, expected), (ours, expected)
    assert bursts >= 3 and report.requests == 0


def test_seeded_sampling_in_bursts_equals_step_by_step(indexes) -> None:
    """The generator's state goes to the worker and back with every burst: the same draws."""
    index = indexes("qwen3")
    ids, mask = left_padded_batch(seed=3)
    options = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=20, top_p=0.9,
                   eos_token_id=None, seed=7)  # fmt: skip
    pipeline = Pipeline(index, [[layer.name for layer in index.layers]])
    try:
        stepped = run(pipeline, ids, mask, **options)
        bursts, count = run_bursts(pipeline, ids, mask, 4, **options)
    finally:
        pipeline.close()
    assert count == 3 and torch.equal(bursts, stepped)


def test_the_kv_budget_refuses_never_and_not_now_apart() -> None:
    """What can never fit (longer than max_seq_len, more sequences than max_batch) is refused
    by `check`, before a server starts streaming; what does not fit now (others in flight)
    only by `claim`, whose room is given back however the request ends."""
    budget = generation.KvBudget(max_batch=2, max_seq_len=10)
    with pytest.raises(generation.GenerationError, match=r"11 tokens per sequence .* max_seq_len=10"):
        budget.check(1, 11)
    with pytest.raises(generation.GenerationError, match=r"3 sequence\(s\) exceed .* max_batch=2"):
        budget.check(3, 5)
    budget.check(2, 10)
    with budget.claim(1, 10):
        budget.check(2, 10)  # fits once the one in flight ends
        refused = pytest.raises(generation.GenerationError, match=r"2 sequence\(s\), with 1 in flight")
        with refused, budget.claim(2, 5):
            pass
        assert budget.in_flight == 1
    with pytest.raises(RuntimeError), budget.claim(2, 10):
        raise RuntimeError("the request failed")
    assert budget.in_flight == 0
