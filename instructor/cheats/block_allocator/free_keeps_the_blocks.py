"""free forgets the sequence but never gives its blocks back: num_free_blocks() and
ref_count() count what the live tables hold, so the numbers look right after a free, while
the blocks themselves never return to the free list and are never handed out again."""
TARGETS = ["test_freeing_the_parent_keeps_the_childs_blocks",
           "test_random_operations_keep_the_invariants",
           "test_random_operations_match_the_paged_pool",
           "test_three_samples_decoded_by_the_bundled_model"]


class BlockAllocator(BlockAllocator):
    def free(self, seq):
        del self.tables[seq], self.lengths[seq]

    def _held(self):
        return [b for table in self.tables.values() for b in table]

    def ref_count(self, block):
        return self._held().count(block)

    def num_free_blocks(self):
        return self.num_blocks - len(set(self._held()))

    def append(self, seq, n_tokens):
        table, length = self.tables[seq], self.lengths[seq]
        copy = length % self.block_size != 0 and self.ref_count(table[-1]) > 1
        new_blocks = blocks_for(length + n_tokens, self.block_size) - len(table)
        if copy + new_blocks > self.num_free_blocks():
            raise OutOfBlocks(f"{copy + new_blocks} blocks needed, "
                              f"{self.num_free_blocks()} free")
        copies = []
        if copy:
            src, dst = table[-1], self._take()
            table[-1] = dst
            copies.append((src, dst))
        for _ in range(new_blocks):
            table.append(self._take())
        self.lengths[seq] = length + n_tokens
        return copies
