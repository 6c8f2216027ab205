"""The HTTP bridge of a `serve` process (coordinator/serving/bridge.py) and a completion request
in its job's engine (coordinator/serving/runs.py), in process: the serve process's own uvicorn
(`HttpFront`) with a stand-in for the Serve handle that runs the app's FastAPI code through
`run_asgi` as a replica does; `Run` against a stand-in job whose engine the test plays (its
fetch thread calls the request's callbacks), with the real tiny tokenizer. No Ray.

What the callers rely on: the request reaches the app as it came and its response streams back
in order; a client that goes away cancels the replica's run, and with it the request in the
engine; a replica that fails is a 503 (an app with no response a 500) in OpenAI's error shape;
a port in use is refused naming it; a request's deltas come in order and add up to each row's
text; a request is cancelled in the engine when its client goes, when every row has met a stop
string, and never twice; its error is raised, as an Exception."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI, Request  # at top level: the app's annotations name them
from fastapi.responses import StreamingResponse

from coordinator.serving import bridge as bridge_module
from coordinator.serving import runs as runs_module
from coordinator.serving.bridge import HttpFront, HttpRequest, ResponseStart, bind, run_asgi
from coordinator.serving.runs import FLOOR_LOGPROB, Run
from coordinator.serving.text import TextStream
from offload.errors import ConfigError
from worker.steps import Logprobs

WAIT_S = 60.0  # bound on what a test waits for; never reached when the code is right
_END = object()


# --- bridge: run_asgi, in a replica ---------------------------------------------------------


def _request(method="GET", path="/x", body=b"", query=b"", headers=()) -> HttpRequest:
    return HttpRequest(
        method=method,
        path=path,
        query_string=query,
        headers=tuple(headers),
        body=body,
        client=("10.0.0.7", 5123),
    )


def test_run_asgi_hands_the_request_and_yields_the_start_then_each_chunk() -> None:
    """The app gets the request as the serve process received it (scope and body); what it
    sends comes back as one ResponseStart then its non-empty body chunks, in order. A complete
    response is not cancelled: the app's code after its last send still runs."""
    seen: dict = {}
    log: list[str] = []

    async def app(scope, receive, send) -> None:
        seen.update(scope=scope, message=await receive())
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
        for chunk in (b"one ", b"", b"two"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        try:
            await asyncio.sleep(0)  # after its response: run_asgi waits for it, never cancels
            log.append("ended by itself")
        except asyncio.CancelledError:
            log.append("cancelled")
            raise

    async def main() -> list:
        request = _request("POST", "/v1/completions", b'{"p": 1}', b"a=1", ((b"x-who", b"me"),))
        return [item async for item in run_asgi(app, request)]

    items = asyncio.run(main())
    assert items == [ResponseStart(status=201, headers=((b"x-a", b"1"),)), b"one ", b"two"]
    scope = seen["scope"]
    assert (scope["type"], scope["method"], scope["path"], scope["raw_path"]) == (
        "http",
        "POST",
        "/v1/completions",
        b"/v1/completions",
    )
    assert scope["query_string"] == b"a=1" and scope["headers"] == [(b"x-who", b"me")]
    assert scope["client"] == ("10.0.0.7", 5123)
    assert seen["message"] == {"type": "http.request", "body": b'{"p": 1}', "more_body": False}
    assert log == ["ended by itself"]


def test_run_asgi_closed_early_cancels_the_app_and_waits_for_its_finally(monkeypatch) -> None:
    """The client went away (the replica's run is closed mid-response): the app's run is
    cancelled at once (not when CANCEL_WAIT_S runs out, made longer than the test's bound
    here), and its `finally` (where a request is cancelled in the engine) has run by the time
    the close returns. An app that looks at its client again sees it gone."""
    monkeypatch.setattr(bridge_module, "CANCEL_WAIT_S", 10 * WAIT_S)
    log: list = []
    never = None

    async def blocked(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        try:
            await never.wait()  # a token that never comes
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        finally:
            log.append("finally")

    async def listening(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        log.append((await receive())["type"])  # the client's next message: it is gone

    async def main(app) -> list:
        nonlocal never
        never = asyncio.Event()
        items = run_asgi(app, _request())
        got = [await items.__anext__(), await items.__anext__()]
        closing = asyncio.ensure_future(items.aclose())
        await asyncio.wait({closing}, timeout=WAIT_S)  # a bound that never cancels it
        assert closing.done(), "the app's run was not cancelled"
        log.append("closed")
        return got

    got = asyncio.run(main(blocked))
    assert got == [ResponseStart(status=200, headers=()), b"first"]
    assert log == ["cancelled", "finally", "closed"]
    log.clear()
    asyncio.run(main(listening))
    assert log[-1] == "closed"  # ended (by the disconnect or the cancel) before the close
    assert log[:-1] in ([], ["http.disconnect"])


# --- bridge: HttpFront, the serve process's own HTTP server ---------------------------------


class Streamed:
    """What `handle.forward.remote(request)` returns with stream=True: the items the replica's
    run yields, as they come; the run is a task of its own (as Serve runs the call in the
    replica), which `cancel()` cancels."""

    def __init__(self, items) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False
        self._run = asyncio.ensure_future(self._pump(items))

    async def _pump(self, items) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
        except Exception as exc:  # the replica failed: its caller sees the error
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(_END)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self._cancelled = True
        self._run.cancel()

    def cancelled(self) -> bool:
        return self._cancelled


class Handle:
    """The app ingress's DeploymentHandle as HttpFront uses it: each request runs `app` through
    `run_asgi` (the replica's side); `failing`: the replica's call raises that instead."""

    def __init__(self, app, failing: Exception | None = None) -> None:
        self.app, self.failing = app, failing
        self.requests: list[HttpRequest] = []
        self.responses: list[Streamed] = []
        self.forward = SimpleNamespace(remote=self._remote)

    def options(self, *, stream: bool) -> Handle:
        assert stream, "the front streams every response"
        return self

    def _remote(self, request: HttpRequest) -> Streamed:
        self.requests.append(request)

        async def failed():
            raise self.failing
            yield  # an async generator

        streamed = Streamed(failed() if self.failing else run_asgi(self.app, request))
        self.responses.append(streamed)
        return streamed


def _front(handle: Handle) -> tuple[HttpFront, int]:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    return HttpFront(handle, sock), port


def _app(ended: threading.Event):
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request):
        body = await request.body()

        async def chunks():
            yield f"{request.method} {request.url.path} {request.url.query} ".encode()
            yield request.headers["x-who"].encode() + b" "
            yield body

        return StreamingResponse(chunks(), status_code=201, headers={"x-answer": "yes"})

    @app.get("/v1/forever")
    async def forever():
        async def chunks():
            try:
                yield b"first;"
                await asyncio.Event().wait()  # the next token never comes
            finally:
                ended.set()  # where a request's cancel runs

        return StreamingResponse(chunks())

    return app


def test_the_front_hands_the_request_as_it_came_and_streams_the_response_back() -> None:
    handle = Handle(_app(threading.Event()))
    front, port = _front(handle)
    try:
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        client.request("POST", "/v1/echo?a=1", body=b"hello", headers={"x-who": "me"})
        response = client.getresponse()
        assert (response.status, response.getheader("x-answer")) == (201, "yes")
        assert response.read() == b"POST /v1/echo a=1 me hello"
        client.close()
    finally:
        front.close()
    (request,) = handle.requests
    assert (request.method, request.path, request.query_string, request.body) == (
        "POST",
        "/v1/echo",
        b"a=1",
        b"hello",
    )
    assert (b"x-who", b"me") in request.headers and request.client[0] == "127.0.0.1"
    with pytest.raises(ConnectionRefusedError):  # closed: its socket with it
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()


def test_a_client_that_goes_away_cancels_the_replicas_run() -> None:
    """The client reads the first chunk and closes its connection: the front cancels the
    handle's call, and the app's streaming ends (its `finally` runs), so the request in the
    engine is cancelled rather than generating for nobody."""
    ended = threading.Event()
    handle = Handle(_app(ended))
    front, port = _front(handle)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as client:
            client.sendall(b"GET /v1/forever HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while b"first;" not in received:
                data = client.recv(4096)
                assert data, f"the connection ended early: {received!r}"
                received += data
        assert received.startswith(b"HTTP/1.1 200")
        assert ended.wait(WAIT_S), "the app's run was not cancelled"
        assert handle.responses[0].cancelled()
    finally:
        front.close()


def _status_and_error(port: int) -> tuple[int, dict]:
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        client.request("GET", "/v1/models")
        response = client.getresponse()
        assert response.getheader("content-type") == "application/json"
        return response.status, json.loads(response.read())["error"]
    finally:
        client.close()


def test_a_replica_that_fails_is_a_503_and_an_app_without_a_response_a_500() -> None:
    """Errors in OpenAI's shape, by kind: the replica's call failed before any byte went (a
    503: retry, another replica may serve it), or the app ended without a response (its bug:
    a 500)."""
    front, port = _front(Handle(None, failing=RuntimeError("replica died")))
    try:
        status, error = _status_and_error(port)
    finally:
        front.close()
    assert status == 503
    assert error == {
        "message": "the server's replica failed (RuntimeError)",
        "type": "service_unavailable",
        "param": None,
        "code": 503,
    }

    async def silent(scope, receive, send) -> None:
        await receive()  # and no response

    front, port = _front(Handle(silent))
    try:
        status, error = _status_and_error(port)
    finally:
        front.close()
    assert status == 500
    assert (error["type"], error["code"]) == ("internal_error", 500)
    assert "no response" in error["message"]


def test_what_a_route_did_not_catch_is_a_500_in_openai_shape_with_its_traceback_logged(
    caplog,
) -> None:
    """The serving app's handler for what no route caught: through the front and run_asgi as
    in a replica, the client gets a 500 in OpenAI's error shape naming only the exception's
    kind, and the log gets its traceback (Starlette alone answers a bare "Internal Server
    Error" and logs nothing: a replica's run swallows what it re-raises)."""
    from coordinator.serving.app import app as serving_app

    handler = serving_app.exception_handlers[Exception]
    app = FastAPI()
    app.add_exception_handler(Exception, handler)

    @app.get("/v1/models")
    async def broken(request: Request):
        raise KeyError("a route's own bug")

    front, port = _front(Handle(app))
    try:
        with caplog.at_level(logging.ERROR, logger="coordinator.serving.app"):
            status, error = _status_and_error(port)
    finally:
        front.close()
    assert status == 500
    assert error == {
        "message": "internal error (KeyError); see the server log",
        "type": "internal_error",
        "param": None,
        "code": 500,
    }
    failed = [r for r in caplog.records if r.name == "coordinator.serving.app"]
    assert failed and failed[0].exc_info[0] is KeyError, caplog.text


def test_a_bound_port_refuses_clients_until_the_front_starts_and_a_port_in_use_is_named() -> None:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):  # refused, not kept waiting
            socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()
        other = socket.socket()
        try:
            other.bind(("127.0.0.1", 0))
            other.listen()
            taken = other.getsockname()[1]
            with pytest.raises(
                ConfigError, match=rf"cannot listen on 127\.0\.0\.1:{taken}: .*--port"
            ):
                bind("127.0.0.1", taken)
        finally:
            other.close()
    finally:
        sock.close()


# --- runs: a completion request in the job's engine ------------------------------------------


class Submitted:
    """The request the engine returned, as Run reads it; the test plays the engine's fetch
    thread through the callbacks Run gave."""

    def __init__(self, ids, options, on_token, on_finish, on_logprobs) -> None:
        self.ids, self.options = ids, options
        self.on_token, self.on_finish, self.on_logprobs = on_token, on_finish, on_logprobs
        self.error: BaseException | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def end(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()
        self.on_finish()


class Engine:
    def __init__(self, gone: bool = False) -> None:
        self.gone = gone
        self.cancelled: list[Submitted] = []

    def cancel(self, request: Submitted) -> None:
        if self.gone:
            raise ConnectionError("the load's keeper is gone")
        self.cancelled.append(request)


class Job:
    """A job as Run uses it: `submit` returns the request, `engine()` takes its cancels.
    `hold`: submit waits for it (a slow call to a named load's engine)."""

    index = None  # each test gives eos_token_id: the checkpoint's are not read

    def __init__(self, engine: Engine | None = None, hold: threading.Event | None = None) -> None:
        self._engine = engine or Engine()
        self.hold = hold
        self.entered = threading.Event()
        self.submitted: list[Submitted] = []

    def submit(self, ids, *, on_token, on_finish, on_logprobs, **options) -> Submitted:
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S), "the test never let the submit go"
        request = Submitted(ids, options, on_token, on_finish, on_logprobs)
        self.submitted.append(request)
        return request

    def engine(self) -> Engine:
        return self._engine


PROMPT = torch.tensor([[5, 6, 7]])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _feed(request: Submitted, rows: list[list[int]]) -> None:
    """The engine's fetch thread: each row's tokens, a step at a time."""
    for step in range(max(len(r) for r in rows)):
        for row, tokens in enumerate(rows):
            if step < len(tokens):
                request.on_token(row, tokens[step])


async def _started(run: Run) -> None:
    """Until `run.start()`, awaited by a task of the test, has its request back."""
    for _ in range(100_000):
        if run._request is not None:
            return
        await asyncio.sleep(0)
    raise AssertionError("the submit never returned")


def test_deltas_come_in_order_and_add_up_to_each_rows_text(tokenizer) -> None:
    """n rows, one request: each delta's row and text in the order the engine gave the tokens,
    the first (and only it) marked first, completion-token counts growing by one per token;
    what a row held back (the possible start of a stop string) comes at the end, so the
    deltas add up to the row's whole text."""
    eos = tokenizer.eos_token_id
    texts = ["the cat sat on the mat.", "the dog ran to the c"]
    rows = [_ids(tokenizer, t) for t in texts]
    job = Job()

    async def main():
        options = {"eos_token_id": [eos], "max_new_tokens": 32}
        run = Run(job, tokenizer, PROMPT, options, stop=("the cow",), n=2)  # row 1 ends "the c"
        await run.start()
        (request,) = job.submitted
        engine = asyncio.ensure_future(
            asyncio.to_thread(lambda: (_feed(request, rows), request.end()))
        )
        deltas = [d async for d in run.deltas()]
        await engine
        return run, deltas

    run, deltas = asyncio.run(main())
    (request,) = job.submitted
    assert request.ids.tolist() == [[5, 6, 7], [5, 6, 7]]  # one row per choice
    assert request.options["max_new_tokens"] == 32 and request.options["logprobs"] is None
    assert request.on_logprobs is None  # no scores asked: none sent
    tokens = sum(len(r) for r in rows)
    by_token = [d for d in deltas if d.new_tokens]
    assert [d.first for d in deltas] == [True] + [False] * (len(deltas) - 1)
    counts = [d.new_tokens for d in by_token]
    assert counts == sorted(set(counts)) and counts[-1] <= tokens  # a held token sends none
    # in the engine's order, nothing lost or doubled: each row's stream, fed as the engine fed
    streams = [TextStream(tokenizer, (eos,), ("the cow",)) for _ in rows]
    fed = [
        (row, ids[step]) for step in range(20) for row, ids in enumerate(rows) if step < len(ids)
    ]
    expected = [(row, text) for row, token in fed if (text := streams[row].push(token))]
    assert [(d.row, d.text) for d in by_token if d.text] == expected
    held = deltas[len(by_token) :]  # after the last token: what the rows held back
    assert [(d.row, d.text.strip()) for d in held] == [(1, "the c")]
    for row, text in enumerate(texts):
        joined = "".join(d.text for d in deltas if d.row == row)
        assert joined == tokenizer.decode(rows[row], skip_special_tokens=True) == text
        assert run.choices[row].stream.text == text
        assert (run.choices[row].finish_reason, run.choices[row].stop_reason) == ("length", None)
    assert run.usage() == {
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "total_tokens": tokens + 3,
    }
    assert run.usage(4)["completion_tokens"] == 4  # a chunk's usage: the tokens it carries
    assert job.engine().cancelled == []  # it ended by itself: nothing to cancel


def test_a_request_whose_rows_all_met_a_stop_string_is_cancelled_once(tokenizer) -> None:
    """A stop string is the client's business (the engine sees no end): once every row has met
    one, the request is cancelled in the engine, once, not before; the choices say why."""
    eos = tokenizer.eos_token_id
    rows = [_ids(tokenizer, "the cat sat on the mat"), _ids(tokenizer, "the dog sat down")]
    job = Job()
    cancels_when: list[int] = []

    async def main() -> Run:
        options = {"eos_token_id": [eos], "max_new_tokens": 32}
        run = Run(job, tokenizer, PROMPT, options, stop=("sat",), n=2)
        await run.start()
        (request,) = job.submitted

        def engine() -> None:
            _feed(request, [rows[0], []])  # row 0 stops; row 1 still runs
            cancels_when.append(len(job.engine().cancelled))
            _feed(request, [[], rows[1]])  # row 1 stops: the request is done
            cancels_when.append(len(job.engine().cancelled))
            _feed(request, [rows[0], rows[1]])  # the engine's next step came first
            request.end()

        feeding = asyncio.ensure_future(asyncio.to_thread(engine))
        [_ async for _ in run.deltas()]
        await feeding
        return run

    run = asyncio.run(main())
    assert cancels_when == [0, 1]
    assert job.engine().cancelled == job.submitted  # once
    assert [c.stream.text for c in run.choices] == ["the cat ", "the dog "]
    assert [(c.finish_reason, c.stop_reason) for c in run.choices] == [("stop", "sat")] * 2


def test_an_end_token_the_request_asked_for_is_its_stop_reason(tokenizer) -> None:
    """vLLM's stop_reason: the stop_token_ids token that ended a row; None for the model's own
    end token, and for a row that ran to its length."""
    eos, own = tokenizer.eos_token_id, _ids(tokenizer, "dog")[0]
    job = Job()

    async def main() -> Run:
        options = {"eos_token_id": [eos, own], "max_new_tokens": 8}
        run = Run(job, tokenizer, PROMPT, options, n=3, stop_token_ids=(own,))
        await run.start()
        (request,) = job.submitted
        feeding = asyncio.ensure_future(
            asyncio.to_thread(
                lambda: (_feed(request, [[9, own, 9], [9, eos], [9, 9, 9]]), request.end())
            )
        )
        [_ async for _ in run.deltas()]
        await feeding
        return run

    run = asyncio.run(main())
    reasons = [(c.finish_reason, c.stop_reason, c.new_tokens) for c in run.choices]
    assert reasons == [("stop", own, 2), ("stop", None, 2), ("length", None, 3)]


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (ConnectionError("a worker died"), ConnectionError),
        (BaseException("engine stopped"), RuntimeError),
    ],
    ids=["exception", "base-exception"],
)
def test_a_request_that_failed_raises_its_error_as_an_exception(tokenizer, error, raised) -> None:
    """The error the request ended with is raised by `finish` (the app maps it by kind); one
    that is not an Exception becomes a RuntimeError naming it, so it never ends the server's
    event loop. What a row held back is not handed out after an error."""
    eos = tokenizer.eos_token_id
    options = {"eos_token_id": [eos], "max_new_tokens": 8}

    async def main(finish: bool):
        job = Job()
        run = Run(job, tokenizer, PROMPT, options, stop=("the cow",))  # "the c": held back
        if finish:
            finishing = asyncio.ensure_future(run.finish())
            await _started(run)
        else:
            await run.start()
        (request,) = job.submitted
        feeding = asyncio.ensure_future(
            asyncio.to_thread(
                lambda: (_feed(request, [_ids(tokenizer, "the c")]), request.end(error))
            )
        )
        if finish:
            try:
                await finishing
            finally:
                await feeding
        deltas = [d async for d in run.deltas()]
        await feeding
        return run, deltas, job

    run, deltas, job = asyncio.run(main(finish=False))
    assert "".join(d.text for d in deltas) == ""  # "the c" stays held back
    assert isinstance(run.error, raised) and job.engine().cancelled == []
    with pytest.raises(raised, match=r"a worker died|engine stopped") as caught:
        asyncio.run(main(finish=True))
    if raised is ConnectionError:
        assert caught.value is error


