"""output_error skips the product with the inputs: the weights' own squared error, times
the number of tokens, which is the output error only when x's rows are orthonormal."""
TARGETS = ["test_output_error"]


def output_error(x, w, w_stored):
    diff = np.asarray(w, np.float64) - np.asarray(w_stored, np.float64)
    return float(len(x) * np.square(diff).sum())
