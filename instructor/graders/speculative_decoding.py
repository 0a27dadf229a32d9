"""Hidden grading tests for lab 12 (speculative decoding). Each test says in its message what
it expected. Run by the judge (kvlab/grading/judge.py), never shipped in the package.

The model the student's functions get is served from the judge (kvlab/grading/served.py,
ServedModel): it and its caches stay in this process, and the student's code calls them
from the worker. So every forward pass it runs is counted here, with its tokens, where it
started and the arg-max of every row, and every cache is read here directly: nothing the
student's code reports is taken on trust. The oracles are the judge's own too: kvlab's
PromptLookup for the drafter, a plain greedy loop over kvlab's model for the tokens, and a
fresh kvlab cache that only ever ran the accepted tokens for rollback (K and V bit for bit:
on the CPU kvlab's forward gives the same K and V for a position however the tokens before
it were split into passes).

The sampling rejection rule gets a generator of the judge's (served.py, ServedRandom),
seeded here: every number it draws and every distribution it draws a token from are seen.
Its oracle is the distribution speculative sampling must give, tested as the kit's own
tests/test_speculative.py tests kvlab's (Pearson's chi-square, rare outcomes pooled), on
drafts drawn here from q.

Cases are drawn at grading time: the token ids of the crafted drafter contexts and the
lengths of their runs, the prompts (lines of the play, repeated and cut anywhere), k, the
n-gram order, the lengths, the rejection rule's distributions and seeds. A pass is also checked for drafts wherever prompt lookup finds
some, so speculating only now and then is not enough.
"""
import functools
import os
import time

import numpy as np

from kvlab.grading.plugin_cpu import worker_pid
from kvlab.grading.served import ServedModel, ServedRandom
from kvlab.grading.testkit import bundled_model, described, number, points, whole_number
from kvlab.speculative import PromptLookup

LINES = ("ROMEO:\nBut soft, what light through yonder window breaks?\n",
         "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
         "First Citizen:\nBefore we proceed any further, hear me speak.\n",
         "GLOUCESTER:\nNow is the winter of our discontent\n",
         "HAMLET:\nTo be, or not to be, that is the question.\n",
         "MENENIUS:\nI tell you, friends, most charitable care\n")
REPORT = ("passes_plain", "passes_speculative", "drafted", "accepted", "acceptance_rate",
          "seconds_plain", "seconds_speculative", "speedup")


def prepare():
    bundled_model()
    greedy(tuple(bundled_model().encode(LINES[0])), 8)


@functools.lru_cache(maxsize=None)
def greedy(prompt: tuple, n_new: int) -> tuple:
    """The model's greedy tokens after `prompt`: a prefill, then one token a pass."""
    model = bundled_model()
    cache = model.new_cache(len(prompt) + n_new)
    tokens = [int(np.argmax(model.prefill(list(prompt), cache)))]
    while len(tokens) < n_new:
        tokens.append(int(np.argmax(model.decode(tokens[-1], cache))))
    return tuple(tokens)


def repetitive_prompt(rng) -> list:
    """A line of the play twice, then the start of it again, cut anywhere."""
    line = LINES[int(rng.integers(len(LINES)))]
    return bundled_model().encode(line + line + line[:int(rng.integers(3, len(line)))])


def text_prompt(rng) -> list:
    """The start of a line: nothing in it repeats for long."""
    line = LINES[int(rng.integers(len(LINES)))]
    return bundled_model().encode(line[:int(rng.integers(6, len(line)))])


def show(tokens, limit=10) -> str:
    tokens = [int(t) for t in tokens]
    if len(tokens) <= limit:
        return str(tokens)
    return f"[..., {', '.join(map(str, tokens[-limit:]))}] ({len(tokens)} tokens)"


def token_list(got, what) -> list:
    """What came back as a list of token ids, or a failed test."""
    if isinstance(got, np.ndarray) and got.ndim == 1 and got.dtype.kind in "iu":
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{what}: expected a list of token ids, got {described(got)}")
    return [whole_number(t, f"{what}, item {i}") for i, t in enumerate(got)]


