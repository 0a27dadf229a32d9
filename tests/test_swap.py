"""Preemption by swapping: a paged sequence copied to host memory and back
(PagedPool.swap_out / swap_in, csrc/swap.c), and the Engine's preemption="swap".

The pool's promise: a sequence swapped out and in goes on bit for bit (the logits of its
next steps equal those of a twin never swapped, in every cache format, with a residual
window, after dropping rows), its host copy is the pool's own bytes (codes and scales, not
floats), swapping out a sequence that shares blocks leaves them intact for the others, and
every refusal changes nothing. The engine's: the tokens are those of preemption by
recompute and of a pool too large to preempt, and its steps count what was swapped and
what was recomputed.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab import SamplingParams

FORMATS = [dict(dtype="fp32"), dict(dtype="fp16"), dict(dtype="bf16"), dict(dtype="int8"),
           dict(dtype="int4"), dict(dtype="fp8"),
           dict(dtype="int8", key_format="int4", window=3)]


def make_model(seed=0) -> kvlab.Model:
    config = kvlab.ModelConfig(dim=32, hidden_dim=44, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=8, vocab_size=40, max_seq_len=96)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=seed))


@pytest.fixture(scope="module")
def small():
    return make_model()


def snapshot(pool) -> dict:
    """Everything a refused call must leave as it was."""
    return {"key_codes": pool.key_codes.copy(), "value_codes": pool.value_codes.copy(),
            "ref_counts": pool.ref_counts.copy(), "fill": pool.fill.copy(),
            "block_tokens": pool.block_tokens.copy(), "free": pool.free_blocks,
            "cached": pool.cached_blocks, "stats": pool.stats(),
            "tables": {(s.id, s.serial): s.block_table.copy() for s in pool.sequences()}}


def assert_unchanged(before: dict, pool) -> None:
    after = snapshot(pool)
    for key, value in before.items():
        if key == "tables":
            assert value.keys() == after[key].keys()
            assert all(np.array_equal(value[k], after[key][k]) for k in value)
        elif isinstance(value, np.ndarray):
            assert np.array_equal(value, after[key]), f"{key} changed"
        else:
            assert value == after[key], f"{key} changed"


def stored_rows(pool, seq) -> list:
    """Every part the pool stores for seq's rows (codes, scales, zero points of K and V),
    in the sequence's order: (n_layers, length, n_kv_heads, per head) each."""
    parts = [pool.key_codes, pool.key_scales, pool.key_zeros,
             pool.value_codes, pool.value_scales, pool.value_zeros]
    rows = []
    for part in (p for p in parts if p is not None):
        blocks = part[seq.block_table]        # (n_blocks, n_layers, block_size, ...)
        by_layer = blocks.swapaxes(0, 1).reshape(blocks.shape[1], -1, *blocks.shape[3:])
        rows.append(by_layer[:, :seq.length])
    return rows


def decode_both(model, a, b, first: int, steps: int = 4) -> None:
    """Greedy-decode a and b side by side from token `first`: every step's logits equal."""
    token = first
    for step in range(steps):
        want, got = model.decode(token, a), model.decode(token, b)
        assert np.array_equal(want, got), f"decode step {step} after the swap differs"
        token = int(np.argmax(want))


