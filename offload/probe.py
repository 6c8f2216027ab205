"""What this node is, as far as pinning host memory and copying weights in are concerned.

`probe_node()` looks at CUDA devices, the kernel (WSL), host memory and RLIMIT_MEMLOCK, and
measures the host-to-device copy rate (`offload.link`). Every step runs on its own: a step that
fails records why in `NodeProbe.errors` and leaves its fields at their "unknown" value, so a
broken driver or a missing /proc never crashes the caller.

On a node with no GPU device at all (no NVIDIA, WSL or AMD device file: a laptop, CI, a CPU
node), the probe never imports torch: CUDA cannot start there, the CPU copy is a plain memmove,
and the dequantize rates (which need torch) are read from what the node measured before
(`offload.node_cache`). A probe process then costs what any process of ours costs to start,
not torch's import on top.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import platform
import resource
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

try:
    import psutil
except ImportError:  # optional: /proc answers without it (host_memory, process_rss)
    psutil = None

from offload import link, node_cache
from offload.errors import ConfigError

# The device files a GPU that torch.cuda can use shows on Linux: NVIDIA's driver (also Jetson's
# nvhost and nvmap), WSL's GPU paravirtualisation, AMD's ROCm. With none of them, and torch not
# imported, CUDA is unavailable without asking torch.
GPU_DEVICE_GLOBS = (
    "/dev/nvidia*",
    "/proc/driver/nvidia/gpus/*",
    "/dev/nvhost-*",
    "/dev/nvmap",
    "/dev/dxg",
    "/dev/kfd",
)


def gpu_device_files() -> list[str]:
    """The GPU device files present on this node (`GPU_DEVICE_GLOBS`)."""
    return [path for pattern in GPU_DEVICE_GLOBS for path in glob.glob(pattern)]


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, answered without importing torch where it can only be
    False: torch not yet imported, on Linux, with no GPU device file (`GPU_DEVICE_GLOBS`).
    Like torch's, it creates no CUDA context."""
    if "torch" not in sys.modules and sys.platform == "linux" and not gpu_device_files():
        return False
    import torch

    return torch.cuda.is_available()


# CUdevice_attribute values from cuda.h (stable across CUDA 10..13).
_CU_ATTR_PAGEABLE_MEMORY_ACCESS = 88
_CU_ATTR_HOST_REGISTER_SUPPORTED = 99
_CU_ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100

# On a node without CUDA the CPU stands in for the GPUs (logical GPUs with simulated budgets).
# This variable says which kind of GPU it stands in for, so that what depends on the kind (the
# backend `auto` picks, the pin decision) runs, and is tested, without that hardware:
# "discrete" (a PCIe GPU: the default) or "coherent" (GH200/GB200 class: the GPU reads host
# memory through the host page tables). Ignored, and said so in `errors`, where CUDA is present.
SIMULATED_GPU_ENV = "OFFLOAD_SIMULATED_GPU"
SIMULATED_GPU_KINDS = ("discrete", "coherent")


