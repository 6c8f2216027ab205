"""A generation request as the engine sees it: a `Request` (what a client submitted and waits
on) of one or more `Sequence`s (one row each: its tokens, its KV slot, its sampling seed).
Sequences move between the scheduler's queues: waiting (FIFO) -> running (a slot, in a
micro-batch) -> finished; a request is done when all its sequences are."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.steps import Logprobs, Sampling, SlotSettings

logger = logging.getLogger(__name__)


class Status(enum.Enum):
    WAITING = "waiting"  # in the queue (new, or preempted: fed again from its start)
    RUNNING = "running"  # in a slot, with KV blocks, in a micro-batch (prefilling or decoding)
    FINISHED = "finished"  # ended, slot and blocks freed


class Finish(enum.Enum):
    STOP = "stop"  # an end-of-sequence token
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # cancelled, or the client went away
    ERROR = "error"  # the step failed: the request's error says why


@dataclass(eq=False)
class Sequence:
    """One row: its prompt, what it generated, and where its keys and values are (a slot for
    its settings and recurrent states, blocks for its keys and values)."""

    request: Request
    row: int  # in its request
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    status: Status | None = None  # written by the scheduler only
    slot: int | None = None  # KV slot while running
    group: int | None = None  # micro-batch while running
    cached: int = 0  # tokens whose keys and values are in its blocks
    blocks: list[int] = field(default_factory=list)  # its KV blocks: positions 0.. in order
    admitted: int = 0  # admission order while running: the youngest is preempted first
    block_names: list[bytes] = field(default_factory=list)  # its full blocks' (prefix caching)
    seed: int | None = None  # when sampling: keys each draw with the token's position
    finish: Finish | None = None
    last_token_s: float | None = None  # for inter-token latency
    # log-probabilities, when its request asks: of each generated token, and of its prompt
    # (the chunks' as they come, by first position, until its first token: then joined)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_chunks: dict[int, Logprobs] = field(default_factory=dict)
    # `tokens`, kept: the prompt and generated lists it was made of, and the prompt's length
    _tokens: list[int] = field(default_factory=list, init=False, repr=False)
    _tokens_of: tuple[list[int], int, list[int]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def tokens(self) -> list[int]:
        """Its prompt then what it generated, as one list to read, never to change. The
        scheduler reads it for every row of every step (the last token, the count, a chunk),
        so it is kept and only extended by what `generated` gained since the last read, not
        built again (that cost O(length) per row per step). `generated` only grows, in place
        (the scheduler's update; a client's copy, `coordinator.engine.host`); a prompt or
        generated list replaced, or one whose length went back, makes it again."""
        prompt, generated = self.prompt, self.generated
        made = self._tokens_of
        known = len(self._tokens) - len(prompt)  # of `generated`, already in it
        if (
            made is None
            or made[0] is not prompt
            or made[1] != len(prompt)
            or made[2] is not generated
            or not 0 <= known <= len(generated)
        ):
            self._tokens = [*prompt, *generated]
            self._tokens_of = (prompt, len(prompt), generated)
        elif known < len(generated):
            # a slice assignment, not an append: two readers at once write the same tail
            self._tokens[len(prompt) + known :] = generated[known:]
        return self._tokens

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: the prompt (or what is left of it), else the last
        token chosen."""
        return len(self.prompt) + len(self.generated) - self.cached

    @property
    def sampling(self) -> Sampling:
        return self.request.sampling

    def settings(self) -> SlotSettings:
        """What the last stage needs to choose this sequence's tokens (sent with its first
        step)."""
        request = self.request
        scored = request.prompt_logprobs is not None and not self.generated
        return SlotSettings(
            sampling=request.sampling,
            seed=self.seed,
            end_ids=tuple(sorted(request.eos_token_ids)) if request.min_new_tokens else (),
            prompt_length=len(self.prompt),
            min_tokens=request.min_new_tokens,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs if scored else None,
            prompt_ids=tuple(self.prompt) if scored else (),
            # its tokens so far (a preempted sequence's generated ones too), for penalties
            history=tuple(self.tokens) if request.sampling.needs_history else (),
        )

    def prompt_logprobs(self) -> Logprobs | None:
        """The prompt's scores (positions 1 on) once every chunk's came, else None."""
        if not self.prompt_chunks or len(self.prompt) < 2:
            return None
        position, joined = 1, None
        while position < len(self.prompt):
            chunk = self.prompt_chunks.get(position)
            if chunk is None:
                return None
            joined = chunk if joined is None else joined + chunk
            position += len(chunk)
        return joined


@dataclass(eq=False)
class Request:
    """What `Engine.submit` returns: wait on it with `result`, stop it with `Engine.cancel`."""

    sampling: Sampling
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    on_token: Callable[[int, int], None] | None = None  # (row, token), from the engine thread
    on_finish: Callable[[], None] | None = None  # once, when the request is done
    min_new_tokens: int = 0  # no end token before this many new tokens
    logprobs: int | None = None  # each token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt position after the first
    # (row, Logprobs): just before on_token, those of the token it hands over; before the
    # first token, the prompt's (when asked)
    on_logprobs: Callable[[int, Logprobs], None] | None = None
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    error: BaseException | None = None
    id: int | None = None  # a client's number for it (coordinator.engine.host)
    _done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def of(
        cls,
        prompts: list[list[int]],
        *,
        sampling: Sampling,
        max_new_tokens: int,
        eos_token_ids=(),
        on_token: Callable[[int, int], None] | None = None,
        on_finish: Callable[[], None] | None = None,
        **scoring,
    ) -> Request:
        """A request of one sequence per prompt (the engine's, or a client's copy of it).
        `scoring`: min_new_tokens, logprobs, prompt_logprobs, on_logprobs."""
        request = cls(
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_ids=frozenset(eos_token_ids),
            on_token=on_token,
            on_finish=on_finish,
            **scoring,
        )
        if request.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens={request.min_new_tokens} must be >= 0")
        request.sequences = [
            Sequence(request=request, row=row, prompt=list(prompt))
            for row, prompt in enumerate(prompts)
        ]
        return request

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[list[int]]:
        """Each row's generated tokens; raises the error the request ended with."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return [s.generated for s in self.sequences]

    @property
    def finish_reasons(self) -> list[Finish | None]:
        return [s.finish for s in self.sequences]

    def end(self) -> None:
        """Wake the waiting client (once every sequence has ended; the engine calls it once)."""
        assert all(s.finish is not None for s in self.sequences), "a request ended while running"
        assert not self._done.is_set(), "a request ended twice"
        self._done.set()
        if self.on_finish is not None:
            try:
                self.on_finish()
            except Exception:  # the client's own: the request has ended, its result stands
                logger.exception("request %s: its on_finish callback raised", self.id)
