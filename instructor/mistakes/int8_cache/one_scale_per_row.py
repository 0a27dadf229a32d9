"""Ignores the group: one scale for each whole row (head). Right when group == head_dim,
but a row with one large value then crushes every other group of that row to a few codes."""
EXPECTED_FAILURES = ["test_quantize_matches_kvlab_quant",
                     "test_quantize_rounds_half_to_even_and_keeps_zero_groups_zero",
                     "test_codes_match_the_c_int8_cache", "test_round_trip_stays_within_your_bound"]


def quantize_int8(x, group):
    x = np.asarray(x, dtype=np.float32)
    scales = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    divisor = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(x / divisor), -127, 127).astype(np.int8)
    return codes, scales
