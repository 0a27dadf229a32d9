"""Public self-checks for lab 9 (int8 cache): `kvlab check int8_cache int8_cache.py`.

Cases you can check by hand. The grade comes from hidden tests: random inputs with
outliers, zeros, tiny and huge values compared bit for bit with kvlab's codes and with the
codes a real int8 cache stores, the error bound, bytes per token and int8 attention.
"""
import numpy as np

import kvlab
from kvlab.grading.remote import RemoteError
from kvlab.grading.testkit import as_array, bundled_model, config_record, described, points


@points(1)
def test_a_group_whose_scale_is_one(sub, rng):
    """max |x| = 127 gives scale 1, so the codes are x rounded, halves to even"""
    x = np.array([[127, 0.5, 1.5, 2.5, -2.5, 3.4, -127, 0]], np.float32)
    codes, scales = sub.quantize_int8(x, 8)
    codes = as_array(codes, "codes", shape=(1, 8))
    want = np.array([[127, 0, 2, 2, -2, 3, -127, 0]])
    assert np.array_equal(codes, want), f"expected codes {want.tolist()}, got {codes.tolist()}"
    scales = as_array(scales, "scales", shape=(1, 1))
    assert scales[0, 0] == 1.0, f"expected scale 1.0, got {float(scales[0, 0])!r}"


@points(1)
def test_an_all_zero_group(sub, rng):
    """zeros: scale 0 and codes 0, without dividing 0 by 0"""
    try:
        codes, scales = sub.quantize_int8.call((np.zeros((1, 4), np.float32), 4), {},
                                               numpy_errors={"divide": "raise", "invalid": "raise"})
    except RemoteError as error:
        if not error.is_a("FloatingPointError"):
            raise
        raise AssertionError(f"quantize_int8 divided by zero ({error.message}): an all-zero group "
                             f"has scale 0; divide it by 1 instead") from None
    codes, scales = as_array(codes, "codes", shape=(1, 4)), as_array(scales, "scales", shape=(1, 1))
    assert not codes.any() and scales[0, 0] == 0, (
        f"expected codes [0, 0, 0, 0] and scale 0, got {codes.tolist()} and {scales.tolist()}")


@points(1)
def test_dequantize_multiplies_by_the_scale(sub, rng):
    """codes [2, -4] with scale 0.5 stand for [1, -2]"""
    got = sub.dequantize_int8(np.array([[2, -4]], np.int8), np.array([[0.5]], np.float32), 2)
    got = as_array(got, "dequantize_int8", shape=(1, 2))
    assert np.array_equal(got, [[1.0, -2.0]]), f"expected [[1.0, -2.0]], got {got.tolist()}"


@points(1)
def test_bytes_per_token_of_the_bundled_model(sub, rng):
    """the bundled model (6 layers, 2 KV heads of 16), groups of 16: codes and scales"""
    config = bundled_model().config
    got = sub.int8_bytes_per_token(config_record(config), 16)
    want = kvlab.kv_bytes_per_token(config, "int8", group=16)
    codes_only = 2 * config.n_layers * config.kv_dim
    hint = " (did you forget the float32 scales?)" if got == codes_only else ""
    assert got == want, f"expected {want:,} B, got {described(got)}{hint}"
