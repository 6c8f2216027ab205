"""The CPU copy engine: FIFO order, errors surface at wait, overlap with the caller; the CUDA
engine's counters read from another thread (fake events: completion decided by the test)."""

from __future__ import annotations

import threading

import pytest
import torch

from offload.copy_engine import CudaCopyEngine, EventTimes, ThreadCopyEngine


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


class FakeEvent:
    """A timing event whose completion the test decides (CUDA's, without a GPU)."""

    def __init__(self, at_ms: float, *, complete: bool = True) -> None:
        self.at_ms = at_ms
        self.complete = complete

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.complete and end.complete, "elapsed_time of an event still pending"
        return end.at_ms - self.at_ms


def test_event_times_fold_only_completed_pairs_and_keep_the_rest() -> None:
    times = EventTimes()
    times.add(FakeEvent(0), FakeEvent(2))
    late = FakeEvent(10, complete=False)
    times.add(FakeEvent(5), late)
    assert times.fold() == pytest.approx(0.002)
    assert len(times) == 1 and times.fold() == 0.0  # pending: not read, not dropped
    late.complete = True
    assert times.fold() == pytest.approx(0.005) and len(times) == 0


def test_event_times_count_every_pair_added_while_another_thread_folds() -> None:
    times = EventTimes()
    num_pairs = 20_000
    folded = []
    adding = threading.Event()

    def reader() -> None:
        adding.wait(timeout=10)
        while len(folded) < 200 or len(times):
            folded.append(times.fold())

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(num_pairs):
        times.add(FakeEvent(0), FakeEvent(1))
        if i == 100:
            adding.set()
    adding.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert sum(folded) + times.fold() == pytest.approx(num_pairs * 1e-3)


def test_cuda_totals_are_read_without_synchronising_the_device(monkeypatch) -> None:
    """A snapshot thread reads the totals while copies are in flight: the completed ones count,
    the device is never synchronised (it would stall the actor's stream for the snapshot)."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())

    def no_sync(*args, **kwargs):
        raise AssertionError("read_totals synchronised the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    engine = CudaCopyEngine(torch.device("cuda", 0))
    engine._copy_times.add(FakeEvent(0), FakeEvent(4))
    engine._copy_times.add(FakeEvent(4), FakeEvent(8, complete=False))
    engine._stall_times.add(FakeEvent(1), FakeEvent(2))
    totals = engine.read_totals()
    assert (totals.copy_s, totals.stall_s) == (pytest.approx(0.004), pytest.approx(0.001))


def test_pageable_copies_bounce_through_pinned_chunks_only_where_the_node_pins() -> None:
    """Issue 57: the staged engine's bounce chunks are pinned memory, so it serves only nodes
    whose decision pins; with pinning off the copies read pageable memory (the direct engine:
    the driver stages them on a copy thread), and nothing is pinned. Where both may serve, the
    faster by the node's measured rates."""
    from offload.copy_engines import copy_engine_kind
    from offload.probe import NodeProbe

    def kind(may_pin: bool, direct: float | None, staged: float | None) -> str:
        probe = NodeProbe(
            cuda_available=True, link_pageable_bytes_per_s=direct, link_staged_bytes_per_s=staged
        )
        return copy_engine_kind("cuda", pinned_source=False, may_pin=may_pin, probe=probe)

    assert copy_engine_kind("cuda", pinned_source=False, may_pin=True) == "staged"  # no rates
    assert copy_engine_kind("cuda", pinned_source=False, may_pin=False) == "direct"
    assert copy_engine_kind("cuda", pinned_source=True, may_pin=True) == "cuda"
    assert kind(True, direct=10e9, staged=20e9) == "staged"
    assert kind(True, direct=30e9, staged=20e9) == "direct"  # a coherent part's C2C link
    assert kind(True, direct=20e9, staged=20e9) == "direct"  # a tie pins nothing
    assert kind(True, direct=10e9, staged=None) == "direct"  # the chunks could not be pinned
    assert kind(True, direct=None, staged=5e9) == "staged"
    assert kind(False, direct=10e9, staged=20e9) == "direct"  # faster, but pinning is off
    for may_pin in (True, False):
        assert copy_engine_kind("cpu", pinned_source=False, may_pin=may_pin) == "thread"


@pytest.mark.parametrize(
    ("env", "measured", "may_pin", "engine"),
    [
        # the arena is too big to pin, but bounce chunks may be: the rates measured here decide
        ({}, (8e9, 20e9), True, "staged"),
        ({}, (30e9, 20e9), True, "direct"),
        # pinning off by the user: nothing pinned, nothing measured
        ({"OFFLOAD_PIN_MEMORY": "off"}, None, False, "direct"),
        ({"VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY": "1"}, None, False, "direct"),
    ],
)
def test_a_pageable_arena_takes_the_engine_its_nodes_rates_choose(
    monkeypatch, env, measured, may_pin: bool, engine: str
) -> None:
    """Issue 57 point 7: the prefetch offloader's engine for a pageable CUDA arena. Where the
    node's decision rules out pinning only the arena's bytes (more than the host's headroom),
    its bounce chunks may still be pinned, and the faster of staged and direct by this node's
    link rates (measured here, since the worker's probe does not carry them) serves it."""
    import contextlib
    import dataclasses
    from types import SimpleNamespace

    import offload.prefetch as prefetch
    from offload.copy_engines import copy_engine_kind
    from offload.host_store import decide_for_device
    from offload.probe import DeviceInfo, NodeProbe

    gib = 2**30
    probe = NodeProbe(
        cuda_available=True,
        devices=(
            DeviceInfo(
                index=0,
                name="NVIDIA H100 80GB HBM3",
                capability=(9, 0),
                total_memory_bytes=80 * gib,
                integrated=False,
                host_register_supported=True,
            ),
        ),
        host_available_bytes=10 * gib,
    )
    device = torch.device("cuda", 0)
    decision = decide_for_device(env, probe, 9 * gib, device)
    assert not decision.pin  # 9 GiB do not fit the headroom of 10 GiB (or the user said off)
    measures: list[set] = []

    def probe_node(steps):
        measures.append(set(steps))
        direct, staged = measured
        return NodeProbe(link_pageable_bytes_per_s=direct, link_staged_bytes_per_s=staged)

    chosen: dict = {}

    def make(device, *, pinned_source, may_pin, probe):
        chosen.update(may_pin=may_pin, probe=probe)
        return copy_engine_kind(
            device.type, pinned_source=pinned_source, may_pin=may_pin, probe=probe
        )

    monkeypatch.setattr(prefetch, "probe_node", probe_node)
    monkeypatch.setattr(prefetch, "make_copy_engine", make)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    offloader = SimpleNamespace(pin_decision=decision, device=device, _env=env)
    assert prefetch.PrefetchOffloader._copy_engine(offloader, False, probe) == engine
    assert chosen["may_pin"] is may_pin
    assert measures == ([{"link"}] if measured else [])
    # the node's facts are kept: only the rates were added
    assert (
        dataclasses.replace(
            chosen["probe"], link_pageable_bytes_per_s=None, link_staged_bytes_per_s=None
        )
        == probe
    )
