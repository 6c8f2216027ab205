"""The engine host's contract (`coordinator.engine.host`) where test_engine_host.py and
test_request_harm.py leave it open (found by mutation testing, issue 60): what a client's
request carries to the last stage and back (rows, end tokens, seeds, scoring, log-probabilities,
on_finish), a client's cancel, close and drain, a call to the host that fails, the lease and the
long poll, and how stops and new engines are counted and timed.

Ordered by events only: gates the test holds, threads joined, and for the lease, the long poll
and the restart delays a clock the test moves (`Clock`, the host module's `time`), never by
sleeps. `ScriptedEngine` stands in for the engine where the test plays the engine's thread."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time

import pytest
from test_engine import GREEDY, WAIT_S, FakePipeline, expected

import coordinator.engine.host as host_module
from coordinator.engine import Engine, EngineConfig, Finish, QueueFullError
from coordinator.engine.engine import EngineClosedError, EngineStoppedError
from coordinator.engine.host import Delivery, EngineClient, EngineHost, _Client
from coordinator.engine.sequences import Request
from coordinator.engine.stats import EngineStats
from coordinator.runtime.errors import WorkerLostError
from offload.errors import ConfigError, LaunchError, NeverFitsError
from worker.steps import Chosen, Logprobs, Sampling

CONFIG = EngineConfig(num_slots=2, max_seq_len=64, burst_steps=1)


# --- stand-ins and helpers ----------------------------------------------------------------------


class LastStage(FakePipeline):
    """The stand-in pipeline, one step per call, whose last stage keeps the settings each new
    sequence brings (`settings`) and, with `scores`, answers with log-probabilities as a real
    last stage does (`Chosen`): of each chosen token, and of a prompt fed whole. What it made
    is kept per prompt (`scored`, in order); a prompt starting with a token in `withhold`
    gets its prompt's but never its tokens'."""

    def __init__(self, scores: bool = False) -> None:
        super().__init__()
        self.scores = scores
        self.settings = []
        self.scored: dict[tuple[int, ...], list[Logprobs]] = {}
        self.withhold: set[int] = set()

    def submit(self, steps):
        for step in steps:
            self.settings.extend(settings for _, settings in step.draw.settings)
        handle = super().submit(steps)
        if not self.scores:
            return handle
        [step] = steps  # burst_steps=1, one stage: one step, run once
        [(m, tokens)] = list(handle.outputs)
        chosen, prompt = {}, {}
        for r, seq in enumerate(step.sequences):
            start, count = step.rows.starts[r], step.rows.counts[r]
            made = self.scored.setdefault(tuple(seq.prompt), [])
            if start == 0 and count == len(seq.prompt) > 1:
                prompt[r] = scores_of(1, seq.prompt[1:])
                made.append(prompt[r])
            if step.draw.choose[r] and seq.prompt[0] not in self.withhold:
                chosen[r] = scores_of(start + count, [int(tokens[r])])
                made.append(chosen[r])
        return type(handle)([(m, Chosen(tokens=tokens, chosen=chosen, prompt=prompt))])


def scores_of(start: int, ids: list[int]) -> Logprobs:
    values = tuple(-(start + i) / 8 for i in range(len(ids)))
    return Logprobs(
        start=start,
        token_ids=tuple(ids),
        logprobs=values,
        top_ids=tuple((t,) for t in ids),
        top_logprobs=tuple((v,) for v in values),
    )


class ScriptedEngine:
    """Stands in for the load's `Engine` where the test plays the engine's thread: `submit`
    keeps the request it makes, with the host's callbacks, which the test calls as that thread
    would (`end`); `cancel` records."""

    def __init__(self) -> None:
        self.stats = EngineStats(num_slots=1)
        self.failure = None
        self.on_stopped = None
        self.submitted: list[Request] = []
        self.cancelled: list[Request] = []

    def submit(self, prompts, *, sampling, max_new_tokens, eos_token_ids=(), seed=None, **rest):
        request = Request.of(prompts, sampling=sampling, max_new_tokens=max_new_tokens, **rest)
        self.submitted.append(request)
        return request

    def cancel(self, request: Request) -> None:
        self.cancelled.append(request)

    def close(self) -> None:
        pass


def end(request: Request, reason: Finish) -> None:
    """The engine's thread ends `request` (its host hears it through on_finish)."""
    for seq in request.sequences:
        seq.finish = reason
    request.end()


