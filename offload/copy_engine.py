"""Copy engines: who moves bytes from host memory into device slots, concurrently with compute.

Both engines expose the same four operations, so the prefetch logic above them is identical on
a GPU and on the CPU (where it is tested and benchmarked):

- `fence()`: a marker of "all compute issued so far"; a copy submitted `after` it must not start
  writing before that compute is done (the slot it overwrites may still be read).
- `submit(dst, src, after=..., then=...)`: start copying, return a ticket. `then`, if given,
  runs after the copy on the copy side (the side stream, the copy thread) and before the ticket
  completes: the prefetch offloader dequantizes 8-bit weights there (`offload.quant`), so the
  compute side waits for weights that are ready to use, and the dequantization overlaps compute.
- `wait(ticket)`: make the compute side wait until that copy has landed.
- `synchronize()`: wait for every copy (before detach or close).

`CudaCopyEngine` uses a side stream and events. `ThreadCopyEngine` uses one background thread
doing `memmove`, the CPU's stand-in for a DMA engine: a single queue, FIFO, so two copies into
the same slot land in the order they were submitted, as on a CUDA stream. From pageable memory
on CUDA, `offload.staging.StagedCopyEngine` bounces the copies through pinned chunks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

import torch

# A copy of one layer takes milliseconds; a wait this long means the copy thread is wedged.
COPY_WAIT_TIMEOUT_S = 300.0
# Completed timing events are folded into the totals once this many are pending, so a
# long-running server that nobody reads does not accumulate them without bound.
MAX_PENDING_TIMING_EVENTS = 4096


@dataclass(slots=True)
class CopyTotals:
    copies: int = 0
    copied_bytes: int = 0
    copy_s: float = 0.0
    stall_s: float = 0.0
    dequant_s: float = 0.0  # time of the `then` steps after copies (dequantizing 8-bit weights)


class CopyEngine(ABC):
    # Which engine it is, as `offload.copy_engines.copy_engine_kind` names them, and the pinned
    # host bytes it holds of its own (bounce chunks; not the arena it copies from).
    kind = ""
    pinned_bytes = 0

    def __init__(self) -> None:
        self.totals = CopyTotals()
        # The counters: the engine's user (or its copy thread) writes, a snapshot thread reads.
        self._lock = threading.Lock()

    @abstractmethod
    def fence(self) -> object | None: ...

    @abstractmethod
    def submit(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        after: object | None,
        then: Callable[[], None] | None = None,
    ) -> object: ...

    @abstractmethod
    def wait(self, ticket: object) -> None: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    def read_totals(self) -> CopyTotals:
        with self._lock:
            return dataclasses.replace(self.totals)

    def close(self) -> None:
        self.synchronize()


class ThreadCopyEngine(CopyEngine):
    """Copies on one daemon thread. Compute on the CPU is synchronous in the caller's thread, so
    by the time a copy is submitted the compute before it is done: `fence()` is None."""

    kind = "thread"

    def __init__(self) -> None:
        super().__init__()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Future | None = None
        self._thread = threading.Thread(target=self._run, name="offload-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            dst, src, then, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                start = time.perf_counter()
                _copy_bytes(dst, src)
                copied = time.perf_counter()
                if then is not None:
                    then()
                with self._lock:
                    self.totals.copy_s += copied - start
                    self.totals.dequant_s += time.perf_counter() - copied
                future.set_result(None)
            except BaseException as exc:
                future.set_exception(exc)

    def fence(self) -> None:
        return None

    def submit(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        after: object | None,
        then: Callable[[], None] | None = None,
    ) -> Future:
        if not self._thread.is_alive():
            raise RuntimeError("the copy engine is closed")
        future: Future = Future()
        with self._lock:
            self.totals.copies += 1
            self.totals.copied_bytes += src.nbytes
        self._jobs.put((dst, src, then, future))
        self._last = future
        return future

    def wait(self, ticket: Future) -> None:
        if ticket.done():
            ticket.result()  # re-raise a failed copy
            return
        start = time.perf_counter()
        ticket.result(timeout=COPY_WAIT_TIMEOUT_S)
        with self._lock:
            self.totals.stall_s += time.perf_counter() - start

    def synchronize(self) -> None:
        # Waits for completion only: a failed copy raises at the `wait` for its ticket, and the
        # arena, not the slot, stays the source of truth for detach.
        if self._last is not None:
            done, _ = futures.wait([self._last], timeout=COPY_WAIT_TIMEOUT_S)
            if not done:
                raise TimeoutError(f"copy engine did not drain within {COPY_WAIT_TIMEOUT_S} s")

    def close(self) -> None:
        if self._thread.is_alive():
            self.synchronize()
            self._jobs.put(None)
            self._thread.join(timeout=COPY_WAIT_TIMEOUT_S)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """memmove for contiguous CPU bytes: one thread, no intra-op pool fighting the compute
    threads for cores, and ctypes releases the GIL for the call."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.nbytes == src.nbytes
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
    else:
        dst.copy_(src)


