"""The paged pool's block manager (csrc/blocks.c) as Python sees it, kvlab._kvlab.BlockManager:
the bookkeeping alone, whose reservations say which rows to copy, and the rules that keep a
reservation from being misused (found by trying to break it). The pool built on it is
tested in test_paged.py; the GPU pool's use of it in tests/cuda/test_host_logic.py."""
import gc
import weakref

import numpy as np
import pytest

import kvlab
from kvlab import _kvlab as core


def ids(*tokens):
    return np.array(tokens, dtype=np.int32)


def test_a_reservation_is_committed_with_exactly_its_tokens_before_anything_else():
    blocks = core.BlockManager(8, 4)
    seq = blocks.new_sequence()
    assert blocks.reserve(seq, 2) == [] and seq.length == 0
    blocks.check()                                       # pending is a legal state
    with pytest.raises(RuntimeError, match="reserved positions not committed"):
        blocks.reserve(seq, 1)
    with pytest.raises(RuntimeError, match="reserved positions not committed"):
        blocks.fork(seq)
    with pytest.raises(RuntimeError, match="reserved positions not committed"):
        blocks.blocks_needed(seq, 1)
    with pytest.raises(ValueError, match="made room for 2"):
        blocks.commit(seq, ids(1))
    blocks.commit(seq, ids(1, 2))
    assert seq.length == 2 and blocks.blocks_needed(seq, 1) == 0
    with pytest.raises(ValueError, match="made room for 0"):
        blocks.commit(seq, ids(3))                       # nothing reserved any more
    blocks.check()


def test_reuse_prefix_refuses_a_sequence_with_a_pending_reservation():
    # it once wrote past the end of the block table (a heap overflow)
    blocks = core.BlockManager(8, 1, max_seqs=1, max_blocks_per_seq=4)
    tokens = np.arange(4, dtype=np.int32)
    seq = blocks.new_sequence()
    blocks.reserve(seq, 4)
    blocks.commit(seq, tokens)
    blocks.free(seq)
    seq = blocks.new_sequence()
    blocks.reserve(seq, 4)
    with pytest.raises(RuntimeError, match="reserved positions not committed"):
        blocks.reuse_prefix(seq, tokens)
    blocks.free(seq)                                     # a free ends the reservation too
    blocks.check()
    assert not blocks.ref_counts.any()


def test_copy_on_write_copies_the_block_that_holds_the_next_position():
    blocks = core.BlockManager(8, 4)
    parent = blocks.new_sequence()
    blocks.reserve(parent, 6)
    blocks.commit(parent, ids(1, 2, 3, 4, 5, 6))
    child = blocks.fork(parent)
    [(dst, src, rows)] = blocks.reserve(child, 1)
    assert (src, rows) == (parent.block_table[1], 2) and dst == child.block_table[1] != src
    blocks.commit(child, ids(9))
    assert blocks.block_tokens[src].tolist()[:3] == [5, 6, 0]       # the parent's, untouched
    assert blocks.block_tokens[dst].tolist()[:3] == [5, 6, 9]
    blocks.check()


def test_a_pool_refuses_reserve_and_commit_even_called_through_its_base_class():
    model = kvlab.load()
    pool = model.new_paged_pool(8, 4, window=2)
    seq = pool.new_sequence()
    model.prefill([1, 2, 3], seq)
    for call in (lambda: pool.reserve(seq, 1), lambda: core.BlockManager.reserve(pool, seq, 1),
                 lambda: core.BlockManager.commit(pool, seq, ids(4))):
        with pytest.raises(TypeError, match="writes K and V between reserve and commit itself"):
            call()
    # and the base class's fork of a pool sequence copies its window rows, as pool.fork does
    child = core.BlockManager.fork(pool, seq)
    for want, got in zip(pool.gather(seq), pool.gather(child)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="PagedPool is made with PagedPool's arguments"):
        core.BlockManager.__init__(pool, 4, 4)
    pool.check()