class Clock:
    """The host module's `time` in a test (monkeypatched): `monotonic()` is what the test set
    (`to`); `sleep(s)` returns once the test has moved the clock `s` on (or on `release`);
    `perf_counter` is the real one."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.cond = threading.Condition()
        self.asleep: dict[threading.Thread, float] = {}  # a sleeping thread -> when it wakes
        self.slept: list[tuple[threading.Thread, float]] = []
        self.released = False

    def monotonic(self) -> float:
        with self.cond:
            return self.now

    def sleep(self, seconds: float) -> None:
        me = threading.current_thread()
        with self.cond:
            self.slept.append((me, seconds))
            self.asleep[me] = wake = self.now + seconds
            self.cond.notify_all()
            while self.now < wake and not self.released:
                self.cond.wait()
            del self.asleep[me]
            self.cond.notify_all()

    def to(self, now: float) -> None:
        with self.cond:
            self.now = now
            self.cond.notify_all()

    def poke(self) -> None:
        """Something `until` waits for changed."""
        with self.cond:
            self.cond.notify_all()

    def until(self, condition, what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(condition, WAIT_S), what

    def sleeping_on(self, thread: threading.Thread) -> bool:
        """`thread` sleeps until after now (it did everything due up to now)."""
        return self.asleep.get(thread, self.now) > self.now

    def release(self) -> None:
        with self.cond:
            self.released = True
            self.cond.notify_all()


@pytest.fixture
def clock(monkeypatch):
    """The host module's time is a `Clock`; a host thread that dies on an error is recorded
    (`clock.crashes`)."""
    made = Clock()
    made.crashes = []

    def crashed(args) -> None:
        made.crashes.append(args.exc_value)
        made.poke()

    monkeypatch.setattr(host_module, "time", made)
    monkeypatch.setattr(threading, "excepthook", crashed)
    yield made
    made.release()


def reaper_of(clock: Clock) -> threading.Thread:
    """The host's lease thread, the one thread asleep on the clock just after it was made."""
    clock.until(lambda: clock.asleep, "the lease thread never slept")
    [reaper] = clock.asleep
    return reaper


def scan(clock: Clock, reaper: threading.Thread, now: float) -> None:
    """Move the clock to `now` and wait until the lease thread has done what was due by then."""
    clock.to(now)
    clock.until(
        lambda: clock.crashes or not reaper.is_alive() or clock.sleeping_on(reaper),
        "the lease thread never slept again",
    )
    assert clock.crashes == [] and reaper.is_alive()


