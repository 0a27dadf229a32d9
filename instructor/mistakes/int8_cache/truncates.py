"""Casts x / scale to int8 without rounding: astype truncates toward zero, so 2.9 becomes 2
and values come back up to a whole step off."""
EXPECTED_FAILURES = ["test_quantize_matches_kvlab_quant",
                     "test_quantize_rounds_half_to_even_and_keeps_zero_groups_zero",
                     "test_codes_match_the_c_int8_cache", "test_round_trip_stays_within_your_bound"]


def quantize_int8(x, group):
    g = _groups(np.asarray(x, dtype=np.float32), group)
    scales = np.abs(g).max(axis=-1) / np.float32(127)
    divisor = np.where(scales > 0, scales, np.float32(1))
    codes = (g / divisor[..., None]).astype(np.int8)
    return codes.reshape(np.shape(x)), scales