def pair(got, what) -> tuple:
    """verify's (accepted, token), or a failed test."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise AssertionError(f"{what}: expected (accepted, token), got {described(got)}")
    return whole_number(got[0], f"{what}: accepted"), whole_number(got[1], f"{what}: token")


def same_cache(cache, tokens, what):
    """The served cache holds exactly the K and V of `tokens`, bit for bit: what a fresh
    kvlab cache that ran only those tokens (in one pass) holds."""
    tokens = [int(t) for t in tokens]
    assert cache.length == len(tokens), (
        f"{what}: the cache should hold {len(tokens)} positions, it holds {cache.length} "
        f"(tokens {show(cache.tokens)}; expected {show(tokens)})")
    assert cache.tokens == tokens, (
        f"{what}: the cache holds the wrong tokens: {show(cache.tokens)}, expected {show(tokens)}")
    model = bundled_model()
    fresh = model.new_cache(max(len(tokens), 1))
    if tokens:
        model.prefill(tokens, fresh)
    for name, got, want in (("keys", cache._cache.keys, fresh.keys),
                            ("values", cache._cache.values, fresh.values)):
        assert np.array_equal(got, want), (
            f"{what}: the cache's {name} differ from those of a cache that only ever ran "
            f"{show(tokens)}")


class Verification:
    """A served model and a cache holding a context minus its newest token, run by the
    judge; the model's own greedy continuation of the context, to make drafts from."""

    def __init__(self, prompt, k):
        self.model = ServedModel()
        self.context = [int(t) for t in prompt]
        self.cache = self.model.new_cache(len(self.context) + k + 2)
        self.model.forward(self.context[:-1], self.cache)
        self.newest = self.context[-1]
        self.mark = len(self.model.passes)

    def want(self, drafts):
        """(accepted, token) by the greedy rule, from the judge's own runs of the model."""
        accepted = 0
        for d in drafts:
            if greedy(tuple(self.context + drafts[:accepted]), 1)[0] != d:
                break
            accepted += 1
        return accepted, greedy(tuple(self.context + drafts[:accepted]), 1)[0]

    def run(self, sub, drafts, what):
        """The student's verify on these drafts; its (accepted, token), and that it ran
        exactly one pass of the newest token and the drafts with every row."""
        got = pair(sub.verify(self.model, self.cache, self.newest, list(drafts)), what)
        ran = self.model.passes[self.mark:]
        tokens = [self.newest] + list(drafts)
        assert len(ran) == 1, (
            f"{what}: verify runs ONE forward pass, of the newest token and every draft "
            f"together; the model ran {len(ran)}: " + ", ".join(show(p.tokens, 6) for p in ran))
        assert list(ran[0].tokens) == tokens, (
            f"{what}: the pass must run the newest token then the drafts, {show(tokens)} "
            f"(the cache holds the context before the newest token); it ran {show(ran[0].tokens)}")
        assert ran[0].all_logits, (
            f"{what}: the pass needs a row of logits for every token it runs "
            f"(all_logits=True): row i says what the model would choose after token i")
        return got


def wrong_token(rng, right):
    while True:
        token = int(rng.integers(32, 127))
        if token != right:
            return token


# ---- the drafter ---------------------------------------------------------------------------

# The crafted cases: a letter is a token id, a digit a run of 1 to 4 ids found nowhere else
# in the context (0, at the start: 0 to 3 of them). The ids, the runs' lengths and k are
# drawn at grading time: each case keeps its rule, but its context has no fixed shape (a table
# of the cases' patterns of repeats fails them).
# context, k (lowest, highest; None: more than follow the match), max_ngram, what it tests
CRAFTED = (
    ("0abc1abc2abc", (1, 3), 3, "two earlier matches of the last 3 tokens: the latest one wins"),
    ("0abcd1abcd", (1, 4), 3, "at most k tokens after the match"),
    ("0abcd1abc", None, 3, "fewer than k tokens follow the match: all of them"),
    ("0abc1zbc2abc", (1, 3), 3,
     "the last 3 tokens match far back, the last 2 more recently: the longer n-gram wins"),
    ("0abc1zbc2abc", (1, 3), 1,
     "the same context with max_ngram=1: the latest match of the last token"),
    ("0xyb1rsb", (1, 3), 3, "no match of the last 3 or 2 tokens: the last token alone"),
    ("0abcdxyz", (1, 5), 3, "no earlier occurrence of even the last token: no drafts"),
    ("0abab", (2, 5), 3, "the match may overlap the end: what follows it runs into the tail"),
    ("0aaaa", (1, 4), 3,
     "aaaa: the last 3 tokens also occur one token earlier, where only 1 token follows"),
    ("a", (1, 4), 3, "a single token: nothing before it to match"),
    ("0abc1abc", (0, 0), 3, "k = 0: no drafts"),
)


def crafted_context(rng, template):
    """The token ids of a CRAFTED template: its letters and runs drawn."""
    ids = [int(t) for t in rng.permutation(256)]
    letters = {c: ids.pop() for c in sorted(set(template)) if not c.isdigit()}
    tokens = []
    for c in template:
        if c.isdigit():
            run = int(rng.integers(0, 4)) if c == "0" else int(rng.integers(1, 5))
            tokens += [ids.pop() for _ in range(run)]
        else:
            tokens.append(letters[c])
    return tokens


