"""A fuzzed HTTP front (issue 53): hypothesis writes request bodies for /v1/completions and
/v1/chat/completions (wrong types, out-of-range and non-finite numbers, huge and empty values,
unknown fields, junk messages, malformed JSON, lone surrogates, wrong content types) and sends
them, many at once, to a real `offloadctl serve` while innocent greedy requests run beside them.

Every answer is 2xx (a completion, or a stream read to its `[DONE]`) or 4xx in OpenAI's error
shape: never a 5xx, never a dropped connection. Every innocent text equals transformers' greedy
text for its prompt alone, and /health answers afterwards. CI (HYPOTHESIS_PROFILE=ci: the same
bodies every run) sends at least `MIN_BODIES`; bench/fuzz_soak.py sends many more.

The bodies are drawn in batches (one hypothesis example each) and sent by a pool of threads
without waiting for the batch, so the server always has `CONCURRENCY` of them in flight; a body
that breaks the rules is kept with its answer and all of them are reported at the end.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st
from test_serving import greedy_text, serving

from coordinator.serving.app import (
    APPLIED,
    CHAT,
    COMPLETIONS,
    FIELDS,
    MAX_LOGPROBS,
    STREAM_OPTIONS,
)

MIN_BODIES = 2000  # per CI run
BATCH = 16  # bodies per hypothesis example
CONCURRENCY = 12  # fuzzed bodies in flight at once
REQUEST_TIMEOUT_S = 120.0  # one answer (a streamed one read to its end)
INNOCENT_TOKENS = 8
INNOCENT_PROMPTS = ("the quick brown fox", "once upon a time", "hello there")
MODEL = "tiny-llama"
SERVE_FLAGS = ("--gpus", "1", "--gpu-memory", "8MiB", "--max-seq-len", "64", "--max-batch", "4")
PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}
UNKNOWN_FIELDS = ("temprature", "prompts", "", "Max_tokens", "\ud800", "x" * 300, "__proto__")
CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
    None,
)


# -- values ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is where the value stands: literals Python's `json` reads but
    `json.dumps` cannot write as they are (integers past 4,300 digits, 1e999)."""

    text: str


BIG_INTS = (2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**4299)
RAW_NUMBERS = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "-0",
    "1e-400",
    "9" * 4301,  # past Python's int-from-text limit (4,300 digits)
    "-" + "9" * 5000,
    "0." + "0" * 5000 + "1",
)


def either(*choices) -> st.SearchStrategy:
    """One of `choices` (each a strategy, or (weight, strategy)), drawn by weight: st.one_of
    flattens the one_ofs inside it into their branches, weighing each branch alike, so a
    one_of of many kinds of junk would drown the values near the valid ones."""
    pairs = [c if isinstance(c, tuple) else (1, c) for c in choices]
    index = st.sampled_from([i for i, (weight, _) in enumerate(pairs) for _ in range(weight)])

    @st.composite
    def one(draw):
        return draw(pairs[draw(index)][1])

    return one()


SURROGATES = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
)
SPECIAL_STRINGS = ["", " ", "user", "assistant", "text", "auto", "none", "\x00", "\n\n"]
SPECIAL_STRINGS += ["<|im_end|>", "<|im_start|>user\n", "{{ raise_exception('x') }}"]
# a lone surrogate in 1 string of 10: one in a body refuses all of it
STRINGS = either((6, st.text(max_size=12)), (3, st.sampled_from(SPECIAL_STRINGS)), SURROGATES)
HUGE_STRINGS = st.builds(
    lambda piece, n: piece * n,
    st.sampled_from(["a ", "\u00e9", "x", "\U0001f600", "<|im_end|>"]),
    st.sampled_from([1_000] * 4 + [50_000]),
)
NUMBERS = either(
    (3, st.integers(-10, 100)),
    st.sampled_from(BIG_INTS),
    (2, st.floats(allow_nan=True, allow_infinity=True)),
    st.sampled_from([0.0, -0.0, 1e-300, 0.5, 1.0, 1.5, 2.0, 1e300]),
    st.sampled_from(RAW_NUMBERS).map(Raw),
)
SCALARS = either(st.none(), st.booleans(), (3, NUMBERS), (3, STRINGS))
JUNK = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(STRINGS, kids, max_size=3),
    max_leaves=6,
)
DEEP = st.sampled_from([10, 200, 900, 3000]).map(
    lambda depth: Raw("[" * depth + "]" * depth)  # past ~1000: json's recursion limit
)
# mostly small: a huge or deep value costs the server time, and the budget is bodies a second
SOME_JUNK = either((6, SCALARS), (6, JUNK), HUGE_STRINGS, DEEP)
BOOLS = either((2, st.booleans()), SOME_JUNK)
SMALL_INTS = either((2, st.integers(-6, 70)), SOME_JUNK)
TOKEN_IDS = st.lists(
    either((4, st.integers(0, 511)), st.integers(-3, 600), NUMBERS), min_size=1, max_size=6
)


