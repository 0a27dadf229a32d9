"""Lab 12: speculative decoding with prompt lookup. Fill in every function marked TODO.

Decoding runs one forward pass per token. Speculative decoding guesses a few tokens cheaply
(the drafts), runs the newest token and every draft through the model in ONE pass over the
KV cache, keeps the drafts as long as they are what the model would have chosen itself,
adds the model's own token after them, and cuts the rejected drafts' K and V off the
cache again. With greedy choice the tokens are exactly plain decoding's; only the number of
passes changes. You write the drafter, the verification, the rollback, the loop, and a
measurement of what it saved; and, for sampled decoding, the rule that keeps the model's
own distribution while it accepts a drafter's samples.

The grader lends your functions a `model` and the caches it makes. They stay in the
grader's process (each call travels there and back), and they work like kvlab's own:

    model.config.vocab_size, model.config.max_seq_len, ...   the model's shape
    cache = model.new_cache(max_seq_len)     an empty KV cache for up to max_seq_len positions
    model.forward(tokens, cache)             runs `tokens` (a list of ids) at the cache's next
                                             positions, appends their K and V; returns the
                                             last token's logits, shape (vocab_size,)
    model.forward(tokens, cache, all_logits=True)   every token's logits, (len(tokens), vocab_size):
                                             row i is what the model predicts after tokens[i]
    cache.length                             positions held
    cache.truncate(n)                        keep the first n positions, forget the rest
    model.encode(text), model.decode_text(ids)

Every call of model.forward is one forward pass, and the grader counts them.

Try things at the end of the file under `if __name__ == "__main__":`; there `kvlab.load()`
gives you the same model with the same calls (the grader never runs that block).

Check your work with:  kvlab check speculative_decoding speculative_decoding.py
Your grade:            kvlab grade speculative_decoding speculative_decoding.py
You may import numpy, math and Python's standard library (time included); nothing from
kvlab (this lab is about writing speculative decoding yourself: the grader refuses a file
that imports kvlab, and kvlab.speculative in particular).
"""
import time

import numpy as np


def propose(tokens, k, max_ngram=3):
    """Prompt lookup: up to k draft tokens to follow `tokens` (the whole context so far, a
    list of ids), found in the context itself.

    For n = max_ngram, max_ngram - 1, ..., 1 (the longest first): take the last n tokens
    (the tail), and look for an earlier place where the same n tokens occur, starting at
    any position before the tail's own (a match may overlap the tail). If there is one,
    take the MOST RECENT such place and return the (at most k) tokens that follow it there,
    even if fewer than k follow; only if the tail occurs nowhere earlier, try a shorter n.
    No match for any n (or k == 0, or fewer than 2 tokens) gives [].

        propose([5, 6, 7, 5, 6], k=2)   -> [7, 5]   (the tail [5, 6] occurred at position 0)

    Returns a list of ints.
    """
    # TODO
    raise NotImplementedError("propose")


def rollback(cache, n_drafts, accepted):
    """The cache has just run a verification pass: the newest token and n_drafts drafts
    were appended to it. Cut off the K and V of the drafts that were not accepted (the last
    n_drafts - accepted positions), so that it holds the context, the newest token and the
    `accepted` accepted drafts: exactly what a cache that only ever ran those tokens holds.
    Returns nothing. (One call of cache.truncate.)"""
    # TODO
    raise NotImplementedError("rollback")


def verify(model, cache, newest, drafts):
    """Check the drafts in one forward pass and keep the right ones.

    The cache holds the context except its newest token `newest` (not run yet); `drafts`
    is a list of guessed tokens to follow it (maybe empty). Run [newest] + drafts through
    the model in ONE pass over the cache, with all_logits=True. Row i of the logits is the
    model's prediction after the token at i, so draft i is right when it equals the
    arg-max of row i. Accept the drafts from the first up to (not including) the first
    wrong one; a draft after a wrong one is never accepted. The model's own next token is
    the arg-max of the row after the last accepted draft (the correction where a draft was
    wrong, or a bonus token when every draft was right). Then roll the cache back (rollback).

    Returns (accepted, token): the number of drafts accepted and the model's next token
    (ints). With no drafts this is one ordinary decode step: (0, the arg-max of row 0).
    """
    # TODO
    raise NotImplementedError("verify")


