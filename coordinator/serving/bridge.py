"""HTTP between a `serve` process and its own Serve app. Ray Serve has one HTTP proxy port per
cluster, so two `serve` commands on one cluster cannot each listen on their own port through
it: each `serve` listens itself (uvicorn, `HttpFront`, in a thread of the serve process) and
hands every request as it came (`HttpRequest`) to its app's deployment through a streaming
DeploymentHandle call; the replica runs it through its FastAPI app (`run_asgi`) and streams
back the response's start (`ResponseStart`), then its body chunks. A client that goes away
cancels the handle's call, which cancels the app's run in the replica, and with it the request
in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass

from offload.errors import ConfigError

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0  # uvicorn's start in its thread, on a socket already bound
STOP_GRACE_S = 5.0  # requests in flight at a stop get this long, then are cancelled
STOP_TIMEOUT_S = 15.0  # the server's thread, after the grace
CANCEL_WAIT_S = 5.0  # a replica's run of a request that was cancelled, to end its `finally`s


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRequest:
    """One HTTP request as the serve process received it (ASGI's names)."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseStart:
    """A response's status and headers: the first item a replica's run yields."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def run_asgi(asgi_app, request: HttpRequest):
    """Run `request` through `asgi_app` (in a replica): yields its ResponseStart, then each body
    chunk (bytes). Closed or cancelled early (the client went away), the app sees a
    disconnect and its run is cancelled: its `finally`s run (a request's cancel) before this
    returns."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": [tuple(h) for h in request.headers],
        "client": request.client,
        "server": None,
    }
    run = asyncio.ensure_future(asgi_app(scope, receive, send))
    run.add_done_callback(lambda _: messages.put_nowait(None))
    complete = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(
                    status=message["status"],
                    headers=tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())),
                )
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
    finally:
        gone.set()  # the app's next look at its client sees it gone
        if not complete:
            run.cancel()
        with contextlib.suppress(BaseException):  # what it raised, the app has logged
            await asyncio.wait_for(run, CANCEL_WAIT_S)


class HttpFront:
    """The serve process's own HTTP server on host:port: uvicorn in a daemon thread, each
    request forwarded to `handle` (a DeploymentHandle of the app's ingress, method `forward`)
    and its response streamed back. `close()` stops it."""

    def __init__(self, handle, sock: socket.socket) -> None:
        import uvicorn

        self.handle = handle.options(stream=True)
        config = uvicorn.Config(
            self,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), daemon=True, name="offload-http"
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise ConfigError(f"the HTTP server on {_where(sock)} did not start")
            time.sleep(0.05)

    def _serve(self, sock: socket.socket) -> None:
        try:
            self._server.run(sockets=[sock])
        except Exception as exc:  # said once; the main thread sees the thread end
            print(f"HTTP server stopped: {exc}", file=sys.stderr)
        finally:
            sock.close()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(STOP_GRACE_S + STOP_TIMEOUT_S)
        if self._thread.is_alive():  # connections that outlived the grace
            self._server.force_exit = True
            self._thread.join(STOP_TIMEOUT_S)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return  # no websockets here
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        request = HttpRequest(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", ())),
            body=bytes(body),
            client=tuple(scope["client"]) if scope.get("client") else None,
        )
        response = self.handle.forward.remote(request)
        relay = asyncio.ensure_future(self._relay(response, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                relay.result()
        finally:
            if not relay.done():  # the client went away: the replica's run is cancelled
                response.cancel()
                relay.cancel()
                with contextlib.suppress(BaseException):
                    await relay
            gone.cancel()

    async def _relay(self, response, send) -> None:
        started = False
        try:
            async for item in response:
                if isinstance(item, ResponseStart):
                    await send(
                        {
                            "type": "http.response.start",
                            "status": item.status,
                            "headers": list(item.headers),
                        }
                    )
                    started = True
                else:
                    await send({"type": "http.response.body", "body": item, "more_body": True})
        except Exception as exc:  # the replica or its app failed: a 503 if nothing went yet
            if started or response.cancelled():  # (cancelled: its client is gone)
                raise
            logger.exception("forwarding a request failed", exc_info=exc)
            await _send_error(send, 503, f"the server's replica failed ({type(exc).__name__})")
            return
        if not started:  # the app ended without a response: its bug, in its log
            await _send_error(send, 500, "internal error (no response); see the server log")
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_error(send, status: int, message: str) -> None:
    kind = "service_unavailable" if status == 503 else "internal_error"
    error = {"message": message, "type": kind, "param": None, "code": status}  # OpenAI's shape
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for HttpFront: bound before anything is loaded, so a port
    that a server listens on is said at once; it listens once the front starts (until then a
    client is refused, not kept waiting). The front's thread closes it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"--host {host}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}; another server there? "
            "choose another --port"
        ) from None
    return sock


def _where(sock: socket.socket) -> str:
    with contextlib.suppress(OSError):
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"
    return "its socket"
