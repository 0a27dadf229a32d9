"""The GPU caches' host-side logic, tested without a GPU (these run everywhere).

A GPU pool is the C core's pool (csrc/paged.c) with its rows in a GPU store: the core decides
which slots each call writes (the slot mapping), when a shared block must be copied first
(copy-on-write), and which rows are already in a block that the prefix cache swapped in; a
contiguous GPU cache's slots are kvlab.cuda's. Here a NumPy stand-in replaces the GPU memory
(conftest.py's fake_store), and the GPU pool must hold, for every sequence, exactly what the
CPU pool holds after the same operations.
"""
import numpy as np
import pytest

import kvlab
from kvlab.cuda import CudaCache, CudaPagedPool
from kvlab.quant import CacheFormat

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
