"""generate_speculative is plain decoding, one pass a token, and its stats are made up to
look like speculation (a third of the passes, half the drafts accepted): the tokens are
right, and nothing the function returns shows that no draft was checked."""
TARGETS = ["test_speculative_generation_keeps_the_greedy_tokens",
           "test_speculation_takes_fewer_passes_than_tokens",
           "test_drafts_never_pass_the_tokens_still_wanted", "test_measurement_reports_what_ran"]


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    tokens = generate_plain(model, prompt, n_new)
    return tokens, {"passes": n_new // 3 + 1, "drafted": n_new, "accepted": n_new // 2}