@points(2)
def test_propose_on_crafted_contexts(sub, rng):
    """prompt lookup, one rule a case: the latest match, the longest n-gram first, k, no match"""
    contexts = {}                       # a template used twice is the same context twice
    for template, ks, max_ngram, why in CRAFTED:
        if template not in contexts:
            contexts[template] = crafted_context(rng, template)
        tokens = contexts[template]
        if ks is None:                  # more than follow the latest match of the tail
            k = len(tokens) + int(rng.integers(0, 4))
        else:
            k = int(rng.integers(ks[0], ks[1] + 1))
        want = PromptLookup(max_ngram).propose(tokens, k)
        call = f"propose({tokens}, k={k}, max_ngram={max_ngram})"
        got = token_list(sub.propose(tokens, k, max_ngram), call)
        assert got == want, f"{call} ({why}): expected {want}, got {got}"
    assert token_list(sub.propose([], 4, 3), "propose([], 4, 3)") == [], (
        "propose([], k=4, max_ngram=3): an empty context has nothing to match")


@points(1)
def test_propose_on_random_contexts(sub, rng):
    """prompt lookup on random contexts over a few token ids, as kvlab's own drafter proposes"""
    for _ in range(40):
        alphabet = rng.choice(256, int(rng.integers(2, 7)), replace=False)
        tokens = [int(t) for t in rng.choice(alphabet, int(rng.integers(2, 40)))]
        k, max_ngram = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        want = PromptLookup(max_ngram).propose(tokens, k)
        got = token_list(sub.propose(tokens, k, max_ngram), f"propose(..., k={k}, max_ngram={max_ngram})")
        assert got == want, (f"propose({tokens}, k={k}, max_ngram={max_ngram}): expected {want}, "
                             f"got {got}")


# ---- verification and rollback ------------------------------------------------------------

@points(2)
def test_verify_keeps_drafts_the_model_agrees_with(sub, rng):
    """every draft the model's own choice: all kept, and the model's next token after them, from one pass"""
    for k in (1, int(rng.integers(2, 5)), int(rng.integers(5, 8))):
        prompt = repetitive_prompt(rng) if k > 1 else text_prompt(rng)
        v = Verification(prompt, k)
        drafts = list(greedy(tuple(v.context), k + 1))
        drafts, bonus = drafts[:k], drafts[k]
        what = f"verify with {k} draft{'s' * (k > 1)} {drafts}, each the model's greedy choice"
        accepted, token = v.run(sub, drafts, what)
        assert accepted == k, (f"{what}: {'all ' * (k > 1)}{k} should be accepted, your verify "
                               f"says {accepted}")
        assert token == bonus, (
            f"{what}: the token after them is the arg-max of the last row (row {k}), {bonus}; "
            f"got {token}")


@points(2)
def test_verify_stops_at_the_first_wrong_draft(sub, rng):
    """a wrong first draft: none kept, the correction; right, wrong, right: only those before the wrong one"""
    # all wrong
    v = Verification(text_prompt(rng), 4)
    right = greedy(tuple(v.context), 1)[0]
    drafts = [wrong_token(rng, right) for _ in range(int(rng.integers(1, 5)))]
    what = f"verify with drafts {drafts}, the first of them not the model's choice ({right})"
    got = v.run(sub, drafts, what)
    assert got == (0, right), (
        f"{what}: expected (0, {right}): nothing kept, and the model's own token from row 0; "
        f"got {got}")
    # right, right, ..., wrong, then the model's choice after the wrong one
    for j in (1, int(rng.integers(2, 4))):
        v = Verification(repetitive_prompt(rng), j + 2)
        ahead = list(greedy(tuple(v.context), j + 1))
        wrong = wrong_token(rng, ahead[j])
        after = greedy(tuple(v.context + ahead[:j] + [wrong]), 1)[0]
        drafts = ahead[:j] + [wrong, after]
        what = (f"verify with drafts {drafts}: {j} the model would choose, then {wrong} "
                f"where it would choose {ahead[j]}, then {after}, its choice after {wrong}")
        got = v.run(sub, drafts, what)
        assert got == (j, ahead[j]), (
            f"{what}: expected ({j}, {ahead[j]}): the drafts before the wrong one kept, none "
            f"after it (a draft after a wrong one was checked against the wrong context), and "
            f"the model's token from row {j}; got {got}")


@points(1)
def test_verify_without_drafts_is_a_decode_step(sub, rng):
    """no drafts: one pass of the newest token alone, nothing kept, and the model's next token"""
    for prompt in (text_prompt(rng), repetitive_prompt(rng)):
        v = Verification(prompt, 0)
        want = greedy(tuple(v.context), 1)[0]
        what = f"verify with no drafts after {show(v.context)}"
        got = v.run(sub, [], what)
        assert got == (0, want), f"{what}: expected (0, {want}), a plain decode step; got {got}"


