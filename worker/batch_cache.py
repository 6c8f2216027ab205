"""A stage's KV cache for every sequence in flight: a pool of fixed-size blocks shared by all
of them, and a slot per running sequence for what does not grow with its length.

Each decoder layer the stage holds gets a keys and a values store of shape (blocks,
block_size, kv_heads, head_dim), each shaped as the model writes it (DeepSeek's multi-head latent
attention writes its compressed latent as keys and its rotated key part as values, one head
each), allocated at load by a first write and kept: the bytes the plan reserved (its pool of
tokens), never more, and no allocation per request or per step. The engine gives a sequence
blocks as it grows and frees them the step it ends; a step carries each row's block table
(`StepRows.tables`: the blocks of positions 0.., in order), so a sequence takes the memory its
tokens need, not `max_seq_len` of it (vLLM measured 60-80% of a slot-per-sequence cache wasted).
A freed block's stale keys are never read: the mask only lets a row see the positions it wrote.

A step sees the pool through a `BatchView` (a transformers `Cache`): the step's rows, their
slots and tables, where each row's new tokens start and how many there are. Rows are
left-padded to the step's width; only the real tokens are written, each into its block and
offset. A layer's attention gets each row's keys and values gathered from its blocks into
(rows, kv_heads, positions, head_dim), position j of a row being position j of its sequence:
the model's own attention and masks run unchanged (no paged kernel). The masks follow each
row's own length; the model's code asks for them by kind (`create_causal_mask`,
`create_sliding_window_causal_mask`, `create_chunked_causal_mask`) and `worker.stage` routes
those calls here (`mask`). Any other mask function reaches `get_query_offset`, which refuses
it. A model may ask the cache how many keys a step attends to (`get_mask_sizes`; Bloom builds
its ALiBi biases from it): every row's keys sit at their own positions, so a bias linear in the
key's position is right for each row (softmax ignores a constant per query).

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

import functools
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from worker.spec import DEFAULT_BLOCK_SIZE, blocks_for

__all__ = ["DEFAULT_BLOCK_SIZE", "BatchView", "KvPool", "blocks_for", "contiguous_tables"]

# A mask function other than the two `worker.stage` routes here reached the cache: this family
# builds its masks some other way, and a mask sized as one sequence would be silently wrong.
_UNROUTED = (
    "this model builds an attention mask that batched generation does not route "
    "(only create_causal_mask, create_sliding_window_causal_mask and "
    "create_chunked_causal_mask are): its family "
    "cannot generate in batches yet"
)


def row_positions(starts: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Position ids (rows, width) of rows left-padded to `width`: each real token its place in
    its sequence (row r's `counts[r]` tokens from `starts[r]` on), padding 0."""
    if width == 1:  # one token a row (a decode step): at its start
        return starts[:, None]
    column = torch.arange(width, device=starts.device)
    return (starts[:, None] + column - (width - counts[:, None])).clamp(min=0)


def contiguous_tables(
    slots: Sequence[int], max_seq_len: int, block_size: int
) -> tuple[tuple[int, ...], ...]:
    """Block tables that give each slot its own run of blocks for `max_seq_len` positions (slot
    s: blocks s*n .. s*n + n-1): for callers that keep one sequence per slot and no block
    bookkeeping (a probe, the family check, tests). Their pool needs `num_slots * n` blocks."""
    n = blocks_for(max_seq_len, block_size)
    return tuple(tuple(range(slot * n, slot * n + n)) for slot in slots)


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
        return BatchView(self, slots, starts, counts, width, tables)


