"""A load's one engine as its clients reach it, from this process or any other.

`EngineHost` sits beside the `Engine` (in the driver for an unnamed job, in the load's keeper
actor for a named load): requests by id, and per client an outbox the engine's thread only
appends to (a token, a request ended). `EngineClient` is what a client holds (`Job.engine()`):
it submits and cancels through the host and one thread of its own fetches the client's outbox
(a bounded long poll) and calls the request's callbacks. So the engine's thread never runs a
client's code (detokenising, an event loop's hand-off), and any number of processes can
generate on one load at once: every one of them goes through the same queue and KV pool.

A client that stops asking for its tokens (its process died, say) for `CLIENT_LEASE_S` while
it has requests in flight is gone: its requests are cancelled and their slots freed.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.engine.engine import Engine
from coordinator.engine.sequences import Finish, Request
from offload.errors import LaunchError
from worker.steps import Logprobs

POLL_WAIT_S = 1.0  # how long one fetch of a client's outbox waits for something to come
CLIENT_LEASE_S = 30.0  # a client with requests in flight that has not fetched for this long is gone
CALL_TIMEOUT_S = 60.0  # a call to the host (submit, cancel, stats) from another process


@dataclass
class Delivery:
    """What a client's fetch returns: tokens (request id, row, token, the log-probabilities
    that came with it: the prompt's before a first token, the token's) in the order they came,
    and the requests that ended since (request id, each row's finish reason, the error)."""

    tokens: list[tuple[int, int, int, tuple[Logprobs, ...]]] = field(default_factory=list)
    ended: list[tuple[int, list[str], BaseException | None]] = field(default_factory=list)


@dataclass
class _Client:
    outbox: Delivery = field(default_factory=Delivery)
    open: set[int] = field(default_factory=set)  # its requests not ended yet
    seen_s: float = field(default_factory=time.monotonic)  # when it last fetched
    fetching: int = 0  # fetches waiting now: the client is there


class EngineHost:
    def __init__(self, engine: Engine, *, lease_s: float = CLIENT_LEASE_S) -> None:
        self.engine, self.lease_s = engine, lease_s
        self._cond = threading.Condition()
        self._clients: dict[str, _Client] = {}
        self._requests: dict[tuple[str, int], Request] = {}
        # (client, request, row) -> the log-probabilities of the token about to come
        self._scores: dict[tuple[str, int, int], list[Logprobs]] = {}
        self._closed = False
        threading.Thread(target=self._reap, daemon=True, name="offload-engine-leases").start()

    def submit(
        self,
        client: str,
        rid: int,
        prompts: list[list[int]],
        *,
        sampling,
        max_new_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        seed: int | None = None,
        **scoring,
    ) -> None:
        """Queue request `rid` (the client numbers its own) of `client`. Raises what
        `Engine.submit` refuses. `scoring`: min_new_tokens, logprobs, prompt_logprobs."""
        key = (client, rid)
        with self._cond:
            box = self._clients.setdefault(client, _Client())
            box.seen_s = time.monotonic()
            box.open.add(rid)
        try:
            request = self.engine.submit(
                prompts,
                sampling=sampling,
                max_new_tokens=max_new_tokens,
                eos_token_ids=eos_token_ids,
                seed=seed,
                on_token=lambda row, token: self._token(client, rid, row, token),
                on_finish=lambda: self._ended(key),
                on_logprobs=lambda row, scores: self._scores.setdefault(
                    (client, rid, row), []
                ).append(scores),
                **scoring,
            )
        except BaseException:
            with self._cond:
                box.open.discard(rid)
            raise
        with self._cond:
            self._requests[key] = request
        if request.done():  # it may have ended before it was recorded (nothing to generate)
            self._ended(key)

    def cancel(self, client: str, rid: int) -> None:
        with self._cond:
            request = self._requests.get((client, rid))
        if request is not None:
            self.engine.cancel(request)

    def fetch(self, client: str, wait_s: float = POLL_WAIT_S) -> Delivery:
        """What came for `client` since its last fetch, waiting up to `wait_s` for something."""
        deadline = time.monotonic() + min(wait_s, POLL_WAIT_S * 10)
        with self._cond:
            box = self._clients.setdefault(client, _Client())
            box.fetching += 1
            try:
                while not (box.outbox.tokens or box.outbox.ended) and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                box.fetching -= 1
            box.seen_s = time.monotonic()
            out, box.outbox = box.outbox, Delivery()
            if not box.open:
                del self._clients[client]
            return out

    def stats(self) -> dict:
        return self.engine.stats.snapshot()

    def prometheus(self, model_name: str) -> str:
        return self.engine.stats.prometheus(model_name)

    def close(self) -> None:
        self.engine.close()  # every request not finished ends (and its client hears it)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # from the engine's thread: appends only
    def _token(self, client: str, rid: int, row: int, token: int) -> None:
        scores = tuple(self._scores.pop((client, rid, row), ()))  # this thread's, just before
        with self._cond:
            box = self._clients.get(client)
            if box is not None:
                box.outbox.tokens.append((rid, row, token, scores))
                self._cond.notify_all()

    def _ended(self, key: tuple[str, int]) -> None:
        """Tell the client its request ended: once (from the engine's thread, or from `submit`
        for a request that ended before it was recorded)."""
        client, rid = key
        with self._cond:
            request = self._requests.get(key)
            box = self._clients.get(client)
            if request is None or box is None or rid not in box.open:
                return  # not recorded yet (submit tells), or told already
            del self._requests[key]
            box.open.discard(rid)
            for row in range(len(request.sequences)):  # a token's that never came
                self._scores.pop((client, rid, row), None)
            reasons = [s.finish.value for s in request.sequences]
            box.outbox.ended.append((rid, reasons, _portable(request.error)))
            self._cond.notify_all()

    def _reap(self) -> None:
        """Cancel the requests of clients gone silent (their process died mid-request)."""
        while not self._closed:
            time.sleep(self.lease_s / 4)
            now = time.monotonic()
            with self._cond:
                gone = [
                    (name, box)
                    for name, box in self._clients.items()
                    if box.open and not box.fetching and now - box.seen_s > self.lease_s
                ]
                requests = [
                    self._requests.get((name, rid)) for name, box in gone for rid in box.open
                ]
            for request in requests:
                if request is not None:
                    self.engine.cancel(request)


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` as it can cross to another process (its own type when it pickles)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return LaunchError(f"{type(error).__name__}: {error}")
    return error


class EngineClient:
    """A client of a load's engine (`Job.engine()`): `submit` returns a `Request` to wait on,
    whose callbacks run on this client's fetch thread (never on the engine's). `call(method,
    *args, **kwargs)` reaches the host: directly in process, or through Ray."""

    def __init__(self, call: Callable, *, local: Engine | None = None) -> None:
        self._call = call
        self.local = local  # the engine itself when it runs in this process (tests)
        self.id = f"client-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests: dict[int, Request] = {}
        self._fetcher: threading.Thread | None = None
        self._closed = False

    def submit(
        self,
        prompts: list[list[int]],
        *,
        sampling,
        max_new_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        seed: int | None = None,
        on_token: Callable[[int, int], None] | None = None,
        on_finish: Callable[[], None] | None = None,
        on_logprobs: Callable[[int, Logprobs], None] | None = None,
        **scoring,
    ) -> Request:
        """`Engine.submit`'s arguments; `on_logprobs(row, Logprobs)` is called just before
        `on_token` with those that came with the token (scoring: min_new_tokens, logprobs,
        prompt_logprobs)."""
        request = Request.of(
            prompts,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
            on_token=on_token,
            on_finish=on_finish,
            on_logprobs=on_logprobs,
            **scoring,
        )
        request.id = rid = next(self._ids)
        with self._lock:  # known before its first token can come
            if self._closed:
                raise LaunchError("this client of the engine is closed")
            self._requests[rid] = request
        try:
            self._call(
                "submit",
                self.id,
                rid,
                prompts,
                sampling=sampling,
                max_new_tokens=max_new_tokens,
                eos_token_ids=tuple(eos_token_ids),
                seed=seed,
                **scoring,
            )
        except BaseException:
            with self._lock:
                self._requests.pop(rid, None)
            raise
        with self._lock:
            if self._fetcher is None and rid in self._requests:
                self._fetcher = threading.Thread(
                    target=self._fetch_loop, daemon=True, name="offload-engine-client"
                )
                self._fetcher.start()
        return request

    def cancel(self, request: Request) -> None:
        if not request.done():
            self._call("cancel", self.id, request.id)

    def snapshot(self) -> dict:
        return self._call("stats")

    def prometheus(self, model_name: str) -> str:
        return self._call("prometheus", model_name)

    def drain(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until every request of this client has heard its end."""
        fetcher = self._fetcher
        if fetcher is not None:
            fetcher.join(timeout_s)

    def close(self) -> None:
        """Stop: requests still in flight are cancelled at the engine and end here with an
        error."""
        with self._lock:
            self._closed = True
            open_requests, self._requests = list(self._requests.values()), {}
        for request in open_requests:
            with contextlib.suppress(Exception):  # the engine may be gone: nothing to free
                self._call("cancel", self.id, request.id)
            self._end(request, None, LaunchError("the client of the engine was closed"))

    def _fetch_loop(self) -> None:
        while True:
            with self._lock:
                if not self._requests:
                    self._fetcher = None
                    return
            try:
                delivery = self._call("fetch", self.id, POLL_WAIT_S)
            except Exception as exc:  # the engine is gone: every open request ends with it
                with self._lock:
                    requests, self._requests = list(self._requests.values()), {}
                    self._fetcher = None
                for request in requests:
                    self._end(request, None, exc)
                return
            self._apply(delivery)

    def _apply(self, delivery: Delivery) -> None:
        with self._lock:
            requests = dict(self._requests)
        for rid, row, token, scores in delivery.tokens:
            request = requests.get(rid)
            if request is None:
                continue
            request.sequences[row].generated.append(token)
            seq = request.sequences[row]
            seq.logprobs.extend(s for s in scores if s.start >= len(seq.prompt))  # not the prompt's
            if request.first_token_s is None:
                request.first_token_s = time.perf_counter()
            if request.on_token is not None and request.error is None:
                try:
                    if request.on_logprobs is not None:
                        for one in scores:
                            request.on_logprobs(row, one)
                    request.on_token(row, token)
                except Exception as exc:  # the client's own callback: its request ends
                    request.error = exc
                    self._call("cancel", self.id, rid)
        for rid, reasons, error in delivery.ended:
            with self._lock:
                request = self._requests.pop(rid, None)
            if request is not None:
                self._end(request, reasons, error)

    @staticmethod
    def _end(request: Request, reasons: list[str] | None, error: BaseException | None) -> None:
        for seq, reason in zip(request.sequences, reasons or [], strict=False):
            seq.finish = Finish(reason)
        for seq in request.sequences:
            if seq.finish is None:
                seq.finish = Finish.ERROR
        request.error = request.error or error
        request.end()
