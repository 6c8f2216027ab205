"""The staged copy engine (pageable host memory -> pinned chunks -> device) on the CPU: a stand-in
stream that runs each copy as late as it may, so a chunk refilled before its copy has read it,
or a slot written before its fence, shows as wrong bytes."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import block_stack, run_stack

from offload import OffloadConfig, PrefetchOffloader
from offload import copy_engine as copy_engine_module
from offload.staging import StagedCopyEngine, StagedTicket, chunk_spans


class LazyStream:
    """`Staging` on the CPU: copies queue up, FIFO, and run only when someone waits for one of
    them (the copy thread for a chunk, the compute side for a job, or synchronize)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # copies (dst, chunk) and work (a callable), run in order
        self._pending: list = []
        self._ran = 0
        self.fences: list[tuple[object, int]] = []  # (fence, copies issued before it)
        self.bound_on: threading.Thread | None = None

    def bind(self) -> None:
        self.bound_on = threading.current_thread()

    def new_chunk(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def fence(self) -> None:
        return None

    def wait_fence(self, fence: object | None) -> None:
        with self._lock:
            self.fences.append((fence, len(self._pending)))

    def copy_async(self, dst: torch.Tensor, chunk: torch.Tensor) -> int:
        with self._lock:
            self._pending.append((dst, chunk))
            return len(self._pending)

    def _run_to(self, marker: int) -> None:
        with self._lock:
            while self._ran < marker:
                item = self._pending[self._ran]
                if callable(item):
                    item()
                else:
                    item[0].copy_(item[1])
                self._ran += 1

    def wait_done(self, marker: int) -> None:
        self._run_to(marker)

    def record(self) -> int:
        with self._lock:
            return len(self._pending)

    def run(self, work) -> None:
        with self._lock:
            self._pending.append(work)

    def compute_wait(self, marker: int) -> None:
        self._run_to(marker)

    def synchronize(self) -> None:
        self._run_to(self.record())


def test_chunk_spans_cover_the_copy_in_order() -> None:
    assert list(chunk_spans(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(chunk_spans(8, 4)) == [(0, 4), (4, 4)]
    assert list(chunk_spans(0, 4)) == []


@pytest.mark.parametrize("num_chunks", [1, 2, 3])
def test_bytes_land_in_order_through_reused_chunks(num_chunks: int) -> None:
    stream = LazyStream()
    engine = StagedCopyEngine(stream, chunk_bytes=64, num_chunks=num_chunks)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g) for _ in range(5)]
    dst = torch.zeros(1000, dtype=torch.uint8)
    other = torch.zeros(333, dtype=torch.int8)
    other_src = torch.randint(-128, 127, (333,), dtype=torch.int8, generator=g)
    tickets = [engine.submit(dst, src, after=f"fence{i}") for i, src in enumerate(sources)]
    side = engine.submit(other, other_src, after=None)
    engine.wait(tickets[2])
    engine.wait(side)
    assert torch.equal(other, other_src)
    engine.wait(tickets[-1])
    assert torch.equal(dst, sources[-1])  # the last submitted copy is what the slot holds
    # each job's fence came before its first chunk: 16 chunks of 64 B per 1000-B job
    assert stream.fences[:5] == [(f"fence{i}", 16 * i) for i in range(5)]
    assert stream.bound_on is engine._thread
    totals = engine.read_totals()
    assert (totals.copies, totals.copied_bytes) == (6, 5 * 1000 + 333)
    engine.close()
    assert not engine._thread.is_alive()


def test_the_direct_engine_copies_from_the_source_itself_after_each_fence() -> None:
    """No chunks (`num_chunks=0`: a node that pins nothing): each job is one copy from the
    pageable source, issued on the copy thread after its fence, in order; nothing pinned."""
    stream = LazyStream()
    stream.new_chunk = None  # a chunk asked for would fail the test
    engine = StagedCopyEngine(stream, num_chunks=0)
    assert (engine.kind, engine.pinned_bytes, engine.chunks) == ("direct", 0, [])
    g = torch.Generator().manual_seed(1)
    sources = [torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g) for _ in range(3)]
    dst = torch.zeros(1000, dtype=torch.uint8)
    tickets = [engine.submit(dst, src, after=f"fence{i}") for i, src in enumerate(sources)]
    engine.wait(tickets[0])
    assert torch.equal(dst, sources[0])  # the lazy stream ran only up to the first job
    engine.wait(tickets[-1])
    assert torch.equal(dst, sources[-1])
    assert stream.fences == [(f"fence{i}", i) for i in range(3)]  # one copy per job
    read = [chunk.data_ptr() for _, chunk in stream._pending]
    assert read == [src.data_ptr() for src in sources]  # no bounce buffer in between
    engine.close()


