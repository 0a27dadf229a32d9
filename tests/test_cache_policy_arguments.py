"""Cache policies' arguments and a policy's own keep() are checked where they enter (issue 35).

Cases tried, and what each now gives:
  * every size argument of every policy (SlidingWindow window; AttentionSinks sinks,
    window; HeavyHitters budget, recent; SnapKV budget, observation, kernel) and
    make_policy's budget: a bool, a float (2.5 and 2.0), a string, None, NaN ->
    ArgumentTypeError (a TypeError and a ValueError) naming the argument; 0, negatives ->
    ValueError "must be at least"; 2**31 and 10**30 -> ValueError "must be at most" (a C
    int), all when the policy is made, before any cache exists. NumPy integers are taken.
  * SnapKV(kernel=10**8) on a 25-token prompt: before, 4.47 GiB asked of NumPy after the
    prompt had run into the cache; now the smoothing uses running sums, memory for the
    prompt's rows whatever the kernel (peak under 1 MiB here), and the same rows are kept
    as with the old kernel-copies smoothing for every kernel tried (1 .. 60).
  * a policy subclass whose keep() returns floats, bools, the wrong shape, a row beyond
    the cache, a negative row, or an int64 row that a cast to int32 would wrap onto a real
    row (2**32 + 3): TypeError / ValueError naming the policy, and the cache unchanged.
  * make_policy with a name that is not a string: ArgumentTypeError; an unknown name:
    ValueError (as before).
"""
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvlab
from kvlab.arguments import ArgumentTypeError
from kvlab.cache_policy import (AttentionSinks, HeavyHitters, SlidingWindow, SnapKV,
                                make_policy, most_attended, newest_rows, smoothed)


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def ids(model):
    return model.tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?")


MAKERS = {
    "SlidingWindow.window": lambda v: SlidingWindow(v),
    "AttentionSinks.sinks": lambda v: AttentionSinks(v, 8),
    "AttentionSinks.window": lambda v: AttentionSinks(4, v),
    "HeavyHitters.budget": lambda v: HeavyHitters(v),
    "HeavyHitters.recent": lambda v: HeavyHitters(2**20, recent=v),
    "SnapKV.budget": lambda v: SnapKV(v, observation=1),
    "SnapKV.observation": lambda v: SnapKV(2**20, observation=v),
    "SnapKV.kernel": lambda v: SnapKV(8, observation=4, kernel=v),
    "make_policy.budget": lambda v: make_policy("window", v),
}


@pytest.mark.parametrize("where", list(MAKERS))
def test_every_size_refuses_bools_floats_strings_and_c_overflow(where):
    make, name = MAKERS[where], where.split(".")[1]
    for bad in (True, False, 2.5, 2.0, "4", None, float("nan"), np.float64(3)):
        if bad is None and name == "recent":
            continue                                   # None: the default, half the budget
        with pytest.raises(ArgumentTypeError, match=f"{name} must be an integer"):
            make(bad)
    for bad in (0, -1, -2**40):
        with pytest.raises(ValueError, match=f"{name} must be at least"):
            make(bad)
    for bad in (2**31, 10**30):
        with pytest.raises(ValueError, match=f"{name} must be at most"):
            make(bad)
    make(np.int64(8))                                  # NumPy integers are integers


@settings(max_examples=60, deadline=None)
@given(where=st.sampled_from(list(MAKERS)),
       value=st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                       st.booleans(), st.text(max_size=3), st.none()))
def test_fuzzed_sizes_make_a_policy_or_a_value_error(where, value):
    try:
        policy = MAKERS[where](value)
    except ValueError:                                 # ArgumentTypeError included
        return
    assert (isinstance(value, int) and not isinstance(value, bool)) or \
        (value is None and where == "HeavyHitters.recent")
    assert 1 <= policy.budget <= 2**31 - 1