def messages_strategy() -> st.SearchStrategy:
    """Chat messages, mostly near a valid list (so that the template renders most of them):
    roles out of turn or unknown, content as text parts, parts that are not dicts or not
    text, roles missing or not strings, content of every type, tool calls, extra keys."""
    role = st.sampled_from(["user", "assistant", "system", "developer", "", "model", "User"])
    part = either(
        (6, st.fixed_dictionaries({"type": st.just("text"), "text": STRINGS})),
        st.fixed_dictionaries({"type": STRINGS}, optional={"text": SOME_JUNK}),
        st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
        SCALARS,
    )
    junk = st.fixed_dictionaries(
        {},
        optional={
            "role": either(role, SOME_JUNK, st.sampled_from(["tool", "function"])),
            "content": either(STRINGS, st.lists(part, max_size=3), SOME_JUNK, HUGE_STRINGS),
            "name": SOME_JUNK,
            "tool_calls": SOME_JUNK,
            "tool_call_id": SOME_JUNK,
            "extra": SOME_JUNK,
        },
    )
    message = either(
        (6, st.fixed_dictionaries({"role": role, "content": STRINGS})),
        (3, st.fixed_dictionaries({"role": role, "content": st.lists(part, max_size=3)})),
        junk,
        SCALARS,
    )
    return either((8, st.lists(message, min_size=1, max_size=4)), st.just([]), SOME_JUNK)


# Values near each field's valid ones (and around its limits), besides junk of any type.
NEAR = {
    "model": st.sampled_from([MODEL, "gpt-4", "", MODEL.upper()]),
    "prompt": either(
        STRINGS, HUGE_STRINGS, TOKEN_IDS, st.lists(either(STRINGS, TOKEN_IDS), max_size=3)
    ),
    "messages": messages_strategy(),
    "max_tokens": SMALL_INTS,
    "max_completion_tokens": SMALL_INTS,
    "min_tokens": SMALL_INTS,
    "n": either((3, st.integers(-1, 6)), st.sampled_from(BIG_INTS)),
    "best_of": either((3, st.integers(-1, 6)), SOME_JUNK),
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "top_k": either(st.sampled_from([-5, -1, 0, 1, 40, 511, 512, 10**6]), NUMBERS),
    "seed": either(st.integers(-(2**64), 2**65), NUMBERS),
    "logprobs": either(
        st.booleans(), (3, st.integers(-2, MAX_LOGPROBS + 2)), st.sampled_from(BIG_INTS)
    ),
    "top_logprobs": either((3, st.integers(-2, MAX_LOGPROBS + 2)), st.sampled_from(BIG_INTS)),
    "stop": either(STRINGS, (2, st.lists(either(STRINGS, SCALARS), max_size=8)), HUGE_STRINGS),
    "min_p": NUMBERS,
    "repetition_penalty": NUMBERS,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "logit_bias": either(
        (3, st.dictionaries(st.integers(-3, 600).map(str), NUMBERS, max_size=4)),
        st.dictionaries(STRINGS, SCALARS, max_size=3),
    ),
    "bad_words": either((3, st.lists(STRINGS, max_size=3)), SOME_JUNK),
    "stop_token_ids": either((3, TOKEN_IDS), SOME_JUNK),
    "stream": BOOLS,
    "stream_options": either(
        (3, st.dictionaries(st.sampled_from([*STREAM_OPTIONS, "x", ""]), BOOLS, max_size=3)),
        SOME_JUNK,
    ),
    "echo": BOOLS,
    "ignore_eos": BOOLS,
    "skip_special_tokens": BOOLS,
    "include_stop_str_in_output": BOOLS,
    "add_generation_prompt": BOOLS,
}
# The values that mean "off" of the fields refused unless off, and their neighbours.
OFF_VALUES = {repr(v): v for _, how in FIELDS.values() if isinstance(how, tuple) for v in how}
OFF = st.sampled_from([*OFF_VALUES.values(), False, True, 0.0, [], {}, "", None])