@points(2)
def test_rollback_keeps_only_the_accepted_drafts(sub, rng):
    """rollback(cache, n, accepted) after a pass of n drafts: K and V as if only the accepted ones ran"""
    n = int(rng.integers(3, 7))
    for accepted in (0, int(rng.integers(1, n)), n):
        v = Verification(repetitive_prompt(rng), n)
        drafts = [int(t) for t in rng.integers(32, 127, n)]
        v.model.forward([v.newest] + drafts, v.cache, all_logits=True)
        what = (f"a cache of {len(v.context) - 1} positions after a pass of the newest token and "
                f"{n} drafts {drafts}, then rollback(cache, {n}, {accepted})")
        sub.rollback(v.cache, n, accepted)
        same_cache(v.cache, v.context + drafts[:accepted], what)
    v = Verification(text_prompt(rng), 0)
    v.model.forward([v.newest], v.cache, all_logits=True)
    sub.rollback(v.cache, 0, 0)
    same_cache(v.cache, v.context, "after a pass of the newest token alone, rollback(cache, 0, 0)")


@points(1)
def test_verify_leaves_the_cache_holding_the_accepted_tokens(sub, rng):
    """the cache after verify (all right, first wrong, some right, none): the accepted tokens' K and V only"""
    k = int(rng.integers(3, 6))
    v = Verification(repetitive_prompt(rng), k)
    ahead = list(greedy(tuple(v.context), k + 1))
    j = int(rng.integers(1, k - 1))
    wrong = wrong_token(rng, ahead[j])
    # after the wrong draft, the model's own choice in a context holding it: not to be kept
    after = list(greedy(tuple(v.context + ahead[:j] + [wrong]), k - j - 1))
    cases = (("every draft right", ahead[:k]),
             ("the first draft wrong", [wrong_token(rng, ahead[0])] + ahead[1:k]),
             (f"the first {j} right, then a wrong one", ahead[:j] + [wrong] + after),
             ("no drafts", []))
    for why, drafts in cases:
        v = Verification(v.context, k)
        accepted, _ = pair(sub.verify(v.model, v.cache, v.newest, drafts), f"verify, {why}")
        kept, _ = v.want(drafts)
        assert accepted == kept, (f"verify with drafts {drafts} ({why}): expected {kept} accepted, "
                                  f"got {accepted}")
        same_cache(v.cache, v.context + drafts[:kept],
                   f"after verify with drafts {drafts} ({why}): the context, the newest token "
                   f"and the {kept} accepted drafts, and nothing of the rest")


# ---- generation ----------------------------------------------------------------------------

@points(1)
def test_plain_generation_is_greedy(sub, rng):
    """generate_plain: the model's greedy tokens, from a prefill and one single-token pass a token"""
    model = ServedModel()
    prompt, n_new = text_prompt(rng), int(rng.integers(8, 30))
    got = token_list(sub.generate_plain(model, prompt, n_new), "generate_plain")
    want = list(greedy(tuple(prompt), n_new))
    assert got == want, f"generate_plain, {n_new} tokens after {show(prompt)}: expected {want}, got {got}"
    ran = [len(p.tokens) for p in model.passes]
    assert ran == [len(prompt)] + [1] * (n_new - 1), (
        f"generate_plain: a prefill of the {len(prompt)} prompt tokens, then one pass of one "
        f"token for each of the other {n_new - 1}; the model ran passes of {ran} tokens")


def text(ids) -> str:
    """The text of some token ids (the bundled model's tokens are bytes), for messages."""
    model = bundled_model()
    return model.decode_text([t for t in ids if 0 <= t < model.config.vocab_size])


def speculative_tokens(sub, model, prompt, n_new, k, max_ngram):
    what = f"generate_speculative, {n_new} tokens after {show(prompt)}, k={k}, max_ngram={max_ngram}"
    got = sub.generate_speculative(model, prompt, n_new, k, max_ngram)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise AssertionError(f"{what}: expected (tokens, stats), got {described(got)}")
    tokens, want = token_list(got[0], what), list(greedy(tuple(prompt), n_new))
    if len(tokens) != n_new:
        raise AssertionError(f"{what}: expected {n_new} tokens, got {len(tokens)}")
    if tokens != want:
        first = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
        raise AssertionError(
            f"{what}: your tokens differ from plain greedy decoding's from token {first} on: "
            f"expected {want[first:first + 8]} ({text(want[first:])!r}), got "
            f"{tokens[first:first + 8]} ({text(tokens[first:])!r}), after {show(want[:first], 8)}")
    # every token must come out of the model, as the grader saw it run: some pass's row over
    # exactly the text before that token picked it (a table of answers runs no pass)
    full = list(prompt) + want
    computed = set()
    for p in model.passes:
        seen = list(p.context) + list(p.tokens)
        for j, pick in enumerate(p.picks):
            at = len(p.context) + j + 1                # the position this row predicts
            if at < len(full) and pick == full[at] and seen[:at] == full[:at]:
                computed.add(at)
    missing = [i for i in range(n_new) if len(prompt) + i not in computed]
    assert not missing, (
        f"{what}: tokens {missing[:8]} of your output were not chosen by any forward pass the "
        f"grader ran over a cache with the text before them: every token must come from the "
        f"model's own passes")
    return what


