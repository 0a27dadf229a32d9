"""Speculative decoding (kvlab/speculative.py): greedy output identical to plain decoding,
token for token, with every drafter on every model the kit ships or reads; sampled output
with the model's own distribution (a chi-square test on a small vocabulary); the counters
add up; what it cannot do is refused, not approximated."""
import numpy as np
import pytest

import kvlab
from kvlab.speculative import DraftModel, PromptLookup

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft"


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def mha():
    return kvlab.load(kvlab.MHA_MODEL)


def drafters(model, mha):
    return {"prompt lookup": PromptLookup(), "prompt lookup 1-gram": PromptLookup(1),
            "first 2 layers": DraftModel.first_layers(model, 2),
            "first 5 layers": DraftModel.first_layers(model, 5),
            "the MHA model": DraftModel(mha)}


def assert_same_as_plain(model, prompt, n_new, drafter, k, **options):
    plain = kvlab.generate(model, prompt, n_new, **options)
    with model.counting() as counts:
        out = kvlab.generate(model, prompt, n_new, speculate=drafter, draft_tokens=k, **options)
    assert out.tokens == plain.tokens and out.finish_reason == plain.finish_reason
    s = out.speculation
    # every token produced is counted; the model ran the prompt once, then once per pass
    assert s.tokens == len(out.tokens) + (out.finish_reason == "eos")
    assert counts.calls == 1 + s.verify_passes
    assert s.passes_saved == max(0, s.tokens - 1) - s.verify_passes >= 0
    assert 0 <= s.accepted <= s.drafted and sum(s.accepted_at) == s.accepted
    assert sum(s.proposed_at) == s.drafted and len(s.proposed_at) <= k
    assert all(0 <= r <= 1 for r in s.acceptance_by_position)
    assert len(out.step_seconds) == s.tokens and out.seconds > 0
    return out


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_is_the_models_own_with_every_drafter(model, mha, k):
    for name, drafter in drafters(model, mha).items():
        out = assert_same_as_plain(model, PROMPT, 60, drafter, k)
        assert out.speculation.draft_tokens == k, name


def test_the_mha_model_with_the_bundled_one_as_its_drafter_and_a_quantized_cache(model, mha):
    for dtype in ("fp32", "int8", "fp16"):
        assert_same_as_plain(mha, PROMPT, 50, DraftModel(model, dtype="int4"), 4, dtype=dtype)
        assert_same_as_plain(mha, PROMPT, 50, PromptLookup(), 4, dtype=dtype)


def test_stories260k_a_model_read_from_llama2c_files(shared_models):
    stories = kvlab.load(shared_models / "stories260K" / "stories260K.bin",
                         tokenizer=shared_models / "stories260K" / "tok512.bin")
    prompt = "Once upon a time, there was a little girl named Lily. Lily"
    for drafter in (PromptLookup(), DraftModel.first_layers(stories, 3)):
        for n_new in (1, 2, 100):
            assert_same_as_plain(stories, prompt, n_new, drafter, 4)


@pytest.mark.parametrize("path", ["mlxd-tiny-llama3-random",
                                  "llama2-tiny-random-gguf/llama-2-tiny-random.gguf"])
def test_models_read_from_safetensors_and_gguf(shared_models, path):
    """Greedy speculation keeps plain decoding's tokens on every kind of file the kit reads:
    a Hugging Face folder (Llama 3, rope scaling, untied) and a GGUF file."""
    model = kvlab.load(shared_models / path)
    drafters = [PromptLookup()]
    if model.config.n_layers > 1:
        drafters.append(DraftModel.first_layers(model, 1))
    for drafter in drafters:
        assert_same_as_plain(model, [1, 5, 9, 5, 9, 5, 9, 3], 40, drafter, 4)


class _StopAt:
    """Just enough of a tokenizer: `eos_id` ends a sequence (the bundled one has no EOS)."""

    def __init__(self, eos_id):
        self.eos_id = eos_id

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_it_stops_at_the_end_of_sequence_token_wherever_a_pass_meets_it(model):
    # the EOS token as an accepted draft, as the model's own token after the drafts, or
    # as the first token: the output stops there, as plain decoding does
    text = "To be, or not to be, that is the question. " * 3
    run = kvlab.generate(model, text, 60, stop_at_eos=False).tokens
    for index in (0, 5, 17, 31, 44):
        stopping = kvlab.Model(model.config, model.weights, tokenizer=_StopAt(run[index]))
        for drafter in (PromptLookup(), DraftModel.first_layers(model, 3)):
            out = assert_same_as_plain(stopping, [1] + list(text.encode()), 60, drafter, 5)
            assert out.finish_reason == "eos" and out.tokens == run[:run.index(run[index])]


