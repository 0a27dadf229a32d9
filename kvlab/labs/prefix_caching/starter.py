"""Lab 7: prefix caching for a paged pool. Fill in every function marked TODO.

Many prompts start with the same tokens (a system prompt, the earlier turns of a chat), and
the K and V of a position depend only on the tokens up to it. So a paged pool can keep the
full blocks of finished requests and hand them to a later prompt that starts the same way:
that prompt skips their prefill. This is the bookkeeping half of kvlab's prefix cache
(csrc/blocks.c) and of vLLM's: which blocks are cached, under which hash, which one to evict.
It stores no keys or values, only token ids, block ids and counts.

Check your work with:  kvlab check prefix_caching prefix_caching.py    (the public checks)
Your grade:            kvlab grade prefix_caching prefix_caching.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library (collections.OrderedDict is
handy); nothing from kvlab (this lab is about writing it yourself: the grader refuses a
file that imports kvlab).
"""


class OutOfBlocks(Exception):
    """allocate() found no free block and no cached block to evict."""


def block_hash(parent_hash, tokens):
    """The hash of a full block: of the hash of the block before it in its sequence
    (parent_hash; None for a sequence's first block) and of its own tokens (a list of
    block_size ints).

    Chaining through the parent makes the hash stand for every token from the start of the
    sequence to the block's end, which is what the block's K and V depend on: the same
    tokens after a different prefix must get a different hash. Return any hashable value
    (an int is simplest); the same arguments must always give the same value.
    """
    # TODO
    raise NotImplementedError("block_hash")


class PrefixCache:
    """A pool of `num_blocks` blocks (ids 0 .. num_blocks - 1) of `block_size` tokens, shared
    by the sequences of requests, with a prefix cache. Sequences are named by the caller
    (admit(seq, prompt) with an id not in use); a sequence is a block table (token p lives
    in block table[p // block_size]) and its tokens.

    Every block is in exactly one of three states:
      used    held by one or more block tables (its ref count is how many)
      cached  held by nobody, full, and registered under its hash: a later prompt that
              starts with the same tokens can take it back (a hit)
      free    held by nobody and not registered: it holds nothing worth keeping

    A full block of a live sequence is registered under its hash (block_hash of the hash of
    the block before it in the table, or None, and its tokens); a partly filled block never
    is. Registered blocks that nobody holds are the cached blocks, kept in LRU order: a
    block becomes the most recently used when its last holder lets go of it.

    Chapter 4, "Paged memory for the cache": chapters/04_paged.md of the course
    """

    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A suggestion (keep it or use your own):
        #   self.free = list(range(num_blocks))   free block ids
        #   self.lru = collections.OrderedDict()  cached blocks, least recently used first
        #   self.refs = [0] * num_blocks          ref count of every block
        #   self.index = {}                       hash -> registered block
        #   self.hash_of = {}                     registered block -> its hash
        #   self.tables, self.tokens = {}, {}     sequence -> block ids; -> its tokens
        #   self.hits = self.misses = 0
        # TODO

    def allocate(self):
        """A block for new tokens, with ref count 1: a free block if there is one (which
        one is up to you); else the least recently used cached block, evicted: it leaves
        the LRU order and is unregistered (its hash finds it no more). Raises OutOfBlocks if
        no block is free or cached."""
        # TODO
        raise NotImplementedError("allocate")

    def admit(self, seq, prompt):
        """Start sequence `seq` (an id not in use) on `prompt` (a list of at least one token).

        1. Reuse. The prompt's full blocks before its last token are looked up: block i is
           prompt[i * block_size:(i + 1) * block_size], for i < (len(prompt) - 1) //
           block_size (the last token is always computed, since its logits pick the next
           token). Walk them from the first, chaining the hashes; a block whose hash is
           registered is a hit: the sequence takes that block (its ref count goes up; a
           cached block becomes used and leaves the LRU order). The first block not found
           stops the walk: it and every block after it are misses, so hits + misses =
           (len(prompt) - 1) // block_size.
        2. append(seq, the rest of the prompt).

        Returns the number of tokens reused: hits * block_size.
        """
        # TODO
        raise NotImplementedError("admit")

    def append(self, seq, tokens):
        """Add `tokens` to sequence `seq`: the rest of a prompt, or a token it decoded.

        1. Take every block the longer sequence needs (allocate()) before anything else,
           so that it holds ceil(length / block_size) blocks.
        2. Then register each block that this call filled up, in order, under its hash —
           unless a block is registered under that hash already (another sequence computed
           the same prefix): then the sequence takes that block instead (its ref count goes
           up; a cached block becomes used and leaves the LRU order) and lets go of its
           own, which, held by nobody and never registered, is free.

        The grader never appends more than the free and cached blocks can hold.
        """
        # TODO
        raise NotImplementedError("append")

    def free(self, seq):
        """Sequence `seq` is done: each block of its table loses a reference, the last
        block first. A block nobody holds any more becomes cached, as the most recently
        used, if it is registered, and free if not."""
        # TODO
        raise NotImplementedError("free")

    def block_table(self, seq):
        """The block ids of sequence `seq`, in order, as a new list."""
        # TODO
        raise NotImplementedError("block_table")

    def cached_blocks(self):
        """The cached blocks' ids, least recently used (the next to be evicted) first."""
        # TODO
        raise NotImplementedError("cached_blocks")

    def stats(self):
        """A dict of five counts, named as kvlab's pool.stats() names them:
        prefix_hits, prefix_misses (over every admit so far), blocks_used, blocks_cached,
        blocks_free (now: the three add up to num_blocks)."""
        # TODO
        raise NotImplementedError("stats")
