"""A paged sequence that drops rows from its front (csrc/blocks.c, csrc/paged.c: kv_seq's
start): a sliding window moves no row, its start moves past the dropped one and its first
block goes back to the pool when the start reaches the block's end; attention sinks move
their few first rows. Nothing a model or a student sees changes: the logits and positions
of every step are the bits of the same rows moved to the front of the sequence (the layout
before the start), of a contiguous cache, and close to the masked NumPy reference, in
every block size; forks, swaps, truncation and the counts of blocks take the start in."""
import numpy as np
import pytest

import kvlab
from kvlab.cache_policy import AttentionSinks, SlidingWindow
from policy_reference import masked_forward, window_mask


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def ids(model):
    """120 token ids, a line said over and over: through 8 rows, 14 times round a window."""
    ids = model.encode("ROMEO: But soft, what light through yonder window breaks? " * 8)[:120]
    assert len(ids) == 120
    return ids


def pool_of(model, block_size, dtype="fp32", num_blocks=16):
    return model.new_paged_pool(num_blocks=num_blocks, block_size=block_size, dtype=dtype)


def window_and_cache(model, ids, n_tokens):
    """SlidingWindow(8) over ids[:n_tokens] in a sequence of a pool in blocks of 4 and in a
    contiguous cache: (pool, seq, cache, policy)."""
    pool, policy = pool_of(model, 4), SlidingWindow(8)
    seq, cache = pool.new_sequence(), policy.new_cache(model)
    policy.forward(model, ids[:n_tokens], seq)
    policy.forward(model, ids[:n_tokens], cache)
    return pool, seq, cache, policy


