"""search_scales takes each channel's largest |x| where AWQ takes its mean: a reasonable
choice that SmolLM2 also rewards, but not the one asked for, so the scales differ."""
EXPECTED_FAILURES = ["test_search_picks_the_alpha_with_the_least_error"]


def search_scales(x, matrices, alphas):
    x = np.asarray(x, dtype=np.float32)
    magnitude = np.abs(x).max(axis=0)
    errors = []
    for alpha in alphas:
        s = channel_scales(magnitude, alpha)
        errors.append(sum(output_error(x, w, q4_0_round_to_nearest(w * s) / s) for w in matrices))
    best = int(np.argmin(errors))
    return {"alpha": alphas[best], "scales": channel_scales(magnitude, alphas[best]),
            "errors": errors}