# ---- the pool ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: "-".join(str(v) for v in f.values()))
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_swapped_sequence_goes_on_bit_for_bit(small, fmt, block_size):
    pool = small.new_paged_pool(num_blocks=64, block_size=block_size, **fmt)
    prompt = [(7 * i + 3) % 40 for i in range(23)]
    twin, seq = pool.new_sequence(), pool.new_sequence()
    small.prefill(prompt, twin)
    small.prefill(prompt, seq)
    n_blocks, rows = len(seq.block_table), stored_rows(pool, seq)
    host = pool.swap_out(seq)
    assert not seq.alive and host.length == 23
    assert host.n_blocks == n_blocks == -(-23 // block_size)
    assert not host.data.flags.writeable
    pool.check()
    back = pool.swap_in(host)
    assert back.length == 23 and len(back.block_table) == host.n_blocks
    # the same bytes in the new blocks: codes, scales and zero points
    assert all(np.array_equal(a, b) for a, b in zip(rows, stored_rows(pool, back)))
    assert np.array_equal(pool.gather(back)[0], pool.gather(twin)[0])
    pool.check()
    decode_both(small, twin, back, first=5)
    pool.check()


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_the_host_copy_is_the_pools_bytes_not_floats(small, dtype):
    # a host copy grows by what the pool stores per position (codes, scales, zero points)
    # plus its token id, whatever the format: a quantized sequence moves its small bytes
    pool = small.new_paged_pool(num_blocks=64, block_size=4, dtype=dtype)
    slot_bytes = pool.nbytes // (pool.num_blocks * pool.block_size)
    sizes = {}
    for n in (8, 24):
        seq = pool.new_sequence()
        small.prefill(list(range(1, n + 1)), seq)
        sizes[n] = pool.swap_out(seq).nbytes
    assert sizes[24] - sizes[8] == 16 * (slot_bytes + 4)
    assert sizes[8] < 8 * (slot_bytes + 4) + 64            # a small header, nothing else


def test_swapping_out_a_forked_sequence_leaves_the_other_intact(small):
    pool = small.new_paged_pool(num_blocks=32, block_size=4)
    parent = pool.new_sequence()
    small.prefill(list(range(1, 11)), parent)                 # 3 blocks, the last partial
    child = pool.fork(parent)
    twin = pool.new_sequence()
    small.prefill(list(range(1, 11)), twin)
    shared = parent.block_table.copy()
    refs = pool.ref_counts[shared].copy()
    keys = pool.gather(child)[0]
    host = pool.swap_out(parent)
    # only the parent's references went: the child's rows are untouched
    assert np.array_equal(pool.ref_counts[shared], refs - 1)
    assert np.array_equal(child.block_table, shared)
    assert np.array_equal(pool.gather(child)[0], keys)
    decode_both(small, twin, child, first=11)
    back = pool.swap_in(host)
    # back is where the parent was: its next tokens are the twin's before it decoded
    fresh = pool.new_sequence()
    small.prefill(list(range(1, 11)), fresh)
    decode_both(small, fresh, back, first=11)
    pool.check()


def test_swapping_out_a_prefix_cache_hit_leaves_the_owner_intact(small):
    pool = small.new_paged_pool(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))
    owner = pool.new_sequence()
    small.prefill(prompt, owner)
    hit = pool.new_sequence()
    assert pool.reuse_prefix(hit, prompt[:-1]) == 12          # three full blocks shared
    small.prefill(prompt[12:], hit)
    twin = pool.new_sequence()
    small.prefill(prompt, twin)
    host = pool.swap_out(hit)
    assert all(pool.ref_counts[b] >= 1 for b in owner.block_table)
    decode_both(small, twin, owner, first=9)
    back = pool.swap_in(host)
    # its full blocks are found in the prefix cache again when it comes back: shared
    assert np.array_equal(back.block_table[:3], owner.block_table[:3])
    fresh = pool.new_sequence()
    small.prefill(prompt, fresh)
    decode_both(small, fresh, back, first=9)
    pool.check()


def test_a_host_copy_comes_back_twice_and_into_another_pool(small):
    pool = small.new_paged_pool(num_blocks=32, block_size=4, dtype="int8")
    seq, twin = pool.new_sequence(), pool.new_sequence()
    small.prefill(list(range(2, 20)), seq)
    small.prefill(list(range(2, 20)), twin)
    host = pool.swap_out(seq)
    first, second = pool.swap_in(host), pool.swap_in(host)
    other = small.new_paged_pool(num_blocks=8, block_size=7, dtype="int8")
    third = other.swap_in(host)                               # another block size
    assert len(third.block_table) == 3
    for back in (first, second, third):
        fresh = pool.new_sequence()
        small.prefill(list(range(2, 20)), fresh)
        decode_both(small, fresh, back, first=1, steps=2)
    pool.check()
    other.check()


