"""A prefix cache that keeps each block's tokens alone, with its position, in one set (a
hash of the block without the blocks before it), skipping the tree: match() walks the
context's blocks while each is in the set. It is right whenever no block the cache holds
comes after a parent it is not held under, and before the test drew spliced prompts
(instructor/graders/serving_capstone.py, spliced()) it passed that test on 20 draws of 20
(19 of 20 keyed by the tokens alone, without the position). Now each spliced prompt's
second block is held, at its position, after another first block: the set claims it, the
pool does not reuse it, and the run stops (100 draws of 100 caught, either way)."""
TARGETS = ["test_the_prefix_cache_answers_what_the_pools_cache_holds"]


class PrefixCache:
    def __init__(self, block_size):
        self.size, self.held = block_size, {}      # (position, block's tokens) -> holders

    def _last(self, tokens):
        n = len(tokens) // self.size - 1
        return n, tuple(tokens[n * self.size:(n + 1) * self.size])

    def insert(self, tokens):
        key = self._last(tokens)
        self.held[key] = self.held.get(key, 0) + 1

    def remove(self, tokens):
        key = self._last(tokens)
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]

    def match(self, tokens):
        n = 0
        while n + self.size < len(tokens) and \
                (n // self.size, tuple(tokens[n:n + self.size])) in self.held:
            n += self.size
        return n
