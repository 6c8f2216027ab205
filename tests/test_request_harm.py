"""One client can never harm another (issue 53): every request value is checked where it enters
(`coordinator.engine.requests.check_request`, shared by `Engine.submit` and the HTTP front), so
a bad one is refused naming its field and never reaches a worker; and a row the last stage
cannot choose a token for fails that row's request alone, the step's other rows going on with
the text transformers gives them (same files, same dtype, one process)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
import torch
from test_engine import GREEDY, FakePipeline, expected
from test_families import VOCAB, Pipeline, family_shape

from coordinator.engine import Engine, EngineConfig
from coordinator.engine.engine import EngineStoppedError
from coordinator.engine.host import ENGINE_RESTART_LIMIT, EngineClient, EngineHost, _Client
from coordinator.engine.pipelines import LocalPipeline, StepTimeoutError
from coordinator.engine.requests import SAMPLING_EPS, RequestError, check_request
from coordinator.planning.checkpoint import load_index
from coordinator.runtime.errors import WorkerLostError
from coordinator.runtime.telemetry import serving_line
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_generate
from offload.errors import ConfigError
from worker.batched import choose_rows, refusal
from worker.steps import Chosen, Draw, RowFailedError, Sampling, SlotSettings, StepRows

WAIT_S = 120.0
NEW = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A bf16 llama that `make_checkpoint` writes with transformers' `save_pretrained`, in one
    in-process stage."""
    root = tmp_path_factory.mktemp("harm") / "ckpt"
    index = load_index(make_checkpoint(root, family_shape("llama", "bfloat16")))
    pipeline = Pipeline(index, [["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]])
    yield pipeline
    pipeline.close()


def greedy_alone(pipeline: Pipeline, prompt: list[int], new: int = NEW) -> list[int]:
    out = reference_generate(
        str(pipeline.index.root),
        torch.tensor([prompt]),
        num_threads=1,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def engine_of(pipeline: Pipeline, pipeline_kind=LocalPipeline, **config) -> Engine:
    return Engine(
        pipeline_kind(pipeline.workers),
        EngineConfig(num_slots=3, max_seq_len=40, vocab_size=VOCAB, **config),
    )


# --- one validation, where a request enters ---------------------------------------------------


def test_check_request_converts_int_likes_and_names_every_bad_value() -> None:
    checked = check_request(
        [np.array([5, 6, 7], dtype=np.int64), [torch.tensor(3), np.int32(4)]],
        sampling=Sampling(do_sample=True, temperature=np.float64(0.7), top_k=np.int64(5)),
        max_new_tokens=np.int64(4),
        eos_token_ids=[np.int64(2), VOCAB + 10],  # past the vocabulary: can never be chosen
        seed=np.uint64(7),
        logprobs=np.int16(2),
        vocab_size=VOCAB,
    )
    assert checked.prompts == [[5, 6, 7], [3, 4]]
    assert all(type(t) is int for p in checked.prompts for t in p)
    assert checked.sampling == Sampling(do_sample=True, temperature=0.7, top_k=5, top_p=1.0)
    assert (checked.max_new_tokens, checked.eos_token_ids, checked.seed) == (4, (2,), 7)
    assert checked.logprobs == 2 and type(checked.logprobs) is int

    def refused(field: str, **changes) -> RequestError:
        values = dict(
            sampling=Sampling(), max_new_tokens=4, vocab_size=VOCAB, names={"prompts": "prompt"}
        )
        prompts = changes.pop("prompts", [[1, 2]])
        values.update(changes)
        with pytest.raises(RequestError) as caught:
            check_request(prompts, **values)
        assert caught.value.param == field, caught.value
        assert isinstance(caught.value, ConfigError)  # a 400, exit code 2
        return caught.value

    for bad in (float("inf"), float("nan"), -0.5, "hot", True, 10**400, 1e300):
        refused("temperature", sampling=Sampling(do_sample=True, temperature=bad))
    assert "finite" in str(refused("top_p", sampling=Sampling(top_p=float("nan"))))
    refused("top_p", sampling=Sampling(top_p=0.0))
    refused("top_k", sampling=Sampling(top_k=-1))
    refused("top_k", sampling=Sampling(top_k=2.5))
    assert "out of the vocabulary" in str(refused("prompt", prompts=[[1, VOCAB]]))
    refused("prompt", prompts=[[1, -1]])
    with pytest.raises(RequestError, match="out of the vocabulary"):  # none known: 64 bits
        check_request([[2**64]], sampling=Sampling(), max_new_tokens=1)
    refused("prompt", prompts=[[1.0, 2.0]])  # floats are not token ids
    refused("prompt", prompts=[[True]])
    refused("prompt", prompts=[[]])
    refused("prompt", prompts=[])
    refused("prompt", prompts="hello")
    refused("logprobs", logprobs=-1)
    refused("logprobs", logprobs=VOCAB + 1)
    refused("prompt_logprobs", prompt_logprobs=-3)
    refused("max_new_tokens", max_new_tokens=-1)
    refused("max_new_tokens", max_new_tokens=float("inf"))
    refused("min_new_tokens", min_new_tokens=-2)
    refused("seed", seed=2**70)
    refused("seed", seed=1.5)
    refused("eos_token_ids", eos_token_ids=[-4])
    for bad in (-0.1, 1.5, float("nan")):
        refused("min_p", sampling=Sampling(do_sample=True, min_p=bad))
    for bad in (0.0, -1.0, float("inf"), "1.1", 3.2e-69, 1e39):  # the fuzzer's 3.2e-69
        refused("repetition_penalty", sampling=Sampling(repetition_penalty=bad))
    refused("frequency_penalty", sampling=Sampling(frequency_penalty=2.5))
    refused("presence_penalty", sampling=Sampling(presence_penalty=-3))
    refused("logit_bias", sampling=Sampling(logit_bias=((VOCAB, 1.0),)))
    refused("logit_bias", sampling=Sampling(logit_bias=((3, float("inf")),)))
    refused("logit_bias", sampling=Sampling(logit_bias=((3, 3e38),)))  # 2 x 3e38 is inf
    refused("logit_bias", sampling=Sampling(logit_bias=((3, 1.0), (3, 2.0))))
    refused("logit_bias", sampling=Sampling(logit_bias=((3,),)))
    refused("bad_words", sampling=Sampling(bad_words=((),)))
    refused("bad_words", sampling=Sampling(bad_words=((1, -2),)))
    processed = check_request(
        [[1]],
        sampling=Sampling(
            min_p=0.3,  # greedy: min_p does nothing, and is dropped
            repetition_penalty=np.float32(1.25),
            logit_bias=[(np.int64(4), 2)],
            bad_words=[[5, 6]],
        ),
        max_new_tokens=1,
        vocab_size=VOCAB,
    ).sampling
    assert processed == Sampling(
        repetition_penalty=1.25, logit_bias=((4, 2.0),), bad_words=((5, 6),)
    )
    assert type(processed.logit_bias[0][0]) is int
    # the API's own names, where it calls them otherwise
    error = refused("max_tokens", max_new_tokens=-1, names={"max_new_tokens": "max_tokens"})
    assert "max_tokens=-1" in str(error)


def test_a_temperature_below_vllms_epsilon_is_greedy() -> None:
    for tiny in (1e-300, SAMPLING_EPS / 2, 0.0):
        checked = check_request(
            [[1]], sampling=Sampling(do_sample=True, temperature=tiny), max_new_tokens=1
        )
        assert not checked.sampling.do_sample, tiny
    kept = check_request(
        [[1]], sampling=Sampling(do_sample=True, temperature=SAMPLING_EPS), max_new_tokens=1
    )
    assert kept.sampling.do_sample and kept.sampling.temperature == SAMPLING_EPS


def test_bad_values_never_reach_the_engine_and_its_load_answers_on(llama) -> None:
    """The issue's Python client: a numpy prompt, logprobs=-1, temperature 1e-300 or inf.
    None of them stops the engine: the bad ones are refused at submit, the odd ones run (a
    numpy prompt as its ints, 1e-300 greedily), and an innocent request beside them gets
    transformers' text."""
    prompt = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 81]
    expected = greedy_alone(llama, prompt)
    engine = engine_of(llama)
    try:
        with pytest.raises(RequestError, match="logprobs"):
            engine.submit([prompt], sampling=Sampling(), max_new_tokens=NEW, logprobs=-1)
        with pytest.raises(RequestError, match="temperature"):
            engine.submit(
                [prompt],
                sampling=Sampling(do_sample=True, temperature=float("inf")),
                max_new_tokens=NEW,
            )
        with pytest.raises(RequestError, match="token id"):
            engine.submit([[1, VOCAB + 3]], sampling=Sampling(), max_new_tokens=NEW)
        innocent = engine.submit([prompt], sampling=Sampling(), max_new_tokens=NEW)
        as_numpy = engine.submit(
            [np.array(prompt, dtype=np.int64)], sampling=Sampling(), max_new_tokens=NEW
        )
        tiny = engine.submit(
            [prompt],
            sampling=Sampling(do_sample=True, temperature=1e-300),
            max_new_tokens=NEW,
            seed=3,
        )
        assert innocent.result(WAIT_S) == [expected]
        assert as_numpy.result(WAIT_S) == [expected]
        assert tiny.result(WAIT_S) == [expected]
        again = engine.submit([prompt], sampling=Sampling(), max_new_tokens=NEW)
        assert again.result(WAIT_S) == [expected]
    finally:
        engine.close()


# --- a row's failure is that request's failure only -------------------------------------------


def test_a_row_the_last_stage_cannot_choose_fails_alone() -> None:
    """choose_rows: a slot whose settings were refused, a row of NaN logits, and a row whose
    draw raises fail by themselves; the others get the tokens they get alone."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[2, 7] = float("nan")
    rows = StepRows.in_slots([0, 1, 2, 3], [0] * 4, [1] * 4, 1, num_slots=4, max_seq_len=8)
    plain = SlotSettings(sampling=Sampling(), prompt_length=1)
    sampled = SlotSettings(
        sampling=Sampling(do_sample=True, temperature=0.8), seed=5, prompt_length=1
    )
    settings = {0: plain, 1: sampled, 2: plain, 3: plain}
    refused = {3: "its settings were refused: temperature must be finite"}
    out = choose_rows(logits, rows, [True] * 4, settings, refused)
    assert isinstance(out, Chosen)
    assert sorted(out.failed) == [2, 3]
    assert "NaN" in out.failed[2] and "finite" in out.failed[3]
    alone0 = choose_rows(
        logits[:1],
        StepRows.in_slots([0], [0], [1], 1, num_slots=4, max_seq_len=8),
        [True],
        settings,
    )
    alone1 = choose_rows(
        logits[1:2],
        StepRows.in_slots([1], [0], [1], 1, num_slots=4, max_seq_len=8),
        [True],
        settings,
    )
    assert int(out.tokens[0]) == int(alone0[0]) == int(torch.argmax(logits[0]))
    assert int(out.tokens[1]) == int(alone1[0])
    assert int(out.tokens[2]) == int(out.tokens[3]) == 0  # placeholders a burst may feed on


def test_a_draw_that_raises_is_pinned_on_its_row(monkeypatch) -> None:
    """Choosing the rows together raises (a row the vectorised draw cannot take): each row is
    chosen alone, and only the one that raises alone fails."""
    import worker.batched as batched

    real = batched.sample_rows

    def picky(logits, settings):
        if 0.25 in settings.temperature:
            raise RuntimeError("a draw this row cannot take")
        return real(logits, settings)

    monkeypatch.setattr(batched, "sample_rows", picky)
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    rows = StepRows.in_slots([0, 1, 2], [0] * 3, [1] * 3, 1, num_slots=3, max_seq_len=8)

    def one(temperature: float) -> SlotSettings:
        return SlotSettings(
            sampling=Sampling(do_sample=True, temperature=temperature), seed=9, prompt_length=1
        )

    settings = {0: one(0.5), 1: one(0.25), 2: one(0.9)}
    out = choose_rows(logits, rows, [True] * 3, settings)
    assert isinstance(out, Chosen) and list(out.failed) == [1]
    assert "a draw this row cannot take" in out.failed[1]
    for r in (0, 2):
        alone = choose_rows(
            logits[r : r + 1],
            StepRows.in_slots([r], [0], [1], 1, num_slots=3, max_seq_len=8),
            [True],
            settings,
        )
        assert int(out.tokens[r]) == int(alone[0])


def test_a_penalized_row_keeps_its_tokens_and_fails_alone_without_them() -> None:
    """The last stage keeps a penalized slot's tokens: each token it chooses is added at its
    position (a position chosen again replaces what came after it), so the penalty sees the
    tokens the row fed. A slot whose tokens it does not hold fails alone."""
    logits = torch.zeros(2, 30)
    logits[:, 7] = 2.0  # greedy picks 7 ...
    logits[:, 8] = 1.9  # ... until a penalty on 7 makes 8 the larger
    penalized = SlotSettings(
        sampling=Sampling(repetition_penalty=2.0), prompt_length=2, history=(3, 4)
    )
    settings = {0: penalized, 1: penalized}
    histories = {0: [3, 4]}  # slot 1's never came

    def step(start: int):
        rows = StepRows.in_slots([0, 1], [start] * 2, [1] * 2, 1, num_slots=2, max_seq_len=8)
        return choose_rows(logits, rows, [True, True], settings, None, histories)

    first = step(1)  # chooses position 2
    assert isinstance(first, Chosen) and list(first.failed) == [1]
    assert "none reached this stage" in first.failed[1]
    assert int(first.tokens[0]) == 7 and histories[0] == [3, 4, 7]
    assert int(step(2).tokens[0]) == 8 and histories[0] == [3, 4, 7, 8]  # 7 is penalized now
    assert int(step(1).tokens[0]) == 7 and histories[0] == [3, 4, 7]  # position 2 again
    gap = step(5)  # position 6: the tokens of positions 3 to 5 never came
    assert list(gap.failed) == [0, 1] and "up to position 3, not up to 6" in gap.failed[0]


def test_refusal_names_what_a_worker_cannot_take() -> None:
    assert refusal(SlotSettings(sampling=Sampling())) is None
    bad = SlotSettings(sampling=Sampling(do_sample=True, temperature=float("inf")), seed=1)
    assert "temperature" in refusal(bad)
    assert "seed" in refusal(SlotSettings(sampling=Sampling(do_sample=True)))


class SlippingThrough(LocalPipeline):
    """Settings that got past the engine's check (say a client of an older engine): the
    sequences of prompts starting with `marker` reach the last stage with temperature inf."""

    marker = 90

    def submit(self, steps):
        for step in steps:
            bad = {s.slot for s in step.sequences if s.prompt[0] == self.marker}
            settings = tuple(
                (
                    slot,
                    SlotSettings(
                        sampling=Sampling(do_sample=True, temperature=float("inf")), seed=1
                    ),
                )
                if slot in bad
                else (slot, s)
                for slot, s in step.draw.settings
            )
            step.draw = Draw(step.draw.choose, settings)
        return super().submit(steps)


@pytest.mark.parametrize("burst", [1, 0], ids=["step-by-step", "bursts"])
def test_a_bad_row_fails_its_request_and_the_batch_goes_on(llama, burst) -> None:
    innocents = [[3, 8, 12, 40, 41], [7, 7, 2, 19, 30, 31, 5]]
    expected = [greedy_alone(llama, p) for p in innocents]
    engine = engine_of(llama, SlippingThrough, burst_steps=burst, batch_wait_s=0.2)
    try:
        first = engine.submit([innocents[0]], sampling=Sampling(), max_new_tokens=NEW)
        bad = engine.submit(
            [[SlippingThrough.marker, 4, 5]], sampling=Sampling(), max_new_tokens=NEW
        )
        second = engine.submit([innocents[1]], sampling=Sampling(), max_new_tokens=NEW)
        assert first.result(WAIT_S) == [expected[0]]
        assert second.result(WAIT_S) == [expected[1]]
        assert bad.wait(WAIT_S)
        with pytest.raises(RowFailedError, match="sequence 0: its settings were refused"):
            bad.result()
        assert engine.stats.snapshot()["requests_running"] == 0
        after = engine.submit([innocents[1]], sampling=Sampling(), max_new_tokens=NEW)
        assert after.result(WAIT_S) == [expected[1]]
    finally:
        engine.close()


# --- a dead engine is never silent ------------------------------------------------------------


def hosted(pipeline: Pipeline, rebuild_gate: threading.Event | None = None, **host_options):
    """An `EngineHost` over `pipeline`'s in-process workers, whose new engines (after one
    stops) wait for `rebuild_gate`, and a client of it."""

    def build(stats=None, take_over=False) -> Engine:
        return Engine(
            LocalPipeline(pipeline.workers),
            EngineConfig(num_slots=3, max_seq_len=40, vocab_size=VOCAB),
            take_over=take_over,
            stats=stats,
        )

    def rebuild(stats) -> Engine:
        assert rebuild_gate is None or rebuild_gate.wait(WAIT_S)
        return build(stats, take_over=True)

    host = EngineHost(build(), rebuild=rebuild, restart_delay_s=0.05, **host_options)
    client = EngineClient(lambda method, *a, **kw: getattr(host, method)(*a, **kw), host=host)
    return host, client


def break_loop(engine: Engine, message: str) -> None:
    """A bug in the engine's loop: its next plan of a step raises."""

    def broken(group: int):
        raise RuntimeError(message)

    engine.scheduler.plan = broken


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_dead_engine_fails_every_request_at_once_and_a_new_one_serves(llama) -> None:
    prompt = [4, 8, 15, 16, 23, 42]
    expected = greedy_alone(llama, prompt)
    gate = threading.Event()
    host, client = hosted(llama, gate)
    try:
        first = host.engine
        break_loop(first, "a bug in the step loop")
        pending = client.submit([prompt], sampling=Sampling(), max_new_tokens=NEW)
        assert pending.wait(WAIT_S)  # ended with the engine, not left waiting
        with pytest.raises(EngineStoppedError, match="a bug in the step loop"):
            pending.result()
        # until a new engine runs: every submit fails at once, health and the stats say why
        with pytest.raises(EngineStoppedError, match="a bug in the step loop"):
            client.submit([prompt], sampling=Sampling(), max_new_tokens=NEW)
        assert "a bug in the step loop" in host.health()
        stats = host.stats()
        assert stats["engine_state"] == "restarting" and stats["engine_failures"] == 1
        assert 'offload:engine_failures_total{model_name="m"} 1' in host.prometheus("m")
        assert 'offload:engine_serving{model_name="m"} 0' in host.prometheus("m")
        assert "loop stopped 1 time(s)" in serving_line(stats)
        gate.set()
        until(lambda: host.engine is not first and host.health() is None, "no new engine")
        again = client.submit([prompt], sampling=Sampling(), max_new_tokens=NEW)
        assert again.result(WAIT_S) == [expected]
        stats = host.stats()
        assert (stats["engine_state"], stats["engine_restarts"]) == ("serving", 1)
        assert 'offload:engine_serving{model_name="m"} 1' in host.prometheus("m")
    finally:
        gate.set()
        host.close()


def test_a_load_whose_engines_keep_stopping_is_failed_and_says_so(llama) -> None:
    failed: list[str] = []
    host, client = hosted(llama, on_failed=failed.append)
    try:
        for n in range(ENGINE_RESTART_LIMIT):
            engine = host.engine
            break_loop(engine, f"bug number {n}")
            request = client.submit([[5, 6, 7]], sampling=Sampling(), max_new_tokens=2)
            assert request.wait(WAIT_S)
            assert isinstance(request.error, EngineStoppedError)
            if n + 1 < ENGINE_RESTART_LIMIT:
                until(lambda e=engine: host.engine is not e, "no new engine")
        until(lambda: host.stats()["engine_state"] == "failed", "not failed")
        assert failed and f"bug number {ENGINE_RESTART_LIMIT - 1}" in failed[0]
        assert "failed" in host.health()
        with pytest.raises(EngineStoppedError):
            client.submit([[5, 6, 7]], sampling=Sampling(), max_new_tokens=2)
        assert "cannot serve" in serving_line(host.stats())
    finally:
        host.close()


def test_a_gone_clients_outbox_is_dropped_and_tokens_wake_only_their_client(llama) -> None:
    host, client = hosted(llama, lease_s=0.4)
    try:
        # a client that submits and never fetches (its process died): its request is
        # cancelled, and once it has ended its outbox goes
        host.submit("ghost", 1, [[9, 10, 11]], sampling=Sampling(), max_new_tokens=30)
        until(lambda: "ghost" not in host._clients, "the gone client's outbox stayed")
        # a client waiting for its tokens is not woken by another client's
        wakes = []

        class Counting(threading.Condition):
            def notify(self, n: int = 1) -> None:
                wakes.append(n)
                super().notify(n)

            notify_all = notify

        with host._lock:
            box = host._clients["idle"] = _Client(Counting(host._lock))
            box.open.add(99)  # it waits on a request of its own
        idle = threading.Thread(target=host.fetch, args=("idle", 5.0), daemon=True)
        idle.start()
        request = client.submit([[9, 10, 11]], sampling=Sampling(), max_new_tokens=NEW)
        assert len(request.result(WAIT_S)[0]) == NEW
        assert wakes == []
    finally:
        host.close()


# --- a hung worker is a lost worker -----------------------------------------------------------


def test_a_step_that_times_out_is_recovered_as_a_lost_worker_and_goes_on() -> None:
    """The engine's wait for a step ends at step_timeout_s: the recovery is asked to replace
    the hung stage (the load's `kill_hung`, then as for a lost worker), and every request in
    flight goes on from its tokens so far, with the tokens an uninterrupted run gives."""
    pipeline = FakePipeline()
    timeouts: list[BaseException] = []
    waits = []

    def wait(handles, timeout_s):
        waits.append(timeout_s)
        return [] if len(pipeline.steps) == 3 and not timeouts else list(handles)

    def recover(exc, epoch):
        if isinstance(exc, StepTimeoutError):  # the recovery killed the hung worker: lost
            timeouts.append(exc)
            exc = WorkerLostError("the hung worker was killed")
        FakePipeline.recover(pipeline, exc, epoch)

    pipeline.wait = wait
    engine = Engine(
        pipeline,
        EngineConfig(num_slots=2, max_seq_len=64, step_timeout_s=0.25, burst_steps=1),
        recover=recover,
        gate=lambda: contextlib.nullcontext(pipeline.epoch),
    )
    try:
        a = engine.submit([[3, 4, 5]], sampling=GREEDY, max_new_tokens=8)
        b = engine.submit([[6, 7]], sampling=GREEDY, max_new_tokens=8)
        assert a.result(WAIT_S) == [expected([3, 4, 5], 8)]
        assert b.result(WAIT_S) == [expected([6, 7], 8)]
        assert len(timeouts) == 1 and "did not finish within 0 s" in str(timeouts[0])
        assert isinstance(timeouts[0], TimeoutError)
        assert pipeline.recoveries == 1 and engine.stats.restarts == 1
        assert set(waits) == {0.25}
    finally:
        engine.close()


# --- the server's event loop never waits on Ray -----------------------------------------------


def test_a_slow_engine_call_never_stalls_the_replicas_event_loop() -> None:
    """A request's submit and cancel are calls to the load's engine (through Ray for a named
    load): they run off the event loop, which serves the replica's other streams meanwhile.
    Each call here returns only once the loop has run a coroutine while it was in flight: were
    the loop blocked by the call, it would never return (its bounded wait would fail)."""
    from types import SimpleNamespace

    from coordinator.engine.sequences import Request
    from coordinator.serving.runs import Run

    loop_ran = threading.Event()
    calls: list[str] = []

    class Engine_:
        def cancel(self, request) -> None:
            calls.append("cancel" if loop_ran.wait(WAIT_S) else "cancel blocked the loop")

    class Job:
        index = None

        def submit(self, ids, **options) -> Request:
            calls.append("submit" if loop_ran.wait(WAIT_S) else "submit blocked the loop")
            return Request.of(ids.tolist(), sampling=Sampling(), max_new_tokens=2)

        def engine(self):
            return Engine_()

    async def main() -> None:
        async def other_stream() -> None:
            while True:
                await asyncio.sleep(0.01)
                loop_ran.set()

        other = asyncio.create_task(other_stream())
        run = Run(
            Job(),
            SimpleNamespace(),
            torch.tensor([[1, 2]]),
            {"eos_token_id": [0], "max_new_tokens": 2},
        )
        await run.start()
        loop_ran.clear()
        run.cancel()  # returns at once: the call goes on on a thread
        for _ in range(int(WAIT_S / 0.01)):
            if len(calls) == 2:
                break
            await asyncio.sleep(0.01)
        other.cancel()

    asyncio.run(main())
    assert calls == ["submit", "cancel"]


def test_a_new_engine_that_cannot_start_yet_is_tried_again_then_the_load_fails(
    llama, monkeypatch
) -> None:
    """A new engine that does not start (its workers are being recovered) is tried again, the
    delay doubling, and the load answers once one starts; one that never starts within
    ENGINE_START_LIMIT_S fails the load."""
    import coordinator.engine.host as host_module

    tries: list[int] = []
    real_rebuild = None

    def flaky(stats):
        tries.append(1)
        if len(tries) <= 3:  # more than ENGINE_RESTART_LIMIT: these are not loops that ended
            raise WorkerLostError("a worker of this load was lost")
        return real_rebuild(stats)

    host, client = hosted(llama)
    try:
        real_rebuild, host._rebuild = host._rebuild, flaky
        first = host.engine
        break_loop(first, "a bug")
        assert client.submit([[5, 6, 7]], sampling=Sampling(), max_new_tokens=2).wait(WAIT_S)
        until(lambda: host.engine is not first, "no new engine")
        assert len(tries) == 4 and host.health() is None
        assert client.submit([[5, 6, 7]], sampling=Sampling(), max_new_tokens=2).result(WAIT_S)
        # one that never starts: the load is failed once the limit is past
        monkeypatch.setattr(host_module, "ENGINE_START_LIMIT_S", 0.3)

        def never(stats):
            raise WorkerLostError("gone for good")

        host._rebuild = never
        second = host.engine
        break_loop(second, "another bug")
        assert client.submit([[5, 6, 7]], sampling=Sampling(), max_new_tokens=2).wait(WAIT_S)
        until(lambda: host.stats()["engine_state"] == "failed", "not failed")
        assert "did not start: gone for good" in host.health()
    finally:
        host.close()
