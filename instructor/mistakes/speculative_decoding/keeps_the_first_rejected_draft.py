"""Rolls back one position too few when a draft was rejected: it keeps the K and V of the
first wrong draft (as if the correction token's slot were already filled). Later passes
then attend over a token that is not in the text, so the generation drifts from plain
decoding's, and its cache fills with stale positions: in measure's longer run they
overflow it (CacheFullError)."""
EXPECTED_FAILURES = ["test_rollback_keeps_only_the_accepted_drafts",
                     "test_verify_leaves_the_cache_holding_the_accepted_tokens",
                     "test_speculative_generation_keeps_the_greedy_tokens",
                     "test_speculation_takes_fewer_passes_than_tokens",
                     "test_measurement_reports_what_ran"]


def rollback(cache, n_drafts, accepted):
    rejected = n_drafts - accepted
    if rejected:
        rejected -= 1
    cache.truncate(cache.length - rejected)
