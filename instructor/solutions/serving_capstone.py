"""Reference solution for lab 15 (the serving capstone).

Scheduler: decodes first (one token each, so TPOT stays short), at most MAX_RUNNING requests
at once (every decode step's cost grows with the batch, and TPOT with it), prompt chunks of
at most CHUNK tokens a step, and admission that serves the requests that can still meet
their TTFT first, shortest prompt first; a request already past its TTFT goes last (it
misses the SLO whatever is done, and serving it first would make others miss too). When
blocks run out, the running request with the most blocks that is not decoding, else the
newest, is preempted. On the grader's workloads it serves twice the goodput of kvlab's
own first-come-first-served scheduler or more.
Drafter: prompt lookup that drafts only after a match of MIN_MATCH tokens or more: a draft
costs a token's work kept or not, so only confident guesses pay.
BlockAllocator: lab 5's, with truncate.
PrefixCache: a tree of blocks (each node a dict from a block's tokens to the node after
it), walked block by block; match stops before the block that holds the last token.
"""
import math

TTFT_SLO = 0.030
TPOT_SLO = 0.002
MAX_RUNNING = 8
CHUNK = 64
MIN_MATCH = 5


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


def blocks_needed(view, request, n_tokens):
    size, done = view["block_size"], request["computed"]
    return blocks_for(done + n_tokens, size) - blocks_for(done, size) + request["extra_blocks"]


class Scheduler:
    def plan(self, view):
        self.view, self.run, self.preempt = view, [], []
        self.tokens, self.free = view["max_batch_tokens"], view["free_blocks"]
        running = view["running"]
        for request in running:
            if request["pending"] == 1 and request["generated"] > 0:
                self._decode(request, running)
        prompt_room = CHUNK
        later = sorted((r for r in running if not self._decoding(r)), key=self._urgency)
        if not self.preempt and len(running) < MAX_RUNNING:
            later += sorted(view["waiting"], key=self._urgency)[:MAX_RUNNING - len(running)]
        for request in later:
            n = min(request["pending"], self.tokens, prompt_room)
            if n <= 0 or not self._fits(request, n):
                continue
            prompt_room -= n
        if not self.run and not self.preempt and running:   # nothing fits: make room
            self.preempt.append(running[-1]["id"])
        return {"run": self.run, "preempt": self.preempt}

    def _decoding(self, request):
        return request["pending"] == 1 and request["generated"] > 0

    def _urgency(self, request):
        """Those that can still make their TTFT first, the shortest first."""
        late = request["generated"] == 0 and \
            self.view["now"] - request["arrival_time"] > TTFT_SLO
        return (late, request["pending"])

    def _fits(self, request, n):
        if request["id"] in self.preempt or len(self.run) >= self.view["max_batch_seqs"]:
            return False
        need = blocks_needed(self.view, request, n)
        if need > self.free:
            return False
        self._add(request, n, need)
        return True

    def _add(self, request, n, blocks):
        self.run.append([request["id"], n])
        self.tokens -= n
        self.free -= blocks

    def _decode(self, request, running):
        if self._fits(request, 1) or request["id"] in self.preempt:
            return
        scheduled = {rid for rid, _ in self.run}
        victims = [r for r in running if r is not request and r["id"] not in scheduled
                   and r["id"] not in self.preempt]
        victims.sort(key=lambda r: (self._decoding(r), -r["blocks"]))
        while victims and blocks_needed(self.view, request, 1) > self.free:
            victim = victims.pop(0)
            self.preempt.append(victim["id"])
            self.free += victim["blocks"]
        self._fits(request, 1)


class Drafter:
    def propose(self, tokens, k):
        for n in range(min(8, len(tokens) - 1), MIN_MATCH - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []


class BlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.unused = list(range(num_blocks))
        self.holders = [0] * num_blocks          # how many tables hold each block
        self.table, self.size = {}, {}
        self.count = 0

    def new_sequence(self):
        self.count += 1
        self.table[self.count], self.size[self.count] = [], 0
        return self.count

    def _grab(self):
        block = self.unused.pop()
        self.holders[block] = 1
        return block

    def _let_go(self, blocks):
        for block in blocks:
            self.holders[block] -= 1
            if not self.holders[block]:
                self.unused.append(block)

    def append(self, seq, n_tokens):
        blocks, size = self.table[seq], self.size[seq]
        shared_tail = size % self.block_size and self.holders[blocks[-1]] > 1
        grow = math.ceil((size + n_tokens) / self.block_size) - len(blocks)
        if grow + bool(shared_tail) > len(self.unused):
            raise MemoryError(f"{grow + bool(shared_tail)} blocks wanted, "
                              f"{len(self.unused)} free")
        copies = []
        if shared_tail:
            fresh = self._grab()
            self._let_go([blocks[-1]])
            copies.append((blocks[-1], fresh))
            blocks[-1] = fresh
        blocks.extend(self._grab() for _ in range(grow))
        self.size[seq] = size + n_tokens
        return copies

    def fork(self, seq):
        child = self.new_sequence()
        self.table[child], self.size[child] = list(self.table[seq]), self.size[seq]
        for block in self.table[seq]:
            self.holders[block] += 1
        return child

    def truncate(self, seq, length):
        keep = math.ceil(length / self.block_size)
        self._let_go(self.table[seq][keep:])
        del self.table[seq][keep:]
        self.size[seq] = length

    def free(self, seq):
        self._let_go(reversed(self.table.pop(seq)))
        del self.size[seq]

    def block_table(self, seq):
        return list(self.table[seq])

    def length(self, seq):
        return self.size[seq]

    def ref_count(self, block):
        return self.holders[block]

    def num_free_blocks(self):
        return len(self.unused)


class PrefixCache:
    def __init__(self, block_size):
        self.block_size = block_size
        self.root = {}                # a block's tokens (a tuple) -> the node after it

    def _blocks(self, tokens):
        size = self.block_size
        return [tuple(tokens[i:i + size]) for i in range(0, len(tokens), size)]

    def _node_before(self, blocks):
        node = self.root
        for block in blocks[:-1]:
            node = node[block]
        return node

    def insert(self, tokens):
        blocks = self._blocks(tokens)
        self._node_before(blocks)[blocks[-1]] = {}

    def remove(self, tokens):
        blocks = self._blocks(tokens)
        del self._node_before(blocks)[blocks[-1]]

    def match(self, tokens):
        node, n = self.root, 0
        for block in self._blocks(tokens[:len(tokens) - 1]):   # the last token is run
            if len(block) < self.block_size or block not in node:
                break
            node, n = node[block], n + self.block_size
        return n
