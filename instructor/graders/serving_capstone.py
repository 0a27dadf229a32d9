"""Hidden grading tests for lab 15 (the serving capstone). Run by the judge
(kvlab/grading/judge.py), never shipped in the package.

Everything that decides the score is the judge's: the Engine, its pool and model, the
virtual clock and its prices (kvlab.slo), the workload (drawn here at grading time) and
the SLO. The tests that measure drafts (the drafter's and the capstone run) run the bundled
model nudged by noise drawn at grading time (nudged_model), so that what the model will
answer cannot be known in advance: a table of its greedy continuations lifted a middling
scheduler a tier (cheat drafts_from_a_table_of_the_models_greedy_text). The student's Scheduler, Drafter and BlockAllocator live in the worker and are
asked through kvlab.plugins' checks, their questions and answers by value: a plug-in can
answer, never touch the clock, the cost model, the requests or the tokens. What they
compute is not free: the CPU time the worker spends answering, beyond a plain Python
answer's (kvlab.grading.plugin_cpu's allowance a call), and all its child processes'
CPU time, read by the judge from the kernel, go on the virtual clock as the step's
plugin_cpu_s (a drafter that runs the model in NumPy pays for every pass of it).

Correctness first: the student's allocator followed through a run with forks, drafts and
preemptions; the student's plans through the engine's checks; the drafter's guesses
against the model's own next tokens. Then the capstone run: the whole workload through the
student's scheduler and drafter, every request's tokens exactly kvlab.generate's (the
gate: a run that fails it earns no speed points), its goodput against two baselines run
on the same workload here: kvlab's own Engine (its first-come-first-served scheduler, no
drafts) and the reference policy below (no drafts). Points at the default's goodput,
halfway from it to the reference's, and 85 % of the way (GOODPUT_TIERS; the floor is at
least a quarter of the reference's, so that a workload the default engine serves badly
still asks for something): the reference solution, whose drafts cost or gain a little of
its scheduler's goodput, reached 92 % of the way or more on 12 drawn workloads.
"""
import functools

import numpy as np

import kvlab
from kvlab import serving
from kvlab.grading.labs import chapter_file
from kvlab.grading.plugin_cpu import STARTUP_ALLOWANCE_S, PluginMeter, Slowness, worker_pid
from kvlab.grading.process import WorkerGone
from kvlab.grading.remote import RemoteError
from kvlab.grading.testkit import points
from kvlab.labs.serving_capstone import workload as lab_workload
from kvlab.model import Model
from kvlab.plugins import PlainDrafter, PlainScheduler, PluginError, StepPlan
from kvlab.slo import SLO, StepCost, VirtualClock
from kvlab.speculative import PromptLookup
from kvlab.weights import MATRICES, Weights

SLO_TARGET = SLO(ttft_s=0.030, tpot_s=0.002)    # the lab's README states the same
ENGINE = dict(num_blocks=128, block_size=16, max_batch_tokens=256)
N_REQUESTS = lab_workload.N_REQUESTS
REFERENCE_GAIN = 2.0      # a workload counts when the reference serves twice the default's
GOODPUT_TIERS = (0.0, 0.5, 0.85)   # of the way from the default's goodput to the reference's
NUDGE = 0.2               # the drafting tests' model: each matrix's noise, of its RMS (nudged_model)
# The drafter's test: how many contexts, and where each is cut in the model's own text. The
# nudged model repeats itself later than the bundled one, so prompt lookup finds less early
# on: with the bundled model's 12 contexts cut at tokens 20-69 the reference's drafter failed
# 6 seeds of 40. Cut at 40-119, 36 of them: over 80 seeds it agreed 0.40-1.19 times as often
# as prompt lookup (the line is a third), a repeat-the-last-token drafter 0.21 times or less,
# and a table of the bundled model's greedy text passed 2 seeds of 80 (40 of 40 unnudged).
# About 1.1 s of the judge's CPU a grading, where 12 contexts took 0.4 s.
DRAFTER_CONTEXTS, DRAFTER_CUT = 36, (40, 120)


def prepare():
    model()
    text()


@functools.lru_cache(maxsize=None)
def model():
    return kvlab.load()


