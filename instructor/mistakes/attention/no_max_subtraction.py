"""The textbook softmax, exp(x) / sum(exp(x)): fine for small scores, inf / inf = NaN once
a score passes about 88 (float32)."""
EXPECTED_FAILURES = ["test_attend_large_scores_do_not_overflow", "test_causal_attention_matches_the_reference"]


def softmax(scores):
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)
