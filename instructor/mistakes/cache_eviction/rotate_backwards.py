"""Turns each pair the wrong way, (a cos t + b sin t, b cos t - a sin t): the sine's sign is
flipped, which is a turn by -shift, so a key turned by s lands where RoPE puts position
p - s. Every re-rotated key is then at the wrong distance from the queries, and the curves
show it."""
EXPECTED_FAILURES = ["test_rotate_turns_each_pair_by_its_angle",
                     "test_rotate_pairs_the_halves_when_not_interleaved",
                     "test_rerotate_puts_each_kept_key_at_its_place",
                     "test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]

_turned = rotate


def rotate(x, shift, inv_freq, interleaved):
    return _turned(x, -np.asarray(shift), inv_freq, interleaved)
