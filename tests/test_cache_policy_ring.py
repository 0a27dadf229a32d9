"""The contiguous cache's ring of rows (csrc/kvcache.c, kv_cache_keep): a policy that drops
rows turns the ring instead of moving every kept row, and nothing a student or a policy sees
changes: the same logits, bit for bit, as the same cache straightened after every step (row
i in slot i, the layout before the ring), and views, positions and attention weights in
row order, oldest first, however many times the ring went round."""
import numpy as np
import pytest

import kvlab
from kvlab.cache_policy import AttentionSinks, HeavyHitters, SlidingWindow
from policy_reference import masked_forward, window_mask


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def ids(model):
    """120 token ids: through 8 rows, 14 turns of the ring."""
    text = ("MENENIUS: Either you must confess yourselves wondrous malicious, or be accused "
            "of folly. I shall tell you a pretty tale: it may be you have heard it.")
    return model.encode(text)[:120]


def token_by_token(policy, model, ids, cache, straighten=False):
    """Every token's logits, one forward call each; straighten: read cache.key_codes after
    every call, which turns the ring back so that row i is in slot i."""
    out = []
    for token in ids:
        out.append(policy.forward(model, [token], cache))
        if straighten:
            cache.key_codes
    return np.stack(out)


@pytest.mark.parametrize("policy", [SlidingWindow(8), SlidingWindow(1), AttentionSinks(2, 6),
                                    HeavyHitters(8), HeavyHitters(10, recent=3)])
@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_a_ring_that_goes_round_many_times_gives_the_bits_of_rows_in_order(model, ids, policy,
                                                                            dtype):
    """120 tokens through 8 rows: the ring goes round 14 times. Attention visits the rows
    oldest first, as it did when they were moved to the front, so the logits, the positions
    and the attention sums are the same bits as a cache straightened after every step."""
    ring = policy.new_cache(model, dtype)
    straight = policy.new_cache(model, dtype)
    got = token_by_token(policy, model, ids, ring)
    want = token_by_token(policy, model, ids, straight, straighten=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ring.positions, straight.positions)
    if policy.tracks_attention:
        np.testing.assert_array_equal(ring.attention_weights, straight.attention_weights)


@pytest.mark.parametrize("policy, visible", [(SlidingWindow(8), window_mask(8)),
                                             (AttentionSinks(2, 6), window_mask(6, sinks=2))])
def test_a_ring_attends_to_exactly_the_kept_positions(model, ids, policy, visible):
    """The NumPy model of a window (kvlab.reference with a mask), after many turns."""
    cache = policy.new_cache(model)
    got = policy.forward(model, ids, cache, all_logits=True)
    np.testing.assert_allclose(got, masked_forward(model, ids, visible), rtol=2e-4, atol=2e-4)


def test_a_window_moves_no_row(model, ids):
    """A view read before a step shows, after it, every row where it was but the oldest,
    whose slot now holds the new token's row: the window turned the ring, moving nothing.
    (Rows moved to the front would show up one place earlier in the old view.)"""
    policy = SlidingWindow(8)
    cache = policy.new_cache(model)
    policy.forward(model, ids[:20], cache)
    before = cache.keys                 # rows in order, row i in slot i
    old = before.copy()
    policy.forward(model, ids[20:21], cache)
    np.testing.assert_array_equal(before[:, 1:], old[:, 1:])
    assert not np.array_equal(before[:, 0], old[:, 0])
    newest = cache.dequantized()[0][:, -1]     # a copy, rows in order: the ring stays turned
    np.testing.assert_array_equal(before[:, 0], newest)
    cache.keys                                  # turns the ring back, under the old view too
    np.testing.assert_array_equal(before[:, -1], newest)


def test_views_after_many_turns_show_rows_oldest_first(model, ids):
    """After 14 turns: positions are the newest 8, oldest first; dequantized() (a copy that
    turns nothing) equals keys and values (which turn the ring back); layer 0's keys are the
    full cache's rows at those positions; and reading them changes no later logit."""
    policy = SlidingWindow(8)
    cache, twin = policy.new_cache(model), policy.new_cache(model)
    policy.forward(model, ids[:-3], cache)
    policy.forward(model, ids[:-3], twin)
    n = len(ids) - 3
    want = np.arange(n - 8, n)
    assert (cache.positions == want[None, :, None]).all()
    keys, values = cache.dequantized()
    np.testing.assert_array_equal(cache.keys, keys)
    np.testing.assert_array_equal(cache.values, values)
    assert (cache.positions == want[None, :, None]).all()
    full = model.new_cache(len(ids))
    model.forward(ids[:n], full)
    np.testing.assert_array_equal(cache.keys[0], full.keys[0, n - 8:n])
    np.testing.assert_array_equal(policy.forward(model, ids[-3:], cache, all_logits=True),
                                  policy.forward(model, ids[-3:], twin, all_logits=True))


def test_h2o_reads_its_sums_in_row_order_on_a_turned_ring(model, ids):
    """HeavyHitters ranks rows by cache.attention_weights, which must come in the order of
    cache.positions whatever the ring's turn: a sinks keep turns it, then each H2O step
    checks that the weights it read are those of the straightened cache."""
    cache = model.new_cache(10)
    cache.track_attention(True)
    model.forward(ids[:10], cache)
    rows = np.concatenate([[0], np.arange(2, 10)]).astype(np.int32)   # row 1 goes: the ring turns
    cache.keep(np.ascontiguousarray(np.broadcast_to(rows[None, :, None],
                                                    (cache.shape[0], 9, cache.shape[2]))))
    weights, positions = cache.attention_weights, cache.positions
    assert list(positions[0, :, 0]) == [0, *range(2, 10)]
    cache.keys                                                          # straightened
    np.testing.assert_array_equal(cache.attention_weights, weights)
    np.testing.assert_array_equal(cache.positions, positions)


def test_refusals_and_truncation_on_a_turned_ring(model, ids):
    """A keep refused on a turned ring changes nothing (the next logits equal a twin's that
    never saw it); truncate takes back the newest rows of a ring as of any cache."""
    policy = SlidingWindow(8)
    cache, twin = policy.new_cache(model), policy.new_cache(model)
    policy.forward(model, ids[:50], cache)
    policy.forward(model, ids[:50], twin)
    positions, (keys, values) = cache.positions, cache.dequantized()
    backwards = np.ascontiguousarray(np.broadcast_to(np.arange(7, 0, -1, dtype=np.int32)[None, :, None],
                                                     (cache.shape[0], 7, cache.shape[2])))
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(backwards)
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(backwards[:, ::-1] + 1)           # rows 2 .. 8: 8 is past the last row
    assert cache.length == 8 and cache.next_position == 50
    np.testing.assert_array_equal(cache.positions, positions)
    np.testing.assert_array_equal(cache.dequantized()[0], keys)
    np.testing.assert_array_equal(cache.dequantized()[1], values)
    np.testing.assert_array_equal(policy.forward(model, ids[50:60], cache, all_logits=True),
                                  policy.forward(model, ids[50:60], twin, all_logits=True))
    # truncate: the newest row goes, and its token again sees the same rows, 54 .. 61
    again = policy.forward(model, ids[60:62], cache, all_logits=True)
    cache.truncate(7)
    assert cache.next_position == 61 and list(cache.positions[0, :, 0]) == list(range(54, 61))
    np.testing.assert_array_equal(policy.forward(model, ids[61:62], cache), again[1])
