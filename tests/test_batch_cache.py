"""The KV pool alone: what a step writes into each row's blocks and reads back, for block tables
in any order and rows in any slots, sequences growing past one block and many; each row's mask
against a plain per-sequence reference; recurrent states per slot."""

from __future__ import annotations

import pytest
import torch

from worker.batch_cache import KvPool
from worker.steps import contiguous_tables

HEADS, DIM, MAX_LEN = 2, 4, 12
BLOCK = 4  # positions per block: a sequence of MAX_LEN takes 3


def pool_of(num_slots: int, num_blocks: int | None = None) -> KvPool:
    return KvPool(
        [0],
        num_blocks=num_blocks or num_slots * MAX_LEN // BLOCK,
        block_size=BLOCK,
        num_slots=num_slots,
        device=torch.device("cpu"),
    )


def tables(slots) -> tuple:
    return contiguous_tables(slots, MAX_LEN, BLOCK)


def kv(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, HEADS, width, DIM, generator=g),
        torch.randn(rows, HEADS, width, DIM, generator=g),
    )


# Each row's blocks: a run of its slot's, or scattered over the pool in any order (as a
# sequence takes whichever block is free when it crosses into the next).
SCATTERED = ((7, 2, 11, 5, 0), (3, 9), (10, 1, 6, 4))


@pytest.mark.parametrize("slots", [[0, 1, 2], [1, 2, 3], [2, 0, 3], [3, 1, 0]])
@pytest.mark.parametrize("scattered", [False, True])
def test_each_row_reads_back_exactly_what_its_sequence_wrote(slots, scattered: bool) -> None:
    """A prefill of three prompts (left-padded to width 5), then decode steps that take each
    row past the end of a block (and the longest past several): each row's keys and values are
    its own sequence's, in order, whatever slots and blocks the rows are in."""
    pool = pool_of(4, num_blocks=12 if scattered else None)
    lengths = [5, 2, 3]
    blocks = SCATTERED if scattered else tables(slots)
    keys, values = kv(3, 5, seed=1)
    history = [
        [(keys[r, :, 5 - n + i], values[r, :, 5 - n + i]) for i in range(n)]
        for r, n in enumerate(lengths)
    ]
    view = pool.view(slots, [0, 0, 0], lengths, 5, blocks)
    got_k, got_v = view.update(keys, values, 0)
    steps = 6
    for step in range(steps):
        starts = [n + step for n in lengths]
        view = pool.view(slots, starts, [1, 1, 1], 1, blocks)
        k, v = kv(3, 1, seed=10 + step)
        for r in range(3):
            history[r].append((k[r, :, 0], v[r, :, 0]))
        got_k, got_v = view.update(k, v, 0)
    assert got_k.shape == (3, HEADS, max(lengths) + steps, DIM)
    for r in range(3):
        want_k = torch.stack([h[0] for h in history[r]], dim=1)
        want_v = torch.stack([h[1] for h in history[r]], dim=1)
        n = want_k.shape[1]
        assert n > BLOCK  # every row crossed into a second block
        assert torch.equal(got_k[r, :, :n], want_k) and torch.equal(got_v[r, :, :n], want_v)


def test_a_block_freed_and_taken_by_another_sequence_holds_only_its_keys() -> None:
    """Sequence A writes two blocks and ends; B takes A's second block as its first: B reads
    its own keys there, and the positions past B's length (A's stale keys) are masked."""
    pool = pool_of(2, num_blocks=4)
    a_keys, a_values = kv(1, 8, seed=1)
    pool.view([0], [0], [8], 8, [(0, 1)]).update(a_keys, a_values, 0)
    b_keys, b_values = kv(1, 2, seed=2)
    view = pool.view([0], [0], [2], 2, [(1,)])
    got_k, got_v = view.update(b_keys, b_values, 0)
    assert torch.equal(got_k[0], b_keys[0]) and torch.equal(got_v[0], b_values[0])
    assert torch.equal(pool.keys[0][1, 2:].transpose(0, 1), a_keys[0, :, 6:])  # stale, unread
    mask = view.mask(sliding_window=None, dtype=torch.float32, implementation="sdpa")
    assert mask.shape[-1] == 2  # B attends to its own two positions only


