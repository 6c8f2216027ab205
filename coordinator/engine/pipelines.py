"""How the engine runs a step on the stages: `RayPipeline` chains the job's workers through Ray
(the activations pass from actor to actor as object refs, the driver only waits for the last
stage's tokens); `LocalPipeline` calls in-process workers (tests, the family check). Both give
the engine handles it can wait on while other micro-batches' steps run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from coordinator.engine.scheduler import Step
from offload.errors import LaunchError
from worker.steps import answer_values, send_through


class StepTimeoutError(LaunchError, TimeoutError):
    """A step (or a burst's next step) did not come back within its bound: a stage is hung.
    The engine recovers as for a lost worker: the stage that does not answer is replaced."""


# (which of the submitted steps, each row's token: with log-probabilities when a row asked),
# the tokens a numpy array from Ray, a tensor from an in-process stage
Tokens = tuple[int, object]


class Handle(Protocol):
    def results(self, timeout_s: float) -> Iterator[Tokens]:
        """The steps' tokens as they come (a burst yields one per micro-batch per step)."""

    def stop(self) -> None:
        """Cut a burst: the workers start no step they need not (in process, and on one
        stage, none). `results` then goes on with the steps that ran anyway (in process, those
        of the other micro-batches already under way; on several stages, every step left,
        which the first stage's ring runs out) and ends; the engine applies them (to the rows
        still running) rather than have them computed again. A step that ran and is not
        yielded is never applied: the next step of its rows starts where the last one applied
        ended. Every write of the burst lands before the engine's next call."""


class Pipeline(Protocol):
    num_stages: int
    max_burst: int  # decode steps one burst may run: longer where cutting one is cheap

    def claim(self, owner: tuple[str, int], *, take: bool) -> None:
        """Make `owner` the engine (and epoch) whose steps every stage runs; raises when a
        stage cannot be claimed (another engine owns it and not `take`, or it is gone)."""

    def release(self, owner: tuple[str, int]) -> None:
        """The engine `owner` closes: the stages it claimed are nobody's (best effort)."""

    def submit(self, steps: list[Step]) -> Handle:
        """One step, through every stage; or a burst of `count` decode steps of each of
        `steps` (one per micro-batch), driven by the first stage (`StageWorker.batch_ring`)."""

    def wait(self, handles: list[Handle], timeout_s: float) -> list[Handle]:
        """Those of `handles` whose first tokens are ready ([] after `timeout_s`)."""


def tokens_of(m: int, out) -> Tokens:
    """Step `m`'s tokens, from a tensor or `Chosen`, or from what crossed Ray (packed: read as
    numpy arrays, so that the engine never needs torch)."""
    return m, answer_values(out)


class InProcessHandle:
    """A step run in this thread: a burst's steps run as they are read. `stop` sets `cut`
    (the ring then sends no step more and yields those under way), or without one closes a
    generator (nothing more is read); a list's steps all ran, and are all read."""

    def __init__(self, outputs, cut: threading.Event | None = None) -> None:
        self.outputs = outputs  # a list, or a generator of a burst's (m, tokens)
        self.cut = cut

    def results(self, timeout_s: float) -> Iterator[Tokens]:
        for item in self.outputs:  # a burst yields lists of steps (StageWorker.batch_ring)
            for m, out in item if isinstance(item, list) else [item]:
                yield tokens_of(m, out)

    def stop(self) -> None:
        if self.cut is not None:
            self.cut.set()
        elif not isinstance(self.outputs, list):
            self.outputs.close()


class LocalPipeline:
    """In-process `StageWorker`s, stepped one after another in the calling thread."""

    max_burst = 64  # a burst in this thread ends when cut (only the steps under way run)

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.num_stages = len(workers)

    def claim(self, owner: tuple[str, int], *, take: bool) -> None:
        for worker in self.workers:
            worker.claim(owner, take)

    def release(self, owner: tuple[str, int]) -> None:
        for worker in self.workers:
            worker.release(owner)

    def submit(self, steps: list[Step]) -> InProcessHandle:
        if len(steps) > 1 or steps[0].count > 1:  # the first stage drives them
            batches = [(step.rows, step.x, step.draw) for step in steps]
            cut = threading.Event()
            ring = self.workers[0].batch_ring(
                batches, steps[0].count, tuple(self.workers[1:]), wire=False, stop=cut
            )
            return InProcessHandle(ring, cut)
        [step] = steps
        return InProcessHandle([(0, send_through(self.workers, step.rows, step.x, step.draw))])

    def wait(self, handles: list[InProcessHandle], timeout_s: float) -> list[InProcessHandle]:
        return list(handles)