def test_events_replay_into_the_reference_counts():
    blocks = core.BlockManager(6, 2, hash_bits=2)       # collisions, eviction, copies
    blocks.record_events = True
    rng = np.random.default_rng(3)
    refs, live = {}, []
    for _ in range(300):
        action = rng.choice(["new", "grow", "grow", "fork", "free", "reuse"])
        try:
            if action == "new" or not live:
                live.append(blocks.new_sequence())
            elif action == "grow":
                seq = live[int(rng.integers(len(live)))]
                n = int(rng.integers(1, 4))
                blocks.reserve(seq, n)
                blocks.commit(seq, rng.integers(0, 3, n).astype(np.int32))
            elif action == "fork":
                live.append(blocks.fork(live[int(rng.integers(len(live)))]))
            elif action == "free":
                blocks.free(live.pop(int(rng.integers(len(live)))))
            else:
                seq = blocks.new_sequence()
                live.append(seq)
                blocks.reuse_prefix(seq, rng.integers(0, 3, 6).astype(np.int32))
        except (kvlab.OutOfBlocks, kvlab.OutOfSequences, kvlab.CacheFullError):
            pass
        for event in blocks.take_events():
            refs[event["block"]] = event.get("refs", 0) if event["event"] != "evicted" \
                else refs.get(event["block"], 0)
        assert refs == {b: int(blocks.ref_counts[b]) for b in refs}
        blocks.check()


def test_a_traced_engine_leaves_no_recording_on_between_steps():
    model = kvlab.load()
    pool = model.new_paged_pool(16, 4)
    trace = []
    engine = kvlab.Engine(model, pool, trace=trace)
    engine.add_request([1, 2, 3], kvlab.SamplingParams(max_new_tokens=3))
    engine.step()
    assert trace and not pool.record_events
    del engine                                           # dropped without close()
    seq = pool.new_sequence()
    model.prefill([4, 5, 6, 7, 8], seq)
    assert not pool.record_events and pool.take_events() == []


def test_a_handle_kept_on_a_pool_subclass_does_not_keep_the_pool_alive():
    class Pool(core.BlockManager):
        pass

    pool = Pool(4, 4)
    pool.sequence = pool.new_sequence()                 # pool -> handle -> pool
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is None


def test_a_truncated_paged_sequence_continues_as_if_the_cut_never_ran():
    # speculative decoding's rollback on a paged pool: the refused drafts' positions go,
    # and what comes next is computed exactly as on a sequence that never held them
    model = kvlab.load()
    pool = model.new_paged_pool(16, 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    seq, other = pool.new_sequence(), pool.new_sequence()
    model.prefill(tokens, seq)
    model.prefill(tokens[:7], other)
    kept = [a.copy() for a in pool.gather(other)]
    sibling = pool.fork(seq)                             # shares every block of seq
    pool.truncate(seq, 6)                                # cuts a block the fork still reads
    assert seq.length == 6 and len(seq.block_table) == 2
    got = model.prefill([20, 21, 22], seq)
    fresh = pool.new_sequence()
    np.testing.assert_array_equal(got, model.prefill(tokens[:6] + [20, 21, 22], fresh))
    for a, b in zip(pool.gather(sibling), model_rows(model, tokens)):
        np.testing.assert_array_equal(a, b)              # the fork's rows did not move
    for a, b in zip(pool.gather(other), kept):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="between 0 and the sequence's length 9"):
        pool.truncate(seq, 10)
    pool.truncate(seq, 0)
    pool.check()
    windowed = model.new_paged_pool(8, 4, dtype="int8", window=2)
    w = windowed.new_sequence()
    model.prefill(tokens[:5], w)
    with pytest.raises(ValueError, match="residual window can only truncate to 0"):
        windowed.truncate(w, 3)
    windowed.truncate(w, 0)


def model_rows(model, tokens):
    pool = model.new_paged_pool(8, 4, prefix_cache=False)
    seq = pool.new_sequence()
    model.prefill(tokens, seq)
    return pool.gather(seq)


def test_a_cut_block_written_once_it_is_no_longer_shared_leaves_the_prefix_cache_first():
    # found by review: it stayed registered, and the commit that filled it again registered
    # it a second time (check() failed, or a lookup looped)
    blocks = core.BlockManager(4, 2)
    a = blocks.new_sequence()
    blocks.reserve(a, 4)
    blocks.commit(a, ids(1, 2, 4, 4))
    b = blocks.fork(a)
    blocks.truncate(a, 3)
    blocks.free(b)
    assert blocks.reserve(a, 1) == []                   # its alone now: written in place
    blocks.commit(a, ids(5))
    blocks.check()
    model = kvlab.load()
    pool = model.new_paged_pool(4, 2)
    seq = pool.new_sequence()
    model.prefill([1, 2, 4, 4], seq)
    fork = pool.fork(seq)
    pool.truncate(seq, 3)
    pool.free(fork)
    model.prefill([6], seq)
    pool.check()
    again = pool.new_sequence()
    assert pool.reuse_prefix(again, [1, 2, 4, 4, 9]) == 2   # the first block only: 4 4 is gone


