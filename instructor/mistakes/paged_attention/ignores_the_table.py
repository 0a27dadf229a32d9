"""Reads block p // block_size of the pool, as if the table were 0, 1, 2, ...: right only
when the sequence's blocks happen to be the pool's first ones, in order."""
EXPECTED_FAILURES = ["test_slot", "test_gather_reads_through_a_shuffled_table",
                     "test_paged_attention_matches_contiguous_attention",
                     "test_the_last_block_is_read_only_up_to_the_length",
                     "test_a_pool_the_bundled_model_filled",
                     "test_a_forked_sequence_reads_its_shared_blocks"]

_through_the_table = paged_attend


def slot(position, block_table, block_size):
    return position // block_size, position % block_size


def paged_attend(q, key_blocks, value_blocks, block_table, length):
    in_pool_order = list(range(len(block_table)))
    return _through_the_table(q, key_blocks, value_blocks, in_pool_order, length)
