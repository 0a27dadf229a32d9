"""Quantized KV caches end to end: the C core's fp16/bf16/int8/int4/fp8 caches (contiguous
and paged, with and without a residual window) against the NumPy reference.

What is checked:
  * logits: one prefill == token-by-token decode == a paged sequence, bit for bit, and
    == kvlab.reference.forward with the same cache format (to 1e-3; 3e-3 for fp16/bf16);
  * stored codes, scales and zero points == kvlab.quant's, bit for bit;
  * the code views are zero-copy, read-only and keep the cache alive;
  * nbytes == kvlab.kv_cache_bytes (and the pool's formula), ratios exact;
  * the residual window: exact reads inside it, forks, no prefix reuse;
  * greedy generation on both cache kinds, attend() against NumPy, append() round trips;
  * bad formats and groups are refused, and a failed call changes nothing.
"""
import gc
import sys

import numpy as np
import pytest

import kvlab
from kvlab import quant, reference

PROMPT = ("ROMEO: But soft, what light through yonder window breaks? "
          "It is the east, and Juliet is the sun.")
N_PROMPT = 40

# Each format, a mixed K/V format and a windowed one, as keyword arguments of new_cache.
FORMATS = {
    "fp32": dict(dtype="fp32"),
    "fp16": dict(dtype="fp16"),
    "bf16": dict(dtype="bf16"),
    "int8": dict(dtype="int8"),
    "int4": dict(dtype="int4"),
    "fp8": dict(dtype="fp8"),
    "int8-k/int4-v g8": dict(key_format="int8", value_format="int4", group=8),
    "int4 +w8": dict(dtype="int4", window=8),
}
# Formats that store some positions in fewer than 16 bits: their logits must move.
LOSSY = {"int8", "int4", "fp8", "int8-k/int4-v g8", "int4 +w8"}


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def prompt(model):
    ids = model.encode(PROMPT)
    assert len(ids) >= N_PROMPT
    return ids[:N_PROMPT]


@pytest.fixture(scope="module")
def fp32_logits(model, prompt):
    cache = model.new_cache(64)
    return model.prefill(prompt, cache, all_logits=True)


def one_at_a_time(model, tokens, cache):
    """Logits of each token fed alone: a one-token prefill, then decode steps."""
    rows = [model.prefill(tokens[:1], cache)]
    rows += [model.decode(int(t), cache) for t in tokens[1:]]
    return np.stack(rows)


def random_rows(n_tokens, config, seed=0, scale=1.5):
    """Random K and V rows in append()'s layout (n_tokens, n_layers, n_kv_heads, head_dim)."""
    rng = np.random.default_rng(seed)
    shape = (n_tokens, config.n_layers, config.n_kv_heads, config.head_dim)
    return ((scale * rng.standard_normal(shape)).astype(np.float32),
            (scale * rng.standard_normal(shape)).astype(np.float32))


def code_arrays(cache):
    """Copies of everything a cache stores (codes, scales, zero points)."""
    names = ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales",
             "value_zeros")
    return {n: None if getattr(cache, n) is None else getattr(cache, n).copy() for n in names}


def base_chain_reaches(array, owner) -> bool:
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base is owner


