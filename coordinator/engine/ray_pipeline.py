"""`Pipeline` over a job's Ray workers. A step is one call per stage, chained by object refs:
stage s+1's call takes stage s's result as its argument, so the activations go from actor to
actor and the driver only fetches the last stage's tokens. Each actor runs its calls in the
order this driver made them, so while stage 1 works on micro-batch A, stage 0 already works on
micro-batch B: every stage busy when there are as many micro-batches as stages.

When every micro-batch is decoding and nothing waits to join, their decode steps run as one
burst: the first stage's worker drives up to `Step.count` steps of each itself, passing each
step's activations on to the next stage and taking the last stage's tokens straight back as
that micro-batch's next input (actor to actor), the micro-batches taking turns so that every
stage has one to work on, and streaming every step's tokens to the driver as they come: one
driver call per burst, the driver off the per-token path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import ray

from coordinator.engine.pipelines import StepTimeoutError, Tokens, tokens_of
from coordinator.engine.scheduler import Step
from coordinator.runtime.errors import WorkerLostError
from worker.steps import NotOwnerError, send_through
from worker.wire import pack

# Below this many bytes a tensor goes inside the call itself: a decode step's inputs are a few
# hundred bytes, and a `ray.put` of each cost ~1.7 ms per step (bench/generate.py). Larger ones
# (a long prompt, its mask for every stage) are put in the object store once. Either way as
# `wire.pack` arrays, which Ray moves faster than tensors.
INLINE_BYTES = 64 * 1024
# A burst's tokens reach the driver at most this long after they are chosen, several steps'
# to one streamed item when steps are short (StageWorker.batch_ring). An item costs the worker
# ~0.35 ms of CPU: at most one per 12 ms keeps that near 3% of its time (at 4 ms, 9%: the tiny
# model of bench/engine.py went from 0.78x to 0.84-0.86x of transformers). The first step of a
# burst goes out at once, and a step as long as this goes out on its own.
RING_YIELD_S = 0.012
RELEASE_TIMEOUT_S = 10.0  # a closing engine gives its claims back, at most this long


def by_value_or_ref(tensor):
    """`tensor` (or None) packed, inside the call when small, else as an object ref."""
    packed = pack(tensor)
    if packed is None or packed.array.nbytes <= INLINE_BYTES:
        return packed
    return ray.put(packed)


class StepHandle:
    def __init__(self, ref) -> None:
        self.waitable = ref

    def results(self, timeout_s: float) -> Iterator[Tokens]:
        yield tokens_of(0, ray.get(self.waitable, timeout=timeout_s))

    def stop(self) -> None:
        pass  # one step: nothing to stop


class BurstHandle:
    def __init__(self, stream, *, through: bool) -> None:
        self.waitable = stream
        self._through = through  # the first stage sends its steps on to others
        self._cancelled = False

    def results(self, timeout_s: float) -> Iterator[Tokens]:
        stream = self.waitable
        while not self._cancelled:  # after a cancel, only the item being read is applied
            # bounded: a stuck stage must not hold the engine's only thread
            ready, _ = ray.wait([stream], num_returns=1, timeout=timeout_s)
            if not ready:
                raise StepTimeoutError(
                    f"a burst's next step did not come within {timeout_s:.0f} s (forward_timeout_s)"
                )
            try:
                ref = next(stream)
            except StopIteration:
                return
            for m, out in ray.get(ref, timeout=timeout_s):  # the steps ready by then
                yield tokens_of(m, out)

    def stop(self) -> None:
        """Cut the burst. One stage: cancel the streaming call (Ray stops a generator task at
        its next yield; it has streamed, so the actor has it: cancelling a call the actor has
        not received can leave a hole in the order of this driver's calls,
        ray-project/ray#65785); its steps still run in that call, before any later call to
        it, and `results` ends with the item it is reading (after a cancel, Ray raises
        TaskCancelledError for the next item, even one yielded before: measured on Ray
        2.60), so the steps the call ran after it are never applied. Several stages: nothing to
        stop. Not a cancel there: it can interrupt the first stage while it submits a step to
        the next one, leaving a hole in that stage's sequence of calls from it, which the next
        stage waits out (30 s) before failing every call queued behind it. The ring runs its
        remaining steps (fewer than its count) out on every stage, and `results` goes on
        yielding them: the engine applies them to the rows still running instead of having
        them computed again, and every write the burst makes lands before its next call."""
        if not self._through:
            self._cancelled = True
            with contextlib.suppress(Exception):
                ray.cancel(self.waitable)


class RayPipeline:
    def __init__(self, workers: Callable[[], list], timeout_s: Callable[[], float]) -> None:
        """`workers()`: the load's worker handles now (they change with recoveries);
        `timeout_s()`: how long one call may take (forward_timeout_s)."""
        self._workers, self._timeout_s = workers, timeout_s

    @property
    def num_stages(self) -> int:
        return len(self._workers())

    @property
    def max_burst(self) -> int:
        """One stage: a cut burst is cancelled at once, so bursts may be long (the driver's
        turn between two bursts costs ~5 ms: 0.6 ms a step in bursts of 8 on a 2 ms step).
        Several: a cut burst runs its remaining steps out (applied, not lost, but a request
        that arrives waits for them), so they stay short."""
        return 64 if self.num_stages == 1 else 8

    def claim(self, owner: tuple[str, int], *, take: bool) -> None:
        actors = self._actors()
        try:
            ray.get(
                [actor.claim.remote(owner, take) for actor in actors],
                timeout=self._timeout_s(),
            )
        except ray.exceptions.RayTaskError as exc:  # the worker's own words, not Ray's wrapper
            if isinstance(exc.cause, NotOwnerError):
                raise exc.cause from None
            raise

    def release(self, owner: tuple[str, int]) -> None:
        actors = [h.actor for h in self._workers() if h.actor is not None]
        with contextlib.suppress(Exception):  # closing: a worker gone has nothing to release
            ray.get([a.release.remote(owner) for a in actors], timeout=RELEASE_TIMEOUT_S)

    def _actors(self) -> list:
        actors = [h.actor for h in self._workers()]
        if not actors or any(a is None for a in actors):  # attached to a load that lost workers
            raise WorkerLostError("a worker of this load was lost")
        return actors

    def submit(self, steps: list[Step]) -> StepHandle | BurstHandle:
        actors = self._actors()
        if len(steps) > 1 or steps[0].count > 1:  # stage 0 drives them, actor to actor
            batches = [(step.rows, pack(step.x), step.draw) for step in steps]
            stream = (
                actors[0]
                .batch_ring.options(num_returns="streaming")
                .remote(batches, steps[0].count, tuple(actors[1:]), self._timeout_s(), RING_YIELD_S)
            )
            return BurstHandle(stream, through=len(actors) > 1)
        [step] = steps
        return StepHandle(send_through(actors, step.rows, by_value_or_ref(step.x), step.draw))

    def wait(self, handles: list, timeout_s: float) -> list:
        by_waitable = {h.waitable: h for h in handles}
        ready, _ = ray.wait(list(by_waitable), num_returns=1, timeout=timeout_s)
        return [by_waitable[w] for w in ready]
