"""How many blocks a length takes: the one piece of paged-cache arithmetic that Python
code does itself, in plain Python (no compiled code), so that the scheduler can use it
without the C core.

The block manager proper (tables, reference counts, the prefix cache) is C: csrc/blocks.c,
kvlab._kvlab.BlockManager. The scheduler, the engine, kvlab.measure and the pools' callers
count blocks with blocks_for before they ask it for any.
"""
from __future__ import annotations


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that n_tokens positions fill, in blocks of block_size: ceil(n_tokens /
    block_size) in whole numbers (csrc/common.h's kv_ceil_div does the same in C)."""
    return -(-n_tokens // block_size)