def nudged_model(rng):
    """The model the drafting tests run (the drafter's and the capstone's): the bundled
    model with every matrix nudged by noise drawn here, NUDGE of its own root mean square
    (the norm vectors kept). Its greedy text is the bundled model's only in part, so a
    table of the bundled model's continuations made in advance (keyed on the last 8
    tokens: 76 % of a workload's tokens) predicts 4-6 % of this one's, where prompt lookup
    still finds 21-32 % (39 % on the bundled model); every price is the same (the shapes and
    the config are), and so is every rule. A drafter has the context to go on, as a
    server's has, not a copy of the model's answers."""
    noise = np.random.default_rng(int(rng.integers(1 << 63)))
    base = model()
    arrays = {}
    tied = base.config.tied_embeddings      # one matrix, as in the bundled model
    for name, array in base.weights.items():
        if name == "classifier" and tied:
            continue
        if name in MATRICES:
            rms = float(np.sqrt(np.mean(np.square(array, dtype=np.float64))))
            array = array + (NUDGE * rms * noise.standard_normal(array.shape)).astype(np.float32)
        arrays[name] = np.ascontiguousarray(array, dtype=np.float32)
    if tied:
        arrays["classifier"] = arrays["token_embedding"]
    return Model(base.config, Weights(**arrays), base.tokenizer, base.source)


@functools.lru_cache(maxsize=None)
def text():
    """Token ids to cut prompts from: the sample the kit serves, and chapter 5."""
    chapter = chapter_file("05_batching.md").read_text(encoding="utf-8")
    return model().encode(serving.SAMPLE_TEXT * 4 + chapter[:20_000])


def draw_workload(rng, n_requests=N_REQUESTS):
    """Poisson arrivals at a rate drawn from 220 to 300 a second (the bundled model's
    engine is overloaded: who goes first decides who meets the SLO); 70 % short prompts
    (4-23 tokens), 30 % long (100-299); 8 to 63 new tokens each: the lab's public draw
    (kvlab/labs/serving_capstone/workload.py, which the starter's trial runs), on text()."""
    return lab_workload.draw(rng, text(), n_requests)


@functools.lru_cache(maxsize=None)
def generated(prompt, new_tokens, served=None):
    """kvlab.generate's greedy tokens, from the bundled model or `served`."""
    return kvlab.generate(served or model(), list(prompt), new_tokens).tokens


def stopped(error: PluginError):
    """What a test raises when the engine stopped a run: the worker's own end (it died or
    ran out of time) as itself, else the rule the plug-in broke."""
    if isinstance(error.__cause__, (WorkerGone, RemoteError)):   # described by the judge
        return error.__cause__
    return AssertionError(f"the engine stopped the run: {error}")


def run(requests, num_blocks=ENGINE["num_blocks"], meter=None, served=None, **plugins):
    """The workload through the Engine on the virtual clock with these plug-ins (and the
    CPU time `meter` reads of the worker they run in), on the bundled model or `served`:
    its goodput report, with "outputs", every request's RequestOutput by arrival order."""
    try:
        return serving.serve(served or model(), requests, ENGINE["max_batch_tokens"], num_blocks,
                             ENGINE["block_size"], clock="virtual", slo=SLO_TARGET,
                             engine_options=plugins, outputs=True, meter=meter)
    except PluginError as error:
        raise stopped(error) from None


def check_tokens(requests, report, what, served=None):
    """Every request finished well, with kvlab.generate's tokens (the correctness gate),
    from the model it ran (the bundled model, or `served`)."""
    outputs = report["outputs"]
    failed = {rid: out.outputs[0].finish_reason for rid, out in outputs.items()
              if out.outputs[0].finish_reason.startswith("error")}
    assert not failed, f"{what}: requests failed: {dict(list(failed.items())[:3])}"
    for rid, (_, prompt, new_tokens) in enumerate(requests):
        want, got = generated(tuple(prompt), new_tokens, served), outputs[rid].outputs[0].tokens
        assert got == want, (f"{what}: request {rid} (a prompt of {len(prompt)} tokens) got "
                             f"{got[:12]}..., kvlab.generate gives {want[:12]}...")


