"""Lab 5 reference solution (instructors only: never hand this to students)."""


class OutOfBlocks(Exception):
    """append() needs more free blocks than there are; nothing was changed."""


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_ids = list(range(num_blocks - 1, -1, -1))   # a stack: block 0 goes first
        self.refs = [0] * num_blocks
        self.tables = {}
        self.lengths = {}
        self.next_id = 0

    def _take(self):
        block = self.free_ids.pop()
        self.refs[block] = 1
        return block

    def _release(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_ids.append(block)

    def new_sequence(self):
        seq, self.next_id = self.next_id, self.next_id + 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq

    def append(self, seq, n_tokens):
        table, length = self.tables[seq], self.lengths[seq]
        # work out everything first ...
        copy = length % self.block_size != 0 and self.refs[table[-1]] > 1
        new_blocks = blocks_for(length + n_tokens, self.block_size) - len(table)
        if copy + new_blocks > len(self.free_ids):
            raise OutOfBlocks(f"appending {n_tokens} tokens needs {copy + new_blocks} blocks, "
                              f"{len(self.free_ids)} are free")
        # ... then change things: from here on nothing can fail
        copies = []
        if copy:
            src, dst = table[-1], self._take()
            self._release(src)            # others still hold it: it stays referenced
            table[-1] = dst
            copies.append((src, dst))
        for _ in range(new_blocks):
            table.append(self._take())
        self.lengths[seq] = length + n_tokens
        return copies

    def fork(self, seq):
        child = self.new_sequence()
        self.tables[child] = list(self.tables[seq])
        self.lengths[child] = self.lengths[seq]
        for block in self.tables[child]:
            self.refs[block] += 1
        return child

    def free(self, seq):
        for block in reversed(self.tables.pop(seq)):
            self._release(block)
        del self.lengths[seq]

    def block_table(self, seq):
        return list(self.tables[seq])

    def length(self, seq):
        return self.lengths[seq]

    def ref_count(self, block):
        return self.refs[block]

    def num_free_blocks(self):
        return len(self.free_ids)
