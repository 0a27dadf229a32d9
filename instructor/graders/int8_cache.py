"""Hidden grading tests for lab 9 (int8 cache quantization). Each test says in its message
what it expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

Codes and scales are checked bit for bit against kvlab.quant (the NumPy specification) and
against what the C core stores in an int8 cache; the error bound against the round trip
and against kvlab.quant.round_trip_error_bound; the byte count against
kvlab.kv_bytes_per_token and a real cache's nbytes; int8 attention against cache.attend.
"""
import numpy as np

import kvlab
import kvlab.quant
from kvlab.grading.remote import RemoteError
from kvlab.grading.testkit import as_array, bundled_model, config_record, described, points

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def prepare():
    bundled_model()


def quantize(sub, x, group):
    """The submission's quantize_int8, where dividing 0 by 0 is an error, not a NaN."""
    try:
        return sub.quantize_int8.call((x, group), {}, numpy_errors={"divide": "raise",
                                                                   "invalid": "raise"})
    except RemoteError as error:
        if not error.is_a("FloatingPointError"):
            raise
        raise AssertionError(
            f"quantize_int8 divided by zero ({error.message}): an all-zero group has scale 0; "
            f"divide it by 1 instead, so that its codes are 0 and not NaN") from None


def index(at):
    return tuple(int(i) for i in at)


def differing(got, want):
    """How many entries differ, or why they cannot be compared."""
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"shape {got.shape} where {want.shape} was expected"
    return f"{np.sum(got != want)} of {want.size} differ"


def check_quantized(got, x, group, what):
    """got = (codes, scales) must equal kvlab.quant.quantize(x, "int8", group), bit for bit."""
    want = kvlab.quant.quantize(x, "int8", group)
    assert isinstance(got, (tuple, list)) and len(got) == 2, f"{what}: expected (codes, scales), got {type(got)}"
    codes, scales = np.asarray(got[0]), np.asarray(got[1])
    assert codes.dtype == np.int8 and codes.shape == x.shape, (
        f"{what}: expected int8 codes of shape {x.shape}, got {codes.dtype} of shape {codes.shape}")
    assert scales.dtype == np.float32 and scales.shape == want.scales.shape, (
        f"{what}: expected float32 scales of shape {want.scales.shape} (one per group of "
        f"{group}), got {scales.dtype} of shape {scales.shape}")
    bad = np.argwhere(scales != want.scales)
    if len(bad):
        at = index(bad[0])
        raise AssertionError(f"{what}: {len(bad)} scales differ; first at index {at}: expected "
                             f"{float(want.scales[at])!r}, got {float(scales[at])!r}")
    bad = np.argwhere(codes != want.codes)
    if len(bad):
        at = index(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {codes.size} codes differ; first at index {at} "
                             f"(x = {float(x[at])!r}, scale "
                             f"{float(want.scales[at[:-1] + (at[-1] // group,)])!r}): "
                             f"expected {want.codes[at]}, got {codes[at]}")


def hard_inputs(rng, shape=(6, 3, 32)):
    """Random rows with what breaks quantizers: outliers, all-zero groups, tiny and huge values."""
    x = rng.standard_normal(shape).astype(np.float32)
    half = shape[-1] // 2
    x[0, 0] = 0.0                                      # a whole row of zeros
    x[0, 1, :half] = 0.0                               # zero groups next to non-zero ones
    x[1] *= np.float32(1e30)                           # huge
    x[2] *= np.float32(1e-30)                          # tiny
    x[3, :, 5] = np.float32(500.0)                     # one outlier per row
    x[3, -1, -3] = np.float32(-8000.0)
    x[4, :, :half] *= np.float32(1e-4)                 # small and large groups in one row
    x[5, 1] = np.float32(1e-40)                        # subnormal numbers
    x[5, -1, ::3] = np.float32(-3e38)                  # near the largest float32
    return x


