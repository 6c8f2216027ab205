"""The KV pool's blocks as the engine hands them out: which are free, which running sequences
hold which, and (prefix caching) which full blocks hold the keys and values of which tokens, so
that a sequence whose tokens start like an earlier one's (a system prompt, a chat history)
reuses its blocks instead of computing them again.

A causal model's keys and values at position p are a function of tokens 0..p, so a full block
is named by a digest of every token up to its end: the digest of the block before it and the
block's own tokens (chained block by block, as vLLM's prefix cache keys them). A block is held
by every running sequence that uses it (a count); when the last one lets it go, a named block
stays as it is, evictable (the least recently used goes first when a block is needed), until a
sequence with the same tokens takes it again, and an unnamed one is free. Only full blocks are
named and shared, and a sequence writes only past the tokens it reused, so no block is written
while another sequence reads it. When the workers lose their caches (a recovery, a new claim),
every name goes (`clear`).

Each slot (a running sequence's index) has a home region of the pool, `region` blocks from
slot x region on: a sequence takes its home blocks in order while they are free, and a step
whose rows all sit in theirs is read through a view of the workers' stores, as a slot per
sequence would be, not gathered block by block (`worker.batch_cache.KvPool.region_blocks`).
Blocks from elsewhere (the highest free first: the pool's tail past every region, then the
ends of the last regions, which only long sequences reach) keep a sequence going past its
region, and shared prefix blocks are wherever they were filled: those steps gather. A home
block that holds a cached prefix nobody runs is not free: it is taken for new keys only when
no free block is left anywhere, and then only as the least recently used named block, as any
other. A hit saves computing a block at every layer; a gather costs a copy of the step's keys.
So with prefix caching, a sequence whose home blocks still hold an ended sequence's prefix
takes free blocks elsewhere, and its steps gather, until that prefix is evicted or reused.

Without Ray and threads: the scheduler calls it from the engine's one loop.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence


def block_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: its tokens after the name of the block before it."""
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, *, num_slots: int, prefix_caching: bool
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.region = num_blocks // num_slots  # blocks of each slot's home region
        self.prefix_caching = prefix_caching
        self._holders: dict[int, int] = {}  # block -> running sequences holding it
        self._name_of: dict[int, bytes] = {}
        self._by_name: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, held by none: LRU
        self._all_free()
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of them, found there (not computed again)

    @property
    def available(self) -> int:
        """Blocks a sequence can take now: free ones, and named ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def home(self, slot: int, index: int) -> int | None:
        """Block `index` of slot `slot`'s home region (None: past its end)."""
        return slot * self.region + index if index < self.region else None

    def take(self, preferred: int | None = None) -> int:
        """A block for new keys: `preferred` (a home block) when it is free, else the highest
        free one, else the least recently used named one nobody holds (its name goes). A named
        block is never taken while a free one is left, even as someone's home: that would
        throw away a cached prefix for a view's sake. The caller checked `available`."""
        if preferred is not None and preferred in self._free:
            block = preferred
            self._free.discard(block)  # its heap entry goes stale: skipped, or valid once freed
        elif self._free:
            while True:
                block = -heapq.heappop(self._highest)
                self._queued.discard(block)
                if block in self._free:  # else taken as someone's home since it was pushed
                    break
            self._free.discard(block)
        else:
            block = self._evict(next(iter(self._evictable)))  # the least recently used
        self._holders[block] = 1
        return block

    def _evict(self, block: int) -> int:
        """A named block nobody holds, taken for new keys: its name goes."""
        del self._evictable[block]
        del self._by_name[self._name_of.pop(block)]
        return block

    def _all_free(self) -> None:
        self._free: set[int] = set(range(self.num_blocks))
        # The free blocks as a max-heap, lazily pruned: a home block taken leaves its entry
        # behind (stale until popped). `_queued` holds the blocks with an entry, so freeing a
        # block whose stale entry is still there pushes nothing: at most one entry per block,
        # where a push per release grew it by one per take-and-release cycle of a home block.
        self._highest: list[int] = [-b for b in range(self.num_blocks)]
        heapq.heapify(self._highest)
        self._queued: set[int] = set(range(self.num_blocks))

    def _set_free(self, block: int) -> None:
        self._free.add(block)
        if block not in self._queued:
            self._queued.add(block)
            heapq.heappush(self._highest, -block)

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence lets its blocks go (it ended, or was preempted)."""
        for block in reversed(blocks):
            left = self._holders[block] - 1
            if left:
                self._holders[block] = left
                continue
            del self._holders[block]
            if block in self._name_of:
                self._evictable[block] = None
            else:
                self._set_free(block)

    def names(self, tokens: Sequence[int], known: list[bytes], full_blocks: int) -> list[bytes]:
        """The names of the first `full_blocks` blocks of `tokens`, extending `known` (the
        names computed before, kept by the sequence)."""
        size = self.block_size
        for i in range(len(known), full_blocks):
            previous = known[-1] if known else b""
            known.append(block_digest(previous, tokens[i * size : (i + 1) * size]))
        return known[:full_blocks]

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of `names` from the first that the pool holds."""
        found = []
        for name in names:
            block = self._by_name.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def cost(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (found by `lookup`) sharing them takes from `available`."""
        return sum(1 for b in blocks if b in self._evictable)

    def share(self, blocks: Sequence[int]) -> None:
        """A sequence holds `blocks` (found by `lookup`) as its first ones."""
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
                self._holders[block] = 1
            else:
                self._holders[block] += 1

    def name(self, blocks: Sequence[int], names: Sequence[bytes]) -> None:
        """`blocks` are full of the keys of the tokens `names` name (in order): a later
        sequence with those tokens may share them. A name another block has already keeps
        that block (both hold the same keys; this one stays unnamed)."""
        if not self.prefix_caching:
            return
        for block, name in zip(blocks, names, strict=True):
            if name not in self._by_name and block not in self._name_of:
                self._by_name[name] = block
                self._name_of[block] = name

    def clear(self) -> None:
        """The workers lost every block's contents: no name is true any more. Only with no
        block held."""
        assert not self._holders, "the prefix cache cleared under running sequences"
        self._all_free()
        self._name_of.clear()
        self._by_name.clear()
        self._evictable.clear()
