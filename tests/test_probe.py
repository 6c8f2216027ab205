"""The node probe: real values on this machine, and failures recorded instead of raised."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import platform
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from helpers import tiny_shape

import offload.link as link_mod
import offload.probe as probe_mod
from coordinator.tools.make_checkpoint import make_checkpoint
from offload import probe_node
from offload.probe import NodeProbe

ROOT = Path(__file__).resolve().parent.parent


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
    # The copy rate, measured: from pinned memory only where there is CUDA to pin for.
    assert probe.link_pageable_bytes_per_s > 0
    assert (probe.link_pinned_bytes_per_s is not None) == probe.cuda_available
    assert probe.link_bytes_per_s(pin=False) == probe.link_pageable_bytes_per_s
    # It crosses process boundaries (a Ray task's result) intact.
    assert pickle.loads(pickle.dumps(probe)) == probe


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
    props = SimpleNamespace(
        name="NVIDIA GH200 480GB", major=9, minor=0, total_memory=96 * 2**30, is_integrated=0
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(link_mod, "measure_host_to_device", lambda device, *, pin: 4e11)

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
    props = SimpleNamespace(
        name="NVIDIA GH200 480GB", major=9, minor=0, total_memory=96 * 2**30, is_integrated=0
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (90 << 30, props.total_memory))
    monkeypatch.setattr(link_mod, "measure_host_to_device", lambda device, *, pin: 4e11)
    monkeypatch.setattr(link_mod, "measure_staged", lambda device: 3e10)
    monkeypatch.setattr(link_mod, "measure_dequantize", lambda device, dtype: 2e12)
    monkeypatch.setattr(
        probe_mod,
        "_cuda_driver_attributes",
        lambda i: dict(
            pageable_memory_access=True,
            host_register_supported=True,
            pageable_memory_access_uses_host_page_tables=True,
        ),
    )
    probe = probe_node()
    assert probe.any_coherent_unified_memory and probe.errors == ()
    # the GPU reads pageable memory over its C2C link faster than pinned chunks could bounce it
    assert probe.pageable_engine(may_pin=True) == ("direct", 4e11)
    assert probe.devices[0].free_memory_bytes == 90 << 30  # what the budget is taken from
    assert probe.link_bytes_per_s(pin=True) == probe.link_bytes_per_s(pin=False) == 4e11
    assert probe.dequant_bytes_per_s == (("fp8", 2e12), ("int8", 2e12))


def test_dequantize_rates_are_measured_on_the_cpu() -> None:
    """The CPU stand-in measures what dequantizing costs it, per 8-bit format."""
    probe = probe_node({"dequantize": probe_mod.PROBE_STEPS["dequantize"]})
    rates = dict(probe.dequant_bytes_per_s)
    assert set(rates) == {"fp8", "int8"} and all(r > 0 for r in rates.values())


def test_host_matmul_rates_are_measured_per_rows() -> None:
    """What computing a few rows through bfloat16 weights in host memory costs this CPU, at
    each of the probe's row counts (what `--host-experts auto` weighs against the link)."""
    probe = probe_node({"host_matmul": probe_mod.PROBE_STEPS["host_matmul"]})
    rates = dict(probe.host_matmul_bytes_per_s)
    assert tuple(rates) == probe_mod.HOST_MATMUL_ROWS and all(r > 0 for r in rates.values())
    assert probe.errors == ()
    with pytest.raises(ValueError, match="num_bytes=0 must be > 0"):
        link_mod.measure_host_matmul(1, entries=0)


def test_cpu_copy_rate_is_measured() -> None:
    rate = link_mod.measure_cpu_copy(num_bytes=2**20, repeats=2)
    assert math.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="num_bytes=0 must be > 0"):
        link_mod.measure_cpu_copy(num_bytes=0)
    with pytest.raises(ValueError, match="repeats=0 must be >= 1"):
        link_mod.measure_cpu_copy(repeats=0)
    with pytest.raises(ValueError, match="device=cpu is not a CUDA device"):
        link_mod.measure_host_to_device(torch.device("cpu"), pin=False)


