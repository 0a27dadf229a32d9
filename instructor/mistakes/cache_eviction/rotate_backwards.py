"""Turns each pair the wrong way, (a cos t + b sin t, b cos t - a sin t): the sine's sign is
flipped, so a key turned by s lands where RoPE puts position p - s. Every re-rotated key is
then at the wrong distance from the queries, and the curves show it."""
EXPECTED_FAILURES = ["test_rotate_turns_each_pair_by_its_angle",
                     "test_rotate_pairs_the_halves_when_not_interleaved",
                     "test_rerotate_puts_each_kept_key_at_its_place",
                     "test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]


def rotate(x, shift, inv_freq, interleaved):
    x = np.asarray(x, dtype=np.float32)
    angles = np.asarray(shift, dtype=np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    cos, sin = np.cos(angles), np.sin(angles)
    half = x.shape[-1] // 2
    first, second = (slice(0, None, 2), slice(1, None, 2)) if interleaved else \
        (slice(0, half), slice(half, None))
    a, b = x[..., first], x[..., second]
    out = np.empty_like(x)
    out[..., first] = a * cos + b * sin
    out[..., second] = b * cos - a * sin
    return out
