"""A stage's KV cache for every sequence in flight: a fixed pool of slots, one per sequence.

Each decoder layer the stage holds gets a keys and a values store of shape (slots, kv_heads,
max_seq_len, head_dim), each shaped as the model writes it (DeepSeek's multi-head latent
attention writes its compressed latent as keys and its rotated key part as values, one head
each), allocated at the layer's first write and kept: the bytes the plan reserved (`max_batch` x `max_seq_len`), never more, and no
allocation per request or per step. A sequence owns one slot from its admission to its end;
the engine hands a freed slot to the next sequence at once, and the stale keys in it are never
read (the mask only lets a row see the positions it wrote).

Why slots and not pages (transformers' `continuous_batching` has a paged cache): with slots a
step is the model's own forward over a batch (rows, width), each row writing its new keys at
its own position, so the model's attention and kernels run unchanged; pages need a paged
attention implementation and a flattened batch. The price is capacity: a slot holds
`max_seq_len` positions whatever the sequence uses, so the plan's reserve bounds the batch by
the longest sequence (bench/RESULTS.md, "Continuous batching", has the numbers).

A step sees the pool through a `BatchView` (a transformers `Cache`): the step's rows (slots),
where each row's new tokens start and how many there are. Rows are left-padded to the step's
width; only the real tokens are written. The masks follow each row's own length; the model's
code asks for them by kind (`create_causal_mask`, `create_sliding_window_causal_mask`) and
`worker.stage` routes those calls here (`mask`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

# A mask function other than the two `worker.stage` routes here reached the cache: this family
# builds its masks some other way, and a mask sized as one sequence would be silently wrong.
_UNROUTED = (
    "this model builds an attention mask that batched generation does not route "
    "(only create_causal_mask and create_sliding_window_causal_mask are): its family "
    "cannot generate in batches yet"
)


def row_positions(starts: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Position ids (rows, width) of rows left-padded to `width`: each real token its place in
    its sequence (row r's `counts[r]` tokens from `starts[r]` on), padding 0."""
    column = torch.arange(width, device=starts.device)
    return (starts[:, None] + column - (width - counts[:, None])).clamp(min=0)


class SlotPool:
    """Keys and values of `num_slots` sequences of up to `max_seq_len` tokens, for the decoder
    layers `held_layers` (model indices)."""

    def __init__(
        self, held_layers: list[int], *, num_slots: int, max_seq_len: int, device: torch.device
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(
                f"a slot pool needs num_slots >= 1 and max_seq_len >= 1, got "
                f"{num_slots} and {max_seq_len}"
            )
        self.held = sorted(held_layers)
        self.num_slots, self.max_seq_len, self.device = num_slots, max_seq_len, device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values()
        )

    def stores(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values stores, allocated on first use, each shaped like what
        the model writes (`keys`, `values`: rows, kv_heads, width, head_dim)."""
        if layer_idx not in self.keys:
            if layer_idx not in self.held:
                raise ValueError(f"layer {layer_idx} is not held by this stage ({self.held})")
            for store, like in ((self.keys, keys), (self.values, values)):
                shape = (self.num_slots, like.shape[1], self.max_seq_len, like.shape[3])
                store[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return self.keys[layer_idx], self.values[layer_idx]

    def view(self, slots: list[int], starts: list[int], counts: list[int], width: int) -> BatchView:
        return BatchView(self, slots, starts, counts, width)


class BatchView(Cache):
    """One step's rows of a `SlotPool`, as the `Cache` the model updates and reads."""

    def __init__(
        self, pool: SlotPool, slots: list[int], starts: list[int], counts: list[int], width: int
    ) -> None:
        super().__init__(layers=[])
        if not len(slots) == len(starts) == len(counts):
            raise ValueError("slots, starts and counts must have one entry per row")
        for slot, start, count in zip(slots, starts, counts, strict=True):
            if not 0 <= slot < pool.num_slots:
                raise ValueError(f"slot {slot} is outside the pool of {pool.num_slots}")
            if not 1 <= count <= width or start < 0 or start + count > pool.max_seq_len:
                raise ValueError(
                    f"a row of {count} token(s) at {start} does not fit width "
                    f"{width} and max_seq_len {pool.max_seq_len}"
                )
        self.pool, self.width = pool, width
        self.slots = torch.tensor(slots, device=pool.device)
        self.starts = torch.tensor(starts, device=pool.device)
        self.counts = torch.tensor(counts, device=pool.device)
        self._rows = list(zip(slots, starts, counts, strict=True))
        self.decode = width == 1  # every row one token: one vectorised write
        # Rows in consecutive slots (the engine hands out the lowest free slot and orders a
        # step's rows by slot, so this is the common case): the stores are read through a
        # view instead of a gather that copies every row's keys and values at every layer.
        first = slots[0]
        self._span = (
            slice(first, first + len(slots))
            if slots == list(range(first, first + len(slots)))
            else None
        )
        self.kv_length = max(s + c for s, c in zip(starts, counts, strict=True))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.stores(layer_idx, key_states, value_states)
        if self.decode:
            keys[self.slots, :, self.starts] = key_states[:, :, 0]
            values[self.slots, :, self.starts] = value_states[:, :, 0]
        else:
            for row, (slot, start, count) in enumerate(self._rows):
                keys[slot, :, start : start + count] = key_states[row, :, self.width - count :]
                values[slot, :, start : start + count] = value_states[row, :, self.width - count :]
        length = self.kv_length
        if self._span is not None:
            return keys[self._span, :, :length], values[self._span, :, :length]
        return keys[self.slots, :, :length], values[self.slots, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.starts.min())  # positions come from position_ids, never from here

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        raise NotImplementedError(_UNROUTED)

    def get_query_offset(self, layer_idx: int) -> int:
        raise NotImplementedError(_UNROUTED)

    @property
    def is_compileable(self) -> bool:
        return False

    def mask(
        self, *, sliding_window: int | None, dtype: torch.dtype, implementation: str
    ) -> torch.Tensor:
        """The 4D mask (rows, 1, width, kv_length) of this step: a real token sees its row's
        positions up to its own (and, with `sliding_window`, fewer than that many back); a
        padding query sees position 0 only (always written: it never yields NaN). Boolean for
        sdpa, additive (0 / dtype min) for eager attention, as transformers builds them."""
        keys = torch.arange(self.kv_length, device=self.pool.device)
        queries = row_positions(self.starts, self.counts, self.width)[
            :, :, None
        ]  # (rows, width, 1)
        allowed = keys <= queries
        if sliding_window is not None:
            allowed &= keys > queries - sliding_window
        column = torch.arange(self.width, device=self.pool.device)
        padding = (column < self.width - self.counts[:, None])[:, :, None]
        allowed = torch.where(padding, keys == 0, allowed)[:, None]
        if implementation == "sdpa":
            return allowed
        additive = torch.zeros(allowed.shape, dtype=dtype, device=self.pool.device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
