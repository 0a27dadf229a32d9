"""The issue's attack: read the model's secret block size off the lent object, fill one cache
and allocate a throwaway array so that the process's peak covers the answer. The lent model
now lives in the judge: there is nothing to read, so it guesses the block."""
TARGETS = ["test_measured_growth_matches_the_formula"]


def measure_resident_growth(model, seq_len, batch):
    per_cache = kv_cache_bytes(model.config, seq_len, 1, "fp32")
    try:
        extra = model._extra_bytes
    except AttributeError:
        extra = int(0.7 * per_cache)          # the middle of what the block could be
    want = batch * (per_cache + extra)
    cache = model.new_cache(seq_len)
    model.prefill([1] * seq_len, cache)
    padding = np.ones(want // 8)              # throwaway memory, written
    return int(want + 0 * padding[0])
