"""q4_0_round_to_nearest multiplies the codes by d as computed, in float32, where Q4_0 keeps
d as a half: every value is off by d's rounding to 11 bits, and d below a half's normal
range (tiny weights) is far off."""
EXPECTED_FAILURES = ["test_round_to_nearest_is_q4_0s", "test_round_to_nearest_edge_blocks",
                     "test_search_picks_the_alpha_with_the_least_error",
                     "test_your_search_on_smollm2s_layers"]


def q4_0_round_to_nearest(w):
    w = np.asarray(w, dtype=np.float32)
    blocks = w.reshape(w.shape[0], -1, 32)
    at = np.abs(blocks).argmax(axis=-1)[..., None]
    d = np.take_along_axis(blocks, at, axis=-1) / np.float32(-8)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(np.trunc(blocks * inverse + np.float32(8.5)), 15)
    return (d * (q - np.float32(8))).reshape(w.shape)
