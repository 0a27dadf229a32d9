"""Public self-checks for lab 6 (attention through a block table):
`kvlab check paged_attention paged_attention.py`.

A pool of 3 blocks of 2 positions you can follow by hand, and a small GQA pool with a real
query. The grade comes from hidden tests: shuffled tables over random pools, partly filled
last blocks with stale rows, MHA, GQA and MQA, and a real pool filled by the bundled model,
against the C core's attention.
"""
import numpy as np

from kvlab.grading.testkit import as_array, c_attend, check_close, described, points

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
    check_close(got, np.array([[(20 + 21 + 0) / 3, 0]]), "q = 0, positions 0..2 of table [2, 0]",
                hints=[(np.array([[(20 + 21 + 0 + 1) / 4, 0]]),
                        "that is the mean of 4 rows: row 1 of block 0 is past the length, stale")])


# 4 query heads on 2 KV heads, head_dim 4; 4 blocks of 3 rows; 7 positions through table [3, 1, 0]
_POOL = np.random.default_rng(6)
GQA_KEYS = _POOL.standard_normal((4, 3, 2, 4)).astype(np.float32)
GQA_VALUES = _POOL.standard_normal((4, 3, 2, 4)).astype(np.float32)
GQA_Q = (_POOL.standard_normal((4, 4)) * 2).astype(np.float32)
GQA_TABLE = [3, 1, 0]


def attend(q, keys, values, length, kv_head, scale):
    """Attention over the table's first `length` rows, query head h reading KV head
    kv_head(h), scores q . k * scale: the right one and known mistakes, for the hints."""
    rows = [(GQA_TABLE[p // 3], p % 3) for p in range(length)]
    k, v = np.array([keys[r] for r in rows]), np.array([values[r] for r in rows])
    out = []
    for h in range(len(q)):
        scores = k[:, kv_head(h)] @ q[h] * scale
        weights = np.exp(scores - scores.max())
        out.append((weights / weights.sum()) @ v[:, kv_head(h)])
    return np.array(out)


@points(1)
def test_gqa_attention_with_a_query(sub, rng):
    """GQA, 4 query heads on 2 KV heads, a real query, 7 positions through table [3, 1, 0]: as the C core attends"""
    got = sub.paged_attend(GQA_Q, GQA_KEYS, GQA_VALUES, GQA_TABLE, 7)
    rows = [(GQA_TABLE[p // 3], p % 3) for p in range(7)]
    want = c_attend(GQA_Q, np.array([GQA_KEYS[r] for r in rows]), np.array([GQA_VALUES[r] for r in rows]))
    right, by, sqrt = (lambda h: h // 2), (lambda h: h % 2), 1 / np.sqrt(4)
    check_close(got, want, "4 query heads on 2 KV heads, 7 positions in blocks of 3, table [3, 1, 0]",
                hints=[(attend(GQA_Q, GQA_KEYS, GQA_VALUES, 7, by, sqrt),
                        "that is query head h reading KV head h % 2: it reads h // (n_heads // "
                        "n_kv_heads), so heads 0 and 1 share KV head 0"),
                       (attend(GQA_Q, GQA_KEYS, GQA_VALUES, 7, right, 1.0),
                        "that is attention with unscaled scores: divide q . k by sqrt(head_dim)"),
                       (attend(GQA_Q, GQA_KEYS, GQA_VALUES, 7, right, 1 / 4),
                        "that is scores divided by head_dim: divide by sqrt(head_dim)"),
                       (attend(GQA_Q, GQA_KEYS, GQA_VALUES, 9, right, sqrt),
                        "that is attention over all 9 rows of the 3 blocks: the last block's "
                        "rows past the length (7) are stale")])
