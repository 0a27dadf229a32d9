"""The GPU caches' host-side logic, tested without a GPU (these run everywhere).

A GPU pool is the C core's pool (csrc/paged.c) with its rows in a GPU store: the core decides
which slots each call writes (the slot mapping), when a shared block must be copied first
(copy-on-write), and which rows are already in a block that the prefix cache swapped in; a
contiguous GPU cache's slots are kvlab.cuda's. Here a NumPy stand-in replaces the GPU memory
(conftest.py's fake_store), and the GPU pool must hold, for every sequence, exactly what the
CPU pool holds after the same operations.
"""
import gc
import weakref

import numpy as np
import pytest

import kvlab
from kvlab.cuda import CudaCache, CudaPagedPool
from kvlab.quant import CacheFormat
from block_trace import replay

L, H, D = 2, 2, 16


def rows_for(tokens, start):
    """K and V of positions start.. of a sequence: a function of its whole prefix, as a
    model's are (so two sequences with one prefix hold the same rows)."""
    keys = np.empty((len(tokens) - start, L, H, D), np.float32)
    for p in range(start, len(tokens)):
        seed = hash(tuple(int(t) for t in tokens[:p + 1])) & 0xFFFFFFFF
        keys[p - start] = np.random.default_rng(seed).standard_normal((L, H, D))
    return keys, keys * np.float32(0.5) + np.float32(1.0)


def make_pools(FakeStore, fmt_name, num_blocks=24, block_size=4, max_seqs=8):
    fmt = CacheFormat.make(D, fmt_name)
    cpu = kvlab.PagedPool(L, H, D, num_blocks, block_size, max_seqs, num_blocks,
                          **fmt.core_arguments())
    gpu = CudaPagedPool(L, H, D, num_blocks, block_size, max_seqs, num_blocks,
                        **fmt.core_arguments(), store=FakeStore(L, H, D, num_blocks * block_size, fmt))
    return cpu, gpu


