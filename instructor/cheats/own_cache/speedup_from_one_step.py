"""The speed-up of one step (the last) for the whole run, and the share saved from the
slopes alone: a ratio read off one point instead of summed over the steps."""
TARGETS = ["test_speedup_and_share_saved"]


def predicted_speedup(cached, uncached, prompt_len, n_new=48):
    last = prompt_len - 1 + n_new - 1
    return float((uncached[0] + uncached[1] * last) / (cached[0] + cached[1] * last))


def share_saved(cached, uncached, position):
    return 1.0 - cached[1] / uncached[1]