# ---- 1. logits: every path agrees -------------------------------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_prefill_decode_paged_and_reference_agree(model, prompt, fp32_logits, name):
    options = FORMATS[name]
    whole = model.prefill(prompt, model.new_cache(64, **options), all_logits=True)

    # the same (token, head) arithmetic whether a token comes in a batch or alone
    stepped = one_at_a_time(model, prompt, model.new_cache(64, **options))
    assert np.array_equal(whole, stepped)

    # and whether its K/V live in one block or in blocks of 4 found through a table
    pool = model.new_paged_pool(num_blocks=32, block_size=4, **options)
    paged_stepped = one_at_a_time(model, prompt, pool.new_sequence())
    paged_whole = model.prefill(prompt, pool.new_sequence(), all_logits=True)
    pool.check()
    assert np.array_equal(whole, paged_stepped)
    assert np.array_equal(whole, paged_whole)

    # The NumPy oracle reads the same stored values (exact rows in the window). Its K and
    # V differ from C's in the last bit or so (another summation order), and now and then
    # that puts a value on the other side of a rounding boundary: one code apart. fp16
    # and bf16 have a boundary every ulp, so with them this prompt flips a few hundred
    # codes and moves logits by up to ~1.5e-3; integer codes almost never flip.
    atol = 3e-3 if name in ("fp16", "bf16") else 1e-3
    ref_cache = reference.ReferenceCache(model.config, 64, model.cache_format(**options))
    expected = reference.forward(model.config, model.weights, prompt, ref_cache)
    np.testing.assert_allclose(whole, expected, rtol=0, atol=atol)

    # ... and quantizing moves the logits far more than that tolerance: the comparison
    # above would see a cache that read the wrong rows or ignored the format
    if name in LOSSY:
        assert np.abs(whole - fp32_logits).max() > 0.05
    elif name == "fp32":
        assert np.array_equal(whole, fp32_logits)


@pytest.mark.parametrize("name", ["int8", "int4 +w8", "int8-k/int4-v g8"])
def test_paged_gather_equals_contiguous_dequantized(model, prompt, name):
    # Both caches keep the same codes and the same window rows, so what the last token
    # read is the same array, bit for bit; fed in odd chunks so blocks fill unevenly.
    options = FORMATS[name]
    cache = model.new_cache(64, **options)
    pool = model.new_paged_pool(num_blocks=32, block_size=4, **options)
    seq = pool.new_sequence()
    for chunk in (prompt[:7], prompt[7:8], prompt[8:30], prompt[30:]):
        model.prefill(chunk, cache)
        model.prefill(chunk, seq)
    for want, got in zip(cache.dequantized(), pool.gather(seq)):
        assert got.shape == (6, N_PROMPT, 2, 16)
        assert np.array_equal(want, got)


# ---- 2. the stored codes are kvlab.quant's ----------------------------------------------------

@pytest.mark.parametrize("fmt, group", [("int8", None), ("int8", 4), ("int4", None),
                                        ("int4", 2), ("fp8", None), ("fp8", 8),
                                        ("bf16", None), ("fp16", None)])
def test_layer0_codes_equal_numpy_quantize(model, prompt, fmt, group):
    # Layer 0's K and V depend only on the embeddings, not on what the cache stores, so
    # the fp32 cache holds exactly the rows every other format quantized.
    exact = model.new_cache(64)
    model.prefill(prompt, exact)
    options = {} if group is None else {"group": group}
    cache = model.new_cache(64, fmt, **options)
    model.prefill(prompt, cache)
    deq_keys, deq_values = cache.dequantized()
    for kind, rows, deq in (("key", exact.keys[0], deq_keys), ("value", exact.values[0],
                                                             deq_values)):
        want = quant.quantize(rows, fmt, group)
        codes = getattr(cache, f"{kind}_codes")[0]
        if fmt == "fp16":       # NumPy's float16 view; quant keeps the raw bits
            codes = codes.view(np.uint16)
        assert codes.dtype == want.codes.dtype
        assert np.array_equal(codes, want.codes), kind
        scales, zeros = getattr(cache, f"{kind}_scales"), getattr(cache, f"{kind}_zeros")
        if want.scales is None:
            assert scales is None
        else:
            assert np.array_equal(scales[0], want.scales), kind
        if want.zeros is None:
            assert zeros is None
        else:
            assert np.array_equal(zeros[0], want.zeros), kind
        assert np.array_equal(deq[0], quant.dequantize(want)), kind


@pytest.mark.parametrize("fmt, code_dtype, per_head, n_groups, zeros",
                         [("fp32", np.float32, 16, 0, False), ("fp16", np.float16, 16, 0, False),
                          ("bf16", np.uint16, 16, 0, False), ("int8", np.int8, 16, 1, False),
                          ("int4", np.uint8, 8, 1, True), ("fp8", np.uint8, 16, 1, False)])
