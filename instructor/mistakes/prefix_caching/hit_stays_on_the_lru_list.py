"""A hit takes a cached block without taking it off the LRU list: the block counts as
cached while a sequence holds it, and allocate() can evict it from under that sequence
and hand it to another."""
EXPECTED_FAILURES = ["test_a_repeated_prompt_reuses_its_full_blocks",
                     "test_only_full_blocks_are_cached",
                     "test_equal_blocks_after_different_prefixes_do_not_match",
                     "test_a_prompt_diverging_mid_block_reuses_the_blocks_before",
                     "test_eviction_takes_the_least_recently_used_block",
                     "test_a_block_computed_twice_is_shared",
                     "test_streams_with_room_match_the_paged_pool",
                     "test_tight_pools_evict_like_the_paged_pool",
                     "test_requests_decoded_by_the_bundled_model"]


class PrefixCache(PrefixCache):
    def _retain(self, block):
        self.refs[block] += 1                       # left on the LRU list

    def _release(self, block):
        self.lru.pop(block, None)
        super()._release(block)
