"""Appends one token at a time, taking a block only when the token needs one: a block swapped
for its registered twin is freed before the next block is taken, so on a full pool the next
block comes from that freed copy instead of evicting a cached block (the pool, and the
docstring, take every block first)."""
EXPECTED_FAILURES = ["test_a_block_computed_twice_is_shared"]


class PrefixCache(PrefixCache):
    def append(self, seq, tokens):
        for token in tokens:
            super().append(seq, [token])