def test_code_views_have_the_documented_shapes_and_dtypes(model, fmt, code_dtype, per_head,
                                                          n_groups, zeros):
    cache = model.new_cache(16, fmt)
    model.prefill([1, 2, 3, 4, 5], cache)
    assert cache.key_format == cache.value_format == fmt
    for kind in ("key", "value"):
        codes = getattr(cache, f"{kind}_codes")
        assert codes.dtype == code_dtype and codes.shape == (6, 5, 2, per_head)
        scales = getattr(cache, f"{kind}_scales")
        if n_groups:
            assert scales.dtype == np.float32 and scales.shape == (6, 5, 2, n_groups)
        else:
            assert scales is None
        zero_points = getattr(cache, f"{kind}_zeros")
        assert (zero_points is not None) == zeros
        if zeros:
            assert zero_points.dtype == np.float32 and zero_points.shape == scales.shape


# ---- 3. views ---------------------------------------------------------------------------------

def test_code_views_are_zero_copy_read_only_and_keep_the_cache_alive(model, prompt):
    cache = model.new_cache(64, "int4", group=4)
    model.prefill(prompt[:10], cache)
    codes, scales, zeros = cache.key_codes, cache.key_scales, cache.key_zeros
    for view in (codes, scales, zeros, cache.value_codes):
        assert not view.flags.writeable
        assert base_chain_reaches(view, cache)
        with pytest.raises(ValueError):
            view.flags.writeable = True
    with pytest.raises(ValueError):
        codes[0, 0, 0, 0] = 1
    assert np.shares_memory(codes, cache.key_codes)
    assert np.shares_memory(scales, cache.key_scales)

    # The length axis is fixed when a view is made, so roll the last position back and
    # write a different token there: the old view must show the new row (same memory).
    before = codes[:, 9].copy()
    other = next(t for t in prompt if t != prompt[9])
    cache.truncate(9)
    model.decode(other, cache)
    assert not np.array_equal(codes[0, 9], before[0]), "the new token must give other codes"
    assert np.array_equal(codes[:, 9], cache.key_codes[:, 9])
    assert np.array_equal(scales[:, 9], cache.key_scales[:, 9])

    # each view holds one reference to the cache (KVCache has no weakref support), and
    # gives it back when dropped: alive while viewed, no leak after
    refs = sys.getrefcount(cache)
    extra = cache.value_zeros
    assert sys.getrefcount(cache) == refs + 1
    del extra
    assert sys.getrefcount(cache) == refs
    snapshot = codes.copy()
    del cache
    gc.collect()
    assert np.array_equal(codes, snapshot)      # still readable: the view owns its cache


def test_float_views_only_exist_for_float_storage(model):
    assert model.new_cache(8, "fp16").keys.dtype == np.float16
    assert model.new_cache(8).values.dtype == np.float32
    for fmt in ("bf16", "int8", "int4", "fp8"):
        cache = model.new_cache(8, fmt)
        with pytest.raises(TypeError, match="codes"):
            cache.keys
        with pytest.raises(TypeError, match="codes"):
            cache.values
    # mixed: the float half is viewable, the quantized half is not
    mixed = model.new_cache(8, key_format="fp16", value_format="int8")
    assert mixed.keys.dtype == np.float16
    with pytest.raises(TypeError, match="codes"):
        mixed.values


# ---- 4. memory --------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    dict(dtype="fp32"), dict(dtype="fp16"), dict(dtype="bf16"), dict(dtype="int8"),
    dict(dtype="int8", group=4), dict(dtype="int4"), dict(dtype="int4", group=2),
    dict(dtype="fp8", group=8), dict(key_format="int8", value_format="int4", group=8),
    dict(key_format="fp16", value_format="int4", value_group=4),
    dict(dtype="int4", window=8), dict(dtype="fp32", window=3)], ids=str)
def test_cache_nbytes_equals_kv_cache_bytes(model, options):
    options = dict(options)
    dtype = options.pop("dtype", "fp32")
    for seq_len in (8, 37, 64):              # a window may not be longer than the cache
        cache = model.new_cache(seq_len, dtype, **options)
        assert cache.nbytes == kvlab.kv_cache_bytes(model.config, seq_len, 1, dtype, **options)
    assert (kvlab.kv_cache_bytes(model.config, 64, 3, dtype, **options)
            == 3 * model.new_cache(64, dtype, **options).nbytes)


