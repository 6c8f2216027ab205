"""An OpenAI-style HTTP front for named loads, on Ray Serve: one Serve replica per load (a
pipeline on its own GPUs; several when the plan chose replicas), Serve's router spreading the
requests; each completion's `x-offload-load` header says which load answered. Each `serve`
command deploys a Serve app of its own and listens on its own port itself (serving/bridge.py:
Serve has one proxy port per cluster), so several run on one cluster; its replicas remove the
app when the command's process is gone without removing it (killed with -9).

`GET /v1/models`, `GET /health` (no key: 503 with the reason once the load cannot serve),
`GET /version`, `POST /v1/completions` and `POST /v1/chat/completions` (where the tokenizer
has a chat template; content a string or text parts), both with `stream: true` as server-sent events. A replica attaches to its
load (so it may run on any node), tokenizes with the checkpoint's tokenizer and submits each
request to the job's engine (`coordinator.engine`), which runs every request in flight in one
batch per step; a request beyond the batch waits in the engine's FIFO queue (a streamed one gets
its first byte with its first token), and only a full queue is answered 429. A client that goes
away cancels its request, which frees its KV slot. With an API key, every request needs
`Authorization: Bearer <key>` (401 otherwise). Errors are in OpenAI's shape, `param` naming
the field; the status comes from the error's kind, never its text (`STATUS_OF_KIND`): beyond
the planned KV cache 400 (never fits), a full queue 429 (busy), a lost worker 503, only a bug
500. `stop` strings end the text where they begin (streamed text never shows part of one);
`stream_options.include_usage` adds a usage chunk. Every request field is applied or refused
with a 400 naming it (`FIELDS`), unknown ones too: none is accepted and ignored.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations
# (`request: Request`) as objects to know what to inject.
import asyncio
import hmac
import json
import logging
import math
import reprlib
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

from coordinator.engine.generation import GenerationError
from coordinator.engine.requests import RequestError, check_request
from coordinator.runtime.group import gone_parts
from coordinator.runtime.record import driver_alive
from coordinator.serving.bridge import HttpFront, HttpRequest, run_asgi
from coordinator.serving.runs import Run
from offload.errors import (
    BusyError,
    LaunchError,
    NotFoundError,
    OffloadCoordinatorError,
    OffloadError,
)
from worker.guided import GuideBook, GuideError
from worker.startup import settle

app = FastAPI()
logger = logging.getLogger(__name__)
# Requests a replica takes at once unless `start` is told the load's queue: Serve holds the rest
# in front of it. `start` sizes it to the engine's queue + batch, so that the engine's queue
# (FIFO, 429 only when full) is the one that decides.
MAX_ONGOING_REQUESTS = 1024 + 64
OWNER_CHECK_S = 5.0  # a replica checks this often that the serve process that started it runs
HEALTH_PING_S = 2.0  # /health: a part that does not answer a ping within this is busy, not gone
RECOVERY_GRACE_S = 60.0
KEEPER = "the load's keeper (its engine)"  # /health: a worker gone this long is not being recovered
MAX_LOGPROBS = 20  # top tokens per position (OpenAI's chat limit, vLLM's default max_logprobs)
LOAD_HEADER = "x-offload-load"  # which load (replica) answered a completion
# Every request field of OpenAI's completions and chat schemas and the vLLM extensions clients
# send, and what this server does with it: applied (to the text, or the response's shape),
# `NO_EFFECT` (accepted: it does not change the output, say an end-user id), or a tuple of the
# values that mean "off", any other value refused with a 400 naming the field (the text would
# not be what the client asked for). A field not in the table (or sent to the other endpoint) is
# refused with a 400 naming it: never accepted and ignored.
APPLIED, NO_EFFECT = "applied", "no effect"
COMPLETIONS, CHAT = "completions", "chat"
BOTH = (COMPLETIONS, CHAT)
FIELDS: dict[str, tuple[tuple[str, ...], object]] = {
    # applied
    "model": (BOTH, APPLIED),
    "prompt": ((COMPLETIONS,), APPLIED),  # a string or token ids, or a list of either
    "messages": ((CHAT,), APPLIED),
    "max_tokens": (BOTH, APPLIED),  # default: completions 16, chat the rest of max_seq_len
    "max_completion_tokens": (BOTH, APPLIED),  # over max_tokens when both are sent
    "temperature": (BOTH, APPLIED),
    "top_p": (BOTH, APPLIED),
    "top_k": (BOTH, APPLIED),  # vLLM: -1 or 0 off
    "min_p": (BOTH, APPLIED),  # vLLM
    "presence_penalty": (BOTH, APPLIED),
    "frequency_penalty": (BOTH, APPLIED),
    "repetition_penalty": (BOTH, APPLIED),  # vLLM
    "logit_bias": (BOTH, APPLIED),  # each bias clamped to [-100, 100], as vLLM
    "bad_words": (BOTH, APPLIED),  # vLLM: strings, tokenized as vLLM does
    # guided decoding (worker.guided, on outlines-core): one of these per request
    "response_format": (BOTH, APPLIED),  # text, json_object, json_schema
    "guided_json": (BOTH, APPLIED),  # vLLM
    "guided_regex": (BOTH, APPLIED),  # vLLM
    "guided_choice": (BOTH, APPLIED),  # vLLM
    "structured_outputs": (BOTH, APPLIED),  # vLLM: {json | regex | choice}
    "seed": (BOTH, APPLIED),
    "stop": (BOTH, APPLIED),
    "stream": (BOTH, APPLIED),
    "stream_options": (BOTH, APPLIED),  # include_usage, continuous_usage_stats (vLLM)
    "n": (BOTH, APPLIED),  # n rows of one prompt, row i seeded seed + i
    "best_of": ((COMPLETIONS,), APPLIED),  # == n only: no row is dropped
    "logprobs": (BOTH, APPLIED),  # completions: top count; chat: a flag (top_logprobs: count)
    "top_logprobs": ((CHAT,), APPLIED),
    "echo": (BOTH, APPLIED),  # completions: the prompt first (scored with logprobs); chat: off
    "skip_special_tokens": (BOTH, APPLIED),  # vLLM: false keeps special tokens in the text
    "ignore_eos": (BOTH, APPLIED),  # vLLM: no end token ends it, only max_tokens (and stops)
    "stop_token_ids": (BOTH, APPLIED),  # vLLM: more ids that end it (not in the text)
    "include_stop_str_in_output": (BOTH, APPLIED),  # vLLM: the stop string or token kept
    "min_tokens": (BOTH, APPLIED),  # vLLM: no end token (nor stop string) before this many
    "add_generation_prompt": ((CHAT,), APPLIED),  # vLLM: open the assistant's turn (default)
    "continue_final_message": ((CHAT,), APPLIED),  # vLLM: the last message goes on
    "chat_template": ((CHAT,), APPLIED),  # vLLM: with --trust-request-chat-template only
    "chat_template_kwargs": ((CHAT,), APPLIED),  # vLLM: the template's variables
    # accepted, no effect on the output
    "user": (BOTH, NO_EFFECT),
    "safety_identifier": (BOTH, NO_EFFECT),
    "prompt_cache_key": (BOTH, NO_EFFECT),
    "metadata": ((CHAT,), NO_EFFECT),
    "parallel_tool_calls": ((CHAT,), NO_EFFECT),  # only acts with tools, which are refused
    # refused unless "off"
    "suffix": ((COMPLETIONS,), ("",)),
    "tools": ((CHAT,), ([],)),
    "tool_choice": ((CHAT,), ("none",)),
    "functions": ((CHAT,), ([],)),
    "function_call": ((CHAT,), ("none",)),
    # vLLM: spaces its slow-tokenizer path puts around special tokens; this server decodes
    # as the fast tokenizer does (vLLM's fast path too), without them
    "spaces_between_special_tokens": (BOTH, (True,)),
    "use_beam_search": (BOTH, (False,)),  # vLLM
    "length_penalty": (BOTH, (1,)),  # vLLM
    "truncate_prompt_tokens": (BOTH, ()),  # vLLM
    "allowed_token_ids": (BOTH, ()),  # vLLM
    "prompt_logprobs": (BOTH, ()),  # vLLM
    "guided_grammar": (BOTH, ()),  # vLLM: a context-free grammar, beyond a regex automaton
    "return_tokens_as_token_ids": (BOTH, (False,)),  # vLLM
    "add_special_tokens": (BOTH, ()),  # vLLM: the default differs per endpoint; left to it
    "documents": ((CHAT,), ()),  # vLLM
    "priority": (BOTH, (0,)),  # vLLM: scheduling order
    "store": ((CHAT,), (False,)),  # nothing is stored here
    "service_tier": ((CHAT,), ("auto", "default")),
    "modalities": ((CHAT,), (["text"],)),
    "audio": ((CHAT,), ()),
    "prediction": ((CHAT,), ()),
    "reasoning_effort": ((CHAT,), ()),
    "verbosity": ((CHAT,), ()),
    "web_search_options": ((CHAT,), ()),
}
# The types of the fields of no effect (OpenAI's schemas): accepted, but not of any type.
NO_EFFECT_KINDS: dict[str, tuple[type, ...]] = {
    "user": (str,),
    "safety_identifier": (str,),
    "prompt_cache_key": (str,),
    "metadata": (dict,),
    "parallel_tool_calls": (bool,),
}
assert set(NO_EFFECT_KINDS) == {n for n, (_, how) in FIELDS.items() if how == NO_EFFECT}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
CONTENT_PARTS = ("text",)  # chat content part types taken: this server's models read text
# An integer field beyond 64 bits is out of range whatever it counts (a seed is used mod 2**64
# by the workers): refused here, it never reaches arithmetic whose result Python cannot print
# (past 4,300 digits) or a float it cannot become.
INT_RANGE = (-(2**63), 2**64)
# Request values in error messages: short (a 50,000-character prompt is not repeated back),
# and nested values only a few levels deep (a 900-level list would exhaust repr's recursion).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 80, 80, 80


def shown(value) -> str:
    """`value` as an error message quotes it: its repr, cut short."""
    return _SHOWN.repr(value)


def _is_off(value, off) -> bool:
    """`value` is the "off" value `off`: equal, and a bool only where `off` is one (Python's
    True == 1 would take `true` for a penalty of 1)."""
    return isinstance(value, bool) == isinstance(off, bool) and value == off


# What vLLM's /tokenize takes: a prompt, or chat messages and how to render them
TOKENIZE_FIELDS = (
    "model",
    "prompt",
    "add_special_tokens",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "return_token_strs",
)


def template_arguments(tokenizer) -> frozenset[str]:
    """apply_chat_template's own arguments (`tokenize`, `return_tensors`, ...), as this
    transformers names them, and "messages": chat_template_kwargs may not set them (they are
    not template variables; some have fields of their own)."""
    import inspect

    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    named = {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(named | {"messages"})


def _only(body: dict, fields: tuple[str, ...], endpoint: str) -> None:
    """Refuse (a 400 naming it) a field of `body` not among `fields`."""
    extra = sorted(set(body) - set(fields))
    if extra:
        raise BadRequest(
            f"unknown field {shown(extra[0])} for {endpoint}: it takes {', '.join(fields)}",
            param=extra[0],
        )


def check_fields(body: dict, endpoint: str) -> None:
    """Refuse (a 400 naming it) a field this endpoint does not know, or one set to a value
    this server does not apply (see FIELDS)."""
    for name, value in body.items():
        endpoints, how = FIELDS.get(name, ((), None))
        if endpoint not in endpoints:
            raise BadRequest(
                f"unknown field {shown(name)} for /v1/{'chat/' if endpoint == CHAT else ''}"
                "completions: this server refuses fields it does not know rather than "
                "ignore them",
                param=name,
            )
        if (
            isinstance(how, tuple)
            and value is not None
            and not any(_is_off(value, off) for off in how)
        ):
            off = f"leave it out, or {' or '.join(map(repr, how))}" if how else "leave it out"
            raise BadRequest(
                f"'{name}'={shown(value)} is not supported by this server ({off})", param=name
            )


def check_text(body: dict) -> None:
    """Refuse (a 400 naming it) a string of the body, or a key, that is not Unicode text: a
    lone surrogate (JSON's "\\ud800"), which Python's `json` reads but no tokenizer, template
    or UTF-8 response can take. Walked without recursion: JSON nests up to ~1,000 levels."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if not _is_text(value):
                where = path or "body"
                raise BadRequest(
                    f"'{where}' is not valid Unicode text (a lone surrogate, \\ud800-\\udfff)",
                    param=where,
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key if _is_text(key) else key.encode("utf-8", "backslashreplace").decode()
                where = f"{path}.{name}" if path else name
                if name is not key:
                    raise BadRequest(
                        f"the field name '{where}' is not valid Unicode text (a lone "
                        "surrogate, \\ud800-\\udfff)",
                        param=where,
                    )
                todo.append((where, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class BadRequest(RequestError):
    """A request field the server cannot take: a 400 naming the field (`param`)."""


def api_names(chat: bool, body: dict) -> dict[str, str]:
    """The engine's names of a request's values (`check_request`) as this API calls them, in
    `body` (the limit is max_completion_tokens when it is sent)."""
    limit = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    return {
        "prompts": "messages" if chat else "prompt",
        "max_new_tokens": limit,
        "min_new_tokens": "min_tokens",
        "eos_token_ids": "stop_token_ids",
        "logprobs": "top_logprobs" if chat else "logprobs",
        "prompt_logprobs": "logprobs",
        "num_sequences": "n",
    }


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


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape (as vLLM's server sends it: the status as `code`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status)


def _error_for(exc: BaseException) -> JSONResponse:
    status, kind = status_of(exc)
    if status == 500:  # a bug: the client gets no internals, the log gets the traceback
        logger.exception("request failed", exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); see the server log", kind)
    return _error(status, str(exc), kind, getattr(exc, "param", None))


@app.exception_handler(Exception)
async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    """What a route did not catch: a 500 in OpenAI's shape, its traceback in the log (without
    this, Starlette answers a bare "Internal Server Error" and nothing says why)."""
    return _error_for(exc)


def _field(body: dict, name: str, kinds: tuple[type, ...], default=None, check=None, param=None):
    """`body[name]` (`default` when absent or null) if of one of `kinds` and in range
    (`check`); else a 400 naming it (`param`, default `name`). A number must be finite, an
    integer within 64 bits (INT_RANGE)."""
    param = param or name
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise BadRequest(
            f"'{param}' must be {' or '.join(k.__name__ for k in kinds)}, got "
            f"{type(value).__name__}",
            param=param,
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = INT_RANGE
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"'{param}'={value!r} must be a finite number", param=param)
        if isinstance(value, int) and not low <= value < high:
            raise BadRequest(f"'{param}'={shown(value)} is out of range", param=param)
    if check is not None and not check(value):
        raise BadRequest(f"'{param}'={shown(value)} is out of range", param=param)
    return value


@dataclass(frozen=True, slots=True)
class Parsed:
    """A completion request as the engine and the response take it: one or more prompts
    (completions take a list), each run with `n` rows (choices)."""

    prompts: tuple  # token ids (1, length) per prompt
    options: dict  # Job.submit's, but max_new_tokens (per prompt: `max_tokens`)
    # asked for (None: the rest of max_seq_len, vLLM's chat default); 0: score the prompt only
    max_tokens: int | None
    stream: bool
    stop: tuple[str, ...]
    include_stop: bool  # vLLM's include_stop_str_in_output
    usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage in every chunk
    n: int = 1  # rows (choices) of each prompt
    logprobs: int | None = None  # top tokens with each generated token's score (None: none)
    echo: tuple[str, ...] | None = None  # completions: each prompt's text, before its text
    skip_special_tokens: bool = True
    stop_token_ids: tuple[int, ...] = ()  # the request's own end tokens (stop_reason)
    guide_field: str | None = None  # the field that asked for guided decoding


def chat_messages(messages, tokenizer, template: str | None = None) -> list[dict]:
    """Chat `messages` for the template (`template`, else the tokenizer's): each {role,
    content}, the content a string or a list of text parts (`[{"type": "text", "text":
    ...}]`). Parts are passed as they are to a template that reads them (one that loops over a
    message's content, by its syntax tree), else joined with newlines, as vLLM does for a
    template that takes strings. Other part types (images, audio, files), and tool calls, are
    refused naming them."""
    from coordinator.serving.text import template_reads_parts

    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "'messages' must be a non-empty list of {role, content} with string values",
            param="messages",
        )
    as_parts = template_reads_parts(tokenizer, template)
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'{where}' must be an object with a string 'role'", param=where)
        for name in ("tool_calls", "function_call", "tool_call_id"):
            if message.get(name) is not None:
                raise BadRequest(
                    f"'{where}.{name}': tools are not supported by this server",
                    param=f"{where}.{name}",
                )
        if message["role"] in ("tool", "function"):
            raise BadRequest(
                f"'{where}.role'={message['role']!r}: tools are not supported by this server",
                param=f"{where}.role",
            )
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in CONTENT_PARTS:
                    raise BadRequest(
                        f"'{where}.content[{j}]': content part type {kind!r} is not supported "
                        "by this server (text only)",
                        param=f"{where}.content",
                    )
                if not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"'{where}.content[{j}].text' must be a string", param=f"{where}.content"
                    )
                texts.append(part["text"])
            if not as_parts:
                content = "\n".join(texts)
        elif not isinstance(content, str):
            raise BadRequest(
                f"'{where}.content' must be a string or a list of text parts",
                param=f"{where}.content",
            )
        out.append({**message, "content": content})
    return out


GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
# The longest guide regex compiled (any JSON object's is 6,900 characters; on a 2-core VM 8,192
# literal characters compile in 1.6 s, 16,384 in 6.3 s), and how long a request waits for its
# compile before a 400 says so (the compile goes on, and is kept for the next request).
MAX_GUIDE_REGEX_CHARS = 8192
GUIDE_COMPILE_TIMEOUT_S = 30.0
GUIDE_KINDS = ("json", "regex", "choice")  # structured_outputs' keys taken


def guide_of(body: dict) -> tuple[str | None, str | None]:
    """(field, regex) of the guided decoding a request asks for (None, None: none): OpenAI's
    `response_format` (json_object: any JSON object; json_schema: its `schema`), vLLM's
    `guided_json` (a schema, or its JSON text), `guided_regex`, `guided_choice` (one of the
    strings) and `structured_outputs` ({json | regex | choice}). One per request; a bad one
    is a 400 naming it, and so is a regex longer than MAX_GUIDE_REGEX_CHARS: its automaton's
    compile time grows with the square of its length (a 50,000-character regex took minutes,
    and the last stage compiles it again)."""
    field, regex = _guide_of(body)
    if regex is not None and len(regex) > MAX_GUIDE_REGEX_CHARS:
        raise BadRequest(
            f"'{field}': its regex has {len(regex)} characters, over the "
            f"{MAX_GUIDE_REGEX_CHARS} this server compiles into an automaton "
            "(MAX_GUIDE_REGEX_CHARS); send a shorter regex, fewer choices or a smaller schema",
            param=field,
        )
    return field, regex


def _guide_of(body: dict) -> tuple[str | None, str | None]:
    asked = [n for n in (*GUIDE_FIELDS, "structured_outputs") if body.get(n) is not None]
    if body.get("response_format") == {"type": "text"}:
        asked.remove("response_format")
    if not asked:
        return None, None
    if len(asked) > 1:
        raise BadRequest(
            f"'{asked[0]}' and '{asked[1]}' both guide the output: send one", param=asked[1]
        )
    field = name = asked[0]  # what the request sent, named in errors
    value = body[name]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return field, _schema_regex({"type": "object"}, field)
        spec = value.get("json_schema") if kind == "json_schema" else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest(
                f"'response_format'={shown(value)}: expected {{'type': 'text'}}, "
                "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name': "
                "..., 'schema': {...}}}",
                param=field,
            )
        return field, _schema_regex(spec["schema"], field)
    if name == "structured_outputs":
        kinds = sorted(value) if isinstance(value, dict) else []
        if len(kinds) != 1 or kinds[0] not in GUIDE_KINDS:
            raise BadRequest(
                f"'structured_outputs'={shown(value)}: expected one of "
                f"{', '.join(GUIDE_KINDS)} (a grammar is beyond a regex automaton)",
                param=field,
            )
        name, value = f"guided_{kinds[0]}", value[kinds[0]]
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise BadRequest(f"'guided_json' is not JSON: {exc}", param=field) from None
        if not isinstance(value, dict):
            raise BadRequest("'guided_json' must be a JSON schema (an object)", param=field)
        return field, _schema_regex(value, field)
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise BadRequest("'guided_regex' must be a non-empty regex string", param=field)
        return field, value
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise BadRequest("'guided_choice' must be a list of non-empty strings", param=field)
    import re

    return field, "(" + "|".join(re.escape(choice) for choice in value) + ")"


def _schema_regex(schema: dict, field: str) -> str:
    """The regex of the JSON texts a schema takes (outlines-core's)."""
    try:
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        raise BadRequest(
            f"'{field}': guided decoding needs outlines-core (pip install outlines-core), "
            "which is not installed here",
            param=field,
        ) from None
    try:
        return build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError, RuntimeError) as exc:  # a schema it cannot take
        raise BadRequest(f"'{field}': the JSON schema cannot be used: {exc}", param=field) from None


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("offload-coordinator")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


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


def completion_logprobs(scores, offset: int = 0) -> dict:
    """The completions' `logprobs` of `scores` (`TokenScore`s): each token's text, its
    log-probability, its top tokens with the token itself (as vLLM's: up to k + 1, None for
    the first prompt token) and where its text begins (from `offset`)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for score in scores:
        out["tokens"].append(score.text)
        out["token_logprobs"].append(score.logprob)
        top = None
        if score.top is not None:
            top = {score.text: score.logprob, **{text: value for text, _, value in score.top}}
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(score.text)
    return out


def chat_logprobs(scores) -> dict:
    """The chat's `logprobs`: per token its text, log-probability, UTF-8 bytes and its top
    tokens (the `top_logprobs` asked for)."""

    def entry(text: str, value: float) -> dict:
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(score.text, score.logprob),
                "top_logprobs": [entry(text, value) for text, _, value in score.top or ()],
            }
            for score in scores
        ]
    }


COMPLETIONS_MAX_TOKENS = 16  # vLLM's default max_tokens on /v1/completions


def _is_ids(values: list) -> bool:
    """A list of token ids (ints, not bools)."""
    return all(isinstance(i, int) and not isinstance(i, bool) for i in values)


def _cancel_all(runs) -> None:
    for run in runs:
        run.cancel()


def _usage(runs, p: int | None = None, count: int | None = None) -> dict:
    """The usage of all the prompts' runs so far; with `count`, run `p`'s completion tokens
    are those (the tokens up to a delta: a streamed chunk's usage is that of what it carries,
    and of the other runs so far)."""
    totals = [run.usage(count if i == p else None) for i, run in enumerate(runs)]
    return {key: sum(t[key] for t in totals) for key in totals[0]}


async def _merged(runs):
    """(prompt index, Delta) of every run as they come: each run's deltas read by a task of
    its own, into one queue; the tasks are cancelled when the reader stops."""
    if len(runs) == 1:
        async for delta in runs[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, run: Run) -> None:
        try:
            async for delta in run.deltas():
                await queue.put((p, delta))
        finally:
            await queue.put((p, None))

    tasks = [asyncio.create_task(pump(p, run)) for p, run in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            p, delta = await queue.get()
            if delta is None:
                left -= 1
                continue
            yield p, delta
    finally:
        for task in tasks:
            task.cancel()


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
        metrics_key: str | None = None,
        trust_request_chat_template: bool = False,
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
        self.metrics_key = metrics_key  # None: /metrics is open, as vLLM's
        self.trust_request_chat_template = trust_request_chat_template
        self.guides = GuideBook(tokenizer=self.tokenizer)  # guided requests' automata, checked
        self.created = int(time.time())
        self._dead_since: float | None = None  # when /health first saw a worker gone
        settle()  # imports done: the GC's own thresholds again (worker.startup)

    def _authorized(self, request: Request, key: str | None = "api") -> bool:
        """Whether the request carries `key` (default: the API key; None: nothing to carry)."""
        key = self.api_key if key == "api" else key
        if key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

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

    @app.get("/health")
    async def health(self):
        """200 while the load can serve; 503 with the reason once its keeper (its engine) is
        gone, its engine stopped (until a new one runs) or failed, or a worker has been gone
        past RECOVERY_GRACE_S (the keeper recovers lost workers meanwhile). No key needed, as
        vLLM's: a router's probe."""
        problem = await asyncio.to_thread(self._liveness)
        if problem is not None:
            return _error(503, problem, "service_unavailable")
        return PlainTextResponse("")

    @app.get("/version")
    async def version(self):
        return {"version": package_version()}

    def _liveness(self) -> str | None:
        try:
            parts = self._parts()
        except OffloadCoordinatorError as exc:  # the load is gone (unloaded), say
            return f"the load {self.load_name!r}: {exc}"
        try:  # the engine's loop stopped: its requests failed, a new one is starting
            engine = self.job.engine().health()
        except OffloadCoordinatorError as exc:  # its keeper does not answer
            engine = str(exc)
        if engine is not None:
            return engine
        dead = gone_parts(parts, HEALTH_PING_S)
        if not dead:
            self._dead_since = None
            return None
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
        if KEEPER in dead or KEEPER not in parts:  # no engine, or none to recover the workers
            return f"{', '.join(dead)} gone: this load cannot serve"
        if now - self._dead_since > RECOVERY_GRACE_S:
            return (
                f"{', '.join(dead)} gone and not recovered within {RECOVERY_GRACE_S:.0f} s: "
                "this load cannot serve"
            )
        return None  # the keeper is recovering them: requests wait meanwhile

    def _parts(self) -> dict:
        """What -> actor (None: gone): the load's keeper and its workers as its record says now
        (the keeper replaces lost workers: this replica's own view of them may be old)."""
        from coordinator.runtime import keeper, registry

        if self.job.name is None:
            return {f"the worker of stage {s}": h.actor for s, h in enumerate(self.job.workers)}
        _, record = registry.load_record(self.job.name)
        parts = {KEEPER: keeper.find(self.job.name)}
        for stage, actor in enumerate(registry.worker_handles(record)):
            parts[f"the worker of stage {stage}"] = actor
        return parts

    @app.get("/metrics")
    async def metrics(self, request: Request):
        """Prometheus' text format, vLLM's metric names: sequences running and waiting, KV pool
        usage (the share of blocks in use) and preemptions, time to first token and
        inter-token latency histograms, tokens generated. Open, as vLLM's, unless the server
        was given a metrics key (`--metrics-key-file`)."""
        if not self._authorized(request, self.metrics_key):
            return _error(
                401,
                "missing or wrong metrics key (Authorization: Bearer <key>)",
                "authentication_error",
            )
        try:
            text = await asyncio.to_thread(self._metrics_text)
        except OffloadCoordinatorError as exc:  # the engine cannot answer: say why, by kind
            return _error_for(exc)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _metrics_text(self) -> str:
        """The engine's metrics, then the offloaders' (`telemetry.prometheus_lines`: bytes
        copied per stage and per generated token, routed experts' hits and misses per layer).
        Workers that do not answer in time cost only their own lines: the scrape still gets
        the engine's, and a comment says why the rest are missing."""
        from coordinator.runtime import telemetry

        engine = self.job.engine()
        text = engine.prometheus(self.model_name)
        try:
            reports = self.job.telemetry()
            tokens = engine.snapshot()["generation_tokens"]
        except OffloadCoordinatorError as exc:
            logger.warning("/metrics without the offloaders' counters: %s", exc)
            why = " ".join(str(exc).split())  # one comment line
            return text + f"# offload: the workers' counters are missing: {why}\n"
        return text + telemetry.prometheus_lines(reports, self.model_name, tokens)

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

    async def _body(self, request: Request) -> dict | JSONResponse:
        """The request's JSON object, once its key and its model are this server's; else the
        error response (401, 400 naming what is wrong with the body, 404 for another model)."""
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
        except RecursionError:  # json's parser nests as deep as Python's recursion limit
            return _error(400, "the request body is nested too deeply to read")
        except ValueError as exc:  # an integer past Python's limit of 4,300 digits
            return _error(400, f"the request body has a number too long to read: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("model", self.model_name) != self.model_name:
            return _error(
                404,
                f"the model {shown(body['model'])} does not exist here: this server "
                f"serves {self.model_name!r} (GET /v1/models)",
                "NotFoundError",
                "model",
            )
        return body

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a `prompt` (special tokens added unless `add_special_tokens` is
        false) or chat `messages` through the template (`add_generation_prompt`, default
        true) -> {count, max_model_len, tokens, token_strs (with `return_token_strs`)}."""
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            _only(body, TOKENIZE_FIELDS, "/tokenize")
            if "messages" in body:
                ids = self._chat_ids(body)[0].tolist()
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise BadRequest("'prompt' must be a string (or send 'messages')", "prompt")
                special = _field(body, "add_special_tokens", (bool,), True)
                ids = self.tokenizer(prompt, add_special_tokens=special)["input_ids"]
            strs = _field(body, "return_token_strs", (bool,), False)
        except OffloadCoordinatorError as exc:  # a bad field, or the template's refusal
            return _error_for(exc)
        return {
            "count": len(ids),
            "max_model_len": self.job.config.max_seq_len,
            "tokens": ids,
            "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: `tokens` (ids of this model's vocabulary) -> {prompt}, their
        text with special tokens as they are."""
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        tokens = body.get("tokens")
        vocab = self.job.index.config.get("vocab_size") or len(self.tokenizer)
        if (
            not isinstance(tokens, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens)
            or any(i < 0 or i >= vocab for i in tokens)
        ):
            return _error(
                400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens"
            )
        try:
            _only(body, ("model", "tokens"), "/detokenize")
        except BadRequest as exc:
            return _error_for(exc)
        return {"prompt": self.tokenizer.decode(tokens)}

    async def _handle(self, request: Request, *, chat: bool):
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            parsed = self._parse(body, chat)
            if parsed.options.get("guide"):  # compiled here first (seconds for a schema): a 400
                try:
                    await asyncio.wait_for(
                        asyncio.to_thread(self.guides.index, parsed.options["guide"]),
                        GUIDE_COMPILE_TIMEOUT_S,
                    )
                except GuideError as exc:
                    raise BadRequest(str(exc), param=parsed.guide_field) from None
                except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                    raise BadRequest(
                        f"'{parsed.guide_field}': its automaton did not compile within "
                        f"{GUIDE_COMPILE_TIMEOUT_S:.0f} s (GUIDE_COMPILE_TIMEOUT_S); send a "
                        "simpler regex or schema",
                        param=parsed.guide_field,
                    ) from None
            runs = [self._run(parsed, ids, chat, body) for ids in parsed.prompts]
        except GenerationError as exc:  # past the context or the KV plan: the API's field
            exc.param = api_names(chat, body).get(exc.param, exc.param)
            return _error_for(exc)
        except OffloadCoordinatorError as exc:  # no chat template, say
            return _error_for(exc)
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            try:
                for run in runs:
                    await run.start()  # a full queue is a 429 here, before the stream's 200
            except OffloadCoordinatorError as exc:
                _cancel_all(runs)
                return _error_for(exc)
            except BaseException:  # its client went away: the prompts already queued end too
                _cancel_all(runs)
                raise
            if not await runs[0].started(request):  # no byte until the request runs
                _cancel_all(runs)
                return _error(499, "the client went away while the request waited")
            return StreamingResponse(
                self._events(runs, rid, chat, request, parsed),
                media_type="text/event-stream",
                headers={LOAD_HEADER: self.load_name},
            )
        try:
            await asyncio.gather(*(run.finish() for run in runs))
        except Exception as exc:  # busy (429), a lost worker (503), a bug (500): by kind
            _cancel_all(runs)
            return _error_for(exc)
        choices = []
        for p, run in enumerate(runs):
            for row, choice in enumerate(run.choices):
                text, scores = choice.stream.text, choice.scores
                if parsed.echo is not None:
                    text, scores = parsed.echo[p] + text, run.prompt_scores + scores
                logprobs = None
                if parsed.logprobs is not None:
                    logprobs = chat_logprobs(scores) if chat else completion_logprobs(scores)
                piece = {"message": {"role": "assistant", "content": text}} if chat else {}
                choices.append(
                    {
                        "index": p * parsed.n + row,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                        "logprobs": logprobs,
                        **(piece or {"text": text}),
                    }
                )
        return JSONResponse(
            {
                "id": rid,
                "object": kind,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(runs),
            },
            headers={LOAD_HEADER: self.load_name},
        )

    def _run(self, parsed: "Parsed", ids, chat: bool, body: dict) -> Run:
        """The engine's run of one prompt, its values checked first (a 400 names the bad one):
        its limit (the rest of max_seq_len when none was asked; 0 scores the prompt and
        generates one token that nobody sees) merged with the checkpoint's settings."""
        length = int(ids.shape[1])
        asked = parsed.max_tokens
        if asked is None:  # at least 1: past max_seq_len, the KV check says so
            asked = max(self.job.config.max_seq_len - length, 1)
        options = {**parsed.options, "max_new_tokens": max(asked, 1)}
        echo_logprobs = parsed.logprobs if parsed.echo is not None else None
        settings = self.job.check_request(  # a 400 now
            length, parsed.n, logprobs=parsed.logprobs, prompt_logprobs=echo_logprobs, **options
        )
        names = api_names(chat, body)
        if settings.min_new_tokens > settings.max_new_tokens and asked:
            raise BadRequest(
                f"'min_tokens'={settings.min_new_tokens} must be <= "
                f"'{names['max_new_tokens']}'={settings.max_new_tokens}",
                param="min_tokens",
            )
        # the engine's own check of what it will run (the checkpoint's settings merged in):
        # a value no worker can take is this request's 400, never its batch's failure
        check_request(
            ids.tolist(),
            sampling=settings.sampling,
            max_new_tokens=settings.max_new_tokens,
            eos_token_ids=settings.eos_token_ids,
            seed=settings.seed,
            min_new_tokens=settings.min_new_tokens,
            logprobs=parsed.logprobs,
            prompt_logprobs=echo_logprobs,
            vocab_size=self._vocab(),
            names=names,
        )
        return Run(
            self.job,
            self.tokenizer,
            ids,
            options,
            parsed.stop,
            parsed.include_stop,
            n=parsed.n,
            skip_special_tokens=parsed.skip_special_tokens,
            logprobs=parsed.logprobs,
            echo_logprobs=echo_logprobs,
            score_only=asked == 0,
            stop_token_ids=parsed.stop_token_ids,
        )

    def _vocab(self) -> int:
        return self.job.index.config.get("vocab_size") or len(self.tokenizer)

    def _parse(self, body: dict, chat: bool) -> "Parsed":
        from coordinator.serving.text import end_ids

        check_text(body)
        check_fields(body, CHAT if chat else COMPLETIONS)
        for name, kinds in NO_EFFECT_KINDS.items():
            _field(body, name, kinds)
        n = _field(body, "n", (int,), 1, lambda v: v >= 1)
        best_of = _field(body, "best_of", (int,), n)
        if best_of != n:
            raise BadRequest(
                f"'best_of'={best_of} is not supported: only best_of == n ({n}), every row "
                "returned (send n alone)",
                param="best_of",
            )
        logprobs, echo = self._scoring(body, chat)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (
            not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
        ):
            raise BadRequest("'stop' must be a non-empty string or a list of them", param="stop")
        prompts = [self._chat_ids(body)] if chat else self._prompts(body.get("prompt"))
        max_tokens = self._limit(body, chat, echo)
        min_tokens = _field(body, "min_tokens", (int,), 0, lambda v: v >= 0)
        options = {"min_new_tokens": min_tokens, **self._sampling(body)}
        guide_field, options["guide"] = guide_of(body)
        stop_ids = _field(body, "stop_token_ids", (list,), [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
        if _field(body, "ignore_eos", (bool,), False) or stop_ids:
            ends = () if body.get("ignore_eos") else end_ids(self.tokenizer, self.job.index)
            options["eos_token_id"] = sorted({*ends, *stop_ids})
        stream = _field(body, "stream", (bool,), False)
        stream_options = _field(body, "stream_options", (dict,), {})
        if stream_options and not stream:
            raise BadRequest("'stream_options' is only allowed with stream=true", "stream_options")
        for name in stream_options:
            if name not in STREAM_OPTIONS:
                raise BadRequest(
                    f"unknown field 'stream_options.{name}' (known: {', '.join(STREAM_OPTIONS)})",
                    param=f"stream_options.{name}",
                )
        usage = _field(
            stream_options, "include_usage", (bool,), False, param="stream_options.include_usage"
        )
        continuous = _field(
            stream_options,
            "continuous_usage_stats",
            (bool,),
            False,
            param="stream_options.continuous_usage_stats",
        )
        if continuous and not usage:  # vLLM would drop it: refused rather than ignored
            raise BadRequest(
                "'stream_options.continuous_usage_stats' needs 'include_usage': true",
                param="stream_options.continuous_usage_stats",
            )
        return Parsed(
            n=n,
            logprobs=logprobs,
            echo=self._echo_texts(body, prompts) if echo else None,
            skip_special_tokens=_field(body, "skip_special_tokens", (bool,), True),
            prompts=tuple(prompts),
            options=options,
            max_tokens=max_tokens,
            stream=stream,
            stop=tuple(stop or ()),
            include_stop=_field(body, "include_stop_str_in_output", (bool,), False),
            usage=usage,
            continuous_usage=continuous,
            stop_token_ids=tuple(i for i in stop_ids if i != self.tokenizer.eos_token_id),
            guide_field=guide_field,
        )

    def _chat_ids(self, body: dict):
        """The token ids (1, n) of a body's chat `messages` through the chat template, with
        vLLM's chat fields: `add_generation_prompt` (default true; false with
        `continue_final_message`, which leaves the last message open), `chat_template` (a
        template is code the server runs: only with --trust-request-chat-template, as vLLM)
        and `chat_template_kwargs` (the template's own variables, `enable_thinking` say)."""
        from coordinator.serving.text import prompt_ids

        template = _field(body, "chat_template", (str,), None)
        if template is not None and not self.trust_request_chat_template:
            raise BadRequest(
                "'chat_template' from a request is refused: a template is code the server "
                "runs, and this server was not started with --trust-request-chat-template",
                param="chat_template",
            )
        variables = _field(body, "chat_template_kwargs", (dict,), {})
        taken = sorted(set(variables) & template_arguments(self.tokenizer))
        if taken:
            raise BadRequest(
                f"'chat_template_kwargs' may not set {taken[0]!r}: it is not a template "
                "variable (send the field of that name, if there is one)",
                param="chat_template_kwargs",
            )
        go_on = _field(body, "continue_final_message", (bool,), False)
        opened = _field(body, "add_generation_prompt", (bool,), not go_on)
        if go_on and opened:
            raise BadRequest(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true: "
                "the last message goes on, or a new turn opens",
                param="continue_final_message",
            )
        messages = chat_messages(body.get("messages"), self.tokenizer, template)
        return prompt_ids(
            self.tokenizer,
            messages=messages,
            add_generation_prompt=opened,
            continue_final_message=go_on,
            chat_template=template,
            template_kwargs=variables,
        )

    @staticmethod
    def _limit(body: dict, chat: bool, echo: bool) -> int | None:
        """The new tokens asked for: max_completion_tokens over max_tokens (vLLM's chat rule,
        on completions too: guidellm sends it), both checked; when neither is sent, vLLM's
        defaults: 16 on completions, the rest of max_seq_len on chat (None). 0 only with
        echo: the prompt's scores alone (vLLM's)."""
        value = None
        for name in ("max_tokens", "max_completion_tokens"):
            sent = _field(body, name, (int,), None, lambda v: v >= 0)
            if sent == 0 and not echo:
                raise BadRequest(
                    f"'{name}'=0 generates nothing: ask for 1 or more, or send it with "
                    "echo=true to score the prompt alone",
                    param=name,
                )
            value = sent if sent is not None else value
        if value is None and not chat:
            value = COMPLETIONS_MAX_TOKENS
        return value

    def _sampling(self, body: dict) -> dict:
        """Job.generate's sampling options from the request, in vLLM's style (`style`:
        what the request leaves out comes from generation_config.json where it sets it,
        else vLLM's neutral values: temperature 1.0, so a request without one samples)."""
        top_k = _field(body, "top_k", (int,), None, lambda v: v >= -1)
        options = {
            "style": "vllm",
            "temperature": _field(body, "temperature", (int, float), None, lambda v: v >= 0),
            "top_p": _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1),
            "top_k": None if top_k is None else max(top_k, 0),  # vLLM's -1: off
            "min_p": _field(body, "min_p", (int, float), None, lambda v: 0 <= v <= 1),
            "repetition_penalty": _field(
                body, "repetition_penalty", (int, float), None, lambda v: v > 0
            ),
            "seed": _field(body, "seed", (int,), None),
        }
        for name in ("frequency_penalty", "presence_penalty"):
            options[name] = _field(body, name, (int, float), None, lambda v: -2 <= v <= 2)
        bias = _field(body, "logit_bias", (dict,), None)
        if bias:
            options["logit_bias"] = self._logit_bias(bias)
        words = _field(body, "bad_words", (list,), None)
        if words:
            options["bad_words_ids"] = self._bad_words(words)
        return options

    def _logit_bias(self, bias: dict) -> dict[int, float]:
        """OpenAI's logit_bias (token ids as strings -> bias) as token -> bias, each bias
        clamped to [-100, 100] as vLLM does; a key that is not a token id of the vocabulary,
        or a bias that is not a number, is a 400."""
        vocab, out = self._vocab(), {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(
                    f"'logit_bias' key {shown(key)} is not a token id", param="logit_bias"
                ) from None
            if not 0 <= token < vocab:
                raise BadRequest(
                    f"'logit_bias' token {token} is out of the vocabulary [0, {vocab})",
                    param="logit_bias",
                )
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not math.isfinite(value):
                raise BadRequest(
                    f"'logit_bias' of token {token} must be a finite number, got {shown(value)}",
                    param="logit_bias",
                )
            out[token] = min(100.0, max(-100.0, float(value)))
        return out

    def _bad_words(self, words: list) -> list[list[int]]:
        """vLLM's bad_words (strings) as token sequences, tokenized as vLLM does: each word
        stripped of leading spaces on its own, and again after a space where that gives a
        different first token in as many tokens (the word inside a text)."""
        out: list[list[int]] = []
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise BadRequest(
                    f"'bad_words' must be non-empty strings, got {shown(word)}", param="bad_words"
                )
            alone = self.tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"]
            spaced = self.tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"]
            out.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

    @staticmethod
    def _scoring(body: dict, chat: bool) -> tuple[int | None, bool]:
        """(top tokens with each token's log-probability, None: none; echo): the completions'
        `logprobs: k` and `echo`, the chat's `logprobs: true` with `top_logprobs: k`."""
        in_range = lambda v: 0 <= v <= MAX_LOGPROBS  # noqa: E731
        if chat:
            if _field(body, "echo", (bool,), False):
                raise BadRequest(
                    "'echo'=true is not supported on /v1/chat/completions (use "
                    "/v1/completions with the templated prompt)",
                    param="echo",
                )
            top = _field(body, "top_logprobs", (int,), None, in_range)
            if not _field(body, "logprobs", (bool,), False):
                if top:
                    raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
                return None, False
            return top or 0, False
        return _field(body, "logprobs", (int,), None, in_range), _field(
            body, "echo", (bool,), False
        )

    def _echo_texts(self, body: dict, prompts: list) -> tuple[str, ...]:
        """Each prompt as `echo` returns it: the string sent, or its token ids decoded."""
        sent = body.get("prompt")
        sent = sent if isinstance(sent, list) and sent and not _is_ids(sent) else [sent]
        return tuple(
            text
            if isinstance(text, str)
            else self.tokenizer.decode(ids[0].tolist(), skip_special_tokens=False)
            for text, ids in zip(sent, prompts, strict=True)
        )

    def _prompts(self, prompt) -> list:
        """A completion's prompts: a string or token ids, or a list of either (one run of n
        choices each, as OpenAI's API and vLLM take them)."""
        import torch

        from coordinator.serving.text import prompt_ids

        many = isinstance(prompt, list) and prompt and not _is_ids(prompt)
        out = []
        for item in prompt if many else [prompt]:
            if isinstance(item, str) and item:
                out.append(prompt_ids(self.tokenizer, item))
            elif isinstance(item, list) and item and _is_ids(item):
                vocab = self._vocab()
                if any(i < 0 or i >= vocab for i in item):
                    raise BadRequest(f"'prompt' has token ids outside [0, {vocab})", param="prompt")
                out.append(torch.tensor([item], dtype=torch.long))
            else:
                raise BadRequest(
                    "'prompt' must be a non-empty string or a list of token ids, or a list of "
                    "those",
                    param="prompt",
                )
        return out

    async def _events(self, runs, rid: str, chat: bool, request: Request, parsed: "Parsed"):
        """Server-sent events: the first with the first token (chat: each choice's role; echo:
        each prompt's text), a chunk per text delta of a choice (with its tokens'
        log-probabilities when asked), a last chunk per choice with its finish and stop
        reasons, then [DONE]. Choice p * n + row is row `row` of prompt p. A client that goes
        away cancels the request (its caches are freed)."""
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * parsed.n * len(runs)  # completions' text_offset: where each text is

        def event(index, delta, finish=None, scores=None, role=False, usage=None, why=None):
            logprobs = None
            if parsed.logprobs is not None and scores is not None:
                if chat:
                    logprobs = chat_logprobs(scores)
                else:
                    logprobs = completion_logprobs(scores, offsets[index])
            if chat:
                piece = {"delta": {"role": "assistant"} if role else {}}
                if delta is not None:
                    piece["delta"]["content"] = delta
            else:
                piece = {"text": delta or ""}
                offsets[index] += len(delta or "")
            choice = {"index": index, **piece, "logprobs": logprobs, "finish_reason": finish}
            data = {
                "id": rid,
                "object": chunk_kind,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [{**choice, "stop_reason": why}],
            }
            if parsed.continuous_usage:  # vLLM's continuous_usage_stats: usage so far, each
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        try:
            first = _usage(runs, 0, runs[0].first_count())
            for row in range(parsed.n if chat else 0):
                yield event(row, None, role=True, usage=first)
            async for p, delta in _merged(runs):
                if await request.is_disconnected():
                    _cancel_all(runs)
                    return
                usage = _usage(runs, p, delta.new_tokens) if parsed.continuous_usage else None
                if delta.first and parsed.echo is not None:  # the prompt, before all else
                    for row in range(parsed.n):
                        start = _usage(runs, p, 0) if parsed.continuous_usage else None
                        scores = runs[p].prompt_scores
                        yield event(p * parsed.n + row, parsed.echo[p], None, scores, usage=start)
                if delta.text or delta.scores or (delta.first and not chat):
                    index = p * parsed.n + delta.row
                    yield event(index, delta.text, None, delta.scores, usage=usage)
            failed = next((run.error for run in runs if run.error is not None), None)
            if failed is not None:
                status, kind = status_of(failed)
                text = str(failed) if status != 500 else "internal error; see the server log"
                message = json.dumps(error_body(status, text, kind))
                yield f"data: {message}\n\n"
            else:
                for p, run in enumerate(runs):
                    for row, choice in enumerate(run.choices):
                        index = p * parsed.n + row
                        why = choice.stop_reason
                        yield event(index, None, choice.finish_reason, why=why, usage=_usage(runs))
                if parsed.usage:  # stream_options.include_usage: one more chunk, no choices
                    data = {
                        "id": rid,
                        "object": chunk_kind,
                        "created": int(time.time()),
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(runs),
                    }
                    yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            _cancel_all(runs)  # a client gone mid-stream (the generator is closed): stop, free


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
    metrics_key: str | None = None,
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
    trust_request_chat_template: bool = False,
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
                deployment.bind(
                    list(load_names),
                    model_name,
                    api_key,
                    owner,
                    metrics_key,
                    trust_request_chat_template,
                ),
                name=served.name,
                route_prefix=None,
                blocking=False,
            )
        served.front = HttpFront(handle, sock)
        return served
    except BaseException:
        served.stop()
        raise