def test_a_cancelled_finish_cancels_the_request_in_the_engine(tokenizer) -> None:
    """The client went away while its request ran (the app's run is cancelled): the request is
    cancelled in the engine too, through a thread (the event loop never waits on Ray)."""
    job = Job()

    async def main() -> None:
        run = Run(job, tokenizer, PROMPT, {"eos_token_id": [0], "max_new_tokens": 8})
        finishing = asyncio.ensure_future(run.finish())
        await _started(run)
        await asyncio.to_thread(job.submitted[0].on_token, 0, 9)
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing

    asyncio.run(main())  # returns once the loop's threads are done: the cancel's too
    assert job.engine().cancelled == job.submitted


def test_a_finish_cancelled_during_its_submit_still_cancels_the_request(tokenizer) -> None:
    """A client that goes away while its submit is in flight (a call to a named load's
    keeper): the request the submit queues is cancelled once it is known. Found by this file:
    it used to run to its limit for nobody, holding its KV blocks."""
    release = threading.Event()
    job = Job(hold=release)

    async def main() -> None:
        run = Run(job, tokenizer, PROMPT, {"eos_token_id": [0], "max_new_tokens": 8})
        finishing = asyncio.ensure_future(run.finish())
        assert await asyncio.to_thread(job.entered.wait, WAIT_S)
        finishing.cancel()  # the client went away while the submit was in flight
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await finishing

    asyncio.run(main())  # returns once the loop's threads are done: the submit's too
    assert len(job.submitted) == 1
    assert job.engine().cancelled == job.submitted