def test_cache_bytes_by_hand(model):
    # 6 layers x 2 KV heads x 16 values, K and V, per position:
    fp32 = model.new_cache(64).nbytes
    assert fp32 == 64 * 6 * 2 * (2 * 16 * 4)
    # int8 with a scale per head: 16 one-byte codes + one 4-byte scale = 20 of 64 bytes
    assert model.new_cache(64, "int8").nbytes * 64 == fp32 * 20
    # int4 (group 16 here, since 32 does not divide 16): 8 bytes + scale + zero = 16 of 64
    assert model.new_cache(64, "int4").nbytes * 4 == fp32
    # a window of 8 adds K and V float32 rows once per cache: 2 x 6 x 8 x 32 x 4 bytes
    assert (model.new_cache(64, "int4", window=8).nbytes
            == model.new_cache(64, "int4").nbytes + 2 * 6 * 8 * 32 * 4)


@pytest.mark.parametrize("options", [dict(dtype="fp32"), dict(dtype="int8"),
                                     dict(dtype="int4", group=4),
                                     dict(key_format="int8", value_format="fp8", window=5)],
                         ids=str)
def test_pool_nbytes_formula(model, options):
    c = model.config
    fmt = model.cache_format(**options)
    pool = model.new_paged_pool(num_blocks=10, block_size=4, max_seqs=3, **options)
    kv_dim = c.n_kv_heads * c.head_dim
    assert pool.nbytes == (c.n_layers * 10 * 4 * fmt.row_bytes(c.n_kv_heads, c.head_dim)
                           + 3 * 2 * c.n_layers * fmt.window * kv_dim * 4)
    assert pool.window == fmt.window and pool.key_format == fmt.key


# ---- 5. the residual window -------------------------------------------------------------------

def test_window_covering_everything_is_exact(model, prompt, fp32_logits):
    # Every read falls inside the window, so the int4 codes are never read at all.
    cache = model.new_cache(48, "int4", window=48)
    logits = model.prefill(prompt, cache, all_logits=True)
    assert np.array_equal(logits, fp32_logits)
    exact = model.new_cache(48)
    model.prefill(prompt, exact)
    for token in (5, 77, 101):
        assert np.array_equal(model.decode(token, cache), model.decode(token, exact))
    assert np.array_equal(cache.dequantized()[0], exact.keys)


@pytest.mark.parametrize("chunks", [(40,), (13, 1, 1, 1, 1, 1, 1, 1, 20), (3, 9, 28)],
                         ids=lambda c: "+".join(map(str, c)))
def test_window_rows_are_exact_and_older_rows_round_trip(model, prompt, chunks):
    # Chunks of every size make the ring of window rows wrap around at odd places.
    window = 8
    cache = model.new_cache(64, "int4", group=4, window=window)
    exact = model.new_cache(64)
    start = 0
    for n in chunks:
        model.prefill(prompt[start:start + n], cache)
        start += n
    model.prefill(prompt, exact)
    keys, values = cache.dequantized()
    for got, rows in ((keys[0], exact.keys[0]), (values[0], exact.values[0])):
        assert np.array_equal(got[-window:], rows[-window:])
        old = quant.dequantize(quant.quantize(rows[:-window], "int4", 4))
        assert np.array_equal(got[:-window], old)
        assert not np.array_equal(got[:-window], rows[:-window])


def test_window_truncate_only_resets(model, prompt):
    cache = model.new_cache(64, "int8", window=4)
    model.prefill(prompt[:10], cache)
    with pytest.raises(ValueError, match="window"):
        cache.truncate(5)
    assert cache.length == 10
    cache.truncate(10)                     # a no-op is allowed
    cache.truncate(0)
    assert cache.length == 0
    # after the reset it behaves like a new cache
    assert np.array_equal(model.prefill(prompt[:10], cache, all_logits=True),
                          model.prefill(prompt[:10], model.new_cache(64, "int8", window=4),
                                        all_logits=True))


