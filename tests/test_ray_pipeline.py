"""`RayPipeline` and its handles against stand-in actor handles and a stand-in `ray` (issue 60:
its mutants were seen only by the Ray tests of test_pipeline, which never run a single step, a
one-stage burst, a release or a refused claim). No Ray here: the module's `ray` is replaced by
`FakeRay`, whose refs answer when the test says so and whose waits honour their bounds as
Ray's do; a call that never answers blocks until the test ends, so a wait without a bound
shows as a call that does not return in time."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray

import coordinator.engine.ray_pipeline as rp
from coordinator.engine.pipelines import StepTimeoutError
from coordinator.engine.scheduler import Step
from coordinator.runtime.errors import WorkerLostError
from worker.steps import NotOwnerError
from worker.wire import Packed, pack

QUICK_S = 3.0  # what "at once" may take on a busy machine: far below the hung calls' bounds


class Ref:
    """An object ref: its value once `ready` is set (at once unless `hung`), or `error`."""

    def __init__(self, value=None, *, hung: bool = False, error: BaseException | None = None):
        self.value, self.error = value, error
        self.ready = threading.Event()
        if not hung:
            self.ready.set()


class Stream:
    """A streaming call's generator: `ray.wait` on it is ready once its next item (or its end)
    is, `next` gives that item's ref."""

    def __init__(self, items: list[Ref], *, ended: bool = True) -> None:
        self.items, self.ended = list(items), threading.Event()
        if ended:
            self.ended.set()

    def is_ready(self) -> bool:
        return (bool(self.items) and self.items[0].ready.is_set()) or (
            not self.items and self.ended.is_set()
        )

    def __next__(self) -> Ref:
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


class FakeRay:
    exceptions = ray.exceptions

    def __init__(self) -> None:
        self.put_values: list = []
        self.cancelled: list = []
        self.cancel_error: BaseException | None = None
        self.hung: list[Ref] = []  # set when the test ends: nothing stays blocked

    def _ready(self, ref) -> bool:
        return ref.is_ready() if isinstance(ref, Stream) else ref.ready.is_set()

    def get(self, refs, *, timeout=None):
        if isinstance(refs, list):
            deadline = None if timeout is None else time.monotonic() + timeout
            return [
                self.get(r, timeout=None if deadline is None else deadline - time.monotonic())
                for r in refs
            ]
        if not refs.ready.wait(None if timeout is None else max(timeout, 0)):
            raise ray.exceptions.GetTimeoutError(f"not ready within {timeout} s")
        if refs.error is not None:
            raise refs.error
        return refs.value

    def wait(self, refs, *, num_returns=1, timeout=None):
        if not isinstance(num_returns, int) or not 0 < num_returns <= len(refs):
            raise ValueError(f"num_returns {num_returns!r} for {len(refs)} refs")  # as Ray's
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [r for r in refs if self._ready(r)]
            if len(ready) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
                ready = ready[:num_returns]
                return ready, [r for r in refs if r not in ready]
            time.sleep(0.01)

    def put(self, value) -> Ref:
        self.put_values.append(value)
        return Ref(value)

    def cancel(self, ref) -> None:
        self.cancelled.append(ref)
        if self.cancel_error is not None:
            raise self.cancel_error


class Method:
    """An actor method: `.remote(*args)` records the call and answers with `answer(*args)`."""

    def __init__(self, answer) -> None:
        self.answer, self.calls, self.options_given = answer, [], []

    def remote(self, *args):
        self.calls.append(args)
        return self.answer(*args)

    def options(self, **options):
        self.options_given.append(options)
        return self


class Actor:
    def __init__(self, name: str, *, claim=None, release=None, ring=None) -> None:
        self.name = name
        # each stage answers a step with its own name and what it was given, the last one a
        # token per row (the rows' count)
        self.batch_step = Method(lambda rows, x, draw: Ref((name, rows, x, draw)))
        self.claim = Method(claim or (lambda owner, take: Ref(None)))
        self.release = Method(release or (lambda owner: Ref(None)))
        self.batch_ring = Method(ring or (lambda *args: Stream([])))


def handle(actor):
    return SimpleNamespace(actor=actor)


def step(count: int = 1, *, group: int = 0, rows="rows", draw="draw") -> Step:
    x = np.arange(3, dtype=np.int64).reshape(1, 3) + group
    return Step(group=group, sequences=[], rows=rows, x=x, draw=draw, prefill=False, count=count)


@pytest.fixture
def fake(monkeypatch):
    stand_in = FakeRay()
    monkeypatch.setattr(rp, "ray", stand_in)
    yield stand_in
    for ref in stand_in.hung:
        ref.ready.set()


