"""Evicts the block cached first (first in, first out), not the one used least recently: a
hit on a cached block does not make it young again, so a system prompt every request
reuses is evicted as soon as it is the oldest block."""
EXPECTED_FAILURES = ["test_a_block_computed_twice_is_shared", "test_eviction_takes_the_least_recently_used_block",
                     "test_tight_pools_evict_like_the_paged_pool",
                     "test_requests_decoded_by_the_bundled_model"]


class PrefixCache(PrefixCache):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.born, self.clock = {}, 0               # registered block -> when

    def _register(self, block, key):
        super()._register(block, key)
        self.clock += 1
        self.born[block] = self.clock

    def _release(self, block):
        super()._release(block)
        if block in self.lru:                       # back in the order it was first cached
            self.lru = OrderedDict.fromkeys(sorted(self.lru, key=self.born.__getitem__))
