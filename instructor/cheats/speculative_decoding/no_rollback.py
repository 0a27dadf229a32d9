"""No rollback: the rejected drafts' K and V stay in the cache. verify's answers are right
(they come from the pass's rows), and the cache is made large enough that nothing
overflows; every pass after a rejection then attends over tokens that are not the text."""
TARGETS = ["test_rollback_keeps_only_the_accepted_drafts",
           "test_verify_leaves_the_cache_holding_the_accepted_tokens",
           "test_speculative_generation_keeps_the_greedy_tokens",
           "test_speculation_takes_fewer_passes_than_tokens"]


def rollback(cache, n_drafts, accepted):
    pass


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    prompt = [int(t) for t in prompt]
    # room for every draft ever checked, rejected or not
    cache = model.new_cache(min(len(prompt) + n_new * (k + 1), model.config.max_seq_len))
    tokens = [int(np.argmax(model.forward(prompt, cache)))]
    stats = {"passes": 1, "drafted": 0, "accepted": 0}
    while len(tokens) < n_new:
        drafts = propose(prompt + tokens, min(k, n_new - len(tokens) - 1), max_ngram)
        accepted, token = verify(model, cache, tokens[-1], drafts)
        tokens += drafts[:accepted] + [token]
        stats["passes"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
    return tokens, stats