def test_a_sequence_that_dropped_rows_comes_back_with_its_positions(small):
    pool = small.new_paged_pool(num_blocks=16, block_size=4)
    cache = small.new_cache(40)
    prompt = list(range(3, 15))
    seq = pool.new_sequence()
    small.prefill(prompt, seq)
    small.prefill(prompt, cache)
    rows = np.array([[[0, 0], [2, 1], [5, 7], [11, 11]]] * 2, dtype=np.int32)
    pool.keep(seq, rows)
    cache.keep(rows)
    positions = pool.positions(seq)
    host = pool.swap_out(seq)
    # into another pool too, one where no sequence has dropped rows yet (it has no
    # positions to write them into until then)
    other = small.new_paged_pool(num_blocks=16, block_size=4)
    elsewhere = other.swap_in(host)
    back = pool.swap_in(host)
    assert np.array_equal(pool.positions(back), positions)
    assert np.array_equal(other.positions(elsewhere), positions)
    token = 4
    for _ in range(3):
        want, got = small.decode(token, cache), small.decode(token, back)
        assert np.array_equal(want, got)
        assert np.array_equal(small.decode(token, elsewhere), want)
        token = int(np.argmax(want))
    pool.check()
    other.check()


def test_swap_in_refused_for_lack_of_blocks_changes_nothing(small):
    pool = small.new_paged_pool(num_blocks=8, block_size=4)
    seq = pool.new_sequence()
    small.prefill(list(range(1, 14)), seq)                    # 4 blocks
    host = pool.swap_out(seq)
    hog = pool.new_sequence()
    small.prefill([30 + i % 9 for i in range(20)], hog)       # 5 blocks: 3 left
    before = snapshot(pool)
    with pytest.raises(kvlab.OutOfBlocks, match="13 tokens needs 4 blocks of 4; the pool "
                       "has 3 free or cached of 8; the pool is unchanged"):
        pool.swap_in(host)
    # only the bytes count: a wrapper that claims other numbers (or none) changes nothing
    for length in (1, 10**30, None):
        with pytest.raises(kvlab.OutOfBlocks, match="13 tokens needs 4 blocks of 4; the "
                           "pool has 3 free or cached of 8; the pool is unchanged"):
            pool.swap_in(kvlab.SwappedSequence(host.data, length, 1))
    assert_unchanged(before, pool)
    pool.check()
    pool.free(hog)                                            # cached blocks count
    assert len(pool.swap_in(host).block_table) == 4
    assert pool.swap_in(kvlab.SwappedSequence(host.data, None, None)).length == 13
    pool.check()


def test_swap_in_refusals_change_nothing(small):
    pool = small.new_paged_pool(num_blocks=16, block_size=4, max_seqs=2,
                                max_blocks_per_seq=4)
    seq = pool.new_sequence()
    small.prefill(list(range(1, 11)), seq)
    host = pool.swap_out(seq)
    a, b = pool.new_sequence(), pool.new_sequence()
    before = snapshot(pool)
    with pytest.raises(kvlab.OutOfSequences):
        pool.swap_in(host)
    assert_unchanged(before, pool)
    pool.free(b)
    before = snapshot(pool)
    with pytest.raises(TypeError, match="SwappedSequence"):
        pool.swap_in(host.data)
    tampered = host.data.copy()
    tampered[0] ^= 1
    with pytest.raises(ValueError, match="not a sequence that swap_out"):
        pool.swap_in(kvlab.SwappedSequence(tampered, host.length, host.n_blocks))
    with pytest.raises(ValueError, match="not a sequence that swap_out"):
        pool.swap_in(kvlab.SwappedSequence(host.data[:-1], host.length, host.n_blocks))
    other_format = small.new_paged_pool(num_blocks=16, block_size=4, dtype="int8")
    with pytest.raises(ValueError, match="another shape or cache format"):
        pool.swap_in(other_format.swap_out(_filled(small, other_format, 10)))
    assert_unchanged(before, pool)
    # longer than a sequence of this pool may be: refused as the forward pass refuses it
    roomy = small.new_paged_pool(num_blocks=16, block_size=4)
    with pytest.raises(kvlab.CacheFullError, match="max_blocks_per_seq=4"):
        pool.swap_in(roomy.swap_out(_filled(small, roomy, 17)))
    assert_unchanged(before, pool)
    pool.check()
    del a


