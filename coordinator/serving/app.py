"""An OpenAI-style HTTP front for named loads, on Ray Serve: one Serve replica per load (a
pipeline on its own GPUs; several when the plan chose replicas), Serve's router spreading the
requests; each completion's `x-offload-load` header says which load answered. Each `serve`
command deploys a Serve app of its own and listens on its own port itself (serving/bridge.py:
Serve has one proxy port per cluster), so several run on one cluster; its replicas remove the
app when the command's process is gone without removing it (killed with -9).

`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` (where the tokenizer
has a chat template), both with `stream: true` as server-sent events. A replica attaches to its
load (so it may run on any node), tokenizes with the checkpoint's tokenizer and submits each
request to the job's engine (`coordinator.engine`), which runs every request in flight in one
batch per step; a request beyond the batch waits in the engine's FIFO queue (a streamed one gets
its first byte with its first token), and only a full queue is answered 429. A client that goes
away cancels its request, which frees its KV slot. With an API key, every request needs
`Authorization: Bearer <key>` (401 otherwise). Bad requests get a 4xx naming the field; the
status comes from the error's kind, never its text (`STATUS_OF_KIND`): beyond the planned KV
cache 400 (never fits), a full queue 429 (busy), a lost worker 503, only a bug 500. `stop`
strings end the text where they begin (streamed text never shows part of one);
`stream_options.include_usage` adds a usage chunk; settings that would change the text and are
not applied here (penalties, logit_bias, logprobs, echo, best_of, suffix, tools,
response_format) are refused with 400, not ignored.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations
# (`request: Request`) as objects to know what to inject.
import hmac
import json
import logging
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from coordinator.runtime.session import driver_alive
from coordinator.serving.bridge import HttpFront, HttpRequest, run_asgi
from coordinator.serving.runs import Run
from offload.errors import (
    BusyError,
    ConfigError,
    LaunchError,
    NotFoundError,
    OffloadCoordinatorError,
    OffloadError,
)

app = FastAPI()
logger = logging.getLogger(__name__)
# Requests a replica takes at once unless `start` is told the load's queue: Serve holds the rest
# in front of it. `start` sizes it to the engine's queue + batch, so that the engine's queue
# (FIFO, 429 only when full) is the one that decides.
MAX_ONGOING_REQUESTS = 1024 + 64
OWNER_CHECK_S = 5.0  # a replica checks this often that the serve process that started it runs
MAX_STOP = 4  # stop strings per request, as OpenAI's API allows
LOAD_HEADER = "x-offload-load"  # which load (replica) answered a completion
# Request fields this server does not apply, with the value that means "off": any other value is
# refused with 400 rather than silently ignored (the text would not be what the client asked).
UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": False,
    "top_logprobs": 0,
    "echo": False,
    "best_of": 1,
    "suffix": "",
    "tools": [],
    "functions": [],
    "response_format": {"type": "text"},
}


class BadRequest(ConfigError):
    """A request field the server cannot take: a 400 naming the field."""


# The project's error kinds -> HTTP status and OpenAI error type, first match wins (the kinds
# derive from one another: BusyError before its base, NotFoundError before ConfigError's kin).
# Nothing reads message texts. Anything else is the server's bug: a 500.
STATUS_OF_KIND: tuple[tuple[type[OffloadCoordinatorError], int, str], ...] = (
    (BusyError, 429, "rate_limit_error"),
    (NotFoundError, 404, "NotFoundError"),
    (LaunchError, 503, "service_unavailable"),
    (OffloadError, 500, "internal_error"),  # the library misused: our bug, not the request's
    (OffloadCoordinatorError, 400, "invalid_request_error"),  # config, checkpoint, never fits
)


def status_of(exc: BaseException) -> tuple[int, str]:
    """HTTP status and error type for an exception a request ended with."""
    for kind, status, name in STATUS_OF_KIND:
        if isinstance(exc, kind):
            return status, name
    return 500, "internal_error"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def _error_for(exc: BaseException) -> JSONResponse:
    status, kind = status_of(exc)
    if status == 500:  # a bug: the client gets no internals, the log gets the traceback
        logger.exception("request failed", exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); see the server log", kind)
    return _error(status, str(exc), kind)


def _field(body: dict, name: str, kinds: tuple[type, ...], default=None, check=None):
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise BadRequest(
            f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    if check is not None and not check(value):
        raise BadRequest(f"'{name}'={value!r} is out of range")
    return value


def _end_with_owner(app_name: str, job_id: str) -> None:
    """A replica's watch (a daemon thread): once the `serve` process that deployed `app_name`
    is gone without removing it (killed with -9), the app is removed, so no replica of it
    stays a client of its load."""
    while True:
        time.sleep(OWNER_CHECK_S)
        try:
            if not driver_alive(job_id):
                logger.warning("the serve process of %s is gone: removing the app", app_name)
                serve.delete(app_name, _blocking=False)
                return
        except Exception as exc:  # look again later
            logger.warning("cannot check the serve process of %s: %s", app_name, exc)


# Ray Serve pickles the deployment class when it is decorated: everything it uses is defined
# above it. No CPU of its own: the replica waits on the workers, which hold the job's CPUs (a
# replica asking for one on a small embedded Ray would never be scheduled).
@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIServer:
    def __init__(
        self,
        load_names: list[str],
        model_name: str,
        api_key: str | None,
        owner: tuple[str, str] | None = None,
    ) -> None:
        from coordinator.runtime.launch import attach
        from coordinator.serving.text import load_tokenizer

        if owner is not None:  # (app name, the serve process's Ray job): the app ends with it
            threading.Thread(
                target=_end_with_owner, args=owner, daemon=True, name="offload-owner"
            ).start()

        rank = serve.get_replica_context().rank.rank if len(load_names) > 1 else 0
        self.load_name = load_names[rank % len(load_names)]
        self.job = attach(self.load_name)
        self.tokenizer = load_tokenizer(self.job.config.checkpoint)
        self.model_name = model_name
        self.api_key = api_key
        self.created = int(time.time())

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    @app.get("/v1/models")
    async def models(self, request: Request):
        if not self._authorized(request):
            return _error(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                "authentication_error",
            )
        # max_model_len as vLLM reports it: the longest prompt + completion a request may ask
        # for (the planned KV cache per sequence, which launch keeps within the context)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "offload-coordinator",
                    "max_model_len": self.job.config.max_seq_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics(self, request: Request):
        """Prometheus' text format, vLLM's metric names: sequences running and waiting, KV slot
        usage, time to first token and inter-token latency histograms, tokens generated."""
        if not self._authorized(request):
            return _error(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                "authentication_error",
            )
        return PlainTextResponse(
            self.job.engine().prometheus(self.model_name),
            media_type="text/plain; version=0.0.4",
        )

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, chat=True)

    async def forward(self, request: HttpRequest):
        """One HTTP request that the serve process's own server received (serving/bridge.py),
        run through this replica's FastAPI app: yields the response's start, then its body
        chunks. Cancelled (the client went away), the app's run is cancelled with it."""
        async for item in run_asgi(self.app, request):
            yield item

    async def _handle(self, request: Request, *, chat: bool):
        if not self._authorized(request):
            return _error(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                "authentication_error",
            )
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if isinstance(body, dict) and body.get("model", self.model_name) != self.model_name:
            return _error(
                404,
                f"the model {body['model']!r} does not exist here: this server "
                f"serves {self.model_name!r} (GET /v1/models)",
                "NotFoundError",
            )
        try:
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            ids, options, stream, stop = self._parse(body, chat)
            stream_options = _field(body, "stream_options", (dict,), {})
            usage = _field(stream_options, "include_usage", (bool,), False)
            self.job.check_request(ids.shape[1], **options)  # a 400 now, not mid-stream
        except OffloadCoordinatorError as exc:  # no chat template, past the context or the KV plan
            return _error_for(exc)
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        run = Run(self.job, self.tokenizer, ids, options, stop)
        if stream:
            try:
                run.start()  # a full queue is a 429 here, before the stream's 200
            except OffloadCoordinatorError as exc:
                return _error_for(exc)
            if not await run.started(request):  # no byte until the request runs
                return _error(499, "the client went away while the request waited")
            return StreamingResponse(
                self._events(run, rid, chat, request, usage),
                media_type="text/event-stream",
                headers={LOAD_HEADER: self.load_name},
            )
        try:
            await run.finish()
        except Exception as exc:  # busy (429), a lost worker (503), a bug (500): by kind
            return _error_for(exc)
        message = {"role": "assistant", "content": run.text}
        choice = {
            "index": 0,
            "finish_reason": run.finish_reason,
            "logprobs": None,
            **({"message": message} if chat else {"text": run.text}),
        }
        return JSONResponse(
            {
                "id": rid,
                "object": kind,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": run.usage(),
            },
            headers={LOAD_HEADER: self.load_name},
        )

    def _parse(self, body: dict, chat: bool):
        from coordinator.engine.generation import sampling_options
        from coordinator.serving.text import prompt_ids

        if _field(body, "n", (int,), 1) != 1:
            raise BadRequest("only n=1 is supported")
        for name, default in UNSUPPORTED.items():  # settings that would change the output
            if body.get(name) not in (None, default):
                raise BadRequest(
                    f"'{name}'={body[name]!r} is not supported by this server "
                    f"(leave it out, or {default!r})"
                )
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (
            not isinstance(stop, list)
            or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stop)
        ):
            raise BadRequest(
                f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them"
            )
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise BadRequest(
                    "'messages' must be a non-empty list of {role, content} with string values"
                )
            ids = prompt_ids(self.tokenizer, messages=messages)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("'prompt' must be a non-empty string")
            ids = prompt_ids(self.tokenizer, prompt)
        limit = (
            "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        )
        max_tokens = _field(body, limit, (int,), 16, lambda v: v >= 1)
        options = sampling_options(
            _field(body, "temperature", (int, float), None, lambda v: v >= 0),
            _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1),
            None,
            _field(body, "seed", (int,), None),
        )
        stream = _field(body, "stream", (bool,), False)
        return ids, {"max_new_tokens": max_tokens, **options}, stream, tuple(stop or ())

    async def _events(self, run: Run, rid: str, chat: bool, request: Request, usage: bool):
        """Server-sent events: a chunk per text delta, a last chunk with the finish reason,
        then [DONE]. A client that goes away cancels the request (its caches are freed)."""
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def event(delta: str | None, finish: str | None) -> str:
            if chat:
                piece = {"delta": {} if delta is None else {"content": delta}}
            else:
                piece = {"text": delta or "", "logprobs": None}
            data = {
                "id": rid,
                "object": chunk_kind,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, **piece, "finish_reason": finish}],
            }
            return f"data: {json.dumps(data)}\n\n"

        try:
            if chat:
                yield event(None, None).replace('"delta": {}', '"delta": {"role": "assistant"}')
            async for delta in run.deltas():
                if await request.is_disconnected():
                    run.cancel()
                    return
                yield event(delta, None)
            if run.error is not None:
                status, kind = status_of(run.error)
                text = str(run.error) if status != 500 else "internal error; see the server log"
                message = json.dumps({"error": {"message": text, "type": kind, "code": status}})
                yield f"data: {message}\n\n"
            else:
                yield event(None, run.finish_reason)
                if usage:  # stream_options.include_usage: one more chunk, no choices
                    data = {
                        "id": rid,
                        "object": chunk_kind,
                        "created": int(time.time()),
                        "model": self.model_name,
                        "choices": [],
                        "usage": run.usage(),
                    }
                    yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            run.cancel()  # a client gone mid-stream (the generator is closed): stop and free


