"""One softmax over all the positions where a split is asked: split_attend and
attend_in_chunks ignore n_splits and chunk, split_states hands back the whole context as its
first piece and empty ones after it, and the merge is never written.

The outputs alone cannot tell it from a split (merged, the pieces give plain attention's
output): the grader also runs split_attend and attend_in_chunks with its own partial in
place of the student's, which records the pieces and scales each one's acc and l, so an
output that never came from the pieces is caught."""
TARGETS = ["test_each_piece_of_a_split_is_reduced", "test_merge_combines_two_pieces",
           "test_merging_with_an_empty_piece_changes_nothing",
           "test_any_number_of_splits_gives_the_c_cores_attention",
           "test_large_scores_do_not_overflow", "test_fixed_chunks_give_the_same_attention"]


def plain(q, keys, values, *ignored):
    kv_mul = q.shape[0] // keys.shape[1]
    k, v = np.repeat(keys, kv_mul, axis=1), np.repeat(values, kv_mul, axis=1)
    s = np.einsum("hd,phd->hp", q, k) / np.sqrt(q.shape[1])
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (np.einsum("hp,phd->hd", w / w.sum(axis=1, keepdims=True), v)).astype(np.float32)


split_attend = attend_in_chunks = plain


def split_states(q, keys, values, n_splits):
    return [partial(q, keys, values)] + [partial(q, keys[:0], values[:0])] * (n_splits - 1)


def merge(a, b):
    raise NotImplementedError("merge")