# ---- host copies that no swap_out writes -------------------------------------------------------

HEADER = ["magic", "n_layers", "n_kv_heads", "head_dim", "window", "key_format", "key_group",
          "value_format", "value_group", "length", "next_position", "compacted"]   # int32 each


def header(data: np.ndarray) -> dict:
    return dict(zip(HEADER, data[:4 * len(HEADER)].view(np.int32).tolist()))


def with_header(data: np.ndarray, **fields) -> np.ndarray:
    data = data.copy()
    words = data[:4 * len(HEADER)].view(np.int32)
    for name, value in fields.items():
        words[HEADER.index(name)] = value
    return data


def compacted_copy(model, pool):
    """A host copy of a sequence that dropped rows, and where its positions lie in it
    (n_layers, n_kv_heads, length int32, the last part when there is no window)."""
    seq = pool.new_sequence()
    model.prefill(list(range(3, 15)), seq)
    pool.keep(seq, np.array([[[0, 0], [2, 1], [5, 7], [11, 11]]] * 2, dtype=np.int32))
    host = pool.swap_out(seq)
    c = model.config
    return host, slice(host.nbytes - c.n_layers * c.n_kv_heads * 4 * 4, None)


@pytest.mark.parametrize("where, value", [((0, 0, 0), -1), ((1, 1, 3), 12), ((1, 1, 3), 10**6),
                                          ((0, 1, 1), 0), ((1, 0, 2), 1)],
                         ids=["negative", "at next_position", "far past it", "repeated",
                              "decreasing"])
def test_swap_in_refuses_row_positions_no_swap_out_writes(small, where, value):
    # Positions are read back as such (positions(), truncate(), a sliding-window model's
    # check of the oldest one): each (layer, head)'s must rise strictly below next_position.
    pool = small.new_paged_pool(num_blocks=16, block_size=4)
    host, at = compacted_copy(small, pool)
    assert header(host.data)["compacted"] == 1 and header(host.data)["next_position"] == 12
    tampered = host.data.copy()
    positions = tampered[at].view(np.int32).reshape(2, 2, 4)
    assert positions[0, 0].tolist() == [0, 2, 5, 11] and positions[0, 1].tolist() == [0, 1, 7, 11]
    positions[where] = value
    before = snapshot(pool)
    with pytest.raises(ValueError, match="header, size or row positions"):
        pool.swap_in(kvlab.SwappedSequence(tampered, 4, 1))
    assert_unchanged(before, pool)
    pool.check()
    assert pool.positions(pool.swap_in(host))[0, :, 1].tolist() == [0, 1, 7, 11]


def test_swap_in_refuses_a_window_sequence_that_claims_dropped_rows(small):
    # keep() refuses a pool with a residual window: no swap_out writes such a copy
    pool = small.new_paged_pool(num_blocks=16, block_size=4, dtype="int8", window=3)
    host = pool.swap_out(_filled(small, pool, 6))
    c, length = small.config, 6
    window_rows = 2 * c.n_layers * 3 * c.kv_dim * 4
    positions = np.tile(np.arange(length, dtype=np.int32), c.n_layers * c.n_kv_heads)
    data = with_header(host.data, compacted=1)
    data = np.concatenate([data[:-window_rows], positions.view(np.uint8), data[-window_rows:]])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="not a sequence that swap_out copied"):
        pool.swap_in(kvlab.SwappedSequence(data, length, 2))
    assert_unchanged(before, pool)


