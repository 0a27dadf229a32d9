"""Lab 6 reference solution (instructors only: never hand this to students)."""
import math

import numpy as np


def blocks_needed(length, block_size):
    return -(-length // block_size)


def unused_rows(length, block_size):
    return blocks_needed(length, block_size) * block_size - length


def slot(position, block_table, block_size):
    return int(block_table[position // block_size]), position % block_size


def gather(blocks, block_table, length):
    block_size = blocks.shape[1]
    rows = [blocks[slot(p, block_table, block_size)] for p in range(length)]
    return np.array(rows, dtype=np.float32).reshape(length, *blocks.shape[2:])


def paged_attend(q, key_blocks, value_blocks, block_table, length):
    n_heads, head_dim = q.shape
    block_size, n_kv_heads = key_blocks.shape[1], key_blocks.shape[2]
    kv_mul = n_heads // n_kv_heads
    # (first position, block, rows used) of each block, in table order; the last is partly filled
    pieces = [(start, block_table[start // block_size], min(block_size, length - start))
              for start in range(0, length, block_size)]
    scores = np.empty((n_heads, length), dtype=np.float32)
    for start, block, rows in pieces:
        keys = key_blocks[block, :rows]                       # (rows, n_kv_heads, head_dim)
        for h in range(n_heads):
            scores[h, start:start + rows] = keys[:, h // kv_mul] @ q[h] / math.sqrt(head_dim)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    out = np.zeros((n_heads, head_dim), dtype=np.float32)
    for start, block, rows in pieces:
        values = value_blocks[block, :rows]
        for h in range(n_heads):
            out[h] += weights[h, start:start + rows] @ values[:, h // kv_mul]
    return out
