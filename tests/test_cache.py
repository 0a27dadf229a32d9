"""The contiguous KV cache as a NumPy-facing object: views, sizes, reset and truncate."""
import gc
import sys
import threading

import numpy as np
import pytest

import kvlab


@pytest.fixture
def model():
    config = kvlab.ModelConfig(dim=32, hidden_dim=48, n_layers=3, n_heads=4, n_kv_heads=2,
                               vocab_size=50, max_seq_len=40)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=7))


def test_views_have_the_documented_shape_and_grow(model):
    cache = model.new_cache(10)
    assert cache.keys.shape == (3, 0, 2, 8)
    model.prefill([1, 2, 3], cache)
    assert cache.keys.shape == (3, 3, 2, 8) and cache.values.shape == (3, 3, 2, 8)
    model.decode(4, cache)
    assert cache.length == 4 and cache.keys.shape[1] == 4
    assert cache.keys.dtype == np.float32


def test_views_are_zero_copy_read_only_and_keep_the_cache_alive(model):
    cache = model.new_cache(10)
    model.prefill([1, 2, 3], cache)
    keys = cache.keys
    assert keys.base is cache
    assert not keys.flags.writeable
    with pytest.raises(ValueError):
        keys[0, 0, 0, 0] = 1.0
    first = keys[0, 0].copy()
    model.decode(4, cache)
    # the same memory: an old view sees the same (unchanged) first position
    assert np.array_equal(cache.keys[0, 0], first)
    assert np.shares_memory(cache.keys, keys)
    refcount = sys.getrefcount(cache)
    values = cache.values
    assert sys.getrefcount(cache) == refcount + 1
    del cache
    gc.collect()
    assert np.array_equal(keys[0, 0], first)       # still readable: the view owns a ref
    assert values.shape == (3, 4, 2, 8)


def test_sizes(model):
    cache = model.new_cache(10)
    assert cache.capacity == 10 and cache.length == 0
    assert cache.nbytes == 2 * 3 * 10 * 2 * 8 * 4
    assert cache.shape == (3, 10, 2, 8)
    assert model.new_cache().capacity == model.config.max_seq_len
    assert "length=0" in repr(cache)


def test_truncate_rolls_back_exactly(model):
    cache = model.new_cache(12)
    model.prefill([5, 6, 7, 8], cache)
    after_four = model.decode(9, cache)
    model.decode(10, cache)
    cache.truncate(4)
    assert cache.length == 4
    assert np.array_equal(model.decode(9, cache), after_four)
    with pytest.raises(ValueError, match="between 0 and"):
        cache.truncate(6)
    with pytest.raises(ValueError):
        cache.truncate(-1)


def test_reset_starts_over(model):
    cache = model.new_cache(8)
    first = model.prefill([1, 2, 3], cache)
    cache.reset()
    assert cache.length == 0 and cache.keys.shape[1] == 0
    assert np.array_equal(model.prefill([1, 2, 3], cache), first)


@pytest.mark.parametrize("kwargs, error", [
    ({"max_seq_len": 0}, ValueError),
    ({"max_seq_len": -5}, ValueError),
    ({"max_seq_len": 2.5}, ValueError),
    ({"dtype": "fp64"}, ValueError),
])
def test_bad_cache_arguments(model, kwargs, error):
    with pytest.raises(error):
        model.new_cache(**kwargs)


def test_raw_cache_constructor_checks():
    with pytest.raises(ValueError, match="positive"):
        kvlab.KVCache(0, 1, 8, 4)
    cache = kvlab.KVCache(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="already initialized"):
        cache.__init__(1, 1, 8, 4)
    empty = kvlab.KVCache.__new__(kvlab.KVCache)
    with pytest.raises(RuntimeError, match="not initialized"):
        empty.keys


def test_threads_on_separate_caches_match_serial_runs(model):
    """Forward passes release the GIL; separate caches never interfere."""
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]

    def run(prompt):
        cache = model.new_cache(30)
        logits = model.prefill(prompt, cache)
        out = []
        for _ in range(20):
            token = int(np.argmax(logits))
            out.append(token)
            logits = model.decode(token, cache)
        return out

    serial = [run(p) for p in prompts]
    results = [None] * len(prompts)

    def worker(i):
        results[i] = run(prompts[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial


def test_appending_another_caches_views_as_they_are_says_how_to_lay_them_out(model):
    # cache.keys is (n_layers, length, ...); append takes (n_tokens, n_layers, ...): the
    # copy from one cache into another is a natural mistake, refused with the way out
    source, target = model.new_cache(40), model.new_cache(40)
    model.prefill(list(range(1, 20)), source)
    with pytest.raises(ValueError, match=r"transpose\(1, 0, 2, 3\)"):
        target.append(source.keys, source.values)
    assert target.length == 0
    token_major = [np.ascontiguousarray(v.transpose(1, 0, 2, 3)) for v in (source.keys, source.values)]
    target.append(*token_major)
    assert np.array_equal(target.keys, source.keys) and np.array_equal(target.values, source.values)
    assert np.array_equal(model.decode(5, target), model.decode(5, source))


def test_the_core_module_names_every_type_and_constant_it_exports():
    """Issue 36: kvlab._kvlab's docstring named two of its five types; it names them all,
    and TOKEN_CHUNK is csrc/ops.h's KV_TOKEN_CHUNK, so prose can name the constant instead
    of restating its value."""
    import re
    from pathlib import Path
    from kvlab import _kvlab as core
    exported = [name for name in dir(core) if not name.startswith("_")]
    types = [name for name in exported if isinstance(getattr(core, name), type)]
    constants = [name for name in exported if name.isupper()]
    assert len(types) == 5 and {"TOKEN_CHUNK", "MAX_BLOCK_SIZE"} <= set(constants)
    missing = [name for name in types + constants if name not in core.__doc__]
    assert not missing, f"kvlab._kvlab's docstring leaves out {missing}"
    ops_h = (Path(__file__).resolve().parents[1] / "csrc" / "ops.h").read_text()
    assert core.TOKEN_CHUNK == int(re.search(r"#define KV_TOKEN_CHUNK (\d+)", ops_h).group(1))