def check_same(cpu, gpu, pairs):
    gpu.check()
    np.testing.assert_array_equal(cpu.ref_counts, gpu.ref_counts)
    for a, b in pairs:
        assert a.alive == b.alive
        if not a.alive:
            continue
        assert a.length == b.length
        np.testing.assert_array_equal(a.block_table, b.block_table)
        for want, got in zip(cpu.gather(a), gpu.gather(b)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt_name", ["fp32", "fp16", "bf16", "int8"])
def test_pool_bookkeeping_follows_the_cpu_pool(fmt_name, fake_store):
    """Random appends, forks (copy-on-write), frees and prefix reuse on both pools."""
    rng = np.random.default_rng(7)
    cpu, gpu = make_pools(fake_store, fmt_name)
    pairs, history = [], []   # (cpu seq, gpu seq), and each pair's tokens
    for step in range(300):
        live = [i for i, (a, _) in enumerate(pairs) if a.alive]
        action = rng.choice(["new", "append", "append", "fork", "free", "reuse"])
        try:
            if action in ("new", "reuse") or not live:
                if cpu.live_sequences == cpu.max_seqs:
                    continue
                a, b = cpu.new_sequence(), gpu.new_sequence()
                tokens = list(rng.integers(0, 3, size=int(rng.integers(1, 14))))
                if action == "reuse":
                    prompt = history[int(rng.integers(len(history)))] if history else tokens
                    tokens = list(prompt[:int(rng.integers(1, len(prompt) + 1))]) + tokens[:2]
                    assert cpu.reuse_prefix(a, tokens, len(tokens) - 1) == \
                        gpu.reuse_prefix(b, tokens, len(tokens) - 1)
                pairs.append((a, b))
                history.append([])
                i = len(pairs) - 1
                start = a.length
                history[i] = list(tokens[:start])
                new = tokens[start:]
            elif action == "append":
                i = int(rng.choice(live))
                new = list(rng.integers(0, 3, size=int(rng.integers(1, 7))))
            elif action == "fork":
                i = int(rng.choice(live))
                if cpu.live_sequences == cpu.max_seqs:
                    continue
                pairs.append((cpu.fork(pairs[i][0]), gpu.fork(pairs[i][1])))
                history.append(list(history[i]))
                continue
            else:
                i = int(rng.choice(live))
                cpu.free(pairs[i][0])
                gpu.free(pairs[i][1])
                continue
            a, b = pairs[i]
            start = len(history[i])
            tokens = history[i] + new
            keys, values = rows_for(tokens, start)
            ids = np.array(new, np.int32)
            try:
                cpu.append(a, ids, keys, values)
            except (kvlab.OutOfBlocks, kvlab.CacheFullError) as error:
                with pytest.raises(type(error)):
                    gpu.append(b, ids, keys, values)
                continue
            gpu.append(b, ids, keys, values)
            history[i] = tokens
        finally:
            check_same(cpu, gpu, pairs)
    assert gpu.stats().prefix_hits > 0 and gpu._store.writes > 50


def test_copy_on_write_copies_the_written_rows(fake_store):
    cpu, gpu = make_pools(fake_store, "fp32", block_size=8)
    a, b = cpu.new_sequence(), gpu.new_sequence()
    keys, values = rows_for([1, 2, 3], 0)
    cpu.append(a, np.array([1, 2, 3], np.int32), keys, values)
    gpu.append(b, np.array([1, 2, 3], np.int32), keys, values)
    ca, cb = cpu.fork(a), gpu.fork(b)
    keys, values = rows_for([1, 2, 3, 9], 3)
    cpu.append(ca, np.array([9], np.int32), keys, values)
    gpu.append(cb, np.array([9], np.int32), keys, values)
    assert cb.block_table[0] != b.block_table[0]          # the child got its own block
    check_same(cpu, gpu, [(a, b), (ca, cb)])


def test_a_block_computed_twice_is_swapped_for_its_twin_after_the_write(fake_store):
    """Two sequences fill the same prefix side by side: the second one writes its rows into
    a block of its own, and the commit swaps that block for the first one's (which the first
    still reads, unchanged) and frees the duplicate: as on the CPU, with no rows skipped."""
    cpu, gpu = make_pools(fake_store, "fp32", block_size=4)
    pairs = [(cpu.new_sequence(), gpu.new_sequence()) for _ in range(2)]
    tokens = [5, 6, 7, 8, 1]
    for a, b in pairs:
        keys, values = rows_for(tokens, 0)
        cpu.append(a, np.array(tokens, np.int32), keys, values)
        counts = np.array([len(tokens)], np.int32)
        _, tables, slots = gpu._reserve_batch([b], counts)
        table = tables[0]
        assert (slots >= 0).all() and len(set(slots.tolist())) == len(tokens)
        gpu._store.write(slots, keys, values)
        gpu._commit_batch([b], np.array(tokens, np.int32), counts)
    assert pairs[0][1].block_table[0] == pairs[1][1].block_table[0]
    assert table[0] != pairs[1][1].block_table[0]        # written, then swapped for the twin
    assert gpu.ref_counts[table[0]] == 0                 # and the duplicate freed
    check_same(cpu, gpu, pairs)


def test_a_held_batch_is_committed_whole_or_given_back_whole(fake_store):
    """A batch reserved for two sequences: a commit naming only one of them is refused (the
    other's rows would stay reserved in a pool no longer held), and a cancel naming only one
    gives back both reservations: the pool is as it was."""
    _, gpu = make_pools(fake_store, "fp32", block_size=4)
    a, b = gpu.new_sequence(), gpu.new_sequence()
    ref_counts = gpu.ref_counts.copy()
    counts = np.array([3, 2], np.int32)
    gpu._reserve_batch([a, b], counts)
    with pytest.raises(ValueError, match="not the sequences and counts"):
        gpu._commit_batch([a], np.arange(3, dtype=np.int32), counts[:1])
    with pytest.raises(RuntimeError, match="in use"):
        gpu.new_sequence()                            # still held by the batch
    gpu._cancel_batch([a])
    gpu.check()
    assert a.length == b.length == 0 and a.block_table.size == b.block_table.size == 0
    np.testing.assert_array_equal(gpu.ref_counts, ref_counts)
    gpu.new_sequence()                                # no longer held


def test_the_gpu_pool_is_the_cpu_pool_with_its_rows_in_the_store(fake_store):
    """The GPU pool's bookkeeping is the C core's pool itself (no CPU pool of dummy rows, no
    Python copy of the books): the pool says which rows to copy (copy-on-write), and its
    store copies them in its own memory."""
    cpu, gpu = make_pools(fake_store, "fp32", block_size=4)
    assert isinstance(gpu, kvlab._kvlab.PagedPool) and isinstance(gpu, kvlab.PagedPool)
    assert isinstance(gpu, kvlab.paged.PoolViews) and isinstance(cpu, kvlab.paged.PoolViews)
    copies, copy_rows = [], gpu._store.copy_rows
    gpu._store.copy_rows = lambda dst, src, n: (copies.append((dst, src, n)), copy_rows(dst, src, n))
    seq = gpu.new_sequence()
    gpu.append(seq, np.arange(6, dtype=np.int32), *rows_for(list(range(6)), 0))
    child = gpu.fork(seq)
    gpu.append(child, np.array([7], np.int32), *rows_for(list(range(6)) + [7], 6))
    [(dst, src, rows)] = copies                          # copy-on-write of the half block
    assert (src, rows) == (seq.block_table[1] * 4, 2) and dst == child.block_table[1] * 4 != src
    gpu.check()
    for pool in (cpu, gpu):
        with pytest.raises(TypeError, match="writes K and V between reserve and commit itself"):
            pool.reserve(pool.new_sequence(), 1)
    # ids as the CPU pool takes them: int32, never an int64 silently wrapped
    keys, values = rows_for([1, 2], 0)
    for tokens in (np.array([1, 2**32 + 2]), [1, 2]):
        with pytest.raises(TypeError, match="int32") as on_gpu:
            gpu.append(gpu.new_sequence(), tokens, keys, values)
        with pytest.raises(TypeError) as on_cpu:
            cpu.append(cpu.new_sequence(), tokens, keys, values)
        assert str(on_gpu.value) == str(on_cpu.value)


@pytest.mark.parametrize("fmt_name", ["fp32", "fp16", "bf16", "int8"])
def test_contiguous_cache_views_match_the_cpu_cache(fmt_name, fake_store):
    fmt = CacheFormat.make(D, fmt_name)
    cpu = kvlab.KVCache(L, H, D, 12, **fmt.core_arguments())
    gpu = CudaCache(L, H, D, 12, fmt, store=fake_store(L, H, D, 12, fmt))
    for part in ("key_codes", "value_codes", "key_scales"):
        want, got = getattr(cpu, part), getattr(gpu, part)
        assert (want is None) == (got is None)
        if want is not None:
            assert got.shape == want.shape and got.dtype == want.dtype
    keys, values = rows_for([3, 1, 4, 1, 5], 0)
    cpu.append(keys, values)
    gpu.append(keys, values)
    for part in ("key_codes", "key_scales", "value_codes", "value_scales", "key_zeros"):
        want, got = getattr(cpu, part), getattr(gpu, part)
        if want is None:
            assert got is None
        else:
            np.testing.assert_array_equal(got, want)
    for want, got in zip(cpu.dequantized(), gpu.dequantized()):
        np.testing.assert_array_equal(got, want)
    if fmt_name in ("fp32", "fp16"):
        np.testing.assert_array_equal(gpu.keys, cpu.keys)
    else:
        with pytest.raises(TypeError, match="codes"):
            gpu.keys
    gpu.truncate(2)
    assert gpu.length == 2 and gpu.dequantized()[0].shape == (L, 2, H, D)
    with pytest.raises(kvlab.CacheFullError):
        gpu.append(*rows_for(list(range(12)), 0))
    assert gpu.length == 2
    gpu.reset()
    assert gpu.length == 0 and gpu.key_codes.shape[1] == 0


def test_formats_the_gpu_cannot_store_are_refused_up_front():
    for kwargs in ({"dtype": "int4"}, {"dtype": "fp8"}, {"key": "int8", "value": "fp16"},
                   {"dtype": "int8", "window": 4}):
        dtype = kwargs.pop("dtype", "fp32")
        fmt = CacheFormat.make(D, dtype, **kwargs)
        with pytest.raises(ValueError):
            CudaCache(L, H, D, 8, fmt, store=object())


def test_which_gpus_an_extension_runs_on():
    # machine code runs within its major version, PTX on its own and every newer GPU
    from kvlab.cuda import runs_on
    built = "sm_75 sm_80 sm_86 sm_89 sm_90 compute_90"
    assert all(runs_on(cap, built) for cap in [(7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
                                               (10, 0), (12, 0)])
    assert not runs_on((7, 0), built)                          # a V100: no sm_70 code
    assert runs_on((8, 9), "sm_80") and not runs_on((9, 0), "sm_80")
    assert not runs_on((7, 5), "sm_86 compute_86")             # PTX never runs on older GPUs
    assert runs_on((12, 0), "sm_86 compute_86")
    assert not runs_on((8, 0), "")
    # as KVLAB_CUDA_GENCODE builds may name them: lists, and sm_90a (that one GPU's features)
    assert runs_on((9, 0), "[sm_90,compute_90]") and runs_on((9, 0), "sm_90a")
    assert not runs_on((10, 0), "sm_90a compute_90a") and runs_on((10, 0), "sm_90a compute_90")


class FakeGpuModel:
    """A stand-in for kvlab._cuda.Model: records what the host asks it to reserve, returns
    logits of the shape the real one returns (zeros)."""

    def __init__(self, config, *weights):
        self.vocab = config["vocab_size"] if isinstance(config, dict) else config.vocab_size
        self.reserved = []
        self.scratch_bytes = 0

    def reserve(self, n_tokens, n_runs, max_blocks, max_seen, n_logits):
        assert 1 <= n_runs <= n_tokens and 1 <= n_logits <= n_tokens
        self.reserved.append((n_tokens, n_runs, n_logits))

    def forward(self, tokens, store, run_tokens, run_start, tables, block_size, slots,
                all_logits=False):
        return np.zeros((len(tokens) if all_logits else len(run_tokens), self.vocab), np.float32)


def test_the_logits_scratch_is_asked_for_the_rows_wanted(fake_store, monkeypatch):
    """A call reserves logits for one row per run unless all_logits asks for every token's
    (csrc/cuda/forward.cu sizes the buffer by that count, not tokens x vocabulary)."""
    import types
    import kvlab.cuda as kc
    monkeypatch.setattr(kc, "extension", lambda: types.SimpleNamespace(Model=FakeGpuModel))
    cpu = kvlab.load()
    gpu = kc.CudaModel(cpu)
    c = gpu.config
    fmt = CacheFormat.make(c.head_dim, "fp32")
    pool = CudaPagedPool(c.n_layers, c.n_kv_heads, c.head_dim, 64, 16, 8, 64,
                         **fmt.core_arguments(),
                         store=fake_store(c.n_layers, c.n_kv_heads, c.head_dim, 64 * 16, fmt))
    a, b = pool.new_sequence(), pool.new_sequence()
    assert gpu.prefill(np.arange(300) % c.vocab_size, a).shape == (c.vocab_size,)
    assert gpu.prefill(np.arange(5), b, all_logits=True).shape == (5, c.vocab_size)
    assert gpu.forward_batch([a, b], [[1, 2, 3], [4]]).shape == (2, c.vocab_size)
    assert gpu.forward_batch([a, b], [[1, 2], [4]], all_logits=True).shape == (3, c.vocab_size)
    assert gpu._gpu.reserved == [(300, 1, 1), (5, 1, 5), (4, 2, 2), (3, 2, 3)]
    pool.check()


@pytest.mark.parametrize("fmt_name", ["fp16", "int8"])
def test_views_and_swapping_follow_the_cpu_pool(fmt_name, fake_store):
    """The GPU pool's views are copies of the same codes, block first, as the CPU pool's
    views; a sequence swapped out and back holds what it held, and the host copy is the
    CPU pool's bytes: it swaps into a CPU pool of the same shape and format, and back."""
    cpu, gpu = make_pools(fake_store, fmt_name, block_size=4)
    pairs = [(cpu.new_sequence(), gpu.new_sequence()) for _ in range(2)]
    for (a, b), tokens in zip(pairs, ([1, 2, 3, 4, 5, 6], [9, 8, 7])):
        keys, values = rows_for(tokens, 0)
        cpu.append(a, np.array(tokens, np.int32), keys, values)
        gpu.append(b, np.array(tokens, np.int32), keys, values)
    for part in ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales"):
        want, got = getattr(cpu, part), getattr(gpu, part)
        assert (want is None) == (got is None)
        if want is not None:
            assert got.dtype == want.dtype and not got.flags.writeable
            np.testing.assert_array_equal(got, want)
    a, b = pairs[0]
    want = cpu.gather(a)
    host_c, host_g = cpu.swap_out(a), gpu.swap_out(b)
    assert not b.alive and host_g.length == 6
    np.testing.assert_array_equal(host_g.data, host_c.data)        # the same bytes
    back = gpu.swap_in(host_g)
    for got, expected in zip(gpu.gather(back), want):
        np.testing.assert_array_equal(got, expected)
    to_cpu = cpu.swap_in(gpu.swap_out(back))                       # GPU -> CPU -> GPU
    to_gpu = gpu.swap_in(cpu.swap_out(to_cpu))
    for got, expected in zip(gpu.gather(to_gpu), want):
        np.testing.assert_array_equal(got, expected)
    gpu.check()
    cpu.check()


class FailingStore:
    """A fake store whose method named by `fail` raises (as on a GPU error); None: none."""

    def __init__(self, store):
        self.store, self.fail = store, None

    def __getattr__(self, name):
        if name == self.fail:
            def failing(*args):
                raise kvlab.CudaError(f"{name} failed (a test)")
            return failing
        return getattr(self.store, name)


def snapshot(pool, seqs):
    return (pool.ref_counts.copy().tolist(), sorted(pool.free_blocks), pool.stats(),
            [(s.length, list(s.block_table)) for s in seqs])


def test_a_store_that_fails_leaves_the_pool_as_it_was(fake_store):
    """A GPU error while rows move: the pool takes back what it had taken (a write failed:
    the sequence is as it was; a swap: nothing happened) and stays usable. A copy-on-write
    made before a failed write is given back, as after a failed copy-on-write: the sequence
    reads the shared block it read before."""
    fmt = CacheFormat.make(D, "fp32")
    store = FailingStore(fake_store(L, H, D, 24 * 4, fmt))
    pool = CudaPagedPool(L, H, D, 24, 4, 8, 24, **fmt.core_arguments(), store=store)
    seq = pool.new_sequence()
    pool.append(seq, np.arange(8, dtype=np.int32), *rows_for(list(range(8)), 0))
    child = pool.fork(seq)                                   # shares two full blocks
    before = snapshot(pool, [seq, child])
    for method, call in (("write", lambda: pool.append(seq, np.array([7], np.int32),
                                                       *rows_for(list(range(9)), 8))),
                         ("read", lambda: pool.swap_out(seq)),
                         ("read", lambda: pool.gather(seq))):
        store.fail = method
        with pytest.raises(kvlab.CudaError, match=method):
            call()
        assert snapshot(pool, [seq, child]) == before and seq.alive
        pool.check()
    # swap_in's put fails: the sequence it made is gone again
    store.fail = None
    host = pool.swap_out(child)
    before = snapshot(pool, [seq])
    store.fail = "put"
    with pytest.raises(kvlab.CudaError, match="put"):
        pool.swap_in(host)
    assert snapshot(pool, [seq]) == before and pool.live_sequences == 1
    # a half-full shared block: the write fails after the copy-on-write, which is given
    # back (the sequence reads the shared block again, the copy is free)
    store.fail = None
    pool.truncate(seq, 6)
    child = pool.fork(seq)
    want = pool.gather(child)
    before = snapshot(pool, [seq, child])
    store.fail = "write"
    with pytest.raises(kvlab.CudaError, match="write"):
        pool.append(child, np.array([7], np.int32), *rows_for(list(range(7)), 6))
    assert child.length == 6 and child.block_table[1] == seq.block_table[1]
    assert snapshot(pool, [seq, child]) == before
    for got, expected in zip(pool.gather(child), want):
        np.testing.assert_array_equal(got, expected)
    pool.check()
    # the copy-on-write itself fails: that fork keeps reading the shared block
    store.fail = None
    other = pool.fork(seq)
    store.fail = "copy_rows"
    with pytest.raises(kvlab.CudaError, match="copy_rows"):
        pool.append(other, np.array([7], np.int32), *rows_for(list(range(7)), 6))
    assert other.alive and other.length == 6 and seq.length == 6
    assert list(other.block_table) == list(seq.block_table)
    pool.check()
    store.fail = None
    pool.append(seq, np.array([7], np.int32), *rows_for(list(range(7)), 6))
    assert seq.length == 7
    for got, expected in zip(pool.gather(seq), rows_for(list(range(7)), 0)):
        np.testing.assert_array_equal(got, expected.transpose(1, 0, 2, 3))


class CopyThenFail:
    """A fake store whose copy_rows copies the rows, then raises (a GPU error noticed after the
    device wrote some of its destination): nothing may rely on the destination's rows."""

    def __init__(self, store):
        self.store, self.fail = store, False

    def copy_rows(self, dst, src, n):
        self.store.copy_rows(dst, src, n)
        if self.fail:
            raise kvlab.CudaError("copy_rows failed after writing (a test)")

    def __getattr__(self, name):
        return getattr(self.store, name)


def shared_half_block(store_class, fake_store, num_blocks):
    """A pool of blocks of 4 whose store is store_class(fake store); a sequence of 6 tokens
    and a fork of it, sharing a half-full last block."""
    fmt = CacheFormat.make(D, "fp32")
    store = store_class(fake_store(L, H, D, num_blocks * 4, fmt))
    pool = CudaPagedPool(L, H, D, num_blocks, 4, 8, num_blocks, **fmt.core_arguments(),
                         store=store)
    seq = pool.new_sequence()
    pool.append(seq, np.arange(6, dtype=np.int32), *rows_for(list(range(6)), 0))
    return pool, store, seq, pool.fork(seq)


def test_a_failed_copy_on_write_leaves_the_sequence_and_the_pool_as_they_were(fake_store):
    """The write needs a copy of the shared half block first, and the store fails it: the
    sequence keeps its shared block (it never lost a row), every count and the free list
    are as they were, the trace tells what happened, and the same call then succeeds."""
    pool, store, seq, child = shared_half_block(CopyThenFail, fake_store, 12)
    before = snapshot(pool, [seq, child]) + (list(pool.free_blocks),)   # in stack order
    want = pool.gather(child)
    pool.record_events = True
    store.fail = True
    for append in range(2):          # two refusals in a row: the first one left nothing
        with pytest.raises(kvlab.CudaError, match="copy_rows failed"):
            pool.append(child, np.array([7], np.int32), *rows_for(list(range(7)), 6))
        assert child.alive and snapshot(pool, [seq, child]) + (list(pool.free_blocks),) == before
        pool.check()
    events = pool.take_events()
    assert replay(events) == {b: int(pool.ref_counts[b]) for b in replay(events)}
    assert [e["event"] for e in events][:4] == ["copied", "released", "shared", "freed"]
    for got, expected in zip(pool.gather(child), want):
        np.testing.assert_array_equal(got, expected)
    store.fail = False
    pool.append(child, np.array([7], np.int32), *rows_for(list(range(7)), 6))
    assert child.length == 7 and child.block_table[1] != seq.block_table[1]
    for got, expected in zip(pool.gather(child), rows_for(list(range(7)), 0)):
        np.testing.assert_array_equal(got, expected.transpose(1, 0, 2, 3))
    pool.check()


def test_a_failed_copy_on_write_into_an_evicted_block_leaves_it_free_not_cached(fake_store):
    """With no free block the copy goes into a cached one, evicted for it. The failed copy
    may have written its rows, so it does not go back to the prefix cache: it is free, and
    the sequence, the reference counts and the blocks available are as they were."""
    pool, store, seq, child = shared_half_block(CopyThenFail, fake_store, 4)
    other = pool.new_sequence()
    pool.append(other, np.arange(100, 108, dtype=np.int32), *rows_for(list(range(100, 108)), 0))
    head, tail = other.block_table
    pool.free(other)                                   # two full blocks: cached, not free
    assert not pool.free_blocks and pool.stats().blocks_cached == 2
    refs, tables = pool.ref_counts.copy(), [list(s.block_table) for s in (seq, child)]
    store.fail = True
    with pytest.raises(kvlab.CudaError, match="copy_rows failed"):
        pool.append(child, np.array([7], np.int32), *rows_for(list(range(7)), 6))
    pool.check()
    np.testing.assert_array_equal(pool.ref_counts, refs)
    assert [list(s.block_table) for s in (seq, child)] == tables and child.length == 6
    assert list(pool.free_blocks) == [tail] and pool.stats().blocks_cached == 1
    # the evicted block (the least recently used: the chain's tail) holds what the failed
    # copy wrote, and is not offered again: a prompt of its tokens finds the head alone
    again = pool.new_sequence()
    assert pool.reuse_prefix(again, np.arange(100, 108, dtype=np.int32)) == 4
    assert list(again.block_table) == [head]


def test_a_batch_whose_copy_on_write_fails_is_given_back_whole(fake_store):
    """_reserve_batch for two sequences, the second needing a copy the store fails: both
    reservations are given back, every sequence is as it was, and the pool is not held."""
    pool, store, seq, child = shared_half_block(CopyThenFail, fake_store, 12)
    first = pool.new_sequence()
    before = snapshot(pool, [seq, child, first]) + (list(pool.free_blocks),)
    store.fail = True
    with pytest.raises(kvlab.CudaError, match="copy_rows failed"):
        pool._reserve_batch([first, child], np.array([3, 1], np.int32))
    assert child.alive and snapshot(pool, [seq, child, first]) + (list(pool.free_blocks),) == before
    pool.check()
    pool.new_sequence()                                # not held


def test_a_forward_pass_that_fails_on_the_gpu_is_cancelled(fake_store, monkeypatch):
    """The pool reserves a batch, the GPU fails (an error, or Ctrl-C while it ran): the pool
    cancels the reservation, every sequence is as it was, and the pool is free again (it is
    held, busy to any other use, only while the GPU runs)."""
    import types
    import kvlab.cuda as kc

    class FailingGpuModel(FakeGpuModel):
        def forward(self, *args, **kwargs):
            with pytest.raises(RuntimeError, match="in use"):   # held: busy to other uses
                pool.new_sequence()
            raise KeyboardInterrupt

    monkeypatch.setattr(kc, "extension", lambda: types.SimpleNamespace(Model=FailingGpuModel))
    gpu = kc.CudaModel(kvlab.load())
    c = gpu.config
    fmt = CacheFormat.make(c.head_dim, "fp32")
    pool = CudaPagedPool(c.n_layers, c.n_kv_heads, c.head_dim, 64, 16, 8, 64,
                         **fmt.core_arguments(),
                         store=fake_store(c.n_layers, c.n_kv_heads, c.head_dim, 64 * 16, fmt))
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.append(a, np.arange(20, dtype=np.int32), *[np.zeros((20, c.n_layers, c.n_kv_heads,
                                                              c.head_dim), np.float32)] * 2)
    twin = pool.fork(a)                     # a shared half block: copy-on-write on the GPU
    before = snapshot(pool, [a, b, twin])
    with pytest.raises(KeyboardInterrupt):
        gpu.forward_batch([twin, b], [[1, 2, 3], [4] * 30])
    after = snapshot(pool, [a, b, twin])
    assert after == before                  # the twin's copy-on-write given back too
    pool.check()
    pool.free(twin)                         # usable: nothing holds it
    assert pool.live_sequences == 2


def test_a_sequence_that_dropped_rows_does_not_swap_into_a_gpu_pool(fake_store):
    """Its rows hold other positions than their row numbers, which the GPU cannot read."""
    cpu, gpu = make_pools(fake_store, "fp32", block_size=4)
    seq = cpu.new_sequence()
    cpu.append(seq, np.arange(6, dtype=np.int32), *rows_for(list(range(6)), 0))
    cpu.keep(seq, np.tile(np.array([0, 2, 5], np.int32)[None, :, None], (L, 1, H)))
    host = cpu.swap_out(seq)
    with pytest.raises(ValueError, match="another shape or cache format"):
        gpu.swap_in(host)
    assert gpu.live_sequences == 0 and gpu.stats().blocks_used == 0
    gpu.check()


def test_the_pool_is_busy_while_its_store_moves_rows(fake_store):
    """The GPU store lets go of the GIL while the device works; meanwhile every other use of
    the pool is refused, as while a CPU pool's forward pass runs."""
    fmt = CacheFormat.make(D, "fp32")
    store = fake_store(L, H, D, 8 * 4, fmt)
    pool = CudaPagedPool(L, H, D, 8, 4, **fmt.core_arguments(), store=store)
    refused, write = [], store.write

    def write_and_look(*args):
        with pytest.raises(RuntimeError, match="in use"):
            pool.new_sequence()
        refused.append(True)
        return write(*args)

    store.write = write_and_look
    seq = pool.new_sequence()
    pool.append(seq, np.arange(3, dtype=np.int32), *rows_for([0, 1, 2], 0))
    assert refused == [True] and seq.length == 3 and pool.live_sequences == 1


def test_a_pool_takes_a_store_that_can_hold_its_rows(fake_store):
    """PagedPool(store=...): an object with the four methods, and a format a store keeps
    (codes and scales: no int4 zero points, no window of float32 rows beside them)."""
    fmt = CacheFormat.make(D, "fp32")
    with pytest.raises(TypeError, match="copy_rows, write, read and put"):
        kvlab.PagedPool(L, H, D, 8, 4, store=object())
    for options in ({"window": 4}, {"key_format": "int4", "value_format": "int4"}):
        with pytest.raises(ValueError, match="no residual window and no int4"):
            kvlab.PagedPool(L, H, D, 8, 4, **options, store=fake_store(L, H, D, 32, fmt))
    pool = kvlab.PagedPool(L, H, D, 8, 4, store=fake_store(L, H, D, 32, fmt))
    assert pool.device == "cuda" and pool.nbytes == pool.key_codes.nbytes * 2
    with pytest.raises(ValueError, match="on 'cuda' but the model runs on 'cpu'"):
        kvlab.load().forward([1, 2], pool.new_sequence())


def test_a_pool_and_a_store_that_refer_to_each_other_are_collected(fake_store):
    """A store written in Python may keep its pool (pool -> store -> pool): the pool takes
    part in garbage collection, so the cycle is freed, not leaked with all its rows."""
    fmt = CacheFormat.make(D, "fp32")
    store = fake_store(L, H, D, 32, fmt)
    pool = kvlab.PagedPool(L, H, D, 8, 4, store=store)
    store.pool = pool
    seq = pool.new_sequence()
    gone = weakref.ref(store)
    del store, pool, seq
    gc.collect()
    assert gone() is None


def test_a_refused_batch_reservation_names_its_cause(fake_store):
    """The GPU pool's batch reservation words its refusals as forward_batch does (one
    helper, kv_py_batch_refused): the sequence given twice, the sequence with no new token;
    and the pool is as it was."""
    _, gpu = make_pools(fake_store, "fp32", block_size=4)
    a, b = gpu.new_sequence(), gpu.new_sequence()
    with pytest.raises(ValueError, match=r"seqs\[0\] and seqs\[1\] are the same sequence"):
        gpu._reserve_batch([a, a], np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match=r"n_tokens\[1\] is 0: every sequence needs"):
        gpu._reserve_batch([a, b], np.array([1, 0], np.int32))
    assert a.length == b.length == 0 and gpu.stats().blocks_used == 0
