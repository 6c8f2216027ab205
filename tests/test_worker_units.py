"""A worker's snapshots and what they report (worker/reporting.py), and the actor class Ray
runs it as (worker/actor.py), driven in process: `Snapshots` with a stand-in for the worker's
snapshot function and, where intervals are measured, a clock the test moves; `StageActor`
around a stand-in StageWorker. No Ray, no checkpoint.

What the callers rely on: each snapshot's copy counters are the increase since the one before
(periodic and on-demand ones sharing one baseline), over the interval between them, and a
restart counts from zero again; the periodic thread takes none before the stage is ready, goes
on after one that failed (saying where), keeps the last SNAPSHOT_HISTORY; every stage reports
a pin decision and who set it; storage is counted once per storage, host memory apart; a
worker whose load or reconfigure failed is broken (its ping says why) until a load finishes,
and every actor method is the worker's of the same name."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from typing import ClassVar

import pytest
import torch
from torch import nn

from offload.errors import StageBrokenError
from offload.policy import PIN_ENV, VLLM_DISABLE_PIN_ENV, PinDecision
from offload.probe import NodeProbe
from offload.quant import BlockFormat, quantized
from offload.stats import OffloadStats
from worker import reporting
from worker.reporting import Snapshots, device_memory, pin_decision, pin_origin, storage_bytes
from worker.snapshot import CopyCounters

WAIT_S = 60.0  # bound on what a test waits for; never reached when the code is right


class Clock:
    """reporting's time.monotonic, moved by the test."""

    def __init__(self) -> None:
        self.now = 500.0

    def monotonic(self) -> float:
        return self.now


class Stage:
    """The worker's side of a snapshot: its offloader's cumulative counters now; each snapshot
    is (time, since_last)."""

    def __init__(self) -> None:
        self.stats = OffloadStats(backend="prefetch")
        self.taken = 0

    def copied(self, copies: int, nbytes: int, copy_s: float, stall_s: float) -> None:
        s = self.stats
        self.stats = OffloadStats(
            backend=s.backend,
            copies=s.copies + copies,
            copied_bytes=s.copied_bytes + nbytes,
            copy_s=s.copy_s + copy_s,
            stall_s=s.stall_s + stall_s,
        )

    def take(self, since_last):
        self.taken += 1
        return types.SimpleNamespace(time=float(self.taken), since_last=since_last(self.stats))


def test_each_snapshot_counts_the_copies_since_the_one_before(monkeypatch) -> None:
    """`since_last` is the offloader's counters' increase since the previous snapshot (the
    first: since the stage started), over the seconds between them; the increases add up to
    the counters. A restart (a new stage) counts from zero and from then."""
    clock = Clock()
    monkeypatch.setattr(reporting, "time", clock)
    stage = Stage()
    snapshots = Snapshots(stage.take, ready=lambda: True, where=lambda: "stage 0")
    clock.now += 2.0
    stage.copied(3, 300, 0.25, 0.5)
    first = snapshots.take().since_last
    assert first == CopyCounters(
        interval_s=2.0, copies=3, copied_bytes=300, copy_s=0.25, stall_s=0.5
    )
    clock.now += 5.0
    stage.copied(2, 50, 0.5, 0.25)
    second = snapshots.take().since_last
    assert second == CopyCounters(
        interval_s=5.0, copies=2, copied_bytes=50, copy_s=0.5, stall_s=0.25
    )
    clock.now += 1.0
    assert snapshots.take().since_last == CopyCounters(interval_s=1.0)  # nothing copied
    assert first.copies + second.copies == stage.stats.copies

    clock.now += 4.0
    snapshots.restart()  # a reconfigured stage: its offloader counts from zero
    stage.stats = OffloadStats(backend="uva")
    clock.now += 3.0
    stage.copied(1, 10, 0.0, 0.0)
    assert snapshots.take().since_last == CopyCounters(interval_s=3.0, copies=1, copied_bytes=10)


def test_history_since_a_time_and_the_latest(monkeypatch) -> None:
    """`history(since)`: the periodic snapshots after that time; `latest()`: the last periodic
    one, or a fresh one before any; a restart forgets the old stage's."""
    stage = Stage()
    snapshots = Snapshots(stage.take, ready=lambda: True, where=lambda: "stage 0")
    fresh = snapshots.latest()
    assert fresh.time == 1.0 and snapshots.history() == []  # taken, not kept
    for _ in range(3):
        snapshots._history.append(snapshots.take())  # what the periodic thread does
    assert [s.time for s in snapshots.history()] == [2.0, 3.0, 4.0]
    assert [s.time for s in snapshots.history(since=2.0)] == [3.0, 4.0]
    assert snapshots.history(since=4.0) == []
    assert snapshots.latest().time == 4.0 and stage.taken == 4  # no new one taken
    snapshots.restart()
    assert snapshots.history() == [] and snapshots.latest().time == 5.0


