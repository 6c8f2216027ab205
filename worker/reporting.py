"""A worker's snapshots over time: taken on demand (`report`) and every few seconds by a
background thread, the last SNAPSHOT_HISTORY kept, each carrying the offloader's copy counters
since the snapshot before it (so a series shows rates). What a snapshot holds is
`worker.snapshot.StageSnapshot`, filled in by the worker (`StageWorker._snapshot`); this module
takes, keeps and paces them, and works out the parts that need no worker state: the pin
decision and where it came from, storage bytes."""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

import torch
from torch import nn

from offload.host_store import decide_for_device
from offload.policy import PIN_ENV, VLLM_DISABLE_PIN_ENV, PinDecision
from offload.quant import QuantizedTensor
from offload.stats import OffloadStats
from worker.snapshot import CopyCounters, StageSnapshot

SNAPSHOT_HISTORY = 360  # periodic snapshots kept: an hour at 10 s
_NO_COPIES = OffloadStats(backend="none")  # the counters before a stage's first snapshot


class Snapshots:
    """`take(since_last)` builds one snapshot, given the function that turns the offloader's
    counters into their increase since the previous snapshot. Snapshots are taken one at a
    time (the periodic thread and callers share the counters); the thread skips ticks while
    `ready()` is false and says on stderr (naming `where()`) when a snapshot fails."""

    def __init__(
        self,
        take: Callable[[Callable[[OffloadStats], CopyCounters]], StageSnapshot],
        *,
        ready: Callable[[], bool],
        where: Callable[[], str],
        interval_s: float = 0.0,
    ) -> None:
        self._take = take
        self._ready = ready
        self._where = where
        self._started = time.monotonic()
        self._last_counters: tuple[OffloadStats, float] | None = None
        self._lock = threading.Lock()
        self._history: collections.deque[StageSnapshot] = collections.deque(maxlen=SNAPSHOT_HISTORY)
        self._stop = threading.Event()
        if interval_s > 0:
            threading.Thread(
                target=self._loop, args=(interval_s,), name="offload-snapshots", daemon=True
            ).start()

    def take(self) -> StageSnapshot:
        with self._lock:
            return self._take(self._since_last)

    def _since_last(self, stats: OffloadStats) -> CopyCounters:
        now = time.monotonic()
        previous, then = self._last_counters or (_NO_COPIES, self._started)
        self._last_counters = (stats, now)
        return CopyCounters.between(previous, stats, interval_s=now - then)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if not self._ready():
                continue
            try:
                self._history.append(self.take())
            except Exception as exc:  # the stage changed under us (reconfigure): next tick
                print(f"{self._where()}: snapshot skipped: {exc}", file=sys.stderr)

    def history(self, since: float = 0.0) -> list[StageSnapshot]:
        """The periodic snapshots taken after time `since` (seconds since the epoch)."""
        return [s for s in list(self._history) if s.time > since]

    def latest(self) -> StageSnapshot:
        """The last periodic snapshot, or a fresh one when none was taken yet."""
        history = list(self._history)
        return history[-1] if history else self.take()

    def restart(self) -> None:
        """For a new stage (reconfigure): its snapshots would pass for the new one's, and its
        offloader counts from zero again."""
        with self._lock:
            self._history.clear()
            self._last_counters = (_NO_COPIES, time.monotonic())

    def stop(self) -> None:
        self._stop.set()


def pin_decision(offloader, probe, device: torch.device) -> PinDecision:
    """The offloader's decision; for a stage that offloads nothing, what the node's policy
    would decide (so every stage reports one)."""
    decision = getattr(offloader, "pin_decision", None)
    if decision is None:
        try:
            decision = decide_for_device(os.environ, probe, 0, device)
        except (ValueError, RuntimeError) as exc:
            decision = PinDecision(pin=False, reason=f"invalid setting: {exc}", source="error")
    return decision


def pin_origin(decision: PinDecision | None, spec) -> str:
    """Who set the variable behind `decision`: the job (its override, a node label, as the
    stage's `spec` records them), the node's own environment, or nobody (the probe)."""
    if decision is None:
        return "none"
    if decision.source in (PIN_ENV, VLLM_DISABLE_PIN_ENV):
        if decision.source in spec.env:
            return spec.env_origins.get(decision.source, "job override")
        return "node environment"
    return "probe"


def storage_bytes(module: nn.Module, host: Mapping[str, torch.Tensor] | None = None) -> int:
    """Bytes behind `module`'s materialised parameters, each storage counted once, but those
    behind `host` (an offloader's host tensors: UVA parameters on the CPU stand-in are views of
    its arena, which is host memory, not the simulated GPU's)."""
    skip = {
        t.untyped_storage().data_ptr()
        for held in (host or {}).values()
        for t in ((held.q, held.scales) if isinstance(held, QuantizedTensor) else (held,))
    }
    storages = {}
    for param in module.parameters():
        if not param.is_meta:
            storage = param.untyped_storage()
            if storage.data_ptr() not in skip:
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def device_memory(
    device: torch.device, budget_bytes: int | None, used_bytes: int
) -> tuple[int, int]:
    """(free, total) bytes of a stage's device: CUDA's own count, or on the CPU stand-in the
    simulated GPU's budget less what the stage holds."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    total = budget_bytes or 0
    return max(total - used_bytes, 0), total
