"""free puts every block of the sequence back on the free list, even blocks a forked
sequence still holds: they are handed out again while still in use."""
EXPECTED_FAILURES = ["test_freeing_the_parent_keeps_the_childs_blocks",
                     "test_random_operations_keep_the_invariants",
                     "test_random_operations_match_the_paged_pool",
                     "test_three_samples_decoded_by_the_bundled_model"]


class BlockAllocator(BlockAllocator):
    def free(self, seq):
        for block in self.tables.pop(seq):
            self.refs[block] -= 1
            self.free_ids.append(block)
        del self.lengths[seq]
