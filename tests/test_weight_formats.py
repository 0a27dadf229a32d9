"""kvlab.weight_formats (NumPy) and the core's products over weights in fewer bytes
(kvlab._kvlab.matmul): each format's product is the float32 product over its dequantized
values, bit for bit, on both kernel tiers; Q8_0 and bf16 bytes are GGUF's own."""
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
    if fmt == "q8_0" and in_dim % 32:
        pytest.skip("q8_0 rows are whole blocks of 32")
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


@pytest.mark.parametrize("call, error", [
    (lambda x, c: core.matmul(x, c, "int4"), ValueError),
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
    with pytest.raises(ValueError, match="blocks of 32"):
        wf.quantize(np.zeros((2, 40), np.float32), "q8_0")
    with pytest.raises(ValueError, match="weight format"):
        wf.row_bytes("int4", 64)
    with pytest.raises(ValueError, match="2-D"):
        wf.quantize(np.zeros(8, np.float32), "fp16")


@pytest.mark.parametrize("n_tokens", [1, 2, 5])
def test_int8_activations_follow_their_numpy_definition(tiers, n_tokens):
    """Q8_0 weights against int8 activations (llama.cpp's way) are not the float32 product,
    so they have their own spec: kvlab.weight_formats.matmul_int8, bit for bit, both tiers;
    and within a rounding of x of the float32 product."""
    rng = np.random.default_rng(n_tokens)
    codes = wf.quantize(random_matrix(rng, 41, 128), "q8_0")
    x = (rng.standard_normal((n_tokens, 128)) * 3).astype(np.float32)
    x[0, :32] = 0.0                               # a block of zeros: a scale of 0
    want = wf.matmul_int8(x, codes, 128)
    for tier in tiers:
        core.set_kernels(tier)
        np.testing.assert_array_equal(core.matmul(x, codes, "q8_0", "int8"), want)
    exact = core.matmul(x, codes, "q8_0")
    assert np.abs(want - exact).max() <= 0.02 * np.abs(exact).max()


def test_int8_activations_only_with_q8_0():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="q8_0"):
        core.matmul(x, wf.quantize(random_matrix(rng, 4, 64), "fp16"), "fp16", "int8")
    with pytest.raises(ValueError, match="activations"):
        core.matmul(x, wf.quantize(random_matrix(rng, 4, 64), "q8_0"), "q8_0", "int4")
