"""A prefix cache that keeps nothing and answers that nothing is cached: the work of the
fourth part skipped. The pool's cache does hold the shared system prompts, so the first
admission it serves from them stops the run."""
TARGETS = ["test_the_prefix_cache_answers_what_the_pools_cache_holds"]


class PrefixCache:
    def __init__(self, block_size):
        pass

    def insert(self, tokens):
        pass

    def remove(self, tokens):
        pass

    def match(self, tokens):
        return 0
