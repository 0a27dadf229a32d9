"""verify does not roll back: the rejected drafts stay in the cache after it returns, and
the generation loop cuts them off itself. verify's answers and passes are right, and so
is every generation; only the cache verify leaves behind is not what it should be."""
TARGETS = ["test_verify_leaves_the_cache_holding_the_accepted_tokens"]


def verify(model, cache, newest, drafts):
    drafts = [int(d) for d in drafts]
    rows = model.forward([int(newest)] + drafts, cache, all_logits=True)
    picks = np.argmax(rows, axis=-1)
    accepted = 0
    while accepted < len(drafts) and picks[accepted] == drafts[accepted]:
        accepted += 1
    return accepted, int(picks[accepted])


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    prompt = [int(t) for t in prompt]
    cache = model.new_cache(len(prompt) + n_new + k)
    tokens = [int(np.argmax(model.forward(prompt, cache)))]
    stats = {"passes": 1, "drafted": 0, "accepted": 0}
    while len(tokens) < n_new:
        drafts = propose(prompt + tokens, min(k, n_new - len(tokens) - 1), max_ngram)
        accepted, token = verify(model, cache, tokens[-1], drafts)
        rollback(cache, len(drafts), accepted)          # here, not in verify
        tokens += drafts[:accepted] + [token]
        stats["passes"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
    return tokens, stats
