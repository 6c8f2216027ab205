"""create_offloader: backend choice and its reasons, the null offloader, UVA without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import block_stack, run_stack
from test_policy import GH200, X86_H100

from offload import (
    NodeProbe,
    NoopOffloader,
    OffloadConfig,
    OffloadUnavailableError,
    PrefetchOffloader,
    create_offloader,
)
from offload.factory import choose_backend


def test_auto_on_cpu_is_prefetch_with_a_reason() -> None:
    offloader = create_offloader(OffloadConfig(layers=(0,)), device="cpu", env={})
    assert isinstance(offloader, PrefetchOffloader)
    assert "CPU device" in offloader.backend_reason


@pytest.mark.parametrize(
    ("probe", "backend", "why"),
    [(GH200, "uva", "coherent unified memory"), (X86_H100, "prefetch", "discrete GPU")],
)
def test_auto_on_cuda_follows_the_probe(probe, backend: str, why: str) -> None:
    chosen, reason = choose_backend(OffloadConfig(layers=(0,)), torch.device("cuda"), probe)
    assert chosen == backend and why in reason


def test_explicit_backend_is_kept() -> None:
    chosen, reason = choose_backend(
        OffloadConfig(backend="prefetch", layers=(0,)), torch.device("cuda"), GH200
    )
    assert (chosen, reason) == ("prefetch", "backend=prefetch requested")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_uva_on_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(OffloadUnavailableError, match="backend='prefetch' or 'auto'"):
        create_offloader(OffloadConfig(backend="uva", layers=(0,)), device="cuda", env={})


def test_auto_on_a_simulated_coherent_gpu_is_uva() -> None:
    """The CPU standing in for a GH200-class GPU (OFFLOAD_SIMULATED_GPU=coherent) takes the
    backend that hardware takes, so the uva path runs without it."""
    probe = NodeProbe(simulated_gpu="coherent")
    offloader = create_offloader(OffloadConfig(layers=(0,)), device="cpu", env={}, probe=probe)
    assert offloader.backend == "uva" and "simulated coherent GPU" in offloader.backend_reason
    plain = create_offloader(
        OffloadConfig(layers=(0,)), device="cpu", env={}, probe=NodeProbe(simulated_gpu="discrete")
    )
    assert plain.backend == "prefetch"


def test_none_offloads_nothing_and_says_so() -> None:
    modules = block_stack(3)
    x = torch.randn(2, 16)
    reference = run_stack(modules, x)
    offloader = create_offloader(OffloadConfig(backend="none"), device="cpu", env={})
    assert (
        isinstance(offloader, NoopOffloader) and "nothing is offloaded" in offloader.backend_reason
    )
    offloader.wrap_modules(modules)
    assert torch.equal(run_stack(modules, x), reference)
    stats = offloader.stats()
    total = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    assert (stats.backend, stats.offloaded_bytes, stats.resident_bytes, stats.copies) == (
        "none",
        0,
        total,
        0,
    )
    offloader.detach()


@pytest.mark.parametrize("simulated", ["discrete", "coherent"])  # prefetch, uva
def test_an_offloader_without_a_probe_measures_no_rates(monkeypatch, simulated: str) -> None:
    """Without a probe the offloaders probe what their decisions read, and never the link or
    dequantization rates (the planner's: ~0.2 s per offloader when they were measured here)."""
    from offload import link

    measured = []

    def record(name):
        return lambda *args, **kwargs: measured.append(name)

    monkeypatch.setattr(link, "measure_cpu_copy", record("copy"))
    monkeypatch.setattr(link, "measure_dequantize", record("dequantize"))
    monkeypatch.setenv("OFFLOAD_SIMULATED_GPU", simulated)
    modules = block_stack(3)
    x = torch.randn(2, 16)
    reference = run_stack(modules, x)
    offloader = create_offloader(OffloadConfig(layers=(0, 2)), device="cpu")
    assert offloader.backend == {"discrete": "prefetch", "coherent": "uva"}[simulated]
    offloader.wrap_modules(modules)
    try:
        assert torch.equal(run_stack(modules, x), reference)
        assert offloader.pin_decision is not None
    finally:
        offloader.detach()
    assert measured == []
