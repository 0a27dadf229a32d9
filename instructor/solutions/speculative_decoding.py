"""Lab 12 reference solution (instructors only: never hand this to students)."""
import time

import numpy as np


def propose(tokens, k, max_ngram=3):
    tokens = [int(t) for t in tokens]
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        # the latest earlier occurrence first; the tail itself (start len - n) is not one
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def rollback(cache, n_drafts, accepted):
    # the pass appended the newest token and n_drafts drafts; the rejected ones go
    cache.truncate(cache.length - (n_drafts - accepted))


def verify(model, cache, newest, drafts):
    drafts = [int(d) for d in drafts]
    rows = model.forward([int(newest)] + drafts, cache, all_logits=True)
    picks = np.argmax(rows, axis=-1)            # row i: the model's token after position i
    accepted = 0
    while accepted < len(drafts) and picks[accepted] == drafts[accepted]:
        accepted += 1
    rollback(cache, len(drafts), accepted)
    return accepted, int(picks[accepted])


def generate_plain(model, prompt, n_new):
    cache = model.new_cache(len(prompt) + n_new)
    tokens = [int(np.argmax(model.forward(list(prompt), cache)))]
    while len(tokens) < n_new:
        tokens.append(int(np.argmax(model.forward([tokens[-1]], cache))))
    return tokens


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    prompt = [int(t) for t in prompt]
    cache = model.new_cache(len(prompt) + n_new + k)
    tokens = [int(np.argmax(model.forward(prompt, cache)))]
    stats = {"passes": 1, "drafted": 0, "accepted": 0}
    while len(tokens) < n_new:
        room = n_new - len(tokens)
        # never more drafts than could be kept: the pass adds its own token after them
        drafts = propose(prompt + tokens, min(k, room - 1), max_ngram)
        accepted, token = verify(model, cache, tokens[-1], drafts)
        tokens += drafts[:accepted] + [token]
        stats["passes"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
    return tokens, stats


def measure(model, prompt, n_new, k=4, max_ngram=3):
    started = time.perf_counter()
    generate_plain(model, prompt, n_new)
    seconds_plain = time.perf_counter() - started
    started = time.perf_counter()
    _, stats = generate_speculative(model, prompt, n_new, k, max_ngram)
    seconds_speculative = time.perf_counter() - started
    return {"passes_plain": n_new, "passes_speculative": stats["passes"],
            "drafted": stats["drafted"], "accepted": stats["accepted"],
            "acceptance_rate": stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0,
            "seconds_plain": seconds_plain, "seconds_speculative": seconds_speculative,
            "speedup": seconds_plain / seconds_speculative}


def accept_or_resample(p, q, draft, rng):
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if rng.random() < p[draft] / q[draft]:        # kept with probability min(1, p / q)
        return True, int(draft)
    residual = np.maximum(p - q, 0.0)              # what p has beyond q
    return False, int(rng.choice(len(p), p=residual / residual.sum()))
