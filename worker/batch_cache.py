"""A stage's KV cache for every sequence in flight: a pool of fixed-size blocks shared by all
of them, and a slot per running sequence for what does not grow with its length.

Each decoder layer the stage holds gets a keys and a values store of shape (blocks,
block_size, kv_heads, head_dim), each shaped as the model writes it (DeepSeek's multi-head latent
attention writes its compressed latent as keys and its rotated key part as values, one head
each), allocated at load by a first write and kept: the bytes the plan reserved (its pool of
tokens), never more, and no allocation per request or per step. The engine gives a sequence
blocks as it grows and frees them the step it ends; each row of a step reads and writes the
blocks of its block table (the blocks of positions 0.., in order: the stage keeps each slot's,
and a step carries what changed in it, `StepRows.table_from`), so a sequence takes the memory
its tokens need, not `max_seq_len` of it (vLLM measured 60-80% of a slot-per-sequence cache
wasted).
A freed block's stale keys are never read: the mask only lets a row see the positions it wrote.

Layers with recurrent state (mamba mixers, gated delta-net and other linear attention, short
convolutions: `qwen3_next`, `bamba`, `jamba`, `lfm2`...) keep per sequence a fixed-size state
instead of keys and values, in its slot (`num_slots`: the sequences running at once): the
model's own code asks the cache for its convolution and recurrent states (`get_conv_state`,
`update_recurrent_state`, as transformers' `LinearAttentionLayer` answers them) and the pool
keeps them per slot, shaped as the model writes them. A row whose sequence starts in this step
(`start` 0) gets its slot's states cleared first (a freed slot's state is never read by the next
sequence); when every row starts, the model sees no previous state, as transformers' own fresh
cache gives. A recurrence cannot skip a padded position (a mamba state decays on a zero input, a
convolution shifts it in), so a step through such a layer must have every row feed exactly
`width` tokens: the engine plans such steps for these models (`Scheduler(uniform=True)`), and a
padded one is refused here, never run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from worker.spec import DEFAULT_BLOCK_SIZE, blocks_for

if TYPE_CHECKING:
    from worker.batch_view import BatchView

__all__ = ["DEFAULT_BLOCK_SIZE", "KvPool", "blocks_for"]


class KvPool:
    """Keys and values in `num_blocks` blocks of `block_size` positions, for the decoder layers
    `held_layers` (model indices), and the recurrent states of `num_slots` sequences."""

    def __init__(
        self,
        held_layers: list[int],
        *,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: torch.device,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_slots < 1:
            raise ValueError(
                f"a KV pool needs num_blocks, block_size and num_slots >= 1, got {num_blocks}, "
                f"{block_size} and {num_slots}"
            )
        self.held = sorted(held_layers)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots, self.device = num_slots, device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        # (kind "conv" or "recurrent", layer, state index) -> (slots, *one sequence's state)
        self.states: dict[tuple[str, int, int], torch.Tensor] = {}
        self.state_at: dict[int, int] = {}  # slot -> how many tokens its states took in

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_blocks, self.block_size, self.num_slots

    @property
    def region_blocks(self) -> int:
        """Blocks of each slot's home region: slot s's are s*R .. s*R + R-1. The engine gives a
        sequence its home blocks first (`coordinator.engine.blocks`), so that a step whose rows
        all sit in theirs reads them through a view, as a slot per sequence would, instead of
        gathering every block: a gather of every row's keys at every layer cost 25-30% of a
        decode step of 16 rows on a CPU (the 106 MiB bench llama, 4 layers)."""
        return self.num_blocks // self.num_slots

    def nbytes(self) -> int:
        stores = (*self.keys.values(), *self.values.values(), *self.states.values())
        return sum(t.numel() * t.element_size() for t in stores)

    def state_store(
        self, key: tuple[str, int, int], like: torch.Tensor, length: int | None = None
    ) -> torch.Tensor:
        """The store of recurrent-state `key`, allocated on first use shaped like one row of
        `like` (a convolution state with its last dim `length`: the kernel's)."""
        store = self.states.get(key)
        if store is None:
            if key[1] not in self.held:
                raise ValueError(f"layer {key[1]} is not held by this stage ({self.held})")
            shape = (*like.shape[1:-1], length) if length is not None else like.shape[1:]
            store = self.states[key] = torch.zeros(
                (self.num_slots, *shape), dtype=like.dtype, device=self.device
            )
        return store

    def clear_states(self, slots: list[int]) -> None:
        """Zero every recurrent state of `slots` (their sequences start now)."""
        if slots and self.states:
            index = torch.tensor(slots, device=self.device)
            with torch.inference_mode():  # the stores were made in a step's inference mode
                for store in self.states.values():
                    store.index_fill_(0, index, 0)

    def stores(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values stores (blocks, block_size, kv_heads, head_dim),
        allocated on first use, each shaped like what the model writes (`keys`, `values`:
        rows, kv_heads, width, head_dim)."""
        if layer_idx not in self.keys:
            if layer_idx not in self.held:
                raise ValueError(f"layer {layer_idx} is not held by this stage ({self.held})")
            for store, like in ((self.keys, keys), (self.values, values)):
                shape = (self.num_blocks, self.block_size, like.shape[1], like.shape[3])
                store[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return self.keys[layer_idx], self.values[layer_idx]

    def view(
        self,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        width: int,
        tables: Sequence[Sequence[int]],
    ) -> BatchView:
        from worker.batch_view import BatchView  # transformers: only where a step runs

        return BatchView(self, slots, starts, counts, width, tables)