class Client:
    """The HTTP request's side of `Run.started`: connected for `present` looks, then gone."""

    def __init__(self, present: int) -> None:
        self.present, self.looks = present, 0

    async def is_disconnected(self) -> bool:
        self.looks += 1
        return self.looks > self.present


def test_a_client_gone_while_its_request_waits_cancels_it(tokenizer, monkeypatch) -> None:
    """A streamed request sends nothing until its first token; its client is looked at
    meanwhile. Gone: `started` says so, and the request is cancelled in the engine."""
    monkeypatch.setattr(runs_module, "DISCONNECT_POLL_S", 0.01)
    job = Job()
    client = Client(present=2)

    async def main() -> bool:
        run = Run(job, tokenizer, PROMPT, {"eos_token_id": [0], "max_new_tokens": 8})
        await run.start()
        return await run.started(client)

    assert asyncio.run(main()) is False
    assert client.looks == 3  # waited while the client was there
    assert job.engine().cancelled == job.submitted


def test_the_first_token_that_ends_the_wait_is_the_streams_first_delta(tokenizer) -> None:
    ids = _ids(tokenizer, "the cat")
    job = Job()

    async def main():
        run = Run(job, tokenizer, PROMPT, {"eos_token_id": [0], "max_new_tokens": 8})
        await run.start()
        (request,) = job.submitted
        await asyncio.to_thread(request.on_token, 0, ids[0])
        started = await run.started(Client(present=10**9))
        count = run.first_count()
        await asyncio.to_thread(lambda: (_feed(request, [ids[1:]]), request.end()))
        return started, count, [d async for d in run.deltas()]

    started, count, deltas = asyncio.run(main())
    assert (started, count) == (True, 1)
    assert deltas[0].first and deltas[0].new_tokens == 1  # not lost to the wait
    assert "".join(d.text for d in deltas) == "the cat"
    assert job.engine().cancelled == []