def test_a_host_copy_over_2_gib_is_not_refused_for_its_size(small):
    # A long sequence of a large model swaps out gigabytes (about 2,000 tokens of an fp32
    # 7B shape make 2 GiB); swap_in once refused any array over 2**31 - 1 bytes, so what
    # swap_out gave could never come back. Its size is the core's size_t: these bytes (2 GiB
    # of zeros, never touched, so never resident) are refused for their header alone.
    pool = small.new_paged_pool(num_blocks=16, block_size=4)
    try:
        huge = np.zeros(2**31 + 16, dtype=np.uint8)
    except MemoryError:                 # a machine that refuses even untouched pages
        pytest.skip("no 2 GiB of address space for the host copy")
    with pytest.raises(ValueError, match="not a sequence that swap_out copied") as refused:
        pool.swap_in(kvlab.SwappedSequence(huge, 0, 0))
    assert "2147483664 bytes" in str(refused.value)


def test_next_position_stays_within_2_30_after_a_swap(small):
    # A sequence holds at most 2**30 positions: a host copy past that is refused, and one
    # at the edge can take no more rows (before, next_position overflowed an int32).
    pool = small.new_paged_pool(num_blocks=16, block_size=4)
    host, _ = compacted_copy(small, pool)
    before = snapshot(pool)
    for past in (2**30 + 1, 2**31 - 1, -5):
        with pytest.raises(ValueError, match="not a sequence that swap_out copied"):
            pool.swap_in(kvlab.SwappedSequence(with_header(host.data, next_position=past), 4, 1))
    assert_unchanged(before, pool)
    seq = pool.swap_in(kvlab.SwappedSequence(with_header(host.data, next_position=2**30 - 1), 4, 1))
    rows = np.zeros((2, 2, 2, 8), dtype=np.float32)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="at most 2\\*\\*30 positions"):
        pool.append(seq, np.array([1, 2], dtype=np.int32), rows, rows)
    with pytest.raises(kvlab.CacheFullError):
        small.decode(1, seq)
    assert_unchanged(before, pool)
    pool.append(seq, np.array([1], dtype=np.int32), rows[:1], rows[:1])   # the last one fits
    assert pool.positions(seq)[0, -1].tolist() == [2**30 - 1] * 2
    pool.check()


def test_swapping_leaks_no_references(small):
    import sys
    pool = small.new_paged_pool(num_blocks=16, block_size=4)
    seq = _filled(small, pool, 9)
    host = pool.swap_out(seq)
    refs = sys.getrefcount(host.data)
    assert refs == 2                                          # the SwappedSequence's, the call's
    pool_refs, data_refs = sys.getrefcount(pool), sys.getrefcount(host.data)
    for _ in range(50):
        back = pool.swap_in(host)
        again = pool.swap_out(back)
        refs = sys.getrefcount(again.data)
        assert refs == 2
        del back, again
        with pytest.raises(ValueError):
            pool.swap_in(kvlab.SwappedSequence(host.data[:-1], 9, 3))
    refs = sys.getrefcount(pool), sys.getrefcount(host.data)
    assert refs == (pool_refs, data_refs)
    pool.check()
    assert pool.stats().n_sequences == 0