@points(3)
def test_quantize_matches_kvlab_quant(sub, rng):
    """codes and scales equal kvlab.quant.quantize(x, "int8", group) bit for bit"""
    for shape, groups in (((4, 3, 16), (16, 8, 4, 2, 1)), ((7, 64), (64, 32, 8)), ((2, 5, 2, 8), (8, 4))):
        x = (rng.standard_normal(shape) * rng.choice([0.01, 1.0, 30.0], size=shape[:-1] + (1,))).astype(np.float32)
        for group in groups:
            got = quantize(sub, x, group)
            check_quantized(got, x, group, f"x of shape {shape}, groups of {group}")


# Rows (found by search) where x * (1 / scale) rounds to another code than x / scale does.
DIVIDE_NOT_MULTIPLY = np.array([
    [0.0036860997788608074, 0.01702905260026455, 0.02902938984334469, -0.016679419204592705, 0.0014639870496466756, -0.013074840418994427, -0.013833712786436081, 0.0025268294848501682, -0.0009841255377978086, -0.012458053417503834, -0.000522714457474649, -0.0002282484929310158, 0.008940406143665314, -0.005269894376397133, -0.024951178580522537, -0.01367501076310873],
    [-24.145694732666016, 25.314464569091797, 3.1972625255584717, 8.005733489990234, 14.328344345092773, 25.813976287841797, 24.155672073364258, 44.745731353759766, 9.92466926574707, -6.256541728973389, 32.78572082519531, -4.354222297668457, 3.2424588203430176, 1.7552512884140015, 19.278667449951172, 52.74491882324219],
    [0.0025399161968380213, 0.014896762557327747, -0.009696769528090954, 0.008132043294608593, -0.008330310694873333, 0.0178824570029974, -0.020234106108546257, 0.0053880647756159306, -0.009052172303199768, 0.007024277001619339, -0.013300375081598759, 0.0005237217992544174, -0.007229790557175875, -0.002960476092994213, -0.0018702425295487046, 0.013004875741899014],
], dtype=np.float32)


@points(2)
def test_quantize_rounds_half_to_even_and_keeps_zero_groups_zero(sub, rng):
    """x / scale = 2.5 gives 2 (np.rint), an all-zero group codes 0 and scale 0, x / scale is divided"""
    halves = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5,
                        10.5, 126.5, -126.5, 0.0, 1.0, -7.0, 2.4999, 2.5001]],
                      dtype=np.float32)                # scale 127 / 127 = 1: x / scale is x
    got = quantize(sub, halves, 16)
    check_quantized(got, halves, 16, "a group whose scale is exactly 1 (halves round to even: "
                                     "0.5 -> 0, 1.5 -> 2, 2.5 -> 2)")
    zeros = np.zeros((2, 16), dtype=np.float32)
    zeros[1, 8:] = np.arange(1, 9, dtype=np.float32)   # a zero group beside a non-zero one
    got = quantize(sub, zeros, 8)
    check_quantized(got, zeros, 8, "all-zero groups (scale 0, codes 0)")
    got = quantize(sub, DIVIDE_NOT_MULTIPLY, 16)
    check_quantized(got, DIVIDE_NOT_MULTIPLY, 16, "rows where x * (1 / scale) rounds to another "
                                                  "code than x / scale (divide by the scale)")


