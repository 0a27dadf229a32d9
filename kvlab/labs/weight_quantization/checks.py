"""Public self-checks for lab 13 (AWQ's scale search): `kvlab check weight_quantization
weight_quantization.py`.

Small cases you can follow by hand. The grade comes from hidden tests: drawn matrices and
blocks built to trip Q4_0's rounding, bit for bit against kvlab's quantizer; the scales,
errors and search on small layers drawn at grading time, and on SmolLM2-135M's own layers.
"""
import numpy as np

from kvlab.grading.testkit import as_array, check_close, described, number, points


@points(1)
def test_a_block_of_q4_0(sub, rng):
    """one block: 8 is the largest, d = -1, so x comes back as 8 - trunc(8.5 - x): -2.5 as -3, 1.5 as 1; -8 would be code 16, cut to 15 (-7)"""
    w = np.zeros((1, 32), np.float32)
    w[0, :6] = [8.0, -8.0, 0.4, 0.6, -2.5, 1.5]
    want = np.zeros((1, 32), np.float32)
    want[0, :6] = [8.0, -7.0, 0.0, 1.0, -3.0, 1.0]
    got = as_array(sub.q4_0_round_to_nearest(w), "q4_0_round_to_nearest", shape=(1, 32))
    check_close(got, want, "a block holding 8, -8, 0.4, 0.6, -2.5, 1.5 and zeros", atol=0, rtol=0)


@points(1)
def test_scales_of_alpha_0_and_1(sub, rng):
    """magnitudes 1, 4, 16: alpha 0 gives ones; alpha 1 gives 1/4, 1, 4 (divided by sqrt(16 * 1))"""
    magnitude = np.array([1.0, 4.0, 16.0], np.float32)
    check_close(sub.channel_scales(magnitude, 0.0), np.ones(3), "alpha 0", atol=0, rtol=1e-6)
    check_close(sub.channel_scales(magnitude, 1.0), np.array([0.25, 1.0, 4.0]), "alpha 1",
                atol=0, rtol=1e-6)


@points(1)
def test_output_error_of_one_weight(sub, rng):
    """x = [[1, 2]], w = [[3, 4]], stored [[3, 3]]: the output moves by 2, error 4"""
    got = number(sub.output_error(np.array([[1, 2]], np.float32), np.array([[3, 4]], np.float32),
                                  np.array([[3, 3]], np.float32)), "output_error")
    assert abs(got - 4.0) < 1e-6, f"expected 4.0, got {got}"


@points(1)
def test_search_on_a_loud_channel(sub, rng):
    """a layer whose channel 0 is 30x louder than the others: some alpha above 0 beats round to nearest"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    x[:, 0] *= 30
    w = (0.1 * rng.standard_normal((16, 64))).astype(np.float32)
    got = sub.search_scales(x, [w], [0.0, 0.25, 0.5, 0.75])
    assert isinstance(got, dict) and {"alpha", "scales", "errors"} <= set(got), (
        f"expected a dict with 'alpha', 'scales' and 'errors', got {described(got)}")
    errors = as_array(got["errors"], "errors", shape=(4,))
    assert got["alpha"] > 0 and errors.min() < errors[0], (
        f"alpha {got['alpha']}, errors {errors.tolist()}: with one loud channel, scaling it up "
        f"should lower the error below alpha 0's (round to nearest)")
    assert errors[[0.0, 0.25, 0.5, 0.75].index(got["alpha"])] == errors.min(), (
        "the alpha returned should be the one with the least error")


@points(1)
def test_fold_two_channels(sub, rng):
    """norm [2, 3], scales [2, 0.5]: the norm becomes [1, 6], the columns are scaled"""
    norm, matrices = sub.fold_into_norm(np.array([2, 3], np.float32),
                                        [np.array([[1, 1], [2, 4]], np.float32)],
                                        np.array([2, 0.5], np.float32))
    check_close(norm, np.array([1, 6]), "the norm weight", atol=0, rtol=1e-6)
    check_close(matrices[0], np.array([[2, 0.5], [4, 2]]), "the matrix", atol=0, rtol=1e-6)
