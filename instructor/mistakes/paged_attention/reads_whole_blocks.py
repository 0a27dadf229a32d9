"""Reads every row of the last block, past the sequence's length: the stale rows (another
sequence's, or nobody's) join the softmax."""
EXPECTED_FAILURES = ["test_paged_attention_matches_contiguous_attention",
                     "test_the_last_block_is_read_only_up_to_the_length",
                     "test_a_pool_the_bundled_model_filled",
                     "test_a_forked_sequence_reads_its_shared_blocks"]

_up_to_the_length = paged_attend


def paged_attend(q, key_blocks, value_blocks, block_table, length):
    block_size = key_blocks.shape[1]
    whole_blocks = -(-length // block_size) * block_size
    return _up_to_the_length(q, key_blocks, value_blocks, block_table, whole_blocks)