def test_failing_link_measurement_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs) -> float:
        raise MemoryError("cannot allocate 16 MiB")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(link_mod, "measure_cpu_copy", broken)
    probe = probe_node({"link": probe_mod._probe_link, "cpu_arch": probe_mod._probe_arch})
    assert probe.link_pageable_bytes_per_s is None and probe.link_pinned_bytes_per_s is None
    assert probe.cpu_arch == platform.machine()  # later steps ran
    assert probe.errors == ("link: MemoryError: cannot allocate 16 MiB",)


def test_cuda_link_without_pinning_keeps_the_pageable_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node where registering host memory fails still measures (and plans with) its
    pageable rate; the pinned one is unknown, with the reason in errors."""

    def measure(device: torch.device, *, pin: bool) -> float:
        if pin:
            raise RuntimeError("cudaHostRegister of 67108864 bytes failed with cudaError 1")
        return 6e9

    def staged(device: torch.device) -> float:
        raise RuntimeError("cudaHostAlloc of 8388608 bytes failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(link_mod, "measure_host_to_device", measure)
    monkeypatch.setattr(link_mod, "measure_staged", staged)
    probe = probe_node({"link": probe_mod._probe_link})
    assert (probe.link_pinned_bytes_per_s, probe.link_pageable_bytes_per_s) == (None, 6e9)
    assert probe.link_staged_bytes_per_s is None
    assert probe.link_bytes_per_s(pin=True) is None and probe.link_bytes_per_s(pin=False) == 6e9
    # a pageable arena's copies go direct: the bounce chunks could not be pinned either
    on_cuda = dataclasses.replace(probe, cuda_available=True)  # (the cuda step did not run)
    assert on_cuda.pageable_engine(may_pin=True) == ("direct", 6e9)
    assert probe.errors == (
        "link (pinned, cuda:0): RuntimeError: cudaHostRegister of 67108864 bytes failed with "
        "cudaError 1",
        "link (staged, cuda:0): RuntimeError: cudaHostAlloc of 8388608 bytes failed",
    )


def test_a_pageable_arena_is_priced_at_the_engine_it_will_use() -> None:
    """Issue 57 point 7: the rate the planner charges a node that does not pin is the direct
    engine's (nothing pinned), whatever the staged one measured; the staged rate is the one of a
    pageable arena on a node that may pin its chunks, where it is the faster."""
    probe = NodeProbe(
        cuda_available=True,
        link_pinned_bytes_per_s=50e9,
        link_pageable_bytes_per_s=8e9,
        link_staged_bytes_per_s=20e9,
    )
    assert probe.link_bytes_per_s(pin=True) == 50e9
    assert probe.link_bytes_per_s(pin=False) == 8e9
    assert probe.pageable_engine(may_pin=False) == ("direct", 8e9)
    assert probe.pageable_engine(may_pin=True) == ("staged", 20e9)
    cpu = NodeProbe(link_pageable_bytes_per_s=14e9, link_staged_bytes_per_s=99e9)
    assert cpu.pageable_engine(may_pin=True) == ("thread", 14e9)
    assert cpu.link_bytes_per_s(pin=False) == 14e9


@pytest.mark.gpu
def test_host_to_device_rates_on_cuda() -> None:
    device = torch.device("cuda", 0)
    allocated = torch.cuda.memory_allocated(device)
    pinned = link_mod.measure_host_to_device(device, pin=True, num_bytes=16 * 2**20)
    pageable = link_mod.measure_host_to_device(device, pin=False, num_bytes=16 * 2**20)
    staged = link_mod.measure_staged(device, num_bytes=16 * 2**20)
    for rate in (pinned, pageable, staged):
        assert math.isfinite(rate) and rate > 0
    # through pinned chunks, never faster than from pinned memory itself (5% for the noise)
    assert staged < pinned * 1.05
    assert torch.cuda.memory_allocated(device) == allocated  # the device buffer is freed


# A Ray probe task's process, run as a new interpreter: probes its node for a model (as the
# runtime's probe task does, `worker.node.probe_unless_cuda`) and says whether torch was
# imported. argv: the model's config.json, and optionally a glob standing for a GPU device.
PROBE_TASK = """
import json, sys
import offload.probe
if len(sys.argv) > 2:
    offload.probe.GPU_DEVICE_GLOBS = (sys.argv[2],)
