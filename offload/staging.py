"""Prefetch from pageable host memory that keeps its overlap: a pinned bounce buffer.

CUDA stages a host-to-device copy from pageable memory through a driver buffer and blocks the
calling thread until it is done. With the arena left pageable (WSL, vLLM's variable, prefetch
forced on a coherent node) the copy of layer i+k would therefore run on the compute thread and
copies and compute would serialise, while the planner prices max(compute, transfer).

`StagedCopyEngine` keeps the copies off the compute thread: a copy thread memcpy's each job,
chunk by chunk, from the pageable arena into a few small pinned chunks, and issues each chunk's
asynchronous copy to the device on a side stream. Its rate is the lower of the host memcpy and
the pinned link; the compute thread only waits where a layer's copy is not issued yet.

Ordering (the copy thread and the side stream are both FIFO, so copies into one slot land in
submission order, as with `CudaCopyEngine`):
- the side stream waits on the job's compute fence before any of its chunks lands in the slot
  (the slot's previous layer may still be read);
- a chunk is refilled only after the device copy that last read it has completed: the copy
  thread waits on that copy's event (never the compute thread);
- `wait(ticket)` first waits, on the host, until the copy thread has issued the job's last chunk
  and recorded its `done` marker, then makes the compute stream wait on it: a stream told to
  wait on an event not yet recorded does not wait at all.

Where nothing may be pinned (the node's decision is off), the same engine runs with no chunks
(`num_chunks=0`, the "direct" engine): the copy thread issues each job's copy from the pageable
arena itself, and the driver stages it through buffers of its own. The copy thread, not the
compute thread, is the one the driver blocks, so the copies still overlap compute, at the
pageable rate the probe measures. Which of the two serves a pageable arena, where both may, is
the faster by the probe's rates (`NodeProbe.pageable_engine`).

The device operations are a small `Staging` object, so the chunking and ordering run and are
tested on the CPU with a stand-in stream (tests/test_staging.py); `CudaStaging` is the real one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from offload.arena import host_buffer
from offload.copy_engine import COPY_WAIT_TIMEOUT_S, CopyEngine, _copy_bytes

# Two chunks: the copy thread fills one while the device reads the other. 8 MiB each (a power
# of two: the pinned allocator rounds up to one) amortises the per-copy launch cost (~10 us)
# over ~0.2 ms of PCIe 5 transfer, and costs 16 MiB of pinned memory per engine.
STAGING_CHUNK_BYTES = 8 * 2**20
NUM_STAGING_CHUNKS = 2


class Staging(Protocol):
    """The device side of a staged copy. Markers are whatever the device uses (CUDA events)."""

    def bind(self) -> None:
        """Called once on the copy thread before its first job."""

    def new_chunk(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of `nbytes` bytes (uint8)."""

    def fence(self) -> object | None:
        """A marker of all compute issued so far (see `CopyEngine.fence`)."""

    def wait_fence(self, fence: object | None) -> None:
        """Make the side stream wait for `fence` before the copies issued after this call."""

    def copy_async(self, dst: torch.Tensor, chunk: torch.Tensor) -> object:
        """Issue chunk -> dst on the side stream; the marker completes once `chunk` is read."""

    def wait_done(self, marker: object) -> None:
        """Block the calling (copy) thread until `marker` has completed."""

    def record(self) -> object:
        """A marker after every copy issued so far on the side stream."""

    def run(self, work: Callable[[], None]) -> None:
        """Issue `work` (device kernels) on the side stream, after the copies issued so far."""

    def compute_wait(self, marker: object) -> None:
        """Make the compute stream wait for `marker` (without blocking the host)."""

    def synchronize(self) -> None:
        """Block until every copy issued on the side stream has completed."""


