"""A load's one engine as its clients reach it, from this process or any other.

`EngineHost` sits beside the `Engine` (in the driver for an unnamed job, in the load's keeper
actor for a named load): requests by id, and per client an outbox the engine's thread only
appends to (a token, a request ended). `EngineClient` is what a client holds (`Job.engine()`):
it submits and cancels through the host and one thread of its own fetches the client's outbox
(a bounded long poll) and calls the request's callbacks. So the engine's thread never runs a
client's code (detokenising, an event loop's hand-off), and any number of processes can
generate on one load at once: every one of them goes through the same queue and KV pool.

A client that stops asking for its tokens (its process died, say) for `CLIENT_LEASE_S` is
gone: its requests are cancelled and their slots freed, and once they have ended its outbox
goes too. Each client waits on a condition of its own, so a token wakes only its client.

An engine whose loop ends on an error (`EngineStoppedError`) has already ended every request
it held with that error, and refuses submits with it; the host then starts a new engine
(`rebuild`, a new claim of the workers: a new epoch) after `ENGINE_RESTART_DELAY_S`, doubling
while one does not start (its workers are being recovered, say), and the load answers again.
After `ENGINE_RESTART_LIMIT` loops ended within `ENGINE_RESTART_WINDOW_S`, or no new engine
started within `ENGINE_START_LIMIT_S`, it stops trying: the load is failed (`health`,
`on_failed`), and says so to every submit. The stats count it all (`engine_failures`, `engine_restarts`, `engine_state`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.engine.engine import Engine, EngineStoppedError
from coordinator.engine.sequences import Finish, Request
from coordinator.engine.stats import EngineStats
from offload.errors import LaunchError
from worker.steps import Logprobs

logger = logging.getLogger(__name__)

POLL_WAIT_S = 1.0  # how long one fetch of a client's outbox waits for something to come
CLIENT_LEASE_S = 30.0  # a client that has not fetched for this long is gone
CALL_TIMEOUT_S = 60.0  # a call to the host (submit, cancel, stats) from another process
ENGINE_RESTART_DELAY_S = 1.0  # before the first new engine after a failure; doubles per try
ENGINE_RESTART_LIMIT = 3  # loops ended on an error ...
ENGINE_RESTART_WINDOW_S = 600.0  # ... within this long: the load is failed
# A new engine that does not start (its workers are being recovered, say) is tried again, the
# delay doubling up to ENGINE_RESTART_MAX_DELAY_S, for at most this long: then the load is failed
ENGINE_START_LIMIT_S = 600.0
ENGINE_RESTART_MAX_DELAY_S = 30.0


@dataclass
class Delivery:
    """What a client's fetch returns: tokens (request id, row, token, the log-probabilities
    that came with it: the prompt's before a first token, the token's) in the order they came,
    and the requests that ended since (request id, each row's finish reason, the error)."""

    tokens: list[tuple[int, int, int, tuple[Logprobs, ...]]] = field(default_factory=list)
    ended: list[tuple[int, list[str], BaseException | None]] = field(default_factory=list)


@dataclass
class _Client:
    wake: threading.Condition  # on the host's lock: notified for this client's news only
    outbox: Delivery = field(default_factory=Delivery)
    open: set[int] = field(default_factory=set)  # its requests not ended yet
    seen_s: float = field(default_factory=time.monotonic)  # when it last fetched
    fetching: int = 0  # fetches waiting now: the client is there


class EngineHost:
    def __init__(
        self,
        engine: Engine,
        *,
        lease_s: float = CLIENT_LEASE_S,
        rebuild: Callable[[EngineStats], Engine] | None = None,
        on_failed: Callable[[str], None] | None = None,
        restart_delay_s: float = ENGINE_RESTART_DELAY_S,
    ) -> None:
        """`rebuild(stats)`: a new engine of the load, counting on `stats` (it takes the
        workers over from the one that stopped); None: a stopped engine is not replaced.
        `on_failed(why)`: the load is failed (no more restarts)."""
        self.engine, self.lease_s = engine, lease_s
        self._rebuild, self._on_failed = rebuild, on_failed
        self._restart_delay_s = restart_delay_s
        self._lock = threading.Lock()
        self._clients: dict[str, _Client] = {}
        self._requests: dict[tuple[str, int], Request] = {}
        # (client, request, row) -> the log-probabilities of the token about to come
        self._scores: dict[tuple[str, int, int], list[Logprobs]] = {}
        self._failures: list[float] = []  # when engines stopped (or failed to start)
        self._closed = False
        self._watch(engine)
        threading.Thread(target=self._reap, daemon=True, name="offload-engine-leases").start()

    def _client(self, name: str) -> _Client:
        """`name`'s box, made on first sight (holding the lock)."""
        box = self._clients.get(name)
        if box is None:
            box = self._clients[name] = _Client(threading.Condition(self._lock))
        return box

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
        with self._lock:
            box = self._client(client)
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
            with self._lock:
                box.open.discard(rid)
            raise
        with self._lock:
            self._requests[key] = request
        if request.done():  # it may have ended before it was recorded (nothing to generate)
            self._ended(key)

    def cancel(self, client: str, rid: int) -> None:
        with self._lock:
            request = self._requests.get((client, rid))
        if request is not None:
            self.engine.cancel(request)

    def fetch(self, client: str, wait_s: float = POLL_WAIT_S) -> Delivery:
        """What came for `client` since its last fetch, waiting up to `wait_s` for something."""
        deadline = time.monotonic() + min(wait_s, POLL_WAIT_S * 10)
        with self._lock:
            box = self._client(client)
            box.fetching += 1
            try:
                while not (box.outbox.tokens or box.outbox.ended) and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    box.wake.wait(left)
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

    def health(self) -> str | None:
        """None while the load's engine serves; else why not (restarting, or failed)."""
        stats = self.engine.stats
        if stats.engine_state == "serving":
            return None
        if stats.engine_state == "restarting":
            return f"the load's engine stopped and a new one is starting: {stats.engine_stopped}"
        return f"the load's engine failed, it serves no more: {stats.engine_stopped}"

    def close(self) -> None:
        with self._lock:
            self._closed = True  # no new engine from now on
        self.engine.close()  # every request not finished ends (and its client hears it)
        with self._lock:
            for box in self._clients.values():
                box.wake.notify_all()

    # the engine's loop ended on an error: a new engine, within bounds
    def _watch(self, engine: Engine) -> None:
        engine.on_stopped = lambda error: self._stopped(engine, error)
        if engine.failure is not None:  # it stopped before it was watched
            self._stopped(engine, engine.failure)

    def _stopped(self, engine: Engine, error: EngineStoppedError) -> None:
        """`engine` stopped (from its own thread, or `_watch`): count it, and start a new one
        on a thread of its own, unless the failures are past the limit."""
        with self._lock:
            stats = engine.stats
            if engine is not self.engine or stats.engine_state != "serving" or self._closed:
                return  # heard already, or closing
            stats.engine_failures += 1
            stats.engine_stopped = str(error)
            giving_up = self._count_failure()
            stats.engine_state = "failed" if giving_up else "restarting"
        if giving_up:
            self._give_up(stats)
            return
        threading.Thread(target=self._restart, daemon=True, name="offload-engine-restart").start()

    def _count_failure(self) -> bool:
        """One more failure now; True when that makes too many (holding the lock)."""
        now = time.monotonic()
        self._failures = [t for t in self._failures if now - t < ENGINE_RESTART_WINDOW_S]
        self._failures.append(now)
        return self._rebuild is None or len(self._failures) >= ENGINE_RESTART_LIMIT

    def _give_up(self, stats: EngineStats) -> None:
        if self._on_failed is not None:
            with contextlib.suppress(Exception):  # a record to write: never the host's end
                self._on_failed(stats.engine_stopped)

    def _restart(self) -> None:
        """Start a new engine (a new claim of the workers), waiting a little more before each
        try; give up past the limit."""
        stats = self.engine.stats
        delay = self._restart_delay_s
        deadline = time.monotonic() + ENGINE_START_LIMIT_S
        while True:
            time.sleep(delay)
            if self._closed:
                return
            try:
                engine = self._rebuild(stats)
            except Exception as exc:  # the workers lost meanwhile, say: try again, later
                giving_up = time.monotonic() + delay > deadline
                with self._lock:
                    stats.engine_stopped = f"a new engine did not start: {exc}"
                    if giving_up:
                        stats.engine_state = "failed"
                if giving_up:
                    self._give_up(stats)
                    return
                delay = min(delay * 2, ENGINE_RESTART_MAX_DELAY_S)
                continue
            with self._lock:
                closed = self._closed
                if not closed:
                    self.engine = engine
                    stats.engine_restarts += 1
                    stats.engine_state = "serving"
            if closed:
                engine.close()
                return
            self._watch(engine)
            return

    # from the engine's thread: appends only
    def _token(self, client: str, rid: int, row: int, token: int) -> None:
        scores = tuple(self._scores.pop((client, rid, row), ()))  # this thread's, just before
        with self._lock:
            box = self._clients.get(client)
            if box is not None:
                box.outbox.tokens.append((rid, row, token, scores))
                box.wake.notify()

    def _ended(self, key: tuple[str, int]) -> None:
        """Tell the client its request ended: once (from the engine's thread, or from `submit`
        for a request that ended before it was recorded)."""
        client, rid = key
        with self._lock:
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
            box.wake.notify()

    def _reap(self) -> None:
        """Cancel the requests of clients gone silent (their process died mid-request), and
        drop the outbox of such a client once they have ended (nobody will fetch it)."""
        while not self._closed:
            time.sleep(self.lease_s / 4)
            now = time.monotonic()
            with self._lock:
                gone = [
                    (name, box)
                    for name, box in self._clients.items()
                    if not box.fetching and now - box.seen_s > self.lease_s
                ]
                for name, box in gone:
                    if not box.open:
                        del self._clients[name]
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

    def __init__(self, call: Callable, *, host: EngineHost | None = None) -> None:
        self._call = call
        self._host = host  # the host when it runs in this process (tests read its engine)
        self.id = f"client-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests: dict[int, Request] = {}
        self._fetcher: threading.Thread | None = None
        self._closed = False

    @property
    def local(self) -> Engine | None:
        """The engine itself when it runs in this process (the one running now)."""
        return self._host.engine if self._host is not None else None

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

    def health(self) -> str | None:
        """None while the load's engine serves; else why not."""
        return self._call("health")

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
                self._apply(self._call("fetch", self.id, POLL_WAIT_S))
            except Exception as exc:  # the engine is gone: every open request ends with it
                with self._lock:
                    requests, self._requests = list(self._requests.values()), {}
                    self._fetcher = None
                for request in requests:
                    self._end(request, None, exc)
                return

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
                    try:
                        self._call("cancel", self.id, rid)
                    except Exception as gone:  # it runs on; the next fetch says if all is gone
                        logger.warning("request %s: its cancel failed (%s)", rid, gone)
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
