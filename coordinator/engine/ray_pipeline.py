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
from collections.abc import Iterator

import ray

from coordinator.engine.pipelines import Tokens, _drawn, _packed_draw
from coordinator.engine.scheduler import Step
from coordinator.runtime.errors import WorkerLostError
from worker.wire import pack

# Below this many bytes a tensor goes inside the call itself: a decode step's inputs are a few
# hundred bytes, and a `ray.put` of each cost ~1.7 ms per step (bench/generate.py). Larger ones
# (a long prompt, its mask for every stage) are put in the object store once. Either way as
# `wire.pack` arrays, which Ray moves faster than tensors.
INLINE_BYTES = 64 * 1024


def by_value_or_ref(tensor):
    """`tensor` (or None) packed, inside the call when small, else as an object ref."""
    packed = pack(tensor)
    if packed is None or packed.array.nbytes <= INLINE_BYTES:
        return packed
    return ray.put(packed)


class _StepRef:
    def __init__(self, ref) -> None:
        self.waitable = ref

    def results(self, timeout_s: float) -> Iterator[Tokens]:
        yield _drawn(0, ray.get(self.waitable, timeout=timeout_s))

    def stop(self) -> None:
        pass  # one step: nothing to stop


class _Burst:
    def __init__(self, stream) -> None:
        self.waitable = stream

    def results(self, timeout_s: float) -> Iterator[Tokens]:
        for ref in self.waitable:  # each next() waits for the worker's next step
            yield _drawn(*ray.get(ref, timeout=timeout_s))

    def stop(self) -> None:
        """Cancel the streaming call after a step it streamed: Ray stops a generator task at
        its next yield. (Only a call that has streamed: cancelling one the actor has not
        received yet can leave a hole in the order of this driver's calls to it, which the
        actor then waits on; see ray-project/ray#65785.) Its later steps run in the same
        actor call, before any call this driver makes after it."""
        with contextlib.suppress(Exception):
            ray.cancel(self.waitable)


class RayPipeline:
    def __init__(self, job) -> None:
        self.job = job  # coordinator.runtime.job.Job (not imported: it imports the engine)

    @property
    def num_stages(self) -> int:
        return len(self.job.workers)

    def submit(self, steps: list[Step]) -> _StepRef | _Burst:
        actors = [h.actor for h in self.job.workers]
        if not actors or any(a is None for a in actors):  # attached to a load that lost workers
            raise WorkerLostError("a worker of this load was lost")
        if len(steps) > 1 or steps[0].count > 1:  # stage 0 drives them, actor to actor
            batches = [(step.rows, pack(step.x), _packed_draw(step.draw)) for step in steps]
            stream = (
                actors[0]
                .batch_ring.options(num_returns="streaming")
                .remote(
                    batches, steps[0].count, tuple(actors[1:]), self.job.config.forward_timeout_s
                )
            )
            return _Burst(stream)
        [step] = steps
        draw = _packed_draw(step.draw)
        ref = by_value_or_ref(step.x)
        for s, actor in enumerate(actors):
            ref = actor.batch_step.remote(step.rows, ref, draw if s == len(actors) - 1 else None)
        return _StepRef(ref)

    def wait(self, handles: list, timeout_s: float) -> list:
        by_waitable = {h.waitable: h for h in handles}
        ready, _ = ray.wait(list(by_waitable), num_returns=1, timeout=timeout_s)
        return [by_waitable[w] for w in ready]