APP_PREFIX = "offload-openai-"  # + the serve command's id: the Serve app of one `serve`


@dataclass(slots=True)
class ServedApp:
    """One `serve` command's Serve app and its HTTP front; `stop()` removes only these."""

    name: str
    front: HttpFront | None = None

    def stop(self) -> None:
        try:
            if self.front is not None:
                self.front.close()
        finally:
            try:
                serve.delete(self.name)
            except Exception as exc:  # its Ray gone already: nothing left; else say it
                if ray.is_initialized():
                    print(f"Serve app {self.name!r} not removed: {exc}", file=sys.stderr)


def start(
    load_names: list[str],
    model_name: str,
    *,
    app_id: str,
    sock: socket.socket,
    api_key: str | None,
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
) -> ServedApp:
    """Serve the named loads on `sock` (bridge.bind), one Serve replica each, as a Serve app
    of this command's own (`offload-openai-<app_id>`, no HTTP route through Serve's proxy:
    this process listens itself and forwards to it). Other Serve apps on the cluster
    and Serve's own settings are left as they are; Serve starts without its proxy when it is
    not running. Returns once the app answers; on failure what this started is removed. The
    process's own SIGINT and SIGTERM handlers are kept, whatever Serve's start installs."""
    from coordinator.runtime.session import keeping_handlers

    deployment = OpenAIServer.options(
        max_ongoing_requests=max_ongoing_requests, num_replicas=len(load_names)
    )
    served = ServedApp(name=f"{APP_PREFIX}{app_id}")
    owner = (served.name, ray.get_runtime_context().get_job_id())
    try:
        with keeping_handlers():
            serve.start(proxy_location="Disabled")  # joins a running Serve as it is
            handle = serve.run(
                deployment.bind(list(load_names), model_name, api_key, owner),
                name=served.name,
                route_prefix=None,
                blocking=False,
            )
        served.front = HttpFront(handle, sock)
        return served
    except BaseException:
        served.stop()
        raise
