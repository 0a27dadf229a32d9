"""Hidden grading tests for lab 10 (flash-decoding). Each test says in its message what it
expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

The outputs are compared with the C core's attention over the same rows (cache.attend of
a kvlab cache), for shapes, lengths and splits drawn at grading time: one piece, pieces of
one position, more pieces than positions (empty ones), scores large enough to overflow an
unshifted exp. The pieces and the merge are checked on their own too.

A split gives the same output as plain attention, so the output alone cannot show that a
split was made. So split_attend and attend_in_chunks also run once with the grader's own
partial in place of the student's (kvlab/grading/remote.py, ServedFunction): it records
which positions each piece held, and scales each piece's acc and l by a factor drawn now,
which moves the output to a value only merging those pieces gives.
"""
import numpy as np

from kvlab.grading.remote import ServedFunction
from kvlab.grading.testkit import as_array, c_attend, check_close, described, points


def shapes(rng):
    """(n_heads, n_kv_heads, head_dim) of each kind, drawn now."""
    n_kv, mul = int(rng.integers(2, 4)), int(rng.integers(2, 4))
    return {"MHA": (n_kv, n_kv, int(rng.choice([8, 16]))),
            "GQA": (n_kv * mul, n_kv, int(rng.choice([8, 16]))),
            "MQA": (int(rng.integers(2, 6)), 1, int(rng.choice([8, 16])))}


def rows(rng, length, n_kv_heads, head_dim, scale=1.0):
    return ((rng.standard_normal((length, n_kv_heads, head_dim)) * scale).astype(np.float32),
            rng.standard_normal((length, n_kv_heads, head_dim)).astype(np.float32))


def cases(rng, lengths):
    """(kind, q, keys, values) for MHA, GQA and MQA, a length drawn from `lengths` each."""
    for kind, (n_heads, n_kv_heads, head_dim) in shapes(rng).items():
        keys, values = rows(rng, int(rng.integers(*lengths)), n_kv_heads, head_dim)
        yield kind, rng.standard_normal((n_heads, head_dim)).astype(np.float32), keys, values