def blocks_for(rows, block_size):
    return -(-rows // block_size)


def slot_of(seq, row, block_size):
    """(block, row in it) of a sequence's row: past its start, through its block table."""
    block, at = divmod(seq.start + row, block_size)
    return int(seq.block_table[block]), at


@pytest.mark.parametrize("policy", [SlidingWindow(8), SlidingWindow(1), AttentionSinks(2, 6)])
@pytest.mark.parametrize("dtype", ["fp32", "int4"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_many_turns_give_the_bits_of_rows_moved_to_the_front(model, ids, policy, dtype,
                                                             block_size):
    """Token by token through 8 rows: the sequence whose start moves, the same sequence
    swapped out and in after every step (it comes back from row 0 of its first block: the
    rows moved to the front, as every keep left them before), and a contiguous cache read
    after every step (which turns its ring back) give the same logits and positions."""
    pool, other = pool_of(model, block_size, dtype), pool_of(model, block_size, dtype)
    seq, moved = pool.new_sequence(), other.new_sequence()
    cache = policy.new_cache(model, dtype)
    starts, blocks_fit = set(), True
    for token in ids:
        want = policy.forward(model, [token], cache)
        cache.key_codes
        np.testing.assert_array_equal(policy.forward(model, [token], seq), want)
        np.testing.assert_array_equal(policy.forward(model, [token], moved), want)
        moved = other.swap_in(other.swap_out(moved))
        starts.add(seq.start)
        blocks_fit &= len(seq.block_table) == blocks_for(seq.start + seq.length, block_size)
    np.testing.assert_array_equal(pool.positions(seq), cache.positions)
    np.testing.assert_array_equal(other.positions(moved), cache.positions)
    np.testing.assert_array_equal(pool.gather(seq)[0], cache.dequantized()[0])
    assert blocks_fit and moved.start == 0
    # (a block of one row has no start; a window of 1 keeps no row before each token)
    assert (max(starts) > 0) == (block_size > 1 and policy.budget > 1)
    pool.check()
    other.check()


@pytest.mark.parametrize("policy, visible", [(SlidingWindow(8), window_mask(8)),
                                             (AttentionSinks(2, 6), window_mask(6, sinks=2))])
def test_a_window_over_blocks_attends_to_exactly_the_kept_positions(model, ids, policy, visible):
    """The NumPy model of a window (kvlab.reference with a mask), after many turns, in one
    call that drops a row before each of its tokens past the eighth."""
    seq = pool_of(model, 3).new_sequence()
    got = policy.forward(model, ids, seq, all_logits=True)
    np.testing.assert_allclose(got, masked_forward(model, ids, visible), rtol=2e-4, atol=2e-4)


def test_a_window_moves_no_row(model, ids):
    """A copy of the pool's keys before a step shows every kept row at the slot where the
    sequence finds it after the step: its start moved past the oldest row, nothing moved."""
    pool = pool_of(model, 4)
    seq, policy = pool.new_sequence(), SlidingWindow(8)
    policy.forward(model, ids[:21], seq)
    before = [slot_of(seq, row, 4) for row in range(8)]
    keys = pool.key_codes.copy()
    policy.forward(model, ids[21:22], seq)
    after = [slot_of(seq, row, 4) for row in range(8)]
    assert after[:7] == before[1:]                        # the same slots, one row earlier
    for block, at in after[:7]:
        np.testing.assert_array_equal(pool.key_codes[block, :, at], keys[block, :, at])
    assert not np.array_equal(pool.key_codes[after[7][0], :, after[7][1]],
                              keys[after[7][0], :, after[7][1]])


def test_the_first_block_goes_back_when_the_start_reaches_its_end(model, ids):
    """Blocks of 4 under a window of 8: every fourth step the start passes a block's end
    and that block is freed (not cached: a block whose rows were partly dropped is never
    offered to the prefix cache, nor are its later blocks), so the sequence holds 2 or 3
    blocks however long it runs, and a new prompt with its tokens finds none of them."""
    pool = pool_of(model, 4, num_blocks=8)
    seq, policy = pool.new_sequence(), SlidingWindow(8)
    policy.forward(model, ids[:8], seq)
    pool.record_events = True
    freed = []
    for token in ids[8:60]:
        first = int(seq.block_table[0])
        policy.forward(model, [token], seq)
        events = pool.take_events()
        gone = [e for e in events if e["event"] == "freed"]
        if seq.start == 0:                                 # it passed the block's last row
            assert gone == [{"event": "freed", "block": first, "to": "free"}], events
            freed.append(first)
        else:
            assert gone == []
        assert len(seq.block_table) in (2, 3) and pool.stats().blocks_used == len(seq.block_table)
    assert len(freed) == 13 and pool.stats().blocks_cached == 0
    assert pool.reuse_prefix(pool.new_sequence(), ids[:60]) == 0
    pool.check()


@pytest.mark.parametrize("room", [dict(num_blocks=16, max_blocks_per_seq=2),
                                  dict(num_blocks=2)], ids=["table", "pool"])
def test_with_no_block_to_spare_keep_moves_the_rows_to_the_front(model, ids, room):
    """A start costs up to a block more than the rows take (8 rows from row 1 of blocks of
    4 take 3 blocks). Where the table or the pool holds only the 2 blocks the window's rows
    take, keep moves them to the front of the first block, as before there was a start, and
    the window runs as in a cache, token after token."""
    policy = SlidingWindow(8)
    cache, seq = policy.new_cache(model), model.new_paged_pool(block_size=4, **room).new_sequence()
    for token in ids[:30]:
        np.testing.assert_array_equal(policy.forward(model, [token], seq),
                                      policy.forward(model, [token], cache))
        assert seq.start == 0 and len(seq.block_table) <= 2
    seq.pool.check()


def window_then_grow(model, ids, n):
    """The logits of ids[30:30 + n] after a window of 8 over ids[:30], the cache then
    growing past 8 rows: a KVCache with room for them."""
    cache = model.new_cache(8 + n)
    SlidingWindow(8).forward(model, ids[:30], cache)
    return model.forward(ids[30:30 + n], cache, all_logits=True)


def test_a_fork_keeps_the_start_and_copies_a_shared_last_block_first(model, ids):
    """A fork of a window whose rows start inside its first block shares its blocks and its
    start; each then goes on as a cache that dropped the same rows (the first write into
    the shared, partly filled last block copies it first), and neither changes the other."""
    pool = pool_of(model, 4)
    seq = pool.new_sequence()
    SlidingWindow(8).forward(model, ids[:30], seq)
    assert seq.start == 2 and seq.length == 8
    child = pool.fork(seq)
    assert child.start == seq.start and list(child.block_table) == list(seq.block_table)
    assert pool.blocks_needed(child, 1) == 1              # a copy of the shared last block
    np.testing.assert_array_equal(model.forward(ids[30:34], child, all_logits=True),
                                  window_then_grow(model, ids, 4))
    assert list(child.block_table[:2]) == list(seq.block_table[:2])
    assert child.block_table[2] != seq.block_table[2]
    np.testing.assert_array_equal(model.forward(ids[30:33], seq, all_logits=True),
                                  window_then_grow(model, ids, 3))
    pool.check()


def test_a_swapped_window_comes_back_from_row_0_and_goes_on_bit_for_bit(model, ids):
    pool, seq, cache, policy = window_and_cache(model, ids, 30)
    assert seq.start == 2 and len(seq.block_table) == 3
    positions = pool.positions(seq)
    host = pool.swap_out(seq)
    assert host.n_blocks == 2                             # its 8 rows take 2 blocks, not 3
    back = pool.swap_in(host)
    assert back.start == 0 and len(back.block_table) == 2 and back.next_position == 30
    np.testing.assert_array_equal(pool.positions(back), positions)
    np.testing.assert_array_equal(policy.forward(model, ids[30:40], back, all_logits=True),
                                  policy.forward(model, ids[30:40], cache, all_logits=True))
    pool.check()


def test_truncate_and_block_counts_take_the_start_in(model, ids):
    """blocks_needed counts from the sequence's start; truncate takes back its newest rows
    (the next token sees what it saw before) and, to 0, forgets the start too."""
    pool, seq, cache, policy = window_and_cache(model, ids, 31)
    assert seq.start == 3 and seq.length == 8 and len(seq.block_table) == 3
    for n in (1, 4, 5, 9):
        assert pool.blocks_needed(seq, n) == blocks_for(3 + 8 + n, 4) - 3
    pool.truncate(seq, 6)
    cache.truncate(6)
    assert seq.start == 3 and len(seq.block_table) == 3 and seq.next_position == 29
    np.testing.assert_array_equal(policy.forward(model, ids[29:33], seq, all_logits=True),
                                  policy.forward(model, ids[29:33], cache, all_logits=True))
    pool.truncate(seq, 0)
    assert seq.start == 0 and len(seq.block_table) == 0 and seq.next_position == 0
    pool.check()


def test_a_batch_step_reads_a_sequence_from_its_start(model, ids):
    pool, seq, cache, policy = window_and_cache(model, ids, 29)
    assert seq.start == 1
    rows = np.ascontiguousarray(policy.keep(cache, 7))
    cache.keep(rows)
    pool.keep(seq, rows)
    batch = model.forward_batch([pool.new_sequence(), seq], [ids[:5], [ids[29]]])
    np.testing.assert_array_equal(batch[1], model.forward([ids[29]], cache))


def test_render_says_where_a_sequence_starts(model, ids):
    pool = pool_of(model, 4)
    seq = pool.new_sequence()
    SlidingWindow(8).forward(model, ids[:30], seq)
    assert f"seq {seq.id}: length 8 from row 2 of its first block, blocks [" in pool.render()