def test_a_pool_swapping_in_another_thread_refuses_cleanly(small):
    """Swaps run without the GIL, the pool busy meanwhile: the pool's other operations
    from another thread either work or raise RuntimeError ("in use"), never a crash or a
    corrupt pool, and the swapped rows come back bit for bit."""
    import threading
    pool = small.new_paged_pool(num_blocks=200, block_size=16, max_blocks_per_seq=100)
    seq, twin = pool.new_sequence(), pool.new_sequence()
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((1500, 2, 2, 8)).astype(np.float32)
    tokens = np.arange(1500, dtype=np.int32) + 100            # nothing to share
    pool.append(seq, tokens, rows, rows)
    keys = pool.gather(seq)[0]
    done, seen, errors, held = threading.Event(), threading.Event(), [], {"seq": seq}

    def worker():
        # at least 100 swaps, and on until the other thread has met one: with one free core
        # (CI runs other tests beside this one) the two threads may take turns for a while
        # before the other runs during a copy (bounded: 20,000 swaps, about 20 s)
        try:
            for count in range(20_000):
                if count >= 100 and seen.is_set():
                    break
                held["seq"] = pool.swap_in(pool.swap_out(held["seq"]))
        except BaseException as error:                    # noqa: B902 (reported below)
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    refused = 0
    while not done.is_set():
        for action in (pool.stats, pool.check, lambda: pool.gather(twin),
                       lambda: pool.free(pool.new_sequence())):
            try:
                action()
            except RuntimeError as error:
                assert "in use" in str(error)
                refused += 1
                seen.set()
    thread.join()
    assert not errors, errors
    # another thread found the pool busy: it ran while a swap was copying, without the GIL
    assert refused > 0
    pool.check()
    assert np.array_equal(pool.gather(held["seq"])[0], keys)


def _filled(model, pool, n):
    seq = pool.new_sequence()
    model.prefill(list(range(1, n + 1)), seq)
    return seq


def test_swap_out_refusals_change_nothing(small):
    pool = small.new_paged_pool(num_blocks=16, block_size=4)
    other = small.new_paged_pool(num_blocks=16, block_size=4)
    seq = _filled(small, pool, 6)
    stranger = _filled(small, other, 6)
    gone = _filled(small, pool, 5)
    pool.free(gone)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="another pool"):
        pool.swap_out(stranger)
    with pytest.raises(ValueError, match="freed"):
        pool.swap_out(gone)
    with pytest.raises(TypeError, match="PagedSequence"):
        pool.swap_out("seq")
    assert_unchanged(before, pool)
    assert seq.alive and stranger.alive
    assert repr(pool.swap_out(seq)).startswith("SwappedSequence(length=6, n_blocks=2")


# ---- the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def workload(seed=12):
    """Greedy and seeded n > 1 requests: on a pool of 21 blocks of 4 (the largest request
    alone, just) they preempt each other."""
    rng = np.random.default_rng(seed)
    requests = []
    for k in range(6):
        prompt, params = rng.integers(1, 256, 10 + 3 * k).tolist(), SamplingParams(max_new_tokens=12)
        if k in (1, 4):
            params = SamplingParams(max_new_tokens=6, n=3, temperature=0.8, seed=k)
        requests.append((prompt, params))
    return requests


def serve(model, requests, num_blocks, preemption, swap_space=None, **kwargs):
    pool = model.new_paged_pool(num_blocks, block_size=4, **kwargs)
    engine = kvlab.Engine(model, pool, preemption=preemption, swap_space=swap_space)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    while engine.has_work:
        assert len(engine.metrics) < 2000, "the engine stopped making progress"
        engine.step()
        pool.check()
    assert pool.stats().blocks_used == 0 and pool.stats().n_sequences == 0
    tokens = {rid: [o.tokens for o in out.outputs] for rid, out in engine.outputs.items()}
    return tokens, engine.metrics


