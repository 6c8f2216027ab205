"""bench/combo_soak.py (random combinations of formats and offload options against
transformers, run by hand, not in CI) can fail: a drawn combination runs equal, and a wrong
number in the loaded weights, or a generation setting the engine drops, is reported as a
difference, never as equal. Also keeps the soak running as the tests' helpers it borrows
change."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from worker import decode, loader
from worker.steps import Sampling
from worker.worker import StageWorker

ROOT = Path(__file__).resolve().parent.parent

# Block FP8 (E8M0 scales, partial blocks: 24 on widths of 32 and 48) over two stages, the
# experts offloaded and fetched by routing (a cache row, calls of one row on the host), the
# resident matrices kept as stored in compact rows, a pool tight enough to wait, shared
# prefixes
TRIAL = dict(
    family="mixtral",
    layers=3,
    dtype="bfloat16",
    quantization="fp8-block",
    fp8_block=24,
    fp8_scales="e8m0",
    fp8_strategy="block",
    stages=2,
    unit="experts",
    expert_fetch="routed",
    expert_cache=1,
    host_expert_rows=1,
    resident_stored=True,
    capacity=2,
    micro_batches=0,
    num_slots=2,
    block_size=4,
    tight_pool=True,
    prefix_caching=True,
    shared_prefix=4,
    burst_steps=0,
    offload_dtype="auto",
    seed=5,
    # then re-planned: whole layers offloaded, fetched whole, resident ones at width (read again)
    replan=dict(
        unit="layer",
        expert_fetch="layer",
        expert_cache=0,
        host_expert_rows=0,
        resident_stored=False,
        capacity=0,
    ),
)


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("combo_soak", ROOT / "bench" / "combo_soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_combination_of_formats_and_options_runs_equal(soak) -> None:
    trial = dict(TRIAL)
    out = soak.run_trial(trial, random.Random(0))
    assert out["result"] == "equal", out
    assert trial["offloaded"] and len(trial["groups"]) == 2  # it did offload, over two stages
    assert len(trial["replan"]["groups"]) == 2


def test_drawn_trials_are_run_and_counted(soak, capsys) -> None:
    assert soak.main(["--trials", "2", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "seed 3: 2 trials" in printed and "'equal': 2" in printed


def test_weights_one_percent_off_are_a_difference(soak, monkeypatch) -> None:
    """Every block scale the loader reads made 1% larger: the logits differ from transformers'
    on the independently dequantized files."""
    read = loader.scales_as_float32
    monkeypatch.setattr(loader, "scales_as_float32", lambda raw: read(raw) * 1.01)
    out = soak.run_trial(dict(TRIAL), random.Random(0))
    assert out["result"] == "differs"
    assert any(p.startswith("plain logits") for p in out["problems"]), out


def test_a_repetition_penalty_the_engine_drops_is_a_difference(soak, monkeypatch) -> None:
    """Every request asks for a repetition penalty of 1.8, which the workers then ignore: the
    logits are right, the generated tokens are not those of generate with the penalty."""
    monkeypatch.setattr(soak, "penalties", lambda rng: Sampling(repetition_penalty=1.8))
    monkeypatch.setattr(decode, "_penalized", lambda scores, settings: scores)
    plain = dict(TRIAL, quantization="none", dtype="float32", resident_stored=False)
    out = soak.run_trial(plain, random.Random(0))
    assert out["result"] == "differs"
    assert all(p.startswith("request") for p in out["problems"]), out


def test_weights_read_wrong_at_a_replan_are_a_difference(soak, monkeypatch) -> None:
    """The block scales the workers read during the re-plan made 1% larger (its resident
    layers go from stored to wide, so they are read again): the logits after it differ, those
    before do not."""
    read, reconfigure = loader.scales_as_float32, StageWorker.reconfigure

    def wrong_from_now_on(self, spec):
        monkeypatch.setattr(loader, "scales_as_float32", lambda raw: read(raw) * 1.01)
        return reconfigure(self, spec)

    monkeypatch.setattr(StageWorker, "reconfigure", wrong_from_now_on)
    out = soak.run_trial(dict(TRIAL), random.Random(0))
    assert out["result"] == "differs", out
    assert out["problems"][0].startswith("after the re-plan"), out