def test_the_periodic_thread_waits_for_the_stage_then_keeps_the_last_ones(
    monkeypatch, capsys
) -> None:
    """No snapshot before the stage is ready; a snapshot that fails (the stage changed under
    it) is skipped, said with where, and the next one is taken; only the last
    SNAPSHOT_HISTORY are kept. Ordered by events: the test holds the sixth snapshot until it
    has looked."""
    monkeypatch.setattr(reporting, "SNAPSHOT_HISTORY", 3)
    ready = threading.Event()
    looks_not_ready = threading.Event()
    not_ready_looks: list[int] = []
    sixth = threading.Event()
    release = threading.Event()
    stage = Stage()

    def is_ready() -> bool:
        if not ready.is_set():
            not_ready_looks.append(stage.taken)
            if len(not_ready_looks) == 3:
                looks_not_ready.set()
        return ready.is_set()

    def take(since_last):
        if stage.taken == 1 and not getattr(take, "failed", False):
            take.failed = True
            raise RuntimeError("the stage is being rebuilt")
        snapshot = stage.take(since_last)
        if stage.taken == 6:
            sixth.set()
            assert release.wait(WAIT_S)
        return snapshot

    snapshots = Snapshots(take, ready=is_ready, where=lambda: "stage 2 on host-1", interval_s=0.01)
    try:
        assert looks_not_ready.wait(WAIT_S)
        assert not_ready_looks[:3] == [0, 0, 0]  # none taken while not ready
        ready.set()
        assert sixth.wait(WAIT_S), "the periodic thread stopped"
        # snapshot 6 is being taken: 1 to 5 were kept as they came, the last 3 stay
        assert [s.time for s in snapshots.history()] == [3.0, 4.0, 5.0]
    finally:
        snapshots.stop()
        release.set()
    assert "stage 2 on host-1: snapshot skipped: the stage is being rebuilt" in (
        capsys.readouterr().err
    )


def test_every_stage_reports_a_pin_decision(monkeypatch) -> None:
    """The offloader's own decision; a stage that offloads nothing reports what its node's
    policy would decide; a setting the policy refuses is reported (pin off, source "error",
    the reason naming the variable and its value), never raised from a snapshot."""
    own = PinDecision(pin=True, reason="planned", source="probe")
    offloader = types.SimpleNamespace(pin_decision=own)
    cpu = torch.device("cpu")
    assert pin_decision(offloader, NodeProbe(), cpu) is own
    monkeypatch.delenv(VLLM_DISABLE_PIN_ENV, raising=False)
    monkeypatch.setenv(PIN_ENV, "off")
    assert pin_decision(object(), NodeProbe(), cpu) == PinDecision(
        pin=False, reason=f"{PIN_ENV}=off", source=PIN_ENV
    )
    monkeypatch.setenv(PIN_ENV, "sometimes")
    refused = pin_decision(object(), NodeProbe(), cpu)
    assert (refused.pin, refused.source) == (False, "error")
    assert refused.reason.startswith(f"invalid setting: {PIN_ENV}='sometimes'")
    monkeypatch.setenv(PIN_ENV, "on")  # forced where nothing can be pinned (a CPU)
    forced = pin_decision(object(), NodeProbe(cuda_available=True), cpu)
    assert (forced.pin, forced.source) == (False, "error")


def test_the_pin_origin_says_who_set_the_variable_behind_the_decision() -> None:
    spec = types.SimpleNamespace(
        env={PIN_ENV: "off", VLLM_DISABLE_PIN_ENV: "1"},
        env_origins={PIN_ENV: "node label offload.pin=off"},
    )
    plain = types.SimpleNamespace(env={}, env_origins={})

    def by(source: str) -> PinDecision:
        return PinDecision(pin=False, reason="r", source=source)

    assert pin_origin(by(PIN_ENV), spec) == "node label offload.pin=off"
    assert pin_origin(by(VLLM_DISABLE_PIN_ENV), spec) == "job override"
    assert pin_origin(by(PIN_ENV), plain) == "node environment"
    assert pin_origin(by("probe.cuda"), spec) == "probe"
    assert pin_origin(None, spec) == "none"


def test_storage_is_counted_once_per_storage_and_host_memory_apart() -> None:
    """Parameters that share a storage (tied weights, views) count it once; meta parameters
    (not built yet) nothing; storages behind the offloader's host tensors (UVA views of its
    arena, quantized values and scales) are host memory, not the device's."""
    module = nn.Module()
    shared = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    module.a = nn.Parameter(shared[:32])
    module.b = nn.Parameter(shared[32:])  # a view: the same storage
    module.c = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))  # 20 bytes
    module.d = nn.Parameter(torch.empty(1000, device="meta"))
    assert storage_bytes(module) == 256 + 20

    arena = torch.zeros(16, dtype=torch.float32)
    held = quantized(torch.randn(4, 8), BlockFormat(torch.float8_e4m3fn, (2, 4)))
    module.e = nn.Parameter(arena[4:], requires_grad=False)  # a view of the arena
    module.f = nn.Parameter(held.q.view(torch.uint8), requires_grad=False)
    module.g = nn.Parameter(held.scales, requires_grad=False)
    with_host = storage_bytes(module)
    host = {"layers.0.w": arena[:4], "layers.1.w": held}
    assert storage_bytes(module, host) == 256 + 20
    assert with_host == 256 + 20 + 64 + held.q.nbytes + held.scales.nbytes


