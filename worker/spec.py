"""What the driver tells a worker to load and run: plain, frozen, picklable values.

These types live in `worker/` because the worker must not import `coordinator/`; the
coordinator builds them from the checkpoint index and the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# safetensors dtype names -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def dtype_size(dtype: str) -> int:
    return torch.empty((), dtype=SAFETENSORS_DTYPES[dtype]).element_size()


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSlice:
    """One tensor of a safetensors file: where its bytes are, and what they are."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint directory
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSpec:
    """One pipeline unit: the embedding, a decoder layer, or the final norm + LM head."""

    name: str  # "embed", "layers.7", "head"
    kind: str  # "embed" | "decoder" | "head"
    index: int | None  # decoder layer index
    tensors: tuple[TensorSlice, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """Everything one worker needs: its layers, which of them are offloaded, and how."""

    stage: int
    num_stages: int
    checkpoint_dir: str
    config: dict  # the checkpoint's config.json
    layers: tuple[LayerSpec, ...]
    offloaded: tuple[str, ...] = ()  # layer names kept in host memory
    prefetch_step: int = 1
    backend: str = "auto"
    env: dict[str, str] = field(default_factory=dict)  # set on this worker by the job
    env_origins: dict[str, str] = field(default_factory=dict)  # "job override" | "node label"
