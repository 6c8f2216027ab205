"""UVA offloading: offloaded parameters become zero-copy device views of host memory.

The GPU reads the weights over the interconnect each time a kernel touches them: no device
memory, no copies, bandwidth bound by PCIe (or NVLink-C2C on GH200/GB200). The host memory must
be pinned (registered and mapped into the device address space) unless the GPU reads pageable
memory through the host page tables (ATS), where the arena may stay pageable.

On a CPU device (the stand-in for a GPU on machines without one) the compute already reads host
memory, so the parameters are plain views of the arena: the same backend, loader path and
accounting as on CUDA, with the pointer mapping as the identity. That is what lets a UVA job be
loaded, run, recovered and re-planned in CI.

On CUDA the views are built for an explicit device index. Given one, torch (from 2.9) takes the
device as said instead of asking the driver what the pointer is, a question pageable memory
fails ("resides on host memory and is not registered") even where the GPU reads it through the
host page tables. Older torch therefore gets registered memory on such GPUs, reported in the
pin decision. The views own a reference to the arena, so the host memory (and its registration)
lives as long as any view of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Mapping

import torch
from torch import nn

from offload.arena import HostArena
from offload.base import BaseOffloader, param_bytes, require_inference
from offload.config import OffloadConfig
from offload.errors import OffloadUnavailableError
from offload.host_store import (
    OffloadedLayer,
    decide_for_device,
    move_to_arena,
    select_offloaded,
    set_param_data,
)
from offload.policy import PinDecision
from offload.probe import DECISION_STEPS, NodeProbe, probe_node
from offload.stats import OffloadStats

# The first torch release whose `as_tensor(obj, device=cuda:N)` trusts the explicit index of a
# CUDA-array-interface object (pytorch commit dae7710) rather than asking cudaPointerGetAttributes,
# which refuses unregistered host memory.
UNREGISTERED_VIEWS_MIN_TORCH = (2, 9)


def torch_views_unregistered_memory(version: str | None = None) -> bool:
    """Whether this torch (or `version`) can build a device tensor over unregistered memory."""
    release = (version or torch.__version__).split("+")[0].split(".")
    numbers = tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in release[:2])
    return numbers >= UNREGISTERED_VIEWS_MIN_TORCH


def cuda_device(device: torch.device | str) -> torch.device:
    """`device` with its index explicit: the current device where it names none. A view built
    for `torch.device("cuda")` makes torch ask the driver about the pointer (see above)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cuda_device() needs a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def reads_pageable_memory(probe: NodeProbe, index: int) -> bool:
    """Whether GPU `index` reads pageable host memory through the host page tables (ATS)."""
    return any(d.index == index and d.coherent_unified_memory for d in probe.devices)


def host_memory_for_views(
    decision: PinDecision, *, reads_pageable: bool, torch_version: str | None = None
) -> PinDecision:
    """The pin decision the UVA arena is built with on a CUDA device.

    Pinned memory is always viewable. Pageable memory is viewable only by a GPU that reads it
    through the host page tables, and only with a torch that takes the explicit index: an older
    torch gets the memory registered instead (said so in the decision); a GPU without that
    access is refused with the knobs that fix it.
    """
    if decision.pin:
        return decision
    if not reads_pageable:
        raise OffloadUnavailableError(
            "the UVA backend needs pinned host memory on a GPU that does not read pageable "
            f"memory through the host page tables (ATS), but the pin policy says off "
            f"({decision.source}: {decision.reason}); set OFFLOAD_PIN_MEMORY=on for this node "
            "or use backend='prefetch'"
        )
    version = torch_version or torch.__version__
    if torch_views_unregistered_memory(version):
        return decision
    floor = ".".join(map(str, UNREGISTERED_VIEWS_MIN_TORCH))
    return PinDecision(
        pin=True,
        reason=f"torch {version} cannot view unregistered host memory on the GPU (needs "
        f">= {floor}), so the arena is registered; the policy said off ({decision.reason})",
        source="torch_version",
    )


