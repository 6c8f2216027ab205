"""The offloader interface, its statistics, and the null offloader.

Offloading is a reversible transform applied to modules that are already built: the model code
knows nothing about it. `wrap_modules` takes the layers in execution order and changes them in
place (hooks and parameter storage, never their `forward`); `detach` puts every parameter back
on the device and removes every hook.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from offload.arena import HostArena
from offload.errors import OffloadError
from offload.policy import PinDecision
from offload.stats import OffloadStats

# Set on each wrapped module so a second offloader (or the same one twice) refuses it.
_MARK = "_offload_coordinator_owner"


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class BaseOffloader(ABC):
    """Lifecycle: `wrap_modules(layers)` once, `post_init()`, forwards, `detach()`."""

    backend: str = "base"

    def __init__(self) -> None:
        self._modules: list[nn.Module] = []
        self.pin_decision: PinDecision | None = None
        self.backend_reason = ""  # set by create_offloader: why this backend
        self._arena: HostArena | None = None  # the offloaded weights, for backends that keep any

    @property
    def wrapped(self) -> bool:
        return bool(self._modules)

    def host_tensors(self) -> Mapping[str, torch.Tensor]:
        """The host memory behind the offloaded weights, by f"{module index}.{param name}":
        a loader may write weights here after `wrap_modules` and before `post_init`. Empty for
        a backend that keeps nothing in host memory."""
        return self._arena if self._arena is not None else {}

    def unviewed_device_bytes(self) -> int:
        """Device bytes the offloader holds that no parameter views (a staging buffer, expert
        caches): what a count of the bytes behind parameters misses. 0 here."""
        return 0

    def wrap_modules(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        """Offload (some of) `modules`, given in execution order; returns them, changed in place."""
        modules = list(modules)
        if self._modules:
            raise OffloadError(
                f"{type(self).__name__}.wrap_modules was already called; call detach() first "
                "or use a new offloader"
            )
        if not modules:
            raise ValueError("wrap_modules needs at least one module")
        self._check_unclaimed(modules)
        self._wrap(modules)
        for module in modules:
            setattr(module, _MARK, type(self).__name__)
        self._modules = modules
        return modules

    def post_init(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Called once all modules are wrapped and their weights are final. Default: nothing."""

    def synchronize(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Wait until every copy issued so far has landed. Default: nothing is in flight."""

    def release_device_buffers(self) -> None:  # noqa: B027 - an optional hook
        """Free the device memory that holds only copies of host memory (prefetch slots), for a
        caller about to drop the modules and build others (a worker's re-plan): the new stage
        may then allocate it. The offloaded parameters are left empty and must not be used
        again; `detach(restore=False)` follows. Default: no such memory."""

    def detach(self, *, restore: bool = True) -> None:
        """Restore every wrapped module: parameters back on the device, hooks removed.

        `restore=False` is for a caller about to drop the modules (a worker rebuilding its
        stage): the hooks go and the host memory is released, but the offloaded weights are not
        copied back to the device, so detaching costs no device memory. The offloaded
        parameters then point at released buffers and must not be used again.
        """
        if not self._modules:
            return
        self._detach(restore=restore)
        for module in self._modules:
            if hasattr(module, _MARK):
                delattr(module, _MARK)
        self._modules = []

    def close(self) -> None:
        self.detach()

    def __enter__(self) -> BaseOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _wrap(self, modules: list[nn.Module]) -> None: ...

    @abstractmethod
    def _detach(self, *, restore: bool) -> None: ...

    @abstractmethod
    def stats(self) -> OffloadStats: ...

    @staticmethod
    def _check_unclaimed(modules: list[nn.Module]) -> None:
        owners: dict[int, int] = {}
        for index, module in enumerate(modules):
            for sub in module.modules():
                owner = getattr(sub, _MARK, None)
                if owner is not None:
                    raise OffloadError(
                        f"module {index} ({type(module).__name__}) is already offloaded by a "
                        f"{owner}; detach() that offloader before wrapping it again"
                    )
            for name, param in module.named_parameters():
                if id(param) in owners and owners[id(param)] != index:
                    raise OffloadError(
                        f"parameter {name!r} of module {index} is shared with module "
                        f"{owners[id(param)]}; tied weights cannot be offloaded per layer"
                    )
                owners[id(param)] = index


class NoopOffloader(BaseOffloader):
    """Offloads nothing, on purpose: the null object for `backend='none'`."""

    backend = "none"

    def _wrap(self, modules: list[nn.Module]) -> None:
        pass

    def _detach(self, *, restore: bool) -> None:
        pass

    def stats(self) -> OffloadStats:
        return OffloadStats(
            backend=self.backend, resident_bytes=sum(param_bytes(m) for m in self._modules)
        )


def require_inference(module_index: int, args: tuple, kwargs: dict) -> None:
    """Offloaded weights are overwritten by the next layer's copy, so autograd must not save
    them for a backward pass: refuse inputs that require grad while grad mode is on."""
    if not torch.is_grad_enabled():
        return
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
        raise OffloadError(
            f"offloaded layer {module_index} was called with inputs that require grad; "
            "offloading is inference-only: run under torch.no_grad() or torch.inference_mode()"
        )
