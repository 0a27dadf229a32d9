"""search_scales measures every alpha's error but skips the choice: it returns the grid's
first alpha, 0, whose scales are all 1: round to nearest, whatever the errors say."""
TARGETS = ["test_search_picks_the_alpha_with_the_least_error",
           "test_your_search_on_smollm2s_layers",
           "test_your_scales_beat_round_to_nearest_on_smollm2"]

_search = search_scales


def search_scales(x, matrices, alphas):
    found = _search(x, matrices, alphas)
    return {"alpha": alphas[0], "scales": channel_scales(np.abs(np.asarray(x)).mean(axis=0), alphas[0]),
            "errors": found["errors"]}
