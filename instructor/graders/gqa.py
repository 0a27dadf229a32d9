"""Hidden grading tests for lab 4 (GQA: attention that shares heads, and an MHA model
converted). Each test says in its message what it expected.

Run by the judge (kvlab/grading/judge.py), never shipped in the package. Attention is
checked against the C core's (cache.attend) and kvlab.reference.attention on MHA, GQA and
MQA shapes drawn at grading time; the conversion against mean-pooling done here; the
forward pass and the conversion table against kvlab.reference.forward run here on the same
weights (the MHA model, kvlab.MHA_MODEL, pooled to a head count drawn now), over a stretch
of text chosen now.
"""
import dataclasses
import functools

import numpy as np

from kvlab import reference
from kvlab.accuracy import kl_divergence, perplexity
from kvlab.grading.handouts import ReferenceModel
from kvlab.grading.testkit import (as_array, c_attend, bundled_model, check_close, described, mha_model,
                                   number, points, raises, whole_number)

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"

# Text to measure the converted models on (Romeo and Juliet, act 2 scene 2: public domain).
TEXT = """JULIET:
O Romeo, Romeo! wherefore art thou Romeo?
Deny thy father and refuse thy name;
Or, if thou wilt not, be but sworn my love,
And I'll no longer be a Capulet.

ROMEO:
Shall I hear more, or shall I speak at this?

JULIET:
'Tis but thy name that is my enemy;
Thou art thyself, though not a Montague.
What's Montague? it is nor hand, nor foot,
Nor arm, nor face, nor any other part
Belonging to a man. O, be some other name!
What's in a name? that which we call a rose
By any other name would smell as sweet;
So Romeo would, were he not Romeo call'd,
Retain that dear perfection which he owes
Without that title. Romeo, doff thy name,
And for that name which is no part of thee
Take all myself.

ROMEO:
I take thee at thy word:
Call me but love, and I'll be new baptized;
Henceforth I never will be Romeo.
"""


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def shapes(rng):
    """(n_heads, n_kv_heads, head_dim) of each kind, drawn now: every GQA draw has at least
    two KV heads shared by at least two query heads."""
    head_dim = lambda: int(rng.choice([4, 8, 16]))     # noqa: E731
    n = int(rng.integers(2, 7))
    n_kv, mul = int(rng.integers(2, 5)), int(rng.integers(2, 5))
    return {"MHA": (n, n, head_dim()), "GQA": (n_kv * mul, n_kv, head_dim()),
            "MQA": (int(rng.integers(2, 9)), 1, head_dim())}


