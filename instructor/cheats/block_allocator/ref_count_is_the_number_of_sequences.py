"""fork hands the child the parent's table and counts no reference; ref_count(block) says
how many sequences are live whenever some table holds the block: right as long as every
live sequence is a fork of one prompt, as right after the worked example's forks."""
TARGETS = ["test_fork_shares_every_block"]


class BlockAllocator(BlockAllocator):
    def fork(self, seq):
        child = self.new_sequence()
        self.tables[child] = list(self.tables[seq])
        self.lengths[child] = self.lengths[seq]
        return child

    def ref_count(self, block):
        held = any(block in table for table in self.tables.values())
        return len(self.tables) if held else 0