def test_scores_of_the_prompt_and_of_each_token_with_minus_infinity_floored(tokenizer) -> None:
    """`logprobs` scores each generated token (its text, log-probability and top tokens, most
    likely first); echo's prompt scores start with the unscored first token; -inf (a masked
    token) becomes FLOOR_LOGPROB, as JSON has no infinity."""
    job = Job()
    inf = float("-inf")

    async def main() -> Run:
        run = Run(
            job,
            tokenizer,
            PROMPT,
            {"eos_token_id": [0], "max_new_tokens": 8},
            logprobs=2,
            echo_logprobs=1,
        )
        await run.start()
        (request,) = job.submitted

        def engine() -> None:
            request.on_logprobs(
                0, Logprobs(1, (6, 7), (-0.5, inf), ((6,), (3,)), ((-0.5,), (-0.1,)))
            )
            request.on_logprobs(0, Logprobs(3, (9,), (-1.5,), ((9, 4),), ((-1.5, inf),)))
            request.on_token(0, 9)
            request.end()

        feeding = asyncio.ensure_future(asyncio.to_thread(engine))
        deltas = [d async for d in run.deltas()]
        await feeding
        return run, deltas

    run, deltas = asyncio.run(main())
    text = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    (request,) = job.submitted
    assert (request.options["logprobs"], request.options["prompt_logprobs"]) == (2, 1)
    assert [(s.token_id, s.logprob) for s in run.prompt_scores] == [
        (5, None),
        (6, -0.5),
        (7, FLOOR_LOGPROB),
    ]
    assert run.prompt_scores[0].top is None
    (score,) = run.choices[0].scores
    assert (score.token_id, score.text, score.logprob) == (9, text(9), -1.5)
    assert score.top == ((text(9), 9, -1.5), (text(4), 4, FLOOR_LOGPROB))
    assert deltas[0].scores == (score,)


