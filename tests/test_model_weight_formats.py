"""A model whose matrices are stored in fewer bytes (kvlab.weight_formats, Weights.converted,
Model(activations=), kvlab.load(weights=)): with float32 activations its logits are the
float32 model's over the dequantized weights, bit for bit, on every path and both kernel
tiers; with int8 activations (Q8_0, Q4_0, Q4_1, and a model mixing them) every path still
agrees with every other; the bytes read are counted per format."""
import numpy as np
import pytest

import kvlab
from kvlab import reference, weight_formats as wf
from kvlab._core import core
from kvlab.errors import WeightsError
from kvlab.measure import forward_counts, scratch_bytes
from kvlab.speculative import DraftModel
from kvlab.weights import MATRICES

TOKENS = np.array([3, 17, 41, 5, 9, 60, 2, 33, 28, 11, 47, 8], dtype=np.int32)


@pytest.fixture(scope="module")
def float_model():
    """GQA, untied, every width a multiple of 32 (Q8_0's block)."""
    config = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16, vocab_size=64, max_seq_len=64)
    return kvlab.Model(config, kvlab.Weights.random(config, seed=3))


@pytest.fixture
def tiers():
    before = core.get_kernels()
    yield ("fast", "plain")
    core.set_kernels(before)


def mixed(weights):
    """The weights with q4_0, q4_1 and q8_0 matrices side by side (a GGUF file's Q4_1
    layers with a Q8_0 embedding, say), and a float32 classifier."""
    formats = {"token_embedding": "q8_0", "wq": "q4_0", "wk": "q4_1", "wv": "q4_0",
               "wo": "q4_1", "w1": "q4_1", "w2": "q4_0", "w3": "q8_0", "classifier": "fp32"}
    return kvlab.Weights(**{name: wf.stored(wf.values(array), formats[name])
                            if name in formats else array for name, array in weights.items()})


def all_paths(model):
    """The logits of TOKENS for every token, by every way of running them."""
    cache = model.new_cache(len(TOKENS))
    prefill = model.prefill(TOKENS[:7], cache, all_logits=True)
    steps = [model.decode(int(t), cache) for t in TOKENS[7:]]
    pool = model.new_paged_pool(num_blocks=12, block_size=4)
    seq, short, other = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
    paged = model.prefill(TOKENS, seq, all_logits=True)
    # a batch of two sequences: TOKENS' rows come after the first's five
    batch = model.forward_batch([short, other], [TOKENS[:5], TOKENS], all_logits=True)[5:]
    return {"cached": np.concatenate([prefill, np.stack(steps)]), "paged": paged,
            "batch": batch, "uncached": model.forward(TOKENS, all_logits=True)}


def test_stored_arrays_say_their_format_and_give_their_values_back():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 5, 64))                       # float64 in
    for fmt in wf.FORMATS:
        stored = wf.stored(values, fmt)
        assert wf.format_of(stored) == fmt and wf.logical_shape(stored) == (2, 5, 64)
        assert wf.as_bytes(stored).shape[-1] == wf.row_bytes(fmt, 64) or fmt == "fp32"
        np.testing.assert_array_equal(
            wf.values(stored).reshape(10, 64),
            wf.dequantize(wf.quantize(values.reshape(10, 64), fmt), fmt, 64))
    with pytest.raises(ValueError, match="dtype int16"):
        wf.format_of(np.zeros(3, np.int16))
    with pytest.raises(ValueError, match="whole number of blocks"):
        wf.stored(values[..., :40], "q8_0")


