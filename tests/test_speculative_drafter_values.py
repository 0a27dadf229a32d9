"""What a drafter hands back is checked where it enters speculation (issue 35), in
kvlab.generate and in kvlab.Engine alike (both go through speculative.propose_drafts).

Cases tried for last_probabilities when sampling (temperature > 0), and what each now gives:
  * NaN, +inf in q for the draft           -> ValueError "NaN or infinite"
  * a negative probability                 -> ValueError "negative probability"
  * all zeros                              -> ValueError "sums to 0.0 ... (all zero)"
  * a sum far from 1 (0.5, 2)              -> ValueError "sums to"
  * q(draft) == 0 (the draft could not have been drawn from it) -> ValueError "probability 0"
  * shorter or longer than the vocabulary, 2-D, a scalar -> ValueError "has shape"
    (a short one leaked an IndexError before)
  * strings, None entries, a dict or a number for the list -> TypeError
  * fewer distributions than drafts        -> ValueError (as before)
  Before, NaN, negative and all-zero q were used in the rejection rule without a word.
  * a good q (a one-hot list of ints, float32 or float64 arrays): accepted, and the tokens
    are those of the model's distribution; greedy decoding never reads q, so a junk q there
    is let through unread (as before).
Constructor arguments: PromptLookup(ngram, min_ngram) refuse bools, floats and strings
(TypeError that is also a ValueError) and sizes beyond a C int; DraftModel refuses what is
not a kvlab.Model (TypeError) and first_layers a float or bool n_layers.
"""
import numpy as np
import pytest

import kvlab
from kvlab import SamplingParams
from kvlab.arguments import ArgumentTypeError
from kvlab.speculative import DraftModel, PromptLookup, propose_drafts

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft"


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


class Drafter:
    """Proposes `drafts`, with `q(vocab, drafts)` as its last_probabilities."""

    def __init__(self, drafts, q):
        self.drafts, self.q = drafts, q
        self.last_probabilities = None

    def propose(self, tokens, k, sampling=None):
        self.last_probabilities = self.q
        return self.drafts[:k]


def one_hot(vocab, x, dtype=np.float64):
    q = np.zeros(vocab, dtype)
    q[x] = 1
    return q


def bad_distributions(vocab):
    """(name, last_probabilities for drafts [5, 7], error, match)."""
    good = one_hot(vocab, 7)
    nan = one_hot(vocab, 5)
    nan[3] = np.nan
    inf = one_hot(vocab, 5)
    inf[5] = np.inf
    negative = one_hot(vocab, 5) * 1.5
    negative[9] = -0.5
    return [
        ("nan", [nan, good], ValueError, "NaN or infinite"),
        ("inf", [inf, good], ValueError, "NaN or infinite"),
        ("negative", [negative, good], ValueError, "negative probability"),
        ("all zero", [np.zeros(vocab), good], ValueError, r"sums to 0.0.*all zero"),
        ("half", [one_hot(vocab, 5) / 2, good], ValueError, "sums to 0.5"),
        ("double", [one_hot(vocab, 5), one_hot(vocab, 7) * 2], ValueError, r"last_probabilities\[1\] sums to 2"),
        ("misses its draft", [one_hot(vocab, 6), good], ValueError, "draft 5 probability 0"),
        ("short", [one_hot(vocab - 1, 5), good], ValueError, "has shape"),
        ("long", [one_hot(vocab + 1, 5), good], ValueError, "has shape"),
        ("2-D", [one_hot(vocab, 5)[None], good], ValueError, "has shape"),
        ("scalar", [1.0, good], ValueError, "has shape"),
        ("strings", [["a"] * vocab, good], TypeError, "dtype"),
        ("None entry", [None, good], TypeError, "dtype object"),
        ("bools", [one_hot(vocab, 5).astype(bool), good], TypeError, "dtype bool"),
        ("a number", 3.0, TypeError, "last_probabilities"),
        ("a dict", {0: good}, TypeError, "last_probabilities"),
        ("too few", [one_hot(vocab, 5)], ValueError, "2 drafts but 1"),
    ]