def totals(metrics) -> dict:
    names = ["preemptions", "recomputed_tokens", "swapped_out_blocks", "swapped_out_bytes",
             "swapped_in_blocks", "swapped_in_bytes"]
    return {name: sum(getattr(m, name) for m in metrics) for name in names}


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_swap_and_recompute_give_the_tokens_of_a_run_without_preemption(model, dtype):
    requests = workload()
    roomy, roomy_metrics = serve(model, requests, 400, "recompute", dtype=dtype)
    recomputed, by_recompute = serve(model, requests, 21, "recompute", dtype=dtype)
    swapped, by_swap = serve(model, requests, 21, "swap", dtype=dtype)
    assert swapped == recomputed == roomy
    assert totals(roomy_metrics)["preemptions"] == 0
    r, s = totals(by_recompute), totals(by_swap)
    assert r["preemptions"] >= 1 and r["recomputed_tokens"] > 0 and r["swapped_out_blocks"] == 0
    assert s["preemptions"] >= 1 and s["recomputed_tokens"] == 0
    # everything swapped out came back in (and each block's bytes are counted once a way)
    assert s["swapped_out_blocks"] == s["swapped_in_blocks"] > 0
    assert s["swapped_out_bytes"] == s["swapped_in_bytes"] > 0


def test_steps_say_what_they_swapped(model):
    _, metrics = serve(model, workload(), 21, "swap")
    out = [m for m in metrics if m.swapped_out_blocks]
    back = [m for m in metrics if m.swapped_in_blocks]
    assert out and back and out[0].step < back[0].step
    assert all(m.preemptions for m in out)                    # swapped out when preempted
    assert "blocks swapped out" in str(out[0]) and "blocks swapped in" in str(back[0])
    # a swapped request comes back decoding: its tokens are not prefilled again
    assert sum(m.recomputed_tokens for m in metrics) == 0


def test_a_swap_that_finds_no_host_memory_falls_back_to_recompute(model, monkeypatch):
    # swap_out allocates the host copy before it touches the pool: a MemoryError there
    # leaves the sequence as it was, and the engine recomputes that request instead
    requests = workload()
    want, _ = serve(model, requests, 21, "recompute")
    refused = []

    def no_memory(self, seq):
        refused.append(seq.length)
        raise MemoryError
    monkeypatch.setattr(kvlab.PagedPool, "swap_out", no_memory)
    got, metrics = serve(model, requests, 21, "swap")
    assert got == want and refused
    t = totals(metrics)
    assert t["preemptions"] >= 1 and t["recomputed_tokens"] > 0 and t["swapped_out_blocks"] == 0


def test_swap_space_caps_the_host_copies_and_the_rest_is_recomputed(model):
    requests = workload()
    want, _ = serve(model, requests, 21, "recompute")
    # no room for any copy: every preemption recomputes
    none, metrics = serve(model, requests, 21, "swap", swap_space=1)
    t = totals(metrics)
    assert none == want and t["preemptions"] >= 1 and t["swapped_out_blocks"] == 0
    # room for everything: as without a cap
    _, free = serve(model, requests, 21, "swap")
    roomy, metrics = serve(model, requests, 21, "swap", swap_space=1 << 40)
    assert roomy == want and totals(metrics) == totals(free)
    # room for the largest copy alone: never more than that held at once
    largest = max(m.swapped_out_bytes for m in free)
    pool = model.new_paged_pool(21, block_size=4)
    engine = kvlab.Engine(model, pool, preemption="swap", swap_space=largest)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    held = []
    while engine.has_work:
        engine.step()
        held.append(engine._swapped_bytes())
    assert 0 < max(held) <= largest
    assert {rid: [o.tokens for o in out.outputs] for rid, out in engine.outputs.items()} == want


def test_swap_nbytes_is_what_swap_out_copies(small):
    pool = small.new_paged_pool(num_blocks=16, block_size=4, dtype="int8", window=3)
    seq = _filled(small, pool, 6)
    size = pool.swap_nbytes(seq)
    assert seq.alive and pool.swap_out(seq).nbytes == size


