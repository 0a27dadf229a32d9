"""kvlab.weight_formats (NumPy) and the core's products over weights in fewer bytes
(kvlab._kvlab.matmul): each format's product is the float32 product over its dequantized
values, bit for bit, on both kernel tiers; Q8_0, Q4_0, Q4_1 and bf16 bytes are GGUF's own;
the int8-activation products of the block formats follow their NumPy spec bit for bit."""
import numpy as np
import pytest

from kvlab import weight_formats as wf
from kvlab._core import core


@pytest.fixture
def tiers():
    before = core.get_kernels()
    yield ("fast", "plain")
    core.set_kernels(before)


def random_matrix(rng, out_dim, in_dim):
    scales = rng.uniform(0.01, 3.0, (out_dim, 1))
    w = (rng.standard_normal((out_dim, in_dim)) * scales).astype(np.float32)
    w[0, :32] = 0.0                              # an all-zero block: a scale of 0
    return w


@pytest.mark.parametrize("fmt", wf.FORMATS)
@pytest.mark.parametrize("in_dim", [64, 70, 256])
@pytest.mark.parametrize("n_tokens", [1, 3, 4, 19])
def test_the_product_is_float32s_over_the_dequantized_weights(tiers, fmt, in_dim, n_tokens):
    if fmt in wf.BLOCK_FORMATS and in_dim % 32:
        pytest.skip(f"{fmt} rows are whole blocks of 32")
    rng = np.random.default_rng(in_dim * 10 + n_tokens)
    codes = wf.quantize(random_matrix(rng, 37, in_dim), fmt)
    values = np.ascontiguousarray(wf.dequantize(codes, fmt, in_dim))
    x = rng.standard_normal((n_tokens, in_dim)).astype(np.float32)
    for tier in tiers:
        core.set_kernels(tier)
        want = core.matmul(x, values, "fp32")
        np.testing.assert_array_equal(core.matmul(x, codes, fmt), want)
    np.testing.assert_allclose(want, x @ values.T, rtol=1e-4, atol=1e-4)


def test_row_bytes_and_the_round_trip():
    rng = np.random.default_rng(0)
    w = random_matrix(rng, 5, 64)
    assert wf.row_bytes("q8_0", 64) == 68 and wf.row_bytes("bf16", 70) == 140
    assert wf.quantize(w, "q8_0").shape == (5, 68) and wf.bytes_per_weight("q8_0") == 34 / 32
    np.testing.assert_array_equal(wf.dequantize(wf.quantize(w, "fp32"), "fp32", 64), w)
    np.testing.assert_allclose(wf.dequantize(wf.quantize(w, "fp16"), "fp16", 64), w, rtol=1e-3)
    # Q8_0: within half a step of its block's scale
    back = wf.dequantize(wf.quantize(w, "q8_0"), "q8_0", 64)
    step = np.abs(w.reshape(5, 2, 32)).max(-1, keepdims=True) / 127
    assert (np.abs(back - w).reshape(5, 2, 32) <= 0.5 * step * 1.01 + 1e-8).all()
    # Q4_0 and Q4_1: 18 and 20 bytes a block of 32
    assert wf.row_bytes("q4_0", 64) == 36 and wf.row_bytes("q4_1", 64) == 40
    assert wf.bytes_per_weight("q4_0") == 18 / 32 and wf.bytes_per_weight("q4_1") == 20 / 32
    assert wf.quantize(w, "q4_0").shape == (5, 36) and wf.quantize(w, "q4_1").shape == (5, 40)
    # Q4_1: within half a step (max - min) / 15, plus the half rounding of d and m
    back = wf.dequantize(wf.quantize(w, "q4_1"), "q4_1", 64).reshape(5, 2, 32)
    blocks = w.reshape(5, 2, 32)
    step = (blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)) / 15
    assert (np.abs(back - blocks) <= 0.5 * step * 1.05 + 2e-3 * np.abs(blocks).max()).all()


def test_q4_nibbles_lie_where_gguf_puts_them():
    """Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one;
    Q4_0's value is d * (q - 8), Q4_1's d * q + m."""
    row = np.zeros((1, 18), np.uint8)
    row[0, :2] = np.array([0.5], "<f2").view(np.uint8)
    row[0, 2 + 3] = 0x9 | (0xF << 4)               # weight 3: 9, weight 19: 15
    values = wf.dequantize(row, "q4_0", 32)[0]
    assert values[3] == 0.5 and values[19] == 3.5 and values[0] == -4.0
    row1 = np.zeros((1, 20), np.uint8)
    row1[0, :4] = np.array([0.25, -1.0], "<f2").view(np.uint8)
    row1[0, 4 + 15] = 0x2 | (0x7 << 4)            # weight 15: 2, weight 31: 7
    values = wf.dequantize(row1, "q4_1", 32)[0]
    assert values[15] == -0.5 and values[31] == 0.75 and values[1] == -1.0


