"""Lab 6: attention through a block table. Fill in every function marked TODO.

Chapter 4 (chapters/04_paged.md of the course) keeps a sequence's K and V in fixed-size
blocks of a shared pool, anywhere in it: the sequence's block table says which. Position p
lives in block block_table[p // block_size], at row p % block_size. A decode step then
reads its keys and values block by block, through the table. Here you write that read, and
the grader compares your attention with the C core's attention over the same rows laid out
contiguously (cache.attend), for shuffled tables, lengths that do not fill the last block,
GQA, and a real pool filled by the bundled model.

One layer of the pool, as kvlab's pool.key_codes[:, layer] holds it (fp32):

    key_blocks, value_blocks    (num_blocks, block_size, n_kv_heads, head_dim)
    block_table                 the sequence's block ids, in order (a list or an int array)
    length                      the positions the sequence holds; the last block's rows past
                                length hold whatever was there before: never read them

q is one decode step's query, (n_heads, head_dim); query head h reads KV head
h // (n_heads // n_kv_heads); scores are q . k / sqrt(head_dim).

Check your work with:  kvlab check paged_attention paged_attention.py    (the public checks)
Your grade:            kvlab grade paged_attention paged_attention.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing it yourself: the grader refuses a file that imports kvlab).
"""
import math

import numpy as np


def blocks_needed(length, block_size):
    """Blocks a sequence of `length` positions takes: ceil(length / block_size)."""
    # TODO
    raise NotImplementedError("blocks_needed")


def unused_rows(length, block_size):
    """Rows the sequence's blocks hold but its positions do not fill (all in the last block):
    the paged pool's only waste, at most block_size - 1."""
    # TODO
    raise NotImplementedError("unused_rows")


def slot(position, block_table, block_size):
    """Where `position` lives: (block id, row in the block)."""
    # TODO
    raise NotImplementedError("slot")


def gather(blocks, block_table, length):
    """The sequence's rows of one layer's K (or V) in position order: (length, n_kv_heads,
    head_dim) float32, read through the table (what a kernel should NOT have to do before
    attending: see chapter 7's question 5)."""
    # TODO
    raise NotImplementedError("gather")


def paged_attend(q, key_blocks, value_blocks, block_table, length):
    """One decode step's attention, (n_heads, head_dim) float32, over the positions the
    table holds, the last block only up to `length`. Softmax over all `length` positions
    (subtract the largest score before exp). Read K and V block by block, as a kernel does:
    the grader checks the output, so gather-then-attend passes too, but it is the copy a
    paged kernel exists to avoid."""
    # TODO
    raise NotImplementedError("paged_attend")
