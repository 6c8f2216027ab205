"""One step's rows of a stage's `KvPool` (worker.batch_cache) as the transformers `Cache` the
model's own code updates and reads. Its own module: the pool and the engine's bookkeeping need
no transformers (a load's keeper, which runs its engine, starts without importing it).

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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from worker.positions import row_positions
from worker.spec import blocks_for

if TYPE_CHECKING:
    from worker.batch_cache import KvPool

# A mask function other than the two `worker.stage` routes here reached the cache: this family
# builds its masks some other way, and a mask sized as one sequence would be silently wrong.
_UNROUTED = (
    "this model builds an attention mask that batched generation does not route "
    "(only create_causal_mask, create_sliding_window_causal_mask and "
    "create_chunked_causal_mask are): its family "
    "cannot generate in batches yet"
)


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
        # slots) or one copy of each row's first kv_length positions, not a gather of each block
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
            # narrowed to the step's keys before the rows are picked: slots not consecutive
            # copy rows x kv_length positions, not every row's whole region (max_seq_len)
            return regions[:, : self.kv_length][self._home].transpose(1, 2)
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
