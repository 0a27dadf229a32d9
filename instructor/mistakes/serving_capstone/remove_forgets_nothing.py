"""remove() does nothing: blocks the pool evicted stay in the tree, and a later request
with the same system prompt is told they are cached. The pool's own cache decides, so no
token is wrong; the engine stops the run at the first such answer. Only the prefix cache's
test fails."""
EXPECTED_FAILURES = ["test_the_prefix_cache_answers_what_the_pools_cache_holds"]


class PrefixCache(PrefixCache):
    def remove(self, tokens):
        pass
