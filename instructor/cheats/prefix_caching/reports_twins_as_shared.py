"""A block that fills up like a registered one keeps its own copy (no swap for the twin),
and stats() counts the pair once: blocks_used and blocks_free come out as if the sequence
held the registered block, while two blocks hold the same K and V."""
TARGETS = ["test_a_block_computed_twice_is_shared"]


class PrefixCache(PrefixCache):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.twin_of = {}                     # a block kept unregistered -> its hash

    def append(self, seq, tokens):
        bs, table, have = self.block_size, self.tables[seq], self.tokens[seq]
        start = len(have)
        needed = -(-(start + len(tokens)) // bs) - len(table)
        if needed > len(self.free_ids) + len(self.lru):
            raise OutOfBlocks(f"{needed} blocks needed")
        table += [self.allocate() for _ in range(needed)]
        have.extend(tokens)
        for i in range(start // bs, len(have) // bs):
            parent = None
            if i > 0:
                parent = self.hash_of.get(table[i - 1], self.twin_of.get(table[i - 1]))
            key = block_hash(parent, have[i * bs:(i + 1) * bs])
            if key in self.index:
                self.twin_of[table[i]] = key
            else:
                self._register(table[i], key)

    def free(self, seq):
        for block in self.tables[seq]:
            if self.refs[block] == 1:
                self.twin_of.pop(block, None)
        super().free(seq)

    def stats(self):
        stats = super().stats()
        used = {b for b, r in enumerate(self.refs) if r > 0}
        seen = {self.index.get(self.twin_of[b], b) if b in self.twin_of else b for b in used}
        stats["blocks_used"] = len(seen)
        stats["blocks_free"] = self.num_blocks - len(seen) - len(self.lru)
        return stats
