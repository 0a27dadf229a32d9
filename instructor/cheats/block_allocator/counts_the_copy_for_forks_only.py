"""Before an append changes anything, the blocks it needs are counted with a copy only when
the sequence is a fork (a child writing into the block it shares): the worked example's
child runs out correctly, but a parent that writes first into its shared, partly filled
block takes the copy from blocks it never counted, and fails half-way."""
TARGETS = ["test_out_of_blocks_changes_nothing"]


class BlockAllocator(BlockAllocator):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.children = set()

    def fork(self, seq):
        child = super().fork(seq)
        self.children.add(child)
        return child

    def append(self, seq, n_tokens):
        table, length = self.tables[seq], self.lengths[seq]
        counted = seq in self.children and length % self.block_size != 0
        new_blocks = blocks_for(length + n_tokens, self.block_size) - len(table)
        if counted + new_blocks > len(self.free_ids):
            raise OutOfBlocks(f"{counted + new_blocks} blocks needed, "
                              f"{len(self.free_ids)} free")
        copies = []
        if length % self.block_size != 0 and self.refs[table[-1]] > 1:
            src, dst = table[-1], self._take()
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        for _ in range(new_blocks):
            table.append(self._take())
        self.lengths[seq] = length + n_tokens
        return copies