def test_make_policy_refuses_a_name_that_is_not_a_string():
    with pytest.raises(ArgumentTypeError, match="name is a string"):
        make_policy(None, 8)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru", 8)
    with pytest.raises(ValueError, match="budget must be at least 2"):
        make_policy("sinks", 1)


def _old_smoothed(older, kernel):
    """SnapKV's smoothing as it was: kernel shifted copies of the padded rows."""
    pad = kernel // 2
    padded = np.pad(older, ((0, 0), (pad, kernel - 1 - pad), (0, 0)), mode="edge")
    return np.stack([padded[:, i:i + older.shape[1], :] for i in range(kernel)]).mean(0)


def test_snapkv_smoothing_keeps_the_same_rows_with_memory_for_the_prompt_only(model, ids):
    cache = model.new_cache(len(ids))
    cache.track_attention(True)
    model.forward(ids, cache)
    older = cache.attention_weights[:, :len(ids) - 4, :]
    for kernel in (1, 2, 3, 5, 8, 13, 31, 60):
        np.testing.assert_allclose(smoothed(older, kernel), _old_smoothed(older, kernel),
                                   rtol=1e-5, atol=1e-9)
        np.testing.assert_array_equal(most_attended(smoothed(older, kernel), 10),
                                      most_attended(_old_smoothed(older, kernel), 10))
    rng = np.random.default_rng(0)
    for n, kernel in ((1, 7), (2, 1), (5, 4), (9, 100)):
        w = rng.random((2, n, 3)).astype(np.float32)
        np.testing.assert_allclose(smoothed(w, kernel), _old_smoothed(w, kernel), rtol=1e-6)


def test_a_huge_snapkv_kernel_needs_no_huge_allocation(model, ids):
    prompt = ids[:25]
    policy = SnapKV(8, observation=4, kernel=10**8)
    cache = policy.new_cache(model, max_seq_len=64)
    tracemalloc.start()
    try:
        policy.forward(model, prompt, cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"SnapKV(kernel=10**8) allocated {peak:,} bytes"
    assert cache.length == 8 and cache.next_position == 25
    # the rows kept are the ones a kernel of the prompt's size keeps: past 2n - 1 rows the
    # window covers every row, and more of it only repeats the edge rows
    same = SnapKV(8, observation=4, kernel=2 * 21 - 1)
    other = same.new_cache(model, max_seq_len=64)
    same.forward(model, prompt, other)
    np.testing.assert_array_equal(cache.positions, other.positions)


class Junk(SlidingWindow):
    """A policy whose keep() returns whatever it is told."""

    def __init__(self, window, rows):
        super().__init__(window)
        self.rows = rows

    def keep(self, cache, n_keep):
        good = newest_rows(cache.length, n_keep, cache)
        return self.rows(good)


@pytest.mark.parametrize("rows, error, match", [
    (lambda good: good.astype(np.float64), TypeError, "integer row indices"),
    (lambda good: good + 0.5, TypeError, "integer row indices"),
    (lambda good: good.astype(bool), TypeError, "integer row indices"),
    (lambda good: good[:, 1:], ValueError, "shaped"),
    (lambda good: good.tolist()[0], ValueError, "shaped"),
    (lambda good: good + 1, ValueError, "returned row 8"),
    (lambda good: good - 10, ValueError, "returned row -"),
    (lambda good: np.where(good == good.max(), good.astype(np.int64) + 2**32, good),
     ValueError, "returned row 4294967303"),
])
def test_a_policys_own_rows_are_checked_before_the_cache_moves(model, ids, rows, error, match):
    policy = Junk(8, rows)
    cache = policy.new_cache(model)
    policy.forward(model, ids[:8], cache)             # full, nothing dropped yet
    keys, positions = cache.keys.copy(), cache.positions.copy()
    with pytest.raises(error, match=match):
        policy.forward(model, ids[8:10], cache)
    assert cache.length == 8 and cache.next_position == 8
    np.testing.assert_array_equal(cache.positions, positions)
    np.testing.assert_array_equal(cache.keys, keys)