def simulated_gpu_kind(env: Mapping[str, str]) -> str:
    """The kind of GPU a CPU stand-in simulates, from `OFFLOAD_SIMULATED_GPU` in `env`."""
    value = env.get(SIMULATED_GPU_ENV, "").strip().lower() or "discrete"
    if value not in SIMULATED_GPU_KINDS:
        raise ConfigError(
            f"{SIMULATED_GPU_ENV}={env[SIMULATED_GPU_ENV]!r} is not a simulated GPU kind; "
            f"allowed: {', '.join(SIMULATED_GPU_KINDS)}"
        )
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    """One CUDA device. Attribute fields are None when the driver could not be asked."""

    index: int
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    integrated: bool
    # The GPU reads pageable host memory through the host's page tables (ATS): GH200/GB200
    # class parts with a coherent CPU-GPU link. Pinning buys nothing there and costs memory.
    pageable_memory_access_uses_host_page_tables: bool | None = None
    pageable_memory_access: bool | None = None
    host_register_supported: bool | None = None
    # Memory free on the device when probed (the probe's own CUDA context open): what a
    # worker's budget is taken from. None: not measured.
    free_memory_bytes: int | None = None

    @property
    def coherent_unified_memory(self) -> bool:
        return bool(self.pageable_memory_access_uses_host_page_tables)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeProbe:
    """A snapshot of one node. Build one by hand in tests; `probe_node()` fills it for real."""

    cuda_available: bool = False
    devices: tuple[DeviceInfo, ...] = ()
    is_wsl: bool = False
    host_total_bytes: int | None = None
    host_available_bytes: int | None = None
    # None means unlimited (RLIM_INFINITY) or unknown; see `errors` to tell them apart.
    memlock_limit_bytes: int | None = None
    cpu_arch: str = ""
    cpu_count: int = 0  # logical CPUs (0: unknown)
    # Host-to-device copy rates, measured (None: not measured, or failed: see `errors`). From
    # pinned memory only on CUDA; without CUDA "pageable" is the CPU stand-in's memcpy rate.
    link_pinned_bytes_per_s: float | None = None
    link_pageable_bytes_per_s: float | None = None
    # On CUDA: from pageable memory through the staged engine's pinned bounce chunks
    # (`offload.staging`), the other way a pageable arena's copies may take.
    link_staged_bytes_per_s: float | None = None
    # How fast the device makes bfloat16 weights from 8-bit ones (bytes made per second), per
    # 8-bit format ("fp8", "int8"): what dequantizing offloaded weights after each copy costs.
    dequant_bytes_per_s: tuple[tuple[str, float], ...] = ()
    # How fast the host's CPU computes a few rows through bfloat16 weights in host memory
    # (weight bytes per second), per rows of a step (HOST_MATMUL_ROWS): what running an MoE
    # layer's experts on the host instead of copying them costs (`host_expert_rows`).
    host_matmul_bytes_per_s: tuple[tuple[int, float], ...] = ()
    # Without CUDA: the kind of GPU the CPU stands in for (see SIMULATED_GPU_ENV); None with CUDA.
    simulated_gpu: str | None = None
    # Without CUDA, where OFFLOAD_SIMULATED_GPU_MEMORY is set: each simulated GPU's total, and
    # the ones this process holds with what is free on them (`offload.simulated`), as `devices`
    # reports real ones. Empty and None where the simulated GPUs have no size of their own.
    simulated_gpu_memory_bytes: int | None = None
    simulated_devices: tuple[DeviceInfo, ...] = ()
    # Without CUDA: NVIDIA GPUs the kernel driver lists all the same (CUDA failed to start).
    nvidia_gpus_present: int = 0
    errors: tuple[str, ...] = field(default=())

    @property
    def any_integrated(self) -> bool:
        return any(d.integrated for d in self.devices)

    @property
    def any_coherent_unified_memory(self) -> bool:
        """A GPU here reads host memory through the host page tables (or the CPU stands in
        for such a GPU)."""
        return self.simulated_gpu == "coherent" or any(
            d.coherent_unified_memory for d in self.devices
        )

    def link_bytes_per_s(self, *, pin: bool) -> float | None:
        """The rate the offloader's copies get: from pinned memory when the node pins; else
        from pageable memory, by the engine a node that pins nothing uses."""
        if pin:
            return self.link_pinned_bytes_per_s
        return self.pageable_engine(may_pin=False)[1]

    def pageable_engine(self, *, may_pin: bool) -> tuple[str, float | None]:
        """(engine, rate) for copies from a pageable arena (`offload.copy_engines`): on CUDA
        "staged" through pinned bounce chunks, where the node may pin them (`may_pin`) and the
        measured rates say it is the faster, else "direct" (the driver stages the copies; nothing
        pinned); without CUDA the CPU's copy "thread". Where neither rate was measured, staged
        (its rate is the lower of a host memcpy and the pinned link, which the driver's own
        staging does not beat by design); where one was, the one measured."""
        direct, staged = self.link_pageable_bytes_per_s, self.link_staged_bytes_per_s
        if not self.cuda_available:
            return "thread", direct
        if not may_pin:
            return "direct", direct
        if staged is not None and (direct is None or staged > direct):
            return "staged", staged
        if staged is None and direct is None:
            return "staged", None
        return "direct", direct

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cuda_driver_attributes(index: int) -> dict[str, bool]:
    """Ask the CUDA driver (libcuda, always present with a driver) for ATS-related attributes.

    torch exposes device properties but not these attributes, so we call cuDeviceGetAttribute
    through ctypes. torch has already initialised the driver when CUDA is available.
    """
    libcuda = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    if libcuda.cuDeviceGet(ctypes.byref(device), index) != 0:
        raise RuntimeError(f"cuDeviceGet({index}) failed")
    out = {}
    for name, attr in (
        ("pageable_memory_access", _CU_ATTR_PAGEABLE_MEMORY_ACCESS),
        ("host_register_supported", _CU_ATTR_HOST_REGISTER_SUPPORTED),
        (
            "pageable_memory_access_uses_host_page_tables",
            _CU_ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
        ),
    ):
        value = ctypes.c_int()
        rc = libcuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device)
        if rc != 0:
            raise RuntimeError(f"cuDeviceGetAttribute({attr}) failed with CUresult {rc}")
        out[name] = bool(value.value)
    return out


