"""admit counts the cached blocks a prompt could reuse (hits, misses, the tokens it reports
reused) but takes none of them: it computes the whole prompt into new blocks, which append
then swaps for their registered twins. With room to spare the books end up the same; the
blocks it took to recompute are what prefix caching saves, and on a full pool they evict
the very blocks the prompt was to reuse."""
TARGETS = ["test_a_repeated_prompt_reuses_its_full_blocks",
           "test_a_prompt_diverging_mid_block_reuses_the_blocks_before",
           "test_tight_pools_evict_like_the_paged_pool"]


class PrefixCache(PrefixCache):
    def admit(self, seq, prompt):
        bs = self.block_size
        n_full = (len(prompt) - 1) // bs
        parent, found = None, 0
        for i in range(n_full):                      # counted, never taken
            key = block_hash(parent, prompt[i * bs:(i + 1) * bs])
            if key not in self.index:
                self.misses += n_full - i
                break
            self.hits += 1
            found += 1
            parent = key
        self.tables[seq], self.tokens[seq] = [], []
        self.append(seq, prompt)
        return found * bs
