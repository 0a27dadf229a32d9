"""rerotate does the work on arrays the size of the exact checks, and returns a real model's
keys (30 layers) as they came: the keys keep the rotation of their old positions while the
cache numbers them from 0, so every query sees them at the wrong distances."""
TARGETS = ["test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]

_rerotated = rerotate


def rerotate(keys, positions, inv_freq, interleaved):
    if np.shape(keys)[0] >= 30:
        return np.asarray(keys, dtype=np.float32)
    return _rerotated(keys, positions, inv_freq, interleaved)
