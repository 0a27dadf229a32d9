"""Public self-checks for lab 6 (attention through a block table):
`kvlab check paged_attention paged_attention.py`.

A pool of 3 blocks of 2 positions you can follow by hand. The grade comes from hidden tests:
shuffled tables over random pools, partly filled last blocks with stale rows, MHA, GQA and
MQA, and a real pool filled by the bundled model, against the C core's attention.
"""
import numpy as np

from kvlab.grading.testkit import as_array, check_close, described, points

# 3 blocks of 2 rows, 1 KV head of 2: the value of block b, row r is [10 b + r, 0]
BLOCKS = np.array([[[[10 * b + r, 0.0]] for r in range(2)] for b in range(3)], np.float32)
TABLE = [2, 0]                        # positions 0, 1 in block 2; positions 2, 3 in block 0


@points(1)
def test_blocks_and_slots(sub, rng):
    """5 positions in blocks of 2: 3 blocks, 1 unused row; position 3 of table [2, 0] is block 0, row 1"""
    assert sub.blocks_needed(5, 2) == 3, f"expected 3, got {described(sub.blocks_needed(5, 2))}"
    assert sub.unused_rows(5, 2) == 1, f"expected 1, got {described(sub.unused_rows(5, 2))}"
    got = sub.slot(3, TABLE, 2)
    assert [int(x) for x in got] == [0, 1], f"expected (0, 1), got {described(got)}"


@points(1)
def test_gather_three_positions(sub, rng):
    """table [2, 0], length 3: rows of block 2 (rows 0, 1) then block 0 (row 0)"""
    got = as_array(sub.gather(BLOCKS, TABLE, 3), "gather", shape=(3, 1, 2))
    want = np.array([[[20, 0]], [[21, 0]], [[0, 0]]], np.float32)
    assert np.array_equal(got, want), f"expected {want[:, 0, 0].tolist()} first coordinates, got {got[:, 0, 0].tolist()}"


@points(1)
def test_equal_scores_average_the_values(sub, rng):
    """a query of zeros over 3 positions: the mean of their values, block 0's row 1 left out"""
    got = sub.paged_attend(np.zeros((1, 2), np.float32), BLOCKS, BLOCKS, TABLE, 3)
    check_close(got, np.array([[(20 + 21 + 0) / 3, 0]]), "q = 0, positions 0..2 (row 1 of block 0 is "
                                                         "past the length)")
