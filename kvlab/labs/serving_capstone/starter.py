"""Lab 15, the capstone: your scheduler, drafter, block allocator and prefix cache, plugged
into kvlab's serving engine and scored by goodput. Fill in every method marked TODO.

The grader runs kvlab.Engine (the real one: the C core, the paged pool, the bundled model)
on a workload it draws, with your objects plugged in (kvlab/plugins.py), on a virtual
clock that moves by what each step computes (kvlab/slo.py). It checks your outputs first
(every request's tokens exactly kvlab.generate's) and then scores your goodput: requests a
second served within the SLO below.

Check your work with:  kvlab check serving_capstone serving_capstone.py
Your grade:            kvlab grade serving_capstone serving_capstone.py
You may import numpy, math and Python's standard library; nothing from kvlab (your code
runs in a process of its own that has no kvlab; everything reaches it as plain values).
"""

TTFT_SLO = 0.030      # seconds to the first token, at most (virtual time)
TPOT_SLO = 0.002      # seconds per output token after the first, at most


def blocks_for(n_tokens, block_size):
    """KV blocks that hold n_tokens positions: ceil(n_tokens / block_size)."""
    return -(-n_tokens // block_size)


def blocks_needed(view, request, n_tokens):
    """Blocks `request` (one of view["running"] or view["waiting"]) takes to run n_tokens
    (1 .. request["pending"]) more tokens: its new blocks, plus the extra the engine counted
    for it (a copy on write, or what it brings back from host memory)."""
    size, done = view["block_size"], request["computed"]
    return blocks_for(done + n_tokens, size) - blocks_for(done, size) + request["extra_blocks"]


class Scheduler:
    """Decides, every step, which requests run and with how many tokens."""

    def plan(self, view):
        """One step's plan. `view` is a dict:

            step, now               the step's number, the clock (seconds)
            max_batch_tokens        the most tokens one step may run (256)
            max_batch_seqs          the most requests one step may run
            block_size              positions per KV block (16)
            free_blocks             blocks that can be handed out now
            sequences_left          more requests the pool can hold
            running, waiting        lists of requests (dicts), running in order of
                                    admission, waiting in line (the first arrived first;
                                    a preempted one goes back to the front)

        and each request a dict: id, arrival_time (seconds, on the same clock as now),
        prompt_len, max_new_tokens, generated (tokens so far), computed (tokens whose K and
        V are in the cache), pending (tokens still to run through the model: 1 when it
        decodes, more for a prompt or a recompute), blocks (held now), preemptions,
        first_token_time (when its first token came, on the clock of now; None before it:
        its TPOT so far is (now - first_token_time) / (generated - 1)), extra_blocks (see
        blocks_needed).

        Return {"run": [[request id, n_tokens], ...], "preempt": [request id, ...]}, and
        if you like "max_drafts": n:
          - run: in batch order; each request at most once, 1 .. pending tokens; a waiting
            request named here is admitted. At most max_batch_tokens tokens in all, at
            most max_batch_seqs requests, at most sequences_left admitted;
          - preempt: running requests to send back to the front of the waiting line (their
            blocks freed; they recompute prompt + generated tokens when run again). Not
            also in run.
          - the blocks of what runs (blocks_needed) at most free_blocks plus the blocks
            of the preempted requests;
          - never nothing while a request runs or waits;
          - max_drafts (an int from 0; leave it out for no cap): the most draft tokens
            the engine adds to this step in all. Without it, drafts fill the token budget
            and blocks your plan leaves; each costs a token of the step's work.
        The engine checks all of this and stops the run (a failed test) on a broken rule.
        """
        # TODO
        raise NotImplementedError("Scheduler.plan")


class Drafter:
    """Guesses the next tokens of a sequence (speculative decoding): the engine runs them
    with the sequence's next token in one pass and keeps those the model agrees with."""

    def propose(self, tokens, k):
        """At most k token ids likely to follow `tokens` (the sequence's whole context,
        prompt and generated tokens, a list of ints). [] drafts nothing. Each draft costs
        a token of the step's work, kept or not."""
        # TODO
        raise NotImplementedError("Drafter.propose")


class BlockAllocator:
    """Lab 5's block allocator (fork and copy-on-write), plus truncate. The engine's pool
    does the same operations at the same time, and after every step your tables, ref
    counts and free blocks must agree with it (block ids are your own choice)."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # TODO

    def new_sequence(self):
        """A new, empty sequence; returns its id (never one of a live sequence)."""
        # TODO
        raise NotImplementedError("BlockAllocator.new_sequence")

    def append(self, seq, n_tokens):
        """Room for n_tokens more tokens: a copy of the last block first if it is shared
        and partly filled (copy-on-write), then the new blocks. Returns the copies made,
        [(src, dst)] or []. Raise an exception if the free blocks do not suffice."""
        # TODO
        raise NotImplementedError("BlockAllocator.append")

    def fork(self, seq):
        """A new sequence sharing every block of seq (each ref count up by one); its id."""
        # TODO
        raise NotImplementedError("BlockAllocator.fork")

    def truncate(self, seq, length):
        """Keep seq's first `length` tokens (length <= its length): the blocks past
        ceil(length / block_size) lose a reference (free at 0). The engine cuts refused
        drafts off this way."""
        # TODO
        raise NotImplementedError("BlockAllocator.truncate")

    def free(self, seq):
        """Drop seq: each of its blocks loses a reference, free at 0."""
        # TODO
        raise NotImplementedError("BlockAllocator.free")

    def block_table(self, seq):
        # TODO
        raise NotImplementedError("BlockAllocator.block_table")

    def length(self, seq):
        # TODO
        raise NotImplementedError("BlockAllocator.length")

    def ref_count(self, block):
        # TODO
        raise NotImplementedError("BlockAllocator.ref_count")

    def num_free_blocks(self):
        # TODO
        raise NotImplementedError("BlockAllocator.num_free_blocks")


class PrefixCache:
    """Which token prefixes the engine's prefix cache holds. The pool's own cache (C) keeps
    the K and V and decides what stays; the engine tells you what it gained (insert) and
    lost (remove), and asks you, for every request it admits, how much of its context the
    cache will give it (match). Each answer must be exactly the pool's. One way: a tree of
    blocks (a radix tree cut at block boundaries, as SGLang's): each node a dict from a
    block's tokens (a tuple) to the node after it."""

    def __init__(self, block_size):
        self.block_size = block_size
        # TODO

    def insert(self, tokens):
        """The cache now holds `tokens` (a list of ints, a whole number of blocks): their
        last block is new; every shorter prefix of whole blocks was inserted before."""
        # TODO
        raise NotImplementedError("PrefixCache.insert")

    def remove(self, tokens):
        """The cache no longer holds the last block of `tokens` (evicted to make room, or cut
        by a truncate): every longer prefix through it was removed before."""
        # TODO
        raise NotImplementedError("PrefixCache.remove")

    def match(self, tokens):
        """How many leading tokens of `tokens` (the context of a request being admitted: its
        prompt, or, when it was preempted, its prompt and the tokens generated so far) the
        engine reuses from the cache: the longest prefix held, in whole blocks, and at most
        len(tokens) - 1 (the last token is always run: its logits choose the next)."""
        # TODO
        raise NotImplementedError("PrefixCache.match")


if __name__ == "__main__":
    # Try your classes in the real engine (the grader never runs this block, and here you
    # may use kvlab): 48 requests drawn as the grader draws its workload (70 % prompts of
    # 4-23 tokens, 30 % of 100-299, 8-63 new tokens, 220-300 arrivals a second), cut from
    # kvlab's sample text; seed=N draws another. Your goodput is printed beside kvlab's
    # default engine's (the grader's first tier) on the same requests.
    #   "yours" is the graded capstone run: your scheduler and drafter, the pool's own
    #   prefix cache on. Your allocator and your prefix cache are each graded in a run of
    #   their own and never change a plan: the prefix cache only answers (the engine checks
    #   each answer), so its line's goodput is "yours" again; allocator= runs the pool
    #   without its prefix cache (your allocator must mirror it block for block), so that
    #   line's goodput can differ from "yours" either way, and is not the one graded.
    import kvlab
    from kvlab import serving
    from kvlab.labs.serving_capstone.workload import trial
    from kvlab.plugins import PlainDrafter, PlainScheduler
    from kvlab.slo import SLO
    model = kvlab.load()
    requests = trial(model, seed=1)
    slo = SLO(TTFT_SLO, TPOT_SLO)

    def yours(**more):
        return dict(scheduler=PlainScheduler(Scheduler()), drafter=PlainDrafter(Drafter()), **more)
    for name, plugins in (("kvlab's default engine", {}),
                          ("yours (scheduler and drafter: the graded run)", yours()),
                          ("yours, with your prefix cache checked", yours(prefix_cache=PrefixCache)),
                          ("yours, with your allocator checked (no prefix cache)",
                           yours(allocator=BlockAllocator))):
        report = serving.serve(model, requests, 256, 128, 16, clock="virtual", slo=slo,
                               engine_options=plugins)
        print(f"{name}: goodput {report['goodput']:.1f} requests/s, {report['served']} of "
              f"{report['requests']} served within the SLO ({report['missed_ttft']} missed "
              f"the TTFT, {report['missed_tpot']} the TPOT)")
