"""A node's compute timing: the model's own decoder layer stepped as a worker steps it, at 1, 8
and 32 sequences; the interpolation the planner reads; the per-shape disk cache; and the rate
reaching the plan through the node's probe."""

from __future__ import annotations

import pytest
from helpers import tiny_shape

from coordinator.config import JobConfig
from coordinator.planning.budgets import node_info
from coordinator.planning.checkpoint import load_index
from coordinator.tools.make_checkpoint import make_checkpoint
from offload import node_cache
from worker import compute_probe
from worker.compute_probe import ComputeProfile, measure
from worker.node import probe_here


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("compute") / "llama"
    return load_index(
        make_checkpoint(
            root,
            tiny_shape(2),
        )
    )


def test_a_decoder_layer_is_timed_and_cached(index, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(node_cache.CACHE_ENV, str(tmp_path))
    profile = measure(index.config, "float32", threads=1)
    assert profile.rows == compute_probe.ROWS and profile.family == "llama"
    assert all(t > 0 for t in profile.layer_s)
    decoder = next(x for x in index.layers if x.kind == "decoder")
    assert profile.layer_bytes == decoder.nbytes  # the layer the checkpoint holds, in its dtype
    assert "cpu (1 thread(s))" in profile.device
    monkeypatch.setattr(compute_probe, "_measure", lambda *a: pytest.fail("measured again"))
    assert measure(index.config, "float32", threads=1) == profile  # this node, this shape
    assert len(list(tmp_path.rglob("*.json"))) == 1


def test_one_layer_shape_is_measured_once_whatever_the_depth_or_vocabulary(
    index, tmp_path, monkeypatch
) -> None:
    """The stages the probe times hold layers 0 and 1: a deeper model or another vocabulary
    reads the same profile; another layer width, or a per-layer list that changes with the
    depth, is measured."""
    monkeypatch.setenv(node_cache.CACHE_ENV, str(tmp_path))
    measured: list[dict] = []
    real = compute_probe._measure

    def counting(config, *args):
        measured.append(config)
        return real(config, *args)

    monkeypatch.setattr(compute_probe, "_measure", counting)
    base = measure(index.config, "float32", threads=1)
    deeper = {**index.config, "num_hidden_layers": 6, "vocab_size": 4096, "eos_token_id": 7}
    assert measure(deeper, "float32", threads=1) == base
    assert len(measured) == 1
    wider = {**index.config, "intermediate_size": 2 * index.config["intermediate_size"]}
    assert measure(wider, "float32", threads=1).layer_bytes > base.layer_bytes
    typed = {
        **index.config,
        "num_hidden_layers": 3,
        "layer_types": ["full_attention"] * 3,
    }
    measure(typed, "float32", threads=1)
    assert len(measured) == 3 and measured[-1] is typed  # not read from the 2-layer entry
    assert len(list(tmp_path.rglob("*.json"))) == 3


def test_probes_of_one_host_at_once_measure_it_once(index, tmp_path, monkeypatch) -> None:
    """Three probes of one host (its Ray nodes) asking at once: one measures, holding the
    shape's lock; the others wait for it and read what it wrote (the same profile). Ordered by
    an event (issue 60): the measurement starts only once all three have found no profile and
    gone for the lock, so none can have come late enough to find the first one's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv(node_cache.CACHE_ENV, str(tmp_path))
    real, real_lock = compute_probe._measure, node_cache.measuring
    measuring: list[int] = []
    arrived: list[int] = []
    all_arrived = threading.Event()

    def arriving(path):  # a probe that found no profile, going for the shape's lock
        arrived.append(threading.get_ident())
        if len(arrived) == 3:
            all_arrived.set()
        return real_lock(path)

    def measure_once_all_arrived(*args):
        measuring.append(threading.get_ident())
        assert all_arrived.wait(60), f"only {len(arrived)} of the 3 probes came for the lock"
        return real(*args)

    monkeypatch.setattr(node_cache, "measuring", arriving)
    monkeypatch.setattr(compute_probe, "_measure", measure_once_all_arrived)
    with ThreadPoolExecutor(3) as pool:
        profiles = list(pool.map(lambda _: measure(index.config, "float32", threads=1), range(3)))
    assert len(arrived) == 3 and len(measuring) == 1, (arrived, measuring)
    assert profiles[0] is not None and profiles.count(profiles[0]) == 3


def test_the_step_time_between_and_beyond_the_measured_sizes() -> None:
    profile = ComputeProfile(
        family="llama",
        dtype="float32",
        device="cpu",
        rows=(1, 8, 32),
        layer_s=(1.0, 2.4, 5.6),
        fixed_s=(0.5, 0.5, 0.9),
        layer_bytes=1000,
    )
    assert [profile.step_s(r) for r in (1, 8, 32)] == [1.0, 2.4, 5.6]
    assert profile.step_s(4) == pytest.approx(1.6)  # on the line from 1 to 8
    assert profile.step_s(64) == pytest.approx(5.6 + 3.2 / 24 * 32)  # the last line, extended
    assert profile.bytes_per_s(8) == pytest.approx(1000 / 2.4)
    assert profile.bytes_per_s(0) == profile.bytes_per_s(1)
    assert profile.fixed_step_s(20) == pytest.approx(0.7) and profile.fixed_step_s(1) == 0.5
    assert (
        "takes 2400.00 ms per step of 8 sequence(s) on cpu, a stage's step 500.00 ms more"
        in profile.describe(8)
    )


def test_the_probe_gives_the_plan_the_rate_for_its_batch(index) -> None:
    """The node's probe times the model; the planner's rate is for steps of max_batch rows."""
    result = probe_here(model=(index.config, "float32", 1))
    profile = result["compute"]
    assert isinstance(profile, ComputeProfile)
    config = JobConfig(
        checkpoint=str(index.root), gpu_memory_bytes=2**20, max_batch=8, max_seq_len=32
    )
    node = node_info(config, result, node_id="n", num_gpus=1)
    rate, source = node.compute_rate(8)
    assert rate == profile.bytes_per_s(8) and source.startswith("measured: a llama decoder layer")
    assert node.compute_rate(32)[0] == profile.bytes_per_s(32)  # the plan's batch decides
    unmeasured = node_info(
        config, {**result, "compute": "not measured: no"}, node_id="n", num_gpus=1
    )
    assert unmeasured.compute_rate(8) == (None, "not measured: no")
    assert node_info(config, probe_here(), node_id="n", num_gpus=1).compute_rate(8)[0] is None


def test_offloadctl_plan_uses_and_shows_the_measured_rate(index, capsys) -> None:
    from coordinator.cli import main

    assert (
        main(
            [
                "plan",
                "--checkpoint",
                str(index.root),
                "--gpus",
                "1",
                "--gpu-memory",
                "8MiB",
                "--max-seq-len",
                "32",
                "--max-batch",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "compute rate on" in out and "per step of 4 sequence(s)" in out
    assert "(default)" not in out.splitlines()[2]  # link and compute rates both measured


def test_a_worker_answers_from_the_cache_only(index, tmp_path, monkeypatch) -> None:
    """A live worker answering for its node (a re-plan) never allocates a layer beside its
    stage: it gives what the node measured before, or says nothing was."""
    monkeypatch.setenv(node_cache.CACHE_ENV, str(tmp_path))
    model = (index.config, "float32", 1)
    assert probe_here(model=model, cached_only=True)["compute"].startswith("not measured")
    measured = probe_here(model=model)["compute"]
    assert probe_here(model=model, cached_only=True)["compute"] == measured
