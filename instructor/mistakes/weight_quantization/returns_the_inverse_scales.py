"""search_scales finds the right alpha but returns 1 / s, the factor the input is multiplied
by, where it must return s, what the weight columns are multiplied by: the loud channels'
columns shrink before rounding and lose precision where AWQ gives them more, and SmolLM2
in Q4_0 drifts from the float model several times further than by round to nearest."""
EXPECTED_FAILURES = ["test_search_picks_the_alpha_with_the_least_error",
                     "test_your_search_on_smollm2s_layers",
                     "test_your_scales_beat_round_to_nearest_on_smollm2"]


_search = search_scales


def search_scales(x, matrices, alphas):
    found = _search(x, matrices, alphas)
    return dict(found, scales=1 / np.asarray(found["scales"], np.float32))
