"""The drafter looks for the tail's earlier occurrence after the tail itself (the range runs
the wrong way), so it never finds one and never drafts. Its goodput is its scheduler's
alone, which is the reference's: only the drafter's own test fails."""
EXPECTED_FAILURES = ["test_the_drafter_guesses_what_the_model_says"]


class Drafter(Drafter):
    def propose(self, tokens, k):
        for n in range(min(8, len(tokens) - 1), MIN_MATCH - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n + 1, len(tokens)):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []
