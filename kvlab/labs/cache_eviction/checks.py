"""Public self-checks for lab 11 (cache eviction): `kvlab check cache_eviction cache_eviction.py`.

Small fixed cases, and one short curve on the bundled model. The grade comes from hidden
tests: rotations in both layouts by drawn shifts against RoPE computed by the grader, rows
kept for drawn lengths and scores (ties and all) against kvlab's AttentionSinks and
HeavyHitters, re-rotated keys of positions each head kept on its own, and the
budget-against-perplexity curves of both policies on SmolLM2-135M against kvlab's.
"""
import numpy as np

from kvlab.grading import eviction
from kvlab.grading.testkit import bundled_model, check_close, described, points

LINE = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "


@points(1)
def test_rotate_a_quarter_and_a_half_turn(sub, rng):
    """one head, two pairs: shift 1 turns the first pair by pi/2 and the second by pi"""
    x = np.array([[1.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    inv_freq = np.array([np.pi / 2, np.pi], dtype=np.float32)
    check_close(sub.rotate(x, np.array([1]), inv_freq, True), [[0.0, 1.0, -1.0, 0.0]],
                "rotate([[1, 0, 1, 0]], shift 1, inv_freq [pi/2, pi], interleaved): (1, 0) a "
                "quarter turn is (0, 1), half a turn (-1, 0)", atol=1e-6)
    check_close(sub.rotate(x, np.array([1]), inv_freq, False), [[-1.0, 0.0, 1.0, 0.0]],
                "the same, interleaved=False: the pairs are (x[0], x[2]) = (1, 1), a quarter "
                "turn to (-1, 1), and (x[1], x[3]) = (0, 0)", atol=1e-6)


@points(1)
def test_sink_rows_of_ten(sub, rng):
    """sink_rows(10, 6, 2): rows 0, 1 and the newest 4"""
    got = sub.sink_rows(10, 6, 2)
    assert np.array_equal(got, [0, 1, 6, 7, 8, 9]), (
        f"sink_rows(10, 6, 2): expected [0, 1, 6, 7, 8, 9], got {described(got)}")


@points(1)
def test_heavy_hitters_of_one_head(sub, rng):
    """scores [5, 1, 4, 4, 0, 9, 2] (one layer and head), 4 kept, 2 of them the newest"""
    scores = np.array([5, 1, 4, 4, 0, 9, 2], dtype=np.float64)[None, :, None]
    got = sub.heavy_hitter_rows(scores, 4, 2)
    assert np.array_equal(np.asarray(got).reshape(-1), [0, 2, 5, 6]), (
        f"heavy_hitter_rows: rows 5 and 6 are the newest; of rows 0 .. 4 the 2 largest are 0 "
        f"(score 5) and 2 (4, tied with row 3: the earlier row wins): expected [0, 2, 5, 6], "
        f"got {described(got)}")


@points(1)
def test_rerotate_to_places_zero_and_one(sub, rng):
    """two keys at positions 3 and 7 become keys at positions 0 and 1"""
    inv_freq = np.array([0.5], dtype=np.float32)
    raw = np.ones((1, 2, 1, 2))
    positions = np.array([3, 7])[None, :, None]
    keys = eviction.KitFunctions.rotate(raw, positions, inv_freq, True).astype(np.float32)
    want = eviction.KitFunctions.rotate(raw, np.array([0, 1])[None, :, None], inv_freq, True)
    check_close(sub.rerotate(keys, positions, inv_freq, True), want,
                "rerotate of keys at positions 3 and 7: RoPE's keys at 0 and 1", atol=1e-5)


@points(1)
def test_sinks_on_the_bundled_model(sub, rng):
    """the bundled model over 300 characters of the play, sinks at budget 32: kvlab's perplexity"""
    model = bundled_model()
    ids = model.encode(LINE * 5)[:300]
    want = eviction.curve(model, ids, (32,), "sinks", eviction.KitFunctions)[0]
    got = eviction.curve(model, ids, (32,), "sinks", sub)[0]
    assert abs(got / want - 1) <= 1e-3, (
        f"perplexity with your sinks at budget 32: {got:.4f}, with kvlab's {want:.4f}")
