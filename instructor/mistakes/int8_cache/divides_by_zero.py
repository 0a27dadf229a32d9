"""Divides by the scale even when it is 0: an all-zero group becomes 0 / 0 = NaN before the
cast to int8 (which then gives whatever the platform makes of NaN)."""
EXPECTED_FAILURES = ["test_quantize_rounds_half_to_even_and_keeps_zero_groups_zero",
                     "test_codes_match_the_c_int8_cache", "test_round_trip_stays_within_your_bound"]


def quantize_int8(x, group):
    g = _groups(np.asarray(x, dtype=np.float32), group)
    scales = np.abs(g).max(axis=-1) / np.float32(127)
    codes = np.clip(np.rint(g / scales[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(np.shape(x)), scales
