"""Public self-checks for lab 8 (scheduler): `kvlab check scheduler scheduler.py`.

The simplest rules on tiny workloads. The grade comes from hidden tests: every rule on
small workloads (worked examples and drawn ones), and random workloads on tight caches checked step by step against the
rules and against kvlab's own scheduler.
"""
from kvlab.grading.testkit import points, raises


@points(1)
def test_add_refuses_what_could_never_fit(sub, rng):
    """8 blocks of 4 hold 32 tokens: a 30-token prompt with 4 new tokens needs 33"""
    scheduler = sub.Scheduler(8, 4, 16, 4)
    with raises("ValueError", "add(0, 30, 4): 30 + 4 - 1 = 33 tokens need 9 blocks of 4"):
        scheduler.add(0, 30, 4)


@points(1)
def test_a_prompt_in_chunks_then_one_token_a_step(sub, rng):
    """a 20-token prompt, 8 tokens a step: chunks of 8, 8 and 4, then 1 token a step"""
    scheduler = sub.Scheduler(16, 4, 8, 4)
    scheduler.add(0, 20, 3)
    batches = []
    while scheduler.has_work() and len(batches) < 20:
        batches.append([tuple(entry) for entry in scheduler.step()])
    want = [[(0, 8)], [(0, 8)], [(0, 4)], [(0, 1)], [(0, 1)]]
    assert batches == want, f"expected {want}, got {batches}"


@points(1)
def test_a_batch_holds_at_most_max_batch_seqs(sub, rng):
    """max_batch_seqs=1: the second request waits for the first to finish"""
    scheduler = sub.Scheduler(16, 4, 64, 1)
    scheduler.add(0, 2, 2)
    scheduler.add(1, 2, 2)
    batches = []
    while scheduler.has_work() and len(batches) < 20:
        batches.append([tuple(entry) for entry in scheduler.step()])
    want = [[(0, 2)], [(0, 1)], [(1, 2)], [(1, 1)]]
    assert batches == want, f"expected {want}, got {batches}"