def test_forked_sequence_with_a_window_continues_like_its_parent(model, prompt):
    options = dict(dtype="int4", window=6)
    pool = model.new_paged_pool(num_blocks=40, block_size=4, **options)
    parent = pool.new_sequence()
    model.prefill(prompt[:10], parent)           # ends mid-block: the fork shares it
    child = pool.fork(parent)
    assert np.array_equal(model.decode(prompt[10], parent), model.decode(prompt[10], child))

    # then they diverge; each must match a contiguous cache that took its path alone
    for seq, tail in ((child, [3, 99, 45, 200, 17, 8, 61]), (parent, prompt[11:18])):
        alone = model.new_cache(64, **options)
        model.prefill(prompt[:11], alone)
        for token in tail:
            assert np.array_equal(model.decode(int(token), seq), model.decode(int(token), alone))
        for want, got in zip(alone.dequantized(), pool.gather(seq)):
            assert np.array_equal(want, got)
    pool.check()


def test_window_pool_never_reuses_prefixes(model, prompt):
    # A cached block holds codes only; the window rows a reader needs are gone with the
    # sequence that wrote them, so a window pool must not hand blocks over.
    for window, expected in ((0, 36), (4, 0)):
        pool = model.new_paged_pool(num_blocks=32, block_size=4, dtype="int8", window=window)
        first = pool.new_sequence()
        model.prefill(prompt, first)             # 10 full blocks
        pool.free(first)
        second = pool.new_sequence()
        assert pool.reuse_prefix(second, np.array(prompt[:37], dtype=np.int32)) == expected
        assert second.length == expected
        # and a window pool does not even keep them: they could never be handed out
        assert pool.stats().blocks_cached == (0 if window else 1)
        pool.check()
    # the window pool's sequence starts empty and computes the same logits afresh
    assert np.array_equal(model.prefill(prompt, second, all_logits=True),
                          model.prefill(prompt, model.new_cache(64, "int8", window=4),
                                        all_logits=True))


# ---- 6. generation ----------------------------------------------------------------------------

def greedy(model, prompt, cache, n_new):
    """Greedy generation over any cache: a prefill, then decode steps."""
    token = int(np.argmax(model.prefill(prompt, cache)))
    out = [token]
    for _ in range(n_new - 1):
        token = int(np.argmax(model.decode(token, cache)))
        out.append(token)
    return out


def test_greedy_loop_matches_kvlab_generate_on_fp32(model, prompt):
    # kvlab.generate makes its own fp32 cache; our loop must be the same greedy loop
    want = kvlab.generate(model, prompt[:12], max_new_tokens=30, stop_at_eos=False).tokens
    assert greedy(model, prompt[:12], model.new_cache(64), 30) == want


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_greedy_generation_on_contiguous_and_paged_caches(model, prompt, dtype):
    n_new = 30
    contiguous = greedy(model, prompt[:12], model.new_cache(64, dtype), n_new)
    pool = model.new_paged_pool(num_blocks=16, block_size=4, dtype=dtype)
    seq = pool.new_sequence()
    paged = greedy(model, prompt[:12], seq, n_new)
    assert len(contiguous) == n_new
    assert all(0 <= t < model.config.vocab_size for t in contiguous)
    assert paged == contiguous                  # same codes, same arithmetic
    assert seq.length == 12 + n_new - 1         # the last token is never fed back
    assert isinstance(model.decode_text(contiguous), str)
    pool.check()


# ---- 7. attend() ------------------------------------------------------------------------------