def test_a_chunk_refilled_before_its_copy_ran_would_show() -> None:
    """The control: without the wait for a chunk's last copy, the lazy stream copies bytes of a
    later chunk, so the test above would fail."""
    stream = LazyStream()
    stream.wait_done = lambda marker: None
    engine = StagedCopyEngine(stream, chunk_bytes=64, num_chunks=2)
    src = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    engine.wait(engine.submit(dst, src, after=None))
    assert not torch.equal(dst, src)
    engine.close()


def test_wait_blocks_until_the_job_is_issued_and_errors_surface_there() -> None:
    stream = LazyStream()
    release = threading.Event()
    stream.bind = lambda: release.wait(timeout=60)  # the copy thread starts late
    engine = StagedCopyEngine(stream, chunk_bytes=16, num_chunks=2)
    src = torch.ones(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    ticket = engine.submit(dst, src, after=None)
    bad = engine.submit(torch.zeros(5, dtype=torch.uint8), src, after=None)
    assert isinstance(ticket, StagedTicket) and not ticket.issued.is_set()
    release.set()
    engine.wait(ticket)
    assert torch.equal(dst, src) and engine.read_totals().stall_s > 0
    with pytest.raises(ValueError, match="100 bytes into 5 bytes"):
        engine.wait(bad)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(dst, src, after=None)


@pytest.mark.parametrize(("layers", "step"), [((0, 1, 2, 3, 4), 2), ((1, 3, 4), 1), ((0, 2), 0)])
def test_prefetch_through_the_staged_engine_matches_resident(layers, step: int) -> None:
    """The prefetch schedule over the staged engine, chunks smaller than a layer: bitwise."""
    modules = block_stack(5, 32)
    x = torch.randn(4, 32)
    reference = run_stack(modules, x)
    engine = StagedCopyEngine(LazyStream(), chunk_bytes=512, num_chunks=2)
    offloader = PrefetchOffloader(
        OffloadConfig(layers=layers, prefetch_step=step), device="cpu", env={}, copy_engine=engine
    )
    offloader.wrap_modules(modules)
    offloader.post_init()
    for _ in range(4):
        assert torch.equal(run_stack(modules, x), reference)
    assert offloader.stats().copies > 0
    offloader.detach()
    assert torch.equal(run_stack(modules, x), reference)


def test_cuda_prefetch_from_pageable_memory_takes_the_staged_engine(monkeypatch) -> None:
    import offload.copy_engines as engines

    monkeypatch.setattr(engines, "CudaStaging", lambda device: LazyStream())
    made = engines.make_copy_engine(torch.device("cuda", 0), pinned_source=False)
    try:
        assert isinstance(made, StagedCopyEngine) and made.pinned_bytes == 2 * 8 * 2**20
        assert made.kind == "staged"
    finally:
        made.close()
    direct = engines.make_copy_engine(torch.device("cuda", 0), pinned_source=False, may_pin=False)
    try:
        assert (direct.kind, direct.pinned_bytes) == ("direct", 0)
    finally:
        direct.close()
    assert isinstance(
        engines.make_copy_engine(torch.device("cpu"), pinned_source=False),
        copy_engine_module.ThreadCopyEngine,
    )


def test_a_copy_thread_that_cannot_start_fails_every_wait_instead_of_hanging() -> None:
    stream = LazyStream()

    def bind() -> None:
        raise RuntimeError("no such device")

    stream.bind = bind
    engine = StagedCopyEngine(stream, chunk_bytes=16, num_chunks=2)
    ticket = engine.submit(
        torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8), after=None
    )
    with pytest.raises(RuntimeError, match="no such device"):
        engine.wait(ticket)
    engine.close()


def test_work_after_a_copy_runs_on_the_side_stream_after_its_chunks() -> None:
    """`then` (the prefetch offloader's dequantization) sees every byte of its copy, and the
    ticket completes only after it ran: the next copy into the buffer cannot overtake it."""
    stream = LazyStream()
    engine = StagedCopyEngine(stream, chunk_bytes=64, num_chunks=2)
    seen: list[torch.Tensor] = []
    dst = torch.zeros(1000, dtype=torch.uint8)
    sources = [torch.full((1000,), i, dtype=torch.uint8) for i in (1, 2)]
    tickets = [
        engine.submit(dst, src, after=None, then=lambda: seen.append(dst.clone()))
        for src in sources
    ]
    engine.wait(tickets[0])
    assert len(seen) == 1 and torch.equal(seen[0], sources[0])
    engine.wait(tickets[1])
    assert len(seen) == 2 and torch.equal(seen[1], sources[1])
    assert engine.read_totals().dequant_s >= 0
    engine.close()
