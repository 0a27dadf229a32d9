"""Scans the context from the start and takes the FIRST earlier occurrence of the tail, not
the most recent one: where the tail occurred more than once, it proposes what followed
the oldest (the tokens are still the model's: only the drafts change)."""
EXPECTED_FAILURES = ["test_propose_on_crafted_contexts", "test_propose_on_random_contexts"]


def propose(tokens, k, max_ngram=3):
    tokens = [int(t) for t in tokens]
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(0, len(tokens) - n):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