def test_prompt_lookup_saves_passes_on_repetitive_text(model):
    text = "To be, or not to be, that is the question. " * 4
    out = kvlab.generate(model, text, 80, speculate=PromptLookup(), draft_tokens=6)
    assert out.speculation.accepted > 20 and out.speculation.passes_saved > 20


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(ngram=2)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]   # latest "1 2"
    assert lookup.propose([7, 8, 9], 3) == []                             # nothing repeats
    assert lookup.propose([5, 6, 5], 4) == [6, 5]                         # 1-gram fallback
    assert PromptLookup(2, min_ngram=2).propose([5, 6, 5], 4) == []
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(1, min_ngram=2)


def test_a_draft_model_keeps_its_cache_across_calls_and_forgets_rejected_drafts(model, mha):
    drafter = DraftModel(mha)
    first = kvlab.generate(model, PROMPT, 30, speculate=drafter)
    again = kvlab.generate(model, PROMPT, 30, speculate=drafter)   # its cache starts full
    assert first.tokens == again.tokens
    assert again.speculation.draft_passes > 0
    other = kvlab.generate(model, "JULIET:\n", 30, speculate=drafter)
    assert other.tokens == kvlab.generate(model, "JULIET:\n", 30).tokens


def test_what_speculation_cannot_do_yet_is_refused(model, mha):
    with pytest.raises(ValueError, match="without a residual window"):
        kvlab.generate(model, PROMPT, 5, speculate=PromptLookup(), dtype="int8", window=4)
    with pytest.raises(ValueError, match="needs a cache"):
        kvlab.generate(model, PROMPT, 5, speculate=PromptLookup(), use_cache=False)
    with pytest.raises(ValueError, match="draft_tokens"):
        kvlab.generate(model, PROMPT, 5, speculate=PromptLookup(), draft_tokens=0)
    with pytest.raises(TypeError, match="takes a drafter"):
        kvlab.generate(model, PROMPT, 5, speculate="ngram")
    with pytest.raises(ValueError, match="n_layers must be between 1 and"):
        DraftModel.first_layers(model, model.config.n_layers)
    small_vocab = kvlab.Model(model.config.replace(vocab_size=128), _shrunk(model.weights, 128))
    with pytest.raises(ValueError, match="vocabulary"):
        kvlab.generate(model, [1, 2, 3], 5, speculate=DraftModel(small_vocab))


def _shrunk(weights, vocab):
    import dataclasses
    embedding = np.ascontiguousarray(weights.token_embedding[:vocab])
    return dataclasses.replace(weights, token_embedding=embedding,
                               classifier=np.ascontiguousarray(weights.classifier[:vocab]))


# ---- sampling: the rejection rule keeps the model's distribution -----------------------------

def _tiny(seed, vocab=5):
    config = kvlab.ModelConfig(dim=16, hidden_dim=24, n_layers=2, n_heads=2, n_kv_heads=1,
                               head_dim=8, vocab_size=vocab, max_seq_len=32)
    weights = kvlab.Weights.random(config, seed=seed)
    for name in ("token_embedding", "classifier"):      # sharper than uniform, far from certain
        setattr(weights, name, np.ascontiguousarray(getattr(weights, name) * 2))
    return kvlab.Model(config, weights)


def _exact_joint(model, prompt, n, temperature, top_k):
    """P(first n tokens) under plain sampling, from the model's own distributions."""
    from kvlab.reference import probabilities
    vocab = model.config.vocab_size
    joint = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, mass in joint.items():
            p = probabilities(model.forward(list(prompt) + list(prefix)), temperature, top_k, None)
            for t in range(vocab):
                if p[t] > 0:
                    grown[prefix + (t,)] = mass * p[t]
        joint = grown
    return joint


def _chi_square(counts, exact, runs):
    """Pearson's statistic of the counts against the exact distribution, rare outcomes
    pooled so that every expected count is at least 5, and its degrees of freedom."""
    outcomes = sorted(exact, key=exact.get, reverse=True)
    expected = np.array([exact[o] * runs for o in outcomes])
    observed = np.array([counts.get(o, 0) for o in outcomes], dtype=float)
    keep = expected >= 5
    expected = np.append(expected[keep], expected[~keep].sum())
    observed = np.append(observed[keep], observed[~keep].sum())
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def _sampled(model, prompt, drafter, runs, n, temperature, top_k):
    counts, drafted, accepted = {}, 0, 0
    for seed in range(runs):
        out = kvlab.generate(model, prompt, n, temperature=temperature, top_k=top_k, seed=seed,
                             speculate=drafter, draft_tokens=2, stop_at_eos=False)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        drafted += out.speculation.drafted
        accepted += out.speculation.accepted
    return counts, drafted, accepted