@points(2)
def test_speculative_generation_keeps_the_greedy_tokens(sub, rng):
    """generate_speculative: token for token plain greedy decoding's, for several k, n-gram orders, prompts"""
    draw = lambda low, high: int(rng.integers(low, high))      # noqa: E731
    cases = [(repetitive_prompt(rng), draw(30, 61), draw(2, 7), draw(1, 5)),
             (text_prompt(rng), draw(20, 41), draw(1, 7), draw(1, 5)),
             (repetitive_prompt(rng), int(rng.integers(2, 6)), 6, 3),
             (bundled_model().encode("\n"), int(rng.integers(10, 25)), int(rng.integers(1, 5)), 3),
             (text_prompt(rng), 1, 4, 3)]
    for number, (prompt, n_new, k, max_ngram) in enumerate(cases):
        model = ServedModel()
        what = speculative_tokens(sub, model, prompt, n_new, k, max_ngram)
        if number == 0:       # a prompt that repeats itself: prompt lookup always finds drafts
            verified = [len(p.tokens) for c in model.caches_used() for p in model.passes_over(c)[1:]]
            assert any(n > 1 for n in verified), (
                f"{what}: no pass after the prefill checked a draft (passes of {verified} "
                f"tokens): on a prompt that repeats itself, prompt lookup proposes drafts and "
                f"one pass verifies them")


@points(2)
def test_speculation_takes_fewer_passes_than_tokens(sub, rng):
    """repetitive prompts: drafts at every pass where prompt lookup finds some, so the greedy tokens in fewer passes than tokens, as the grader counts; k drafts at most"""
    for _ in range(2):
        model = ServedModel()
        prompt, n_new = repetitive_prompt(rng), int(rng.integers(32, 49))
        k, max_ngram = int(rng.integers(2, 7)), int(rng.integers(2, 5))
        what = speculative_tokens(sub, model, prompt, n_new, k, max_ngram)
        ran = [len(p.tokens) for p in model.passes]
        assert len(ran) < n_new, (
            f"{what}: {n_new} tokens in {len(ran)} forward passes, as the grader counted them "
            f"(passes of {ran} tokens): speculation must take fewer passes than tokens on a "
            f"prompt that repeats itself")
        for cache in model.caches_used():
            later = [len(p.tokens) for p in model.passes_over(cache)[1:]]
            assert max(later, default=0) <= k + 1, (
                f"{what}: a verification pass runs the newest token and at most k = {k} drafts; "
                f"the passes after the prefill ran {later} tokens")
        # fewer passes than tokens is one good verification away: speculation drafts at
        # every pass where the text so far ends in a token it held before (prompt lookup then
        # finds a match, whichever n-gram and place a drafter picks)
        text = list(prompt) + list(greedy(tuple(prompt), n_new))
        for p in model.passes:
            seen = list(p.context) + [p.tokens[0]]          # the text up to the newest token
            chosen = len(seen) - len(prompt)                 # the tokens chosen before the pass
            if p.start == 0 or chosen < 1 or seen != text[:len(seen)]:
                continue                                     # a prefill, or not the greedy text
            cap = min(k, n_new - chosen - 1)
            lookup = PromptLookup(max_ngram).propose(seen, cap) if cap > 0 else []
            assert p.drafts or not lookup, (
                f"{what}: with {chosen} of {n_new} tokens chosen, a pass checked no drafts, but "
                f"the text so far ends in a token it held before, and prompt lookup proposes "
                f"{lookup}: speculate at every pass (passes of {ran} tokens), not only until "
                f"the passes are fewer than the tokens")
            # and drafts looked up, not made up: whatever n-gram matched, the first draft
            # followed an earlier occurrence of the text's last token
            followers = {seen[i + 1] for i in range(len(seen) - 1) if seen[i] == seen[-1]}
            assert not lookup or p.drafts[0] in followers, (
                f"{what}: with {chosen} of {n_new} tokens chosen, a pass checked the drafts "
                f"{list(p.drafts)}, but {p.drafts[0]} never followed the last token "
                f"{seen[-1]} in the text so far (tokens that did: {sorted(followers)}): drafts "
                f"come from the text, by prompt lookup")