@points(3)
def test_codes_match_the_c_int8_cache(sub, rng):
    """quantizing an fp32 cache's K and V gives the codes and scales an int8 cache stores"""
    model = bundled_model()
    tokens = model.encode(PROMPT)
    fp32 = model.new_cache(64)
    model.prefill(tokens, fp32)
    for group in (16, 8, 4, 1):
        int8 = model.new_cache(64, "int8", group=group)
        model.prefill(tokens, int8)
        # layer 0's K and V depend on the tokens only; later layers read quantized values
        for name, x, codes, scales in (("keys", fp32.keys[0], int8.key_codes[0], int8.key_scales[0]),
                                       ("values", fp32.values[0], int8.value_codes[0], int8.value_scales[0])):
            got_codes, got_scales = quantize(sub, np.asarray(x), group)
            assert np.array_equal(np.asarray(got_codes), codes) and np.array_equal(np.asarray(got_scales), scales), (
                f"the bundled model's layer-0 {name}, groups of {group}: your codes and scales differ "
                f"from the int8 cache's {name[:-1]}_codes[0] and {name[:-1]}_scales[0] (codes: "
                f"{differing(got_codes, codes)}; scales: {differing(got_scales, scales)})")
    x = hard_inputs(rng, shape=(12, 4, 16)).reshape(12, 2, 2, 16)   # (tokens, n_layers, n_kv_heads, head_dim)
    for group in (16, 4, 2):
        cache = kvlab.KVCache(2, 2, 16, 12, key_format="int8", value_format="int8",
                              key_group=group, value_group=group)
        cache.append(x, x[::-1].copy())
        got_codes, got_scales = quantize(sub, x.transpose(1, 0, 2, 3), group)
        assert np.array_equal(np.asarray(got_codes), cache.key_codes) and \
            np.array_equal(np.asarray(got_scales), cache.key_scales), (
                f"rows with outliers, zeros, tiny and huge values appended to an int8 cache (groups "
                f"of {group}): your codes or scales differ from cache.key_codes / key_scales, both "
                f"(n_layers, length, n_kv_heads, ...) (codes: {differing(got_codes, cache.key_codes)}; "
                f"scales: {differing(got_scales, cache.key_scales)})")


@points(2)
def test_dequantize_matches_the_c_cache(sub, rng):
    """dequantize_int8 gives what an int8 cache's attention reads (cache.dequantized())"""
    model = bundled_model()
    for group in (16, 4):
        cache = model.new_cache(64, "int8", group=group)
        model.prefill(model.encode(PROMPT), cache)
        keys, values = cache.dequantized()
        for name, codes, scales, want in (("keys", cache.key_codes, cache.key_scales, keys),
                                          ("values", cache.value_codes, cache.value_scales, values)):
            got = np.asarray(sub.dequantize_int8(codes, scales, group))
            assert got.dtype == np.float32 and got.shape == want.shape, (
                f"{name}, groups of {group}: expected float32 of shape {want.shape}, got "
                f"{got.dtype} of shape {got.shape}")
            assert np.array_equal(got, want), (
                f"{name}, groups of {group}: {np.sum(got != want)} values differ from "
                f"cache.dequantized() (code * scale in float32); largest difference "
                f"{np.abs(got - want).max():.3g}")


