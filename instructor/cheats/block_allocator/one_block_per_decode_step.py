"""append works out the blocks a sequence needs only for its first tokens (the prompt);
after that it takes one block at most per call, as one decoded token does, and the worked
example's one append that needs two (6 tokens onto 11, blocks of 4) comes from a table."""
TARGETS = ["test_append_takes_a_block_every_block_size_tokens"]

_WORKED = {(5, 4, 11, 6): 2}     # (num_blocks, block_size, length, n_tokens) -> new blocks


class BlockAllocator(BlockAllocator):
    def append(self, seq, n_tokens):
        table, length, bs = self.tables[seq], self.lengths[seq], self.block_size
        copy = length % bs != 0 and self.refs[table[-1]] > 1
        if not table:
            new_blocks = blocks_for(n_tokens, bs)
        else:
            new_blocks = _WORKED.get((self.num_blocks, bs, length, n_tokens),
                                     int(blocks_for(length + n_tokens, bs) > len(table)))
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
