"""What the reserve (coordinator/planning/reserve.py) promises, tested as a contract rather than
as its formula: it is what its parts add up to and says so; it never shrinks when a step could
grow (more rows, tokens, positions, a wider model, eager attention); `--reserve` replaces it and
simulated GPUs keep none; the job's options carry it; and it covers every step the engine's
scheduler can actually plan for the job's settings (the steps are made by the real scheduler,
not re-derived here), the batch auto max_batch may choose, and the attention the model runs."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from helpers import tiny_shape
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.config import JobConfig
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequences import Request
from coordinator.planning.budgets import node_info
from coordinator.planning.checkpoint import load_index
from coordinator.planning.formats import format_bytes
from coordinator.planning.options import AUTO_MAX_BATCH
from coordinator.planning.reserve import (
    CUBLAS_WORKSPACE_BYTES,
    Reserve,
    job_options,
    resolve_reserve,
    step_reserve,
)
from coordinator.planning.snapshot import ClusterSnapshot, GpuInfo, NodeInfo
from coordinator.tools.make_checkpoint import make_checkpoint
from offload import DeviceInfo, NodeProbe
from worker.steps import NO_TOKEN, Sampling

GiB = 1 << 30
MODEL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 128,
}
STEP = {"max_batch": 4, "max_seq_len": 64, "prefill_tokens": 512, "attn_implementation": None}

GPUS = ClusterSnapshot(
    nodes=(NodeInfo(node_id="gpu", gpus=(GpuInfo(index=0, memory_bytes=GiB),), cuda=True),)
)
SIMULATED = ClusterSnapshot(
    nodes=(NodeInfo(node_id="cpu", gpus=(GpuInfo(index=0, memory_bytes=GiB),)),)
)


def reserve(model=None, dtype="bfloat16", **step) -> Reserve:
    return step_reserve(model or MODEL, dtype, **{**STEP, **step})


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    shape = tiny_shape(2, dtype="bfloat16", tokenizer=False)
    return load_index(make_checkpoint(tmp_path_factory.mktemp("reserve") / "ckpt", shape))


def job(**changes) -> JobConfig:
    return JobConfig(checkpoint="c", **{"max_batch": 4, "max_seq_len": 64, **changes})


# 1. what it is made of


@pytest.mark.parametrize("attn", [None, "sdpa", "eager"])
def test_the_reserve_is_the_sum_of_the_parts_it_shows(attn) -> None:
    """Its bytes are its parts' (cuBLAS's workspace first, the activations, the logits), each
    more than nothing, and `describe` names every part with its size after where the number
    came from; a reserve without parts (given, or none) is described by its source alone."""
    computed = reserve(attn_implementation=attn)
    assert computed.source == "computed"
    assert computed.nbytes == sum(n for _, n in computed.parts)
    assert computed.parts[0] == ("cuBLAS workspace", CUBLAS_WORKSPACE_BYTES)
    assert len(computed.parts) == 3 and all(n > 0 for _, n in computed.parts)
    text = computed.describe()
    assert text.startswith("computed: ")
    for what, n in computed.parts:
        assert f"{what} {format_bytes(n)}" in text
    assert ("eager attention" in text) is (attn == "eager")
    given = Reserve(1 << 20, (), "given (--reserve)")
    assert given.describe() == "given (--reserve)"


# 2. it never shrinks when a step could grow

GROWS = {
    "max_batch": (1, 80),
    "max_seq_len": (1, 4096),
    "prefill_tokens": (1, 4096),
    "hidden_size": (0, 512),
    "num_attention_heads": (1, 32),
    "intermediate_size": (0, 1024),
    "vocab_size": (0, 4096),
}


@st.composite
def settings_and_a_bigger_one(draw):
    step = {
        "max_batch": draw(st.integers(*GROWS["max_batch"])),
        "max_seq_len": draw(st.integers(*GROWS["max_seq_len"])),
        "prefill_tokens": draw(st.integers(*GROWS["prefill_tokens"])),
        "attn_implementation": draw(st.sampled_from([None, "sdpa", "eager"])),
    }
    model = {k: draw(st.integers(*GROWS[k])) for k in MODEL}
    dtype = draw(st.sampled_from(["bfloat16", "float16", "float32"]))
    field = draw(st.sampled_from([*GROWS, "attn_implementation", "dtype"]))
    bigger_step, bigger_model, bigger_dtype = dict(step), dict(model), dtype
    if field == "attn_implementation":
        bigger_step[field] = "eager"
    elif field == "dtype":
        bigger_dtype = "float32"
    else:
        _, high = GROWS[field]
        where = bigger_step if field in step else bigger_model
        where[field] = draw(st.integers(where[field], high))
    return (model, dtype, step), (bigger_model, bigger_dtype, bigger_step), field


@settings(max_examples=300, deadline=None)
@given(settings_and_a_bigger_one())
def test_the_reserve_never_shrinks_when_a_step_could_grow(pair) -> None:
    (model, dtype, step), (bigger_model, bigger_dtype, bigger_step), field = pair
    small = step_reserve(model, dtype, **step)
    big = step_reserve(bigger_model, bigger_dtype, **bigger_step)
    assert big.nbytes >= small.nbytes >= CUBLAS_WORKSPACE_BYTES, field


def test_an_moe_layer_reserves_for_the_experts_a_token_runs() -> None:
    """An MoE model's MLP activations are its experts' (moe_intermediate_size each, times the
    experts a token runs): never less than a dense MLP of that width, and more with each
    expert a token runs; a multimodal config.json reserves for its text model."""
    dense = reserve({**MODEL, "intermediate_size": 0}, max_batch=1)
    one = reserve({**MODEL, "intermediate_size": 0, "moe_intermediate_size": 128}, max_batch=1)
    two = reserve(
        {**MODEL, "intermediate_size": 0, "moe_intermediate_size": 128, "num_experts_per_tok": 2},
        max_batch=1,
    )
    assert dense.nbytes < one.nbytes < two.nbytes
    assert one.nbytes == reserve(max_batch=1).nbytes  # one expert of 128: a dense MLP of 128
    wrapped = reserve({"model_type": "vlm", "text_config": MODEL, "vocab_size": 1})
    assert wrapped == reserve()


def test_a_dtype_without_a_known_size_is_reserved_as_float32() -> None:
    """Never less than the widest: an unknown dtype name cannot shrink the reserve."""
    assert reserve(dtype="float8_e4m3fn").nbytes == reserve(dtype="float32").nbytes
    assert reserve(dtype="float32").nbytes > reserve(dtype="bfloat16").nbytes


# 3. which reserve a job gets


def test_given_replaces_it_simulated_gpus_keep_none_and_one_real_gpu_node_computes(index) -> None:
    """--reserve is the reserve wherever the GPUs are (0 included: the operator said none);
    with no real GPU anywhere there is none; one node of real GPUs among simulated ones is
    enough for a computed reserve, the same as on real GPUs alone."""
    assert resolve_reserve(job(reserve_bytes=0), index, GPUS) == Reserve(0, (), "given (--reserve)")
    assert resolve_reserve(job(reserve_bytes=12345), index, SIMULATED).nbytes == 12345
    none = resolve_reserve(job(), index, SIMULATED)
    assert none.nbytes == 0 and none.source.startswith("none: simulated GPUs")
    mixed = ClusterSnapshot(nodes=(*SIMULATED.nodes, *GPUS.nodes))
    computed = resolve_reserve(job(), index, mixed)
    assert computed == resolve_reserve(job(), index, GPUS) and computed.source == "computed"
    assert computed == step_reserve(index.config, index.dtype, **STEP)


def test_the_jobs_options_carry_the_reserve_and_say_where_it_came_from(index) -> None:
    for config, snapshot in ((job(), GPUS), (job(reserve_bytes=7), GPUS), (job(), SIMULATED)):
        options = job_options(config, index, snapshot)
        resolved = resolve_reserve(config, index, snapshot)
        assert options.reserve_bytes == resolved.nbytes
        assert options.reserve_source == resolved.describe()
        assert dataclasses.replace(options, reserve_bytes=0, reserve_source="") == (
            dataclasses.replace(config.plan_options(), reserve_bytes=0, reserve_source="")
        )


def test_auto_max_batch_reserves_for_the_largest_batch_it_may_choose(index) -> None:
    """max_batch 0 (auto) is reserved for AUTO_MAX_BATCH sequences, at least what any batch
    it may choose needs, and both objectives choose within it."""
    from coordinator.planning.batch_size import plan_job
    from coordinator.planning.throughput import BATCHES

    auto = resolve_reserve(job(max_batch=0), index, GPUS)
    for batch in (1, 8, AUTO_MAX_BATCH):
        assert resolve_reserve(job(max_batch=batch), index, GPUS).nbytes <= auto.nbytes
    assert max(BATCHES) <= AUTO_MAX_BATCH
    gpu = node_info(job(max_batch=0), probe_result(), node_id="n", num_gpus=1)
    for objective in ("latency", "throughput"):
        config = job(max_batch=0, objective=objective)
        chosen, plan = plan_job(config, index, ClusterSnapshot(nodes=(gpu,)))
        assert 1 <= chosen.max_batch <= AUTO_MAX_BATCH, objective
        assert plan.options.reserve_bytes == auto.nbytes
        assert resolve_reserve(chosen, index, GPUS).nbytes <= auto.nbytes


def probe_result() -> dict:
    """What `worker.node.probe_here()` returns on a node with one 80 GiB GPU."""
    device = DeviceInfo(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        capability=(9, 0),
        total_memory_bytes=80 * GiB,
        integrated=False,
    )
    probe = NodeProbe(
        cuda_available=True,
        devices=(device,),
        host_available_bytes=400 * GiB,
        link_pinned_bytes_per_s=50e9,
        link_pageable_bytes_per_s=12e9,
    )
    return {
        "hostname": "gpu-a",
        "probe": probe,
        "pin": {"pin": True, "reason": "test", "source": "probe"},
        "error": None,
    }


# 4. it covers what runs


def scheduled_steps(scheduler: Scheduler, prompts: list[list[int]], max_new_tokens: int):
    """Every step the scheduler plans for `prompts`, run to the end: (rows, padded tokens,
    positions its keys reach)."""
    request = Request.of(prompts, sampling=Sampling(), max_new_tokens=max_new_tokens)
    scheduler.enqueue(request)
    seen = []
    for _ in range(10_000):
        scheduler.admit()
        steps = [step for g in scheduler.idle_groups() if (step := scheduler.plan(g))]
        if not steps:
            break
        for step in steps:
            reach = max(a + n for a, n in zip(step.rows.starts, step.rows.counts, strict=True))
            seen.append((len(step.sequences), step.x.size, reach))
            tokens = np.where(step.draw.choose, 11, NO_TOKEN).astype(np.int64)
            scheduler.update(step, 0, tokens)
            scheduler.complete(step)
    assert not scheduler.running and not scheduler.waiting
    return seen


@settings(max_examples=100, deadline=None)
@given(
    max_batch=st.integers(1, 6),
    max_seq_len=st.integers(2, 96),
    prefill_tokens=st.integers(1, 200),
    recurrent=st.sampled_from(["no", "chunks continue", "whole prompts"]),
    micro_batches=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 95), min_size=1, max_size=9),
    attn=st.sampled_from([None, "eager"]),
)
def test_every_step_the_scheduler_plans_fits_the_reserve(
    index, max_batch, max_seq_len, prefill_tokens, recurrent, micro_batches, lengths, attn
) -> None:
    """For the job's settings, every step the engine's scheduler plans (prompt chunks, long
    prompts taken whole where the model's recurrence does not continue over chunks, decodes
    riding along, a full batch decoding) needs no more than the reserve: the reserve computed
    for that step's own rows and padded tokens is at most the job's."""
    whole = recurrent == "whole prompts"
    config = job(
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        prefill_tokens=prefill_tokens,
        attn_implementation=attn,
    )
    model = dataclasses.replace(index, chunks_continue=not whole)
    planned = resolve_reserve(config, model, GPUS)
    scheduler = Scheduler(
        num_slots=max_batch,
        max_seq_len=max_seq_len,
        num_groups=micro_batches,
        prefill_tokens=prefill_tokens,
        uniform=recurrent != "no",
        whole_prompts=whole,
        num_blocks=config.kv_blocks(),
    )
    prompts = [[3 + i % 7 for i in range(min(n, max_seq_len - 1) or 1)] for n in lengths]
    longest = max(len(p) for p in prompts)
    said = covers(planned)
    for rows, tokens, reach in scheduled_steps(scheduler, prompts, max(1, max_seq_len - longest)):
        where = f"a step of {rows} rows, {tokens} padded tokens, keys to position {reach}"
        assert rows <= max_batch
        assert rows <= said["rows"], f"{where}: the job reserved {planned.describe()}"
        assert tokens <= said["tokens"], f"{where}: the job reserved {planned.describe()}"
        if attn == "eager":
            assert reach <= said["positions"], f"{where}: the job reserved {planned.describe()}"
        step = step_reserve(
            index.config,
            index.dtype,
            max_batch=rows,
            max_seq_len=max_seq_len,
            prefill_tokens=tokens,
            attn_implementation=attn,
        )
        assert step.nbytes <= planned.nbytes, (
            f"{where} needs {step.describe()}; the job reserved {planned.describe()}"
        )


def covers(reserve: Reserve) -> dict[str, int]:
    """What a computed reserve says it holds, as the plan shows it to the operator: the rows
    of its logits, the tokens of its activations and, with eager attention, the positions
    of its scores."""
    text = reserve.describe()
    tokens = re.search(r"activations of (\d+) tokens", text)
    rows = re.search(r"logits of (\d+) rows", text)
    positions = re.search(r"x (\d+) positions\)", text)
    assert tokens and rows, text
    said = {"tokens": int(tokens[1]), "rows": int(rows[1])}
    if positions:
        said["positions"] = int(positions[1])
    return said


def test_the_reserve_is_for_the_attention_the_model_runs(tmp_path) -> None:
    """A model that transformers runs with eager attention when none is asked for (Gemma 2)
    has its scores reserved as when eager is asked for."""
    shape = tiny_shape(2, arch="gemma2", dtype="bfloat16", tokenizer=False)
    gemma = load_index(make_checkpoint(tmp_path / "gemma2", shape))
    default = resolve_reserve(job(max_seq_len=4096), gemma, GPUS)
    eager = resolve_reserve(job(max_seq_len=4096, attn_implementation="eager"), gemma, GPUS)
    assert default.nbytes == eager.nbytes, (default.describe(), eager.describe())


def test_a_whole_prompt_model_reserves_for_a_whole_max_seq_len_prompt(index) -> None:
    """Where prompts go in whole (the recurrence does not continue over chunks), the reserve
    is at least that of one max_seq_len prompt in one step, however small prefill_tokens;
    where chunks continue, prefill_tokens bounds it."""
    config = job(max_batch=1, max_seq_len=1024, prefill_tokens=16)
    whole = resolve_reserve(config, dataclasses.replace(index, chunks_continue=False), GPUS)
    chunked = resolve_reserve(config, index, GPUS)
    one_prompt = step_reserve(
        index.config,
        index.dtype,
        max_batch=1,
        max_seq_len=1024,
        prefill_tokens=1024,
        attn_implementation=None,
    )
    assert whole.nbytes >= one_prompt.nbytes > chunked.nbytes