def within(seconds: float, call):
    """`call()`'s result (or its exception, raised here) if it returns within `seconds`; a
    call that blocks longer fails the test (it is left to end when the test sets its refs)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not return within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_tensor_goes_inside_the_call_when_small_and_through_the_object_store_when_large(
    fake,
) -> None:
    small = np.arange(4, dtype=np.int64)
    inline = rp.by_value_or_ref(small)
    assert isinstance(inline, Packed) and inline.array.tolist() == [0, 1, 2, 3]
    assert rp.by_value_or_ref(None) is None
    assert fake.put_values == []
    large = np.zeros(rp.INLINE_BYTES // 8 + 1, dtype=np.int64)
    ref = rp.by_value_or_ref(large)
    assert isinstance(ref, Ref) and fake.put_values == [ref.value]
    assert isinstance(ref.value, Packed) and ref.value.array.shape == large.shape


def test_a_single_step_goes_stage_to_stage_and_its_tokens_are_read_within_the_bound(fake) -> None:
    stages = [Actor("s0"), Actor("s1"), Actor("s2")]
    pipeline = rp.RayPipeline(lambda: [handle(a) for a in stages], lambda: 5.0)
    one = step()
    submitted = pipeline.submit([one])
    assert isinstance(submitted, rp.StepHandle)
    [(rows0, x0, draw0)] = stages[0].batch_step.calls
    assert rows0 == "rows" and draw0 is None and x0.array.tolist() == one.x.tolist()
    # each next stage takes the previous one's answer (a ref, actor to actor), the last draws
    [(rows1, x1, draw1)] = stages[1].batch_step.calls
    assert (rows1, draw1) == ("rows", None) and x1.value[0] == "s0"
    [(rows2, x2, draw2)] = stages[2].batch_step.calls
    assert (rows2, draw2) == ("rows", "draw") and x2.value[0] == "s1"
    assert pipeline.wait([submitted], timeout_s=QUICK_S) == [submitted]

    # the last stage's tokens, as step 0's
    tokens = pack(np.array([11, 12]))
    stages[2].batch_step.answer = lambda rows, x, draw: Ref(tokens)
    m, out = next(pipeline.submit([one]).results(timeout_s=QUICK_S))
    assert m == 0 and out.tolist() == [11, 12]

    # a stage that never answers: the read ends at its bound, never holding the engine
    hung = Ref(hung=True)
    fake.hung.append(hung)
    stages[2].batch_step.answer = lambda rows, x, draw: hung
    stuck = pipeline.submit([one])
    with pytest.raises(ray.exceptions.GetTimeoutError):
        within(QUICK_S, lambda: next(stuck.results(timeout_s=0.2)))


def test_steps_of_several_micro_batches_or_of_several_tokens_go_to_the_first_stages_ring(
    fake,
) -> None:
    stages = [Actor("s0"), Actor("s1")]
    pipeline = rp.RayPipeline(lambda: [handle(a) for a in stages], lambda: 7.0)
    for steps in ([step(2)], [step(5)], [step(1, group=0), step(1, group=1)]):
        stages[0].batch_ring.calls.clear()
        submitted = pipeline.submit(steps)
        assert isinstance(submitted, rp.BurstHandle), [s.count for s in steps]
        [(batches, count, others, timeout_s, yield_s)] = stages[0].batch_ring.calls
        assert count == steps[0].count and others == (stages[1],)
        assert (timeout_s, yield_s) == (7.0, rp.RING_YIELD_S)
        assert [(r, x.array.tolist(), d) for r, x, d in batches] == [
            ("rows", s.x.tolist(), "draw") for s in steps
        ]
        assert stages[0].batch_ring.options_given[-1] == {"num_returns": "streaming"}
    assert stages[0].batch_step.calls == [] and stages[1].batch_ring.calls == []


def burst(*items, ended: bool = True) -> Stream:
    return Stream([Ref(list(item)) for item in items], ended=ended)


def test_a_burst_streams_every_step_it_ran_and_a_hung_one_ends_at_the_bound(fake) -> None:
    outs = [pack(np.array([t])) for t in range(4)]
    stream = burst([(0, outs[0]), (1, outs[1])], [(0, outs[2])], [(1, outs[3])])
    stages = [Actor("s0", ring=lambda *args: stream), Actor("s1")]
    pipeline = rp.RayPipeline(lambda: [handle(a) for a in stages], lambda: 5.0)
    submitted = pipeline.submit([step(2, group=0), step(2, group=1)])
    assert submitted.waitable is stream
    assert pipeline.wait([submitted], timeout_s=QUICK_S) == [submitted]
    read = list(submitted.results(timeout_s=QUICK_S))
    assert [(m, out.tolist()) for m, out in read] == [(0, [0]), (1, [1]), (0, [2]), (1, [3])]

    stuck = Ref(hung=True)
    fake.hung.append(stuck)
    stream = Stream([Ref([(0, outs[0])]), stuck])
    pipeline = rp.RayPipeline(lambda: [handle(Actor("s0", ring=lambda *a: stream))], lambda: 5.0)
    results = pipeline.submit([step(3)]).results(timeout_s=0.3)
    assert next(results)[0] == 0
    with pytest.raises(StepTimeoutError, match="did not come within"):
        within(QUICK_S, lambda: next(results))


def test_stopping_a_one_stage_burst_cancels_it_and_a_longer_one_runs_its_steps_out(fake) -> None:
    outs = [pack(np.array([t])) for t in range(3)]
    stream = burst([(0, outs[0])], [(0, outs[1])], [(0, outs[2])])
    one = rp.RayPipeline(lambda: [handle(Actor("s0", ring=lambda *a: stream))], lambda: 5.0)
    submitted = one.submit([step(3)])
    results = submitted.results(timeout_s=QUICK_S)
    assert next(results)[1].tolist() == [0]
    fake.cancel_error = RuntimeError("the call already ended")  # a cancel Ray refuses
    submitted.stop()  # never raises: the engine is cutting the burst
    assert fake.cancelled == [stream]
    assert list(results) == []  # only the item being read was applied

    fake.cancelled.clear()
    stream = burst([(0, outs[0])], [(0, outs[1])], [(0, outs[2])])
    stages = [Actor("s0", ring=lambda *a: stream), Actor("s1")]
    two = rp.RayPipeline(lambda: [handle(a) for a in stages], lambda: 5.0)
    submitted = two.submit([step(3)])
    results = submitted.results(timeout_s=QUICK_S)
    assert next(results)[1].tolist() == [0]
    submitted.stop()
    assert fake.cancelled == []  # never a hole in the next stage's calls
    assert [out.tolist() for _, out in results] == [[1], [2]]


def test_wait_gives_a_ready_step_at_once_and_nothing_when_none_is_ready_by_the_bound(fake) -> None:
    pipeline = rp.RayPipeline(lambda: [], lambda: 5.0)
    ready, hung = rp.StepHandle(Ref(1)), rp.StepHandle(Ref(hung=True))
    fake.hung.append(hung.waitable)
    start = time.monotonic()
    assert within(QUICK_S, lambda: pipeline.wait([hung, ready], timeout_s=30.0)) == [ready]
    assert time.monotonic() - start < QUICK_S
    assert within(QUICK_S, lambda: pipeline.wait([hung], timeout_s=0.1)) == []


def test_a_claim_reaches_every_stage_as_asked_and_a_refusal_is_the_workers_own_error(
    fake,
) -> None:
    stages = [Actor("s0"), Actor("s1")]
    pipeline = rp.RayPipeline(lambda: [handle(a) for a in stages], lambda: 5.0)
    pipeline.claim(("engine", 1), take=False)
    pipeline.claim(("engine", 2), take=True)
    for actor in stages:
        assert actor.claim.calls == [(("engine", 1), False), (("engine", 2), True)]

    refused = NotOwnerError("an older epoch")
    stages[1].claim.answer = lambda owner, take: Ref(
        error=ray.exceptions.RayTaskError("claim", "", refused)
    )
    with pytest.raises(NotOwnerError) as caught:
        pipeline.claim(("engine", 1), take=False)
    assert caught.value is refused
    other = ray.exceptions.RayTaskError("claim", "", ValueError("broken"))
    stages[1].claim.answer = lambda owner, take: Ref(error=other)
    with pytest.raises(ray.exceptions.RayTaskError):
        pipeline.claim(("engine", 1), take=False)

    # a stage that never answers: the claim ends at the load's bound (forward_timeout_s)
    never = Ref(hung=True)
    fake.hung.append(never)
    stages[1].claim.answer = lambda owner, take: never
    bounded = rp.RayPipeline(lambda: [handle(a) for a in stages], lambda: 0.2)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        within(QUICK_S, lambda: bounded.claim(("engine", 1), take=False))


def test_a_load_that_lost_a_worker_runs_nothing_and_says_so(fake) -> None:
    alive = Actor("s0")
    pipeline = rp.RayPipeline(lambda: [handle(alive), handle(None)], lambda: 5.0)
    for call in (
        lambda: pipeline.submit([step()]),
        lambda: pipeline.claim(("engine", 1), take=False),
    ):
        with pytest.raises(WorkerLostError, match=r"^a worker of this load was lost$"):
            call()
    with pytest.raises(WorkerLostError, match="was lost"):
        rp.RayPipeline(lambda: [], lambda: 5.0).submit([step()])
    assert alive.batch_step.calls == [] and alive.claim.calls == []


def test_release_gives_every_live_worker_its_claim_back_within_its_bound(fake, monkeypatch) -> None:
    gone = Actor("gone", release=lambda owner: Ref(error=ray.exceptions.RayActorError()))
    fine = Actor("fine")
    pipeline = rp.RayPipeline(lambda: [handle(gone), handle(None), handle(fine)], lambda: 5.0)
    within(QUICK_S, lambda: pipeline.release(("engine", 1)))  # a worker gone: no error
    assert gone.release.calls == [(("engine", 1),)] and fine.release.calls == [(("engine", 1),)]

    never = Ref(hung=True)
    fake.hung.append(never)
    hung = Actor("hung", release=lambda owner: never)
    monkeypatch.setattr(rp, "RELEASE_TIMEOUT_S", 0.2)
    pipeline = rp.RayPipeline(lambda: [handle(hung), handle(fine)], lambda: 5.0)
    within(QUICK_S, lambda: pipeline.release(("engine", 2)))  # a closing engine never hangs
    assert hung.release.calls == [(("engine", 2),)]
    assert fine.release.calls[-1] == (("engine", 2),)