class Watched(threading.Condition):
    """A client's wake-up condition (on the host's lock) that counts the waits on it."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.waits = 0
        self.seen = threading.Condition()

    def wait(self, timeout=None):
        with self.seen:
            self.waits += 1
            self.seen.notify_all()
        return super().wait(timeout)

    def until(self, condition, what: str) -> None:
        with self.seen:
            assert self.seen.wait_for(condition, WAIT_S), what


def fetching(host: EngineHost, client: str, wait_s: float, wake: Watched, out: list):
    """A thread fetching `client`'s news into `out` (its return tells `wake`'s watchers)."""

    def fetch() -> None:
        try:
            out.append(host.fetch(client, wait_s))
        finally:
            with wake.seen:
                wake.seen.notify_all()

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def hosted():
    """`make(pipeline=None, **host_options)`: a host over an engine on the stand-in pipeline
    (two slots, one step per call); gates opened and hosts closed at the end."""
    made = []

    def make(pipeline=None, **host_options):
        pipeline = pipeline or FakePipeline()
        host = EngineHost(Engine(pipeline, CONFIG), **host_options)
        made.append((host, pipeline))
        return host, pipeline

    yield make
    for host, pipeline in made:
        pipeline.gate.set()
        host.close()


def client_of(host: EngineHost, before=None) -> EngineClient:
    """A client reaching `host` in this process; `before(method)` runs first on every call
    (a gate, or the call failing)."""

    def call(method, *args, **kwargs):
        if before is not None:
            before(method)
        return getattr(host, method)(*args, **kwargs)

    return EngineClient(call, host=host)


def watch(engine: Engine) -> tuple[list[Request], list[Request]]:
    """The requests `engine` made for submits, and those it was told to cancel, as they come."""
    made, cancelled = [], []
    submit, cancel = engine.submit, engine.cancel

    def watched_submit(*args, **kwargs) -> Request:
        request = submit(*args, **kwargs)
        made.append(request)
        return request

    def watched_cancel(request: Request) -> None:
        cancelled.append(request)
        cancel(request)

    engine.submit, engine.cancel = watched_submit, watched_cancel
    return made, cancelled


@contextlib.contextmanager
def set_when_joining(event: threading.Event):
    """Set `event` as soon as this thread calls `Thread.join` (it then waits on a thread)."""

    def profile(frame, what, arg) -> None:
        if what == "call" and frame.f_code is threading.Thread.join.__code__:
            event.set()

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


def stop_loop(engine: Engine, why: str) -> None:
    """A bug in `engine`'s loop (its next plan of a step raises): it stops at the next request,
    which ends with it."""

    def broken(group: int):
        raise RuntimeError(why)

    engine.scheduler.plan = broken
    request = engine.submit([[3, 4]], sampling=GREEDY, max_new_tokens=2)
    assert request.wait(WAIT_S) and isinstance(request.error, EngineStoppedError)


def stopped_engine(pipeline: FakePipeline, why: str) -> Engine:
    """An engine whose loop stopped on `why` and that has told whoever watched it then."""
    engine = Engine(pipeline, CONFIG)
    heard = threading.Event()
    engine.on_stopped = lambda error: heard.set()
    stop_loop(engine, why)
    assert heard.wait(WAIT_S)
    return engine


def gated_rebuild(pipeline: FakePipeline, gate: threading.Event):
    """`rebuild` for a host: each call puts its thread in `calls`, waits for `gate`, and makes
    a new engine (kept in `made`) that takes the workers over."""
    calls: queue.Queue[threading.Thread] = queue.Queue()
    made: list[Engine] = []

    def rebuild(stats) -> Engine:
        calls.put(threading.current_thread())
        assert gate.wait(WAIT_S)
        engine = Engine(pipeline, CONFIG, take_over=True, stats=stats)
        made.append(engine)
        return engine

    return rebuild, calls, made


# --- what a request carries, both ways --------------------------------------------------------


def test_a_request_carries_its_settings_to_the_last_stage_and_its_rows_back(hosted) -> None:
    pipeline = LastStage()
    host, _ = hosted(pipeline)
    client = client_of(host)
    stop = expected([3, 4], 6)[2]  # the first row's third token; never the second row's
    seen: list[tuple[int, int]] = []
    finished: list[str] = []
    threads_before = set(threading.enumerate())
    pipeline.gate.clear()  # both requests are in flight at once
    first = client.submit(
        [[3, 4], [6, 7, 8]],
        sampling=GREEDY,
        max_new_tokens=6,
        eos_token_ids=[stop],
        min_new_tokens=1,
        on_token=lambda row, token: seen.append((row, token)),
        on_finish=lambda: finished.append("first"),
    )
    sampled = Sampling(do_sample=True, temperature=0.7)
    second = client.submit([[5]], sampling=sampled, max_new_tokens=3, seed=1234)
    # one thread fetches for the client, whatever it has in flight, and never keeps a process up
    fetchers = [t for t in threading.enumerate() if t not in threads_before]
    assert [(t.name, t.daemon) for t in fetchers] == [("offload-engine-client", True)]
    pipeline.gate.set()
    assert first.result(WAIT_S) == [expected([3, 4], 6)[:3], expected([6, 7, 8], 6)]
    assert first.finish_reasons == [Finish.STOP, Finish.LENGTH]
    assert second.result(WAIT_S) == [expected([5], 3)]  # the stand-in ignores sampling
    for row, tokens in enumerate(first.result()):
        assert [t for r, t in seen if r == row] == tokens
    assert finished == ["first"] and first.first_token_s is not None
    # the client's request says what was asked
    assert (first.sampling, first.max_new_tokens) == (GREEDY, 6)
    assert first.eos_token_ids == frozenset({stop}) and first.min_new_tokens == 1
    # ... and so does what the last stage was sent for each sequence
    sent = sorted(
        (s.prompt_length, s.seed, s.min_tokens, s.end_ids, s.sampling.do_sample)
        for s in pipeline.settings
    )
    assert sent == [
        (1, 1234, 0, (), True),
        (2, None, 1, (stop,), False),
        (3, None, 1, (stop,), False),
    ]


def test_log_probabilities_reach_the_client_with_their_tokens(hosted) -> None:
    pipeline = LastStage(scores=True)
    host, _ = hosted(pipeline)
    client = client_of(host)
    got: list[tuple[int, object]] = []
    request = client.submit(
        [[3, 4, 5], [6, 7]],
        sampling=GREEDY,
        max_new_tokens=3,
        logprobs=1,
        prompt_logprobs=1,
        on_logprobs=lambda row, scores: got.append((row, scores)),
        on_token=lambda row, token: got.append((row, token)),
    )
    assert request.result(WAIT_S) == [expected([3, 4, 5], 3), expected([6, 7], 3)]
    for row, prompt in enumerate(([3, 4, 5], [6, 7])):
        made = pipeline.scored[tuple(prompt)]  # the prompt's, then each token's
        assert len(made) == 4 and made[0].start == 1 and made[1].start == len(prompt)
        tokens = request.sequences[row].generated
        # the prompt's before the first token, each token's just before it
        assert [x for r, x in got if r == row] == [
            made[0],
            made[1],
            tokens[0],
            made[2],
            tokens[1],
            made[3],
            tokens[2],
        ]
        assert request.sequences[row].logprobs == made[1:]  # the tokens' own, not the prompt's
    # a token that comes without its own: its request fails, and the prompt's, handed over
    # for that token, go with it
    pipeline.withhold.add(9)
    broken = client.submit(
        [[9, 10]],
        sampling=GREEDY,
        max_new_tokens=3,
        logprobs=1,
        prompt_logprobs=1,
        on_token=lambda row, token: None,
    )
    assert broken.wait(WAIT_S) and isinstance(broken.error, RuntimeError)
    assert pipeline.scored[(9, 10)] and host._scores == {}


def test_an_error_that_cannot_cross_processes_reaches_the_client_as_a_launch_error(
    hosted,
) -> None:
    class Unpicklable(Exception):  # a class of a function's own does not pickle
        pass

    host, pipeline = hosted()
    client = client_of(host)
    pipeline.fail.append(Unpicklable("the step broke"))
    request = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=2)
    assert request.wait(WAIT_S) and request.finish_reasons == [Finish.ERROR]
    assert type(request.error) is LaunchError
    assert str(request.error) == "Unpicklable: the step broke"
    pipeline.fail.append(ConfigError("a bad value"))  # one that pickles comes as it is
    request = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=2)
    assert request.wait(WAIT_S) and type(request.error) is ConfigError


def test_the_client_reads_the_engine_state_through_the_host(hosted) -> None:
    host, _ = hosted()
    client = client_of(host)
    assert client.local is host.engine
    assert EngineClient(lambda method, *a, **kw: None).local is None  # the host elsewhere
    assert client.health() is None
    snapshot = client.snapshot()
    assert (snapshot["engine_state"], snapshot["kv_slots"]) == ("serving", 2)
    assert 'offload:engine_serving{model_name="tiny"} 1' in client.prometheus("tiny")


def test_a_refused_submit_leaves_nothing_open(hosted) -> None:
    host, _ = hosted()
    with pytest.raises(NeverFitsError):
        host.submit("c", 1, [[3] * 60], sampling=GREEDY, max_new_tokens=10)
    assert host.fetch("c", 0.0) == Delivery()
    assert "c" not in host._clients  # nothing open: its box went with that fetch
    # the client keeps nothing of a request refused: its close ends nothing
    client, ended = client_of(host), []
    with pytest.raises(NeverFitsError):
        client.submit(
            [[3] * 60], sampling=GREEDY, max_new_tokens=10, on_finish=lambda: ended.append(1)
        )
    client.close()
    assert ended == []


# --- cancel, close, drain, a failed call --------------------------------------------------------


def test_a_cancel_from_any_thread_reaches_the_engine_at_once(hosted) -> None:
    host, pipeline = hosted()
    made, cancelled = watch(host.engine)
    pipeline.gate.clear()  # nothing runs: the request is open when it is cancelled
    client = client_of(host)
    request = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=50)
    client.cancel(request)
    assert cancelled == made and len(made) == 1
    pipeline.gate.set()
    assert request.wait(WAIT_S) and request.finish_reasons == [Finish.ABORT]
    client.cancel(request)  # ended: nothing more to tell the engine
    assert cancelled == made


def test_a_callback_that_raises_ends_its_request_with_that_error_and_cancels_it(hosted) -> None:
    """Ordered as test_engine_host's cancel: a step after the first token waits until the
    engine holds the cancel, so its 60 tokens cannot end the request first."""
    host, pipeline = hosted()
    engine, submit = host.engine, pipeline.submit
    made, cancelled = watch(engine)

    def held(steps):  # the engine's thread
        if any(s.generated for step in steps for s in step.sequences):
            assert cancelled_event.wait(WAIT_S), "the client's cancel never reached the engine"
        return submit(steps)

    cancelled_event = threading.Event()
    cancel = engine.cancel

    def cancel_and_tell(request) -> None:
        cancel(request)
        cancelled_event.set()

    engine.cancel, pipeline.submit = cancel_and_tell, held
    broken = ValueError("the client's callback broke")

    def on_token(row, token):
        raise broken

    request = client_of(host).submit(
        [[3, 4]], sampling=GREEDY, max_new_tokens=60, on_token=on_token
    )
    assert request.wait(WAIT_S)
    assert request.error is broken and request.finish_reasons == [Finish.ABORT]
    assert cancelled == made and made[0].finish_reasons == [Finish.ABORT]


def test_a_callback_whose_cancel_fails_or_an_on_finish_that_raises_ends_only_its_own_request(
    hosted, caplog
) -> None:
    """One client, three requests in one delivery: the first's on_token raises and the cancel
    it sends fails too (the host is unreachable for cancels); the second's on_finish raises.
    Each ends with its own error; the third, beside them, ends with its tokens, and the
    client's fetch thread goes on serving a request submitted afterwards."""
    host, pipeline = hosted()
    made, _ = watch(host.engine)
    unreachable = ConnectionError("cancel cannot reach the host")

    def before(method) -> None:
        if method == "cancel":
            raise unreachable

    client = client_of(host, before)
    pipeline.gate.clear()  # all three are queued before the first step runs
    broken = ValueError("the client's on_token broke")

    def on_token(row, token):
        raise broken

    def on_finish():
        raise RuntimeError("the client's on_finish broke")

    first = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=3, on_token=on_token)
    second = client.submit([[5, 6]], sampling=GREEDY, max_new_tokens=3, on_finish=on_finish)
    caplog.set_level("WARNING")
    pipeline.gate.set()
    assert first.wait(WAIT_S) and first.error is broken
    assert second.wait(WAIT_S) and second.result() == [expected([5, 6], 3)]
    third = client.submit([[7, 8]], sampling=GREEDY, max_new_tokens=3)
    assert third.result(WAIT_S) == [expected([7, 8], 3)]
    assert all(request.wait(WAIT_S) for request in made)
    said = [record.getMessage() for record in caplog.records]  # neither passed over silently
    assert f"request {first.id}: its cancel failed (cancel cannot reach the host)" in said
    assert f"request {second.id}: its on_finish callback raised" in said


