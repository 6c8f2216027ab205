"""How the engine runs a step on the stages: `RayPipeline` chains the job's workers through Ray
(the activations pass from actor to actor as object refs, the driver only waits for the last
stage's tokens); `LocalPipeline` calls in-process workers (tests, the family check). Both give
the engine handles it can wait on while other micro-batches' steps run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from coordinator.engine.scheduler import Step
from worker.batched import Draw, Drawn
from worker.wire import pack, unpack

# (which of the submitted steps, each row's token, the sampling rows' generator states)
Tokens = tuple[int, torch.Tensor, torch.Tensor | None]


class Handle(Protocol):
    def results(self, timeout_s: float) -> Iterator[Tokens]:
        """The steps' tokens as they come (a burst yields one per micro-batch per step)."""

    def stop(self) -> None:
        """End a burst early: the workers stop at their next step; what they make after it
        is never read (the next step of these rows starts where the last one read ended)."""


class Pipeline(Protocol):
    num_stages: int

    def submit(self, steps: list[Step]) -> Handle:
        """One step, through every stage; or a burst of `count` decode steps of each of
        `steps` (one per micro-batch), driven by the first stage (`StageWorker.batch_ring`)."""

    def wait(self, handles: list[Handle], timeout_s: float) -> list[Handle]:
        """Those of `handles` whose first tokens are ready ([] after `timeout_s`)."""


def _drawn(m: int, out: Drawn) -> Tokens:
    return m, unpack(out.tokens), unpack(out.states)


def _packed_draw(draw: Draw) -> Draw:
    return Draw(draw.samplings, pack(draw.states) if draw.states is not None else None)


class _Done:
    """A step run in this thread: a burst's steps run as they are read (`stop` ends it)."""

    def __init__(self, outputs) -> None:
        self.outputs = outputs  # a list, or a generator of a burst's (m, Drawn)

    def results(self, timeout_s: float) -> Iterator[Tokens]:
        for out in self.outputs:
            yield out if len(out) == 3 else _drawn(*out)

    def stop(self) -> None:
        if not isinstance(self.outputs, list):
            self.outputs.close()


class LocalPipeline:
    """In-process `StageWorker`s, stepped one after another in the calling thread."""

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.num_stages = len(workers)

    def submit(self, steps: list[Step]) -> _Done:
        if len(steps) > 1 or steps[0].count > 1:  # the first stage drives them
            batches = [(step.rows, step.x, step.draw) for step in steps]
            return _Done(
                self.workers[0].batch_ring(batches, steps[0].count, tuple(self.workers[1:]))
            )
        [step] = steps
        x = step.x
        for worker in self.workers[:-1]:
            x = worker.batch_step(step.rows, x)
        return _Done([_drawn(0, self.workers[-1].batch_step(step.rows, x, step.draw))])

    def wait(self, handles: list[_Done], timeout_s: float) -> list[_Done]:
        return list(handles)
