"""error_bound returns the round trip's own error, |dequantize(quantize(x)) - x|, measured
rather than bounded: the round trip never exceeds it, so a test that only compares the two
is satisfied, but it says nothing of the half step a group's scale allows."""
TARGETS = ["test_error_bound_is_half_a_step"]


def error_bound(x, group):
    x = np.asarray(x, dtype=np.float32)
    codes, scales = quantize_int8(x, group)
    return np.abs(dequantize_int8(codes, scales, group) - x)
