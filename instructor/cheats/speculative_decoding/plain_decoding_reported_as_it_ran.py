"""generate_speculative is plain decoding, its stats truthful: n_new passes, nothing drafted.
The tokens are exactly greedy decoding's, which is what speculation must give; it just
never speculates."""
TARGETS = ["test_speculative_generation_keeps_the_greedy_tokens",
           "test_speculation_takes_fewer_passes_than_tokens",
           "test_drafts_never_pass_the_tokens_still_wanted", "test_measurement_reports_what_ran"]


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    return generate_plain(model, prompt, n_new), {"passes": n_new, "drafted": 0, "accepted": 0}
