"""Counts the bytes of K and forgets V: half the chapter 2 formula."""
EXPECTED_FAILURES = ["test_the_cache_keeps_what_was_appended",
                     "test_the_cache_holds_what_the_formula_says"]


class KVCache(KVCache):
    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.k if a is not None)
