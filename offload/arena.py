"""One exact-size host buffer for all the offloaded weights of one offloader.

PyTorch's pinned allocator (`tensor.pin_memory()`, `torch.empty(..., pin_memory=True)`) rounds
every block up to a power of two and caches it, so pinning N weights one by one can cost up to
2x their bytes of host RAM. The arena instead allocates one pageable buffer of exactly the sum of
the (aligned) tensor sizes, carves every tensor out of it as a view, and, when the pin policy
says so, page-locks the whole buffer in place with `cudaHostRegister`. Host bytes used stay
within `alignment` bytes per tensor (plus one page) of the payload.

The arena is a `Mapping[str, Tensor]`, so pinned, pageable and test weight stores are
interchangeable for the code that reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from offload.errors import PinningUnavailableError

# 256 bytes: the CUDA caching allocator's own alignment, so zero-copy views are as aligned as
# ordinary device tensors (vectorised kernels need 16 B; DMA engines like larger).
ARENA_ALIGNMENT_BYTES = 256
_PAGE_BYTES = 4096
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context and mapped into
# the device address space, which the UVA offloader needs.
_HOST_REGISTER_FLAGS = 0x01 | 0x02


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def align_up(value: int, alignment: int = ARENA_ALIGNMENT_BYTES) -> int:
    """`value` rounded up to a multiple of `alignment` (the arena's, by default)."""
    return (value + alignment - 1) // alignment * alignment


# Bytes of page-locked buffers `host_buffer` handed out in this process (they are small and
# reused: a loader's staging buffer, a staged engine's bounce chunks), for the GPU check.
pinned_buffer_bytes = 0


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A host buffer of `nbytes` bytes (uint8), page-locked only when `pin`: the node's pin
    decision (`offload.policy`), never "CUDA is there". With the arena's registration, the one
    way host memory of ours gets pinned."""
    global pinned_buffer_bytes
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if pin:
        pinned_buffer_bytes += nbytes
    return buffer


def _unregister(ptr: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if rc != 0:
        # Called from close() or a finalizer: report, do not raise from a finalizer.
        import warnings

        warnings.warn(f"cudaHostUnregister failed with cudaError {rc}", stacklevel=2)


class HostArena(Mapping[str, torch.Tensor]):
    """Host buffer holding named tensors back to back, each aligned to `alignment` bytes.

    Tensors are laid out in the order given, so tensors added together (one layer's weights)
    form one contiguous byte range: see `span()`.
    """

    def __init__(
        self,
        specs: Iterable[TensorSpec],
        *,
        pin: bool,
        alignment: int = ARENA_ALIGNMENT_BYTES,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        self._layout: dict[str, tuple[int, TensorSpec]] = {}
        offset = 0
        for spec in specs:
            if spec.name in self._layout:
                raise ValueError(f"tensor {spec.name!r} appears twice in the arena")
            offset = align_up(offset, alignment)
            self._layout[spec.name] = (offset, spec)
            offset += spec.nbytes
        self.payload_bytes = sum(spec.nbytes for _, spec in self._layout.values())
        self.nbytes = offset
        if pin and not torch.cuda.is_available():
            raise PinningUnavailableError(
                "cannot pin the arena: this process sees no CUDA device; "
                "create it with pin=False (OFFLOAD_PIN_MEMORY=off or auto)"
            )
        # One page of slack so the buffer starts on a page boundary: registering a range that
        # shares pages with unrelated allocations would pin those too.
        raw = torch.empty(self.nbytes + _PAGE_BYTES, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE_BYTES
        self._raw = raw
        self._buffer = raw[start : start + self.nbytes]
        self.host_bytes = raw.numel()
        self.pinned = False
        self._finalizer: weakref.finalize | None = None
        if pin and self.nbytes > 0:
            ptr = self._buffer.data_ptr()
            rc = int(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, _HOST_REGISTER_FLAGS))
            if rc != 0:
                raise PinningUnavailableError(
                    f"cudaHostRegister of {self.nbytes} bytes failed with cudaError {rc}; "
                    "set OFFLOAD_PIN_MEMORY=off on this node to offload to pageable memory"
                )
            self.pinned = True
            self._finalizer = weakref.finalize(self, _unregister, ptr)
        self._views = {
            name: self._view(offset, spec) for name, (offset, spec) in self._layout.items()
        }

    def _view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        flat = self._buffer[offset : offset + spec.nbytes]
        return flat.view(spec.dtype).view(spec.shape)

    # Mapping protocol
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    @property
    def data_ptr(self) -> int:
        return self._buffer.data_ptr()

    def offset(self, name: str) -> int:
        return self._layout[name][0]

    def span(self, names: Iterable[str]) -> tuple[int, int]:
        """The byte range [start, end) that covers `names`, which must be laid out together."""
        wanted = set(names)
        if not wanted:
            raise ValueError("span() needs at least one tensor name")
        start = min(self._layout[n][0] for n in wanted)
        end = max(self._layout[n][0] + self._layout[n][1].nbytes for n in wanted)
        others = [
            n for n, (off, _) in self._layout.items() if start <= off < end and n not in wanted
        ]
        if others:
            raise ValueError(
                f"tensors {sorted(wanted)} are not contiguous: {others} lie between them"
            )
        return start, end

    def bytes(self, start: int, end: int) -> torch.Tensor:
        """A flat uint8 view of [start, end) of the buffer."""
        assert 0 <= start <= end <= self.nbytes, (start, end, self.nbytes)
        return self._buffer[start:end]

    def close(self) -> None:
        """Unregister the buffer from CUDA. Views stay readable (as pageable memory)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostArena({len(self)} tensors, payload={self.payload_bytes} B, "
            f"allocated={self.host_bytes} B, pinned={self.pinned})"
        )
