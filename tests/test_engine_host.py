"""A load's engine as its clients reach it (`coordinator.engine.host`): several clients of one
engine, each request's callbacks on the client's own thread (never the engine's), a client
that goes silent has its requests cancelled. On the stand-in pipeline of test_engine.py; the
same host in a named load's keeper is in test_named_loads.py."""

from __future__ import annotations

import threading

import pytest
from test_engine import GREEDY, WAIT_S, FakePipeline, expected

from coordinator.engine import Engine, EngineConfig, Finish
from coordinator.engine.host import EngineClient, EngineHost
from offload.errors import NeverFitsError


@pytest.fixture
def host():
    pipeline = FakePipeline()
    engine = Engine(pipeline, EngineConfig(num_slots=2, max_seq_len=1024, burst_steps=4))
    made = EngineHost(engine)
    yield made
    made.close()


def client_of(host: EngineHost) -> EngineClient:
    return EngineClient(lambda method, *a, **kw: getattr(host, method)(*a, **kw))


def test_clients_share_one_engine_and_their_callbacks_run_off_its_thread(host) -> None:
    clients = [client_of(host) for _ in range(3)]
    threads: set[str] = set()
    seen: dict[int, list[int]] = {}

    def on_token(i):
        def record(row, token):
            threads.add(threading.current_thread().name)
            seen.setdefault(i, []).append(token)

        return record

    requests = [
        c.submit([[3 + i, 4]], sampling=GREEDY, max_new_tokens=6, on_token=on_token(i))
        for i, c in enumerate(clients)
    ]
    for i, request in enumerate(requests):
        assert request.result(WAIT_S) == [expected([3 + i, 4], 6)]
        assert seen[i] == expected([3 + i, 4], 6)
        assert request.finish_reasons == [Finish.LENGTH]
    assert threads == {"offload-engine-client"}  # never "offload-engine"
    assert host.engine.stats.requests == 3 and len(host.engine.scheduler.free_slots) == 2


def test_refusals_reach_the_client_as_they_are(host) -> None:
    client = client_of(host)
    with pytest.raises(NeverFitsError, match="max_seq_len=1024"):
        client.submit([[3] * 1020], sampling=GREEDY, max_new_tokens=10)
    assert client.submit([[3]], sampling=GREEDY, max_new_tokens=0).result(WAIT_S) == [[]]


def test_a_cancel_from_the_client_frees_the_slot(host) -> None:
    """Ordered by events (issue 60): once the client has heard a token, no step runs until
    the engine holds the client's cancel, so the request's 1000 tokens cannot have ended it
    first; it ends aborted, with at most the tokens of the burst in flight after the cancel."""
    client = client_of(host)
    engine = host.engine
    pipeline, submit = engine.pipeline, engine.pipeline.submit
    cancel, cancelled = engine.cancel, threading.Event()
    made_at_cancel: list[int] = []

    def held(steps):  # the engine's thread: a step after the first token waits for the cancel
        if any(s.generated for step in steps for s in step.sequences):
            assert cancelled.wait(WAIT_S), "the client's cancel never reached the engine"
        return submit(steps)

    def watched_cancel(request) -> None:
        made_at_cancel.append(len(request.sequences[0].generated))
        cancel(request)
        cancelled.set()

    def cancel_at_the_first(row, token):
        if not made_at_cancel:
            client.cancel(long)

    pipeline.submit, engine.cancel = held, watched_cancel
    long = client.submit(
        [[3, 4]], sampling=GREEDY, max_new_tokens=1000, on_token=cancel_at_the_first
    )
    assert long.wait(WAIT_S) and long.finish_reasons == [Finish.ABORT]
    [made] = made_at_cancel
    assert made <= len(long.sequences[0].generated) <= made + engine.config.burst_steps
    assert client.submit([[5]], sampling=GREEDY, max_new_tokens=3).result(WAIT_S) == [
        expected([5], 3)
    ]


def test_a_client_that_goes_silent_has_its_requests_cancelled() -> None:
    """A client process that dies mid-request stops fetching: after the lease its requests
    end (aborted) and their slots go to the others. Ordered by events (issue 60): the steps
    wait until the lease has cancelled the silent request, so its 4000 tokens cannot have
    ended it first; then it ends aborted, with almost none of them made."""
    pipeline = FakePipeline()
    engine = Engine(pipeline, EngineConfig(num_slots=1, max_seq_len=4096, burst_steps=1))
    host = EngineHost(engine, lease_s=0.4)
    silent_cancelled = threading.Event()
    cancel = engine.cancel

    def watched_cancel(request) -> None:
        if request is host._requests.get(("gone", 1)):
            silent_cancelled.set()
        cancel(request)

    engine.cancel = watched_cancel
    try:
        pipeline.gate.clear()  # no step runs until the lease has cancelled the silent request
        host.submit("gone", 1, [[3, 4]], sampling=GREEDY, max_new_tokens=4000)
        gone = host._requests[("gone", 1)]
        alive = client_of(host).submit([[5]], sampling=GREEDY, max_new_tokens=3)
        assert silent_cancelled.wait(WAIT_S), "the lease never cancelled the silent client"
        pipeline.gate.set()
        assert alive.result(WAIT_S) == [expected([5], 3)]
        assert gone.wait(WAIT_S) and gone.finish_reasons == [Finish.ABORT]
        assert len(gone.sequences[0].generated) < 4000
        assert host.engine.stats.requests == 2 and not host.engine.scheduler.running
    finally:
        pipeline.gate.set()
        host.close()