def test_close_ends_the_open_requests_here_and_cancels_them_at_the_engine(hosted) -> None:
    host, pipeline = hosted()
    made, cancelled = watch(host.engine)
    pipeline.gate.clear()  # nothing runs: the requests are open when their clients close
    client = client_of(host)
    finished: list[int] = []
    request = client.submit(
        [[3, 4], [5]], sampling=GREEDY, max_new_tokens=5, on_finish=lambda: finished.append(1)
    )
    client.close()
    assert request.done() and finished == [1]
    assert request.finish_reasons == [Finish.ERROR, Finish.ERROR]
    with pytest.raises(LaunchError, match=r"^the client of the engine was closed$"):
        request.result()
    assert cancelled == made and len(made) == 1  # told at once: its slots are freed
    with pytest.raises(LaunchError, match=r"^this client of the engine is closed$"):
        client.submit([[5]], sampling=GREEDY, max_new_tokens=2)
    assert len(made) == 1

    # a client whose host cannot be reached any more closes all the same
    def unreachable(method) -> None:
        if method == "cancel":
            raise ConnectionError("the load's host is gone")

    other = client_of(host, unreachable)
    orphan = other.submit([[6]], sampling=GREEDY, max_new_tokens=5)
    other.close()
    assert orphan.done() and type(orphan.error) is LaunchError

    # a client closed while its submit is under way still raises that submit's refusal
    def close_then_refuse(method) -> None:
        if method == "submit":
            racing.close()
            raise QueueFullError("the queue is full")

    racing = client_of(host, close_then_refuse)
    with pytest.raises(QueueFullError, match="the queue is full"):
        racing.submit([[7]], sampling=GREEDY, max_new_tokens=2)
    pipeline.gate.set()
    assert made[0].wait(WAIT_S) and made[0].finish_reasons == [Finish.ABORT, Finish.ABORT]


