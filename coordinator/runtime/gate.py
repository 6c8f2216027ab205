"""Who may use the job's workers at once: any number of passes (forward passes, generation
steps), or one change (a recovery, close) alone.

Passes from several threads run at the same time, which is what keeps every stage busy: stage 1
works on one request's step while stage 0 works on the next request's (each actor takes its
calls in order). A change waits until no other thread is inside, so a re-plan never swaps the
workers under a pass. A thread that is inside and needs a change (its pass found a lost worker)
steps out while it waits, so two threads that both saw the loss cannot wait for each other;
`epoch` counts the changes, so the second one sees that the first already recovered.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Gate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside: dict[int, int] = {}  # thread id -> how many passes it is in
        self._alone: int | None = None  # the thread making a change
        self.epoch = 0  # changes of the workers so far

    @contextmanager
    def inside(self) -> Iterator[int]:
        """A pass; yields the epoch it runs in."""
        me = threading.get_ident()
        with self._cond:
            while self._alone not in (None, me):
                self._cond.wait()
            self._inside[me] = self._inside.get(me, 0) + 1
            epoch = self.epoch
        try:
            yield epoch
        finally:
            with self._cond:
                self._inside[me] -= 1
                if not self._inside[me]:
                    del self._inside[me]
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """A change, with no other thread inside; this thread's own passes step out meanwhile."""
        me = threading.get_ident()
        with self._cond:
            depth = self._inside.pop(me, 0)
            self._cond.notify_all()
            while self._alone not in (None, me) or self._inside:
                self._cond.wait()
            outer, self._alone = self._alone, me
        try:
            yield
        finally:
            with self._cond:
                self._alone = outer
                if depth:
                    self._inside[me] = depth
                self._cond.notify_all()
