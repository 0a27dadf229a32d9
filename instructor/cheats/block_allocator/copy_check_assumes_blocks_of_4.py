"""Copy-on-write asks whether the last block is partly filled with `length % 4`, the block
size of the worked scenarios, instead of the allocator's own block size: right whenever the
blocks hold 4 tokens, wrong copies (or writes into a shared block) for any other size."""
TARGETS = ["test_writing_into_a_shared_partly_filled_block_copies_it",
           "test_a_full_shared_block_is_not_copied",
           "test_three_samples_decoded_by_the_bundled_model",
           "test_random_operations_keep_the_invariants",
           "test_random_operations_match_the_paged_pool"]


class BlockAllocator(BlockAllocator):
    def append(self, seq, n_tokens):
        table, length = self.tables[seq], self.lengths[seq]
        copy = length % 4 != 0 and self.refs[table[-1]] > 1
        new_blocks = blocks_for(length + n_tokens, self.block_size) - len(table)
        if copy + new_blocks > len(self.free_ids):
            raise OutOfBlocks(f"{copy + new_blocks} blocks needed, {len(self.free_ids)} free")
        copies = []
        if copy:
            src, dst = table[-1], self._take()
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        for _ in range(new_blocks):
            table.append(self._take())
        self.lengths[seq] = length + n_tokens
        return copies
