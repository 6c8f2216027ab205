"""A generation request as the engine sees it: a `Request` (what a client submitted and waits
on) of one or more `Sequence`s (one row each: its tokens, its KV slot, its sampler state).
Sequences move between the scheduler's queues: waiting (FIFO) -> running (a slot, in a
micro-batch) -> finished; a request is done when all its sequences are."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker.decode import Sampling


class Finish(enum.Enum):
    STOP = "stop"  # an end-of-sequence token
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # cancelled, or the client went away
    ERROR = "error"  # the step failed: the request's error says why


@dataclass(eq=False)
class Sequence:
    """One row: its prompt, what it generated, and where its keys and values are."""

    request: Request
    row: int  # in its request
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    slot: int | None = None  # KV slot while running
    slot_used: int | None = None  # the last slot it held (for reports)
    group: int | None = None  # micro-batch while running
    cached: int = 0  # tokens whose keys and values are in the slot
    state: torch.Tensor | None = None  # generator state when sampling
    finish: Finish | None = None
    last_token_s: float | None = None  # for inter-token latency

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: the prompt (or what is left of it), else the last
        token chosen."""
        return len(self.prompt) + len(self.generated) - self.cached

    @property
    def sampling(self) -> Sampling:
        return self.request.sampling


@dataclass(eq=False)
class Request:
    """What `Engine.submit` returns: wait on it with `result`, stop it with `cancel`."""

    sampling: Sampling
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    on_token: Callable[[int, int], None] | None = None  # (row, token), from the engine thread
    on_finish: Callable[[], None] | None = None  # once, when the request is done
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """End the request at the next step boundary; its slots are freed then."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

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

    def _end_if_done(self) -> None:
        if self._done.is_set() or not all(s.finish is not None for s in self.sequences):
            return
        self._done.set()
        if self.on_finish is not None:
            self.on_finish()
