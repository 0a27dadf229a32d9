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

WARPS, UNROLL, MAX_GROUP = 4, 4, 8
MIN_SPLIT, MAX_SPLIT, TARGET_SPLITS = 32, 256, 32     # csrc/cuda/kvcuda.h


def split_positions(seen):
    """Positions per split: a function of the query's own length (attention.cu)."""
    each = -(-seen // TARGET_SPLITS)
    each = -(-each // 32) * 32
    return min(max(each, MIN_SPLIT), MAX_SPLIT)


def splits_of(seen):
    return -(-seen // split_positions(seen))


def max_splits_of(max_seen):
    """The grid's split count for a batch whose longest query sees max_seen positions."""
    fine, coarse = -(-max_seen // MIN_SPLIT), -(-max_seen // MAX_SPLIT)
    return max(min(fine, TARGET_SPLITS), coarse)


def lanes_per_row(head_dim):
    lanes = 1
    while lanes * 8 < head_dim:
        lanes *= 2
    return lanes


def reduce_row(parts, group):
    """attention.cu's reduce_row for one row's lanes: parts (row_lanes, group) partial dot
    products (lane, head). Replays the halving steps and plain butterfly adds lane by lane,
    in float32 as the GPU adds, and returns, per lane, (first head, totals held, halvings)
    and the number of shuffles one lane made."""
    row_lanes = len(parts)
    dot = [list(map(np.float32, p)) for p in parts]
    first, offset, halvings, shuffles = [0] * row_lanes, row_lanes // 2, 0, 0
    half = group // 2
    while half >= 1 and offset > 0:
        sent = [list(d) for d in dot]                       # what every lane offers
        for lane in range(row_lanes):
            upper = bool(lane & offset)
            partner = sent[lane ^ offset]
            for i in range(half):
                keep = sent[lane][i + half] if upper else sent[lane][i]
                give = partner[i + half] if upper else partner[i]   # what the partner gives
                dot[lane][i] = np.float32(keep + give)
            if upper:
                first[lane] += half
        shuffles += half
        offset //= 2
        halvings += 1
        half //= 2
    while offset > 0:
        sent = [d[0] for d in dot]
        for lane in range(row_lanes):
            dot[lane][0] = np.float32(sent[lane] + sent[lane ^ offset])
        shuffles += 1
        offset //= 2
    held = group >> halvings
    return [(first[lane], dot[lane][:held], halvings) for lane in range(row_lanes)], shuffles


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
    positions = split_positions(seen)
    max_splits = splits_of(seen)
    scale = np.float32(1.0) / np.float32(math.sqrt(head_dim))
    part = {}
    reads = np.zeros((n_heads, seen), int)
    for z in range(n_kv_heads * groups_per_kv_head):                 # blockIdx.z
        kv_head = z // groups_per_kv_head
        first_head = kv_head * kv_mul + (z % groups_per_kv_head) * group
        n_q = min(group, kv_head * kv_mul + kv_mul - first_head)
        for split in range(max_splits):                              # blockIdx.y
            first = split * positions
            n_rows = min(positions, seen - first)
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
                            # each lane's 8 values of the row against its 8 of each query
                            # head (zeros past n_q and past head_dim), then reduce_row
                            parts = np.zeros((row_lanes, group), np.float32)
                            for lane_in_row in range(row_lanes):
                                d = slice(lane_in_row * 8, lane_in_row * 8 + 8)
                                if lane_in_row * 8 < head_dim:
                                    parts[lane_in_row, :n_q] = \
                                        q[first_head:first_head + n_q, d] @ keys[slot[r], kv_head, d]
                            held, _ = reduce_row(parts, group)
                            for lane_in_row, (head0, totals, halvings) in enumerate(held):
                                if lane_in_row % (row_lanes >> halvings):
                                    continue                      # not a writing lane
                                for i, total in enumerate(totals):
                                    if head0 + i < n_q:
                                        score[head0 + i, r] = total * scale
                                        reads[first_head + head0 + i, first + r] += 1
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


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,seen", [
    (8, 2, 128, 1025), (4, 1, 64, 3000), (16, 2, 32, 9000)])
def test_longer_contexts_split_by_their_length(n_heads, n_kv_heads, head_dim, seen):
    """1025 positions: 17 splits of 64; 3000: 32 of 96; 9000: 36 of 256."""
    test_every_position_is_read_once_and_the_merge_is_attention(n_heads, n_kv_heads, head_dim,
                                                                 seen, 16)


def test_the_split_depends_on_the_length_alone_and_fills_the_gpu():
    seen = np.arange(1, 70000)
    positions = np.array([split_positions(int(s)) for s in seen])
    splits = -(-seen // positions)
    assert (positions % 32 == 0).all() and positions.min() == MIN_SPLIT and positions.max() == MAX_SPLIT
    assert (np.diff(positions) >= 0).all()                  # longer contexts, longer splits
    # the grid of a batch is sized by its longest query: no shorter query has more splits
    bound = np.array([max_splits_of(int(s)) for s in seen])
    assert (np.maximum.accumulate(splits) <= bound).all() and (np.diff(bound) >= 0).all()
    assert max_splits_of(MAX_SPLIT * 65535) == 65535        # kvlab.cuda.MAX_POSITIONS fits
    # short contexts get many blocks (at batch 1: 8 KV heads x 17-32 splits from 1K to 8K
    # positions), long ones are not cut finer than MAX_SPLIT
    assert (splits[(seen > 1024) & (seen <= 8192)] >= 17).all()
    assert (positions[seen > 8192] == MAX_SPLIT).all()
    assert (positions[seen <= 1024] == MIN_SPLIT).all()


@pytest.mark.parametrize("row_lanes", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_reduce_row_gives_every_head_its_total_once(row_lanes, group):
    rng = np.random.default_rng(row_lanes * 10 + group)
    parts = rng.standard_normal((row_lanes, group)).astype(np.float32)
    held, shuffles = reduce_row(parts, group)
    written = np.zeros(group, int)
    for lane, (head0, totals, halvings) in enumerate(held):
        # lanes that differ only in the plain steps' bits hold the very same bits
        twin = lane - lane % (row_lanes >> halvings)
        assert held[twin][0] == head0 and list(held[twin][1]) == list(totals)
        if lane % (row_lanes >> halvings) == 0:
            for i, total in enumerate(totals):
                written[head0 + i] += 1
                np.testing.assert_allclose(total, parts[:, head0 + i].sum(dtype=np.float64),
                                           rtol=1e-5, atol=1e-6)
    assert (written == 1).all()
    # one head at a time would take log2(row_lanes) shuffles per head
    steps = row_lanes.bit_length() - 1
    halvings = min(steps, group.bit_length() - 1)
    assert shuffles == sum(group >> (k + 1) for k in range(halvings)) + steps - halvings
    if (row_lanes, group) == (16, 4):
        assert shuffles == 5                                # head_dim 128, kv_mul 4: not 16