class CudaStaging:
    """`Staging` on a CUDA device: a side stream, events, pinned chunks."""

    def __init__(self, device: torch.device) -> None:
        if device.index is None:  # the copy thread must name it: set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def bind(self) -> None:
        torch.cuda.set_device(self.device)  # a new thread starts on device 0

    def new_chunk(self, nbytes: int) -> torch.Tensor:
        # pinned: chunks are made only where the node's decision pins (`make_copy_engine`)
        return host_buffer(nbytes, pin=True)

    def fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_fence(self, fence: object | None) -> None:
        if fence is not None:
            self.stream.wait_event(fence)

    def copy_async(self, dst: torch.Tensor, chunk: torch.Tensor) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            dst.copy_(chunk, non_blocking=True)
        return self.record()

    def wait_done(self, marker: torch.cuda.Event) -> None:
        marker.synchronize()

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def run(self, work: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            work()

    def compute_wait(self, marker: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(marker)

    def synchronize(self) -> None:
        self.stream.synchronize()


def chunk_spans(nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each chunk of a copy of `nbytes` bytes, in order."""
    for offset in range(0, nbytes, chunk_bytes):
        yield offset, min(chunk_bytes, nbytes - offset)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("a staged copy needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


class StagedTicket:
    """One job: set once the copy thread has issued its last chunk (or failed)."""

    __slots__ = ("error", "issued", "marker")

    def __init__(self) -> None:
        self.issued = threading.Event()
        self.marker: object | None = None
        self.error: BaseException | None = None


class StagedCopyEngine(CopyEngine):
    """Copies from pageable host memory through pinned chunks, on a copy thread; with
    `num_chunks=0`, straight from the source, on the copy thread (the module doc's "direct").

    Timings: `copy_s` is the copy thread's time per job (memcpy into the chunks, issuing their
    copies, waiting for a free chunk), the staged path's bottleneck; `stall_s` is the time the
    compute thread waited for a job to be issued.
    """

    def __init__(
        self,
        staging: Staging,
        *,
        chunk_bytes: int = STAGING_CHUNK_BYTES,
        num_chunks: int = NUM_STAGING_CHUNKS,
    ) -> None:
        super().__init__()
        if chunk_bytes <= 0 or num_chunks < 0:
            raise ValueError(
                f"chunk_bytes={chunk_bytes} must be > 0 and num_chunks={num_chunks} >= 0"
            )
        self.staging = staging
        self.chunk_bytes = chunk_bytes
        self.chunks = [staging.new_chunk(chunk_bytes) for _ in range(num_chunks)]
        self._free: list[object | None] = [None] * num_chunks  # the copy that last read each
        self._next_chunk = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: StagedTicket | None = None
        self._thread = threading.Thread(target=self._run, name="offload-stage", daemon=True)
        self._thread.start()

    @property
    def kind(self) -> str:
        return "staged" if self.chunks else "direct"

    @property
    def pinned_bytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)

    def _run(self) -> None:
        broken: BaseException | None = None
        try:
            self.staging.bind()
        except BaseException as exc:  # every job fails with it, at its wait: none hangs
            broken = exc
        while True:
            job = self._jobs.get()
            if job is None:
                return
            dst, src, after, then, ticket = job
            start = copied = time.perf_counter()
            try:
                if broken is not None:
                    raise broken
                self._stage(dst, src, after)
                copied = time.perf_counter()
                if then is not None:
                    self.staging.run(then)
                ticket.marker = self.staging.record()
            except BaseException as exc:
                ticket.error = exc
            finally:
                with self._lock:
                    self.totals.copy_s += copied - start
                    self.totals.dequant_s += time.perf_counter() - copied
                ticket.issued.set()

    def _stage(self, dst: torch.Tensor, src: torch.Tensor, after: object | None) -> None:
        dst, src = _flat_bytes(dst), _flat_bytes(src)
        if dst.numel() != src.numel():
            raise ValueError(f"staged copy of {src.numel()} bytes into {dst.numel()} bytes")
        self.staging.wait_fence(after)
        if not self.chunks:  # direct: the driver stages pageable memory itself
            self.staging.copy_async(dst, src)
            return
        for offset, length in chunk_spans(src.numel(), self.chunk_bytes):
            index = self._next_chunk
            self._next_chunk = (index + 1) % len(self.chunks)
            if self._free[index] is not None:
                self.staging.wait_done(self._free[index])  # its last copy has read it
            chunk = self.chunks[index][:length]
            _copy_bytes(chunk, src[offset : offset + length])
            self._free[index] = self.staging.copy_async(dst[offset : offset + length], chunk)

    def fence(self) -> object | None:
        return self.staging.fence()

    def submit(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        after: object | None,
        then: Callable[[], None] | None = None,
    ) -> StagedTicket:
        if not self._thread.is_alive():
            raise RuntimeError("the copy engine is closed")
        ticket = StagedTicket()
        with self._lock:
            self.totals.copies += 1
            self.totals.copied_bytes += src.nbytes
        self._jobs.put((dst, src, after, then, ticket))
        self._last = ticket
        return ticket

    def wait(self, ticket: StagedTicket) -> None:
        if not ticket.issued.is_set():
            start = time.perf_counter()
            if not ticket.issued.wait(COPY_WAIT_TIMEOUT_S):
                raise TimeoutError(f"a staged copy was not issued within {COPY_WAIT_TIMEOUT_S} s")
            with self._lock:
                self.totals.stall_s += time.perf_counter() - start
        if ticket.error is not None:
            raise ticket.error
        self.staging.compute_wait(ticket.marker)

    def synchronize(self) -> None:
        # Waits for completion only: a failed job raises at the `wait` for its ticket.
        last = self._last
        if last is not None and not last.issued.wait(COPY_WAIT_TIMEOUT_S):
            raise TimeoutError(f"copy engine did not drain within {COPY_WAIT_TIMEOUT_S} s")
        self.staging.synchronize()

    def close(self) -> None:
        if self._thread.is_alive():
            self.synchronize()
            self._jobs.put(None)
            self._thread.join(timeout=COPY_WAIT_TIMEOUT_S)
