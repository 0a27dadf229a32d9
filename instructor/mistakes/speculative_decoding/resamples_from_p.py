"""After a rejection, draws the token from p itself rather than from the residual
max(0, p - q): the tokens p gives more than q were already kept as drafts, and drawing
them again from p counts them twice, so the rule no longer gives p."""
EXPECTED_FAILURES = ["test_the_rejection_rule_keeps_the_models_distribution",
                     "test_the_rejection_rule_case_by_case"]


def accept_or_resample(p, q, draft, rng):
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if rng.random() < p[draft] / q[draft]:
        return True, int(draft)
    return False, int(rng.choice(len(p), p=p))
