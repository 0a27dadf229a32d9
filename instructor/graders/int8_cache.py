"""Hidden grading tests for lab 9 (int8 cache quantization). Each test says in its message
what it expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

Codes and scales are checked bit for bit against kvlab.quant (the NumPy specification) and
against what the C core stores in an int8 cache; the error bound against the round trip
and against kvlab.quant.round_trip_error_bound; the byte count against
kvlab.kv_bytes_per_token and a real cache's nbytes; int8 attention against cache.attend.

Every input is drawn at grading time (a worked example is one case among drawn ones): the
rows of exact halves, the zero groups and the rows where multiplying is not dividing; the
prompt whose K and V the bundled model's caches hold; codes and scales of other shapes.
"""
import numpy as np

import kvlab
import kvlab.quant
from kvlab.grading.remote import RemoteError
from kvlab.grading.testkit import as_array, bundled_model, config_record, described, points

LINES = ("ROMEO:\nBut soft, what light through yonder window breaks?",
         "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
         "First Citizen:\nBefore we proceed any further, hear me speak.",
         "HAMLET:\nTo be, or not to be, that is the question.")


def prepare():
    bundled_model()


def drawn_prompt(rng) -> str:
    """A line of the play cut anywhere past its first words, drawn at grading time: the
    bundled model's cache of it holds K and V no table written beforehand has."""
    line = LINES[int(rng.integers(len(LINES)))]
    return line[:int(rng.integers(16, len(line) + 1))]


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
    x[2, -1] *= np.float32(1e-8)                       # tinier: 127 / max |x| overflows
    x[3, :, 5] = np.float32(500.0)                     # one outlier per row
    x[3, -1, -3] = np.float32(-8000.0)
    x[4, :, :half] *= np.float32(1e-4)                 # small and large groups in one row
    x[5, 1] = np.float32(1e-40)                        # subnormal numbers, equal
    x[5, 2] *= np.float32(1e-40)                       # and not (x * 127 loses them too)
    # near the largest float32, where x * 127 overflows (x / scale does not)
    x[5, -1] = rng.uniform(-3e38, 3e38, shape[-1]).astype(np.float32)
    x[5, -1, ::3] = np.float32(-3e38)
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

# A group whose scale is exactly 1, worked out in the message: x / scale is x.
HALVES = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5,
                    10.5, 126.5, -126.5, 0.0, 1.0, -7.0, 2.4999, 2.5001]], dtype=np.float32)


def halves_rows(rng, n_rows, group):
    """Rows whose groups have a power-of-two scale, so that x / scale is exact: each group's
    largest value is +-127 steps, the others mostly half steps (-126.5 to 126.5)."""
    steps = rng.integers(-126, 127, size=(n_rows, group)).astype(np.float32)
    steps += np.where(rng.random((n_rows, group)) < 0.75, np.float32(0.5), np.float32(0))
    steps = np.clip(steps, -126.5, 126.5)
    steps[np.arange(n_rows), rng.integers(0, group, n_rows)] = rng.choice([-127.0, 127.0], n_rows)
    scale = np.float32(2.0) ** rng.integers(-20, 21, size=(n_rows, 1)).astype(np.float32)
    return (steps * scale).astype(np.float32)


def zero_groups(rng, group):
    """Rows of groups of which some are all zeros, beside groups that are not."""
    rows, n_groups = int(rng.integers(2, 6)), int(rng.integers(2, 5))
    x = rng.standard_normal((rows, n_groups, group)).astype(np.float32)
    zero = rng.random((rows, n_groups)) < 0.4
    zero[0, 0], zero[-1, -1] = True, False
    x[zero] = 0.0
    return x.reshape(rows, n_groups * group)


def divided_rows(rng, n=2):
    """Rows of 16 (one group) found at grading time where x * (1 / scale), or x * (127 / max|x|),
    rounds to another code than x / scale: n of each kind."""
    inverse, ratio = [], []
    for _ in range(100):
        x = (rng.standard_normal((50000, 16))
             * rng.choice([0.01, 1.0, 30.0], size=(50000, 1))).astype(np.float32)
        largest = np.abs(x).max(axis=-1, keepdims=True)
        scale = largest / np.float32(127)
        want = np.rint(x / scale)
        inverse += list(x[(np.rint(x * (np.float32(1) / scale)) != want).any(-1)])
        ratio += list(x[(np.rint(x * (np.float32(127) / largest)) != want).any(-1)])
        if len(inverse) >= n and len(ratio) >= n:
            break
    return np.array(inverse[:n] + ratio[:n], dtype=np.float32).reshape(-1, 16)


