"""kvlab/grading/handouts.py: the models a lab lends, as the GQA lab uses them."""
import numpy as np
import pytest

import kvlab
from kvlab import reference
from kvlab.grading.handouts import ReferenceModel

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
    with pytest.raises(ValueError, match="layer must be an int"):
        ReferenceModel().key_value_weights(6)
    with pytest.raises(TypeError, match="encode takes a str"):
        ReferenceModel().encode(b"bytes")
