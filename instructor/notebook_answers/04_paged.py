"""Worked answer to notebook 04's "Your turn" (instructors only).

    from kvlab import your_turn
    your_turn.check("04_paged", pool_footprint)
"""


def pool_footprint(lengths, block_size):
    blocks = unused = 0
    for n in lengths:
        taken = -(-n // block_size)         # ceil(n / block_size): 0 for an empty sequence
        blocks += taken
        unused += taken * block_size - n    # the rows of its last block past its length
    return blocks, unused

# Each sequence leaves fewer than block_size slots empty, whatever its length: that bounded
# internal fragmentation is what paging buys over a contiguous cache of max_seq_len.
# Mistakes the check catches: n // block_size + 1 blocks (one too many when n is a multiple
# of block_size, and one for an empty sequence), block_size - n % block_size empty slots.