def test_drain_waits_until_every_request_heard_its_end(hosted) -> None:
    host, _ = hosted()
    made, _ = watch(host.engine)
    release = threading.Event()
    client = client_of(host, lambda method: method != "fetch" or release.wait(WAIT_S))
    try:
        request = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=3)
        assert made[0].wait(WAIT_S)  # ended at the engine; the client's fetch is held
        # drain(0) does not wait: it returns, the client not told yet
        drainer = threading.Thread(target=client.drain, args=(0.0,), daemon=True)
        drainer.start()
        drainer.join(WAIT_S)
        assert not drainer.is_alive() and not request.done()
        # drain(WAIT_S) returns once the client has heard: the fetch goes on when drain waits
        with set_when_joining(release):
            client.drain(WAIT_S)
        assert request.done() and request.result() == [expected([3, 4], 3)]
    finally:
        release.set()


def test_a_failed_fetch_ends_the_open_requests_with_its_error_and_the_client_goes_on(
    hosted,
) -> None:
    host, pipeline = hosted()
    made, _ = watch(host.engine)
    gone = ConnectionError("the load's host is gone")
    release = threading.Event()
    fetches = 0

    def before(method) -> None:
        nonlocal fetches
        if method == "fetch":
            fetches += 1
            if fetches == 1:
                raise gone
            assert release.wait(WAIT_S)

    client = client_of(host, before)
    pipeline.gate.clear()
    first = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=4)
    assert first.wait(WAIT_S) and first.error is gone and first.finish_reasons == [Finish.ERROR]
    # a later request is fetched again; what comes for the ended one is passed over
    second = client.submit([[5, 6]], sampling=GREEDY, max_new_tokens=4)
    pipeline.gate.set()
    assert all(request.wait(WAIT_S) for request in made)
    release.set()  # one delivery: the first's tokens and end, among the second's
    assert second.result(WAIT_S) == [expected([5, 6], 4)]
    with pytest.raises(ConnectionError):
        first.result()


