"""kvlab/grading/handouts.py: the models and functions a lab lends (served from the judge),
as the own-cache, cache-size and GQA labs use them."""
import mmap
import re

import numpy as np
import pytest

import kvlab
from kvlab import reference
from kvlab.grading import handouts
from kvlab.grading.handouts import LabModel, LentFunctions, ReferenceModel

TOKENS = list(b"ROMEO:\nBut soft")


def forward(model, tokens):
    """An uncached pass over the lent building blocks (kvlab.reference.attention in between)."""
    x = model.embed(tokens)
    positions = np.arange(len(tokens))
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, positions)
        x = model.mlp(layer, model.attention_output(layer, x, reference.attention(q, k, v, positions)))
    return model.logits(x)


@pytest.mark.parametrize("checkpoint, path", [("default", None), ("mha", kvlab.MHA_MODEL)])
def test_a_checkpoint_gives_the_reference_models_logits(checkpoint, path):
    lent, model = ReferenceModel(checkpoint=checkpoint), kvlab.load(path)
    assert lent.config.n_kv_heads == model.config.n_kv_heads
    want = reference.forward(model.config, model.weights, TOKENS)
    np.testing.assert_allclose(forward(lent, TOKENS), want, atol=1e-5)


def test_the_default_model_as_mha_has_the_same_logits():
    as_mha = ReferenceModel(checkpoint="default_as_mha")
    model = kvlab.load()
    assert as_mha.config.n_kv_heads == model.config.n_heads == 8
    want = reference.forward(model.config, model.weights, TOKENS)
    np.testing.assert_allclose(forward(as_mha, TOKENS), want, atol=1e-4)


def test_new_key_value_weights_make_a_new_model_and_leave_the_old_one():
    mha = ReferenceModel(checkpoint="mha")
    wk0, wv0 = mha.key_value_weights(0)
    assert wk0.shape == (8 * 16, 128)
    c = mha.config
    keys = [mha.key_value_weights(layer)[0][:2 * c.head_dim] for layer in range(c.n_layers)]
    values = [mha.key_value_weights(layer)[1][:2 * c.head_dim] for layer in range(c.n_layers)]
    small = mha.with_key_value_weights(keys, values)
    assert small.config.n_kv_heads == 2 and mha.config.n_kv_heads == 8
    assert np.array_equal(small.key_value_weights(3)[1], values[3])
    assert np.array_equal(mha.key_value_weights(0)[0], wk0)
    q, k, v = small.qkv(0, small.embed(TOKENS), np.arange(len(TOKENS)))
    assert q.shape[1:] == (8, 16) and k.shape[1:] == v.shape[1:] == (2, 16)
    wk0[:] = 0                                            # a copy: the model keeps its own
    assert np.abs(mha.key_value_weights(0)[0]).sum() > 0


@pytest.mark.parametrize("change, says", [
    (lambda k, v: (k[:5], v), "a list of 6 arrays"),
    (lambda k, v: ([w[:3 * 16] for w in k], [w[:3 * 16] for w in v]), "dividing the 8 query heads"),
    (lambda k, v: ([w[:, :5] for w in k], v), "must be a float array of shape"),
    (lambda k, v: (k, [w[:32] for w in v]), "different head counts"),
    (lambda k, v: ([np.full_like(w, np.nan) for w in k], v), "inf or nan"),
    (lambda k, v: ([w.astype(np.int32) for w in k], v), "must be a float array"),
])
def test_bad_key_value_weights_are_refused(change, says):
    mha = ReferenceModel(checkpoint="mha")
    keys = [mha.key_value_weights(layer)[0] for layer in range(6)]
    values = [mha.key_value_weights(layer)[1] for layer in range(6)]
    with pytest.raises(ValueError) as error:
        mha.with_key_value_weights(*change(keys, values))
    assert says in str(error.value)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        ReferenceModel(checkpoint="gpt")
    with pytest.raises(ValueError, match="layer must be at most 5"):
        ReferenceModel().key_value_weights(6)
    with pytest.raises(TypeError, match="encode takes a str"):
        ReferenceModel().encode(b"bytes")


def test_every_call_is_logged_with_its_rows():
    """The own-cache lab's grader reads what each step ran from this log, in the judge."""
    model = ReferenceModel(checkpoint="mha")
    forward(model, TOKENS)
    names = [call.name for call in model.log]
    assert names[0] == "embed" and names[-1] == "logits"
    assert names.count("qkv") == names.count("mlp") == model.config.n_layers
    assert {call.rows for call in model.log} == {len(TOKENS)}
    assert [call.layer for call in model.log if call.name == "qkv"] == list(range(6))
    assert all(call.ended >= call.started for call in model.log)


