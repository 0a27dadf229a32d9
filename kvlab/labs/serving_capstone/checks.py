"""Public self-checks for lab 15 (the serving capstone):
`kvlab check serving_capstone serving_capstone.py`.

One small case for each of your four objects, without the engine. The grade comes from
hidden tests that run them inside kvlab.Engine on drawn workloads (see the README).
"""
from kvlab.grading.testkit import points


def one_request(rid, prompt_len, **fields):
    request = dict(id=rid, arrival_time=0.0, prompt_len=prompt_len, max_new_tokens=8,
                   generated=0, computed=0, pending=prompt_len, blocks=0, preemptions=0,
                   first_token_time=None, extra_blocks=0)
    request.update(fields)
    return request


@points(1)
def test_a_lone_waiting_request_is_admitted(sub, rng):
    """a view with one waiting request of 10 tokens and room for it: the plan runs it"""
    view = dict(step=0, now=0.001, max_batch_tokens=256, max_batch_seqs=64, block_size=16,
                free_blocks=8, sequences_left=8, running=[], waiting=[one_request(0, 10)])
    plan = sub.Scheduler().plan(view)
    assert isinstance(plan, dict) and set(plan) <= {"run", "preempt", "max_drafts"}, (
        f"plan() returns {{'run': [...], 'preempt': [...]}} (and maybe 'max_drafts'), "
        f"got {plan!r}")
    run = [tuple(pair) for pair in plan.get("run", [])]
    assert len(run) == 1 and run[0][0] == 0 and 1 <= run[0][1] <= 10, (
        f"expected request 0 to run with 1 to 10 tokens, got run={run}")


@points(1)
def test_a_decoding_request_gets_one_token(sub, rng):
    """a running request that decodes (pending 1) and room for it: the plan runs it, 1 token"""
    running = [one_request(3, 5, generated=2, computed=6, pending=1, blocks=1,
                           first_token_time=0.006)]
    view = dict(step=4, now=0.01, max_batch_tokens=256, max_batch_seqs=64, block_size=16,
                free_blocks=7, sequences_left=7, running=running, waiting=[])
    run = [tuple(pair) for pair in sub.Scheduler().plan(view).get("run", [])]
    assert run == [(3, 1)], f"expected run=[(3, 1)], got {run}"


@points(1)
def test_the_drafter_proposes_at_most_k_ids(sub, rng):
    """propose on a context that repeats itself: a list of at most k token ids from it"""
    tokens = [5, 9, 2, 7, 1, 3] * 3
    drafts = sub.Drafter().propose(tokens, 3)
    assert isinstance(drafts, list) and len(drafts) <= 3, f"expected a list of at most 3, got {drafts!r}"
    assert all(isinstance(d, int) and d in tokens for d in drafts), (
        f"expected token ids of the context, got {drafts!r}")


@points(1)
def test_the_allocator_forks_and_truncates(sub, rng):
    """blocks of 4: 6 tokens, a fork shares both blocks, the child cut to 3 tokens lets go of one"""
    alloc = sub.BlockAllocator(8, 4)
    seq = alloc.new_sequence()
    alloc.append(seq, 6)
    child = alloc.fork(seq)
    table = alloc.block_table(seq)
    assert [alloc.ref_count(b) for b in table] == [2, 2], "after fork each block is held twice"
    alloc.truncate(child, 3)
    assert alloc.length(child) == 3 and len(alloc.block_table(child)) == 1, (
        "truncate(child, 3) keeps one block of 4 and a length of 3")
    assert [alloc.ref_count(b) for b in table] == [2, 1], (
        f"the cut block is held by the parent alone: expected ref counts [2, 1], got "
        f"{[alloc.ref_count(b) for b in table]}")
    assert alloc.num_free_blocks() == 6, f"2 of 8 blocks used: expected 6 free"


@points(1)
def test_the_prefix_cache_matches_whole_blocks_before_the_last_token(sub, rng):
    """blocks of 4: 8 tokens inserted (two blocks), then the second removed: match counts whole blocks held, never the last token's"""
    cache = sub.PrefixCache(4)
    tokens = [5, 9, 2, 7, 1, 3, 8, 6, 4]
    cache.insert(tokens[:4])
    cache.insert(tokens[:8])
    assert cache.match(tokens) == 8, f"9 tokens, the first 8 held: expected 8, got {cache.match(tokens)!r}"
    assert cache.match(tokens[:8]) == 4, (
        f"8 tokens, all held: the last is always run, so expected 4, got {cache.match(tokens[:8])!r}")
    assert cache.match(tokens[:6]) == 4, f"6 tokens: one whole block held, got {cache.match(tokens[:6])!r}"
    assert cache.match([5, 9, 2, 0, 1, 3, 8, 6, 4]) == 0, "a first block that differs: nothing held"
    cache.remove(tokens[:8])
    assert cache.match(tokens) == 4, f"after remove(the 8 tokens): expected 4, got {cache.match(tokens)!r}"
