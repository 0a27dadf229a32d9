"""Lab 5: a block allocator with fork and copy-on-write. Fill in every method marked TODO.

This is the bookkeeping half of a paged pool (kvlab's C block manager, csrc/blocks.c, and
vLLM's block manager): which physical blocks each sequence's tokens live in, and how many
sequences share each block. It stores no keys or values, only block ids and counts.

Check your work with:  kvlab check block_allocator block_allocator.py    (the public checks)
Your grade:            kvlab grade block_allocator block_allocator.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing it yourself: the grader refuses a file that imports kvlab).
"""


class OutOfBlocks(Exception):
    """append() needs more free blocks than there are. The allocator is left exactly as
    it was before the call: no block taken, no table or count changed."""


def blocks_for(n_tokens, block_size):
    """Blocks that hold n_tokens positions: ceil(n_tokens / block_size)."""
    return -(-n_tokens // block_size)


class BlockAllocator:
    """A pool of `num_blocks` physical blocks (ids 0 .. num_blocks - 1) of `block_size`
    token positions each, shared by any number of sequences.

    A sequence is a block table (a list of block ids: logical block i of the sequence is
    physical block table[i]) and a length in tokens. Position p lives in block
    table[p // block_size], so a sequence of length L has exactly
    blocks_for(L, block_size) = ceil(L / block_size) blocks in its table.

    Blocks are reference counted: ref_count(b) is the number of block-table entries, over
    all live sequences, that hold b. Every block is either free (ref count 0, ready to be
    handed out) or referenced (ref count >= 1), never both. Which free block you hand out
    next is up to you.

    Chapter 4, "Paged memory for the cache": chapters/04_paged.md of the course
    """

    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A suggestion (keep it or use your own):
        #   self.free = list(range(num_blocks))  free block ids
        #   self.refs = [0] * num_blocks         ref count of every block
        #   self.tables = {}                     sequence id -> list of block ids
        #   self.lengths = {}                    sequence id -> length in tokens
        #   self.next_id = 0                     the next new sequence id
        # TODO

    def new_sequence(self):
        """A new, empty sequence (length 0, no blocks). Returns its id, an int never
        returned before by new_sequence() or fork()."""
        # TODO
        raise NotImplementedError("new_sequence")

    def append(self, seq, n_tokens):
        """Make room for n_tokens (>= 1) more tokens at the end of sequence `seq`.

        1. Copy-on-write: if the sequence's last block is shared (ref count > 1) AND only
           partly filled (length % block_size != 0), the new tokens would be written into
           rows another sequence also reads. Take a free block `dst`, put it in place of
           the shared block `src` in this sequence's table (src's ref count goes down by
           one, dst's is 1), and report the copy (src, dst): the caller copies src's rows
           into dst. A full shared block is never written again, so it stays shared.
        2. Then take one free block for each new block the longer sequence needs, so that
           the table holds ceil((length + n_tokens) / block_size) blocks.

        Blocks needed = (1 if a copy is needed else 0) + new blocks. If that is more than
        num_free_blocks(), raise OutOfBlocks and change nothing (check before you take
        anything). Otherwise the length grows by n_tokens.

        Returns the list of copies made: [] or [(src, dst)].
        """
        # TODO
        raise NotImplementedError("append")

    def fork(self, seq):
        """A new sequence that shares every block of `seq`: the same block table (a copy
        of the list, not the same list object), the same length, and every one of those
        blocks' ref counts up by one. No block is taken or copied. Returns the new id."""
        # TODO
        raise NotImplementedError("fork")

    def free(self, seq):
        """Drop sequence `seq`: each block in its table loses one reference, and a block
        whose ref count reaches 0 goes back to the free blocks. The id is not used again."""
        # TODO
        raise NotImplementedError("free")

    def block_table(self, seq):
        """The block ids of `seq`, in order, as a new list."""
        # TODO
        raise NotImplementedError("block_table")

    def length(self, seq):
        """Tokens in `seq`."""
        # TODO
        raise NotImplementedError("length")

    def ref_count(self, block):
        """How many block-table entries of live sequences hold `block` (0: it is free)."""
        # TODO
        raise NotImplementedError("ref_count")

    def num_free_blocks(self):
        """Blocks that can be handed out now."""
        # TODO
        raise NotImplementedError("num_free_blocks")