FIELD_VALUES = {
    name: either((3, NEAR.get(name, OFF)), (2, SOME_JUNK)) for name in [*FIELDS, *UNKNOWN_FIELDS]
}


# The options of a request the server takes (some do not go together: those are 400s), by
# endpoint; strategies made once (a composite made per draw costs hypothesis a look at its
# source each time).
OPTIONS = {
    "model": st.just(MODEL),
    "n": st.integers(1, 2),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1]),
    "seed": st.integers(0, 2**32),
    "stop": st.sampled_from(["e", [" ", "a"], "\n"]),
    "min_tokens": st.integers(0, 1),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=2),
}
BASE_OPTIONS = {
    COMPLETIONS: {**OPTIONS, "logprobs": st.integers(0, 3), "echo": st.booleans()},
    CHAT: {**OPTIONS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3)},
}
BASE_PROMPTS = {
    COMPLETIONS: either(
        st.sampled_from(INNOCENT_PROMPTS), st.lists(st.integers(0, 511), min_size=1, max_size=8)
    ).map(lambda prompt: {"prompt": prompt}),
    CHAT: st.sampled_from(INNOCENT_PROMPTS).map(
        lambda text: {"messages": [{"role": "user", "content": text}]}
    ),
}


@st.composite
def base_body(draw, chat: bool) -> dict:
    """A request that the server takes (mostly), generating a few tokens, streamed or not,
    with options that shape the answer: what the mutations start from, so that the answers a
    fuzzed body can get include every kind of 2xx."""
    endpoint = CHAT if chat else COMPLETIONS
    body: dict = {"max_tokens": draw(st.integers(1, 4)), **draw(BASE_PROMPTS[endpoint])}
    options = BASE_OPTIONS[endpoint]
    names = draw(st.lists(st.sampled_from(sorted(options)), max_size=4, unique=True))
    body.update({name: draw(options[name]) for name in names})
    if draw(st.integers(0, 3)) == 3:  # a quarter streamed
        body["stream"] = True
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": draw(BOOLS)}
    return body


@dataclass(frozen=True)
class Sent:
    """One fuzzed HTTP request: where, with which headers, and the body's bytes."""

    chat: bool
    body: bytes
    content_type: str | None
    key: str | None = ""  # "": the server's key; None: no Authorization header

    def __repr__(self) -> str:
        body = self.body if len(self.body) <= 400 else self.body[:400] + b"..."
        return f"Sent({PATHS[self.chat]}, {self.content_type!r}, {len(self.body)} bytes: {body!r})"


