"""Only the blocks a prompt fills are registered: a block that decoding fills (append after
admit) is never hashed, so it is freed rather than cached and never found again, and a
conversation's next turn reuses its prompt but not the answer before it."""
TARGETS = ["test_only_full_blocks_are_cached",
           "test_streams_with_room_match_the_paged_pool",
           "test_requests_decoded_by_the_bundled_model"]


class PrefixCache(PrefixCache):
    admitting = False

    def admit(self, seq, prompt):
        self.admitting = True
        try:
            return super().admit(seq, prompt)
        finally:
            self.admitting = False

    def append(self, seq, tokens):
        if self.admitting:
            return super().append(seq, tokens)
        bs, table, have = self.block_size, self.tables[seq], self.tokens[seq]
        needed = -(-(len(have) + len(tokens)) // bs) - len(table)
        if needed > len(self.free_ids) + len(self.lru):
            raise OutOfBlocks(f"{needed} blocks needed")
        table += [self.allocate() for _ in range(needed)]
        have.extend(tokens)
