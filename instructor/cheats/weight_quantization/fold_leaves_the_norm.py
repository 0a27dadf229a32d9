"""fold_into_norm skips the fold: the norm weight and the matrices come back as they were."""
TARGETS = ["test_fold_into_norm_keeps_the_layer"]


def fold_into_norm(norm_weight, matrices, scales):
    return np.asarray(norm_weight, np.float32), [np.asarray(w, np.float32) for w in matrices]
