"""The C forward pass (kvlab.Model) against the NumPy reference, and its input checks."""
import numpy as np
import pytest

import kvlab
from kvlab import reference

SHAPES = {
    # name: (n_heads, n_kv_heads, head_dim, dim, tied, interleaved, rope_scaling)
    "mha": (4, 4, 8, 32, True, True, None),
    "gqa": (8, 2, 16, 128, False, False, None),
    "mqa": (6, 1, 10, 64, True, True, None),          # head_dim 10: not a multiple of 8
    "odd-dims": (3, 3, 6, 20, False, False, None),    # dim != n_heads * head_dim
    "llama3-rope": (4, 2, 12, 48, False, False,
                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def make(name, seed=0, vocab=61, hidden=45, layers=2):
    heads, kv_heads, head_dim, dim, tied, interleaved, scaling = SHAPES[name]
    config = kvlab.ModelConfig(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads,
                               n_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                               max_seq_len=64, tied_embeddings=tied,
                               rope_interleaved=interleaved, rope_scaling=scaling,
                               rope_theta=500.0 if scaling else 10000.0)
    weights = kvlab.Weights.random(config, seed=seed)
    return kvlab.Model(config, weights)


def tokens_for(model, n, seed=1):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, size=n)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_prefill_then_decode_matches_reference(name):
    model = make(name)
    tokens = tokens_for(model, 20)
    cache, ref_cache = model.new_cache(32), reference.ReferenceCache(model.config, 32)

    got = model.prefill(tokens[:12], cache, all_logits=True)
    want = reference.forward(model.config, model.weights, tokens[:12], ref_cache)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    for token in tokens[12:]:
        got = model.decode(int(token), cache)
        want = reference.forward(model.config, model.weights, [token], ref_cache)[0]
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(cache.keys, ref_cache.keys, atol=2e-5, rtol=0)
    np.testing.assert_allclose(cache.values, ref_cache.values, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_cached_and_uncached_logits_agree_exactly(name):
    """The core sums every dot product in one fixed order, so the cache is bit-exact."""
    model = make(name, seed=3)
    tokens = tokens_for(model, 17, seed=4)
    cache = model.new_cache(17)
    model.prefill(tokens[:5], cache)
    for i in range(5, 17):
        cached = model.decode(int(tokens[i]), cache)
        uncached = model.forward(tokens[:i + 1])
        assert np.array_equal(cached, uncached)


def test_last_row_equals_all_logits_last_row():
    model = make("gqa")
    tokens = tokens_for(model, 9)
    every = model.forward(tokens, all_logits=True)
    assert every.shape == (9, model.config.vocab_size)
    assert np.array_equal(model.forward(tokens), every[-1])


def test_prefill_in_chunks_equals_one_prefill():
    model = make("mha")
    tokens = tokens_for(model, 24)
    one, chunked = model.new_cache(24), model.new_cache(24)
    whole = model.prefill(tokens, one, all_logits=True)
    parts = [model.prefill(tokens[a:b], chunked, all_logits=True)
             for a, b in ((0, 7), (7, 8), (8, 24))]
    assert np.array_equal(np.concatenate(parts), whole)
    assert np.array_equal(one.keys, chunked.keys)


def test_threads_do_not_change_results():
    model = make("gqa")
    tokens = tokens_for(model, 30)
    before = kvlab.get_num_threads()
    try:
        kvlab.set_num_threads(1)
        single = model.forward(tokens, all_logits=True)
        kvlab.set_num_threads(2)
        double = model.forward(tokens, all_logits=True)
    finally:
        kvlab.set_num_threads(before)
    assert np.array_equal(single, double)


# ---- bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("tokens, error, match", [
    ([1.0, 2.0], TypeError, "integers"),
    ([True, False], TypeError, "integers"),
    ([[1, 2]], ValueError, "1-D"),
    ([], ValueError, "non-empty"),
    ([0, 61], ValueError, "out of range"),
    ([-1], ValueError, "out of range"),
    (["a"], TypeError, "integers"),
])
def test_bad_tokens_raise_and_leave_cache_unchanged(tokens, error, match):
    model = make("mha")
    cache = model.new_cache(16)
    model.prefill([1, 2, 3], cache)
    keys_before = cache.keys.copy()
    with pytest.raises(error, match=match):
        model.prefill(tokens, cache)
    assert cache.length == 3
    assert np.array_equal(cache.keys, keys_before)


