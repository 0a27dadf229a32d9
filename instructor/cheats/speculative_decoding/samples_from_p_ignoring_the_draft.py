"""accept_or_resample never judges the draft: it draws a token from p and calls the draft
accepted when the two happen to agree. Every token comes out distributed as p, which is
what the rule is for; the rule itself, and what it saves, are skipped."""
TARGETS = ["test_the_rejection_rule_keeps_the_models_distribution",
           "test_the_rejection_rule_case_by_case"]


def accept_or_resample(p, q, draft, rng):
    p = np.asarray(p, dtype=np.float64)
    token = int(rng.choice(len(p), p=p / p.sum()))
    return token == int(draft), token
