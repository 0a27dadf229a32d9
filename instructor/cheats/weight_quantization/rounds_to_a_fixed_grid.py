"""q4_0_round_to_nearest skips the blocks and their scales: every weight rounded to the
nearest multiple of 1/8, whatever its block holds."""
TARGETS = ["test_round_to_nearest_is_q4_0s", "test_round_to_nearest_edge_blocks"]


def q4_0_round_to_nearest(w):
    return (np.round(np.asarray(w, np.float32) * 8) / 8).astype(np.float32)
