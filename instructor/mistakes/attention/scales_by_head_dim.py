"""Divides the scores by head_dim instead of sqrt(head_dim): the softmax comes out too flat
(right only when every query is zero, or head_dim is 1; scores of 10,000 are one-hot either
way, so that test cannot see it)."""
EXPECTED_FAILURES = ["test_attend_mha",
                     "test_attend_matches_the_c_cache_of_the_mha_model",
                     "test_a_cache_filled_token_by_token_gives_the_same_attention",
                     "test_causal_rows_equal_decode_steps", "test_causal_attention_matches_the_reference"]

_scaled_by_sqrt = attend
_causal_scaled_by_sqrt = causal_attention


def attend(q, keys, values):
    return _scaled_by_sqrt(q / math.sqrt(q.shape[-1]), keys, values)


def causal_attention(q, k, v):
    return _causal_scaled_by_sqrt(q / math.sqrt(q.shape[-1]), k, v)
