"""Lab 8: a batching scheduler with preemption. Write Scheduler.add and Scheduler.step.

A continuous-batching server decides, every step, which requests run and with how many
tokens. This is that decision, on its own: no model, no tensors, only counts of tokens
and of KV-cache blocks. The rules are kvlab's own scheduler's (kvlab/scheduler.py) for
requests of one sample each, without a prefix cache.

Check your work with:  kvlab check scheduler scheduler.py    (the public checks)
Your grade:            kvlab grade scheduler scheduler.py    (your course runs hidden tests)
You may import numpy, math and Python's standard library; nothing from kvlab (this lab is
about writing it yourself: the grader refuses a file that imports kvlab).
"""
import collections
import dataclasses


def blocks_for(n_tokens, block_size):
    """KV blocks that hold n_tokens positions: ceil(n_tokens / block_size)."""
    return -(-n_tokens // block_size)


@dataclasses.dataclass
class Request:
    """One request: a prompt of prompt_len tokens, then max_new_tokens generated ones.

    generated: tokens generated so far. They are the request's output and are never lost,
               not even when the request is preempted.
    computed:  tokens whose K and V are in the cache. 0 while waiting (a preempted
               request's cache is freed), then it grows as the request runs.
    The request's tokens are its prompt followed by what it generated; `pending` of them
    still have to go through the model. A running request holds
    blocks_for(computed, block_size) blocks of the cache.
    """
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
    """Waiting and running queues over a cache of num_blocks blocks of block_size tokens.

    Each step runs one batch of at most max_batch_tokens tokens and max_batch_seqs
    entries. Keep the fields set up in __init__ up to date: the grader reads them through
    the methods at the end of the class (already written).

    Chapter 5, "Batching and scheduling": chapters/05_batching.md of the course
    """

    def __init__(self, num_blocks, block_size, max_batch_tokens, max_batch_seqs):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.requests = {}                   # request id -> Request
        self.waiting = collections.deque()   # Requests waiting to run, the next one first
        self.running = []                    # running Requests, oldest admission first
        self.done = []                       # ids of finished requests, in finishing order

    def add(self, request_id, prompt_len, max_new_tokens):
        """A new request joins the END of the waiting queue.

        Raise ValueError (and add nothing) if prompt_len < 1 or max_new_tokens < 1, or if
        the request could never run even alone: its longest sequence holds
        prompt_len + max_new_tokens - 1 tokens (the last generated token is never fed
        back), so it needs blocks_for(prompt_len + max_new_tokens - 1, block_size)
        blocks, and that must not be more than num_blocks.
        """
        # TODO
        raise NotImplementedError("add")

    def step(self):
        """Decide and run one step. Returns the batch: a list of (request_id, n_tokens).

        The budget: at most max_batch_tokens tokens in all, at most max_batch_seqs
        entries. "Free blocks" are num_blocks minus the blocks every running request
        holds; a request holds blocks_for(computed, block_size) blocks, counting the
        tokens given to it in this step as computed already.

        1. Running requests first, oldest admission first. Each gets
           n = min(request.pending, tokens left in the budget): 1 when it decodes, or the
           next chunk of its prompt (chunked prefill). If n is 0, or the batch already has
           max_batch_seqs entries, it gets nothing this step (it keeps its blocks).
           Its blocks grow by need = blocks_for(computed + n) - blocks_for(computed).
           While need > free blocks: PREEMPT the most recently admitted running request
           (the last of self.running; it may be this very request, which then gets
           nothing): all its blocks are freed, its computed goes back to 0, it leaves
           running and goes to the FRONT of the waiting queue. It keeps `generated`: when
           it runs again it recomputes its prompt and everything it generated.
        2. Only if nothing was preempted in this step, admit waiting requests from the
           front of the queue, in order, while tokens are left in the budget, the batch
           has fewer than max_batch_seqs entries, and the first chunk's blocks are free:
           chunk = min(request.pending, tokens left), blocks_for(chunk) <= free blocks.
           Stop at the first request that does not fit (first come, first served: never
           skip it for a later one). An admitted request joins the end of self.running
           and its chunk joins the batch.
        3. Run the batch: every entry's request computes its n tokens (computed += n).
           A request that has now computed all its tokens (computed == prompt_len +
           generated) generates one more token (generated += 1). If that makes
           generated == max_new_tokens, it is finished: it leaves running, its blocks are
           freed, and its id is appended to self.done (in batch order).

        The batch lists the running requests' entries (in running order), then the
        admitted requests' (in the order admitted).
        """
        # TODO
        raise NotImplementedError("step")

    # ---- looking at it (already written: they read the fields above) ---------------------

    def has_work(self):
        return bool(self.waiting or self.running)

    def waiting_ids(self):
        """Ids of the waiting requests, the next to be admitted first."""
        return [r.id for r in self.waiting]

    def running_ids(self):
        """Ids of the running requests, oldest admission first."""
        return [r.id for r in self.running]

    def finished(self):
        """Ids of the finished requests, in the order they finished."""
        return list(self.done)

    def request(self, request_id):
        return self.requests[request_id]

    def num_free_blocks(self):
        return self.num_blocks - sum(blocks_for(r.computed, self.block_size)
                                     for r in self.running)