# ---- the reference policy (the judge's own, for the full-marks line) ------------------------
class Reference:
    """Decodes first, at most 8 running, prompt chunks of at most 64 tokens a step, those
    that can still meet their TTFT admitted first, the shortest first."""

    def plan(self, view):
        run, preempt, free, tokens = [], [], view.free_blocks, view.max_batch_tokens
        decoding = [r for r in view.running if r.decoding]
        for r in decoding:
            while view.blocks_needed(r, 1) > free and len(view.running) > len(preempt) + 1:
                victim = max((x for x in view.running if x is not r and x.id not in preempt
                              and all(x.id != rid for rid, _ in run)),
                             key=lambda x: (not x.decoding, x.blocks), default=None)
                if victim is None:
                    break
                preempt.append(victim.id)
                free += victim.blocks
            if r.id not in preempt and view.blocks_needed(r, 1) <= free:
                run.append((r.id, 1))
                free, tokens = free - view.blocks_needed(r, 1), tokens - 1
        late = lambda r: (r.generated == 0 and view.now - r.arrival_time > SLO_TARGET.ttft_s,
                          r.pending)
        others = sorted((r for r in view.running if not r.decoding and r.id not in preempt),
                        key=late)
        if not preempt and len(view.running) < 8:
            others += sorted(view.waiting, key=late)[:8 - len(view.running)]
        chunk = 64
        for r in others:
            n = min(r.pending, tokens, chunk)
            if n > 0 and len(run) < view.max_batch_seqs and view.blocks_needed(r, n) <= free:
                run.append((r.id, n))
                free, tokens, chunk = free - view.blocks_needed(r, n), tokens - n, chunk - n
        if not run and not preempt and view.running:
            preempt.append(view.running[-1].id)
        return StepPlan(run, preempt)


_measured = {}          # this grading's capstone run: the goodputs, or why there are none


def workload_that_matters(rng, served, tries=6):
    """A drawn workload on which the order of service matters: the reference policy's
    goodput at least REFERENCE_GAIN times the default engine's (a light draw, which any
    order serves about as well, is drawn again; about one in eight is), on model `served`.
    Returns it with the two baselines' reports."""
    for _ in range(tries):
        requests = draw_workload(rng)
        default = run(requests, served=served)
        reference = run(requests, served=served, scheduler=Reference())
        if reference["goodput"] >= REFERENCE_GAIN * default["goodput"]:
            break
    return requests, default, reference


def goodputs(sub, rng):
    """(the student's goodput, the default's, the reference's) on one drawn workload and
    one nudged model (nudged_model), measured once a grading: the first of the three tests
    that asks runs it. The meter starts first: what the worker computed since it started,
    beyond its startup's allowance, is charged at its first call (a table made at import,
    a thread busy while the baselines run)."""
    if not _measured:
        try:
            meter = PluginMeter(worker_pid(sub), slowness=Slowness(), startup_s=STARTUP_ALLOWANCE_S)
            served = nudged_model(rng)
            requests, default, reference = workload_that_matters(rng, served)
            plugins = metered_plugins(sub, meter)
            mine = run(requests, served=served, **plugins)
            mine["plugin_cpu_s"] = plugins["meter"].charged
            check_tokens(requests, mine, "the capstone run", served)
            _measured["goodputs"] = (mine, default, reference)
        except (AssertionError, Exception) as error:
            _measured["failed"] = error
    if "failed" in _measured:
        raise _measured["failed"]
    return _measured["goodputs"]


def metered_plugins(sub, meter):
    """The student's scheduler and drafter for the capstone run, and the meter that puts
    the CPU time their worker spends on the virtual clock (kvlab.grading.plugin_cpu:
    beyond an allowance a call, and all its child processes'); made after the meter
    starts, so that what their constructors compute is charged too. The two baselines
    run in the judge, with no worker: their plans are priced as kvlab's own scheduler's
    are, by the step's fixed price, which the allowance stands for."""
    return dict(meter=meter,
                scheduler=meter.metered(PlainScheduler(sub.Scheduler()), "plan"),
                drafter=meter.metered(PlainDrafter(sub.Drafter()), "propose"))


def tier(sub, rng, share):
    """The goodput line `share` of the way from the floor (the default engine's goodput,
    and at least a quarter of the reference's) to the reference's."""
    mine, default, reference = goodputs(sub, rng)
    floor = max(default["goodput"], 0.25 * reference["goodput"])
    line = floor + share * max(0.0, reference["goodput"] - floor)
    said = (f"your goodput {mine['goodput']:.1f} requests/s ({mine['served']} of "
            f"{mine['requests']} within TTFT {SLO_TARGET.ttft_s * 1e3:g} ms and TPOT "
            f"{SLO_TARGET.tpot_s * 1e3:g} ms; {mine['missed_ttft']} missed the TTFT, "
            f"{mine['missed_tpot']} the TPOT; {1e3 * mine['plugin_cpu_s']:.1f} ms of your "
            f"plug-ins' CPU time charged to the clock), kvlab's default engine "
            f"{default['goodput']:.1f}, the reference {reference['goodput']:.1f}")
    assert mine["goodput"] >= line - 1e-9, f"{said}: this tier needs {line:.1f}"
    return f"{said}: this tier needs {line:.1f}"


