"""Public self-checks for lab 10 (flash-decoding): `kvlab check flash_decoding flash_decoding.py`.

Cases small enough to follow by hand. The grade comes from hidden tests: random MHA, GQA and
MQA shapes split every way, compared with the C core's attention; the pieces and the merge
on their own, empty pieces and scores large enough to overflow.
"""
import numpy as np

from kvlab.grading.testkit import as_array, check_close, points


def example(seed, length, n_kv_heads):
    """q of 2 heads of 4, and `length` positions of K and V, fixed by `seed`."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, 4)).astype(np.float32),
            rng.standard_normal((length, n_kv_heads, 4)).astype(np.float32),
            rng.standard_normal((length, n_kv_heads, 4)).astype(np.float32))


@points(1)
def test_a_piece_of_one_position(sub, rng):
    """one position: m is its score, l is 1, acc is its value"""
    q = np.array([[2.0, 0.0]], np.float32)
    keys = np.array([[[3.0, 1.0]]], np.float32)            # score 2 * 3 / sqrt(2)
    values = np.array([[[5.0, 7.0]]], np.float32)
    acc, m, l = sub.partial(q, keys, values)
    check_close(m, np.array([6 / np.sqrt(2)]), "m")
    check_close(l, np.array([1.0]), "l = exp(m - m)")
    check_close(acc, np.array([[5.0, 7.0]]), "acc = 1 * v")


@points(1)
def test_two_halves_merge_into_the_whole(sub, rng):
    """a piece of positions 0-1 merged with 2-3: the attention of all four"""
    q, keys, values = example(0, 4, 2)
    whole = sub.partial(q, keys, values)
    acc, m, l = sub.merge(sub.partial(q, keys[:2], values[:2]), sub.partial(q, keys[2:], values[2:]))
    check_close(as_array(acc, "acc") / as_array(l, "l")[:, None],
                as_array(whole[0], "acc") / as_array(whole[2], "l")[:, None],
                "acc / l of the merge against acc / l of one piece of all four positions")


@points(1)
def test_one_piece_is_plain_attention(sub, rng):
    """split_attend with 1 piece and with 3 pieces of 3 positions: softmax-weighted values"""
    q, keys, values = example(1, 3, 1)
    scores = keys[:, 0] @ q.T / 2.0                         # (positions, heads), sqrt(4) = 2
    w = np.exp(scores - scores.max(axis=0))
    want = (w / w.sum(axis=0)).T @ values[:, 0]
    for n_splits in (1, 3):
        check_close(sub.split_attend(q, keys, values, n_splits), want, f"{n_splits} piece(s)")


@points(1)
def test_more_pieces_than_positions(sub, rng):
    """3 positions in 5 pieces: the last 2 pieces are empty, and the output is unchanged"""
    q, keys, values = example(2, 3, 1)
    states = sub.split_states(q, keys, values, 5)
    assert len(states) == 5, f"expected 5 states, got {len(states)}"
    m = as_array(states[-1][1], "m of piece 4", shape=(2,))
    assert np.all(np.isneginf(m)), f"piece 4 holds no position: expected m = -inf, got {m.tolist()}"
    check_close(sub.split_attend(q, keys, values, 5), sub.split_attend(q, keys, values, 1),
                "5 pieces (2 of them empty) against 1 piece (exp(-inf - (-inf)) is NaN)")
