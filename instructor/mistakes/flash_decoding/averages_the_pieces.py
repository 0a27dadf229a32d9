"""Normalizes each piece on its own and averages the pieces' outputs: right for one piece,
wrong as soon as two pieces carry different total weight."""
EXPECTED_FAILURES = ["test_any_number_of_splits_gives_the_c_cores_attention",
                     "test_large_scores_do_not_overflow"]


def split_attend(q, keys, values, n_splits):
    outputs = [acc / l[:, None] for acc, _, l in split_states(q, keys, values, n_splits) if l.any()]
    return np.mean(outputs, axis=0).astype(np.float32)
