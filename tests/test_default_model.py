"""The bundled models: the default (GQA) and its MHA twin, small, documented, and the C path
reproduces the greedy text that the training script computed with PyTorch."""
import json

import numpy as np
import pytest

import kvlab

MODELS = {"default": kvlab.DEFAULT_MODEL, "mha": kvlab.MHA_MODEL}


@pytest.fixture(scope="module", params=list(MODELS))
def bundled(request):
    path = MODELS[request.param]
    return request.param, kvlab.load(path), json.loads(path.with_suffix(".json").read_text())


def test_bundled_files_are_small_and_described(bundled):
    name, model, meta = bundled
    assert MODELS[name].stat().st_size <= 8 * 1024 * 1024
    assert 500_000 <= model.n_params <= 5_000_000
    assert model.n_params == meta["n_params"]
    assert meta["val_loss"] < 2.0 and meta["train_loss"] < 2.0
    assert isinstance(model.tokenizer, kvlab.tokenizer.ByteTokenizer)


def test_the_twins_differ_only_in_key_value_heads():
    default, mha = kvlab.load(), kvlab.load(kvlab.MHA_MODEL)
    assert default.config.n_kv_heads < default.config.n_heads                   # GQA
    assert mha.config.n_kv_heads == mha.config.n_heads                          # MHA
    assert mha.config.replace(n_kv_heads=default.config.n_kv_heads, name=default.config.name) \
        == default.config
    same_training = ("steps", "batch_size", "context", "seed", "split")
    cards = [json.loads(path.with_suffix(".json").read_text()) for path in MODELS.values()]
    assert [{k: card[k] for k in same_training} for card in cards][0] == \
        [{k: card[k] for k in same_training} for card in cards][1]


def test_c_path_reproduces_the_pytorch_greedy_sample(bundled):
    _, model, meta = bundled
    sample = meta["greedy_sample"]
    out = kvlab.generate(model, sample["prompt"], max_new_tokens=len(sample["ids"]))
    assert out.tokens == sample["ids"]


def test_default_model_writes_shakespeare_like_text_the_same_way_twice(bundled):
    _, model, _ = bundled
    cached = kvlab.generate(model, "ROMEO:\n", 120, use_cache=True)
    uncached = kvlab.generate(model, "ROMEO:\n", 120, use_cache=False)
    assert cached.text == uncached.text
    words = cached.completion.split()
    assert len(words) > 10 and np.mean([w.isascii() for w in words]) > 0.95