def encode(value, *, ascii_only: bool = True) -> bytes:
    """`value` as JSON text, NaN and the infinities as Python writes them, each `Raw` as its
    text; strings with lone surrogates as escapes (ascii_only) or as the bytes `surrogatepass`
    writes (which Python's `json` reads back as the same string)."""
    raws: list[str] = []

    def lift(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: lift(x) for k, x in v.items()}
        if isinstance(v, list):
            return [lift(x) for x in v]
        return v

    text = json.dumps(lift(value), ensure_ascii=ascii_only)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00", ensure_ascii=ascii_only), raw, 1)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def fuzzed(draw) -> Sent:
    """A body near a valid one (`base_body`) with 1-3 fields set to values near theirs or junk
    (the endpoint's own fields, applied ones most, then any, then unknown ones), sometimes
    without its prompt; mostly sent as JSON, some as other documents, cut short or in other
    encodings; with any content type, a few without the key or with a wrong one."""
    chat = draw(st.booleans())
    body = draw(base_body(chat))
    names = [
        n for n, (endpoints, _) in FIELDS.items() if (CHAT if chat else COMPLETIONS) in endpoints
    ]
    applied = [n for n in names if FIELDS[n][1] == APPLIED]  # every field, these most
    for name in draw(
        st.lists(
            st.sampled_from([*names, *applied, *applied, *sorted(FIELDS), *UNKNOWN_FIELDS]),
            min_size=1,
            max_size=3,
        )
    ):
        body[name] = draw(FIELD_VALUES[name])
    # (hypothesis draws the simplest choice, 0, more often than the others: here a body as is)
    if draw(st.integers(0, 9)) == 9:  # the prompt or the messages left out
        body.pop("messages" if chat else "prompt", None)
    how = draw(st.integers(0, 19))
    if how == 19:  # a document that is not an object, or not JSON at all
        data = draw(
            st.one_of(
                SOME_JUNK.map(encode),
                st.binary(max_size=40),
                st.sampled_from([b"", b"{", b"{}", b'{"prompt":}', b"\xff\xfe", b"[1,]"]),
            )
        )
    elif how == 18:  # cut short
        data = encode(body)
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif how == 17:  # UTF-16 (which Python's json detects), or latin-1 bytes
        text = encode(body, ascii_only=False).decode("utf-8", "surrogatepass")
        data = text.encode(draw(st.sampled_from(["utf-16", "utf-16-le", "latin-1"])), "replace")
    else:
        data = encode(body, ascii_only=draw(st.booleans()))
    content_type = draw(st.sampled_from([*CONTENT_TYPES[:1] * 6, *CONTENT_TYPES]))
    key = draw(st.sampled_from([""] * 30 + [None, "wrong"]))
    return Sent(chat, data, content_type, key)


# -- sending ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no answer (the connection dropped, a timeout)
    body: bytes = b""
    content_type: str = ""
    error: str = ""  # the client's exception, when no answer came
    seconds: float = 0.0


def send(port: int, server_key: str, sent: Sent) -> Answer:
    """POST `sent` on a connection of its own (no keep-alive to go stale); the body read to
    its end (a stream to its last event)."""
    headers = {}
    if sent.content_type is not None:
        headers["Content-Type"] = sent.content_type
    if sent.key is not None:
        headers["Authorization"] = f"Bearer {sent.key or server_key}"
    start = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", PATHS[sent.chat], body=sent.body, headers=headers)
        response = connection.getresponse()
        body = response.read()
        kind = response.getheader("content-type", "")
        return Answer(response.status, body, kind, seconds=time.monotonic() - start)
    except (OSError, http.client.HTTPException) as exc:
        return Answer(None, error=repr(exc), seconds=time.monotonic() - start)
    finally:
        connection.close()


def error_problem(data, status: int) -> str | None:
    """What is wrong with an error body, against OpenAI's shape: {"error": {message, type,
    param, code}} (the status as `code`, as vLLM's server sends it)."""
    error = data.get("error") if isinstance(data, dict) else None
    if not (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and "param" in error
        and (error["param"] is None or isinstance(error["param"], str))
        and error.get("code") == status
    ):
        return f"not OpenAI's error shape for {status}: {data!r}"[:600]
    return None


