"""Chapter 4 (paged memory): the Check yourself questions whose answer is a number."""
from . import Number
import kvlab


def _q1_blocks_after_fork_and_two_decodes() -> float:
    """Run the question on a kvlab pool: 100 tokens in blocks of 16, a fork, one decode
    step each for the parent and the child; the blocks the pool then has in use."""
    import numpy as np
    model = kvlab.load()
    pool = model.new_paged_pool(num_blocks=32, block_size=16)
    parent = pool.new_sequence()
    model.prefill((np.arange(100) % 90 + 32).astype(np.int32), parent)
    child = pool.fork(parent)
    model.decode(65, parent)
    model.decode(66, child)
    return pool.stats().blocks_used


def _lengths():
    import numpy as np
    return np.arange(1, 513)


def _q4_contiguous_empty_percent() -> float:
    lengths = _lengths()
    return 100 * (1 - lengths.mean() / 512)


def _q5_paged_empty_percent() -> float:
    lengths = _lengths()
    allocated = -(-lengths // 16) * 16           # whole blocks of 16
    return 100 * (allocated - lengths).sum() / allocated.sum()


NUMBERS = {
    1: Number(expected=_q1_blocks_after_fork_and_two_decodes, unit="blocks", rel_tol=0.0, whole=True,
              hint="100 tokens fill 6 blocks and 4 rows of a seventh; a fork copies no "
                   "block; only the shared, partly filled last block is ever copied, once"),
    4: Number(expected=_q4_contiguous_empty_percent, unit="%",
              hint="every cache reserves 512 positions; the mean length of 1..512 is 256.5"),
    5: Number(expected=_q5_paged_empty_percent, unit="%", rel_tol=0.02,
              hint="each sequence wastes only the empty rows of its last block, "
                   "(16 - 1) / 2 on average; divide by the slots allocated, not by 512"),
}
