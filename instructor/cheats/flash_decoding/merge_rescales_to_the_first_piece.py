"""One exp instead of two: the merge rescales the second piece to the first piece's max and
keeps that max. Exact on paper whichever piece holds the larger score, and acc / l comes out
right, but m is not the largest score, and exp(m2 - m1) overflows when m2 is far above m1."""
TARGETS = ["test_merge_combines_two_pieces"]


def merge(a, b):
    if np.all(np.isneginf(a[1])):                        # an empty first piece: nothing to rescale
        return b
    scale = np.exp(b[1] - a[1])
    return a[0] + scale[:, None] * b[0], a[1], a[2] + scale * b[2]