# --- the lease and the long poll, on the test's clock -------------------------------------------


def test_a_client_silent_past_its_lease_is_cancelled_and_not_before(clock) -> None:
    engine = ScriptedEngine()
    host = EngineHost(engine, lease_s=40.0)
    try:
        reaper = reaper_of(clock)
        assert (reaper.name, reaper.daemon) == ("offload-engine-leases", True)
        host.submit("quiet", 1, [[3]], sampling=GREEDY, max_new_tokens=5)
        [request] = engine.submitted
        request.on_token(0, 7)  # the engine's thread hands over a token
        assert host.fetch("quiet", 0.0).tokens == [(1, 0, 7, ())]  # at 1000: then silent
        scan(clock, reaper, 1010.0)
        scan(clock, reaper, 1030.0)
        assert engine.cancelled == []
        scan(clock, reaper, 1050.0)
        assert engine.cancelled == [request]
        end(request, Finish.ABORT)  # once it has ended, its box goes too
        scan(clock, reaper, 1060.0)
        assert "quiet" not in host._clients
    finally:
        host.close()


def test_a_client_with_a_fetch_waiting_is_there_though_another_returned(clock) -> None:
    engine = ScriptedEngine()
    host = EngineHost(engine, lease_s=4.0)
    try:
        reaper = reaper_of(clock)
        wake = Watched(host._lock)
        host._clients["c"] = _Client(wake)
        host.submit("c", 1, [[3]], sampling=GREEDY, max_new_tokens=5)
        [request] = engine.submitted
        out: list[Delivery] = []
        fetchers = [fetching(host, "c", 10.0, wake, out) for _ in range(2)]
        wake.until(lambda: wake.waits >= 2 or out, "the fetches never waited")
        request.on_token(0, 7)  # wakes one of them
        wake.until(lambda: len(out) == 1, "no fetch returned the token")
        scan(clock, reaper, 1005.0)  # silent past the lease since 1000, but one fetch waits
        assert engine.cancelled == []
        request.on_token(0, 8)  # the other one returns, at 1005: then nobody fetches
        wake.until(lambda: len(out) == 2, "the other fetch never returned the token")
        scan(clock, reaper, 1010.0)
        assert engine.cancelled == [request]
        assert [d.tokens for d in out] == [[(1, 0, 7, ())], [(1, 0, 8, ())]]
        for fetcher in fetchers:
            fetcher.join(WAIT_S)
    finally:
        host.close()


