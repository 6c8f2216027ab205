"""The node probe: real values on this machine, and failures recorded instead of raised."""

from __future__ import annotations

import platform
import resource
from types import SimpleNamespace

import psutil
import pytest
import torch

import offload.probe as probe_mod
from offload import probe_node


def test_probe_of_this_machine() -> None:
    probe = probe_node()
    assert probe.cuda_available == torch.cuda.is_available()
    assert len(probe.devices) == (torch.cuda.device_count() if probe.cuda_available else 0)
    assert probe.cpu_arch == platform.machine()
    total = psutil.virtual_memory().total
    assert probe.host_total_bytes == total
    assert 0 < probe.host_available_bytes <= total
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    expected = None if soft == resource.RLIM_INFINITY else soft
    assert probe.memlock_limit_bytes == expected
    assert probe.errors == ()
    assert probe.to_dict()["cpu_arch"] == platform.machine()


def test_failing_step_is_recorded_and_the_rest_still_runs() -> None:
    def broken(fields: dict, errors: list) -> None:
        raise OSError("/proc is not mounted")

    steps = dict(probe_mod.PROBE_STEPS, host_memory=broken)
    probe = probe_node(steps)
    assert probe.host_total_bytes is None and probe.host_available_bytes is None
    assert probe.cpu_arch == platform.machine()  # later steps ran
    assert probe.errors == ("host_memory: OSError: /proc is not mounted",)


def test_wsl_is_detected_from_the_kernel_release(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SimpleNamespace(release="5.15.167.4-microsoft-standard-WSL2")
    monkeypatch.setattr(probe_mod.platform, "uname", lambda: fake)
    assert probe_node().is_wsl
    fake.release = "6.8.0-45-generic"
    assert not probe_node().is_wsl


def test_cuda_device_without_driver_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU whose driver cannot be asked for ATS attributes is still listed, with the
    attributes unknown (None) and the reason in errors."""
    props = SimpleNamespace(name="NVIDIA GH200 480GB", major=9, minor=0, total_memory=96 * 2**30,
                            is_integrated=0)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)

    def no_driver(index: int) -> dict:
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(probe_mod, "_cuda_driver_attributes", no_driver)
    probe = probe_node()
    assert probe.cuda_available
    (device,) = probe.devices
    assert (device.name, device.capability, device.integrated) == (
        "NVIDIA GH200 480GB",
        (9, 0),
        False,
    )
    assert device.pageable_memory_access_uses_host_page_tables is None
    assert not probe.any_coherent_unified_memory  # unknown is not claimed as coherent
    assert any("libcuda.so.1" in e for e in probe.errors)


def test_cuda_device_with_ats_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(name="NVIDIA GH200 480GB", major=9, minor=0, total_memory=96 * 2**30,
                            is_integrated=0)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(
        probe_mod,
        "_cuda_driver_attributes",
        lambda i: dict(pageable_memory_access=True, host_register_supported=True,
                       pageable_memory_access_uses_host_page_tables=True),
    )  # fmt: skip
    probe = probe_node()
    assert probe.any_coherent_unified_memory and probe.errors == ()