@pytest.mark.parametrize("drafter_name", ["prompt lookup", "draft model"])
def test_sampled_tokens_have_the_models_distribution(drafter_name, monkeypatch):
    model = _tiny(1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]                   # prompt lookup proposes "3 1 2 ..."
    temperature, top_k, n, runs = 0.9, 4, 4, 3000
    make = (lambda: PromptLookup(2)) if drafter_name == "prompt lookup" else (lambda: DraftModel(_tiny(2)))
    exact = _exact_joint(model, prompt, n, temperature, top_k)
    counts, drafted, accepted = _sampled(model, prompt, make(), runs, n, temperature, top_k)
    assert drafted > runs and 0 < accepted < drafted    # drafts were made, kept and refused
    assert set(counts) <= set(exact)                    # nothing the model could not draw
    statistic, dof = _chi_square(counts, exact, runs)
    # chi-square with dof degrees of freedom: mean dof, deviation sqrt(2 dof); five
    # deviations above the mean is a p-value near 1e-5 (the draws are seeded: no flakes)
    limit = dof + 5 * np.sqrt(2 * dof)
    assert statistic < limit, (statistic, dof, drafter_name)

    # and the test can tell: keeping every draft (no rejection rule) fails it
    def keep_all(rows, drafts, q, sampling):
        temperature, top_k, top_p, rng = sampling
        return len(drafts), kvlab.sampling.sample(rows[len(drafts)], temperature, top_k, top_p, rng)
    monkeypatch.setattr(kvlab.speculative, "verify_drafts", keep_all)
    counts, _, _ = _sampled(model, prompt, make(), runs, n, temperature, top_k)
    assert _chi_square(counts, exact, runs)[0] > limit


class _Junk:
    """A drafter that proposes what it is given to propose."""
    last_probabilities = None

    def __init__(self, proposal):
        self.proposal = proposal

    def propose(self, tokens, k, sampling=None):
        return self.proposal


def test_a_drafters_junk_is_refused_or_cut_to_k(model):
    for junk, error in ((None, "returns a list of token ids"), ([2.7], "integer token ids"),
                        ([True], "integer token ids"), ("abc", "returns a list")):
        with pytest.raises(TypeError, match=error):
            kvlab.generate(model, PROMPT, 5, speculate=_Junk(junk))
    with pytest.raises(ValueError, match="out of range"):
        kvlab.generate(model, PROMPT, 5, speculate=_Junk([999]))
    many = kvlab.generate(model, PROMPT, 20, speculate=_Junk(list(range(40))), draft_tokens=3)
    assert many.tokens == kvlab.generate(model, PROMPT, 20).tokens
    assert len(many.speculation.proposed_at) == 3          # never more than k checked
    gen = kvlab.generate(model, PROMPT, 8, speculate=_Junk(iter([1, 2, 3])))
    assert gen.tokens == kvlab.generate(model, PROMPT, 8).tokens


def test_a_draft_model_interrupted_mid_proposal_drafts_correctly_after(model, mha):
    drafter = DraftModel(mha)
    kvlab.generate(model, PROMPT, 30, speculate=drafter)
    real, calls = drafter.model.decode, [0]

    def flaky(token, cache):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(token, cache)
    drafter.model.decode = flaky
    with pytest.raises(KeyboardInterrupt):
        kvlab.generate(model, "JULIET:\nO Romeo", 30, speculate=drafter)
    del drafter.model.decode
    again = kvlab.generate(model, PROMPT, 30, speculate=drafter)
    assert again.tokens == kvlab.generate(model, PROMPT, 30).tokens
    fresh = kvlab.generate(model, PROMPT, 30, speculate=DraftModel(mha))
    assert again.speculation.accepted == fresh.speculation.accepted   # its cache is right


def test_nan_logits_in_a_checked_row_raise_when_sampling():
    from kvlab.speculative import verify_drafts
    rows = np.array([[0, 0, 0, 5, 0], [np.nan] * 5, [0] * 5], dtype=np.float32)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="NaN"):
        for _ in range(50):                 # the first draft is kept sooner or later
            verify_drafts(rows, [3, 3], None, (1.0, None, None, rng))
