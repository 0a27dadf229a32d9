"""generate_plain keeps no K and V between steps: each token empties the cache and runs the
whole text again, the prompt and every token so far. The tokens are greedy decoding's,
and there is one pass a token, as the count of passes expects."""
TARGETS = ["test_plain_generation_is_greedy"]


def generate_plain(model, prompt, n_new):
    cache = model.new_cache(len(prompt) + n_new)
    tokens = []
    while len(tokens) < n_new:
        cache.truncate(0)
        tokens.append(int(np.argmax(model.forward(list(prompt) + tokens, cache))))
    return tokens
