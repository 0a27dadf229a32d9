"""sink_rows and heavy_hitter_rows are kvlab's own AttentionSinks and HeavyHitters
(kvlab.cache_policy), imported by name at call time past the source check: the worker never
has kvlab loaded, and refuses to load it."""
TARGETS = ["test_sink_rows_are_the_first_and_the_newest",
           "test_heavy_hitters_keep_the_newest_and_the_most_attended",
           "test_heavy_hitters_break_ties_and_count_no_row_twice",
           "test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]

import shutil as _ue                                          # noqa: E402

_sys = _ue.sys


class _Cache:
    def __init__(self, length, shape, weights=None):
        self.length, self.shape, self.attention_weights = length, shape, weights


def _policies():
    return _sys.modules["importlib"].import_module("kvlab.cache_policy")


def sink_rows(length, n_keep, sinks):
    policy = _policies().AttentionSinks(sinks, max(1, n_keep - sinks))
    return policy.keep(_Cache(length, (1, length, 1, 0)), n_keep)[0, :, 0]


def heavy_hitter_rows(scores, n_keep, n_recent):
    scores = np.asarray(scores)
    policy = _policies().HeavyHitters(n_keep + 2, n_recent + 1)
    return policy.keep(_Cache(scores.shape[1], scores.shape + (0,), scores), n_keep)
