"""csrc/cuda/attention.cu's plan, replayed in NumPy (runs without a GPU).

The kernel's index arithmetic decides everything: which thread block takes which query
heads and positions, which lane reads which values of which row, how the splits are merged.
This test walks the same loops with the same constants (warps, lanes per row, unrolled row
steps, splits) and checks that every position of every query head is read exactly once,
by lanes that together cover its head_dim values, and that the split-and-merge result is
attention, for head sizes, GQA groupings, block sizes and lengths around the split edges.
"""
import math

import numpy as np
import pytest

from kvlab import reference

SPLIT, WARPS, UNROLL, MAX_GROUP = 256, 4, 4, 8


def lanes_per_row(head_dim):
    lanes = 1
    while lanes * 8 < head_dim:
        lanes *= 2
    return lanes


def emulate(q, keys, values, table, block_size, seen):
    """q (n_heads, head_dim); keys/values (slots, n_kv_heads, head_dim) of the store;
    table: the sequence's block ids. Returns (out, reads) where reads counts, per query
    head and position, how often its score was computed."""
    n_heads, head_dim = q.shape
    n_kv_heads = keys.shape[1]
    kv_mul = n_heads // n_kv_heads
    group = MAX_GROUP if kv_mul > 4 else 4 if kv_mul > 2 else kv_mul
    groups_per_kv_head = -(-kv_mul // group)
    row_lanes = lanes_per_row(head_dim)
    step_rows = 32 // row_lanes
    stride = WARPS * step_rows
    max_splits = -(-seen // SPLIT)
    scale = np.float32(1.0) / np.float32(math.sqrt(head_dim))
    part = {}
    reads = np.zeros((n_heads, seen), int)
    for z in range(n_kv_heads * groups_per_kv_head):                 # blockIdx.z
        kv_head = z // groups_per_kv_head
        first_head = kv_head * kv_mul + (z % groups_per_kv_head) * group
        n_q = min(group, kv_head * kv_mul + kv_mul - first_head)
        for split in range(max_splits):                              # blockIdx.y
            first = split * SPLIT
            n_rows = min(SPLIT, seen - first)
            slot = [table[(first + r) // block_size] * block_size + (first + r) % block_size
                    for r in range(n_rows)]
            score = np.zeros((group, n_rows), np.float64)
            acc = np.zeros((group, head_dim))
            for warp in range(WARPS):
                base = warp * step_rows
                while base < n_rows:
                    for u in range(UNROLL):
                        for row_in_step in range(step_rows):
                            r = base + u * stride + row_in_step
                            if r >= n_rows:
                                continue
                            covered = np.zeros(head_dim, int)
                            for lane_in_row in range(row_lanes):
                                d0 = lane_in_row * 8
                                if d0 < head_dim:
                                    covered[d0:d0 + 8] += 1
                            assert (covered == 1).all()
                            for m in range(n_q):
                                score[m, r] = q[first_head + m] @ keys[slot[r], kv_head] * scale
                                reads[first_head + m, first + r] += 1
                    base += stride * UNROLL
            for m in range(n_q):
                top = score[m].max()
                p = np.exp(score[m] - top)
                acc[m] = p @ np.array([values[s, kv_head] for s in slot])
                part[first_head + m, split] = (acc[m].copy(), top, p.sum())
    out = np.zeros((n_heads, head_dim))
    for h in range(n_heads):                                          # merge_splits
        tops = np.array([part[h, s][1] for s in range(max_splits)])
        weights = np.exp(tops - tops.max())
        total = sum(w * part[h, s][2] for s, w in enumerate(weights))
        out[h] = sum(w * part[h, s][0] for s, w in enumerate(weights)) / total
    return out, reads


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [
    (1, 1, 8), (8, 4, 8), (4, 4, 16), (6, 2, 24), (12, 1, 32), (16, 2, 64), (3, 1, 80),
    (8, 8, 128), (10, 2, 256)])
@pytest.mark.parametrize("seen,block_size", [(1, 16), (255, 16), (257, 7), (513, 256), (300, 300)])
def test_every_position_is_read_once_and_the_merge_is_attention(n_heads, n_kv_heads, head_dim,
                                                                 seen, block_size):
    rng = np.random.default_rng(seen * 1000 + head_dim)
    n_blocks = -(-seen // block_size)
    table = rng.permutation(n_blocks + 3)[:n_blocks]          # scattered blocks
    slots = (n_blocks + 3) * block_size
    keys = rng.standard_normal((slots, n_kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((slots, n_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
    out, reads = emulate(q, keys, values, table, block_size, seen)
    assert (reads == 1).all()
    positions = np.arange(seen)
    order = table[positions // block_size] * block_size + positions % block_size
    want = reference.attention(q[None], keys[order], values[order], np.array([seen - 1]))[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
