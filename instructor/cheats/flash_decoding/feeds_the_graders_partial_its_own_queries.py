"""Plain attention where a split is asked; when the grader's partial stands in for the
student's, it is fed the pieces it expects but with queries of the cheat's choosing (the
first piece's aimed so that its score dwarfs the rest), so that the "merge" the grader
predicts is the first piece alone, returned without merging. (A reviewer's attack: the
grader's partial now takes only the test's query, and each piece in order.)"""
TARGETS = ["test_any_number_of_splits_gives_the_c_cores_attention",
           "test_large_scores_do_not_overflow", "test_fixed_chunks_give_the_same_attention"]


_mine = partial


def _plain(q, keys, values):
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    k, v = np.repeat(keys, kv_mul, axis=1), np.repeat(values, kv_mul, axis=1)
    s = np.einsum("hd,shd->hs", q.astype(np.float64), k) / math.sqrt(head_dim)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (np.einsum("hs,shd->hd", w / w.sum(axis=1, keepdims=True), v)).astype(np.float32)


def _fool(q, keys, values, pieces):
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    first = None
    for piece in pieces:
        if not len(piece):
            continue
        if first is None:
            aim = keys[piece[0]][np.arange(n_heads) // kv_mul]          # (n_heads, head_dim)
            aim = aim / np.linalg.norm(aim, axis=1, keepdims=True)
            first = partial((aim * 1e5).astype(np.float32), keys[piece], values[piece])
        else:
            partial(np.zeros_like(q), keys[piece], values[piece])
    acc, _, l = first
    return (np.asarray(acc) / np.asarray(l)[:, None]).astype(np.float32)


def split_attend(q, keys, values, n_splits):
    if partial is not _mine:
        return _fool(q, keys, values, np.array_split(np.arange(len(keys)), n_splits))
    return _plain(q, keys, values)


def attend_in_chunks(q, keys, values, chunk):
    if partial is not _mine:
        return _fool(q, keys, values, [np.arange(a, min(a + chunk, len(keys)))
                                       for a in range(0, len(keys), chunk)])
    return _plain(q, keys, values)
