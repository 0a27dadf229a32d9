"""quantize_int8 scales the values straight to +-127, x * 127 / max |x|, with no thought for
the float range: on ordinary K and V the codes are those of x / scale (all but one row in
tens of thousands), but for values past 2.7e36, x * 127 overflows to infinity and every
such value is coded +-127."""
TARGETS = ["test_codes_match_the_c_int8_cache", "test_round_trip_stays_within_your_bound"]


def quantize_int8(x, group):
    g = _groups(np.asarray(x, dtype=np.float32), group)
    largest = np.abs(g).max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        codes = np.rint(g * np.float32(127) / np.where(largest > 0, largest, np.float32(1)))
    codes = np.clip(codes, -127, 127).astype(np.int8)
    return codes.reshape(np.shape(x)), largest[..., 0] / np.float32(127)
