"""The stage worker as Ray runs it: `StageActor`, an actor class whose module imports no torch,
holding a `worker.worker.StageWorker` that it builds in the actor's process.

Ray loads an actor's class in every process that gets a handle to one, to learn its methods. A
named load's keeper holds its workers' handles (it runs the load's engine and recovers lost
workers): with `ray.remote(StageWorker)` it imported `worker.worker`, and with it torch and the
model's transformers modules, only to learn method names (~5 CPU-s to start and ~250 MiB for
as long as the load). With this class it imports this module; the worker's process imports
the rest when the actor is built, as before.

Each method is the worker's method of the same name (see `StageWorker` for what it does);
in-process callers (tests, the family check, the compute probe) use `StageWorker` itself.

A worker is healthy when it is ready, not when it answers: a load or reconfigure that fails
(out of memory, a timeout, a read) leaves it broken, and its `ping` then raises
`StageBrokenError` saying why, so the runtime counts it as lost and replaces it
(`coordinator.runtime.group.gone_parts`). A load that finishes makes it whole again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.worker import StageWorker


class StageActor:
    def __init__(self, spec: Any, **options: Any) -> None:
        from worker.worker import StageWorker

        self.worker: StageWorker = StageWorker(spec, **options)
        self.broken: str | None = None  # why its last load or reconfigure failed

    # loading: a failure leaves the worker broken until a load finishes
    def _loading(self, what: str, call, *args: Any) -> Any:
        try:
            result = call(*args)
        except BaseException as exc:
            self.broken = f"its {what} failed: {type(exc).__name__}: {exc}"
            raise
        if what in ("finish_load", "load"):
            self.broken = None
        return result

    def prepare(self) -> dict[int, int]:
        return self._loading("prepare", self.worker.prepare)

    def reconfigure(self, spec: Any) -> dict[int, int]:
        return self._loading("reconfigure", self.worker.reconfigure, spec)

    def load_chunk(self, index: int) -> int:
        return self._loading("load_chunk", self.worker.load_chunk, index)

    def finish_load(self) -> Any:
        return self._loading("finish_load", self.worker.finish_load)

    def load(self) -> Any:
        return self._loading("load", self.worker.load)

    # running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.worker.forward(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.worker.step(*args, **kwargs)

    def claim(self, owner: tuple[str, int], take: bool = False) -> None:
        self.worker.claim(owner, take)

    def release(self, owner: tuple[str, int]) -> None:
        self.worker.release(owner)

    def batch_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.worker.batch_step(*args, **kwargs)

    def batch_ring(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        # a generator, as the worker's: Ray streams what it yields (num_returns="streaming")
        yield from self.worker.batch_ring(*args, **kwargs)

    # reporting
    def kv_cache_bytes(self) -> int:
        return self.worker.kv_cache_bytes()

    def device_bytes(self) -> int:
        return self.worker.device_bytes()

    def history(self, since: float = 0.0) -> list:
        return self.worker.history(since)

    def latest(self) -> Any:
        return self.worker.latest()

    def report(self) -> Any:
        return self.worker.report()

    def node_probe(self, model: tuple[dict, str, int] | None = None) -> dict:
        return self.worker.node_probe(model)

    def ping(self) -> int:
        """The worker's pid; StageBrokenError (why) when its last load or reconfigure failed."""
        if self.broken is not None:
            from offload.errors import StageBrokenError

            raise StageBrokenError(self.broken)
        return self.worker.ping()

    def close(self) -> None:
        self.worker.close()