def _nvidia_gpus_present() -> int:
    """NVIDIA GPUs the kernel driver lists, whether or not CUDA starts in this process."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _probe_cuda(fields: dict, errors: list[str]) -> None:
    available = cuda_available()
    fields["cuda_available"] = available
    if not available:
        fields["nvidia_gpus_present"] = _nvidia_gpus_present()
        return
    import torch

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        attrs: dict = {}
        try:
            attrs = _cuda_driver_attributes(index)
        except Exception as exc:  # a missing libcuda or an old driver: record, go on
            errors.append(f"cuda device {index} attributes: {exc}")
        try:  # the devices this process was given (Ray's CUDA_VISIBLE_DEVICES): held by it
            attrs["free_memory_bytes"] = int(torch.cuda.mem_get_info(index)[0])
        except Exception as exc:
            errors.append(f"cuda device {index} free memory: {exc}")
        devices.append(
            DeviceInfo(
                index=index,
                name=props.name,
                capability=(props.major, props.minor),
                total_memory_bytes=props.total_memory,
                integrated=bool(getattr(props, "is_integrated", False)),
                **attrs,
            )
        )
    fields["devices"] = tuple(devices)


def _probe_simulated_gpu(fields: dict, errors: list[str]) -> None:
    if not fields.get("cuda_available"):
        fields["simulated_gpu"] = simulated_gpu_kind(os.environ)
    elif os.environ.get(SIMULATED_GPU_ENV):
        errors.append(f"{SIMULATED_GPU_ENV} is ignored: this node has CUDA devices")


def _probe_wsl(fields: dict, errors: list[str]) -> None:
    release = platform.uname().release.lower()
    fields["is_wsl"] = "microsoft" in release or "wsl" in release


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this host's memory: psutil's, or /proc/meminfo's where
    psutil is not installed (a bare GPU machine with torch alone runs the GPU check)."""
    if psutil is not None:
        mem = psutil.virtual_memory()
        return int(mem.total), int(mem.available)
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields[key] = int(rest.split()[0]) * 1024  # kB
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])


def process_rss() -> int:
    """This process's resident bytes: psutil's, or /proc/self/statm's without it."""
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _probe_host_memory(fields: dict, errors: list[str]) -> None:
    fields["host_total_bytes"], fields["host_available_bytes"] = host_memory()


def _probe_memlock(fields: dict, errors: list[str]) -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    fields["memlock_limit_bytes"] = None if soft == resource.RLIM_INFINITY else int(soft)


def _probe_arch(fields: dict, errors: list[str]) -> None:
    fields["cpu_arch"] = platform.machine()
    fields["cpu_count"] = os.cpu_count() or 0


def _probe_link(fields: dict, errors: list[str]) -> None:
    if not cuda_available():
        fields["link_pageable_bytes_per_s"] = link.measure_cpu_copy()
        return
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    measures = (
        (
            "link_pinned_bytes_per_s",
            "pinned",
            lambda: link.measure_host_to_device(device, pin=True),
        ),
        (
            "link_pageable_bytes_per_s",
            "pageable",
            lambda: link.measure_host_to_device(device, pin=False),
        ),
        ("link_staged_bytes_per_s", "staged", lambda: link.measure_staged(device)),
    )
    for name, kind, measure in measures:
        try:  # each on its own: a node that cannot pin still copies from pageable memory
            fields[name] = measure()
        except Exception as exc:
            errors.append(f"link ({kind}, {device}): {type(exc).__name__}: {exc}")


DEQUANT_FORMATS = ("fp8", "int8")