@points(2)
def test_quantize_rounds_half_to_even_and_keeps_zero_groups_zero(sub, rng):
    """x / scale = 2.5 gives 2 (np.rint), an all-zero group codes 0 and scale 0, x / scale is divided"""
    got = quantize(sub, HALVES, 16)
    check_quantized(got, HALVES, 16, "a group whose scale is exactly 1 (halves round to even: "
                                     "0.5 -> 0, 1.5 -> 2, 2.5 -> 2)")
    for group in (16, 8):
        x = halves_rows(rng, int(rng.integers(3, 7)), group)
        got = quantize(sub, x, group)
        check_quantized(got, x, group, f"groups of {group} whose scale is a power of two, so that "
                                       f"x / scale is a whole or half number (halves round to even: "
                                       f"0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2)")
    zeros = np.zeros((2, 16), dtype=np.float32)
    zeros[1, 8:] = np.arange(1, 9, dtype=np.float32)   # a zero group beside a non-zero one
    for x, group in ((zeros, 8), (zero_groups(rng, 8), 8), (zero_groups(rng, 4), 4)):
        got = quantize(sub, x, group)
        check_quantized(got, x, group, f"all-zero groups beside others, groups of {group} (an "
                                       f"all-zero group has scale 0 and codes 0)")
    for x in (DIVIDE_NOT_MULTIPLY, divided_rows(rng)):
        got = quantize(sub, x, 16)
        check_quantized(got, x, 16, "rows where x * (1 / scale), or x * (127 / max |x|), rounds "
                                    "to another code than x / scale (divide each value by the scale)")


@points(3)
def test_codes_match_the_c_int8_cache(sub, rng):
    """quantizing an fp32 cache's K and V gives the codes and scales an int8 cache stores"""
    model = bundled_model()
    text = drawn_prompt(rng)
    tokens = model.encode(text)
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
                f"the bundled model's layer-0 {name} after {text!r}, groups of {group}: your codes "
                f"and scales differ "
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


def check_dequantized(sub, codes, scales, group, want, what):
    got = np.asarray(sub.dequantize_int8(codes, scales, group))
    assert got.dtype == np.float32 and got.shape == want.shape, (
        f"{what}: expected float32 of shape {want.shape}, got {got.dtype} of shape {got.shape}")
    bad = np.argwhere(got != want)
    if len(bad):
        at = index(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {want.size} values differ from code * scale in float32; first "
            f"at index {at}: code {int(codes[at])}, scale "
            f"{float(scales[at[:-1] + (at[-1] // group,)])!r} (groups of {group}): expected "
            f"{float(want[at])!r}, got {float(got[at])!r}")


@points(2)
def test_dequantize_matches_the_c_cache(sub, rng):
    """dequantize_int8 gives what an int8 cache's attention reads (cache.dequantized()), and code * scale for any codes"""
    model = bundled_model()
    text = drawn_prompt(rng)
    for group in (16, int(rng.choice([8, 4, 2]))):
        cache = model.new_cache(64, "int8", group=group)
        model.prefill(model.encode(text), cache)
        keys, values = cache.dequantized()
        for name, codes, scales, want in (("keys", cache.key_codes, cache.key_scales, keys),
                                          ("values", cache.value_codes, cache.value_scales, values)):
            check_dequantized(sub, codes, scales, group, want,
                              f"the bundled model's int8 cache of {text!r}, its {name} (groups of "
                              f"{group}), against cache.dequantized()")
    # codes and scales of other shapes and groups, as another model's cache holds them
    for group in rng.choice([1, 2, 4, 8, 16, 32], size=3, replace=False):
        group = int(group)
        shape = tuple(int(n) for n in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        d = group * int(rng.integers(1, 5))
        codes = rng.integers(-127, 128, size=shape + (d,)).astype(np.int8)
        scales = (rng.random(shape + (d // group,)) * 10.0 ** rng.uniform(-8, 8)).astype(np.float32)
        scales[rng.random(scales.shape) < 0.2] = 0.0            # all-zero groups
        want = kvlab.quant.dequantize(kvlab.quant.Quantized("int8", codes, scales, group=group))
        check_dequantized(sub, codes, scales, group, want,
                          f"random codes of shape {codes.shape} with scales of shape {scales.shape}")


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
    text = drawn_prompt(rng)
    for group in (16, 4):
        cache = model.new_cache(64, "int8", group=group)
        model.prefill(model.encode(text), cache)
        for layer in range(c.n_layers):
            q = (rng.standard_normal((c.n_heads, c.head_dim)) * 2).astype(np.float32)
            got = np.asarray(sub.attend_int8(q, cache.key_codes[layer], cache.key_scales[layer],
                                                    cache.value_codes[layer], cache.value_scales[layer],
                                                    group))
            want = cache.attend(q, layer)
            assert got.shape == want.shape, f"expected shape {want.shape}, got {got.shape}"
            error = np.abs(got - want)
            assert np.all(error <= 1e-5 + 1e-5 * np.abs(want)), (
                f"layer {layer} of the bundled model's int8 cache of {text!r} (groups of {group}, 8 "
                f"query heads on 2 KV heads): off by up to {np.nanmax(error):.3g} from "
                f"cache.attend(q, layer)")