def problem(answer: Answer) -> str | None:
    """Why `answer` breaks the rules, or None: 2xx with a completion (a stream ending with
    [DONE], any error in it a 4xx), or 4xx in OpenAI's error shape."""
    if answer.status is None:
        return f"no answer: {answer.error}"
    if not (200 <= answer.status < 300 or 400 <= answer.status < 499):  # 499: a client gone
        return f"status {answer.status}: {answer.body[:600]!r}"
    try:
        text = answer.body.decode("utf-8")
        if "text/event-stream" in answer.content_type:
            events = [line[len("data: ") :] for line in text.split("\n") if line]
            if not events or events[-1] != "[DONE]":
                return f"a stream that did not end with [DONE]: {text[-600:]!r}"
            for item in events[:-1]:
                data = json.loads(item)
                if not isinstance(data, dict):
                    return f"a stream event that is not an object: {item[:600]!r}"
                if "error" in data:
                    status = data["error"].get("code") if isinstance(data["error"], dict) else None
                    if not isinstance(status, int) or status >= 500:
                        return f"a stream ended with a server error: {item[:600]!r}"
                    return error_problem(data, status)
                if not isinstance(data.get("choices"), list):
                    return f"a stream event without choices: {item[:600]!r}"
            return None
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"status {answer.status}, not JSON: {answer.body[:600]!r}"
    if answer.status >= 400:
        return error_problem(data, answer.status)
    if not (isinstance(data, dict) and isinstance(data.get("choices"), list)):
        return f"status {answer.status} without choices: {text[:600]!r}"
    return None


