"""UVA offloading: offloaded parameters become zero-copy device views of host memory.

The GPU reads the weights over the interconnect each time a kernel touches them: no device
memory, no copies, bandwidth bound by PCIe (or NVLink-C2C on GH200/GB200). The host memory must
be pinned (registered and mapped into the device address space) unless the GPU reads pageable
memory through the host page tables (ATS), where the arena may stay pageable.

On a CPU device (the stand-in for a GPU on machines without one) the compute already reads host
memory, so the parameters are plain views of the arena: the same backend, loader path and
accounting as on CUDA, with the pointer mapping as the identity. That is what lets a UVA job be
loaded, run, recovered and re-planned in CI.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import torch
from torch import nn

from offload.arena import HostArena
from offload.base import BaseOffloader, OffloadStats, param_bytes, require_inference
from offload.config import OffloadConfig
from offload.errors import OffloadUnavailableError
from offload.host_store import (
    OffloadedLayer,
    decide_for_device,
    move_to_arena,
    select_offloaded,
    set_param_data,
)
from offload.probe import NodeProbe, probe_node


class _DeviceMemory:
    """Hands a raw device pointer to torch through the CUDA array interface."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


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
        self.config = config
        self._env = dict(os.environ if env is None else env)
        self._probe = probe
        self._arena: HostArena | None = None
        self._layers: list[OffloadedLayer] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def _wrap(self, modules: list[nn.Module]) -> None:
        layers = select_offloaded(modules, self.config)
        planned = sum(layer.payload_bytes for layer in layers)
        probe = self._probe if self._probe is not None else probe_node()
        self.pin_decision = decide_for_device(self._env, probe, planned, self.device)
        ats = probe.any_coherent_unified_memory
        on_host = self.device.type == "cpu"  # the compute reads host memory already
        if not self.pin_decision.pin and not ats and not on_host:
            raise OffloadUnavailableError(
                "the UVA backend needs pinned host memory on a GPU without ATS, but the pin "
                f"policy says off ({self.pin_decision.source}: {self.pin_decision.reason}); "
                "set OFFLOAD_PIN_MEMORY=on for this node or use backend='prefetch'"
            )
        arena = move_to_arena(layers, pin=self.pin_decision.pin)
        try:
            if on_host:
                flat = arena.bytes(0, arena.nbytes)
            else:
                base = _mapped_device_pointer(arena.data_ptr) if arena.pinned else arena.data_ptr
                with torch.cuda.device(self.device):
                    flat = torch.as_tensor(_DeviceMemory(base, arena.nbytes), device=self.device)
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
        self._arena.close()
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