class EventTimes:
    """Pairs of (start, end) timing events whose elapsed time is still to be counted.

    The thread that issues work adds pairs; whoever reads the totals (a worker's snapshot
    thread, concurrently) folds them: both under one lock, and a fold takes only the pairs whose
    end has completed (`query()`, which never blocks; the start, recorded earlier on the same
    stream, has then completed too). The rest wait for a later fold. So reading the totals never
    synchronises the device, never asks `elapsed_time` of a pending event, and never loses or
    counts twice a pair appended during the read.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[object, object]] = []

    def add(self, start: object, end: object) -> int:
        """Add a pair; returns how many are pending."""
        with self._lock:
            self._pending.append((start, end))
            return len(self._pending)

    def fold(self) -> float:
        """Seconds between start and end, summed over the completed pairs, which are dropped."""
        done: list[tuple[object, object]] = []
        waiting: list[tuple[object, object]] = []
        with self._lock:
            for pair in self._pending:
                (done if pair[1].query() else waiting).append(pair)
            self._pending = waiting
        return sum(start.elapsed_time(end) for start, end in done) / 1e3

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


class CudaCopyEngine(CopyEngine):
    """Copies on a side stream. Ordering, all on the GPU, none of it blocking the host:
    copy stream waits on the compute fence -> copies -> records `done`; the compute stream
    waits on `done` before the layer's kernels. Timing events are folded in `read_totals()`
    from completed events only (see `EventTimes`), so neither the hot path nor a reader of the
    totals ever blocks on them. It serves pinned sources only: from pageable memory the driver
    blocks the calling thread for each copy (`offload.staging`)."""

    kind = "cuda"

    def __init__(self, device: torch.device, *, timing: bool = True) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.timing = timing
        self._copy_times = EventTimes()
        self._stall_times = EventTimes()
        self._dequant_times = EventTimes()

    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self.timing)

    def fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def submit(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        after: object | None,
        then: Callable[[], None] | None = None,
    ) -> torch.cuda.Event:
        done = self._event()
        copied = self._event() if then is not None and self.timing else done
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            start = self._event() if self.timing else None
            if start is not None:
                start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            if then is not None:
                if copied is not done:
                    copied.record(self.stream)
                then()  # kernels on the side stream, after the copy
            done.record(self.stream)
        if start is not None:
            self._copy_times.add(start, copied)
            if copied is not done:
                self._dequant_times.add(copied, done)
        with self._lock:
            self.totals.copies += 1
            self.totals.copied_bytes += src.nbytes
        return done

    def wait(self, ticket: torch.cuda.Event) -> None:
        compute = torch.cuda.current_stream(self.device)
        if self.timing:
            before = self._event()
            before.record(compute)
        compute.wait_event(ticket)
        if self.timing:
            after = self._event()
            after.record(compute)
            if self._stall_times.add(before, after) > MAX_PENDING_TIMING_EVENTS:
                self.read_totals()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def read_totals(self) -> CopyTotals:
        """The totals so far: counters as issued, times of the copies and stalls that have
        completed (those still in flight are counted by a later read). Safe from any thread."""
        copy_s, stall_s = self._copy_times.fold(), self._stall_times.fold()
        dequant_s = self._dequant_times.fold()
        with self._lock:
            self.totals.copy_s += copy_s
            self.totals.stall_s += stall_s
            self.totals.dequant_s += dequant_s
            return dataclasses.replace(self.totals)
