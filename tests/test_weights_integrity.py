"""Weights that cannot be trusted are refused before the C core reads them (issue 35).

Cases tried, and what each now gives:
  * a NaN, +inf or -inf block scale in a Q8_0, Q4_0 or Q4_1 matrix (d, and Q4_1's m), in
    every matrix (token_embedding, wq ... w3, classifier), whether the Weights are made with
    it (Weights(...), dataclasses.replace), converted from float32 values holding NaN
    (Weights.converted), or written into an array after the Weights were made and then
    handed to kvlab.Model: WeightsError naming the weight and its layer (or row), and
    "block scale". Before: with int8 activations the logits could be finite and silently
    changed (with float32 activations, NaN, and generate raised).
  * a scale that is large but finite (65504, the largest half): accepted, as before.
  * float32 weights holding NaN: still made (tests build such models on purpose, and
    kvlab.load refuses them with Weights.check_finite, as before).
  * a weight array handed to kvlab.Model resized in place with refcheck=False (the array
    itself, or the array a matrix is a view of), then a forward pass: NumPy refuses the
    resize with a ValueError ("cannot resize an array that references or is referenced
    ..."), and the model's logits stay those of the weights it was made with. Run in a
    subprocess, so that a regression (the core reading freed memory: a segfault, or
    silently other numbers) fails the test instead of killing the run.
  * the same arrays once the Model is gone: they can be resized again.
  * Weights.random(scale=NaN, inf, -0.1, True; seed=1.5, True, -1): ValueError or
    ArgumentTypeError naming the argument (a NaN scale made NaN weights silently).
  * CacheFormat.make(group=True, 8.0, 2**40; window=True, 2.0, -1, 2**40): ArgumentTypeError
    or ValueError naming it (True was a group, or a window, of 1).
"""
import dataclasses
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import kvlab
from kvlab import weight_formats as wf
from kvlab.errors import WeightsError
from kvlab.weights import MATRICES

CONFIG = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=16, vocab_size=64, max_seq_len=64, tied_embeddings=False)


@pytest.fixture(scope="module")
def float_weights():
    return kvlab.Weights.random(CONFIG, seed=3)