def test_bad_distributions_are_refused_by_generate_and_the_engine(model):
    vocab = model.config.vocab_size
    for name, q, error, match in bad_distributions(vocab):
        with pytest.raises(error, match=match):
            kvlab.generate(model, PROMPT, 6, temperature=1.0, seed=0,
                           speculate=Drafter([5, 7], q), draft_tokens=2)
        # the engine fails that request alone, naming the error
        engine = kvlab.Engine(model, model.new_paged_pool(16, 8),
                              speculate=Drafter([5, 7], q), draft_tokens=2)
        rid = engine.add_request(model.tokenizer.encode(PROMPT),
                                 SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
        [reason] = [o.finish_reason for o in engine.run(progress=False)[rid].outputs]
        assert reason.startswith("error") and error.__name__ in reason, (name, reason)
        assert "IndexError" not in reason


def test_a_short_distribution_no_longer_leaks_an_index_error(model):
    vocab = model.config.vocab_size
    sampling = (1.0, None, None, np.random.default_rng(0))
    with pytest.raises(ValueError, match=rf"has shape \(10,\).*{vocab} probabilities"):
        propose_drafts(Drafter([30], [np.full(10, 0.1)]), [1, 2, 3], 1, 5, sampling, vocab)


def test_good_distributions_pass_and_greedy_never_reads_them(model):
    vocab = model.config.vocab_size
    for q in ([one_hot(vocab, 5, np.float32), one_hot(vocab, 7)],
              [one_hot(vocab, 5, np.int64).tolist(), one_hot(vocab, 7)],
              np.stack([one_hot(vocab, 5), one_hot(vocab, 7)])):
        out = kvlab.generate(model, PROMPT, 8, temperature=1.0, seed=0,
                             speculate=Drafter([5, 7], q), draft_tokens=2)
        assert len(out.tokens) == 8
    for _, q, _, _ in bad_distributions(vocab):      # greedy: the distributions are never read
        if not (isinstance(q, list) and len(q) == 2):
            continue                                    # (a junk container is refused)
        out = kvlab.generate(model, PROMPT, 8, speculate=Drafter([5, 7], q), draft_tokens=2)
        assert out.tokens == kvlab.generate(model, PROMPT, 8).tokens
    # a draft model's own q passes the checks, bit for bit as before
    sampled = kvlab.generate(model, PROMPT, 20, temperature=0.8, top_k=20, seed=1,
                             speculate=DraftModel.first_layers(model, 2), draft_tokens=3)
    assert len(sampled.tokens) == 20 and sampled.speculation.drafted > 0


@pytest.mark.parametrize("make, error, match", [
    (lambda: PromptLookup(2.0), ArgumentTypeError, "ngram must be an integer"),
    (lambda: PromptLookup(True), ArgumentTypeError, "ngram must be an integer"),
    (lambda: PromptLookup("3"), ArgumentTypeError, "ngram must be an integer"),
    (lambda: PromptLookup(3, min_ngram=1.5), ArgumentTypeError, "min_ngram"),
    (lambda: PromptLookup(0), ValueError, "ngram must be at least 1"),
    (lambda: PromptLookup(2**40), ValueError, "ngram must be at most"),
    (lambda: PromptLookup(1, min_ngram=2), ValueError, "min_ngram <= ngram"),
    (lambda: DraftModel("model"), TypeError, "kvlab.Model"),
])
def test_drafter_arguments_are_refused_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_first_layers_refuses_a_float_or_bool_count(model):
    for n in (1.5, 2.0, True, "2"):
        with pytest.raises(ArgumentTypeError, match="n_layers must be an integer"):
            DraftModel.first_layers(model, n)
    assert DraftModel.first_layers(model, np.int64(2)).model.config.n_layers == 2