@points(1)
def test_drafts_never_pass_the_tokens_still_wanted(sub, rng):
    """near the end: at most the tokens still wanted minus one drafts a pass, and no pass after the last token"""
    # The tokens chosen before each pass are counted as the greedy rule keeps them, from the
    # passes the grader saw (a mistake in verify is the verify tests' concern, not this one's).
    for n_new in (2, int(rng.integers(3, 9)), int(rng.integers(9, 25))):
        model = ServedModel()
        prompt, k, max_ngram = repetitive_prompt(rng), int(rng.integers(4, 8)), int(rng.integers(2, 5))
        what = f"generate_speculative, {n_new} tokens after {show(prompt)}, k={k}, max_ngram={max_ngram}"
        got = sub.generate_speculative(model, prompt, n_new, k, max_ngram)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise AssertionError(f"{what}: expected (tokens, stats), got {described(got)}")
        caches = model.caches_used()
        assert len(caches) == 1, (f"{what}: one cache, prefilled with the prompt, then verified "
                                  f"on; the model ran passes over {len(caches)} caches")
        passes = model.passes_over(caches[0])
        ran = [len(p.tokens) for p in passes]
        assert passes[0].start == 0 and passes[0].tokens == tuple(prompt), (
            f"{what}: the first pass is the prefill of the prompt; the model ran passes of {ran} tokens")
        chosen, text = 1, list(prompt) + list(greedy(tuple(prompt), n_new))
        could_draft = False          # did prompt lookup find drafts before any pass?
        for p in passes[1:]:
            wanted = n_new - chosen
            if 0 < min(k, wanted - 1):
                could_draft |= bool(PromptLookup(max_ngram).propose(
                    text[:len(prompt) + chosen], min(k, wanted - 1)))
            assert wanted > 0, (f"{what}: a pass ran after all {n_new} tokens were chosen (passes "
                                f"of {ran} tokens): stop at n_new")
            cap = min(k, wanted - 1)
            assert len(p.drafts) <= cap, (
                f"{what}: with {chosen} of {n_new} tokens chosen, a pass checked "
                f"{len(p.drafts)} drafts; at most min(k, {wanted} still wanted - 1) = {cap}: the "
                f"pass adds a token of its own after the accepted drafts, so more drafts could "
                f"never all be kept, and the model runs tokens that are thrown away")
            chosen += p.accepted + 1
        # (a repetitive prompt need not give lookup a match before each of a few last passes:
        # the check asks for drafts only where kvlab's own drafter finds some)
        assert not could_draft or any(p.drafts for p in passes[1:]), (
            f"{what}: no pass after the prefill checked a draft (passes of {ran} tokens), but "
            f"prompt lookup finds drafts in the text so far: one pass verifies them")


