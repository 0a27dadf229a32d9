"""An empty piece reduced to all zeros, m = 0 included, instead of m = -inf: no -inf, so
no exp(-inf - (-inf)) to think about, and the outputs come out right as long as some score
of every head is above about -87."""
TARGETS = ["test_an_empty_piece", "test_each_piece_of_a_split_is_reduced"]

_with_minus_inf = partial


def partial(q, keys, values):
    acc, m, l = _with_minus_inf(q, keys, values)
    if len(keys) == 0:
        m = np.zeros_like(m)
    return acc, m, l
