"""A block that fills up with the same tokens, after the same prefix, as a registered block
keeps its own copy: the same K and V are held twice (the registered block stays cached, or
with the sequences that hold it), and the copy, never registered, is freed, not cached."""
EXPECTED_FAILURES = ["test_only_full_blocks_are_cached",
                     "test_a_block_computed_twice_is_shared",
                     "test_streams_with_room_match_the_paged_pool",
                     "test_tight_pools_evict_like_the_paged_pool"]


class PrefixCache(PrefixCache):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.copies = {}                            # a block kept unregistered -> its hash

    def append(self, seq, tokens):
        bs, table, have = self.block_size, self.tables[seq], self.tokens[seq]
        start = len(have)
        table += [self.allocate() for _ in range(-(-(start + len(tokens)) // bs) - len(table))]
        have.extend(tokens)
        for i in range(start // bs, len(have) // bs):
            parent = None
            if i > 0:
                before = table[i - 1]
                parent = self.hash_of[before] if before in self.hash_of else self.copies[before]
            key = block_hash(parent, have[i * bs:(i + 1) * bs])
            if key in self.index:
                self.copies[table[i]] = key
            else:
                self._register(table[i], key)
