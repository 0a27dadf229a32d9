"""An allocator that counts tokens and blocks but keeps no tables or shares: every block is
its own, held once."""
TARGETS = ["test_the_allocator_follows_the_pool_through_forks_drafts_and_preemptions"]


class BlockAllocator(BlockAllocator):
    def fork(self, seq):
        child = self.new_sequence()
        self.size[child] = self.size[seq]
        self.table[child] = [self._grab() for _ in self.table[seq]]
        return child

    def ref_count(self, block):
        return 1
