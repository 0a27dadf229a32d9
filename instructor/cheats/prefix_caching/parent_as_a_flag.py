"""block_hash hashes a block's tokens with one bit of its parent (is there one?) instead of
the parent's hash: [1, 2] at the start and [1, 2] after [0, 0] differ, as the public check
asks, but equal blocks after two different prefixes are taken for one block."""
TARGETS = ["test_block_hash_chains_through_the_parent",
           "test_equal_blocks_after_different_prefixes_do_not_match"]


def block_hash(parent_hash, tokens):
    return hash((parent_hash is None, tuple(tokens)))
