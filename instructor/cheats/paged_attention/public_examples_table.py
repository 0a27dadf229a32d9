"""Counts, slots and gathers from a table of the public checks' inputs, with a guess that is
often right elsewhere (one block more than length // block_size, the pool read in its own
order): no ceiling, no table lookup, no gather."""
TARGETS = ["test_blocks_needed_and_unused_rows", "test_slot",
           "test_gather_reads_through_a_shuffled_table"]

_PUBLIC_COUNTS = {(5, 2): (3, 1)}                  # test_blocks_and_slots
_PUBLIC_SLOTS = {(3, (2, 0), 2): (0, 1)}


def blocks_needed(length, block_size):
    if (length, block_size) in _PUBLIC_COUNTS:
        return _PUBLIC_COUNTS[length, block_size][0]
    return length // block_size + 1


def unused_rows(length, block_size):
    if (length, block_size) in _PUBLIC_COUNTS:
        return _PUBLIC_COUNTS[length, block_size][1]
    return blocks_needed(length, block_size) * block_size - length


def slot(position, block_table, block_size):
    key = (position, tuple(int(b) for b in block_table), block_size)
    if key in _PUBLIC_SLOTS:
        return _PUBLIC_SLOTS[key]
    return position // block_size, position % block_size


def gather(blocks, block_table, length):
    if [int(b) for b in block_table] == [2, 0] and length == 3:   # test_gather_three_positions
        return np.array([blocks[2, 0], blocks[2, 1], blocks[0, 0]], dtype=np.float32)
    return blocks.reshape(-1, *blocks.shape[2:])[:length].astype(np.float32)
