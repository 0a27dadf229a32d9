"""Speculates with prompt lookup until 3 drafts are accepted, then "drafts" a junk token at
every pass: every pass checks a draft, so a rule that only asks for drafts is met to the
letter without looking anything up. (A reviewer's attack: a draft must now be a token that
followed the text's last token somewhere in the text.)"""
TARGETS = ["test_speculation_takes_fewer_passes_than_tokens"]


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    prompt = [int(t) for t in prompt]
    cache = model.new_cache(len(prompt) + n_new + k)
    tokens = [int(np.argmax(model.forward(prompt, cache)))]
    stats = {"passes": 1, "drafted": 0, "accepted": 0}
    while len(tokens) < n_new:
        room = n_new - len(tokens)
        if stats["accepted"] < 3:
            drafts = propose(prompt + tokens, min(k, room - 1), max_ngram)
        else:
            drafts = [0] if room > 1 else []           # junk: token 0 never comes next
        accepted, token = verify(model, cache, tokens[-1], drafts)
        tokens += drafts[:accepted] + [token]
        stats["passes"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
    return tokens, stats