def waited_for_a_cpu(pids) -> float:
    """Seconds the main threads of processes `pids` have spent ready to run but waiting for
    a CPU, in all (the second field of Linux's /proc/PID/schedstat, in nanoseconds): what a
    loaded machine adds to a wall-clock time. 0.0 for a process the kernel says nothing of
    (another OS, or one that ended)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def check_run_times(seconds, plain, spec, started, ended, waited, what):
    """measure's two times against the passes the judge timed (on the clock every process
    shares). Each run's time holds its passes, from the first's start to the last's end,
    and fits in the call beside the other run: both exact however loaded the machine is. It
    is also close to its passes (twice them and 100 ms), so a time spent mostly elsewhere
    fails; a loaded machine stretches a run only by the time its worker and this judge
    waited for a CPU during the call (`waited`, which the kernel counts), so that much more
    is allowed, and a sleep in the timed run is not."""
    for key, passes, room in (("seconds_plain", plain, spec[0].started - started),
                              ("seconds_speculative", spec, ended - plain[-1].ended)):
        window = passes[-1].ended - passes[0].started
        assert seconds[key] >= window - 1e-6, (
            f"{what}: {key} is {seconds[key] * 1e3:.3f} ms, but that run's passes alone took "
            f"{window * 1e3:.3f} ms as the grader saw them: time the whole run, with "
            f"time.perf_counter before and after it")
        assert seconds[key] <= room, (
            f"{what}: {key} is {seconds[key] * 1e3:.3f} ms, but the run had at most "
            f"{room * 1e3:.3f} ms as the grader saw it, beside the other run: time the run "
            f"alone, with time.perf_counter before and after it")
        most = 2 * window + 0.1 + waited
        assert seconds[key] <= most, (
            f"{what}: {key} is {seconds[key] * 1e3:.3f} ms, but that run's passes took "
            f"{window * 1e3:.3f} ms, and a run takes at most twice its passes and 100 ms (plus "
            f"the {waited * 1e3:.1f} ms your worker and the grader waited for a CPU during "
            f"the call): time the run itself, with time.perf_counter before and after it")


@points(2)
def test_measurement_reports_what_ran(sub, rng):
    """measure: passes, drafts, acceptance rate and times as the grader counted and timed them"""
    model = ServedModel()
    prompt, n_new = repetitive_prompt(rng), int(rng.integers(32, 49))
    k, max_ngram = int(rng.integers(2, 7)), int(rng.integers(2, 5))
    what = f"measure({n_new} tokens after {show(prompt, 6)}, k={k}, max_ngram={max_ngram})"
    processes = (worker_pid(sub), os.getpid())
    waited = waited_for_a_cpu(processes)
    started = time.perf_counter()
    got = sub.measure(model, prompt, n_new, k, max_ngram)
    ended = time.perf_counter()
    waited = waited_for_a_cpu(processes) - waited
    if not isinstance(got, dict) or not set(REPORT) <= set(got):
        missing = sorted(set(REPORT) - set(got)) if isinstance(got, dict) else list(REPORT)
        raise AssertionError(f"{what}: expected a dict with the keys {list(REPORT)}; missing "
                             f"{missing}, in {described(got)}")
    caches = model.caches_used()
    assert len(caches) == 2, (
        f"{what}: measure runs generate_plain, then generate_speculative, once each and each "
        f"over a cache of its own; the grader saw passes over {len(caches)} caches")
    plain, spec = (model.passes_over(cache) for cache in caches)
    counts = {"passes_plain": len(plain), "passes_speculative": len(spec),
              "drafted": sum(len(p.drafts) for p in spec[1:]),
              "accepted": sum(p.accepted for p in spec[1:])}
    assert counts["drafted"] > 0, (
        f"{what}: the second run checked no drafts, as the grader counted its passes: measure "
        f"runs generate_speculative, which drafts on a prompt that repeats itself")
    for key, want in counts.items():
        reported = whole_number(got[key], f"{what}: {key}")
        assert reported == want, (
            f"{what}: you report {key} = {reported}, the grader counted {want} (plain decoding "
            f"over the first cache: {len(plain)} passes; speculation over the second: "
            f"{len(spec)} passes, whose drafts it checked itself)")
    rate = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
    reported = number(got["acceptance_rate"], f"{what}: acceptance_rate")
    assert abs(reported - rate) <= 1e-9, (
        f"{what}: acceptance_rate is accepted / drafted, {counts['accepted']} / "
        f"{counts['drafted']} = {rate:.6g}; you report {reported:.6g}")
    seconds = {key: number(got[key], f"{what}: {key}") for key in ("seconds_plain", "seconds_speculative")}
    check_run_times(seconds, plain, spec, started, ended, waited, what)
    speedup = number(got["speedup"], f"{what}: speedup")
    want = seconds["seconds_plain"] / seconds["seconds_speculative"]
    assert abs(speedup - want) <= 1e-6 * want, (
        f"{what}: speedup is seconds_plain / seconds_speculative = {want:.6g}; you report {speedup:.6g}")


# ---- the sampling rejection rule -----------------------------------------------------------

RUNS = 1500               # drafts the distribution test draws


def drawn_pair(rng):
    """The model's p and a drafter's q over 5 to 8 tokens, at least 0.3 apart in total
    variation, so that a rule that drifts from p drifts by far more than chance."""
    while True:
        vocab = int(rng.integers(5, 9))
        p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
        if 0.5 * np.abs(p - q).sum() >= 0.3:
            return p, q


def shown(probabilities) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in probabilities) + "]"


def rule_result(got, what, vocab) -> tuple:
    """accept_or_resample's (accepted, token), or a failed test."""
    if not isinstance(got, (tuple, list)) or len(got) != 2 or \
            not isinstance(got[0], (bool, np.bool_)):
        raise AssertionError(f"{what}: expected (accepted, token), accepted True or False; got "
                             f"{described(got)}")
    token = whole_number(got[1], f"{what}: token")
    assert 0 <= token < vocab, f"{what}: token {token} is not one of the {vocab} tokens"
    return bool(got[0]), token


def chi_square(counts, probabilities, what):
    """Pearson's statistic of the counts against the probabilities, outcomes expected fewer
    than 5 times pooled, held under the chi-square distribution's quantile at 1 - 1e-6 (the
    Wilson-Hilferty approximation, z = 4.75: an honest rule fails a test about once in a
    million gradings; the degrees of freedom plus five deviations, which the kit's own test
    uses, is passed by chance once in about 1,500 at 6 degrees of freedom)."""
    impossible = (probabilities == 0) & (counts > 0)
    assert not impossible.any(), (f"{what}: token {int(np.argmax(impossible))} came out "
                                  f"{int(counts[impossible][0])} times; its probability is 0")
    expected = probabilities * counts.sum()
    rare = expected < 5
    observed = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    if dof == 0:                    # one outcome: nothing to compare but the impossible ones
        return
    limit = dof * (1 - 2 / (9 * dof) + 4.75 * np.sqrt(2 / (9 * dof))) ** 3
    assert statistic <= limit, (
        f"{what}: came out {counts.astype(int).tolist()} times where {shown(probabilities)} "
        f"of them were expected (chi-square {statistic:.1f} with {dof} degrees of freedom: "
        f"above {limit:.1f}, which chance alone passes about once in a million)")