def test_converted_weights_keep_norms_float32_and_a_tied_classifier_tied():
    config = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=4,
                               head_dim=16, vocab_size=40, max_seq_len=32, tied_embeddings=True)
    weights = kvlab.Weights.random(config)
    for fmt, share in (("fp16", 0.5), ("bf16", 0.5), ("q8_0", 34 / 128), ("q4_0", 18 / 128),
                       ("q4_1", 20 / 128)):
        small = weights.converted(fmt)
        small.check(config)
        assert small.classifier is small.token_embedding
        assert small.format == fmt and set(small.formats) == set(MATRICES)
        assert small.attn_norm is weights.attn_norm
        assert share < small.nbytes / weights.nbytes < share * 1.05
        assert small.float32().float32() is not small and small.float32().format == "fp32"
    assert weights.float32() is weights
    mixed = kvlab.Weights(**{**dict(weights.items()), "wq": wf.stored(weights.wq, "fp16")})
    assert mixed.format == "mixed" and mixed.formats["wq"] == "fp16"


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "q8_0", "q4_0", "q4_1", "mixed"])
def test_float32_activations_give_the_float32_models_logits_over_the_values(float_model, fmt,
                                                                            tiers):
    stored = (mixed(float_model.weights) if fmt == "mixed"
              else float_model.weights.converted(fmt))
    small = kvlab.Model(float_model.config, stored, activations="fp32")
    over_values = kvlab.Model(float_model.config, stored.float32())
    for tier in tiers:
        core.set_kernels(tier)
        want = all_paths(over_values)
        for path, got in all_paths(small).items():
            np.testing.assert_array_equal(got, want[path], err_msg=f"{tier} {path}")
            np.testing.assert_array_equal(got, want["cached"], err_msg=f"{tier} {path}")
    np.testing.assert_allclose(want["uncached"],
                               reference.forward(small.config, small.weights, TOKENS),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "mixed"])