def test_a_request_preempted_mid_prompt_is_swapped_back_mid_prompt(model):
    # Two tokens a step: a long decode (A) and a long prompt fed one token a step (B) beside
    # it. The pool runs out while B is still in its prompt, and B, admitted last, goes.
    rng = np.random.default_rng(3)
    a = (rng.integers(1, 256, 6).tolist(), SamplingParams(max_new_tokens=40))
    b = (rng.integers(1, 256, 24).tolist(), SamplingParams(max_new_tokens=2))
    results, mid_prompt = [], []
    for preemption in ("recompute", "swap"):
        pool = model.new_paged_pool(12, block_size=4)
        engine = kvlab.Engine(model, pool, max_batch_tokens=2, preemption=preemption)
        for prompt, params in (a, b):
            engine.add_request(prompt, params)
        while engine.has_work:
            engine.step()
            pool.check()
            mid_prompt += [s.swapped.length for r in engine.scheduler.waiting
                           for s in r.sequences if s.swapped is not None]
        assert sum(m.preemptions for m in engine.metrics) >= 1
        results.append({rid: [o.tokens for o in out.outputs]
                         for rid, out in engine.outputs.items()})
    assert mid_prompt and all(0 < n < len(b[0]) for n in mid_prompt)
    assert results[0] == results[1]
    assert results[1][0] == [kvlab.generate(model, a[0], max_new_tokens=40).tokens]
    assert results[1][1] == [kvlab.generate(model, b[0], max_new_tokens=2).tokens]


def test_admission_counts_the_blocks_of_every_sequence_swapped_back_in(model):
    # A request of three sampled sequences, swapped out, comes back while the token budget
    # (7) leaves chunks to only some of them: all three are swapped in at admission, and
    # the plan counted the blocks of those with a chunk only (swap_in raised OutOfBlocks)
    requests = [([188, 98, 75, 157], SamplingParams(max_new_tokens=16, n=3)),
                ([163, 192], SamplingParams(max_new_tokens=10, n=3, temperature=0.8, seed=60,
                                            stop_at_eos=False)),
                ([105, 69, 179, 73, 5, 242], SamplingParams(max_new_tokens=20, n=3,
                                                            temperature=0.8, seed=64))]
    results = {}
    for preemption, num_blocks in (("swap", 7), ("recompute", 7), ("recompute", 100)):
        pool = model.new_paged_pool(num_blocks, block_size=16)
        engine = kvlab.Engine(model, pool, max_batch_tokens=7, preemption=preemption)
        for prompt, params in requests:
            engine.add_request(prompt, params)
        while engine.has_work:
            assert len(engine.metrics) < 2000, "the engine stopped making progress"
            engine.step()
            pool.check()
        assert pool.stats().blocks_used == 0 and pool.stats().n_sequences == 0
        results[preemption, num_blocks] = {rid: [o.tokens for o in out.outputs]
                                           for rid, out in engine.outputs.items()}
        if preemption == "swap":
            assert sum(m.swapped_in_blocks for m in engine.metrics) > 0
    assert results["swap", 7] == results["recompute", 7] == results["recompute", 100]


def test_bad_preemption_modes_are_refused(model):
    with pytest.raises(ValueError, match="preemption must be 'recompute' or 'swap', got 'swapping'"):
        kvlab.Engine(model, num_blocks=16, preemption="swapping")
    with pytest.raises(ValueError, match="swap_space caps the host copies of preemption='swap'"):
        kvlab.Engine(model, num_blocks=16, swap_space=1 << 20)
    for bad in (0, -1, 2.5, True):
        with pytest.raises((ValueError, TypeError), match="swap_space"):
            kvlab.Engine(model, num_blocks=16, preemption="swap", swap_space=bad)
    assert kvlab.Engine(model, num_blocks=16).preemption == "recompute"

    class CannotSwap(kvlab.PagedPool):
        swap_out = None
    c = model.config
    pool = CannotSwap(c.n_layers, c.n_kv_heads, c.head_dim, 16, 4)
    with pytest.raises(ValueError, match="pool.swap_out, which CannotSwap does not have"):
        kvlab.Engine(model, pool, preemption="swap")
    kvlab.Engine(model, pool)                                 # recompute needs no swap
