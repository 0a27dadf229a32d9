"""Proposes k drafts every pass, however few tokens are still wanted, and cuts the tokens to
n_new at the end: the right tokens, but the last passes run drafts that could never all be
kept (the docstring's cap: the tokens still wanted minus one)."""
EXPECTED_FAILURES = ["test_drafts_never_pass_the_tokens_still_wanted"]


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    prompt = [int(t) for t in prompt]
    cache = model.new_cache(len(prompt) + n_new + k)
    tokens = [int(np.argmax(model.forward(prompt, cache)))]
    stats = {"passes": 1, "drafted": 0, "accepted": 0}
    while len(tokens) < n_new:
        drafts = propose(prompt + tokens, k, max_ngram)
        accepted, token = verify(model, cache, tokens[-1], drafts)
        tokens += drafts[:accepted] + [token]
        stats["passes"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
    return tokens[:n_new], stats
