"""fold_into_norm multiplies the RMSNorm weight by the scales too, where it must divide: the
columns grow by s and so does their input, s squared in all."""
EXPECTED_FAILURES = ["test_fold_into_norm_keeps_the_layer"]


def fold_into_norm(norm_weight, matrices, scales):
    scales = np.asarray(scales, dtype=np.float32)
    return (np.asarray(norm_weight, np.float32) * scales,
            [np.asarray(w, np.float32) * scales for w in matrices])
