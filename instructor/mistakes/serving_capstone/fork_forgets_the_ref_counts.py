"""fork copies the parent's table but leaves its blocks' ref counts as they were: the
parent and the child then each think they hold the blocks alone."""
EXPECTED_FAILURES = ["test_the_allocator_follows_the_pool_through_forks_drafts_and_preemptions"]


class BlockAllocator(BlockAllocator):
    def fork(self, seq):
        child = self.new_sequence()
        self.table[child], self.size[child] = list(self.table[seq]), self.size[seq]
        return child
