"""One generation request's steps through a job's pipeline (`Job.generate` drives them with
`coordinator.generation.generate`): every step fed is recorded, so that a request that loses a
worker goes on exactly after recovery, and a job of one stage lets its worker run the decode
steps itself, a burst per call."""

from __future__ import annotations

import contextlib
import uuid

import ray
import torch

from coordinator.runtime.errors import WorkerLostError
from coordinator.runtime.group import worker_failure
from worker.decode import advance
from worker.wire import pack, unpack

END_REQUEST_TIMEOUT_S = 30.0
# Decode steps a one-stage job's worker runs per call (`RequestSteps.burst`): the Ray call's
# fixed cost (~2.5 ms here) is paid once per burst instead of once per token, while other
# requests' steps still get the worker between bursts.
BURST_STEPS = 8


class RequestSteps:
    """One request's steps through the pipeline, each worker caching its layers' keys and
    values under the request's id. It remembers every step fed so far: when a worker is lost,
    the job recovers and the steps are fed again, in order, under a new id. That rebuilds the
    caches exactly as they were (same inputs, same shapes, same kernels), so the request goes
    on with the logits it would have had: the output is the one an uninterrupted run gives."""

    def __init__(self, job, epoch: int) -> None:
        self.job = job  # the `Job` (not imported: job.py imports this module)
        self.epoch = epoch  # of the workers the request's caches are on
        self.request = uuid.uuid4().hex
        self.fed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # ids, mask, pos

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        self.fed.append((ids, mask, positions))
        try:
            return self.job._forward(ids, mask, positions, 1, self.request)
        except (ray.exceptions.RayError, WorkerLostError) as exc:
            return self._recover(exc)

    def _recover(self, exc: Exception) -> torch.Tensor:
        """After a step failed with `exc`: recover the job and feed every recorded step again
        under a new id; the last step's logits. Raises `exc` (as a clear error) when no worker
        was lost: then the step itself failed."""
        self.job._recover_or_raise(exc, self.epoch)
        self.epoch = self.job._gate.epoch
        self.end()
        self.request = uuid.uuid4().hex
        try:
            for step_ids, step_mask, step_positions in self.fed:
                logits = self.job._forward(step_ids, step_mask, step_positions, 1, self.request)
        except ray.exceptions.RayError as again:
            raise worker_failure(again, self.job.workers) from None
        return logits

    @property
    def burst(self):
        """`generation.Burst` when the job has one stage (read again before every burst: a
        recovery may re-plan the job onto another number of stages)."""
        return self._burst if len(self.job.workers) == 1 else None

    def _burst(self, tokens, mask, positions, unfinished, count, settings, generator):
        """Decode steps run by the job's one worker itself: one streaming call for up to
        BURST_STEPS tokens, each coming back as it is chosen, instead of a call per token.
        Every step is recorded as if fed from here, so a lost worker is recovered as in
        `__call__` (the burst then ends early and the loop goes on from its last token)."""
        timeout_s = self.job.config.forward_timeout_s
        call, running = None, False
        try:
            actor = self.job.workers[0].actor
            if actor is None:  # attached to a load that lost its worker
                raise WorkerLostError("the worker of this load was lost")
            call = actor.decode.options(num_returns="streaming").remote(
                self.request, pack(tokens), pack(mask), pack(positions), pack(unfinished),
                min(count, BURST_STEPS), settings.sampling, settings.eos_token_ids,
                settings.pad_token_id, pack(generator.get_state()) if generator is not None else None,
            )  # fmt: skip
            while True:
                ready, _ = ray.wait([call], timeout=timeout_s)
                if not ready:
                    raise self.job._forward_timeout()
                try:
                    chosen, state = ray.get(next(call), timeout=timeout_s)
                except StopIteration:
                    call = None  # finished: nothing to stop
                    return
                running = True
                self.fed.append((tokens, mask, positions))
                chosen = unpack(chosen)
                if generator is not None:
                    generator.set_state(unpack(state))
                yield chosen
                mask, positions = advance(mask, positions)
                tokens = chosen[:, None]
        except (ray.exceptions.RayError, WorkerLostError) as exc:
            self._recover(exc)  # the caches hold every step taken; the loop goes on from there
        finally:
            # Left early: the worker stops stepping at its next token. Only a call that has
            # streamed a token is cancelled: cancelling one the actor has not received yet
            # leaves a hole in the order of this driver's calls to it, and the actor holds the
            # later ones for its 30 s reorder wait, then drops them (end_request included: the
            # cache was kept; ray-project/ray#65785 describes that queue). A call left
            # uncancelled runs at most BURST_STEPS steps; end_request is queued after it.
            if call is not None and running:
                with contextlib.suppress(Exception):
                    ray.cancel(call)

    def end(self) -> None:
        """Free the request's caches on every worker (bounded; a lost worker holds none)."""
        refs = [h.actor.end_request.remote(self.request) for h in self.job.workers if h.actor]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=END_REQUEST_TIMEOUT_S)
