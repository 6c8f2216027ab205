"""A stage's KV cache for one request: the model's own `DynamicCache`, holding only the layers
the stage runs.

`DynamicCache(config=...)` gives every decoder layer its cache layer of the right kind (sliding
window or full), exactly as `generate` builds it; on a stage, only the layers it holds are ever
written. But the model asks the cache about a layer it may not hold: the causal mask takes its
sizes from the first full-attention layer of the model, the sliding mask from the first
sliding one, the positions from layer 0. `StageCache` answers those questions from the first
layer of the same kind that this stage holds, which has seen exactly the same tokens.
"""

from __future__ import annotations

from transformers import DynamicCache


class StageCache(DynamicCache):
    def __init__(self, config, held_layers: list[int]) -> None:
        super().__init__(config=config)
        if not held_layers:
            raise ValueError("a stage without decoder layers keeps no KV cache")
        self._held = sorted(held_layers)

    def _held_like(self, layer_idx: int) -> int:
        """The first held layer of the kind of `layer_idx` (sliding or not); `layer_idx` itself
        when the stage holds it or none of its kind (then no held layer uses that mask)."""
        if layer_idx in self._held or layer_idx >= len(self.layers):
            return layer_idx
        sliding = self.is_sliding
        return next((i for i in self._held if sliding[i] == sliding[layer_idx]), layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._held_like(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._held_like(layer_idx))

    def nbytes(self) -> int:
        """Bytes of the cached keys and values."""
        total = 0
        for layer in self.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
        return total
