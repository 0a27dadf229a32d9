"""kvlab/grading/eviction.py, the cache-eviction lab's run of a policy over a text: nothing is
evicted while the budget holds the text, a drop renumbers the kept rows from 0 and hands the
policy each row's old position, H2O's scores carry every query's attention across drops,
and what a policy returns is refused, with the reason, when it cannot be rows or keys."""
import numpy as np
import pytest

pytest.importorskip("kvlab._kvlab")
import kvlab  # noqa: E402
from kvlab.grading import eviction  # noqa: E402
from kvlab.next_token_metrics import log_softmax  # noqa: E402

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and " * 4


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


class Recorder(eviction.KitFunctions):
    """kvlab's functions, with every call's arguments kept."""

    def __init__(self):
        self.rows, self.rerotations = [], []

    def heavy_hitter_rows(self, scores, n_keep, n_recent):
        rows = super().heavy_hitter_rows(scores, n_keep, n_recent)
        self.rows.append((scores.copy(), rows))
        return rows

    def rerotate(self, keys, positions, inv_freq, interleaved):
        self.rerotations.append(positions.copy())
        return super().rerotate(keys, positions, inv_freq, interleaved)


def test_a_budget_that_holds_the_text_evicts_nothing(model):
    ids = np.asarray(model.encode(TEXT))[:120]
    full = model.forward(ids, model.new_cache(len(ids)), all_logits=True)
    want = -log_softmax(full[:-1])[np.arange(len(ids) - 1), ids[1:]]
    never = lambda *args: pytest.fail("nothing should be evicted")     # noqa: E731
    got = eviction.token_losses(model, ids, len(ids), never, never, score_from=0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(eviction.token_losses(model, ids, 200, never, never, score_from=50)) == 69


def test_each_drop_renumbers_the_rows_and_carries_every_querys_attention(model):
    c = model.config
    ids = np.asarray(model.encode(TEXT))[:150]
    budget, drop = 32, eviction.drop_size(32)
    functions = Recorder()
    eviction.curve(model, ids, (budget,), "h2o", functions)
    assert len(functions.rows) == len(functions.rerotations) == -(-(len(ids) - 1 - budget) // drop)
    kept_before = None
    for (scores, rows), positions in zip(functions.rows, functions.rerotations):
        assert scores.shape == (c.n_layers, budget, c.n_kv_heads)
        # the rows were renumbered 0 .. at the last drop: a row's position is its number
        np.testing.assert_array_equal(positions, rows)
        # each query hands its KV head kv_mul of attention (8.4): the first fill's budget
        # queries, then the kept rows' carried sums and the drop's new queries
        queries = budget if kept_before is None else drop
        carried = 0.0 if kept_before is None else kept_before
        np.testing.assert_allclose(scores.sum(axis=1), carried + c.kv_mul * queries, rtol=1e-5)
        kept_before = np.take_along_axis(scores, rows, axis=1).sum(axis=1)


@pytest.mark.parametrize("rows, why", [
    (lambda length, n_keep: np.arange(n_keep) * 1.0, "integer row numbers"),
    (lambda length, n_keep: np.arange(n_keep + 1), "shape"),
    (lambda length, n_keep: np.arange(length - n_keep, length) + 1, "not in a cache"),
    (lambda length, n_keep: np.r_[0, np.arange(n_keep - 1)], "strictly increasing"),
])
def test_rows_that_are_not_rows_are_refused_with_the_reason(model, rows, why):
    class Wrong(eviction.KitFunctions):
        @staticmethod
        def sink_rows(length, n_keep, sinks):
            return rows(length, n_keep)
    ids = np.asarray(model.encode(TEXT))[:40]
    with pytest.raises(ValueError, match=why):
        eviction.curve(model, ids, (16,), "sinks", Wrong)


def test_keys_that_are_not_keys_are_refused(model):
    ids = np.asarray(model.encode(TEXT))[:40]
    for keys, why in ((lambda k: k[:, :-1], "float array of shape"), (lambda k: k * np.nan, "inf or nan"),
                      (lambda k: k.astype(np.int32), "float array")):
        class Wrong(eviction.KitFunctions):
            @staticmethod
            def rerotate(k, positions, inv_freq, interleaved, keys=keys):
                return keys(np.asarray(k))
        with pytest.raises(ValueError, match=why):
            eviction.curve(model, ids, (16,), "sinks", Wrong)
    with pytest.raises(ValueError, match="at least 2 rows"):
        eviction.token_losses(model, ids, 1, None, None)