@dataclass
class Tally:
    """What the fuzzed bodies got: status counts, how long each answer took, the bodies that
    broke the rules (with why)."""

    statuses: Counter = field(default_factory=Counter)
    broken: list[tuple[Sent, str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # each answer's, in the order they came
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def add(self, sent: Sent, answer: Answer) -> None:
        why = problem(answer)
        with self.lock:
            self.statuses[answer.status if answer.status is not None else "none"] += 1
            self.seconds.append(answer.seconds)
            if why is not None:
                self.broken.append((sent, why))

    def report(self) -> str:
        lines = [f"{len(self.broken)} of {self.sent} bodies broke the rules:"]
        lines += [f"  {sent!r}\n    -> {why}" for sent, why in self.broken[:10]]
        return "\n".join(lines)


class Fuzzer:
    """Sends bodies with `CONCURRENCY` in flight (never more than twice that queued), each
    answer checked into `tally`."""

    def __init__(self, port: int, key: str, concurrency: int = CONCURRENCY) -> None:
        self.port, self.key = port, key
        self.tally = Tally()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz")
        self._room = threading.Semaphore(2 * concurrency)
        self._futures: list[Future] = []

    def submit(self, sent: Sent) -> None:
        self._room.acquire()
        future = self._pool.submit(self._one, sent)
        self._futures.append(future)

    def _one(self, sent: Sent) -> None:
        try:
            self.tally.add(sent, send(self.port, self.key, sent))
        finally:
            self._room.release()

    def drain(self) -> Tally:
        for future in self._futures:
            future.result()
        self._pool.shutdown()
        return self.tally


def send_fuzzed(fuzzer: Fuzzer, batches: int, random_seed: int | None = None) -> None:
    """`batches` hypothesis examples of BATCH fuzzed bodies each, handed to `fuzzer`: under
    the loaded profile (CI's draws the same bodies every run), or from `random_seed`."""

    @settings(
        max_examples=batches,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(fuzzed(), min_size=BATCH, max_size=BATCH))
    def batch(bodies: list[Sent]) -> None:
        for sent in bodies:
            fuzzer.submit(sent)

    if random_seed is not None:
        batch = seed(random_seed)(batch)
    batch()


def chosen_bodies() -> list[Sent]:
    """The bodies the issue names, sent every run whatever hypothesis draws."""
    ok = {"prompt": "hello there", "max_tokens": 2}
    talk = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    bodies: list[tuple[bool, object]] = [
        (False, b"{"),
        (False, b'{"prompt": "hi", "max_tokens": 2,}'),
        (True, b""),
        (False, b"[1, 2]"),
        (True, b"null"),
        (False, b'"prompt"'),
        (False, b"\xff\xfe\x00"),
        (False, b'{"prompt": "hi", "temperature": NaN}'),
        (False, b'{"prompt": "hi", "top_p": Infinity}'),
        (True, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}'),
        (False, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"),
        (False, b"[" * 100_000 + b"]" * 100_000),
        (False, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        (False, b'{"prompt": "\\ud800", "max_tokens": 2}'),
        (True, b'{"messages": [{"role": "\\udfff", "content": "hi"}]}'),
        (False, {**ok, "prompt": "a " * 50_000}),
        (True, {**talk, "messages": [{"role": "user", "content": "b " * 50_000}]}),
        (False, {**ok, "max_tokens": 10**30}),
        (False, {**ok, "max_tokens": 10**4299}),
        (False, {**ok, "temperature": 10**400}),
        (False, {**ok, "n": 10**18}),
        (False, {**ok, "logprobs": 10**9}),
        (False, {**ok, "logprobs": -1}),
        (False, {**ok, "seed": 2**200}),
        (False, {**ok, "top_k": -5}),
        (False, {**ok, "stop": [1, None, "", {"a": 1}]}),
        (False, {**ok, "stop": ["a", "b", "c", "d", "e"]}),
        (False, {**ok, "stream": True, "stream_options": {"include_usage": "yes"}}),
        (False, {**ok, "stream": True, "stream_options": [1]}),
        (False, {**ok, "stream_options": {"include_usage": True}}),
        (False, {**ok, "temprature": 0}),
        (True, {**talk, "prompt": "x"}),
        (True, {**talk, "messages": [1, "x", None]}),
        (True, {**talk, "messages": [{"content": "no role"}]}),
        (True, {**talk, "messages": [{"role": "user", "content": 5}]}),
        (True, {**talk, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        (True, {**talk, "messages": [{"role": "assistant", "content": "a"}] * 3}),
        (True, {**talk, "messages": [{"role": "user", "content": "a", "name": [1]}]}),
        (True, {**talk, "max_completion_tokens": 2, "max_tokens": "x"}),
        (True, {**talk, "presence_penalty": True}),
        (True, {**talk, "user": {"id": [1]}}),
        (True, {**talk, "logprobs": True, "top_logprobs": 10**6}),
        (False, {**ok, "echo": True, "logprobs": 2, "stream": True}),
        (False, {**ok, "stream": True, "n": 2, "stream_options": {"include_usage": True}}),
        # found by this fuzzer: a temperature past float32 is inf there, and the masked
        # end tokens' -inf / inf was NaN (a 500); a 400 naming temperature now
        (True, {**talk, "min_tokens": 1, "logprobs": True, "n": 2, "temperature": 1e300}),
        (False, {**ok, "temperature": 3e38, "min_tokens": 1}),  # within float32: it runs
        (False, {**ok, "repetition_penalty": 1e300, "logit_bias": {"5": 1e300}}),
        (False, {**ok, "guided_regex": "(", "min_p": 2}),
        # found by it too: a repetition penalty of 3e-69 is 0 in float32 (x / 0); 1.2e-38 is
        # a number there, and pushes the scores past float32's largest
        (True, {**talk, "logprobs": True, "stream": True, "repetition_penalty": 3.2e-69}),
        (False, {**ok, "repetition_penalty": 1.2e-38, "temperature": 1e-5}),
        # found by it under load: a 50,000-character regex compiled for minutes (no answer
        # within 120 s); a 400 naming the field and the limit now
        (True, {**talk, "max_tokens": 3, "guided_regex": "\u00e9" * 50_000}),
        # found by it under load: a guide complete before max_tokens with ignore_eos chose its
        # end token, which did not end the row, and the automaton failed at the next token
        # (a 500 mid-stream); the row now runs to its limit on the end token. Eight tokens
        # always pass a four-letter guide's end; the original (sampled, streamed) as sent
        (
            False,
            {"prompt": "once", "max_tokens": 8, "ignore_eos": True, "guided_regex": "none"},
        ),
        (
            False,
            {
                "prompt": "once upon a time",
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "guided_regex": "none",
                "seed": 3,
            },
        ),
    ]
    sent = []
    for chat, body in bodies:
        data = body if isinstance(body, bytes) else encode(body)
        sent.append(Sent(chat, data, "application/json"))
    sent.append(Sent(False, encode(ok), "text/plain"))
    sent.append(Sent(True, encode(talk), None))
    sent.append(Sent(False, b"prompt=hi", "application/x-www-form-urlencoded"))
    return sent


# -- innocents -------------------------------------------------------------------------------


class Innocents:
    """Greedy requests that run while the fuzzing does, each kind in a thread of its own, over
    and over: completions, streamed completions and chat. `texts[(kind, prompt)]` is every
    text each got; `problems` every answer that was not a 200 with a text."""

    KINDS = ("completion", "stream", "chat")

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self.texts: dict[tuple[str, str], list[str]] = {}
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in self.KINDS
        ]

    def __enter__(self) -> Innocents:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 10)

    def rounds(self) -> int:
        """The fewest requests any (kind, prompt) has had."""
        counts = [len(self.texts.get((k, p), ())) for k in self.KINDS for p in INNOCENT_PROMPTS]
        return min(counts)

    def _loop(self, kind: str) -> None:
        while True:  # each kind at least once per prompt, however fast the fuzzing ends
            for prompt in INNOCENT_PROMPTS:
                try:
                    self._one(kind, prompt)
                except Exception as exc:  # an answer it cannot read: said, not a dead thread
                    self.problems.append(f"{kind} {prompt!r}: {exc!r}")
            if self._stop.is_set():
                return

    def _one(self, kind: str, prompt: str) -> None:
        body: dict = {"max_tokens": INNOCENT_TOKENS, "temperature": 0, "model": MODEL}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if kind == "stream":
            body["stream"] = True
        answer = send(self.port, self.key, Sent(kind == "chat", encode(body), "application/json"))
        why = problem(answer)
        if why is None and answer.status != 200:
            why = f"status {answer.status}: {answer.body[:300]!r}"
        if why is not None:
            self.problems.append(f"{kind} {prompt!r}: {why}")
            return
        if kind == "stream":
            events = answer.body.decode().split("\n")
            chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        else:
            choice = json.loads(answer.body)["choices"][0]
            text = choice["message"]["content"] if kind == "chat" else choice["text"]
        self.texts.setdefault((kind, prompt), []).append(text)


def expected_texts(checkpoint: str) -> dict[tuple[str, str], str]:
    """transformers' greedy text of each innocent request, alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    out = {}
    for prompt in INNOCENT_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out["completion", prompt] = out["stream", prompt] = greedy_text(
            checkpoint, tokenizer, ids, INNOCENT_TOKENS
        )
        chat_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        out["chat", prompt] = greedy_text(checkpoint, tokenizer, chat_ids, INNOCENT_TOKENS)
    return out


def health(base: str) -> int:
    """GET /health's status."""
    try:
        with urllib.request.urlopen(f"{base.removesuffix('/v1')}/health", timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """One server for the module (its start is most of the module's time)."""
    with serving(tmp_path_factory.mktemp("fuzz"), *SERVE_FLAGS) as server:
        yield server


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1].split("/")[0])


def test_fuzzed_bodies_get_2xx_or_a_4xx_in_openai_shape_and_never_harm_innocents(
    fuzz_server,
) -> None:
    """The issue's bodies and at least MIN_BODIES drawn ones, CONCURRENCY in flight, while
    innocent greedy requests run: no 5xx, no dropped connection, 4xx in OpenAI's shape, 2xx
    completions (streams to their [DONE]); every innocent text transformers' alone; /health
    200 afterwards."""
    base, key = fuzz_server.base, fuzz_server.key
    expected = expected_texts(fuzz_server.checkpoint)
    fuzzer = Fuzzer(port_of(base), key)
    start = time.monotonic()
    with Innocents(port_of(base), key) as innocents:
        for sent in chosen_bodies():
            fuzzer.submit(sent)
        send_fuzzed(fuzzer, batches=math.ceil(MIN_BODIES / BATCH))
        tally = fuzzer.drain()
    seconds = time.monotonic() - start
    print(
        f"{tally.sent} bodies in {seconds:.1f} s ({tally.sent / seconds:.0f}/s), statuses "
        f"{dict(sorted(tally.statuses.items(), key=str))}, slowest {max(tally.seconds):.2f} s; "
        f"innocent rounds {innocents.rounds()}"
    )
    assert not tally.broken, f"{tally.report()}\nthe server's logs:\n{fuzz_server.errors()}"
    assert tally.sent >= MIN_BODIES
    # the fuzzing reached both sides: bodies that ran and bodies refused
    assert tally.statuses[200] >= tally.sent // 50 and tally.statuses[400] >= tally.sent // 2
    assert not innocents.problems, innocents.problems[:10]
    assert innocents.rounds() >= 1
    for what, texts in innocents.texts.items():
        assert set(texts) == {expected[what]}, (what, Counter(texts), expected[what])
    assert health(base) == 200


# Chat templates of other families than the tiny checkpoint's ChatML: ones that raise on roles
# out of turn (Mistral's, Gemma's, as published) and one that reads content parts (Llama 4's).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
PARTS = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'text' %}"
    "{{ content['text'] | trim }}{% endif %}{% endfor %}{% endif %}{{ '<|eot|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """The tiny checkpoint's tokenizer (ChatML) and copies with the templates above."""
    from transformers import AutoTokenizer

    from coordinator.tools.tiny_tokenizer import write_tokenizer

    root = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(root, vocab_size=512, max_positions=256)
    out = {}
    for name, template in (
        ("chatml", None),
        ("mistral", MISTRAL),
        ("gemma", GEMMA),
        ("parts", PARTS),
    ):
        tokenizer = AutoTokenizer.from_pretrained(root)
        if template is not None:
            tokenizer.chat_template = template
        out[name] = tokenizer
    return out


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    template=st.sampled_from(["chatml", "mistral", "gemma", "parts"]),
    messages=messages_strategy(),
    opened=st.booleans(),
)
def test_junk_messages_through_chat_templates_get_ids_or_a_4xx_naming_them(
    tokenizers, template, messages, opened
) -> None:
    """What the server does with `messages` before the engine (serving/app.py: the text check,
    `chat_messages`, the template): ids, or an error whose kind is a 4xx naming the messages,
    whichever template the checkpoint brings, one that raises on turns out of order too."""
    from coordinator.serving.app import chat_messages, check_text, status_of
    from coordinator.serving.text import prompt_ids
    from offload.errors import OffloadCoordinatorError

    tokenizer = tokenizers[template]
    try:
        check_text({"messages": messages})
        ids = prompt_ids(
            tokenizer, messages=chat_messages(messages, tokenizer), add_generation_prompt=opened
        )
    except OffloadCoordinatorError as exc:
        status, _ = status_of(exc)
        param = getattr(exc, "param", None)
        event(f"refused: {type(exc).__name__} {re.sub(r'[0-9]+', 'i', str(param))}")
        assert 400 <= status < 500, exc
        assert param is None or param.startswith("messages"), (param, exc)
    else:
        event(f"ids ({template})")
        assert ids.shape[0] == 1 and ids.shape[1] >= 1


def test_the_bodies_are_what_the_server_reads() -> None:
    """The encoder writes what Python's json reads back: raw literals as they are, lone
    surrogates as escapes or as `surrogatepass` bytes."""
    value = {"a": Raw("NaN"), "b": [Raw("-Infinity")], "c": "\ud800", "d": 1.5}
    for ascii_only in (True, False):
        back = json.loads(encode(value, ascii_only=ascii_only))
        assert math.isnan(back["a"]) and back["b"] == [-math.inf]
        assert back["c"] == "\ud800" and back["d"] == 1.5
        with pytest.raises(ValueError, match="4300 digits"):  # past Python's limit, as meant
            json.loads(encode({"e": Raw("9" * 4301)}, ascii_only=ascii_only))