def test_a_fetch_waits_up_to_its_wait_then_returns_an_empty_delivery(clock) -> None:
    host = EngineHost(ScriptedEngine())
    try:
        wake = Watched(host._lock)
        host._clients["c"] = _Client(wake)
        out: list[Delivery] = []
        fetcher = fetching(host, "c", 1.0, wake, out)
        wake.until(lambda: wake.waits >= 1 or out, "the fetch never waited")
        assert out == []  # nothing came, the clock stands: it waits
        clock.to(1000.5)
        with host._lock:  # a wake-up for nothing: it reads the clock again
            waits = wake.waits
            wake.notify_all()
        wake.until(lambda: wake.waits > waits or out, "the fetch never waited again")
        assert out == []
        clock.to(1001.0)  # its wait is over: its own timed wait ends, and it returns
        fetcher.join(WAIT_S)
        assert not fetcher.is_alive() and out == [Delivery()]
        assert clock.crashes == []
    finally:
        host.close()


# --- stops and new engines ----------------------------------------------------------------------


def test_an_engine_that_stopped_before_its_host_watched_it_is_replaced() -> None:
    pipeline = FakePipeline()
    first = stopped_engine(pipeline, "a bug before the host came")
    gate = threading.Event()
    rebuild, calls, made = gated_rebuild(pipeline, gate)
    host = EngineHost(first, rebuild=rebuild, restart_delay_s=0.0)
    try:
        client = client_of(host)
        restarter = calls.get(timeout=WAIT_S)
        assert (restarter.name, restarter.daemon) == ("offload-engine-restart", True)
        why = client.health()
        assert "a new one is starting" in why and "a bug before the host came" in why
        stats = client.snapshot()
        assert (stats["engine_state"], stats["engine_failures"]) == ("restarting", 1)
        gate.set()
        restarter.join(WAIT_S)
        assert host.engine is made[0] and client.local is made[0] and client.health() is None
        request = client.submit([[3, 4]], sampling=GREEDY, max_new_tokens=3)
        assert request.result(WAIT_S) == [expected([3, 4], 3)]
        assert client.snapshot()["engine_restarts"] == 1
    finally:
        gate.set()
        host.close()