def test_a_score_only_request_hands_out_no_token(tokenizer) -> None:
    """vLLM's max_tokens 0 with echo: the prompt goes through for its scores; its one token
    is not the client's (no text, no completion token), but the stream still starts."""
    job = Job()

    async def main():
        run = Run(
            job, tokenizer, PROMPT, {"eos_token_id": [0], "max_new_tokens": 1}, score_only=True
        )
        await run.start()
        (request,) = job.submitted
        await asyncio.to_thread(lambda: (request.on_token(0, 9), request.end()))
        return run, [d async for d in run.deltas()]

    run, deltas = asyncio.run(main())
    assert [(d.text, d.first, d.new_tokens) for d in deltas] == [("", True, 0)]
    assert run.text == "" and run.usage()["completion_tokens"] == 0


def test_a_cancel_to_an_engine_that_is_gone_is_said_and_a_done_request_is_not_cancelled(
    tokenizer, caplog
) -> None:
    """Off the event loop (the fetch thread), a cancel is made there; an engine that is gone
    is logged, never raised into the caller. A request already done sends no cancel."""
    job = Job(Engine(gone=True))

    async def main() -> Run:
        run = Run(job, tokenizer, PROMPT, {"eos_token_id": [0], "max_new_tokens": 8})
        await run.start()
        return run

    run = asyncio.run(main())
    with caplog.at_level(logging.WARNING, logger=runs_module.__name__):
        run.cancel()  # no event loop in this thread: made here
    assert "cancel not delivered: the load's keeper is gone" in caplog.text
    job.engine().gone = False
    run.cancel()
    assert job.engine().cancelled == job.submitted
    job.submitted[0]._done.set()
    run.cancel()
    assert job.engine().cancelled == job.submitted  # not again
