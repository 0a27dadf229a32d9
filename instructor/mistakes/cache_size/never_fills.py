"""Measures right after creating the caches: no page is taken until it is written."""
EXPECTED_FAILURES = ["test_measured_growth_matches_the_formula"]


def measure_resident_growth(model, seq_len, batch):
    kvlab.measure.release_freed_memory()
    before = kvlab.measure.resident_bytes()
    caches = [model.new_cache(seq_len) for _ in range(batch)]
    grown = kvlab.measure.resident_bytes() - before
    del caches
    return grown
