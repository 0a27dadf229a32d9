"""Keeps the newest n_keep rows and no sinks: a sliding window. On SmolLM2, which parks a
third of its attention on position 0 (chapter 8.1), the perplexity soars."""
EXPECTED_FAILURES = ["test_sink_rows_are_the_first_and_the_newest", "test_sinks_curve_on_smollm2"]


def sink_rows(length, n_keep, sinks):
    return np.arange(length - n_keep, length)