@pytest.mark.parametrize("fmt, field", [("q8_0", "d"), ("q4_0", "d"), ("q4_1", "d"),
                                        ("q4_1", "m")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_block_scale_is_refused_when_the_weights_are_made(float_weights, fmt,
                                                                       field, bad):
    weights = float_weights.converted(fmt)
    for name in MATRICES:
        array = getattr(weights, name).copy()
        flat = array[field].reshape(-1)
        # layer 1 of a per-layer matrix, row 3 of the others
        index = (1, 5, 0) if array.ndim == 3 else (3, 1)
        array[field][index] = bad
        where = "layer 1" if array.ndim == 3 else "row 3"
        with pytest.raises(WeightsError, match=rf"{name}'? \({where}\).*block scale \({fmt}"):
            dataclasses.replace(weights, **{name: array})
        assert np.isfinite(flat.astype(np.float32)).sum() == flat.size - 1


def test_a_scale_written_after_the_weights_were_made_is_refused_by_model(float_weights):
    weights = float_weights.converted("q8_0")
    weights.wq = weights.wq.copy()          # the fixture's arrays stay intact
    weights.wq["d"][1, 5, 0] = np.nan       # after __post_init__ ran
    for activations in ("int8", "fp32"):
        with pytest.raises(WeightsError, match=r"'wq' \(layer 1\).*block scale"):
            kvlab.Model(CONFIG, weights, activations=activations)
    with pytest.raises(WeightsError, match="wq"):
        weights.check(CONFIG)


def test_converting_values_that_hold_nan_is_refused(float_weights):
    broken = dataclasses.replace(float_weights, w2=float_weights.w2.copy())
    broken.w2[1, 7, 40] = np.nan            # float32 weights with NaN may be made
    with np.errstate(invalid="ignore"):
        for fmt in wf.BLOCK_FORMATS:
            with pytest.raises(WeightsError, match=r"'w2' \(layer 1\).*block scale"):
                broken.converted(fmt)


def test_large_finite_scales_and_clean_weights_still_load(float_weights):
    weights = float_weights.converted("q8_0")
    wq = weights.wq.copy()
    wq["d"][0, 0, 0] = np.float16(65504)
    made = dataclasses.replace(weights, wq=wq)
    assert np.isfinite(kvlab.Model(CONFIG, made, activations="fp32").forward([1, 2])).any()
    for fmt in wf.BLOCK_FORMATS:
        logits = kvlab.Model(CONFIG, float_weights.converted(fmt)).forward([1, 2, 3])
        assert np.isfinite(logits).all()


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python (a crash there fails the test, not the run)."""
    with tempfile.TemporaryDirectory() as cwd:
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvlab.__file__)))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=300, cwd=cwd, env=env)


@pytest.mark.parametrize("fmt", ["fp32", "q8_0", "fp16"])
def test_resizing_a_weight_array_cannot_reach_the_core(fmt):
    result = run_isolated(f"""
        import numpy as np, kvlab
        config = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                                   head_dim=16, vocab_size=64, max_seq_len=64)
        weights = kvlab.Weights.random(config, seed=3).converted({fmt!r})
        # a matrix that is a view of a larger array the caller also holds
        big = np.zeros((2,) + weights.w1.shape[1:], weights.w1.dtype)
        big[:] = weights.w1
        weights.w1 = big[:]
        assert weights.w1.base is big
        model = kvlab.Model(config, weights)
        want = model.forward([1, 2, 3])
        tried = refused = 0
        for name in ("wq", "w2", "attn_norm", "token_embedding", "w1"):
            array = getattr(weights, name)
            while isinstance(array, np.ndarray):    # the array, and the arrays it views
                tried += 1
                try:
                    array.resize((10**6,), refcheck=False)
                except ValueError as exc:
                    assert "resize" in str(exc), exc
                    refused += 1
                array = array.base
        assert big is weights.w1.base
        got = model.forward([1, 2, 3])
        np.testing.assert_array_equal(got, want)
        print("refused", refused, "of", tried)
        del model
        import gc; gc.collect()
        weights.attn_norm.resize((1,), refcheck=False)   # free to resize once no model reads it
        print("resized after")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    refused, tried = result.stdout.split("refused ")[1].split()[::2][:2]
    assert refused == tried and int(tried) >= 6, result.stdout
    assert "resized after" in result.stdout


def test_pinned_covers_every_array_and_its_bases(float_weights):
    weights = float_weights.converted("q4_1")
    pins = weights.pinned()
    referents = {id(p()) for p in pins}
    for _, array in weights.items():
        assert id(array) in referents
        if isinstance(array.base, np.ndarray):
            assert id(array.base) in referents


@pytest.mark.parametrize("kwargs, error, match", [
    ({"scale": float("nan")}, ValueError, "scale must be a finite number"),
    ({"scale": float("inf")}, ValueError, "scale must be a finite number"),
    ({"scale": -0.1}, ValueError, "scale must be at least 0"),
    ({"scale": True}, TypeError, "scale must be a number"),
    ({"seed": 1.5}, TypeError, "seed must be an integer"),
    ({"seed": True}, TypeError, "seed must be an integer"),
    ({"seed": -1}, ValueError, "seed must be at least 0"),
])
def test_random_weights_refuse_a_nan_scale_and_a_float_seed(kwargs, error, match):
    """Weights.random: a NaN or infinite scale made NaN weights without a word; a bool or
    float seed was taken (or refused in NumPy's words)."""
    with pytest.raises(error, match=match):
        kvlab.Weights.random(CONFIG, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dtype": "int8", "group": True}, TypeError, "group size must be an integer"),
    ({"dtype": "int4", "group": 8.0}, TypeError, "group size must be an integer"),
    ({"dtype": "int8", "group": 2**40}, ValueError, "group size must be at most"),
    ({"dtype": "int8", "window": True}, TypeError, "window must be a non-negative"),
    ({"dtype": "int8", "window": 2.0}, TypeError, "window must be a non-negative"),
    ({"dtype": "int8", "window": -1}, ValueError, "window must be a non-negative"),
    ({"dtype": "int8", "window": 2**40}, ValueError, "window must be at most"),
])
def test_cache_formats_refuse_bool_and_float_sizes(kwargs, error, match):
    """kvlab.quant.CacheFormat.make: group=True was a group of 1 and window=True a window
    of 1; now both are refused like floats, and sizes beyond a C int too."""
    with pytest.raises(error, match=match):
        kvlab.CacheFormat.make(64, **kwargs)
    assert kvlab.CacheFormat.make(64, "int4", group=np.int64(16)).key_group == 16
