"""Normalizes each piece on its own and averages the pieces' outputs: right for one piece,
wrong as soon as two pieces carry different total weight."""
EXPECTED_FAILURES = ["test_any_number_of_splits_gives_the_c_cores_attention",
                     "test_large_scores_do_not_overflow"]


def split_attend(q, keys, values, n_splits):
    outputs = []
    for piece in np.array_split(np.arange(len(keys)), n_splits):
        if len(piece):
            acc, _, l = partial(q, keys[piece], values[piece])
            outputs.append(acc / l[:, None])
    return np.mean(outputs, axis=0).astype(np.float32)