class BatchView(Cache):
    """One step's rows of a `KvPool`, as the `Cache` the model updates and reads."""

    def __init__(
        self,
        pool: KvPool,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        width: int,
        tables: Sequence[Sequence[int]],
    ) -> None:
        super().__init__(layers=[])
        if not len(slots) == len(starts) == len(counts) == len(tables):
            raise ValueError("slots, starts, counts and tables must have one entry per row")
        size, num_blocks = pool.block_size, pool.num_blocks
        for slot, start, count, table in zip(slots, starts, counts, tables, strict=True):
            if not 0 <= slot < pool.num_slots:
                raise ValueError(f"slot {slot} is outside the pool of {pool.num_slots}")
            if not 1 <= count <= width or start < 0 or start + count > len(table) * size:
                raise ValueError(
                    f"a row of {count} token(s) at {start} does not fit width {width} and its "
                    f"{len(table)} block(s) of {size} positions"
                )
            if min(table) < 0 or max(table) >= num_blocks:
                raise ValueError(
                    f"slot {slot}'s block table {list(table)} names a block outside the pool "
                    f"of {num_blocks}"
                )
        self.pool, self.width = pool, width
        device = pool.device
        self._slots, self._starts, self._counts = list(slots), list(starts), list(counts)
        # a decode step: one new token per row, no padding
        self.decode = width == 1
        # Where each real token goes: its place in the flattened stores (block x block_size +
        # offset), once per step for every layer; and, unless every row feeds one token (a
        # decode step, whose sources are simply column 0), which (row, column) of the step's
        # input it comes from.
        self._places = torch.tensor(
            [
                table[p // size] * size + p % size
                for start, count, table in zip(starts, counts, tables, strict=True)
                for p in range(start, start + count)
            ],
            device=device,
        )
        self._sources = (
            None
            if self.decode
            else (
                torch.tensor([r for r, c in enumerate(counts) for _ in range(c)], device=device),
                torch.tensor([width - c + i for c in counts for i in range(c)], device=device),
            )
        )
        # Rows in consecutive slots (the engine hands out the lowest free slot and orders a
        # step's rows by slot, so this is the common case): recurrent states, and keys in the
        # slots' home regions, are read through a view instead of a gather.
        first = slots[0]
        self._span = (
            slice(first, first + len(slots))
            if self._slots == list(range(first, first + len(slots)))
            else None
        )
        self.kv_length = max(s + c for s, c in zip(starts, counts, strict=True))
        # every row's last position is the step's last: nothing for a mask to hide in a
        # decode step
        self.aligned = self.decode and all(s + 1 == self.kv_length for s in starts)
        # The blocks each row's attention reads, positions 0..kv_length-1 (a row shorter than
        # that pads with its first block: positions it never wrote are masked)
        n = blocks_for(self.kv_length, size)
        # Every row in its slot's home region (`KvPool.region_blocks`), and the positions up to
        # kv_length inside it: the rows are read through a view of the stores (consecutive
        # slots) or one copy per row, not a gather of each block
        region = pool.region_blocks
        home = n <= region and all(
            list(t) == list(range(slot * region, slot * region + len(t)))
            for slot, t in zip(slots, tables, strict=True)
        )
        self._home = (self._span or self.slots) if home else None
        self._read = (
            None
            if home
            else torch.tensor(
                [list(t[:n]) + [t[0]] * (n - min(n, len(t))) for t in tables], device=device
            )
        )
        # recurrent state: rows that start here (cleared), and the states handed to the model
        # as copies (rows not consecutive) that its in-place updates change: written back by
        # `commit` after the step
        fresh = [slot for slot, start in zip(slots, starts, strict=True) if start == 0]
        if pool.states:  # a state cannot go back: a step must start where the last one ended
            for slot, start in zip(slots, starts, strict=True):
                if start and pool.state_at.get(slot) != start:
                    raise ValueError(
                        f"slot {slot}'s recurrent state took in {pool.state_at.get(slot, 0)} "
                        f"tokens, but the step feeds it from position {start}: a step ran "
                        "whose tokens were dropped (a recurrence cannot be rewound), or its "
                        "state was lost; the sequence must be fed again from its start"
                    )
        pool.clear_states(fresh)
        self.all_fresh = len(fresh) == len(slots)
        self.uniform = all(c == width for c in counts)
        self._handed: dict[tuple[str, int, int], torch.Tensor] = {}

    # The rows as tensors on the pool's device, made when a step needs them (a decode step of
    # rows in consecutive slots in their home regions, without recurrent state, never does)
    @functools.cached_property
    def slots(self) -> torch.Tensor:
        return torch.tensor(self._slots, device=self.pool.device)

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        return torch.tensor(self._starts, device=self.pool.device)

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        return torch.tensor(self._counts, device=self.pool.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.stores(layer_idx, key_states, value_states)
        for store, new in ((keys, key_states), (values, value_states)):
            # (rows, heads, width, dim) -> one (heads, dim) entry per real token
            new = (
                new[:, :, 0]
                if self._sources is None
                else new[self._sources[0], :, self._sources[1]]
            )
            store.view(-1, *store.shape[2:]).index_copy_(0, self._places, new)
        return self._gather(keys), self._gather(values)

    def _gather(self, store: torch.Tensor) -> torch.Tensor:
        """Each row's positions 0..kv_length-1 from its blocks: (rows, heads, kv_length, dim)."""
        if self._home is not None:
            pool = self.pool
            regions = store[: pool.num_slots * pool.region_blocks].view(
                pool.num_slots, pool.region_blocks * pool.block_size, *store.shape[2:]
            )
            rows = regions[self._home]
        else:
            rows = store[self._read].flatten(1, 2)  # (rows, blocks x block_size, heads, dim)
        return rows[:, : self.kv_length].transpose(1, 2)

    # recurrent state (transformers' LinearAttentionLayer interface, per row from the slots)
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state_rows(("conv", layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state_rows(("recurrent", layer_idx, state_idx))

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The step's inputs (rows, channels, width) after each row's previous convolution
        state (none when every row starts here: padded to the kernel as transformers does);
        the last `kernel` positions become each row's state."""
        key = ("conv", layer_idx, state_idx)
        previous = self._state_rows(key)
        existing = self.pool.states.get(key)
        kernel = existing.shape[-1] if existing is not None else conv_kernel_size
        kernel = kernel or conv_states.shape[-1]
        if previous is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self._write_rows(key, full[..., -kernel:], kernel)
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        key = ("recurrent", layer_idx, state_idx)
        self._check_uniform(key)
        self._write_rows(key, recurrent_states)
        return recurrent_states

    def has_previous_state(
        self, layer_idx: int | None = None, state_idx: int | None = None
    ) -> bool:
        return not self.all_fresh

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def commit(self) -> None:
        """Write the states the model updated in place (copies of rows not consecutive) back
        to their slots. Called once the step's forward is done."""
        if not self.pool.states:
            return
        with torch.inference_mode():
            for key, rows in self._handed.items():
                self.pool.states[key][self.slots] = rows
        self._handed.clear()
        for slot, start, count in zip(self._slots, self._starts, self._counts, strict=True):
            self.pool.state_at[slot] = start + count

    def _check_uniform(self, key: tuple[str, int, int]) -> None:
        if not self.uniform:
            raise ValueError(
                f"a step whose rows feed {sorted(set(self.counts.tolist()))} tokens (padded to "
                f"{self.width}) reached layer {key[1]}'s recurrent state: a recurrence cannot "
                "skip padding, so every row of a step through it must feed the same number of "
                "tokens (Scheduler(uniform=True))"
            )

    def _state_rows(self, key: tuple[str, int, int]) -> torch.Tensor | None:
        """The step's rows of state `key` (None when every row starts here): a view of the
        store when the rows are consecutive slots (the model's in-place updates land in it),
        else a copy that `commit` writes back."""
        self._check_uniform(key)
        if self.all_fresh:
            return None
        if key in self._handed:
            return self._handed[key]
        store = self.pool.states.get(key)
        if store is None:
            raise ValueError(
                f"layer {key[1]}'s {key[0]} state was never written, yet a row continues its "
                "sequence: the KV pool lost it (the stage changed); the sequence must be fed "
                "again from its start"
            )
        if self._span is not None:
            return store[self._span]
        rows = self._handed[key] = store[self.slots]
        return rows

    def _write_rows(
        self, key: tuple[str, int, int], rows: torch.Tensor, length: int | None = None
    ) -> None:
        store = self.pool.state_store(key, rows, length)
        if self._span is not None:
            store[self._span].copy_(rows)
        else:
            store[self.slots] = rows
        self._handed.pop(key, None)  # what the model wrote supersedes the copy handed out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self._starts)  # positions come from position_ids, never from here

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.kv_length, 0  # keys at positions 0..kv_length-1 in every row's slot

    def get_query_offset(self, layer_idx: int) -> int:
        raise NotImplementedError(_UNROUTED)

    @property
    def is_compileable(self) -> bool:
        return False

    def mask(
        self,
        *,
        sliding_window: int | None,
        dtype: torch.dtype,
        implementation: str,
        chunk: int | None = None,
    ) -> torch.Tensor | None:
        """The 4D mask (rows, 1, width, kv_length) of this step: a real token sees its row's
        positions up to its own (with `sliding_window`, fewer than that many back; with
        `chunk`, none before its own chunk of that many positions); a padding query sees
        position 0 only (always written: it never yields NaN). Boolean for
        sdpa, additive (0 / dtype min) for eager attention, as transformers builds them.

        None for sdpa when it would hide nothing (a decode step whose rows are all as long as
        the step, within the window and the chunk), as transformers leaves out a mask that
        allows everything: sdpa then takes its unmasked kernel, grouped-query heads unrepeated."""
        length = self.kv_length
        if (
            implementation == "sdpa"
            and self.aligned
            and (sliding_window is None or length <= sliding_window)
            and (chunk is None or length <= chunk)
        ):
            return None
        keys = torch.arange(length, device=self.pool.device)
        queries = row_positions(self.starts, self.counts, self.width)[
            :, :, None
        ]  # (rows, width, 1)
        allowed = keys <= queries
        if sliding_window is not None:
            allowed &= keys > queries - sliding_window
        if chunk is not None:  # Llama 4's chunked layers: only the query's own chunk
            allowed &= keys // chunk == queries // chunk
        if not self.decode:
            column = torch.arange(self.width, device=self.pool.device)
            padding = (column < self.width - self.counts[:, None])[:, :, None]
            allowed = torch.where(padding, keys == 0, allowed)
        allowed = allowed[:, None]
        if implementation == "sdpa":
            return allowed
        additive = torch.zeros(allowed.shape, dtype=dtype, device=self.pool.device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