def test_each_stop_and_each_new_engine_is_counted_once() -> None:
    pipeline = FakePipeline()
    gate = threading.Event()
    rebuild, calls, made = gated_rebuild(pipeline, gate)
    host = EngineHost(Engine(pipeline, CONFIG), rebuild=rebuild, restart_delay_s=0.0)
    try:
        first = host.engine
        stop_loop(first, "bug one")
        restarter = calls.get(timeout=WAIT_S)
        first.on_stopped(first.failure)  # heard again (the host watched it as it stopped)
        assert host.stats()["engine_failures"] == 1
        gate.set()
        restarter.join(WAIT_S)
        assert host.engine is made[0]
        first.on_stopped(first.failure)  # the replaced engine's news, late: not the load's
        stats = host.stats()
        assert (stats["engine_state"], stats["engine_failures"], stats["engine_restarts"]) == (
            "serving",
            1,
            1,
        )
        stop_loop(made[0], "bug two")
        calls.get(timeout=WAIT_S).join(WAIT_S)
        assert host.engine is made[1]
        stats = host.stats()
        assert (stats["engine_state"], stats["engine_failures"], stats["engine_restarts"]) == (
            "serving",
            2,
            2,
        )
        assert "bug two" in stats["engine_stopped"]
    finally:
        gate.set()
        host.close()


def test_a_host_closed_while_a_new_engine_starts_closes_that_engine() -> None:
    pipeline = FakePipeline()
    gate = threading.Event()
    rebuild, calls, made = gated_rebuild(pipeline, gate)
    host = EngineHost(Engine(pipeline, CONFIG), rebuild=rebuild, restart_delay_s=0.0)
    first = host.engine
    try:
        stop_loop(first, "a bug")
        restarter = calls.get(timeout=WAIT_S)
        host.close()
        gate.set()
        restarter.join(WAIT_S)
        [late] = made
        assert host.engine is first and host.stats()["engine_restarts"] == 0
        with pytest.raises(EngineClosedError):
            late.submit([[3]], sampling=GREEDY, max_new_tokens=2)
    finally:
        gate.set()
        host.close()


def test_a_load_that_cannot_restart_fails_even_when_recording_that_fails() -> None:
    first = stopped_engine(FakePipeline(), "a bug")
    calls: list[str] = []

    def on_failed(why: str) -> None:
        calls.append(why)
        raise OSError("the record could not be written")

    host = EngineHost(first, on_failed=on_failed)  # no rebuild: the first stop fails the load
    try:
        assert len(calls) == 1 and "a bug" in calls[0]
        assert "serves no more" in host.health() and host.stats()["engine_state"] == "failed"
    finally:
        host.close()


def test_a_new_engine_that_does_not_start_is_tried_again_waits_doubling_until_the_limit(
    clock, monkeypatch
) -> None:
    monkeypatch.setattr(host_module, "ENGINE_START_LIMIT_S", 5.0)
    tries: list[float] = []
    failed: list[str] = []

    def never(stats) -> Engine:
        tries.append(clock.monotonic())
        raise WorkerLostError(f"the workers are being recovered (try {len(tries)})")

    def on_failed(why: str) -> None:
        failed.append(why)
        clock.poke()

    host = EngineHost(
        Engine(FakePipeline(), CONFIG),
        rebuild=never,
        on_failed=on_failed,
        restart_delay_s=1.0,
        lease_s=1e6,
    )
    try:
        reaper = reaper_of(clock)

        def restarter() -> threading.Thread | None:
            waiting = [t for t in clock.asleep if t is not reaper and clock.sleeping_on(t)]
            return waiting[0] if waiting else None

        stop_loop(host.engine, "a bug")
        for _ in range(8):  # more tries than the limit allows
            clock.until(lambda: failed or clock.crashes or restarter(), "no new try")
            if failed or clock.crashes:
                break
            with clock.cond:
                clock.to(clock.asleep[restarter()])
        assert clock.crashes == []
        # started at 1000 with 5 s to start: tries after 1, 2 and 4 s; the next would be past
        assert [s for t, s in clock.slept if t is not reaper] == [1.0, 2.0, 4.0]
        assert tries == [1001.0, 1003.0, 1007.0]
        assert failed == ["a new engine did not start: the workers are being recovered (try 3)"]
        assert host.stats()["engine_state"] == "failed" and "did not start" in host.health()
    finally:
        host.close()
