"""append takes blocks one at a time and raises OutOfBlocks when the free list runs dry,
keeping the blocks (and the copy) it already took: a failed append leaves a half-grown
table and fewer free blocks."""
EXPECTED_FAILURES = ["test_out_of_blocks_changes_nothing",
                     "test_random_operations_keep_the_invariants",
                     "test_random_operations_match_the_paged_pool"]


class BlockAllocator(BlockAllocator):
    def append(self, seq, n_tokens):
        table, length = self.tables[seq], self.lengths[seq]
        copies = []
        if length % self.block_size != 0 and self.refs[table[-1]] > 1:
            if not self.free_ids:
                raise OutOfBlocks("no free block for the copy")
            src, dst = table[-1], self._take()
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        while len(table) < blocks_for(length + n_tokens, self.block_size):
            if not self.free_ids:
                raise OutOfBlocks("no free block left")
            table.append(self._take())
        self.lengths[seq] = length + n_tokens
        return copies