def test_the_refusals_state_the_cores_limits_as_they_are():
    """Issue 36: BlockManager's refusal said block_size at most 256 long after the core took
    4096; the block manager's and the pool's limits are now one sentence (binding.h), with
    the block size written from KV_MAX_BLOCK_SIZE itself."""
    most = core.MAX_BLOCK_SIZE
    assert core.BlockManager(2, most).block_size == most      # the largest is taken
    for make in (lambda: core.BlockManager(2, most + 1),
                 lambda: core.PagedPool(1, 1, 8, 2, most + 1)):
        with pytest.raises(ValueError, match=rf"block_size at most {most}, num_blocks at most "
                                             r"2\*\*24 \(and num_blocks \* block_size at most "
                                             r"2\*\*32\)") as error:
            make()
        assert "at most 256" not in str(error.value)
    # the binding's own range checks share one wording, kvlab.arguments' (at least / at most)
    for make in (lambda: core.BlockManager(2, 4, hash_bits=0),
                 lambda: core.PagedPool(1, 1, 8, 2, 4, hash_bits=0)):
        with pytest.raises(ValueError, match=r"^hash_bits must be at least 1, got 0$"):
            make()
    with pytest.raises(ValueError, match=r"^hash_bits must be at most 64, got 65$"):
        core.BlockManager(2, 4, hash_bits=65)
    with pytest.raises(ValueError, match=r"^max_seqs must be at least -2,?147,?483,?648"):
        core.BlockManager(2, 4, max_seqs=-2**31 - 1)          # was "at most 2147483647"


def test_python_counts_blocks_as_the_core_does():
    """kvlab.blocks.blocks_for, the one Python ceiling division of a length into blocks (the
    scheduler's, kvlab.measure's), agrees with the block manager's own count."""
    from kvlab.blocks import blocks_for
    from kvlab import scheduler
    assert scheduler.blocks_for is blocks_for and blocks_for(0, 16) == 0
    for block_size in (1, 3, 16, core.MAX_BLOCK_SIZE):
        blocks = core.BlockManager(64, block_size)
        seq = blocks.new_sequence()
        for n in (1, block_size - 1, block_size, block_size + 1, 5 * block_size + 2):
            if n > 0 and blocks_for(n, block_size) <= 64:
                assert blocks.blocks_needed(seq, n) == blocks_for(n, block_size), (n, block_size)


def snapshot(blocks, seqs):
    return (blocks.ref_counts.tolist(), list(blocks.free_blocks), blocks.stats(),
            [(s.length, list(s.block_table)) for s in seqs])


def test_cancel_after_a_copy_on_write_gives_the_copy_back():
    # the owner of the rows could not write them (or copy the shared rows): cancel instead
    # of commit leaves the sequence reading the shared block and the pool as before
    blocks = core.BlockManager(8, 4)
    seq = blocks.new_sequence()
    blocks.reserve(seq, 6)
    blocks.commit(seq, ids(1, 2, 3, 4, 5, 6))            # a full block, then a half one
    child = blocks.fork(seq)
    before = snapshot(blocks, [seq, child])
    [(dst, src, rows)] = blocks.reserve(child, 7)        # the copy, and two blocks more
    assert (src, rows) == (seq.block_table[1], 2) and len(child.block_table) == 4
    blocks.check()
    blocks.cancel(child)
    assert snapshot(blocks, [seq, child]) == before
    blocks.check()
    blocks.cancel(child)                                 # none pending: nothing changes
    assert snapshot(blocks, [seq, child]) == before
    assert blocks.reserve(child, 1) == [(dst, src, rows)]     # as the first time
    blocks.commit(child, ids(9))
    assert child.length == 7 and blocks.ref_counts[src] == 1
    blocks.check()


def test_cancel_keeps_the_copy_when_the_shared_block_changed_meanwhile():
    blocks = core.BlockManager(4, 4)
    seq = blocks.new_sequence()
    blocks.reserve(seq, 2)
    blocks.commit(seq, ids(1, 2))
    child = blocks.fork(seq)
    [(dst, src, _)] = blocks.reserve(child, 1)
    blocks.truncate(seq, 1)                  # its other reader, alone with it, cuts it and
    blocks.reserve(seq, 1)                   # writes another token where the copy's was
    blocks.commit(seq, ids(7))
    blocks.cancel(child)
    assert list(child.block_table) == [dst] and child.length == 2
    assert blocks.ref_counts[src] == 1 and blocks.ref_counts[dst] == 1
    blocks.check()


def test_a_pool_refuses_cancel_as_it_refuses_reserve():
    pool = kvlab.PagedPool(1, 1, 4, 4, 2)
    with pytest.raises(TypeError, match="writes K and V between reserve and commit itself"):
        pool.cancel(pool.new_sequence())
