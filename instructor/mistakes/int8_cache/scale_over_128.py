"""Divides the largest magnitude by 128 (the int8 range is -128..127, after all): the largest
value then needs code 128, is clipped to 127, and comes back a whole step short."""
EXPECTED_FAILURES = ["test_quantize_matches_kvlab_quant",
                     "test_quantize_rounds_half_to_even_and_keeps_zero_groups_zero",
                     "test_codes_match_the_c_int8_cache", "test_round_trip_stays_within_your_bound"]


def quantize_int8(x, group):
    g = _groups(np.asarray(x, dtype=np.float32), group)
    scales = np.abs(g).max(axis=-1) / np.float32(128)
    divisor = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(g / divisor[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(np.shape(x)), scales