def test_int8_activations_agree_on_every_path_and_both_tiers(float_model, tiers, fmt):
    stored = (mixed(float_model.weights) if fmt == "mixed"
              else float_model.weights.converted(fmt))
    small = kvlab.Model(float_model.config, stored)
    assert small.activations == "int8" and "int8 activations" in repr(small)
    results = {}
    for tier in tiers:
        core.set_kernels(tier)
        results[tier] = all_paths(small)
        for path, got in results[tier].items():
            np.testing.assert_array_equal(got, results["fast"]["cached"], err_msg=f"{tier} {path}")
    exact = all_paths(kvlab.Model(float_model.config, small.weights, activations="fp32"))
    got = results["fast"]["cached"]
    assert not np.array_equal(got, exact["cached"])            # the activations were rounded
    assert np.abs(got - exact["cached"]).max() < 0.05 * np.abs(exact["cached"]).max()
    assert (got.argmax(-1) == exact["cached"].argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("fmt, int8", [("fp16", False), ("q8_0", False), ("q8_0", True),
                                       ("q4_0", True), ("q4_1", False), ("q4_1", True)])
def test_the_bytes_read_and_the_scratch_are_counted_per_format(float_model, fmt, int8):
    stored = float_model.weights.converted(fmt)
    small = kvlab.Model(float_model.config, stored, activations="int8" if int8 else "fp32")
    c, threads = small.config, kvlab.get_num_threads()
    cache = small.new_cache(len(TOKENS))
    for n, start, run in ((7, 0, lambda: small.prefill(TOKENS[:7], cache)),
                          (1, 7, lambda: small.decode(int(TOKENS[7]), cache))):
        small.reset_counters()
        run()
        counted = small.counters
        assert counted.weight_bytes == forward_counts(c, n, start, weights=stored.formats).weight_bytes
        assert counted.scratch_bytes == scratch_bytes(c, n, threads, weights=stored.formats,
                                                      int8_activations=int8)
    fp32 = forward_counts(c, 1, 7).weight_bytes
    assert counted.weight_bytes < fp32 * (0.55 if fmt == "fp16" else 0.3)


def test_what_does_not_fit_is_refused_by_name(float_model):
    config, weights = float_model.config, float_model.weights
    with pytest.raises(WeightsError, match="'attn_norm' must be float32"):
        kvlab.Model(config, kvlab.Weights(**{**dict(weights.items()),
                                             "attn_norm": weights.attn_norm.astype(np.float16)}))
    with pytest.raises(WeightsError, match="'wq'.*dtype float64"):
        kvlab.Model(config, kvlab.Weights(**{**dict(weights.items()),
                                             "wq": weights.wq.astype(np.float64)}))
    odd = kvlab.ModelConfig(dim=48, hidden_dim=64, n_layers=1, n_heads=3, n_kv_heads=3,
                            head_dim=16, vocab_size=20, max_seq_len=16)
    with pytest.raises(WeightsError, match="'token_embedding' cannot be stored as q8_0: "
                                           ".*whole number of blocks"):
        kvlab.Weights.random(odd).converted("q8_0")
    config_dict, arrays = float_model._core_arguments()
    for name in ("wqq", 1):     # a misspelt name is refused, not passed over as float32
        with pytest.raises(WeightsError, match="not one of the model's weights"):
            core.Model(config_dict, arrays, formats={name: "fp16"})
    with pytest.raises(ValueError, match="activations must be"):
        kvlab.Model(config, weights, activations="int4")
    with pytest.raises(ValueError, match="goes with Q8_0, Q4_0 or Q4_1 weights"):
        kvlab.Model(config, weights.converted("fp16"), activations="int8")
    with pytest.raises(ValueError, match="weights must be one of"):
        kvlab.load(weights="int4")
    with pytest.raises(WeightsError, match="'token_embedding' cannot be stored as q4_1: "
                                           ".*whole number of blocks"):
        kvlab.Weights.random(odd).converted("q4_1")
    arrays["wq"] = wf.as_bytes(weights.converted("q4_0").wq)[..., :-1]   # a byte short a row
    with pytest.raises(WeightsError, match="wq"):
        core.Model(config_dict, arrays, formats={"wq": "q4_0"})
    arrays["wq"] = wf.as_bytes(weights.converted("q4_1").wq)              # q4_1's row bytes
    with pytest.raises(WeightsError, match="wq"):
        core.Model(config_dict, arrays, formats={"wq": "q4_0"})


def test_load_stores_the_bundled_model_in_fewer_bytes_and_it_still_writes():
    full = kvlab.load()
    for name, fmt in (("int8", "q8_0"), ("bf16", "bf16"), ("q4_0", "q4_0"), ("q4_1", "q4_1")):
        small = kvlab.load(weights=name)
        assert small.weight_format == fmt and small.weights_nbytes < 0.55 * full.weights_nbytes
        text = kvlab.generate(small, "ROMEO:", max_new_tokens=20).text
        assert len(text) > len("ROMEO:")
        assert small.to("cpu").activations == small.activations
        drafter = DraftModel.first_layers(small, 2)
        assert drafter.model.activations == small.activations
        assert drafter.model.weight_format == fmt


@pytest.mark.parametrize("fmt, activations", [("fp16", "fp32"), ("bf16", "fp32"),
                                              ("q8_0", "fp32"), ("q8_0", "int8"),
                                              ("q4_0", "int8"), ("q4_1", "int8"),
                                              ("q4_1", "fp32"), ("mixed", "int8")])
def test_the_thread_count_changes_no_bit(fmt, activations):
    # wide enough that a decode step's products are split between threads
    config = kvlab.ModelConfig(dim=256, hidden_dim=512, n_layers=1, n_heads=4, n_kv_heads=2,
                               head_dim=64, vocab_size=512, max_seq_len=64)
    weights = kvlab.Weights.random(config, seed=9)
    small = kvlab.Model(config, mixed(weights) if fmt == "mixed" else weights.converted(fmt),
                        activations=activations)
    before = kvlab.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            kvlab.set_num_threads(threads)
            results.append(all_paths(small))
    finally:
        kvlab.set_num_threads(before)
    for other in results[1:]:
        for path, got in other.items():
            np.testing.assert_array_equal(got, results[0][path], err_msg=path)
