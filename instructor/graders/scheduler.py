"""Hidden grading tests for lab 8 (scheduler). Each test says in its message what it expected.
Run by the judge (kvlab/grading/judge.py), never shipped in the package.

Small fixed workloads check one rule at a time (chunked prefill, the token budget, FIFO
admission, preemption of the most recently admitted request, recompute). Then seeded
random workloads on tight caches (heavy preemption) are checked two ways: against the
rules, from what your scheduler returns and shows after every step (the grader keeps its
own count of every request's tokens and blocks); and step by step against kvlab's own
scheduler (kvlab/scheduler.py, the one kvlab.Engine runs), driven through a pool that
counts blocks.
"""
import numpy as np

from kvlab import scheduler as kvlab_scheduler
from kvlab.grading.testkit import points, raises


def blocks_for(n_tokens, block_size):
    return -(-n_tokens // block_size)


def queues(scheduler):
    """(waiting ids, running ids, finished ids, free blocks, has work): one round trip."""
    waiting, running, finished, free, busy = scheduler.calls(
        ("waiting_ids",), ("running_ids",), ("finished",), ("num_free_blocks",), ("has_work",))
    return list(waiting), list(running), list(finished), free, busy


def counts(scheduler, ids):
    """{request id: (generated, computed)} as the scheduler's requests hold them."""
    return dict(zip(ids, scheduler.calls(*[("request", i) for i in ids],
                                         attrs=("generated", "computed"))))


def run(sub, num_blocks, block_size, max_batch_tokens, max_batch_seqs, requests,
        max_steps=1000):
    """Add requests (id, prompt_len, max_new_tokens) and step until done; returns the
    scheduler and every step's (batch, running_ids, waiting_ids) after it."""
    scheduler = sub.Scheduler(num_blocks, block_size, max_batch_tokens, max_batch_seqs)
    for request in requests:
        scheduler.add(*request)
    steps = []
    waiting, running, _, _, busy = queues(scheduler)
    while busy:
        assert len(steps) < max_steps, (
            f"still not done after {max_steps} steps: running {running}, waiting {waiting} "
            f"(is something never admitted?)")
        batch = [tuple(entry) for entry in scheduler.step()]
        waiting, running, _, _, busy = queues(scheduler)
        steps.append((batch, running, waiting))
    return scheduler, steps


def batches(steps):
    return [batch for batch, _, _ in steps]


# ---- kvlab's scheduler, driven through a pool that counts blocks --------------------------

class CountingPool:
    """kvlab.scheduler's BlockSpace for one-sample requests without a prefix cache: a
    request holds blocks_for(computed) blocks, and its blocks are freed when it is."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size, self.held = num_blocks, block_size, {}

    def available(self):
        return self.num_blocks - sum(self.held.values())

    def needed(self, sample, n_tokens):
        return (blocks_for(sample.computed + n_tokens, self.block_size)
                - blocks_for(sample.computed, self.block_size))

    def sequences_left(self):
        return 1 << 30

    def start(self, request):
        for sample in request.active():
            sample.seq, sample.computed = request.id, 0
        self.held[request.id] = 0
        return 0                                     # no prefix cache: nothing found

    def release(self, request):
        self.held.pop(request.id, None)
        for sample in request.samples:
            sample.seq = None


class KvlabReference:
    """kvlab.scheduler.Scheduler plus what kvlab.Engine does after each step: compute the
    scheduled tokens, generate a token when a request has computed all of its own."""

    def __init__(self, num_blocks, block_size, max_batch_tokens, max_batch_seqs):
        self.pool = CountingPool(num_blocks, block_size)
        self.scheduler = kvlab_scheduler.Scheduler(block_size, max_batch_tokens, max_batch_seqs)
        self.requests, self.done = {}, []

    def add(self, request_id, prompt_len, max_new_tokens):
        params = kvlab_scheduler.SamplingParams(max_new_tokens=max_new_tokens)
        request = kvlab_scheduler.Request(id=request_id, prompt=[1] * prompt_len,
                                          params=params, arrival=request_id)
        request.samples = [kvlab_scheduler.Sample(index=0, tokens=[1] * prompt_len,
                                                  prompt_len=prompt_len)]
        self.requests[request_id] = request
        self.scheduler.add(request)

    def step(self):
        decided = self.scheduler.schedule(self.pool)
        for request, sample, n in decided.items:
            self.pool.held[request.id] = blocks_for(sample.computed + n, self.pool.block_size)
            sample.computed += n
            if sample.computed == len(sample.tokens):
                sample.tokens.append(7)
                sample.finished = len(sample.outputs) >= request.params.max_new_tokens
        for request in {r.id: r for r, _, _ in decided.items}.values():
            if request.finished and request.state is kvlab_scheduler.State.RUNNING:
                self.pool.release(request)
                self.scheduler.finish(request)
                self.done.append(request.id)
        return [(r.id, n) for r, _, n in decided.items]

    def view(self):
        return {"running": [r.id for r in self.scheduler.running],
                "waiting": [r.id for r in self.scheduler.waiting],
                "finished": list(self.done), "free blocks": self.pool.available(),
                "generated": {i: len(r.samples[0].outputs) for i, r in self.requests.items()}}


def view(scheduler, ids):
    waiting, running, finished, free, _ = queues(scheduler)
    return {"running": running, "waiting": waiting, "finished": finished, "free blocks": free,
            "generated": {i: got[0] for i, got in counts(scheduler, ids).items()}}


def random_workload(seed):
    """A cache with just enough blocks for the largest request alone (so preemption is
    common), a small budget and batch size, up to 11 requests."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 8]))
    max_batch_tokens = int(rng.integers(1, 40))
    max_batch_seqs = int(rng.integers(1, 9))
    requests = [(rid, int(rng.integers(1, 30)), int(rng.integers(1, 12)))
                for rid in range(int(rng.integers(2, 12)))]
    need = max(blocks_for(p + m - 1, block_size) for _, p, m in requests)
    num_blocks = need + int(rng.integers(0, 4))
    return num_blocks, block_size, max_batch_tokens, max_batch_seqs, requests


def seeds(rng):
    """Thirty workloads known to reach every rule, and six drawn at grading time."""
    return list(range(30)) + [int(x) for x in rng.integers(100, 1 << 30, size=6)]


# ---- the tests ------------------------------------------------------------------------
# The scenarios below are fixed in shape, but their request ids (and, where the answer can
# be worked out for any size, their sizes) are drawn at grading time: the expected steps a
# failed test prints cannot be looked up the next time.

def ids(rng, n):
    """n distinct request ids, drawn now, in arrival order."""
    return [int(i) for i in rng.choice(10 ** 6, size=n, replace=False)]


def reference_batches(num_blocks, block_size, max_tokens, max_seqs, requests):
    """Every step's batch as kvlab's scheduler decides them."""
    reference = KvlabReference(num_blocks, block_size, max_tokens, max_seqs)
    for request in requests:
        reference.add(*request)
    steps = []
    while reference.scheduler.has_work:
        steps.append(reference.step())
    return steps


@points(1)
def test_add_refuses_a_request_that_could_never_fit(sub, rng):
    """add raises ValueError for a request that needs more blocks than the cache has"""
    a, b, c, d = ids(rng, 4)
    scheduler = sub.Scheduler(10, 4, 16, 4)
    scheduler.add(a, 37, 4)                          # 37 + 3 = 40 tokens: exactly 10 blocks
    for args, why in (((b, 38, 4), "38 + 3 = 41 tokens need 11 blocks of 4; there are 10"),
                      ((c, 0, 3), "a prompt of 0 tokens"), ((d, 5, 0), "max_new_tokens 0")):
        with raises("ValueError", f"add{args} ({why})"):
            scheduler.add(*args)
    assert scheduler.waiting_ids() == [a], (
        f"only request {a} was accepted: expected waiting [{a}], got {scheduler.waiting_ids()}")


@points(2)
def test_a_long_prompt_is_prefilled_in_chunks(sub, rng):
    """a long prompt goes in chunks of max_batch_tokens, then one token a step"""
    (a,) = ids(rng, 1)
    prompt, budget, new = int(rng.integers(60, 141)), int(rng.integers(8, 25)), int(rng.integers(2, 6))
    scheduler, steps = run(sub, 64, 4, budget, 8, [(a, prompt, new)])
    want = [[(a, budget)]] * (prompt // budget) + ([[(a, prompt % budget)]] if prompt % budget else []) \
        + [[(a, 1)]] * (new - 1)
    assert batches(steps) == want, (
        f"a {prompt}-token prompt, max_batch_tokens={budget}: the prompt goes in chunks of "
        f"{budget} (the last chunk generates the first token), then one token a step until "
        f"{new}: expected {want}, got {batches(steps)}")
    assert scheduler.finished() == [a] and scheduler.request(a).generated == new


@points(2)
def test_decodes_and_a_prefill_chunk_share_a_step(sub, rng):
    """a decoding request gets its token first; a long prompt fills the rest of the budget"""
    a, b = ids(rng, 2)
    scheduler, steps = run(sub, 64, 4, 10, 8, [(a, 3, 10), (b, 30, 2)])
    want = [[(a, 3), (b, 7)], [(a, 1), (b, 9)], [(a, 1), (b, 9)], [(a, 1), (b, 5)],
            [(a, 1), (b, 1)]] + [[(a, 1)]] * 5
    got = batches(steps)
    assert got == want, (
        f"max_batch_tokens=10, request {a} has a 3-token prompt, request {b} a 30-token one: "
        f"step 0 runs 3 + 7 tokens, then request {a} decodes 1 token a step and request {b}'s "
        f"prompt takes the other 9.\n  expected {want}\n  got      {got}")
    assert scheduler.finished() == [b, a], f"expected [{b}, {a}] to finish, got {scheduler.finished()}"


@points(2)
def test_admission_is_first_come_first_served(sub, rng):
    """a request that does not fit blocks the ones behind it, even ones that would fit"""
    a, b, c = ids(rng, 3)
    scheduler, steps = run(sub, 6, 4, 64, 8, [(a, 20, 1), (b, 8, 1), (c, 4, 1)])
    got = batches(steps)
    want = [[(a, 20)], [(b, 8), (c, 4)]]
    assert got == want, (
        f"6 blocks of 4: request {a} (20 tokens) takes 5; request {b} (8 tokens) needs 2 and "
        f"waits, and request {c} (4 tokens, 1 block) arrived after it, so it waits too.\n"
        f"  expected {want}\n  got      {got}")


@points(1)
def test_a_batch_holds_at_most_max_batch_seqs_requests(sub, rng):
    """max_batch_seqs=2: the third request waits until a place is free"""
    prompt, new = int(rng.integers(1, 5)), int(rng.integers(2, 5))     # alike: only the limit decides
    requests = [(rid, prompt, new) for rid in ids(rng, 3)]
    scheduler, steps = run(sub, 10, 4, 64, 2, requests)
    want = reference_batches(10, 4, 64, 2, requests)
    assert batches(steps) == want, (f"requests (id, prompt_len, max_new_tokens) {requests}, at "
                                    f"most 2 a step: expected {want}, got {batches(steps)}")


def preemption(rng):
    """6 blocks of 2. Requests a and b (4-token prompts, 6 new tokens each) run together;
    request c (5 tokens: 3 blocks) waits. At step 3 request a needs its 4th block and none
    is free: request b, admitted last, is preempted."""
    a, b, c = ids(rng, 3)
    return (6, 2, 64, 8, [(a, 4, 6), (b, 4, 6), (c, 5, 2)]), (a, b, c)


@points(2)
def test_preemption_takes_the_newest_request_and_requeues_it_first(sub, rng):
    """out of blocks: the most recently admitted request goes back to the FRONT of the queue"""
    workload, (a, b, c) = preemption(rng)
    scheduler, steps = run(sub, *workload)
    got = [(batch, running, waiting) for batch, running, waiting in steps[:4]]
    want = [([(a, 4), (b, 4)], [a, b], [c]), ([(a, 1), (b, 1)], [a, b], [c]),
            ([(a, 1), (b, 1)], [a, b], [c]), ([(a, 1)], [a], [b, c])]
    assert got == want, (
        f"6 blocks of 2, requests {a} and {b} run, {c} waits; at step 3 request {a} needs a "
        f"4th block and none is free, so request {b} (admitted last) is preempted and goes "
        f"back in front of request {c}. Steps 0-3 as (batch, running after, waiting after):\n"
        f"  expected {want}\n  got      {got}")
    again = [rid for batch, _, _ in steps[4:] for rid, _ in batch if rid != a]
    assert again[:1] == [b], (
        f"request {b} is first in line, so it runs again before request {c}: got batches "
        f"{batches(steps)[4:]} after step 3")
    assert sorted(scheduler.finished()) == sorted([a, b, c]), f"finished: {scheduler.finished()}"


@points(2)
def test_a_preempted_request_keeps_its_tokens_and_recomputes_them(sub, rng):
    """after preemption a request recomputes prompt + generated tokens, then goes on"""
    workload, (a, b, c) = preemption(rng)
    scheduler = sub.Scheduler(*workload[:4])
    for request in workload[4]:
        scheduler.add(*request)
    for _ in range(4):
        scheduler.step()
    one = scheduler.request(b)
    assert (one.generated, one.computed) == (3, 0), (
        f"request {b} was preempted at step 3 after generating 3 tokens: it keeps them "
        f"(generated 3) and its cache is gone (computed 0); got generated {one.generated}, "
        f"computed {one.computed}")
    given = []
    while scheduler.has_work():
        batch = scheduler.step()
        given += [n for rid, n in batch if rid == b]
        if len(given) == 1:
            assert scheduler.request(b).generated == 4, (
                f"recomputing its 7 tokens ends with a new token: expected generated 4, "
                f"got {scheduler.request(b).generated}")
    assert given[0] == 7, (
        f"readmitted, request {b} recomputes its prompt (4) and the 3 tokens it generated: "
        f"expected a first chunk of 7 tokens, got {given[0]} (all its chunks: {given})")
    assert given == [7, 1, 1] and scheduler.request(b).generated == 6, (
        f"then it decodes its last 2 tokens and stops at max_new_tokens=6: expected chunks "
        f"[7, 1, 1] and generated 6, got {given} and {scheduler.request(b).generated}")


def check_rules(sub, workload, where):
    """Run a workload and check every rule after every step, from the outside."""
    num_blocks, block_size, max_tokens, max_seqs, requests = workload
    spec = {rid: (p, m) for rid, p, m in requests}
    generated = dict.fromkeys(spec, 0)               # the grader's own counts
    computed = dict.fromkeys(spec, 0)
    scheduler = sub.Scheduler(num_blocks, block_size, max_tokens, max_seqs)
    for request in requests:
        scheduler.add(*request)
    total = sum(p + 2 * m for p, m in spec.values())
    for t in range(50 * total):
        waiting, running, finished_before, _, busy = queues(scheduler)
        if not busy:
            break
        at = f"{where}, step {t}"
        batch = [tuple(entry) for entry in scheduler.step()]
        ids = [rid for rid, _ in batch]
        n_tokens = sum(n for _, n in batch)
        assert n_tokens <= max_tokens and len(batch) <= max_seqs, (
            f"{at}: the batch {batch} holds {n_tokens} tokens in {len(batch)} entries; the "
            f"limits are max_batch_tokens={max_tokens}, max_batch_seqs={max_seqs}")
        assert all(n >= 1 for n in (n for _, n in batch)) and len(set(ids)) == len(ids), \
            f"{at}: each request appears at most once, with at least 1 token: got {batch}"
        assert set(ids) <= set(waiting) | set(running), f"{at}: {batch} runs unknown requests"
        from_running = [rid for rid in ids if rid in running]
        admitted = [rid for rid in ids if rid in waiting]
        assert ids == from_running + admitted, (
            f"{at}: running requests come first, then admitted ones; running {running}, "
            f"waiting {waiting}, batch {batch}")
        assert from_running == [rid for rid in running if rid in from_running], (
            f"{at}: running requests run in admission order {running}; batch {batch}")
        assert admitted == waiting[:len(admitted)], (
            f"{at}: admission is first come, first served: waiting {waiting}, the batch "
            f"admitted {admitted} (expected the first {len(admitted)} of the queue)")
        # the grader runs the batch on its own counts
        newly_finished = []
        for rid, n in batch:
            p, m = spec[rid]
            computed[rid] += n
            assert computed[rid] <= p + generated[rid], (
                f"{at}: request {rid} has {p} + {generated[rid]} tokens and computed "
                f"{computed[rid] - n} of them; the batch gives it {n} more")
            if computed[rid] == p + generated[rid]:
                generated[rid] += 1
                if generated[rid] == m:
                    newly_finished.append(rid)
        after_waiting, after_running, finished, free, _ = queues(scheduler)
        assert finished == finished_before + newly_finished, (
            f"{at}: after batch {batch}, requests {newly_finished} reach max_new_tokens: "
            f"expected finished {finished_before + newly_finished}, got {finished}")
        preempted = [rid for rid in running if rid not in after_running
                     and rid not in newly_finished]
        assert not set(preempted) & set(ids), (
            f"{at}: preempted requests {preempted} must not run in the batch {batch}")
        assert preempted == running[len(running) - len(preempted):], (
            f"{at}: preemption takes the most recently admitted requests first: running was "
            f"{running}, you preempted {preempted}")
        assert not (preempted and admitted), (
            f"{at}: a step that preempts {preempted} admits nobody, but admitted {admitted}")
        want_waiting = preempted + waiting[len(admitted):]
        assert after_waiting == want_waiting, (
            f"{at}: waiting was {waiting}; admitted {admitted}, preempted {preempted} (they "
            f"go to the front): expected waiting {want_waiting}, got {after_waiting}")
        want_running = [rid for rid in running + admitted
                        if rid not in preempted and rid not in newly_finished]
        assert after_running == want_running, (
            f"{at}: expected running {want_running}, got {after_running}")
        for rid in preempted:
            computed[rid] = 0
        theirs = counts(scheduler, list(spec))
        for rid in spec:
            if rid in finished:                      # its cache is gone: computed is moot
                assert theirs[rid][0] == spec[rid][1], (
                    f"{at}: request {rid} finished with {theirs[rid][0]} tokens generated; "
                    f"max_new_tokens is {spec[rid][1]}")
                continue
            got = tuple(theirs[rid])
            assert got == (generated[rid], computed[rid]), (
                f"{at}: request {rid} (prompt {spec[rid][0]}) has generated {generated[rid]} "
                f"tokens and has {computed[rid]} in the cache; yours says generated {got[0]}, "
                f"computed {got[1]}" + (" (a preempted request keeps what it generated)"
                                        if rid in preempted else ""))
        held = sum(blocks_for(computed[rid], block_size) for rid in after_running)
        assert held <= num_blocks, (
            f"{at}: the running requests {after_running} hold {held} blocks; there are "
            f"{num_blocks}")
        assert free == num_blocks - held, (
            f"{at}: the running requests hold {held} of {num_blocks} blocks; "
            f"num_free_blocks() says {free}")
    assert not scheduler.has_work(), (
        f"{where}: not done after {50 * total} steps: running {scheduler.running_ids()}, "
        f"waiting {scheduler.waiting_ids()} (does a request starve?)")
    assert sorted(scheduler.finished()) == sorted(spec), \
        f"{where}: every request must finish once; finished {scheduler.finished()}"
    assert generated == {rid: m for rid, (p, m) in spec.items()}, (
        f"{where}: every request generates exactly max_new_tokens; the batches gave "
        f"{generated}")


@points(3)
def test_random_workloads_follow_the_rules(sub, rng):
    """30 random workloads on tight caches: budget, FIFO, preemption, tokens, blocks"""
    for seed in seeds(rng):
        workload = random_workload(seed)
        num_blocks, block_size, max_tokens, max_seqs, requests = workload
        where = (f"seed {seed}: {num_blocks} blocks of {block_size}, max_batch_tokens="
                 f"{max_tokens}, max_batch_seqs={max_seqs}, requests (id, prompt_len, "
                 f"max_new_tokens) {requests}")
        check_rules(sub, workload, where)


@points(3)
def test_random_workloads_match_kvlabs_scheduler(sub, rng):
    """30 random workloads: every step equals kvlab.scheduler's decision"""
    for seed in seeds(rng):
        num_blocks, block_size, max_tokens, max_seqs, requests = random_workload(seed)
        where = (f"seed {seed}: {num_blocks} blocks of {block_size}, max_batch_tokens="
                 f"{max_tokens}, max_batch_seqs={max_seqs}, requests (id, prompt_len, "
                 f"max_new_tokens) {requests}")
        scheduler = sub.Scheduler(num_blocks, block_size, max_tokens, max_seqs)
        reference = KvlabReference(num_blocks, block_size, max_tokens, max_seqs)
        for request in requests:
            scheduler.add(*request)
            reference.add(*request)
        ids = [rid for rid, _, _ in requests]
        for t in range(5000):
            if not reference.scheduler.has_work:
                break
            before = reference.view()
            want = reference.step()
            got = [tuple(entry) for entry in scheduler.step()]
            assert got == want, (
                f"{where}\nstep {t}, with running {before['running']}, waiting "
                f"{before['waiting']}, {before['free blocks']} free blocks:\n"
                f"  kvlab's scheduler runs {want}\n  yours runs             {got}")
            mine = view(scheduler, ids)
            assert mine == reference.view(), (
                f"{where}\nafter step {t} (batch {want}):\n  kvlab's scheduler: "
                f"{reference.view()}\n  yours:             {mine}")
        assert not scheduler.has_work(), f"{where}: kvlab's scheduler is done, yours is not"