def test_a_simulated_gpus_free_bytes_are_its_budget_less_what_the_stage_holds() -> None:
    cpu = torch.device("cpu")
    assert device_memory(cpu, 1000, 300) == (700, 1000)
    assert device_memory(cpu, 1000, 1300) == (0, 1000)  # never negative
    assert device_memory(cpu, None, 300) == (0, 0)  # no size given


# --- the actor ---------------------------------------------------------------------------------


class Worker:
    """A StageWorker as the actor uses it: each call recorded, `fail` (a method name) raises."""

    made: ClassVar[list] = []

    def __init__(self, spec, **options) -> None:
        Worker.made.append((spec, options))
        self.calls: list = []
        self.fail: dict[str, BaseException] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def method(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name in self.fail:
                raise self.fail.pop(name)
            if name == "batch_ring":
                return iter(["ring-0", "ring-1"])
            return f"{name}-result"

        return method


@pytest.fixture
def actor(monkeypatch):
    import worker.worker as worker_module
    from worker.actor import StageActor

    Worker.made = []
    monkeypatch.setattr(worker_module, "StageWorker", Worker)
    made = StageActor("spec", device="cpu", num_threads=2)
    assert Worker.made == [("spec", {"device": "cpu", "num_threads": 2})]
    return made


LOAD_STEPS = [
    ("prepare", ()),
    ("reconfigure", ("new spec",)),
    ("load_chunk", (3,)),
    ("finish_load", ()),
    ("load", ()),
]


@pytest.mark.parametrize(("step", "args"), LOAD_STEPS, ids=[s for s, _ in LOAD_STEPS])
def test_a_failed_load_step_breaks_the_worker_until_a_load_finishes(actor, step, args) -> None:
    """Healthy is ready, not answering: a failed load or reconfigure step leaves the worker
    broken, its ping saying which step failed and why (so the runtime replaces it); steps that
    do not finish a load leave it broken; finish_load (or load) makes it whole."""
    assert actor.ping() == "ping-result"
    actor.worker.fail[step] = MemoryError("CUDA out of memory")
    with pytest.raises(MemoryError):
        getattr(actor, step)(*args)
    with pytest.raises(StageBrokenError, match=rf"its {step} failed: MemoryError: CUDA out of"):
        actor.ping()
    actor.prepare()
    actor.load_chunk(0)
    actor.reconfigure("another spec")
    with pytest.raises(StageBrokenError, match=rf"its {step} failed"):
        actor.ping()  # still: no load finished
    actor.finish_load()
    assert actor.ping() == "ping-result"
    actor.worker.fail["load"] = KeyboardInterrupt()  # interrupted mid-load: broken too
    with pytest.raises(KeyboardInterrupt):
        actor.load()
    with pytest.raises(StageBrokenError, match="its load failed: KeyboardInterrupt"):
        actor.ping()
    assert actor.load() == "load-result" and actor.ping() == "ping-result"


def test_every_actor_method_is_the_workers_of_the_same_name(actor) -> None:
    calls = [
        ("prepare", (), {}),
        ("reconfigure", ("s",), {}),
        ("load_chunk", (2,), {}),
        ("finish_load", (), {}),
        ("load", (), {}),
        ("forward", ("ids",), {"positions": 3}),
        ("step", (1, 2), {"k": "v"}),
        ("batch_step", ("rows",), {"epoch": 4}),
        ("kv_cache_bytes", (), {}),
        ("device_bytes", (), {}),
        ("history", (12.5,), {}),
        ("latest", (), {}),
        ("report", (), {}),
        ("node_probe", (({"a": 1}, "bf16", 2),), {}),
        ("ping", (), {}),
        ("close", (), {}),
    ]
    for name, args, kwargs in calls:
        result = getattr(actor, name)(*args, **kwargs)
        if name != "close":
            assert result == f"{name}-result", name
    assert actor.claim(("engine", 3), True) is None
    assert actor.release(("engine", 3)) is None
    assert list(actor.batch_ring("steps", n=2)) == ["ring-0", "ring-1"]  # streamed as yielded
    assert actor.worker.calls == [
        *calls,
        ("claim", (("engine", 3), True), {}),
        ("release", (("engine", 3),), {}),
        ("batch_ring", ("steps",), {"n": 2}),
    ]


def test_the_actors_module_imports_no_torch() -> None:
    """Ray imports an actor's class module in every process that gets a handle (a keeper holds
    its workers'): this one imports no torch and no worker code; the worker's process imports
    them when the actor is built."""
    code = (
        "import sys, worker.actor; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'transformers') or m == 'worker.worker'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
