"""Public self-checks for lab 12 (speculative decoding):
`kvlab check speculative_decoding speculative_decoding.py`.

Small fixed cases on the bundled model. The model your functions get stays in the grader's
process, which counts every forward pass it runs and reads the caches itself. The grade
comes from hidden tests: crafted and random contexts for the drafter; drafts all right, all
wrong, partly right and none, against the model's own choices; caches after rollback
compared bit for bit with a cache that only ever ran the accepted tokens; generations
compared token for token with plain greedy decoding, their passes counted; your
measurement compared with what the grader counted and timed; and the rejection rule run on
thousands of drafts, its tokens tested against the model's distribution.
"""
import numpy as np

from kvlab.grading.served import ServedModel, ServedRandom
from kvlab.grading.testkit import bundled_model, check_tokens, described, points

LINE = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def greedy(prompt, n_new):
    model = bundled_model()
    cache = model.new_cache(len(prompt) + n_new)
    tokens = [int(np.argmax(model.prefill(prompt, cache)))]
    while len(tokens) < n_new:
        tokens.append(int(np.argmax(model.decode(tokens[-1], cache))))
    return tokens


def text(ids):
    """The text of some token ids, for messages (ids outside the vocabulary left out)."""
    model = bundled_model()
    return model.decode_text([t for t in ids if 0 <= t < model.config.vocab_size])


@points(1)
def test_propose_takes_the_latest_match(sub, rng):
    """[1, 2, 3, 1, 2, 4, 1, 2]: the last 2 tokens occurred twice before; the latest wins"""
    got = sub.propose([1, 2, 3, 1, 2, 4, 1, 2], 2, 3)
    assert got == [4, 1], (f"propose([1, 2, 3, 1, 2, 4, 1, 2], k=2, max_ngram=3): [1, 2] occurred "
                           f"at positions 0 and 3, and after the latest came 4, 1: expected "
                           f"[4, 1], got {described(got)}")
    got = sub.propose([1, 2, 3], 2, 3)
    assert got == [], f"propose([1, 2, 3], k=2): no token repeats, so no drafts; got {described(got)}"


@points(1)
def test_verify_keeps_the_models_own_choices(sub, rng):
    """after "ROMEO:", drafts that are the model's next 3 choices: all 3 kept, plus its 4th"""
    model = ServedModel()
    context = model.encode("ROMEO:")
    cache = model.new_cache(16)
    model.forward(context[:-1], cache)
    ahead = greedy(context, 4)
    got = sub.verify(model, cache, context[-1], ahead[:3])
    assert isinstance(got, (tuple, list)) and list(got) == [3, ahead[3]], (
        f"verify with the drafts {ahead[:3]} (the model's own): expected (3, {ahead[3]}), "
        f"got {described(got)}")
    assert len(model.passes) == 2, (f"verify runs one forward pass; the model ran "
                                    f"{len(model.passes) - 1}")


@points(1)
def test_rollback_cuts_the_rejected_drafts(sub, rng):
    """7 positions, a pass of the newest token and 3 drafts, 1 accepted: 9, as a cache that ran only those"""
    model = ServedModel()
    tokens = model.encode("ROMEO:\nBut soft")
    cache = model.new_cache(16)
    model.forward(tokens[:7], cache)               # the context but its newest token
    model.forward(tokens[7:11], cache)             # the newest token and 3 drafts
    sub.rollback(cache, 3, 1)
    assert cache.length == 9, f"7 + 1 newest + 1 accepted draft: expected 9 positions, got {cache.length}"
    fresh = bundled_model().new_cache(16)
    bundled_model().prefill(tokens[:9], fresh)
    assert np.array_equal(cache.keys, fresh.keys) and np.array_equal(cache.values, fresh.values), (
        "the cache's K and V differ from a cache that ran only the first 9 tokens")


@points(1)
def test_speculation_keeps_plain_decodings_tokens(sub, rng):
    """a line of the play twice: 24 tokens, the same as plain greedy decoding, in fewer passes"""
    model = ServedModel()
    prompt = model.encode(LINE + LINE + "ROMEO:\nBut")
    want = greedy(prompt, 24)
    got = sub.generate_speculative(model, prompt, 24, 4, 3)
    assert isinstance(got, (tuple, list)) and len(got) == 2, f"expected (tokens, stats), got {described(got)}"
    check_tokens(got[0], want, "24 tokens after a line of the play twice", text=text)
    assert len(model.passes) < 24, f"24 tokens took {len(model.passes)} forward passes"


@points(1)
def test_measure_counts_what_ran(sub, rng):
    """measure over 16 tokens: plain decoding takes 16 passes, speculation what the grader counted"""
    model = ServedModel()
    prompt = model.encode(LINE + LINE + "ROMEO:\nBut")
    got = sub.measure(model, prompt, 16, 4, 3)
    assert isinstance(got, dict), f"expected a dict, got {described(got)}"
    assert got.get("passes_plain") == 16, f"passes_plain: expected 16, got {described(got.get('passes_plain'))}"
    counted = len(model.passes) - 16
    assert got.get("passes_speculative") == counted, (
        f"passes_speculative: the grader counted {counted}, you report "
        f"{described(got.get('passes_speculative'))}")


@points(1)
def test_the_rejection_rule_where_it_is_certain(sub, rng):
    """p = [0.5, 0.5, 0], q = [0, 0.5, 0.5]: draft 1 always kept (p = q there), draft 2 never, then token 0"""
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.0, 0.5, 0.5])
    for _ in range(5):
        got = sub.accept_or_resample(p, q, 1, ServedRandom(int(rng.integers(1000))))
        assert isinstance(got, (tuple, list)) and list(got) == [True, 1], (
            f"accept_or_resample(p, q, 1, rng): p[1] / q[1] = 1, so draft 1 is always kept: "
            f"expected (True, 1), got {described(got)}")
        got = sub.accept_or_resample(p, q, 2, ServedRandom(int(rng.integers(1000))))
        assert isinstance(got, (tuple, list)) and list(got) == [False, 0], (
            f"accept_or_resample(p, q, 2, rng): p[2] = 0, so draft 2 is never kept, and the "
            f"residual max(0, p - q) = [0.5, 0, 0] gives token 0: expected (False, 0), got "
            f"{described(got)}")