def reduce_by_hand(q, keys, values):
    """(acc, m, l) of a piece, in float64, straight from the definitions."""
    n_heads, head_dim = q.shape
    kv_mul = n_heads // keys.shape[1]
    acc, m, l = np.zeros((n_heads, head_dim)), np.full(n_heads, -np.inf), np.zeros(n_heads)
    for h in range(n_heads):
        if len(keys):
            s = keys[:, h // kv_mul].astype(np.float64) @ q[h] / np.sqrt(head_dim)
            m[h] = s.max()
            w = np.exp(s - m[h])
            l[h], acc[h] = w.sum(), w @ values[:, h // kv_mul]
    return acc, m, l


def through_the_pieces(sub, name, q, keys, values, how, pieces, rng, what):
    """Run the student's `name`(q, keys, values, how) with the grader's partial in place of
    theirs, which scales each piece's acc and l by a factor drawn now: it must be given the
    test's query and `pieces` (position ranges) in order (empty ones as the code likes),
    and the output must be the merge of what it returned."""
    wanted = [piece for piece in pieces if len(piece)]
    sizes = [len(piece) for piece in wanted]
    given, refused, empty = [], [], []

    def scaled_partial(q_, keys_, values_):
        q_, keys_, values_ = np.asarray(q_), np.asarray(keys_), np.asarray(values_)
        i = len(given)
        if len(keys_) == 0 and keys_.shape[1:] == keys.shape[1:] and q_.shape == q.shape \
                and len(empty) <= len(pieces) + 2:
            empty.append(i)
            return (np.zeros(q.shape, np.float32), np.full(len(q), -np.inf, np.float32),
                    np.zeros(len(q), np.float32))         # an empty piece: the merge's identity
        piece = wanted[i] if i < len(wanted) else None
        if piece is None or q_.shape != q.shape or keys_.shape != keys[piece].shape \
                or values_.shape != values[piece].shape or not np.array_equal(q_, q) \
                or not np.array_equal(keys_, keys[piece]) or not np.array_equal(values_, values[piece]):
            refused.append(i)
            raise ValueError(f"partial was given something other than the query and piece {i} "
                             f"of the split (pieces of {sizes} positions, in order)")
        given.append(i)
        acc, m, l = reduce_by_hand(q_, keys_, values_)
        factor = rng.uniform(0.25, 4.0)
        return ((acc * factor).astype(np.float32), m.astype(np.float32),
                (l * factor).astype(np.float32))

    served = ServedFunction(scaled_partial)
    got = getattr(sub, name).call((q, keys, values, how), {}, replace={"partial": served})
    assert not refused and len(given) == len(wanted), (
        f"{what}: your {name} should reduce each piece with your partial (the grader put its "
        f"own partial in its place for this call) and merge the results; partial was given "
        f"{len(given)} of the {len(wanted)} pieces of {sizes} positions, in order, with the "
        f"query" + (f", and {len(refused)} call(s) with something else" if refused else ""))
    states = [call[2] for call in served.calls]
    top = np.max([m for _, m, _ in states], axis=0)
    weights = [np.exp(m.astype(np.float64) - top) for _, m, _ in states]
    acc = sum(w[:, None] * a.astype(np.float64) for w, (a, _, _) in zip(weights, states))
    norm = sum(w * l.astype(np.float64) for w, (_, _, l) in zip(weights, states))
    check_close(got, acc / norm[:, None],
                f"{what}, run with the grader's partial in place of yours (it scales each "
                f"piece's acc and l by a factor of its own): your {name}'s output should be "
                f"the merge of the pieces partial returned, acc / l", atol=1e-4, rtol=1e-4)


def state_of(got, n_heads, head_dim, what):
    assert isinstance(got, (tuple, list)) and len(got) == 3, f"{what}: expected (acc, m, l), got {described(got)}"
    return (as_array(got[0], f"{what}: acc", shape=(n_heads, head_dim)),
            as_array(got[1], f"{what}: m", shape=(n_heads,)),
            as_array(got[2], f"{what}: l", shape=(n_heads,)))


@points(2)
def test_a_piece_reduces_to_its_max_sum_and_weighted_values(sub, rng):
    """partial(q, keys, values): m the largest score, l and acc shifted by it"""
    for kind, q, keys, values in cases(rng, (1, 12)):
        (n_heads, head_dim), length, n_kv_heads = q.shape, len(keys), keys.shape[1]
        acc, m, l = state_of(sub.partial(q, keys, values), n_heads, head_dim, f"{kind}, {length} positions")
        want_acc, want_m, want_l = reduce_by_hand(q, keys, values)
        check_close(m, want_m, f"{kind}, {length} positions: m, the largest score per query head "
                               f"(head h reads KV head h // {n_heads // n_kv_heads})")
        check_close(l, want_l, f"{kind}, {length} positions: l, the sum of exp(s - m)")
        check_close(acc, want_acc, f"{kind}, {length} positions: acc, the sum of exp(s - m) v")


@points(1)
def test_an_empty_piece(sub, rng):
    """no positions: m = -inf, l = 0, acc = 0"""
    n_heads, n_kv_heads, head_dim = shapes(rng)["GQA"]
    keys, values = rows(rng, 0, n_kv_heads, head_dim)
    q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
    acc, m, l = state_of(sub.partial(q, keys, values), n_heads, head_dim, "an empty piece")
    assert np.all(np.isneginf(m)) and not np.any(l) and not np.any(acc), (
        f"an empty piece: expected m = -inf, l = 0, acc = 0 for every head, got m {m.tolist()}, "
        f"l {l.tolist()}")


@points(2)
def test_merge_combines_two_pieces(sub, rng):
    """merge of two pieces equals the reduction of both together, in either order"""
    n_heads, n_kv_heads, head_dim = shapes(rng)["GQA"]
    for split, scale in ((3, 1.0), (1, 1.0), (7, 40.0)):
        length = split + int(rng.integers(1, 9))
        keys, values = rows(rng, length, n_kv_heads, head_dim, scale)
        q = (rng.standard_normal((n_heads, head_dim)) * scale).astype(np.float32)
        first = reduce_by_hand(q, keys[:split], values[:split])
        second = reduce_by_hand(q, keys[split:], values[split:])
        whole = reduce_by_hand(q, keys, values)
        for order, (a, b) in (("first, second", (first, second)), ("second, first", (second, first))):
            a = tuple(np.asarray(x, np.float32) for x in a)
            b = tuple(np.asarray(x, np.float32) for x in b)
            acc, m, l = state_of(sub.merge(a, b), n_heads, head_dim, f"merge({order})")
            what = f"merge({order}) of positions 0..{split - 1} and {split}..{length - 1}"
            check_close(m, whole[1], f"{what}: m", atol=1e-4)
            check_close(acc / l[:, None], whole[0] / whole[2][:, None],
                        f"{what}: acc / l against the output of all {length} positions")


@points(2)
def test_merging_with_an_empty_piece_changes_nothing(sub, rng):
    """an empty piece on either side, or both: no NaN, nothing changed"""
    n_heads, n_kv_heads, head_dim = shapes(rng)["MHA"]
    keys, values = rows(rng, 5, n_kv_heads, head_dim)
    q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
    full = tuple(np.asarray(x, np.float32) for x in reduce_by_hand(q, keys, values))
    empty = (np.zeros((n_heads, head_dim), np.float32), np.full(n_heads, -np.inf, np.float32),
             np.zeros(n_heads, np.float32))
    for what, a, b in (("merge(empty, piece)", empty, full), ("merge(piece, empty)", full, empty)):
        acc, m, l = state_of(sub.merge(a, b), n_heads, head_dim, what)
        check_close(acc, full[0], f"{what}: acc")
        check_close(l, full[2], f"{what}: l")
    acc, m, l = state_of(sub.merge(empty, empty), n_heads, head_dim, "merge(empty, empty)")
    assert not np.any(np.isnan(acc)) and not np.any(np.isnan(l)) and np.all(np.isneginf(m)), (
        "merge(empty, empty) must stay empty (m = -inf, l = 0, acc = 0), with no NaN: "
        "exp(-inf - (-inf)) is NaN")


@points(3)
def test_each_piece_of_a_split_is_reduced(sub, rng):
    """split_states: one (acc, m, l) per np.array_split piece, empty pieces included"""
    for kind, q, keys, values in cases(rng, (5, 30)):
        (n_heads, head_dim), length = q.shape, len(keys)
        for n_splits in (1, int(rng.integers(2, 6)), length + int(rng.integers(1, 4))):
            got = sub.split_states(q, keys, values, n_splits)
            pieces = np.array_split(np.arange(length), n_splits)
            assert isinstance(got, (list, tuple)) and len(got) == n_splits, (
                f"{kind}, {length} positions in {n_splits} pieces: expected a list of "
                f"{n_splits} states, got {described(got)}")
            for i, (state, piece) in enumerate(zip(got, pieces)):
                what = f"{kind}, {length} positions in {n_splits} pieces: piece {i} ({len(piece)} positions)"
                acc, m, l = state_of(state, n_heads, head_dim, what)
                want_acc, want_m, want_l = reduce_by_hand(q, keys[piece], values[piece])
                if not len(piece):
                    assert np.all(np.isneginf(m)) and not np.any(l) and not np.any(acc), (
                        f"{what}: an empty piece is m = -inf, l = 0, acc = 0")
                    continue
                check_close(m, want_m, f"{what}: m")
                check_close(acc / l[:, None], want_acc / want_l[:, None], f"{what}: acc / l")


@points(2)
def test_any_number_of_splits_gives_the_c_cores_attention(sub, rng):
    """split_attend with 1, a few, one per position and more pieces than positions, as cache.attend"""
    for kind, q, keys, values in cases(rng, (8, 40)):
        length, want = len(keys), c_attend(q, keys, values)
        for n_splits in (1, 2, int(rng.integers(3, 8)), length, length + int(rng.integers(1, 5))):
            got = sub.split_attend(q, keys, values, n_splits)
            check_close(got, want, f"{kind}, {length} positions in {n_splits} pieces"
                                   + (" (some of them empty)" if n_splits > length else ""))
        n_splits = int(rng.integers(2, 8))
        through_the_pieces(sub, "split_attend", q, keys, values, n_splits,
                           np.array_split(np.arange(length), n_splits), rng,
                           f"{kind}, {length} positions in {n_splits} pieces")


@points(1)
def test_large_scores_do_not_overflow(sub, rng):
    """scores of about 10,000 in some pieces and small ones in others"""
    n_heads, n_kv_heads, head_dim = shapes(rng)["GQA"]
    length = 24
    keys, values = rows(rng, length, n_kv_heads, head_dim)
    keys[length // 2:] *= np.float32(100.0)                # the later pieces' scores are huge
    q = (rng.standard_normal((n_heads, head_dim)) * 100).astype(np.float32)
    want = c_attend(q, keys, values)
    for n_splits in (1, 4, 24):
        got = sub.split_attend(q, keys, values, n_splits)
        check_close(got, want, f"scores up to about 1e4, {n_splits} pieces (is each piece's max "
                               f"subtracted before exp, and the merge's?)", atol=1e-4)
    through_the_pieces(sub, "split_attend", q, keys, values, 4,
                       np.array_split(np.arange(length), 4), rng,
                       "scores up to about 1e4, 4 pieces (is the merge's max subtracted before exp?)")


@points(1)
def test_fixed_chunks_give_the_same_attention(sub, rng):
    """attend_in_chunks with chunks of 1, of a few positions, and of more than the context"""
    n_heads, n_kv_heads, head_dim = shapes(rng)["GQA"]
    length = int(rng.integers(10, 50))
    keys, values = rows(rng, length, n_kv_heads, head_dim)
    q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
    want = c_attend(q, keys, values)
    for chunk in (1, int(rng.integers(2, 9)), length - 1, length + 5):
        got = sub.attend_in_chunks(q, keys, values, chunk)
        check_close(got, want, f"{length} positions in chunks of {chunk}")
    chunk = int(rng.integers(2, 9))
    through_the_pieces(sub, "attend_in_chunks", q, keys, values, chunk,
                       [np.arange(a, min(a + chunk, length)) for a in range(0, length, chunk)],
                       rng, f"{length} positions in chunks of {chunk}")