@pytest.mark.parametrize(("window", "chunk"), [(None, None), (3, None), (None, 4)])
def test_masks_let_each_real_token_see_its_own_past_only(window, chunk) -> None:
    pool = pool_of(3)
    starts, counts, width = [4, 0, 2], [2, 3, 1], 3
    view = pool.view([2, 0, 1], starts, counts, width, tables([2, 0, 1]))
    kinds = dict(sliding_window=window, chunk=chunk, dtype=torch.float32)
    mask = view.mask(implementation="sdpa", **kinds)[:, 0]
    additive = view.mask(implementation="eager", **kinds)[:, 0]
    assert torch.equal(additive == 0, mask)
    for r in range(3):
        for column in range(width):
            pad = column < width - counts[r]
            position = starts[r] + column - (width - counts[r])
            for key in range(view.kv_length):
                if pad:  # a padding query sees position 0 only: no NaN, never read
                    want = key == 0
                else:
                    want = key <= position and (window is None or key > position - window)
                    want = want and (chunk is None or key // chunk == position // chunk)
                assert bool(mask[r, column, key]) == want, (r, column, key)


def test_a_row_that_does_not_fit_is_refused() -> None:
    pool = pool_of(2)
    with pytest.raises(ValueError, match="outside the pool of 2"):
        pool.view([2], [0], [1], 1, tables([1]))
    with pytest.raises(ValueError, match="does not fit"):
        pool.view([0], [MAX_LEN - 1], [2], 2, tables([0]))
    with pytest.raises(ValueError, match="does not fit width 1 and its 1 block"):
        pool.view([0], [BLOCK], [1], 1, [(0,)])  # its table ends before its position
    with pytest.raises(ValueError, match="names a block outside the pool of 6"):
        pool.view([0], [0], [1], 1, [(6,)])
    with pytest.raises(NotImplementedError, match="does not route"):
        pool.view([0], [0], [1], 1, tables([0])).get_query_offset(0)  # any other mask function


CHANNELS, KERNEL, STATE = 3, 4, (2, 5)  # a convolution's channels and kernel; an SSM state


def conv_like(rows: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, CHANNELS, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("slots", [[0, 1], [2, 0]])  # consecutive (a view), or not (a copy)
def test_recurrent_states_follow_each_row_through_its_slot(slots) -> None:
    """As a mamba layer uses them: a fresh prefill sees no state and writes its last `KERNEL`
    inputs; a decode sees each row's own state, updates it in place, and the pool keeps the
    update (written back for rows not in consecutive slots); a sequence new to a slot starts
    from a cleared state, the other row's untouched."""
    pool = pool_of(3)
    prompt = conv_like(2, 6, seed=1)
    view = pool.view(slots, [0, 0], [6, 6], 6, tables(slots))
    assert view.get_conv_state(0) is None and view.get_recurrent_state(0) is None
    full = view.update_conv_state(prompt, 0, conv_kernel_size=KERNEL)
    assert torch.equal(full, prompt)  # no previous state: the inputs as they came
    states = torch.randn(2, *STATE, generator=torch.Generator().manual_seed(2))
    view.update_recurrent_state(states, 0)
    view.commit()

    step = conv_like(2, 1, seed=3)
    view = pool.view(slots, [6, 6], [1, 1], 1, tables(slots))
    conv = view.get_conv_state(0)
    assert torch.equal(conv, prompt[..., -KERNEL:])
    conv.copy_(torch.cat([conv, step], -1)[..., -KERNEL:])  # causal_conv1d_update's in place
    recurrent = view.get_recurrent_state(0)
    assert torch.equal(recurrent, states)
    recurrent.mul_(2)  # mamba2_selective_state_update's in place
    view.commit()
    for r, slot in enumerate(slots):
        want = torch.cat([prompt[r], step[r]], -1)[..., -KERNEL:]
        assert torch.equal(pool.states["conv", 0, 0][slot], want)
        assert torch.equal(pool.states["recurrent", 0, 0][slot], 2 * states[r])

    view = pool.view(slots[:1], [0], [1], 1, tables(slots[:1]))  # a new sequence, first slot
    assert pool.states["recurrent", 0, 0][slots[0]].abs().sum() == 0
    assert torch.equal(pool.states["recurrent", 0, 0][slots[1]], 2 * states[1])


def test_a_recurrent_state_refuses_padding_and_a_step_it_did_not_take_in() -> None:
    """A padded row would feed its padding into the recurrence, and a state cannot be rewound:
    both are refused with what to do, never run."""
    pool = pool_of(2)
    view = pool.view([0, 1], [0, 0], [3, 3], 3, tables([0, 1]))
    view.update_conv_state(conv_like(2, 3, seed=1), 0, conv_kernel_size=KERNEL)
    view.commit()
    with pytest.raises(ValueError, match="same number of tokens"):
        pool.view([0, 1], [3, 3], [1, 2], 2, tables([0, 1])).get_conv_state(0)
    with pytest.raises(ValueError, match="took in 3 tokens, but the step feeds it from position 5"):
        pool.view([0], [5], [1], 1, tables([0]))  # steps at 3 and 4 ran, their tokens dropped
    pool.view([0, 1], [3, 3], [1, 1], 1, tables([0, 1])).commit()
    pool.view([0], [4], [1], 1, tables([0]))  # where its last step ended: fine
