"""Defects a review of the engine found (issue 53, point 6), each pinned by what it broke: a
home block that held a cached prefix was evicted while free blocks were left; the free-block
heap grew with every take and release; a sequence's tokens were rebuilt (prompt + generated)
on every read, so a decode step cost O(length) per row; rows in their home regions but not in
consecutive slots copied each whole region per layer before narrowing it to the step's keys."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coordinator.engine.blocks import BlockPool
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequences import Finish, Request
from worker.batch_cache import KvPool
from worker.steps import Sampling, contiguous_tables

GREEDY = Sampling()


def request(prompt: list[int], max_new_tokens: int = 1000) -> Request:
    return Request.of([prompt], sampling=GREEDY, max_new_tokens=max_new_tokens)


def run_step(scheduler: Scheduler, token: int = 7) -> None:
    """Plan micro-batch 0's next step, hand every row `token`, and complete it."""
    step = scheduler.plan(0)
    assert step is not None
    scheduler.update(step, 0, np.full(len(step.sequences), token, dtype=np.int64))
    scheduler.complete(step)


# 1. the home-block preference never evicts a cached prefix while a free block is left


def test_a_named_home_block_is_kept_while_free_blocks_are_left() -> None:
    """Slot 0's home blocks hold a cached prefix nobody runs: a new sequence in slot 0 takes
    free blocks elsewhere and the prefix stays found; once no free block is left, the least
    recently used named block goes (not the preferred one)."""
    pool = BlockPool(8, 16, num_slots=2, prefix_caching=True)  # regions: 0-3 and 4-7
    prefix = [pool.take(pool.home(0, i)) for i in range(2)]
    assert prefix == [0, 1]
    names = pool.names(list(range(32)), [], 2)
    pool.name(prefix, names)
    pool.release(prefix)
    assert pool.lookup(names) == [0, 1] and pool.available == 8

    taken = [pool.take(pool.home(0, i)) for i in range(2)]
    assert not set(taken) & {0, 1}, f"the cached prefix's blocks {taken} were evicted"
    assert pool.lookup(names) == [0, 1]
    assert pool.take(pool.home(0, 2)) == 2  # a free home block is still the first choice

    # no free block left: the least recently used name goes, even where another is preferred
    rest = [pool.take() for _ in range(pool.available - 2)]
    other = pool.names(list(range(100, 116)), [], 1)
    pool.name(rest[:1], other)
    pool.release(rest[:1])  # named after the prefix's: more recently used
    # the LRU block: the prefix's last (a sequence lets its blocks go from the end, so an
    # eviction shortens a prefix from its end and the rest stays found)
    assert pool.take(preferred=rest[0]) == 1
    assert pool.lookup(names) == [0] and pool.lookup(other) == rest[:1]


def test_a_cached_prefix_survives_another_sequence_in_its_slot() -> None:
    """Through the scheduler: A fills slot 0's home blocks and ends, B (another prompt) runs
    in slot 0 while free blocks are left, then C with A's prompt reuses A's two full blocks."""
    scheduler = Scheduler(
        num_slots=2, max_seq_len=64, num_groups=1, prefill_tokens=64, prefix_caching=True
    )
    first = request(list(range(3, 43)))
    for prompt_request in (first, request(list(range(50, 90)))):
        scheduler.enqueue(prompt_request)
        [seq] = scheduler.admit()
        assert seq.slot == 0
        run_step(scheduler)
        scheduler.finish_request(prompt_request, Finish.ABORT)
    third = request(list(range(3, 43)))
    scheduler.enqueue(third)
    scheduler.admit()
    assert scheduler.blocks.hits == 32  # A's two full blocks, still cached
    assert third.sequences[0].cached == 32


# 2. the free-block heap stays the pool's size


def test_the_free_block_heap_stays_bounded_over_many_cycles() -> None:
    """10,000 take/release cycles of home blocks (taken without leaving the heap) on a 64-block
    pool: the heap holds at most one entry per block, and `take()` still gives the highest
    free block."""
    pool = BlockPool(64, 16, num_slots=4, prefix_caching=False)
    for i in range(10_000):
        block = pool.take(pool.home(i % 4, i % 3))
        pool.release([block])
    assert len(pool._highest) <= 64, f"{len(pool._highest)} heap entries for 64 blocks"
    assert [pool.take() for _ in range(64)] == list(range(63, -1, -1))


def test_random_takes_and_releases_always_give_the_highest_free_block() -> None:
    """Against a plain set: whatever the order of takes (home or not) and releases, `take()`
    gives the highest free block and the heap never outgrows the pool."""
    rng = random.Random(53)
    pool = BlockPool(32, 16, num_slots=4, prefix_caching=False)
    free, held = set(range(32)), []
    for _ in range(5_000):
        if held and (not free or rng.random() < 0.5):
            block = held.pop(rng.randrange(len(held)))
            pool.release([block])
            free.add(block)
            continue
        preferred = pool.home(rng.randrange(4), rng.randrange(8)) if rng.random() < 0.5 else None
        block = pool.take(preferred)
        want = preferred if preferred in free else max(free)
        assert block == want
        free.discard(block)
        held.append(block)
        assert len(pool._highest) <= 32


