"""Keeps a draft when u < q[draft] / p[draft], the ratio upside down: drafts the drafter
likes more than the model are kept more often, not less, and the tokens drift towards q."""
EXPECTED_FAILURES = ["test_the_rejection_rule_keeps_the_models_distribution",
                     "test_the_rejection_rule_case_by_case"]


def accept_or_resample(p, q, draft, rng):
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if rng.random() < q[draft] / p[draft]:
        return True, int(draft)
    residual = np.maximum(p - q, 0.0)
    return False, int(rng.choice(len(p), p=residual / residual.sum()))
