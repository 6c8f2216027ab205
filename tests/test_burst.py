"""A one-stage job generating over Ray: its worker runs the decode steps itself, a burst per
call (`StageWorker.decode` as a streaming generator), each token streamed as it comes. Greedy
output equals transformers' `generate` across several bursts; seeded sampling draws what it
draws a step at a time; a worker killed mid-burst is recovered and the request goes on with
the same output; a request cancelled mid-burst stops the worker's steps and frees its cache."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from helpers import kill_actor, wait_gpus_free

from coordinator.config import JobConfig
from coordinator.make_checkpoint import CheckpointShape, make_checkpoint
from coordinator.reference import reference_generate
from coordinator.runtime import request as request_module
from coordinator.runtime.job import launch
from coordinator.runtime.request import BURST_STEPS

NEW_TOKENS = 2 * BURST_STEPS + 3  # three bursts after the prefill's token


@pytest.fixture(scope="module")
def one_stage_job(tmp_path_factory):
    checkpoint = str(make_checkpoint(tmp_path_factory.mktemp("burst") / "llama", CheckpointShape(
        num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
        vocab_size=128)))  # fmt: skip
    # address="local": a new Ray, never one another process on this machine runs
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    try:
        config = JobConfig(checkpoint=checkpoint, gpu_memory_bytes=8 * 2**20, max_batch=2,
                           max_seq_len=32)  # fmt: skip
        with launch(config) as job:
            assert len(job.plan.stages) == 1
            yield job, checkpoint
        wait_gpus_free(1)
    finally:
        ray.shutdown()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return ids, mask


def test_bursts_equal_transformers_and_survive_a_killed_worker(one_stage_job,
                                                               monkeypatch) -> None:  # fmt: skip
    job, checkpoint = one_stage_job
    ids, mask = batch()
    expected = reference_generate(checkpoint, ids, attention_mask=mask, num_threads=1,
                                  max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)  # fmt: skip
    calls_before = job.telemetry()[0].forwards
    bursts = []
    real_burst = request_module.RequestSteps._burst

    def counted(self, *args):
        bursts.append(args[4])  # steps asked for
        yield from real_burst(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(request_module.RequestSteps, "_burst", counted)
        out = job.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    assert torch.equal(out, expected)
    assert bursts == [NEW_TOKENS - 1 - i * BURST_STEPS for i in range(3)]  # 8 + 8 + 2 steps
    assert job.telemetry()[0].forwards - calls_before == NEW_TOKENS  # a forward per token

    streamed: list[torch.Tensor] = []

    def kill_mid_burst(tokens: torch.Tensor) -> None:
        streamed.append(tokens)
        if len(streamed) == BURST_STEPS // 2 + 2:  # inside the first burst
            kill_actor(job.workers[0].actor)  # dead before the request takes another token

    out = job.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                       on_tokens=kill_mid_burst)  # fmt: skip
    assert torch.equal(out, expected) and [e["event"] for e in job.events] == ["replaced workers"]
    assert torch.equal(torch.stack(streamed, 1), expected[:, ids.shape[1] :])
    assert job.telemetry()[0].requests == 0


def test_seeded_sampling_and_cancelling_mid_burst(one_stage_job, monkeypatch) -> None:
    job, _ = one_stage_job
    ids, mask = batch()
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.3, top_k=30,
                   eos_token_id=None, seed=5)  # fmt: skip
    bursts = job.generate(ids, mask, **options)
    with monkeypatch.context() as patch:  # the same request a step (and a Ray call) at a time
        patch.setattr(request_module.RequestSteps, "burst", property(lambda self: None))
        stepped = job.generate(ids, mask, **options)
    assert torch.equal(bursts, stepped)

    seen: list[torch.Tensor] = []
    out = job.generate(ids, mask, **options, on_tokens=seen.append,
                       cancelled=lambda: len(seen) >= 3)  # fmt: skip
    assert out.shape[1] == ids.shape[1] + 3 and torch.equal(out, bursts[:, : ids.shape[1] + 3])
    report = job.telemetry()[0]
    assert report.requests == 0 and report.kv_cache_bytes == 0
    assert torch.equal(job.generate(ids, mask, **options), bursts)  # the worker is free again


def test_a_burst_that_outlasts_forward_timeout_is_a_timeout_error(one_stage_job,
                                                                  monkeypatch) -> None:  # fmt: skip
    """The burst waits for each token at most forward_timeout_s (here: a wait that finds
    nothing ready, as a stuck worker would give). A burst left before its first token is not
    cancelled: cancelling a call the actor has not received held the driver's next calls to
    that worker for 30 s, and the request's end_request timed out with its cache kept (about
    one time in two; so it is left five times here)."""
    job, _ = one_stage_job
    ids, mask = batch()

    class NothingReady:  # request.py's view of Ray, whose waits on a burst find nothing ready
        def __getattr__(self, name):
            return getattr(ray, name)

        @staticmethod
        def wait(refs, *args, **kwargs):
            if isinstance(refs[0], ray.ObjectRefGenerator):
                return [], refs
            return ray.wait(refs, *args, **kwargs)

    for _ in range(5):
        with monkeypatch.context() as patch:
            patch.setattr(request_module, "ray", NothingReady())
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=r"forward did not finish within 300 s"):
                job.generate(ids, mask, max_new_tokens=4)
            assert time.monotonic() - start < 10  # its end_request was not held back
    report = job.telemetry()[0]
    assert report.requests == 0 and report.kv_cache_bytes == 0


def test_a_forward_past_the_context_is_refused(one_stage_job) -> None:
    """A learned-position model fails deep in a worker past its window, a RoPE one answers
    with no error: both are refused before anything runs."""
    job, _ = one_stage_job
    with pytest.raises(ValueError, match=r"2049 tokens per sequence exceed the model's context "
                       r"of 2048 tokens \(max_position_embeddings in config.json\)"):  # fmt: skip
        job.forward(torch.zeros(1, 2049, dtype=torch.long))