@pytest.mark.parametrize("call, says", [
    (lambda m: m.qkv(0, np.zeros((2, 128)), [0]), "positions must be 2"),
    (lambda m: m.qkv(0, np.zeros((2, 64)), [0, 1]), "x must be a numeric array of shape"),
    (lambda m: m.attention_output(0, np.zeros((1, 128)), np.zeros((1, 8, 8))), "out must be"),
    (lambda m: m.embed([256]), "out of range [0, 256)"),
    (lambda m: m.embed([]), "non-empty"),
    (lambda m: m.mlp(True, np.zeros((1, 128))), "layer must be an int"),
])
def test_bad_arrays_are_refused_before_the_log(call, says):
    model = ReferenceModel(checkpoint="mha")
    with pytest.raises(ValueError, match=re.escape(says)):
        call(model)
    assert model.log == []


def test_the_lab_model_knows_what_its_caches_hold():
    """The cache-size lab's model: its block is taken when a cache is first filled, and the
    bytes held are what the grader bounds a measurement by."""
    model = LabModel(extra_bytes=10_000)                   # rounded up to whole pages
    assert model.config.n_layers == kvlab.load().config.n_layers
    empty, full = model.new_cache(64), model.new_cache(64)
    assert model.filled_bytes() == 0 and not empty.filled
    model.prefill(list(range(64)), full)
    block = -(-10_000 // mmap.PAGESIZE) * mmap.PAGESIZE
    assert full.filled and full.length == 64
    assert model.filled_bytes() == full.held_bytes == full._cache.nbytes + block
    with pytest.raises(TypeError, match="made by this model"):
        LabModel().prefill([1], full)
    with pytest.raises(ValueError, match="max_seq_len must be at most 512"):
        model.new_cache(10**6)


def test_lent_functions_are_the_labs_own_and_no_more():
    lent = LentFunctions(("kvlab.measure.resident_bytes", "kvlab.accuracy.perplexity"))
    assert lent.served_methods == ("resident_bytes", "perplexity")
    assert lent.resident_bytes() > 0
    with pytest.raises(AttributeError):
        lent.kl_divergence
    with pytest.raises(LookupError, match="cannot lend"):
        LentFunctions(("kvlab.reference.forward",))


def test_what_a_call_can_make_the_judge_compute_is_bounded():
    """Served calls run in the judge: rows beyond the model's context are refused before any
    work, and a model makes only so many converted copies, which log into its own log."""
    model = ReferenceModel(checkpoint="mha", convertible=True)
    with pytest.raises(ValueError, match="more than the model.s context, 512"):
        model.embed(np.zeros(513, np.int64))
    with pytest.raises(ValueError, match="n from 1 to the context, 512"):
        model.mlp(0, np.zeros((513, 128), np.float32))
    keys = [model.key_value_weights(layer)[0] for layer in range(6)]
    values = [model.key_value_weights(layer)[1] for layer in range(6)]
    copy = model.with_key_value_weights(keys, values)
    copy.embed([1, 2])
    assert model.log == copy.log and model.log[-1].rows == 2       # one log for both
    for _ in range(handouts.MAX_CONVERSIONS - 1):
        model.with_key_value_weights(keys, values)
    with pytest.raises(ValueError, match="converted models already"):
        copy.with_key_value_weights(keys, values)


def test_only_the_gqa_labs_model_offers_its_conversion():
    assert "with_key_value_weights" not in ReferenceModel(checkpoint="mha").served_methods
    assert "with_key_value_weights" in ReferenceModel(checkpoint="mha", convertible=True).served_methods


def test_the_served_generator_draws_among_a_bounded_number_of_items():
    """The speculative lab's ServedRandom runs in the judge: choice(10 ** 10) would have it
    build 80 GB of items, so the number of items is bounded before any is made; choices
    within the bound are drawn and written down as before."""
    from kvlab.grading.served import MAX_ITEMS, ServedRandom
    rng = ServedRandom(7)
    for a in (10 ** 10, MAX_ITEMS + 1, 0, -3):
        with pytest.raises(ValueError, match="items"):
            rng.choice(a)
    assert rng.draws == []
    assert 0 <= rng.choice(MAX_ITEMS) < MAX_ITEMS
    assert rng.choice([5, 6], p=[0.0, 1.0]) == 6
    assert [d.method for d in rng.draws] == ["choice", "choice"]


def test_a_lent_model_encodes_a_prompt_not_a_frame_of_text():
    """encode runs in the judge: 64 MB of text (a frame's worth) had it build 64 million
    ints; a lent model now takes at most handouts.MAX_TEXT characters at once."""
    from kvlab.grading.served import ServedModel
    for model in (LabModel(), ReferenceModel(), ServedModel()):
        assert model.encode("ROMEO:") == list(b"ROMEO:")
        with pytest.raises(ValueError, match="at most"):
            model.encode("x" * (handouts.MAX_TEXT + 1))
        with pytest.raises(TypeError):
            model.encode(b"bytes")