def _probe_dequantize(fields: dict, errors: list[str]) -> None:
    if "torch" in sys.modules or cuda_available():
        fields["dequant_bytes_per_s"] = _measure_dequantize(errors)
        return
    # A process that has not imported torch, on a node without GPUs: the CPU's rates as this
    # node measured them before, for this torch build and thread count; measured and kept
    # when there are none (only a complete measurement is kept).
    path = node_cache.cache_file("dequantize", _cpu_dequantize_key())
    with node_cache.measuring(path):
        cached = node_cache.read(path) or {}
        if set(cached) == set(DEQUANT_FORMATS):
            fields["dequant_bytes_per_s"] = tuple((f, float(cached[f])) for f in DEQUANT_FORMATS)
            return
        failed = len(errors)
        rates = _measure_dequantize(errors)
        if len(errors) == failed:
            node_cache.write(path, dict(rates))
    fields["dequant_bytes_per_s"] = rates


def _cpu_dequantize_key() -> list:
    """What the CPU's dequantize rates depend on, all known without importing torch: the torch
    build, the CPU, and the environment that sets torch's thread count."""
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return [node_cache.torch_version(), platform.machine(), _cpu_model(), os.cpu_count(), threads]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "")
    except OSError:
        return platform.processor()


def _measure_dequantize(errors: list[str]) -> tuple[tuple[str, float], ...]:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rates = []
    for name, dtype in zip(DEQUANT_FORMATS, (torch.float8_e4m3fn, torch.int8), strict=True):
        try:
            rates.append((name, link.measure_dequantize(device, dtype)))
        except Exception as exc:
            errors.append(f"dequantize ({name}, {device}): {type(exc).__name__}: {exc}")
    return tuple(rates)


HOST_MATMUL_ROWS = (1, 16)


def _probe_host_matmul(fields: dict, errors: list[str]) -> None:
    if cuda_available():
        fields["host_matmul_bytes_per_s"] = _measure_host_matmul(errors)
        return
    # As `_probe_dequantize` on a node without GPUs, whether this process has torch or not (a
    # step before may have imported it): the rates this node measured before, measured and
    # kept where there are none. They are the host CPU's, the same for every process here.
    path = node_cache.cache_file("host_matmul", _cpu_dequantize_key())
    with node_cache.measuring(path):
        cached = node_cache.read(path) or {}
        if set(cached) == {str(rows) for rows in HOST_MATMUL_ROWS}:
            fields["host_matmul_bytes_per_s"] = tuple(
                (rows, float(cached[str(rows)])) for rows in HOST_MATMUL_ROWS
            )
            return
        failed = len(errors)
        rates = _measure_host_matmul(errors)
        if len(errors) == failed:
            node_cache.write(path, {str(rows): rate for rows, rate in rates})
    fields["host_matmul_bytes_per_s"] = rates


def _measure_host_matmul(errors: list[str]) -> tuple[tuple[int, float], ...]:
    rates = []
    for rows in HOST_MATMUL_ROWS:
        try:
            rates.append((rows, link.measure_host_matmul(rows)))
        except Exception as exc:
            errors.append(f"host matmul ({rows} rows): {type(exc).__name__}: {exc}")
    return tuple(rates)


ProbeStep = Callable[[dict, list], None]
PROBE_STEPS: dict[str, ProbeStep] = {
    "cuda": _probe_cuda,
    "simulated_gpu": _probe_simulated_gpu,  # after "cuda": only without it
    "wsl": _probe_wsl,
    "host_memory": _probe_host_memory,
    "memlock": _probe_memlock,
    "cpu_arch": _probe_arch,
    "link": _probe_link,
    "dequantize": _probe_dequantize,
    "host_matmul": _probe_host_matmul,
}
# What a process that only needs the pin decision probes: the link and dequantization rates
# are for the planner, and measuring them costs tens of milliseconds (and a device buffer on
# CUDA) per process.
DECISION_STEPS: dict[str, ProbeStep] = {
    k: v for k, v in PROBE_STEPS.items() if k not in ("link", "dequantize", "host_matmul")
}


def probe_node(steps: dict[str, ProbeStep] | None = None) -> NodeProbe:
    """Probe this node. Never raises: a failing step is recorded in `errors` with its cause."""
    fields: dict = {}
    errors: list[str] = []
    for name, step in (PROBE_STEPS if steps is None else steps).items():
        try:
            step(fields, errors)
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return NodeProbe(**fields, errors=tuple(errors))
