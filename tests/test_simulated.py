"""Simulated GPUs that hold memory as real ones do (`offload.simulated`): a node's ledger of
what each process holds on each GPU, read by the probes. Issue 57 point 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from offload.errors import ConfigError
from offload.simulated import DeviceLedger, simulated_gpu_memory


def test_free_is_the_total_less_what_live_processes_hold(tmp_path) -> None:
    ledger = DeviceLedger("node-a", root=tmp_path)
    parent = os.getppid()  # another live process
    ledger.hold(0, 300)
    ledger.hold(0, 200, pid=parent)
    ledger.hold(1, 50)
    assert ledger.holders(0) == {os.getpid(): 300, parent: 200}
    assert ledger.free(0, 1000) == 500 and ledger.free(1, 1000) == 950
    assert ledger.free(0, 1000, credit=[os.getpid()]) == 800  # a survivor's own stage
    assert ledger.free(0, 400) == 0  # never below zero
    ledger.hold(0, 100)  # replaces what it held (a reconfigured stage)
    assert ledger.free(0, 1000) == 700
    ledger.release(0)
    assert ledger.holders(0) == {parent: 200}
    assert DeviceLedger("node-b", root=tmp_path).free(0, 1000) == 1000  # another node's
    [device] = ledger.devices([1], 1000)
    assert (device.index, device.total_memory_bytes, device.free_memory_bytes) == (1, 1000, 950)


def test_a_process_that_exited_holds_nothing(tmp_path) -> None:
    """As the driver frees a dead process's memory: its entry counts nothing, and goes."""
    ledger = DeviceLedger("node-a", root=tmp_path)
    code = (
        "import sys; from pathlib import Path; from offload.simulated import DeviceLedger; "
        "DeviceLedger('node-a', root=Path(sys.argv[1])).hold(2, 700)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    assert list((tmp_path / "node-a" / "gpu2").iterdir())  # it wrote, then exited
    assert ledger.free(2, 1000) == 1000
    assert not list((tmp_path / "node-a" / "gpu2").iterdir())


def test_the_size_is_read_from_the_environment() -> None:
    assert simulated_gpu_memory({}) is None
    assert simulated_gpu_memory({"OFFLOAD_SIMULATED_GPU_MEMORY": " "}) is None
    assert simulated_gpu_memory({"OFFLOAD_SIMULATED_GPU_MEMORY": "1.5GiB"}) == 3 << 29
    for bad in ("0", "lots"):
        with pytest.raises(ConfigError, match=f"OFFLOAD_SIMULATED_GPU_MEMORY={bad!r}"):
            simulated_gpu_memory({"OFFLOAD_SIMULATED_GPU_MEMORY": bad})
