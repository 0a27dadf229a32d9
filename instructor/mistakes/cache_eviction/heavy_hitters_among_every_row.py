"""Ranks every row, the newest included, for the heavy hitters, then adds the newest rows:
a newest row with a large score is kept twice (and an older one that should have been kept
is not). The rows are no longer distinct, which the grader's run refuses."""
EXPECTED_FAILURES = ["test_heavy_hitters_keep_the_newest_and_the_most_attended",
                     "test_heavy_hitters_break_ties_and_count_no_row_twice",
                     "test_heavy_hitters_curve_on_smollm2"]


def heavy_hitter_rows(scores, n_keep, n_recent):
    scores = np.asarray(scores)
    n_layers, length, n_kv_heads = scores.shape
    order = np.argsort(-scores, axis=1, kind="stable")[:, :n_keep - n_recent, :]
    recent = np.broadcast_to(np.arange(length - n_recent, length)[None, :, None],
                             (n_layers, n_recent, n_kv_heads))
    return np.sort(np.concatenate([order, recent], axis=1), axis=1)
