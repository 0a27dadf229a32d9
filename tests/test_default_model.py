"""The bundled default model: small, GQA, documented, and the C path reproduces the
greedy text that the training script computed with PyTorch."""
import json

import numpy as np

import kvlab

META = kvlab.DEFAULT_MODEL.with_suffix(".json")


def test_bundled_files_are_small_and_described():
    assert kvlab.DEFAULT_MODEL.stat().st_size <= 8 * 1024 * 1024
    meta = json.loads(META.read_text())
    model = kvlab.load()
    assert 500_000 <= model.n_params <= 5_000_000
    assert model.n_params == meta["n_params"]
    assert model.config.n_kv_heads < model.config.n_heads          # GQA
    assert meta["val_loss"] < 2.0 and meta["train_loss"] < 2.0
    assert isinstance(model.tokenizer, kvlab.tokenizer.ByteTokenizer)


def test_c_path_reproduces_the_pytorch_greedy_sample():
    meta = json.loads(META.read_text())["greedy_sample"]
    model = kvlab.load()
    out = kvlab.generate(model, meta["prompt"], max_new_tokens=len(meta["ids"]))
    assert out.tokens == meta["ids"]


def test_default_model_writes_shakespeare_like_text_the_same_way_twice():
    model = kvlab.load()
    cached = kvlab.generate(model, "ROMEO:\n", 120, use_cache=True)
    uncached = kvlab.generate(model, "ROMEO:\n", 120, use_cache=False)
    assert cached.text == uncached.text
    words = cached.completion.split()
    assert len(words) > 10 and np.mean([w.isascii() for w in words]) > 0.95
