"""Keeps only the newest rows: append replaces what a layer held instead of adding to it, so
a decode step attends to itself alone."""
EXPECTED_FAILURES = ["test_the_cache_keeps_what_was_appended",
                     "test_prefill_then_decode_matches_the_uncached_run",
                     "test_greedy_tokens_are_the_same_with_and_without_the_cache",
                     "test_the_cache_holds_what_the_formula_says"]


class KVCache(KVCache):               # the solution's cache, with this append instead
    def append(self, layer, k, v):
        self.k[layer] = np.asarray(k, np.float32).copy()
        self.v[layer] = np.asarray(v, np.float32).copy()
