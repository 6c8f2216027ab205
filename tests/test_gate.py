"""The job's gate: passes run at once, a change runs alone; a thread inside a pass can make a
change (its own pass steps out), and two threads that both need one do not wait for each
other.

"Nothing happened yet" is asserted only once the thread that must wait is known to wait: the
gate's condition tells the test when a thread waits on it, so a slow machine cannot make the
assertion pass early or fail (a thread that had not yet reached the gate)."""

from __future__ import annotations

import threading

from coordinator.runtime.gate import Gate

WAIT_S = 10.0


class SeenWaiting(threading.Condition):
    """A condition that sets `waiting` whenever a thread waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def watched_gate() -> tuple[Gate, SeenWaiting]:
    gate = Gate()
    gate._cond = SeenWaiting()  # nothing waits on it yet
    return gate, gate._cond


def test_passes_run_at_once_and_a_change_waits_for_them() -> None:
    gate, cond = watched_gate()
    inside = threading.Barrier(3, timeout=WAIT_S)  # both passes and the test
    release = threading.Event()
    order: list[str] = []

    def a_pass() -> None:
        with gate.inside():
            inside.wait()  # two passes inside at the same time, or this times out
            release.wait(WAIT_S)
            order.append("pass")

    def a_change() -> None:
        with gate.alone():
            order.append("change")

    passes = [threading.Thread(target=a_pass) for _ in range(2)]
    for t in passes:
        t.start()
    inside.wait()  # both passes are inside, and stay until released
    change = threading.Thread(target=a_change)
    change.start()
    assert cond.waiting.wait(WAIT_S), "the change never waited"
    assert order == []  # the change waits for both passes
    release.set()
    for t in [*passes, change]:
        t.join(WAIT_S)
        assert not t.is_alive()
    assert order == ["pass", "pass", "change"]


def test_two_passes_that_both_need_a_change_do_not_deadlock() -> None:
    gate = Gate()
    both_failed = threading.Barrier(2, timeout=WAIT_S)
    changes: list[int] = []

    def failing_pass() -> None:
        with gate.inside() as epoch:
            both_failed.wait()  # both saw the same loss in the same epoch
            with gate.alone():  # each steps out while waiting: no deadlock
                if gate.epoch == epoch:  # the first one recovers...
                    changes.append(epoch)
                    gate.epoch += 1
                # ...the second sees the epoch moved on and does nothing

    threads = [threading.Thread(target=failing_pass) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "deadlock"
    assert changes == [0] and gate.epoch == 1


def test_a_pass_waits_while_a_change_runs() -> None:
    gate, cond = watched_gate()
    inside_change = threading.Event()
    finish = threading.Event()
    seen: list[str] = []

    def change() -> None:
        with gate.alone():
            inside_change.set()
            finish.wait(WAIT_S)
            seen.append("change done")

    def a_pass() -> None:
        with gate.inside():
            seen.append("pass")

    t1 = threading.Thread(target=change)
    t1.start()
    assert inside_change.wait(WAIT_S)
    t2 = threading.Thread(target=a_pass)
    t2.start()
    assert cond.waiting.wait(WAIT_S), "the pass never waited"
    assert seen == []
    finish.set()
    t1.join(WAIT_S)
    t2.join(WAIT_S)
    assert not t1.is_alive() and not t2.is_alive()
    assert seen == ["change done", "pass"]
