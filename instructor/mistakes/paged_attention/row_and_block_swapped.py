"""Swaps the two halves of a slot: block table[p % block_size], row p // block_size."""
EXPECTED_FAILURES = ["test_slot", "test_gather_reads_through_a_shuffled_table"]


def slot(position, block_table, block_size):
    return int(block_table[position % block_size]), position // block_size


def gather(blocks, block_table, length):
    block_size = blocks.shape[1]
    rows = [blocks[slot(p, block_table, block_size)] for p in range(length)]
    return np.array(rows, dtype=np.float32).reshape(length, *blocks.shape[2:])