# 3. a decode step reads a sequence's tokens without rebuilding them


class CountingList(list):
    """A prompt that counts the elements every copy of it reads (concatenation, iteration,
    slicing)."""

    copied = 0

    def __add__(self, other):
        CountingList.copied += len(self)
        return list(self.__iter__()) + list(other)

    def __iter__(self):
        CountingList.copied += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.copied += len(item)
        return item


def test_tokens_are_one_list_that_follows_what_was_generated() -> None:
    """`tokens` is the same list read after read, and it follows every way `generated` grows
    (the scheduler's update, a client's append) or is replaced."""
    seq = request([3, 4, 5]).sequences[0]
    tokens = seq.tokens
    assert seq.tokens is tokens and tokens == [3, 4, 5]
    seq.generated.append(9)  # as coordinator.engine.host's client does
    assert seq.tokens is tokens and seq.tokens == [3, 4, 5, 9]
    assert len(seq.tokens) == 4 and seq.tokens[-1] == 9
    seq.generated = [1, 2]
    assert seq.tokens == [3, 4, 5, 1, 2]
    seq.prompt = [8]
    assert seq.tokens == [8, 1, 2]


def test_a_decode_step_does_not_copy_a_long_sequence() -> None:
    """A 50,000-token prompt, prefilled: twenty decode steps (planned, updated, completed,
    crossing a block's end with prefix caching on) copy none of it."""
    n = 50_000
    scheduler = Scheduler(
        num_slots=2, max_seq_len=n + 64, num_groups=1, prefill_tokens=n, prefix_caching=True
    )
    long = request([5 + i % 50 for i in range(n)])
    scheduler.enqueue(long)
    [seq] = scheduler.admit()
    run_step(scheduler, token=11)  # the prefill: the whole prompt, then its first token
    assert seq.cached == n and seq.generated == [11]
    seq.prompt = CountingList(seq.prompt)
    assert len(seq.tokens) == n + 1  # (a rebuild after the prompt was replaced may copy once)
    CountingList.copied = 0
    for i in range(20):
        step = scheduler.plan(0)
        assert not step.prefill and step.x.tolist() == [[seq.generated[-1]]]
        scheduler.update(step, 0, np.array([12 + i]))
        scheduler.complete(step)
    assert seq.cached == n + 20 and len(seq.block_names) > n // 16  # a block was named
    assert CountingList.copied == 0, f"decode steps copied {CountingList.copied} prompt tokens"
    assert seq.tokens == [*list.__iter__(seq.prompt), 11, *range(12, 32)]


# 4. rows in home regions, slots not consecutive: only the step's keys are copied


class IndexShapes(TorchDispatchMode):
    """The shape of every advanced-index copy (`aten.index`) made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index.Tensor:
            self.shapes.append(tuple(out.shape))
        return out


def test_rows_in_home_regions_of_scattered_slots_copy_only_the_steps_keys() -> None:
    """Slots 2, 0, 3 (not consecutive) in their home regions of 12 positions: a decode step
    whose keys end at position 4 copies rows x 4 positions of each store, not rows x 12, and
    reads exactly the keys and values each row's blocks hold."""
    heads, dim, max_len, block = 2, 4, 12, 4
    pool = KvPool([0], num_blocks=12, block_size=block, num_slots=4, device=torch.device("cpu"))
    slots, lengths = [2, 0, 3], [3, 2, 1]
    tables = contiguous_tables(slots, max_len, block)
    g = torch.Generator().manual_seed(0)
    prefill = pool.view(slots, [0, 0, 0], lengths, 3, tables)
    prefill.update(torch.randn(3, heads, 3, dim, generator=g), torch.randn(3, heads, 3, dim), 0)
    decode = pool.view(slots, lengths, [1, 1, 1], 1, tables)
    assert decode.kv_length == 4 and decode._home is not None  # the home-region path
    new_k, new_v = torch.randn(3, heads, 1, dim, generator=g), torch.randn(3, heads, 1, dim)
    with IndexShapes() as seen:
        got_k, got_v = decode.update(new_k, new_v, 0)
    assert seen.shapes == [(3, 4, heads, dim)] * 2, f"copied {seen.shapes}"
    for store, got in ((pool.keys[0], got_k), (pool.values[0], got_v)):
        for r, table in enumerate(tables):
            want = store[list(table)].flatten(0, 1)[:4].transpose(0, 1)
            assert torch.equal(got[r], want)
    for r, length in enumerate(lengths):  # the new token is where its row's position is
        assert torch.equal(got_k[r, :, length], new_k[r, :, 0])
        assert torch.equal(got_v[r, :, length], new_v[r, :, 0])
