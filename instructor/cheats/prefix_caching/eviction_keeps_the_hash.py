"""allocate() evicts the least recently used cached block but leaves its hash in the index
(a step whose effect shows only later): the stale entry still finds the block after it has
been handed out and filled with other tokens, or freed."""
TARGETS = ["test_eviction_takes_the_least_recently_used_block",
           "test_tight_pools_evict_like_the_paged_pool"]


class PrefixCache(PrefixCache):
    def allocate(self):
        if self.free_ids:
            block = self.free_ids.pop()
        elif self.lru:
            block, _ = self.lru.popitem(last=False)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.refs[block] = 1
        return block
