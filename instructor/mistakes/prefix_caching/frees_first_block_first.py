"""free lets go of a sequence's blocks first to last: its chain's head becomes less
recently used than its tail and is evicted first, leaving cached blocks that no prompt can
reach any more, since the walk starts at the head."""
EXPECTED_FAILURES = ["test_a_block_computed_twice_is_shared", "test_eviction_takes_the_least_recently_used_block",
                     "test_tight_pools_evict_like_the_paged_pool",
                     "test_requests_decoded_by_the_bundled_model"]


class PrefixCache(PrefixCache):
    def free(self, seq):
        for block in self.tables.pop(seq):
            self._release(block)
        del self.tokens[seq]