def numpy_attend(q, keys, values):
    """One query token over (positions, n_kv_heads, head_dim): GQA softmax attention."""
    n_heads, head_dim = q.shape
    group = n_heads // keys.shape[1]
    out = np.empty_like(q, dtype=np.float64)
    for h in range(n_heads):
        k, v = keys[:, h // group].astype(np.float64), values[:, h // group].astype(np.float64)
        scores = k @ q[h].astype(np.float64) / np.sqrt(head_dim)
        weights = np.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ v
    return out


@pytest.mark.parametrize("options", [dict(dtype="int8"), dict(dtype="int4", group=4, window=5),
                                     dict(key_format="fp8", value_format="bf16")], ids=str)
def test_attend_equals_numpy_over_dequantized_rows(model, options):
    c = model.config
    cache = model.new_cache(32, **options)
    keys, values = random_rows(20, c, seed=1)
    cache.append(keys, values)
    deq_keys, deq_values = cache.dequantized()
    q = np.random.default_rng(2).standard_normal((c.n_heads, c.head_dim)).astype(np.float32)
    for layer in (0, 3, c.n_layers - 1):
        out = cache.attend(q, layer)
        assert out.shape == (c.n_heads, c.head_dim) and out.dtype == np.float32
        want = numpy_attend(q, deq_keys[layer], deq_values[layer])
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    # the default layer is 0, and attending changes nothing
    assert np.array_equal(cache.attend(q), cache.attend(q, layer=0))
    assert cache.length == 20


def test_attend_rejects_bad_queries(model):
    c = model.config
    cache = model.new_cache(8, "int8")
    q = np.zeros((c.n_heads, c.head_dim), dtype=np.float32)
    with pytest.raises(ValueError, match="empty"):
        cache.attend(q)
    cache.append(*random_rows(3, c))
    with pytest.raises(ValueError):
        cache.attend(np.zeros((c.n_heads, c.head_dim - 1), dtype=np.float32))
    with pytest.raises(ValueError):
        cache.attend(np.zeros((3, c.head_dim), dtype=np.float32))   # not a multiple of 2
    with pytest.raises(ValueError):
        cache.attend(np.zeros((c.n_heads * c.head_dim,), dtype=np.float32))
    with pytest.raises(TypeError):
        cache.attend(q.astype(np.float64))
    with pytest.raises(TypeError):
        cache.attend(q.tolist())
    for layer in (c.n_layers, -1):
        with pytest.raises(IndexError):
            cache.attend(q, layer)


# ---- 8. errors --------------------------------------------------------------------------------

BAD_FORMATS = [
    (dict(dtype="int3"), "unknown cache format"),
    (dict(dtype="fp64"), "unknown cache format"),
    (dict(key_format="int3"), "unknown cache format"),
    (dict(dtype="int8", group=5), "divide"),
    (dict(dtype="fp8", group=3), "divide"),
    (dict(dtype="int4", group=1), "even"),
    (dict(dtype="int4", value_group=32), "divide"),
    (dict(dtype="fp16", key_group=4), "has no groups"),
    (dict(dtype="fp16", group=4), "has no groups"),     # a group no side can use
    (dict(dtype="fp32", group=5), "has no groups"),
    (dict(dtype="fp32", value_group=16), "has no groups"),
    (dict(dtype="int8", key_format="bf16", key_group=2), "has no groups"),
    (dict(dtype="int8", window=-1), "window"),
]


@pytest.mark.parametrize("options, match", BAD_FORMATS, ids=str)
def test_bad_formats_are_refused_by_caches_and_pools(model, options, match):
    with pytest.raises(ValueError, match=match):
        model.new_cache(16, **options)
    with pytest.raises(ValueError, match=match):
        model.new_paged_pool(num_blocks=4, block_size=4, **options)
    with pytest.raises(ValueError, match=match):
        kvlab.kv_cache_bytes(model.config, 16, **{"dtype": "fp32", **options})


def test_group_applies_to_the_side_that_has_groups(model):
    # documented: `group` sets whichever of K and V is grouped; an explicit key_group or
    # value_group on a float side is an error (above)
    cache = model.new_cache(8, key_format="int8", value_format="fp16", group=4)
    assert (cache.key_group, cache.value_group) == (4, 0)
    assert cache.key_scales.shape[-1] == 4 and cache.value_scales is None
    cache = model.new_cache(8, key_format="bf16", value_format="int4")
    assert (cache.key_group, cache.value_group) == (0, 16)     # int4 default: 32 > head_dim


@pytest.mark.parametrize("kwargs", [dict(key_format="int3"), dict(value_format="fp64"),
                                    dict(key_format="int8", key_group=5),
                                    dict(value_format="int4", value_group=1),
                                    dict(key_format="fp16", key_group=4),
                                    dict(window=-1), dict(window=9)], ids=str)
def test_the_core_constructor_checks_formats_too(kwargs):
    # Python checks first; the C core must refuse on its own when called directly.
    with pytest.raises(ValueError):
        kvlab.KVCache(6, 2, 16, 8, **kwargs)


def test_window_longer_than_the_cache_is_refused(model):
    with pytest.raises(ValueError, match="window"):
        model.new_cache(8, "int8", window=9)
    with pytest.raises(ValueError, match="window"):   # the formula agrees with the cache
        kvlab.kv_cache_bytes(model.config, 8, dtype="int8", window=9)
    assert model.new_cache(8, "int8", window=8).window == 8


@pytest.mark.parametrize("options", [dict(dtype="int4"), dict(dtype="int8", window=4),
                                     dict(key_format="fp8", value_format="int4", group=8)],
                         ids=str)
def test_failed_calls_leave_a_quantized_cache_unchanged(model, prompt, options):
    cache = model.new_cache(10, **options)
    model.prefill(prompt[:8], cache)
    stored, seen = code_arrays(cache), cache.dequantized()

    def unchanged():
        assert cache.length == 8
        for name, array in code_arrays(cache).items():
            assert (array is None) == (stored[name] is None) and (
                array is None or np.array_equal(array, stored[name])), name
        for want, got in zip(seen, cache.dequantized()):
            assert np.array_equal(want, got)

    with pytest.raises(kvlab.CacheFullError):
        model.prefill(prompt[8:11], cache)
    unchanged()
    with pytest.raises(kvlab.CacheFullError):
        cache.append(*random_rows(3, model.config))
    unchanged()
    with pytest.raises(ValueError):
        model.prefill([1, 2, 256], cache)           # a token out of the vocabulary
    unchanged()
    # the two free slots still work, and the next token is full again
    model.prefill(prompt[8:10], cache)
    assert cache.length == 10
    with pytest.raises(kvlab.CacheFullError):
        model.decode(1, cache)


# ---- 9. append() round trips ------------------------------------------------------------------

@pytest.mark.parametrize("fmt, group", [("fp16", None), ("bf16", None), ("int8", None),
                                        ("int8", 4), ("int4", None), ("int4", 2),
                                        ("fp8", None), ("fp8", 8)])
def test_append_round_trips_within_the_bound(model, fmt, group):
    c = model.config
    cache = model.new_cache(32, fmt, **({} if group is None else {"group": group}))
    keys, values = random_rows(11, c, seed=3, scale=4.0)
    cache.append(keys[:4], values[:4])
    cache.append(keys[4:], values[4:])
    got_keys, got_values = cache.dequantized()
    for rows, got in ((keys, got_keys), (values, got_values)):
        rows = rows.transpose(1, 0, 2, 3)         # -> (n_layers, n_tokens, ...)
        assert got.shape == rows.shape
        assert np.all(np.abs(got - rows) <= quant.round_trip_error_bound(rows, fmt, group))
        # and the codes are exactly kvlab.quant's for every layer, not just close
        assert np.array_equal(got, quant.dequantize(quant.quantize(rows, fmt, group)))
    assert not np.array_equal(got_keys, keys.transpose(1, 0, 2, 3))   # it is lossy


def test_append_with_a_window_keeps_the_last_rows_exact(model):
    c = model.config
    cache = model.new_cache(32, "int4", window=5)
    keys, values = random_rows(12, c, seed=4)
    for start, stop in ((0, 3), (3, 4), (4, 12)):
        cache.append(keys[start:stop], values[start:stop])
    got_keys, _ = cache.dequantized()
    rows = keys.transpose(1, 0, 2, 3)
    assert np.array_equal(got_keys[:, -5:], rows[:, -5:])
    assert np.array_equal(got_keys[:, :-5], quant.dequantize(quant.quantize(rows[:, :-5], "int4")))
