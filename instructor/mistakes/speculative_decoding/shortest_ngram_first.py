"""Tries the n-grams from the shortest up (n = 1, 2, ..., max_ngram) and takes the first
match: the last token alone nearly always occurred before, so it proposes what followed
the latest occurrence of one token, even where the last three tokens occurred earlier."""
EXPECTED_FAILURES = ["test_propose_on_crafted_contexts", "test_propose_on_random_contexts"]


def propose(tokens, k, max_ngram=3):
    tokens = [int(t) for t in tokens]
    for n in range(1, min(max_ngram, len(tokens) - 1) + 1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
