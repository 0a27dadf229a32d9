"""Lab 7 reference solution (instructors only: never hand this to students)."""
from collections import OrderedDict


class OutOfBlocks(Exception):
    """No block is free and none is cached: nothing to hand out."""


def block_hash(parent_hash, tokens):
    return hash((parent_hash, tuple(tokens)))


class PrefixCache:
    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_ids = list(range(num_blocks - 1, -1, -1))   # a stack: block 0 goes first
        self.lru = OrderedDict()      # cached blocks, least recently used first
        self.refs = [0] * num_blocks
        self.hash_of = {}             # registered block -> its hash
        self.index = {}               # hash -> registered block
        self.tables = {}
        self.tokens = {}
        self.hits = self.misses = 0

    def allocate(self):
        if self.free_ids:
            block = self.free_ids.pop()
        elif self.lru:
            block, _ = self.lru.popitem(last=False)          # the least recently used
            del self.index[self.hash_of.pop(block)]           # its hash finds it no more
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.refs[block] = 1
        return block

    def _retain(self, block):
        if self.refs[block] == 0:
            del self.lru[block]                               # cached -> used
        self.refs[block] += 1

    def _release(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.lru[block] = None                        # the most recently used end
            else:
                self.free_ids.append(block)

    def _register(self, block, key):
        self.index[key] = block
        self.hash_of[block] = key

    def admit(self, seq, prompt):
        bs = self.block_size
        table = self.tables[seq] = []
        n_full = (len(prompt) - 1) // bs                      # the last token is computed
        parent = None
        for i in range(n_full):
            key = block_hash(parent, prompt[i * bs:(i + 1) * bs])
            block = self.index.get(key)
            if block is None:
                self.misses += n_full - i
                break
            self.hits += 1
            self._retain(block)
            table.append(block)
            parent = key
        reused = len(table) * bs
        self.tokens[seq] = list(prompt[:reused])
        self.append(seq, prompt[reused:])
        return reused

    def append(self, seq, tokens):
        bs, table, have = self.block_size, self.tables[seq], self.tokens[seq]
        start = len(have)
        needed = -(-(start + len(tokens)) // bs) - len(table)
        if needed > len(self.free_ids) + len(self.lru):
            raise OutOfBlocks(f"{needed} blocks needed, "
                              f"{len(self.free_ids) + len(self.lru)} free or cached")
        table += [self.allocate() for _ in range(needed)]    # every block first ...
        have.extend(tokens)
        for i in range(start // bs, len(have) // bs):         # ... then the blocks just filled
            parent = self.hash_of[table[i - 1]] if i > 0 else None
            key = block_hash(parent, have[i * bs:(i + 1) * bs])
            twin = self.index.get(key)
            if twin is None:
                self._register(table[i], key)
            else:                           # computed twice: share the known block
                self._retain(twin)
                self._release(table[i])
                table[i] = twin

    def free(self, seq):
        for block in reversed(self.tables.pop(seq)):          # a chain's tail goes first
            self._release(block)
        del self.tokens[seq]

    def block_table(self, seq):
        return list(self.tables[seq])

    def cached_blocks(self):
        return list(self.lru)

    def stats(self):
        return {"prefix_hits": self.hits, "prefix_misses": self.misses,
                "blocks_used": sum(1 for r in self.refs if r > 0),
                "blocks_cached": len(self.lru), "blocks_free": len(self.free_ids)}