def test_the_bytes_are_ggufs_own():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    kinds = gguf.GGMLQuantizationType
    rng = np.random.default_rng(1)
    w = random_matrix(rng, 16, 256)
    ours = wf.quantize(w, "q8_0")
    np.testing.assert_array_equal(ours, quantize(w, kinds.Q8_0))
    np.testing.assert_array_equal(wf.dequantize(ours, "q8_0", 256), dequantize(ours, kinds.Q8_0))
    np.testing.assert_array_equal(wf.quantize(w, "bf16"),
                                  quantize(w, kinds.BF16).view(np.uint8).reshape(16, -1))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_q4_bytes_are_ggufs_own(fmt):
    """quantize() writes what the gguf package's reference quantizer writes, byte for byte,
    and dequantize() reads them as its dequantizer does, bit for bit: all-zero and
    all-equal blocks, a lone large value of either sign, and values on a code's edge too."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    kind = gguf.GGMLQuantizationType[fmt.upper()]
    rng = np.random.default_rng(4)
    w = random_matrix(rng, 24, 256)
    w[1, 32:64] = 1.25                             # all equal: d = 0 for Q4_1
    w[2, :32] = 0.0
    w[2, 5] = -3.0                                  # the largest magnitude is negative
    w[3, :32] = np.arange(32, dtype=np.float32) / 2 - 8   # values on code boundaries
    w[4, :] *= 1e-5                                 # d a subnormal half
    w[5, :] *= 3e3                                  # and a large one
    ours = wf.quantize(w, fmt)
    np.testing.assert_array_equal(ours, quantize(w, kind).view(np.uint8).reshape(24, -1))
    np.testing.assert_array_equal(wf.dequantize(ours, fmt, 256), dequantize(ours, kind))


@pytest.mark.parametrize("call, error", [
    (lambda x, c: core.matmul(x, c, "int4"), ValueError),
    (lambda x, c: core.matmul(x[:, :48], c[:, :27], "q4_0"), ValueError),   # in_dim 48
    (lambda x, c: core.matmul(x, c[:, :36], "q4_1"), ValueError),        # q4_0's row bytes
    (lambda x, c: core.matmul(x, c[:, :40], "q4_0", "int8"), ValueError),  # q4_1's
    (lambda x, c: core.matmul(x[:, :40], c[:, :30], "q4_1", "int8"), ValueError),
    (lambda x, c: core.matmul(x[:, :60], c, "q8_0"), ValueError),       # not whole blocks
    (lambda x, c: core.matmul(x, c[:, :-1], "q8_0"), ValueError),        # row bytes wrong
    (lambda x, c: core.matmul(x.astype(np.float64), c, "q8_0"), TypeError),
    (lambda x, c: core.matmul(x, c.view(np.int8), "q8_0"), TypeError),
    (lambda x, c: core.matmul(x, c[:0], "q8_0"), ValueError),            # no rows
])
def test_bad_arguments_are_named(call, error):
    rng = np.random.default_rng(2)
    codes = wf.quantize(random_matrix(rng, 4, 64), "q8_0")
    with pytest.raises(error):
        call(rng.standard_normal((2, 64)).astype(np.float32), codes)


def test_the_numpy_side_refuses_what_it_cannot_store():
    for fmt in wf.BLOCK_FORMATS:
        with pytest.raises(ValueError, match="blocks of 32"):
            wf.quantize(np.zeros((2, 40), np.float32), fmt)
    with pytest.raises(ValueError, match="blocks of 32"):
        wf.empty((3, 40), "q4_1")
    with pytest.raises(ValueError, match="rows of 64 weights are 36 bytes"):
        wf.dequantize(np.zeros((2, 40), np.uint8), "q4_0", 64)
    with pytest.raises(ValueError, match="int8 activations"):
        wf.matmul_int8(np.zeros((1, 64), np.float32), np.zeros((2, 128), np.uint8), 64, "fp16")
    with pytest.raises(ValueError, match="weight format"):
        wf.row_bytes("int4", 64)
    with pytest.raises(ValueError, match="2-D"):
        wf.quantize(np.zeros(8, np.float32), "fp16")


@pytest.mark.parametrize("fmt", wf.BLOCK_FORMATS)
@pytest.mark.parametrize("n_tokens, out_dim", [(1, 41), (2, 41), (3, 38), (5, 41), (16, 43)])
def test_int8_activations_follow_their_numpy_definition(tiers, fmt, n_tokens, out_dim):
    """Block-format weights against int8 activations (llama.cpp's way) are not the float32
    product, so they have their own spec: kvlab.weight_formats.matmul_int8, bit for bit,
    both tiers, for 1, 2, 3 and many tokens (the fast tier takes tokens four, then two at a time) and
    out_dims that are not multiples of 4 (its last rows one at a time); and within a
    rounding of x of the float32 product."""
    rng = np.random.default_rng(n_tokens * 7 + out_dim)
    codes = wf.quantize(random_matrix(rng, out_dim, 128), fmt)
    x = (rng.standard_normal((n_tokens, 128)) * 3).astype(np.float32)
    x[0, :32] = 0.0                               # a block of zeros: a scale of 0
    want = wf.matmul_int8(x, codes, 128, fmt)
    for tier in tiers:
        core.set_kernels(tier)
        np.testing.assert_array_equal(core.matmul(x, codes, fmt, "int8"), want)
    exact = core.matmul(x, codes, fmt)
    assert np.abs(want - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("fmt", wf.BLOCK_FORMATS)
@pytest.mark.parametrize("n_tokens, out_dim", [(1, 41), (2, 41), (5, 41), (9, 300)])
def test_int8_activations_that_are_not_finite_or_tiny(tiers, fmt, n_tokens, out_dim):
    """A block of activations holding NaN or inf has no int8 codes: its products are NaN,
    as float32's would be (not a finite number made of undefined conversions); a block
    whose scale's inverse overflows (amax below about 4e-37) gives codes of 0. Both tiers
    as the spec, bit for bit, also where the products run in parallel (9 x 300)."""
    rng = np.random.default_rng(n_tokens + out_dim)
    codes = wf.quantize(random_matrix(rng, out_dim, 128), fmt)
    x = rng.standard_normal((n_tokens, 128)).astype(np.float32)
    x[0, 5] = np.nan                              # block 0 of the first token
    x[-1, 40] = np.inf                            # block 1 of the last
    x[-1, 64:96] = 0.0
    x[-1, 65], x[-1, 66] = 3e-37, -1e-37          # block 2: a scale of about 2e-39
    want = wf.matmul_int8(x, codes, 128, fmt)
    assert np.isnan(want[0]).all() and np.isnan(want[-1]).all()
    if n_tokens > 2:
        assert np.isfinite(want[1:-1]).all()      # the other tokens are not touched
    for tier in tiers:
        core.set_kernels(tier)
        np.testing.assert_array_equal(core.matmul(x, codes, fmt, "int8"), want)
    tiny = x[-1:].copy()
    tiny[0, 40] = 0.0                             # the tiny block alone: it adds 0
    no_block = tiny.copy()
    no_block[0, 64:96] = 0.0
    for tier in tiers:
        core.set_kernels(tier)
        np.testing.assert_array_equal(core.matmul(tiny, codes, fmt, "int8"),
                                      core.matmul(no_block, codes, fmt, "int8"))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_int8_q4_takes_every_code(tiers, fmt):
    """Random bytes: every nibble 0 .. 15 against codes up to +-127, with any d and m (no
    quantizer's choices), still the spec's bits on both tiers."""
    rng = np.random.default_rng(5)
    blocks = np.zeros((9, 4), wf._DTYPES[fmt])
    blocks["qs"] = rng.integers(0, 256, blocks["qs"].shape)
    blocks["d"] = rng.uniform(-0.1, 0.1, blocks.shape)
    if fmt == "q4_1":
        blocks["m"] = rng.uniform(-1, 1, blocks.shape)
    codes = blocks.view(np.uint8).reshape(9, -1)
    x = (rng.standard_normal((4, 128)) * 5).astype(np.float32)
    want = wf.matmul_int8(x, codes, 128, fmt)
    for tier in tiers:
        core.set_kernels(tier)
        np.testing.assert_array_equal(core.matmul(x, codes, fmt, "int8"), want)


def test_int8_activations_only_with_block_formats():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="q8_0, q4_0 or q4_1"):
        core.matmul(x, wf.quantize(random_matrix(rng, 4, 64), "fp16"), "fp16", "int8")
    with pytest.raises(ValueError, match="activations"):
        core.matmul(x, wf.quantize(random_matrix(rng, 4, 64), "q8_0"), "q8_0", "int4")