def test_core_rejects_wrong_token_arrays_directly():
    """The binding checks dtype, shape and contiguity itself, not only the Python layer."""
    model = make("mha")
    core = model._core
    with pytest.raises(TypeError, match="int32"):
        core.forward(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        core.forward(np.arange(10, dtype=np.int32)[::2])
    with pytest.raises(ValueError, match="out of range"):
        core.forward(np.array([5, 999], dtype=np.int32))
    with pytest.raises(TypeError, match="KVCache"):
        core.forward(np.array([1], dtype=np.int32), cache="not a cache")


def test_cache_full_raises_and_cache_is_unchanged():
    model = make("gqa")
    cache = model.new_cache(6)
    model.prefill([1, 2, 3, 4], cache)
    keys_before, values_before = cache.keys.copy(), cache.values.copy()
    with pytest.raises(kvlab.CacheFullError, match="holds 4 of 6"):
        model.prefill([5, 6, 7], cache)
    assert cache.length == 4
    assert np.array_equal(cache.keys, keys_before) and np.array_equal(cache.values, values_before)
    model.decode(5, cache)
    model.decode(6, cache)
    with pytest.raises(kvlab.CacheFullError):
        model.decode(7, cache)
    assert cache.length == 6


def test_cache_of_another_model_is_refused():
    small, other = make("mha"), make("gqa")
    cache = other.new_cache(8)
    with pytest.raises(ValueError, match="model needs"):
        small.prefill([1, 2], cache)
    assert cache.length == 0


def test_decode_takes_one_integer():
    model = make("mha")
    cache = model.new_cache(4)
    with pytest.raises(TypeError):
        model.decode([1, 2], cache)
    with pytest.raises(TypeError):
        model.decode(1.5, cache)


def test_bad_weights_are_rejected():
    model = make("gqa")
    config, weights = model.config, model.weights
    for field, bad, match in [
        ("wq", weights.wq.astype(np.float64), "float32"),
        ("wk", weights.wk[:, :-1], "shape"),
        ("w1", np.asfortranarray(weights.w1), "contiguous"),
        ("final_norm", [1.0] * config.dim, "numpy array"),
    ]:
        broken = kvlab.Weights(**{**dict(weights.items()), field: bad})
        with pytest.raises(kvlab.WeightsError, match=match):
            kvlab.Model(config, broken)


@pytest.mark.parametrize("changes, match", [
    ({"n_heads": 6, "n_kv_heads": 4}, "divide"),
    ({"head_dim": 7}, "even"),
    ({"dim": 0}, "positive"),
    ({"norm_eps": -1.0}, "norm_eps"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling"),
])
def test_configs_that_do_not_fit_raise(changes, match):
    base = dict(dim=32, hidden_dim=40, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=10,
                max_seq_len=8)
    with pytest.raises(kvlab.ConfigError, match=match):
        kvlab.ModelConfig(**{**base, **changes})


def test_core_model_cannot_be_reinitialized():
    model = make("mha")
    with pytest.raises(RuntimeError, match="already initialized"):
        model._core.__init__({}, {})


def test_weights_are_used_in_place():
    """The core reads the NumPy buffers; it keeps references instead of copies."""
    model = make("mha")
    tokens = tokens_for(model, 4)
    before = model.forward(tokens)
    model.weights.classifier[...] *= 2          # tied: also the embedding
    after = model.forward(tokens)
    assert not np.array_equal(before, after)


def test_token_array_changed_by_another_thread_cannot_crash():
    """The binding copies the ids before releasing the GIL; a thread flipping them to an
    out-of-range value meanwhile must not make the core read past the embedding."""
    import threading
    model = make("mha")
    tokens = np.zeros(2000, dtype=np.int32)
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            tokens[-1] = 10**6
            tokens[-1] = 0

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(20):
            try:
                model._core.forward(tokens, None)
            except ValueError:
                pass
    finally:
        stop.set()
        flipper.join()


def test_set_num_threads_applies_to_every_python_thread():
    import threading
    before = kvlab.get_num_threads()
    seen = []
    try:
        kvlab.set_num_threads(1)
        worker = threading.Thread(target=lambda: seen.append(kvlab.get_num_threads()))
        worker.start()
        worker.join()
    finally:
        kvlab.set_num_threads(before)
    assert seen == [1]


def test_config_conversion_that_mutates_the_dict_is_safe():
    """Model.__init__ converts each borrowed dict value before the next lookup."""
    model = make("mha")
    config = {k: getattr(model.config, k) for k in
              ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
               "vocab_size", "max_seq_len")}
    config["rope_interleaved"] = True

    class Evil:
        def __float__(self):
            del config["rope_interleaved"]
            return 1e-5

    config["norm_eps"] = Evil()
    arrays = dict(model.weights.items())
    arrays["rope_inv_freq"] = model.config.rope_inv_freq()
    with pytest.raises(kvlab.ConfigError, match="rope_interleaved"):
        kvlab.model.core.Model(config, arrays)


def test_results_do_not_depend_on_the_thread_count():
    # Threads split the output rows of each matrix product and the (block of prefill
    # tokens, KV head) pairs of attention; every output is still summed by one thread in the one fixed order, so
    # the tolerance is zero: one thread and two give the same bits, and the same tokens.
    config = kvlab.ModelConfig(dim=256, hidden_dim=640, n_layers=2, n_heads=8, n_kv_heads=2,
                               vocab_size=1000, max_seq_len=256)
    model = kvlab.Model(config, kvlab.Weights.random(config, seed=3))
    prompt = list(np.random.default_rng(3).integers(0, 1000, 100))
    before = kvlab.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            kvlab.set_num_threads(threads)
            cache = model.new_cache(140)
            logits = [model.prefill(prompt, cache, all_logits=True)]
            tokens = []
            for _ in range(20):
                tokens.append(int(np.argmax(logits[-1][-1] if logits[-1].ndim == 2 else logits[-1])))
                logits.append(model.decode(tokens[-1], cache))
            runs.append((logits, tokens, kvlab.generate(model, prompt, 20).tokens))
    finally:
        kvlab.set_num_threads(before)
    for logits, tokens, generated in runs[1:]:
        assert tokens == runs[0][1] and generated == runs[0][2]
        assert all(np.array_equal(a, b) for a, b in zip(logits, runs[0][0]))


# ---- decode_steps: the per-token loop in C --------------------------------------------

def greedy_by_hand(model, token, cache, n_steps, stop=None):
    """decode() + numpy.argmax, token by token: what decode_steps must match."""
    picks = []
    for _ in range(n_steps):
        token = int(np.argmax(model.decode(token, cache)))
        picks.append(token)
        if token == stop:
            break
    return picks


@pytest.mark.parametrize("name", ["gqa", "mqa", "odd-dims"])
@pytest.mark.parametrize("options", [{}, {"dtype": "int8", "window": 4}, {"dtype": "fp16"}])
def test_decode_steps_matches_decode_token_by_token(name, options):
    model = make(name)
    prompt = tokens_for(model, 5)
    in_c, by_hand = model.new_cache(40, **options), model.new_cache(40, **options)
    first = int(np.argmax(model.prefill(prompt, in_c)))
    model.prefill(prompt, by_hand)
    with model.counting() as counted_c:
        picks, seconds = model.decode_steps(first, in_c, 30)
    with model.counting() as counted_by_hand:
        expected = greedy_by_hand(model, first, by_hand, 30)
    assert picks.dtype == np.int32 and picks.tolist() == expected
    assert seconds.shape == (30,) and np.all(seconds > 0)
    assert in_c.length == by_hand.length == 35
    for a, b in zip(in_c.dequantized(), by_hand.dequantized()):
        assert np.array_equal(a, b)
    # the core counts the same work either way: 30 decode calls
    assert counted_c.flops == counted_by_hand.flops and counted_c.calls == 30
    assert counted_c.kv_read_bytes == counted_by_hand.kv_read_bytes


def test_decode_steps_samples_as_decode_and_sample_do_token_by_token():
    from kvlab.sampling import sample
    model = make("gqa")
    in_c, by_hand = model.new_cache(40), model.new_cache(40)
    first = int(np.argmax(model.prefill([1, 2, 3], in_c)))
    model.prefill([1, 2, 3], by_hand)
    picks, _ = model.decode_steps(first, in_c, 30, temperature=1.2, top_k=30, top_p=0.95,
                                  rng=np.random.default_rng(9))
    rng, token, expected = np.random.default_rng(9), first, []
    for _ in range(30):
        token = sample(model.decode(token, by_hand), 1.2, 30, 0.95, rng)
        expected.append(token)
    assert picks.tolist() == expected
    assert np.array_equal(in_c.keys, by_hand.keys)


def test_decode_steps_with_nan_logits_raises_after_that_step():
    """A token cannot be chosen from NaN logits, greedy or sampled (greedy used to take
    numpy.argmax's pick, the NaN's index, forever): the step that made them stays in the
    cache (as after decode() then a failed sample()), the error names the step, and the
    steps before it are kept in the cache and on the exception."""
    config = kvlab.ModelConfig(dim=48, hidden_dim=64, n_layers=2, n_heads=6, n_kv_heads=2,
                               vocab_size=40, max_seq_len=96, tied_embeddings=False)
    arrays = dict(kvlab.Weights.random(config, seed=11, scale=0.3).items())
    arrays["classifier"] = arrays["classifier"].copy()
    arrays["classifier"][7] = np.nan
    model = kvlab.Model(config, kvlab.Weights(**arrays))
    for options in ({"temperature": 1.0, "rng": np.random.default_rng(0)}, {}):
        cache = model.new_cache(20)
        model.prefill([1, 2], cache)
        with pytest.raises(ValueError, match=r"decode step 0 \(position 2\).*NaN") as error:
            model.decode_steps(3, cache, 5, **options)
        assert cache.length == 3
        tokens, seconds = error.value.completed
        assert tokens.tolist() == [] and seconds.shape == (0,)
        with pytest.raises(ValueError, match="NaN"):
            kvlab.sampling.sample(model.decode(4, cache), **options)


def test_decode_steps_stops_after_the_stop_token():
    model = make("gqa")
    cache, reference_cache = model.new_cache(40), model.new_cache(40)
    first = int(np.argmax(model.prefill([1, 2, 3], cache)))
    model.prefill([1, 2, 3], reference_cache)
    run = greedy_by_hand(model, first, reference_cache, 20)
    stop = run[6]
    picks, seconds = model.decode_steps(first, cache, 20, stop_token=stop)
    assert picks.tolist() == run[:run.index(stop) + 1]          # the stop token included
    assert len(seconds) == len(picks) and cache.length == 3 + len(picks)


def test_decode_steps_over_a_paged_sequence_steps_in_python_with_the_same_tokens():
    model = make("gqa")
    pool = model.new_paged_pool(num_blocks=8, block_size=4)
    seq, cache = pool.new_sequence(), model.new_cache(40)
    first = int(np.argmax(model.prefill([5, 6], seq)))
    model.prefill([5, 6], cache)
    assert model.decode_steps(first, seq, 12)[0].tolist() == \
        model.decode_steps(first, cache, 12)[0].tolist()


@pytest.mark.parametrize("call, error, match", [
    (lambda m, c: m.decode_steps(99, c, 3), ValueError, "out of range"),
    (lambda m, c: m.decode_steps(-1, c, 3), ValueError, "out of range"),
    (lambda m, c: m.decode_steps(1.0, c, 3), TypeError, "integer token"),
    (lambda m, c: m.decode_steps(1, c, 0), ValueError, "max_steps"),
    (lambda m, c: m.decode_steps(1, c, 3, stop_token=61), ValueError, "stop_token"),
    (lambda m, c: m.decode_steps(1, c, 7), kvlab.CacheFullError, "holds 4 of 10"),
    (lambda m, c: m._core.generate(1, c, 3, stop_token=61), ValueError, "stop_token"),
    (lambda m, c: m._core.generate(1, c, 3, temperature=1.0), ValueError, "needs uniforms"),
    (lambda m, c: m._core.generate(1, c, 3, 1.0, uniforms=np.zeros(2)), ValueError, "uniforms"),
    (lambda m, c: m._core.generate(1, c, 3, 1.0, uniforms=np.zeros(3, np.float32)), ValueError,
     "float64"),
    (lambda m, c: m._core.generate(1, c, 3, -1.0), ValueError, "temperature"),
    (lambda m, c: m._core.generate(1, c, 3, 1.0, top_p=0.0), ValueError, "top_p"),
    (lambda m, c: m.decode_steps(1, c, 3, temperature=1.0, top_k=0), ValueError, "top_k"),
    (lambda m, c: m._core.generate(1, "no cache", 3), TypeError, "KVCache"),
])
def test_decode_steps_bad_input_raises_and_leaves_the_cache_unchanged(call, error, match):
    model = make("gqa")
    cache = model.new_cache(10)
    model.prefill([1, 2, 3, 4], cache)
    keys = cache.keys.copy()
    with pytest.raises(error, match=match):
        call(model, cache)
    assert cache.length == 4 and np.array_equal(cache.keys, keys)


def test_decode_steps_runs_with_the_gil_released():
    """Another Python thread keeps running while one thread's greedy loop is in C."""
    import threading
    import time
    config = kvlab.ModelConfig(dim=256, hidden_dim=512, n_layers=4, n_heads=4, n_kv_heads=4,
                               vocab_size=512, max_seq_len=512)
    model = kvlab.Model(config, kvlab.Weights.random(config, seed=3))
    cache = model.new_cache(400)
    first = int(np.argmax(model.prefill([1, 2], cache)))
    ticks, done = [], threading.Event()

    def count_ticks():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=count_ticks)
    ticker.start()
    try:
        start = time.perf_counter()
        model.decode_steps(first, cache, 390)
        end = time.perf_counter()
    finally:
        done.set()
        ticker.join()
    # with the GIL held for the whole call the ticker could not have run inside it
    assert sum(start < t < end for t in ticks) >= 3