def pooled(w, n_kv_heads, head_dim):
    """(n_heads * head_dim, dim) -> (n_kv_heads * head_dim, dim): each group's mean."""
    n_heads = w.shape[0] // head_dim
    groups = w.reshape(n_kv_heads, n_heads // n_kv_heads, head_dim, w.shape[1])
    return groups.mean(axis=1, dtype=np.float64).reshape(n_kv_heads * head_dim, -1)


@functools.lru_cache(maxsize=None)
def converted(n_kv_heads):
    """The MHA model's config and weights, mean-pooled to n_kv_heads, made here."""
    model = mha_model()
    c, w = model.config, model.weights
    pool = lambda stacked: np.stack([pooled(layer, n_kv_heads, c.head_dim)    # noqa: E731
                                     for layer in stacked]).astype(np.float32)
    return c.replace(n_kv_heads=n_kv_heads), dataclasses.replace(w, wk=pool(w.wk), wv=pool(w.wv))


@functools.lru_cache(maxsize=None)
def oracle(n_kv_heads, tokens):
    return reference.forward(*converted(n_kv_heads), list(tokens))


@functools.lru_cache(maxsize=None)
def filled():
    """The bundled model (8 query heads, 2 KV heads of 16) with its cache after a prompt."""
    model = bundled_model()
    cache = model.new_cache(64)
    model.prefill(model.encode(PROMPT), cache)
    return model, cache


def stretch(rng, length):
    """`length` tokens of TEXT from an offset drawn now."""
    data = list(TEXT.encode("utf-8"))
    start = int(rng.integers(0, len(data) - length))
    return tuple(data[start:start + length])


def prepare():
    filled()
    mha_model()


@points(3)
def test_attend_mha_gqa_and_mqa(sub, rng):
    """decode attention of every kind as the C core's: query head h reads KV head h // kv_mul"""
    for kind, (n_heads, n_kv_heads, head_dim) in shapes(rng).items():
        for length in (1, int(rng.integers(2, 12)), int(rng.integers(12, 60))):
            q = normal(rng, n_heads, head_dim)
            keys, values = normal(rng, length, n_kv_heads, head_dim), normal(rng, length, n_kv_heads, head_dim)
            got = sub.attend(q, keys, values)
            check_close(got, c_attend(q, keys, values),
                        f"{kind}: {n_heads} query heads, {n_kv_heads} KV head(s) of {head_dim}, "
                        f"{length} cached position{'s' * (length != 1)} (query head h reads KV head "
                        f"h // {n_heads // n_kv_heads})")


@points(2)
def test_attend_over_the_bundled_models_cache(sub, rng):
    """over the bundled model's cache (8 query heads on 2 KV heads), every layer, as cache.attend"""
    model, cache = filled()
    for layer in range(model.config.n_layers):
        q = normal(rng, model.config.n_heads, model.config.head_dim, scale=2.0)
        got = sub.attend(q, cache.keys[layer], cache.values[layer])
        check_close(got, cache.attend(q, layer), f"layer {layer} of the bundled model's cache "
                    f"({cache.length} positions, 8 query heads on 2 KV heads)")


@points(2)
def test_causal_rows_equal_decode_steps(sub, rng):
    """prefill row t equals attend(q[t], k[:t+1], v[:t+1]), and both are kvlab.reference.attention"""
    for kind, (n_heads, n_kv_heads, head_dim) in shapes(rng).items():
        T = int(rng.integers(5, 14))
        q, k, v = normal(rng, T, n_heads, head_dim), normal(rng, T, n_kv_heads, head_dim), \
            normal(rng, T, n_kv_heads, head_dim)
        got = as_array(sub.causal_attention(q, k, v), f"causal_attention ({kind})",
                       shape=(T, n_heads, head_dim))
        check_close(got, reference.attention(q, k, v, np.arange(T)),
                    f"{kind} prefill of {T} tokens, {n_heads} query heads on {n_kv_heads} KV head(s)")
        t = int(rng.integers(0, T))
        check_close(got[t], sub.attend(q[t], k[:t + 1], v[:t + 1]),
                    f"{kind}: prefill row {t} against your attend(q[{t}], k[:{t + 1}], v[:{t + 1}])")


@points(2)
def test_mean_pool_heads(sub, rng):
    """each new head is the mean of its group of consecutive old heads"""
    for n_heads, head_dim, dim in ((8, 4, 6), (int(rng.choice([6, 12])), int(rng.choice([2, 8])), 5)):
        w = normal(rng, n_heads * head_dim, dim)
        for n_kv_heads in [g for g in range(1, n_heads + 1) if n_heads % g == 0]:
            got = sub.mean_pool_heads(w, n_kv_heads, head_dim)
            check_close(got, pooled(w, n_kv_heads, head_dim),
                        f"{n_heads} heads of {head_dim} rows pooled to {n_kv_heads} (head g is the mean "
                        f"of heads {n_heads // n_kv_heads}g..{n_heads // n_kv_heads}g+"
                        f"{n_heads // n_kv_heads - 1})", atol=1e-6)


@points(1)
def test_mean_pool_refuses_a_count_that_does_not_divide(sub, rng):
    """n_kv_heads that does not divide n_heads (or is 0) raises ValueError, and one that
    does is not refused (a function that always raises earns nothing here; whether it pools
    right is the test above's)"""
    n_heads, head_dim = int(rng.choice([6, 8, 10, 12])), int(rng.choice([2, 4]))
    w = normal(rng, n_heads * head_dim, 3)
    refused = [0] + [g for g in range(2, n_heads) if n_heads % g]
    for n_kv_heads in rng.permutation(refused)[:3]:
        with raises("ValueError", f"mean_pool_heads of {n_heads} heads to {n_kv_heads}"):
            sub.mean_pool_heads(w, int(n_kv_heads), head_dim)
    n_kv_heads = int(rng.choice([g for g in range(2, n_heads) if n_heads % g == 0]))
    got = np.asarray(sub.mean_pool_heads(w, n_kv_heads, head_dim))
    assert got.shape == (n_kv_heads * head_dim, 3), (
        f"{n_heads} heads of {head_dim} rows pooled to {n_kv_heads}, which divides them: "
        f"expected shape ({n_kv_heads * head_dim}, 3), got {got.shape}")


@points(2)
def test_convert_pools_every_layer_and_leaves_the_model(sub, rng):
    """convert(model, n): every layer's wk and wv pooled; the model given keeps its own"""
    n_kv_heads = int(rng.choice([2, 4]))      # GQA: groups of more than one, more than one group
    model = ReferenceModel(checkpoint="mha", convertible=True)
    small = sub.convert(model, n_kv_heads)
    assert isinstance(small, ReferenceModel), (
        f"convert should return the model that model.with_key_value_weights(keys, values) "
        f"makes, got {described(small)}")
    config, weights = converted(n_kv_heads)
    for layer in range(config.n_layers):
        got = small.key_value_weights(layer)
        assert isinstance(got, (tuple, list)) and len(got) == 2, (
            f"convert's model: key_value_weights({layer}) should give (wk, wv), got {described(got)}")
        check_close(got[0], weights.wk[layer], f"the converted model's wk, layer {layer} "
                    f"({n_kv_heads} KV heads)", atol=1e-6)
        check_close(got[1], weights.wv[layer], f"the converted model's wv, layer {layer} "
                    f"({n_kv_heads} KV heads)", atol=1e-6)
        kept = model.key_value_weights(layer)
        for name, got_kept, want_kept in (("wk", kept[0], mha_model().weights.wk[layer]),
                                          ("wv", kept[1], mha_model().weights.wv[layer])):
            check_close(got_kept, want_kept, f"the model given to convert, {name} of layer {layer} "
                        f"afterwards (it must stay the MHA model)", atol=0, rtol=0)


@points(2)
def test_forward_matches_the_reference(sub, rng):
    """forward over the MHA model, and over one converted here, as kvlab.reference.forward"""
    tokens = stretch(rng, int(rng.integers(20, 60)))
    model = ReferenceModel(checkpoint="mha")
    check_close(sub.forward(model, list(tokens)), oracle(8, tokens),
                f"forward of the MHA model over {len(tokens)} tokens", atol=1e-4, rtol=1e-4)
    n_kv_heads = int(rng.choice([2, 4]))      # GQA: groups of more than one, more than one group
    config, weights = converted(n_kv_heads)
    small = model.with_key_value_weights([w for w in weights.wk], [w for w in weights.wv])
    check_close(sub.forward(small, list(tokens)), oracle(n_kv_heads, tokens),
                f"forward of the MHA model pooled to {n_kv_heads} KV heads (by the grader) over "
                f"{len(tokens)} tokens", atol=1e-4, rtol=1e-4)


@points(2)
def test_a_model_whose_grouped_heads_are_equal_converts_without_loss(sub, rng):
    """the bundled GQA model written as MHA (heads repeated), converted back, gives its logits"""
    tokens = stretch(rng, int(rng.integers(20, 60)))
    model = ReferenceModel(checkpoint="default_as_mha", convertible=True)
    back = sub.convert(model, 2)
    bundled = bundled_model()
    want = reference.forward(bundled.config, bundled.weights, list(tokens))
    check_close(sub.forward(back, list(tokens)), want,
                "the bundled model's KV heads repeated to 8, then pooled back to 2: the bundled "
                "model's own logits (averaging equal heads changes nothing)", atol=1e-4, rtol=1e-4)


@points(3)
def test_conversion_table(sub, rng):
    """bytes per token, perplexity and KL of each conversion, as measured here on the same text"""
    tokens = stretch(rng, int(rng.integers(80, 140)))
    counts = [int(g) for g in rng.permutation([8, 4, 2, 1])[:3]]
    model = ReferenceModel(checkpoint="mha", convertible=True)
    rows = sub.conversion_table(model, list(tokens), counts)
    assert isinstance(rows, (list, tuple)) and len(rows) == len(counts), (
        f"conversion_table for n_kv_heads {counts}: expected a list of {len(counts)} dicts, got "
        f"{described(rows)}")
    c = mha_model().config
    original = oracle(8, tokens)
    for row, n_kv_heads in zip(rows, counts):
        assert isinstance(row, dict), f"each row should be a dict, got {described(row)}"
        what = f"the row for {n_kv_heads} KV heads"
        for key in ("n_kv_heads", "cache_bytes_per_token", "perplexity", "kl"):
            assert key in row, f"{what} has no {key!r}"
        assert whole_number(row["n_kv_heads"], f"{what}: n_kv_heads") == n_kv_heads, (
            f"rows come in the order of kv_head_counts {counts}: {what} says n_kv_heads "
            f"{row['n_kv_heads']!r}")
        want_bytes = 2 * c.n_layers * n_kv_heads * c.head_dim * 4
        got_bytes = whole_number(row["cache_bytes_per_token"], f"{what}: cache_bytes_per_token")
        assert got_bytes == want_bytes, (
            f"{what}: K and V x {c.n_layers} layers x {n_kv_heads} heads x {c.head_dim} x 4 B = "
            f"{want_bytes:,} bytes per token, got {got_bytes:,}")
        logits = oracle(n_kv_heads, tokens)
        check_close(np.array([number(row["perplexity"], f"{what}: perplexity")]),
                    np.array([perplexity(logits, np.array(tokens))]),
                    f"{what}: perplexity over {len(tokens)} tokens", atol=0, rtol=1e-3)
        check_close(np.array([number(row["kl"], f"{what}: kl")]),
                    np.array([kl_divergence(original, logits)]),
                    f"{what}: KL from the MHA model's predictions, nats", atol=1e-4, rtol=1e-3)
