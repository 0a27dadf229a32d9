"""Numbers the kept keys from 1, not 0: each goes to position i + 1, and the newest kept key
lands on the position the next token comes at. Distances between kept keys are right; each
key is a step too close to every later query, and at small budgets that shows."""
EXPECTED_FAILURES = ["test_rerotate_puts_each_kept_key_at_its_place",
                     "test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]


def rerotate(keys, positions, inv_freq, interleaved):
    slots = np.arange(1, np.shape(keys)[1] + 1)[None, :, None]
    return rotate(keys, slots - np.asarray(positions), inv_freq, interleaved)