@points(2)
def test_round_trip_stays_within_your_bound(sub, rng):
    """|dequantize(quantize(x)) - x| <= error_bound(x), and never more than half a step, for outliers, zeros, tiny and huge values"""
    for _ in range(8):
        x = hard_inputs(rng)
        for group in (32, 16, 8, 2, 1):
            got = quantize(sub, x, group)
            assert isinstance(got, (tuple, list)) and len(got) == 2, (
                f"quantize_int8: expected (codes, scales), got {described(got)}")
            codes = as_array(got[0], "quantize_int8's codes", shape=x.shape, dtype=np.int8)
            scales = as_array(got[1], "quantize_int8's scales",
                              shape=x.shape[:-1] + (x.shape[-1] // group,), dtype=np.float32)
            back = as_array(sub.dequantize_int8(codes, scales, group), "dequantize_int8",
                            shape=x.shape)
            back = back.astype(np.float64)
            bound = as_array(sub.error_bound(x, group), "error_bound", shape=x.shape)
            # a bound looser than half a step (infinity, say) proves nothing: the tighter counts
            bound = np.minimum(bound, kvlab.quant.round_trip_error_bound(x, "int8", group))
            error = np.abs(back - x)
            over = np.argwhere(~(error <= bound))
            if len(over):
                at = index(over[0])
                raise AssertionError(
                    f"groups of {group}: {len(over)} values come back further than your bound; first "
                    f"at index {at}: x = {float(x[at])!r}, came back as {float(back[at])!r} (error {error[at]:.4g}, "
                    f"bound {bound[at]:.4g})")


@points(2)
def test_error_bound_is_half_a_step(sub, rng):
    """error_bound is half of its group's step, as kvlab.quant.round_trip_error_bound says"""
    for group in (32, 8, 1):
        x = hard_inputs(rng)
        got = np.asarray(sub.error_bound(x, group), dtype=np.float64)
        want = kvlab.quant.round_trip_error_bound(x, "int8", group).astype(np.float64)
        assert got.shape == x.shape, f"error_bound: expected shape {x.shape}, got {got.shape}"
        off = ~(np.abs(got - want) <= 1e-3 * want + 1e-9)
        if np.any(off):
            at = index(np.argwhere(off)[0])
            raise AssertionError(f"groups of {group}: at index {at} (x = {float(x[at])!r}) expected a bound of "
                                 f"{want[at]:.6g} (half the step max|x| / 127 of its group, plus a "
                                 f"little for float rounding), got {got[at]:.6g}")


@points(2)
def test_bytes_per_token(sub, rng):
    """codes and float32 scales of K and V in every layer: kvlab.kv_bytes_per_token, and a real cache"""
    for _ in range(20):
        n_kv_heads = int(rng.choice([1, 2, 8]))
        n_heads = n_kv_heads * int(rng.choice([1, 4]))
        head_dim = int(rng.choice([8, 16, 64, 128]))
        config = kvlab.ModelConfig(dim=n_heads * head_dim, hidden_dim=4 * n_heads * head_dim,
                                   n_layers=int(rng.integers(1, 81)), n_heads=n_heads,
                                   n_kv_heads=n_kv_heads, vocab_size=1000, max_seq_len=4096)
        for group in (head_dim, 32 if head_dim >= 32 else head_dim // 2, 2, 1):
            got = sub.int8_bytes_per_token(config_record(config), group)
            want = kvlab.kv_bytes_per_token(config, "int8", group=group)
            assert got == want, (f"{config.n_layers} layers, {n_kv_heads} KV heads x {head_dim}, "
                                 f"groups of {group}: expected {want:,} bytes, got {described(got)}")
    model = bundled_model()
    for group in (16, 4):
        cache = model.new_cache(100, "int8", group=group)
        got = sub.int8_bytes_per_token(config_record(model.config), group)
        assert got * 100 == cache.nbytes, (f"the bundled model's int8 cache of 100 positions, groups of "
                                           f"{group}, allocates {cache.nbytes:,} B: {cache.nbytes // 100:,} "
                                           f"per token; you say {got!r}")


@points(2)
def test_attend_int8_matches_the_c_cache(sub, rng):
    """attention over an int8 cache's codes equals cache.attend of that cache"""
    model = bundled_model()
    c = model.config
    for group in (16, 4):
        cache = model.new_cache(64, "int8", group=group)
        model.prefill(model.encode(PROMPT), cache)
        for layer in range(c.n_layers):
            q = (rng.standard_normal((c.n_heads, c.head_dim)) * 2).astype(np.float32)
            got = np.asarray(sub.attend_int8(q, cache.key_codes[layer], cache.key_scales[layer],
                                                    cache.value_codes[layer], cache.value_scales[layer],
                                                    group))
            want = cache.attend(q, layer)
            assert got.shape == want.shape, f"expected shape {want.shape}, got {got.shape}"
            error = np.abs(got - want)
            assert np.all(error <= 1e-5 + 1e-5 * np.abs(want)), (
                f"layer {layer} of the bundled model's int8 cache (groups of {group}, 8 query heads on "
                f"2 KV heads): off by up to {np.nanmax(error):.3g} from cache.attend(q, layer)")
