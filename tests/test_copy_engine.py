"""The CPU copy engine: FIFO order, errors surface at wait, overlap with the caller."""

from __future__ import annotations

import pytest
import torch

from offload.copy_engine import ThreadCopyEngine


def test_copies_to_one_destination_land_in_submission_order() -> None:
    engine = ThreadCopyEngine()
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    sources = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(1, 20)]
    tickets = [engine.submit(dst, src, after=engine.fence()) for src in sources]
    engine.wait(tickets[-1])
    assert bool((dst == 19).all())
    totals = engine.read_totals()
    assert (totals.copies, totals.copied_bytes) == (19, 19 << 20)
    assert totals.copy_s > 0
    engine.close()


def test_a_failed_copy_raises_at_wait() -> None:
    engine = ThreadCopyEngine()
    ticket = engine.submit(torch.zeros(4), torch.zeros(5), after=None)  # shapes do not match
    with pytest.raises(RuntimeError):
        engine.wait(ticket)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(torch.zeros(4), torch.zeros(4), after=None)


def test_close_drains_pending_copies_and_stops_the_thread() -> None:
    engine = ThreadCopyEngine()
    pairs = [(torch.zeros(1 << 18), torch.full((1 << 18,), float(i))) for i in range(32)]
    tickets = [engine.submit(dst, src, after=None) for dst, src in pairs]
    engine.close()
    assert all(t.done() for t in tickets)
    assert all(torch.equal(dst, src) for dst, src in pairs)
    assert not engine._thread.is_alive()
