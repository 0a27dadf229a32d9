"""kvlab.quant: the NumPy reference of the cache formats (the C core will match its codes)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlab import quant


def rows(seed=0, shape=(5, 3, 64), scale=2.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


@pytest.mark.parametrize("fmt, group", [("fp32", None), ("fp16", None), ("bf16", None),
                                        ("int8", None), ("int8", 16), ("int4", 32),
                                        ("int4", 64)])
def test_round_trip_within_the_bound(fmt, group):
    x = rows()
    q = quant.quantize(x, fmt, group)
    back = quant.dequantize(q)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.all(np.abs(back - x) <= quant.round_trip_error_bound(x, fmt, group))


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, (4, 16), elements=st.floats(-1e4, 1e4, width=32)),
       st.sampled_from([("int8", 16), ("int8", 4), ("int4", 16), ("int4", 8), ("fp16", None),
                        ("bf16", None), ("fp8", 16), ("fp8", 4)]))
def test_round_trip_bound_holds_for_any_values(x, fmt_group):
    fmt, group = fmt_group
    back = quant.dequantize(quant.quantize(x, fmt, group))
    bound = quant.round_trip_error_bound(x, fmt, group)
    if fmt == "fp16":       # beyond fp16's range values saturate to inf: not a cache value
        keep = np.abs(x) < 6e4
        x, back, bound = x[keep], back[keep], bound[keep]
    assert np.all(np.abs(back - x) <= bound + 1e-30)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_round_trip_bound_holds_below_the_smallest_normal(fmt):
    # Found by hypothesis in CI: 2.2e-8 rounds to 0 in fp16 (subnormal spacing 2**-24), and
    # the bound must be half that spacing, not half of a smaller, made-up one.
    tiny = np.float32(2.0 ** -14) if fmt == "fp16" else np.finfo(np.float32).tiny
    x = np.array([[2.2060664e-08, 2.9e-8, 3.1e-8, -1e-7, tiny, tiny / 3, 0.0, 1e-45] * 2],
                 dtype=np.float32)
    back = quant.dequantize(quant.quantize(x, fmt))
    assert np.all(np.abs(back - x) <= quant.round_trip_error_bound(x, fmt))


def test_codes_and_sizes():
    x = rows(shape=(2, 64))
    q8 = quant.quantize(x, "int8")
    assert q8.codes.dtype == np.int8 and q8.scales.shape == (2, 1)
    assert np.abs(q8.codes).max() == 127                      # the largest value maps to 127
    q4 = quant.quantize(x, "int4", 32)
    assert q4.codes.shape == (2, 32) and q4.codes.dtype == np.uint8
    assert q4.scales.shape == q4.zeros.shape == (2, 2)
    assert q4.nbytes == 2 * 32 + 2 * 2 * 8
    assert quant.bytes_per_value("int8", 128) == 1 + 4 / 128
    assert quant.bytes_per_value("int4", 128, 32) == 0.5 + 8 / 32


def test_bf16_rounds_to_nearest_even_like_torch():
    torch = pytest.importorskip("torch")
    x = np.concatenate([rows(shape=(1000,)), np.array([1.00390625, 1.01171875, -0.0, np.inf],
                                                      dtype=np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(quant.bf16_round(x), want)


def test_all_zero_groups_are_exact():
    x = np.zeros((3, 32), dtype=np.float32)
    for fmt in ("int8", "int4", "fp8"):
        assert np.array_equal(quant.dequantize(quant.quantize(x, fmt)), x)


def test_e4m3_codes_cover_the_format():
    codes = np.arange(256, dtype=np.uint8)
    values = quant.e4m3_decode(codes)
    assert values[0x7E] == 448 and values[0xFE] == -448            # the largest finite value
    assert np.isnan(values[0x7F]) and np.isnan(values[0xFF])         # no infinity, one NaN each
    assert values[0x01] == 2.0 ** -9 and values[0x08] == 2.0 ** -6   # subnormal, smallest normal
    finite = ~np.isnan(values)
    assert np.array_equal(quant.e4m3_encode(values[finite]), codes[finite])   # exact round trip
    # saturation instead of overflow, and ties to even between neighbouring codes
    assert quant.e4m3_encode(np.array([1e6, -500.0], np.float32)).tolist() == [0x7E, 0xFE]
    assert quant.e4m3_encode(np.array([1.0625, 1.1875], np.float32)).tolist() == [0x38, 0x3A]


def test_fp8_keeps_relative_precision_where_int8_does_not():
    # one large value in a group: int8's uniform steps flush the small ones to zero, fp8's
    # exponent keeps them (the reason fp8 caches exist)
    x = np.array([[100.0] + [0.01 * (i + 1) for i in range(15)]], dtype=np.float32)
    int8_back = quant.dequantize(quant.quantize(x, "int8"))
    fp8_back = quant.dequantize(quant.quantize(x, "fp8"))
    assert np.all(int8_back[0, 1:5] == 0)
    assert np.all(np.abs(fp8_back[0, 1:] - x[0, 1:]) <= 0.07 * x[0, 1:])


@pytest.mark.parametrize("fmt, group, match", [("int3", None, "unknown"), ("int8", 5, "divide"),
                                               ("int4", 3, "even"), ("fp8", 7, "divide"),
                                               ("fp16", 16, "no groups")])
def test_bad_formats_and_groups(fmt, group, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(rows(shape=(2, 48)), fmt, group)


def test_default_groups():
    assert quant.check_format("int8", 128) == 128 and quant.check_format("fp8", 64) == 64
    assert quant.check_format("int4", 128) == 32 and quant.check_format("int4", 48) == 48
    assert quant.check_format("int8", 16, 0) == 16        # 0 means the default, as in C


# ---- the C core's conversions give the same codes, bit for bit ------------------------------

from kvlab import _kvlab  # noqa: E402

EDGES = np.array([0.0, -0.0, 1e-8, 2**-24, 3 * 2**-25, 2**-25, 6.0e-5, 6.1035e-5, 2**-14,
                  1.0009765625, 1.00048828125, 65504.0, 65519.9, 65520.0, 7e4, -3e38,
                  np.inf, -np.inf, 1.00390625, 1.01171875], dtype=np.float32)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_c_half_formats_match_numpy_on_edge_values(fmt):
    x = np.concatenate([EDGES, rows(shape=(1024,), scale=1e3), rows(shape=(1024,), scale=1e-5)])
    x = x.reshape(1, -1).astype(np.float32)
    codes, _, _ = _kvlab.quantize(x, fmt)    # fp16 codes come back as float16, bf16 as uint16
    with np.errstate(over="ignore"):
        assert np.array_equal(codes.view(np.uint16), quant.quantize(x, fmt).codes)


FORMAT_GROUPS = [("fp32", 0), ("fp16", 0), ("bf16", 0), ("int8", 32), ("int8", 8),
                 ("int4", 32), ("int4", 4), ("fp8", 32), ("fp8", 8)]


def assert_c_matches_numpy(x, fmt, group):
    """The core's store (csrc/store.c) holds the same codes as kvlab.quant, bit for bit,
    and decodes them to the same float32 values."""
    codes, scales, zeros = _kvlab.quantize(x, fmt, group)
    with np.errstate(over="ignore", invalid="ignore"):
        want = quant.quantize(x, fmt, group or None)
        back = quant.dequantize(want)
    assert codes.dtype == want.codes.dtype or fmt == "fp16"
    assert np.array_equal(codes.view(np.uint8), want.codes.view(np.uint8))
    assert (scales is None) == (want.scales is None) and (zeros is None) == (want.zeros is None)
    assert scales is None or np.array_equal(scales, want.scales)
    assert zeros is None or np.array_equal(zeros, want.zeros)
    assert np.array_equal(_kvlab.round_trip(x, fmt, group), back, equal_nan=True)


@settings(max_examples=80, deadline=None)
@given(arrays(np.float32, (3, 32), elements=st.floats(-1e5, 1e5, width=32)),
       st.sampled_from(FORMAT_GROUPS))
def test_c_codes_equal_numpy_codes(x, fmt_group):
    assert_c_matches_numpy(x, *fmt_group)


@pytest.mark.parametrize("fmt, group", FORMAT_GROUPS)
def test_c_codes_equal_numpy_codes_on_edge_values(fmt, group):
    # zeros, subnormals, values at rounding ties, one huge value per group, NaN-free
    x = np.concatenate([EDGES[np.isfinite(EDGES) & (np.abs(EDGES) < 6e4)],
                        np.zeros(15, np.float32), rows(shape=(161,), scale=1e-30)])
    x = np.concatenate([x, rows(shape=(3 * 32 - len(x) % 32,), scale=7.0)])
    assert_c_matches_numpy(x.reshape(-1, 32).astype(np.float32), fmt, group)


def test_c_quantize_rejects_bad_arguments():
    x = rows(shape=(2, 48))
    with pytest.raises(ValueError, match="unknown cache format"):
        _kvlab.quantize(x, "int3", 16)
    with pytest.raises(ValueError, match="divide"):
        _kvlab.quantize(x, "int8", 5)
    with pytest.raises(ValueError, match="even"):
        _kvlab.quantize(x, "int4", 3)
    with pytest.raises(ValueError, match="0 for float"):
        _kvlab.quantize(x, "fp16", 16)
    with pytest.raises(TypeError, match="float32"):
        _kvlab.quantize(x.astype(np.float64), "int8", 16)