class _DeviceMemory:
    """Hands a raw device pointer to torch through the CUDA array interface. torch keeps this
    object alive as long as any tensor built from it, and this object keeps `owner` alive: the
    host memory behind the pointer."""

    def __init__(self, ptr: int, nbytes: int, *, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def device_view(arena: HostArena, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor on the CUDA `device` (explicit index) over the whole arena."""
    assert device.type == "cuda" and device.index is not None, device
    with torch.cuda.device(device):  # the pointer query and the view in this device's context
        base = _mapped_device_pointer(arena.data_ptr) if arena.pinned else arena.data_ptr
        flat = torch.as_tensor(_DeviceMemory(base, arena.nbytes, owner=arena), device=device)
    if flat.device != device or flat.data_ptr() != base:  # a copy, not a view: never silently
        raise OffloadUnavailableError(
            f"torch built a copy on {flat.device}, not a view on {device}, of the host arena; "
            "use backend='prefetch'"
        )
    return flat


def _mapped_device_pointer(host_ptr: int) -> int:
    """Device address of registered host memory (equal to the host address on UVA systems
    where CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM holds, but asking the driver is always right)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    device_ptr = ctypes.c_uint64()
    rc = libcuda.cuMemHostGetDevicePointer_v2(
        ctypes.byref(device_ptr), ctypes.c_void_p(host_ptr), 0
    )
    if rc != 0:
        raise OffloadUnavailableError(f"cuMemHostGetDevicePointer failed with CUresult {rc}")
    return device_ptr.value


class UVAOffloader(BaseOffloader):
    backend = "uva"

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device: torch.device | str,
        env: Mapping[str, str] | None = None,
        probe: NodeProbe | None = None,
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise OffloadUnavailableError(
                f"the UVA backend was given device={self.device}, but this process sees no "
                "CUDA device; use backend='prefetch' or 'auto', or device='cpu'"
            )
        if self.device.type not in ("cuda", "cpu"):
            raise OffloadUnavailableError(
                f"the UVA backend runs on a CUDA device or on the CPU, not device={self.device}; "
                "use backend='prefetch' or 'auto'"
            )
        if self.device.type == "cuda":
            self.device = cuda_device(self.device)
        self.config = config
        self._env = dict(os.environ if env is None else env)
        self._probe = probe
        self._arena: HostArena | None = None
        self._layers: list[OffloadedLayer] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def _wrap(self, modules: list[nn.Module]) -> None:
        layers = select_offloaded(modules, self.config)
        planned = sum(layer.payload_bytes for layer in layers)
        probe = self._probe if self._probe is not None else probe_node(DECISION_STEPS)
        decision = decide_for_device(self._env, probe, planned, self.device)
        on_host = self.device.type == "cpu"  # the compute reads host memory already
        if not on_host:
            decision = host_memory_for_views(
                decision, reads_pageable=reads_pageable_memory(probe, self.device.index)
            )
        self.pin_decision = decision
        # Registered in this device's context: a torch before 2.9 takes the view's device from
        # the registration, and a copy to another device would not be a view (refused below).
        with contextlib.nullcontext() if on_host else torch.cuda.device(self.device):
            arena = move_to_arena(layers, pin=decision.pin)
        try:
            flat = arena.bytes(0, arena.nbytes) if on_host else device_view(arena, self.device)
        except BaseException:
            arena.close()
            raise
        self._arena = arena
        self._layers = layers
        for layer in layers:
            for position, (key, (_, param)) in enumerate(
                zip(layer.keys, layer.params, strict=True)
            ):
                offset = arena.offset(key)
                view = flat[offset : offset + param.numel() * param.element_size()]
                set_param_data(layer, position, view.view(param.dtype).view(param.shape))
            self._hooks.append(
                layer.module.register_forward_pre_hook(
                    lambda m, a, k, i=layer.index: require_inference(i, a, k), with_kwargs=True
                )
            )

    def _detach(self, *, restore: bool) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels may still read the host memory
        with torch.no_grad():
            for layer in self._layers if restore else ():
                for position, key in enumerate(layer.keys):
                    set_param_data(layer, position, self._arena[key].to(self.device, copy=True))
        # Not closed: a view still held (a caller's reference, or every parameter after
        # restore=False) keeps the arena, and so its memory and registration, alive; the
        # arena's finalizer unregisters it when the last view goes.
        self._arena = None
        self._layers = []

    def stats(self) -> OffloadStats:
        total = sum(param_bytes(m) for m in self._modules)
        if self._arena is None:
            return OffloadStats(backend=self.backend, resident_bytes=total)
        offloaded = self._arena.payload_bytes
        return OffloadStats(
            backend=self.backend,
            offloaded_layers=len(self._layers),
            offloaded_bytes=offloaded,
            resident_bytes=total - offloaded,
            host_bytes=self._arena.host_bytes,
            pinned_bytes=offloaded if self._arena.pinned else 0,
            pageable_bytes=0 if self._arena.pinned else offloaded,
        )
