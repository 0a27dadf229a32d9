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
                        ("bf16", None)]))
def test_round_trip_bound_holds_for_any_values(x, fmt_group):
    fmt, group = fmt_group
    back = quant.dequantize(quant.quantize(x, fmt, group))
    bound = quant.round_trip_error_bound(x, fmt, group)
    if fmt == "fp16":       # beyond fp16's range values saturate to inf: not a cache value
        keep = np.abs(x) < 6e4
        x, back, bound = x[keep], back[keep], bound[keep]
    assert np.all(np.abs(back - x) <= bound + 1e-30)


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
    for fmt in ("int8", "int4"):
        assert np.array_equal(quant.dequantize(quant.quantize(x, fmt)), x)


@pytest.mark.parametrize("fmt, group, match", [("int3", None, "unknown"), ("int8", 5, "divide"),
                                               ("int4", 3, "even"), ("int8", 0, "divide")])
def test_bad_formats_and_groups(fmt, group, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(rows(shape=(2, 48)), fmt, group)