# ---- the tests --------------------------------------------------------------------------------
@points(3)
def test_the_allocator_follows_the_pool_through_forks_drafts_and_preemptions(sub, rng):
    """your BlockAllocator, driven as the engine's pool is (forks of n=3 samples, drafts cut back, preemptions on 24 blocks), agrees with it after every step"""
    requests = draw_workload(rng, 10)
    engine = kvlab.Engine(model(), num_blocks=24, block_size=8, max_batch_tokens=64,
                          allocator=lambda n, size: sub.BlockAllocator(n, size),
                          drafter=PromptLookup(), clock=VirtualClock(StepCost.for_model(model())))
    for _, prompt, new_tokens in requests[:8]:
        engine.add_request(prompt[:60], kvlab.SamplingParams(max_new_tokens=min(new_tokens, 24)))
    engine.add_request(requests[8][1][:13], kvlab.SamplingParams(max_new_tokens=12, n=3,
                                                                temperature=0.8, seed=int(rng.integers(1000))))
    try:
        engine.run(progress=False)
    except PluginError as error:
        raise stopped(error) from None


@points(3)
def test_the_schedulers_plans_follow_the_rules_and_keep_every_token(sub, rng):
    """your Scheduler on a drawn workload of 16 requests on a pool of 40 blocks: every plan passes the engine's checks and every request gets kvlab.generate's tokens"""
    requests = draw_workload(rng, 16)
    report = run(requests, num_blocks=40, scheduler=PlainScheduler(sub.Scheduler()))
    check_tokens(requests, report, "your scheduler")


@points(2)
def test_the_drafter_guesses_what_the_model_says(sub, rng):
    """your Drafter on 36 drawn contexts, each a prompt and the model's own first 40 to 119 tokens after it: at most k valid ids, and at least a third as many drafts the model agrees with (its next tokens) as prompt lookup's"""
    ids, drafter, lookup, served = text(), sub.Drafter(), PromptLookup(), nudged_model(rng)
    mine = theirs = drafted = 0
    for _ in range(DRAFTER_CONTEXTS):
        start, length = int(rng.integers(0, len(ids) - 40)), int(rng.integers(8, 40))
        prompt = ids[start:start + length]
        cut, k = int(rng.integers(*DRAFTER_CUT)), int(rng.integers(2, 7))
        own = generated(tuple(prompt), cut + k, served)      # no more than the test reads
        context, want = prompt + own[:cut], own[cut:]
        drafts = drafter.propose(list(context), k)
        assert isinstance(drafts, list) and len(drafts) <= k and all(
            isinstance(t, int) and 0 <= t < model().config.vocab_size for t in drafts), (
            f"propose(a context of {len(context)} tokens, {k}) must give at most {k} token "
            f"ids, got {str(drafts)[:200]}")
        mine += agreed(drafts, want)
        theirs += agreed(lookup.propose(context, k), want)
        drafted += len(drafts)
    assert drafted > 0, f"your drafter proposed nothing on {DRAFTER_CONTEXTS} contexts"
    print(f"the model agreed with {mine} of your {drafted} drafts, {theirs} of prompt lookup's")
    assert 3 * mine >= theirs, (
        f"the model agreed with {mine} of your {drafted} drafts (each up to the first it "
        f"refused), with {theirs} of prompt lookup's: at least a third as many are needed")


def agreed(drafts, want):
    """How many drafts the model keeps: those before the first that is not its own token."""
    n = 0
    while n < len(drafts) and n < len(want) and drafts[n] == want[n]:
        n += 1
    return n


@points(3)
def test_the_capstone_run_gives_every_request_generates_tokens(sub, rng):
    """the capstone run (48 drawn requests, your scheduler and drafter): every request's tokens exactly kvlab.generate's"""
    goodputs(sub, rng)


@points(3)
def test_goodput_reaches_kvlabs_default_engine(sub, rng):
    """goodput under the SLO at least that of kvlab's own Engine on the same workload (and a quarter of the reference's)"""
    return tier(sub, rng, GOODPUT_TIERS[0])


