"""Lab 8 reference solution (instructors only: never hand this to students)."""
import collections
import dataclasses


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


@dataclasses.dataclass
class Request:
    id: int
    prompt_len: int
    max_new_tokens: int
    generated: int = 0
    computed: int = 0

    @property
    def tokens(self):
        return self.prompt_len + self.generated

    @property
    def pending(self):
        return self.tokens - self.computed


class Scheduler:
    def __init__(self, num_blocks, block_size, max_batch_tokens, max_batch_seqs):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.requests = {}
        self.waiting = collections.deque()
        self.running = []
        self.done = []

    def add(self, request_id, prompt_len, max_new_tokens):
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError("prompt_len and max_new_tokens must be at least 1")
        longest = blocks_for(prompt_len + max_new_tokens - 1, self.block_size)
        if longest > self.num_blocks:
            raise ValueError(f"request {request_id} needs {longest} blocks; the cache has "
                             f"{self.num_blocks}")
        request = Request(request_id, prompt_len, max_new_tokens)
        self.requests[request_id] = request
        self.waiting.append(request)

    def _free(self, scheduled):
        """Free blocks, counting the tokens scheduled in this step as computed."""
        held = sum(blocks_for(r.computed + scheduled.get(r.id, 0), self.block_size)
                   for r in self.running)
        return self.num_blocks - held

    def _preempt(self, request):
        request.computed = 0                  # its cache is gone; `generated` stays
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _admit(self, batch, scheduled, budget):
        while self.waiting and budget > 0 and len(batch) < self.max_batch_seqs:
            request = self.waiting[0]
            chunk = min(request.pending, budget)
            if blocks_for(chunk, self.block_size) > self._free(scheduled):
                break                         # first come, first served: no skipping
            self.waiting.popleft()
            self.running.append(request)
            batch.append((request.id, chunk))
            scheduled[request.id] = chunk
            budget -= chunk

    def _run(self, batch):
        for request_id, n in batch:
            request = self.requests[request_id]
            request.computed += n
            if request.computed == request.tokens:
                request.generated += 1
                if request.generated == request.max_new_tokens:
                    self.running.remove(request)
                    self.done.append(request.id)

    def step(self):
        batch, scheduled = [], {}             # scheduled: request id -> tokens this step
        budget = self.max_batch_tokens
        preempted = False
        for request in list(self.running):
            if request not in self.running:   # preempted earlier in this step
                continue
            n = min(request.pending, budget)
            if n == 0 or len(batch) >= self.max_batch_seqs:
                continue
            need = (blocks_for(request.computed + n, self.block_size)
                    - blocks_for(request.computed, self.block_size))
            while need > self._free(scheduled):
                victim = self.running[-1]     # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request not in self.running:
                continue
            batch.append((request.id, n))
            scheduled[request.id] = n
            budget -= n
        if not preempted:
            self._admit(batch, scheduled, budget)
        self._run(batch)
        return batch

    # ---- looking at it (given in the starter) ---------------------------------------------

    def has_work(self):
        return bool(self.waiting or self.running)

    def waiting_ids(self):
        return [r.id for r in self.waiting]

    def running_ids(self):
        return [r.id for r in self.running]

    def finished(self):
        return list(self.done)

    def request(self, request_id):
        return self.requests[request_id]

    def num_free_blocks(self):
        return self.num_blocks - sum(blocks_for(r.computed, self.block_size)
                                     for r in self.running)