from worker.node import probe_unless_cuda
config = json.load(open(sys.argv[1]))
result = probe_unless_cuda(0, (config, "float32", 1))
probe = result["probe"]
print(json.dumps({
    "torch": "torch" in sys.modules,
    "dequant": dict(probe.dequant_bytes_per_s),
    "host_matmul": probe.host_matmul_bytes_per_s,
    "link": probe.link_pageable_bytes_per_s,
    "compute": repr(result["compute"]),
    "pin": result["pin"],
    "errors": probe.errors,
}))
"""


@pytest.mark.skipif(
    bool(probe_mod.gpu_device_files()), reason="GPU device files here: the probe asks torch"
)
def test_a_probe_without_gpus_reads_what_its_node_measured_without_importing_torch(
    tmp_path: Path,
) -> None:
    """The first probes of a node without GPU device files (two at once, as a laptop's
    simulated nodes are probed) measure the dequantize rates and the model's layer once each:
    the other waits and reads. Every later probe reads them and never imports torch; a GPU
    device file sends the probe to torch."""
    config = make_checkpoint(tmp_path / "ckpt", tiny_shape(2)) / "config.json"
    env = {**os.environ, "OFFLOAD_COMPUTE_CACHE": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", PROBE_TASK, str(config), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(process: subprocess.Popen) -> dict:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        return json.loads(out)

    def probe(*args: str) -> dict:
        return result(start(*args))

    first, other = (result(p) for p in [start(), start()])
    # Measured once each, by whichever came first (two timings never agree to the last bit);
    # which of the two imported torch depends on who took which lock first.
    assert first["torch"] or other["torch"]
    assert first["errors"] == other["errors"] == []
    assert (other["dequant"], other["compute"]) == (first["dequant"], first["compute"])
    assert other["host_matmul"] == first["host_matmul"] and len(first["host_matmul"]) == 2
    assert set(first["dequant"]) == {"fp8", "int8"} and first["compute"].startswith("Compute")
    second = probe()
    assert not second["torch"], "a probe with its node's measurements cached imported torch"
    assert second["link"] > 0  # measured again: a memmove needs no torch
    assert second["host_matmul"] == first["host_matmul"]
    assert (second["dequant"], second["compute"], second["pin"], second["errors"]) == (
        first["dequant"],
        first["compute"],
        first["pin"],
        [],
    )
    device = tmp_path / "nvidia0"
    device.touch()
    with_device = probe(str(device))  # torch is asked, and answers as it does here
    assert with_device["torch"] and with_device["compute"] == first["compute"]


def test_host_memory_and_rss_read_proc_where_psutil_is_missing(monkeypatch) -> None:
    """Issue 57 point 9: the GPU check runs where torch alone is installed. Without psutil the
    probe and the worker's snapshots read /proc, and agree with psutil's numbers."""
    import psutil

    from offload import probe as probe_module

    with_psutil = probe_module.host_memory()
    rss = probe_module.process_rss()
    monkeypatch.setattr(probe_module, "psutil", None)
    total, available = probe_module.host_memory()
    assert total == with_psutil[0] == psutil.virtual_memory().total
    assert abs(available - with_psutil[1]) < 2**30  # moments apart
    assert abs(probe_module.process_rss() - rss) < 2**28