@points(3)
def test_goodput_reaches_halfway_to_the_reference(sub, rng):
    """goodput at least halfway from kvlab's default engine's to the reference's"""
    return tier(sub, rng, GOODPUT_TIERS[1])


@points(3)
def test_goodput_reaches_the_reference(sub, rng):
    """goodput at least 85 % of the way from kvlab's default engine's to the reference policy's"""
    return tier(sub, rng, GOODPUT_TIERS[2])


# ---- the prefix cache (its own engine run, beside the pool's cache) ---------------------------
PREFIX_ENGINE = dict(num_blocks=20, block_size=8, max_batch_tokens=32)
SPLICED = (6, 8, 13)        # the requests of spliced() prompts


def draw_shared_prompts(rng, n_requests=17, size=PREFIX_ENGINE["block_size"]):
    """Three system prompts of 2 to 6 whole blocks cut from the text; each request one of
    them, then 1 to 12 tokens of its own, or nothing (every fourth request, and three in
    ten of the others): a prompt of whole blocks, all of it cached when a request before it
    had the same system prompt, but the last token's block, which is run. The 10th and
    11th are instead prompts of 8 to 10 blocks of their own, which evict much of what is
    cached before the last ones come back to the system prompts. The 7th, 9th and 14th
    are spliced (SPLICED, spliced()): blocks the cache holds, each after a parent it does
    not hold it under, and 1 to 12 tokens of their own. 4 to 12 new tokens each, on 20
    blocks."""
    ids = text()
    systems = []
    for _ in range(3):
        length = size * int(rng.integers(2, 7))
        start = int(rng.integers(0, len(ids) - length))
        systems.append(ids[start:start + length])
    requests, used = [], []           # the system prompts used, by number, in order
    for i in range(n_requests):
        if i in (9, 10):
            own, system = size * int(rng.integers(8, 11)), []
        else:
            own = 0 if i % 4 == 3 or rng.random() < 0.3 else int(rng.integers(1, 13))
            if i in SPLICED:
                own = max(own, 1)       # the block after the first held whole
                system = spliced([systems[u] for u in reversed(used[:-1])], size)
            else:
                used.append(int(rng.integers(3)))
                system = systems[used[-1]]
        start = int(rng.integers(0, len(ids) - own))
        requests.append((system + ids[start:start + own], int(rng.integers(4, 13))))
    return requests


def spliced(earlier, size):
    """A prompt of blocks the pool's cache may hold, none but the first after the parent it
    is held under. earlier: the system prompts of the requests before, the latest first,
    less the last request's (still running when this one is admitted, its blocks often
    not cached yet). The first block of earlier[0], then the blocks from the second on of
    the latest that starts otherwise, at their own positions (or, if none does, earlier[0]'s
    own blocks from the second on, each a block early). The pool reuses the first block at
    most; a cache that keys a block by its tokens, or by its position, without the blocks
    before it (a parent-free hash) claims more: 100 draws of 100 caught either, where the
    draw without spliced prompts caught 0 and 1 of 20."""
    first = earlier[0]
    other = next((s for s in earlier if s[:size] != first[:size]), None)
    return first[size:] if other is None else first[:size] + other[size:]


@points(3)
def test_the_prefix_cache_answers_what_the_pools_cache_holds(sub, rng):
    """your PrefixCache beside the pool's prefix cache, on 17 drawn requests sharing 3 drawn system prompts (some whole, repeated; some spliced from two of them; two long ones that evict them between) on a pool of 20 blocks: every match() exactly the pool's reuse, every token kvlab.generate's"""
    requests = draw_shared_prompts(rng)
    engine = kvlab.Engine(model(), **PREFIX_ENGINE,
                          prefix_cache=lambda size: sub.PrefixCache(size))
    for prompt, new_tokens in requests:
        engine.add_request(prompt, kvlab.SamplingParams(max_new_tokens=new_tokens))
    try:
        outputs = engine.run(progress=False)
    except PluginError as error:
        raise stopped(error) from None
    for rid, (prompt, new_tokens) in enumerate(requests):
        want, got = generated(tuple(prompt), new_tokens), outputs[rid].outputs[0].tokens
        assert got == want, f"request {rid} got {got[:12]}..., kvlab.generate gives {want[:12]}..."
