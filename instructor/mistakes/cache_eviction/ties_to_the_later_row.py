"""Sorts the scores up and takes the last ones, so that of two rows with the same score the
later one wins, where H2O (and kvlab) keep the earlier. Sums of real attention almost never
tie, so only the crafted ties show it."""
EXPECTED_FAILURES = ["test_heavy_hitters_break_ties_and_count_no_row_twice"]


def heavy_hitter_rows(scores, n_keep, n_recent):
    scores = np.asarray(scores)
    n_layers, length, n_kv_heads = scores.shape
    older = length - n_recent
    order = np.argsort(scores[:, :older, :], axis=1, kind="stable")[:, ::-1, :][:, :n_keep - n_recent, :]
    recent = np.broadcast_to(np.arange(older, length)[None, :, None], (n_layers, n_recent, n_kv_heads))
    return np.concatenate([np.sort(order, axis=1), recent], axis=1)