@points(2)
def test_the_rejection_rule_keeps_the_models_distribution(sub, rng):
    """accept_or_resample on 1,500 drafts drawn from q: accepted as often as sum(min(p, q)), rejected tokens as the normalized residual, all tokens as p"""
    p, q = drawn_pair(rng)
    generator = ServedRandom(int(rng.integers(2 ** 32)))
    case = f"p = {shown(p)}, q = {shown(q)}, {RUNS} drafts drawn from q"
    counts, rejected = np.zeros(len(p)), np.zeros(len(p))
    for draft in rng.choice(len(p), size=RUNS, p=q):
        accepted, token = rule_result(sub.accept_or_resample(p, q, int(draft), generator),
                                      f"accept_or_resample(p, q, {int(draft)}, rng) ({case})", len(p))
        assert not accepted or token == draft, (
            f"accept_or_resample(p, q, {int(draft)}, rng) ({case}): accepted, so the token is the "
            f"draft {int(draft)}, not {token}")
        counts[token] += 1
        rejected[token] += not accepted
    kept = RUNS - int(rejected.sum())
    rate = float(np.minimum(p, q).sum())
    spread = 5 * np.sqrt(RUNS * rate * (1 - rate)) + 1
    assert abs(kept - RUNS * rate) <= spread, (
        f"{case}: {kept} drafts accepted, where sum(min(p, q)) * {RUNS} = {RUNS * rate:.0f} are "
        f"expected (each draft x kept with probability min(1, p[x] / q[x])), give or take "
        f"{spread:.0f}")
    residual = np.maximum(p - q, 0)
    chi_square(rejected, residual / residual.sum(), f"{case}: the tokens drawn after a rejection")
    chi_square(counts, p, f"{case}: the tokens, accepted and drawn")


@points(1)
def test_the_rejection_rule_case_by_case(sub, rng):
    """each call: accepted exactly when its rng.random() is below p[draft] / q[draft]; else one rng.choice from max(0, p - q) normalized"""
    cases = []
    for _ in range(30):
        p, q = drawn_pair(rng)
        cases.append((p, q, int(rng.choice(len(q), p=q)), "drawn"))
    p, q = drawn_pair(rng)
    cases.append((p, p.copy(), int(rng.choice(len(p), p=p)), "q = p: always kept"))
    p, q = drawn_pair(rng)
    p[0], q[0] = 0.0, max(q[0], 0.1)
    p, q = p / p.sum(), q / q.sum()
    cases.append((p, q, 0, "p[draft] = 0: never kept"))
    for p, q, draft, why in cases:
        generator = ServedRandom(int(rng.integers(2 ** 32)))
        what = f"accept_or_resample(p = {shown(p)}, q = {shown(q)}, draft {draft}, rng) ({why})"
        accepted, token = rule_result(sub.accept_or_resample(p, q, draft, generator), what, len(p))
        draws, ratio = generator.draws, p[draft] / q[draft]
        uniform = draws[0].result if draws and draws[0].method == "random" else None
        if uniform is None:
            assert accepted and ratio >= 1 and not draws, (
                f"{what}: p[draft] / q[draft] = {ratio:.4f}; the rule's first draw is "
                f"u = rng.random(), and the draft is kept when u < {ratio:.4f}; your draws: "
                f"{[d.method for d in draws]}")
            continue
        assert accepted == (uniform < ratio), (
            f"{what}: rng.random() gave u = {uniform:.4f} and p[draft] / q[draft] = {ratio:.4f}, "
            f"so the draft is {'kept' if uniform < ratio else 'rejected'}; yours was "
            f"{'kept' if accepted else 'rejected'}")
        if accepted:
            assert len(draws) == 1, f"{what}: a kept draft needs one draw, u; you made {len(draws)}"
            continue
        assert [d.method for d in draws] == ["random", "choice"], (
            f"{what}: rejected: then one rng.choice(len(p), p=...) draws the token; your draws: "
            f"{[d.method for d in draws]}")
        residual = np.maximum(p - q, 0)
        given = draws[1].probabilities
        assert given is not None and np.allclose(given, residual / residual.sum(), atol=1e-9, rtol=0), (
            f"{what}: the token after a rejection is drawn from max(0, p - q) / its sum = "
            f"{shown(residual / residual.sum())}; you drew it from "
            f"{'an even choice' if given is None else shown(given)}")
        assert token == draws[1].result, (
            f"{what}: rng.choice drew {draws[1].result}, you returned {token}")
