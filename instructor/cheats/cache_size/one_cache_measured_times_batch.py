"""Measures one filled cache and multiplies by the batch: the memory of the other caches is
counted, never taken (the issue's version: no cache at all, a throwaway array instead)."""
TARGETS = ["test_measured_growth_matches_the_formula"]


def measure_resident_growth(model, seq_len, batch):
    rng = np.random.default_rng(0)
    kvlab.measure.release_freed_memory()
    before = kvlab.measure.resident_bytes()
    cache = model.new_cache(seq_len)
    model.prefill(rng.integers(0, model.config.vocab_size, size=seq_len), cache)
    kvlab.measure.release_freed_memory()
    one = kvlab.measure.resident_bytes() - before
    return batch * one