def generate_plain(model, prompt, n_new):
    """Plain greedy decoding, the baseline: the n_new tokens the model chooses after
    `prompt` (a list of ids), each the arg-max of the last logits. One cache
    (model.new_cache), a prefill of the whole prompt (its logits give the first token), then
    one pass of one token (the newest) per token after it: n_new passes in all.
    Returns the list of n_new ints."""
    # TODO
    raise NotImplementedError("generate_plain")


def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    """Greedy decoding with speculation: exactly generate_plain's tokens, in fewer passes.

    One cache. Prefill the prompt (the first token, as in generate_plain), then repeat:
    propose up to k drafts from everything so far (prompt and tokens generated), but never
    more than the tokens still wanted minus one (the pass adds a token of its own after the
    accepted drafts); verify them after the newest token; the accepted drafts and the
    model's token are the next tokens. Stop at n_new tokens.

    Returns (tokens, stats): the list of n_new ints, and a dict of what ran:
        {"passes": forward passes, the prefill included,
         "drafted": drafts checked, over every pass,
         "accepted": drafts accepted}
    """
    # TODO
    raise NotImplementedError("generate_speculative")


def measure(model, prompt, n_new, k=4, max_ngram=3):
    """What speculation saves, measured: run generate_plain and then generate_speculative
    (in that order, once each, each with the cache it makes), timing each run alone with
    time.perf_counter just before and after it. Returns a dict:
        "passes_plain":        forward passes plain decoding ran
        "passes_speculative":  forward passes speculative decoding ran
        "drafted", "accepted": from generate_speculative's stats
        "acceptance_rate":     accepted / drafted (0.0 when nothing was drafted)
        "seconds_plain", "seconds_speculative":   the wall time of each run
        "speedup":             seconds_plain / seconds_speculative
    The grader counts and times the passes itself (it tells the two runs apart by their
    caches), and compares."""
    # TODO
    raise NotImplementedError("measure")


def accept_or_resample(p, q, draft, rng):
    """The sampling rejection rule, for one draft token (Leviathan et al. and Chen et al.,
    2023; chapter 9.6): with sampling instead of greedy choice, a draft is kept at random, so
    that the tokens still come out distributed exactly as the model's own.

    p: the model's probabilities at this position, q: the drafter's, each (vocab,) summing
    to 1; draft: the token the drafter drew from q (so q[draft] > 0); rng: a random number
    generator with rng.random() (a float drawn uniformly from [0, 1)) and rng.choice(n,
    p=probs) (an int from 0 .. n - 1 drawn with those probabilities), as numpy's
    np.random.default_rng() has them (the grader lends you one of its own).

    Accept the draft with probability min(1, p[draft] / q[draft]): draw u = rng.random()
    and accept when u < p[draft] / q[draft]. Else draw the token from the residual
    max(0, p - q), normalized to sum to 1, with one rng.choice(len(p), p=...).
    Returns (accepted, token): (True, draft), or (False, the token drawn).
    """
    # TODO
    raise NotImplementedError("accept_or_resample")


if __name__ == "__main__":
    # Try your code here: the grader never runs this block. kvlab's own model has the
    # calls the grader's has (model.forward(tokens, cache, all_logits=...), new_cache,
    # cache.length, cache.truncate, encode).
    import kvlab
    model = kvlab.load()
    print(propose([5, 6, 7, 5, 6], 2))                       # [7, 5]
    line = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    prompt = model.encode(line + line + "ROMEO:\nBut")
    plain = generate_plain(model, prompt, 40)
    tokens, stats = generate_speculative(model, prompt, 40)
    print(tokens == plain, stats)                            # True, and fewer than 40 passes
    print(model.decode_text(tokens))
    print(measure(model, prompt, 40))
    # the rejection rule: over many drafts drawn from q, the tokens come out as p
    rng = np.random.default_rng(0)
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.3, 0.5])
    tokens = [accept_or_resample(p, q, int(rng.choice(3, p=q)), rng)[1] for _ in range(20000)]
    print(np.bincount(tokens, minlength=3) / len(tokens))     # about [0.6, 0.3, 0.1]
