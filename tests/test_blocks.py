"""The KV block pool's own contract (`coordinator.engine.blocks`), driven directly: a full
block's name stands for every token up to its end, not only its own, so a prefix is found
only where the whole of it was computed; a block takes one name, the first given, and a name
list that does not match the blocks is refused; each slot's home region is its `region`
blocks and ends there, the pool's tail belonging to no slot.

From mutation testing (issue 60): each test kills mutants no other test noticed (the chain of
names cut, a home block past the region's end, the name list's length unchecked).
"""

from __future__ import annotations

import pytest

from coordinator.engine.blocks import BlockPool, block_digest

SIZE = 4  # tokens per block


def test_a_block_name_stands_for_every_token_before_it() -> None:
    """The same block of tokens after different prefixes has different names, so a prompt is
    never handed keys computed after another prefix: with [A, X] and [B, Y] cached, a prompt
    [B, X] reuses B's block and computes X again (its keys attend to B, not to A)."""
    a, b, x, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    assert block_digest(block_digest(b"", a), x) != block_digest(block_digest(b"", b), x)
    assert block_digest(b"", a) == block_digest(b"", list(a))  # a name is the tokens', only

    pool = BlockPool(8, SIZE, num_slots=2, prefix_caching=True)
    ax, by, bx = a + x, b + y, b + x
    names_ax, names_by, names_bx = (pool.names(t, [], 2) for t in (ax, by, bx))
    assert names_bx[0] == names_by[0] and names_bx[1] != names_ax[1] != names_by[1]
    # extending the names a sequence kept gives the names computed at once
    known = pool.names([*ax, 0, 0], [], 1)
    assert pool.names([*ax, 0, 0], known, 2) == names_ax and known == names_ax

    first = [pool.take(pool.home(0, i)) for i in range(2)]
    pool.name(first, names_ax)
    second = [pool.take(pool.home(1, i)) for i in range(2)]
    pool.name(second, names_by)
    pool.release(first)
    pool.release(second)
    assert pool.lookup(names_ax) == first and pool.lookup(names_by) == second
    assert pool.lookup(names_bx) == second[:1], "a block cached after A was found after B"
    assert pool.lookup(pool.names(x + b, [], 2)) == []  # X first: nothing cached starts so


def test_a_block_takes_one_name_per_block_given() -> None:
    """`name` pairs blocks with names one to one: a list of names that does not match the
    blocks is a caller's mistake, refused (ValueError), not silently cut to the shorter; the first block given a
    name keeps it (a second block with the same keys stays unnamed), a named block keeps its
    name; without prefix caching nothing is named."""
    pool = BlockPool(8, SIZE, num_slots=2, prefix_caching=True)
    names = pool.names(list(range(3 * SIZE)), [], 3)
    blocks = [pool.take() for _ in range(3)]
    with pytest.raises(ValueError):
        pool.name(blocks, names[:2])
    with pytest.raises(ValueError):
        pool.name(blocks[:2], names)

    pool = BlockPool(8, SIZE, num_slots=2, prefix_caching=True)
    blocks = [pool.take() for _ in range(3)]
    pool.name(blocks[:1], names[:1])
    twin = pool.take()
    pool.name([twin], names[:1])  # the same tokens' keys in another block: the first stays
    pool.name(blocks[:1], names[1:2])  # a named block keeps its name
    assert pool.lookup(names[:1]) == blocks[:1] and pool.lookup(names[1:2]) == []
    pool.release([twin])
    assert pool.cost(blocks[:1]) == 0  # still held, so sharing it costs nothing
    assert pool.available == 8 - 3  # the unnamed twin is free again
    pool.release(blocks[:1])  # named, held by none: kept, and sharing it takes one block
    assert pool.cost(blocks[:1]) == 1 and pool.available == 8 - 2
    assert pool.lookup(names[:1]) == blocks[:1]

    plain = BlockPool(8, SIZE, num_slots=2, prefix_caching=False)
    taken = [plain.take() for _ in range(3)]
    plain.name(taken, names)
    plain.release(taken)
    assert plain.lookup(names) == [] and plain.available == 8


def test_each_slot_s_home_region_ends_where_the_next_begins() -> None:
    """10 blocks, 3 slots: each slot's home is 3 blocks from slot x 3, None past them (never
    the next slot's first block); block 9, in no region, is the first one `take()` gives when
    no home is asked for, then the ends of the last regions."""
    pool = BlockPool(10, SIZE, num_slots=3, prefix_caching=False)
    assert pool.region == 3
    assert [[pool.home(slot, i) for i in range(4)] for slot in range(3)] == [
        [0, 1, 2, None],
        [3, 4, 5, None],
        [6, 7, 8, None],
    ]
    assert pool.home(0, 7) is None
    # a sequence past its home region takes the highest free block, not the next slot's home
    homes = [pool.take(pool.home(0, i)) for i in range(3)]
    assert homes == [0, 1, 2]
    assert pool.take(pool.home(0, 3)) == 9
    assert pool.take(pool.home(0, 4)) == 8
    assert pool.used == 5 and pool.available == 5
