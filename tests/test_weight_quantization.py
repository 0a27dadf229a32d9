"""kvlab.weight_quantization: round to nearest, AWQ's scales and GPTQ's error feedback give
weights in the kit's own formats that a Model runs, and each method does what it claims."""
import dataclasses

import numpy as np
import pytest

pytest.importorskip("kvlab._kvlab")
import kvlab  # noqa: E402
from kvlab import accuracy, reference, weight_formats  # noqa: E402
from kvlab import weight_quantization as wq  # noqa: E402
from kvlab.model import Model  # noqa: E402

CONFIG = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                           vocab_size=97, max_seq_len=64, name="tiny")


@pytest.fixture(scope="module")
def tiny():
    weights = kvlab.Weights.random(CONFIG, seed=3)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 96)
    return weights, wq.calibrate(CONFIG, weights, tokens, window=48)


def correlated_inputs(rng, n=256, in_dim=64):
    """Inputs with a few large channels and correlated ones, as a model's are."""
    x = rng.standard_normal((n, in_dim)) @ (np.eye(in_dim) + 0.3 * rng.standard_normal((in_dim, in_dim)))
    x[:, [3, 40]] *= 12
    return x.astype(np.float32)


def test_the_block_pieces_are_the_quantizer():
    """weight_formats.quantize is block_scales, block_codes and pack_blocks in a row, and
    block_values gives dequantize's numbers."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 96)).astype(np.float32)
    for fmt in weight_formats.BLOCK_FORMATS:
        blocks = w.reshape(8, 3, 32)
        d, m = weight_formats.block_scales(blocks, fmt)
        q = weight_formats.block_codes(blocks, fmt, d[..., None], m[..., None])
        packed = weight_formats.pack_blocks(fmt, d, m, q)
        assert packed.tobytes() == weight_formats.quantize(w, fmt).tobytes()
        assert np.array_equal(weight_formats.block_values(fmt, d[..., None], m[..., None], q).reshape(8, 96),
                              weight_formats.dequantize(packed, fmt, 96))


def test_codes_are_cut_to_the_formats_range():
    d, m = np.float32([0.1]), np.float32([-0.5])
    far = np.float32([[-100.0, 100.0]])
    assert weight_formats.block_codes(far, "q8_0", d, m).tolist() == [[-127, 127]]
    assert weight_formats.block_codes(far, "q4_0", d, m).tolist() == [[0, 15]]
    assert weight_formats.block_codes(far, "q4_1", d, m).tolist() == [[0, 15]]


def test_round_to_nearest_is_the_kits_conversion(tiny):
    weights, _ = tiny
    for fmt in weight_formats.BLOCK_FORMATS:
        got = wq.quantize_weights(CONFIG, weights, fmt, embedding_format=fmt)
        want = weights.converted(fmt)
        for name, array in got.items():
            assert array.tobytes() == getattr(want, name).tobytes(), (fmt, name)
        assert got.classifier is got.token_embedding            # a tied classifier stays tied


def test_awqs_fold_leaves_the_float_model_unchanged(tiny):
    """Scaling columns up and the previous operation's output down is the same function:
    the folded float32 weights give the original logits to float32 rounding."""
    weights, calibration = tiny
    folded, searches = wq.awq_fold(CONFIG, weights, calibration, "q4_0")
    assert len(searches) == CONFIG.n_layers and set(searches[0]) == {"attn", "wo", "ffn", "w2"}
    assert any(s.alpha > 0 for layer in searches for s in layer.values())
    tokens = list(range(5, 30))
    np.testing.assert_allclose(reference.forward(CONFIG, folded, tokens),
                               reference.forward(CONFIG, weights, tokens), rtol=1e-4, atol=1e-4)
    # heads that share a value head share its scales (GQA): wo's columns per KV head agree
    s = searches[0]["wo"].scales.reshape(CONFIG.n_kv_heads, CONFIG.kv_mul, CONFIG.head_dim)
    assert np.array_equal(s[:, 0], s[:, 1])


def test_awq_search_beats_or_equals_round_to_nearest():
    rng = np.random.default_rng(2)
    x = correlated_inputs(rng)
    w = (0.1 * rng.standard_normal((48, 64))).astype(np.float32)
    found = wq.awq_search(x, [w], "q4_0")
    rtn = wq.output_error(x, w, wq.rounded(w, "q4_0"))
    assert found.errors[0.0] == pytest.approx(rtn)          # alpha 0: scales of 1, RTN
    assert found.errors[found.alpha] == min(found.errors.values()) < rtn
    assert found.scales.shape == (64,) and found.scales.dtype == np.float32
    s = wq.awq_scales(np.abs(x).mean(0), found.alpha)
    assert np.array_equal(s, found.scales) and s.max() * s.min() == pytest.approx(1, rel=1e-5)


def test_gptq_without_correlations_is_round_to_nearest():
    """With H a multiple of the identity, no column's error has anywhere to go."""
    w = np.random.default_rng(3).standard_normal((16, 64)).astype(np.float32)
    for fmt in weight_formats.BLOCK_FORMATS:
        assert wq.gptq_quantize(w, 3.0 * np.eye(64), fmt).tobytes() == \
            weight_formats.quantize(w, fmt).tobytes()


def test_gptq_lowers_the_layers_output_error():
    rng = np.random.default_rng(4)
    x = correlated_inputs(rng)
    w = (0.1 * rng.standard_normal((48, 64))).astype(np.float32)
    for fmt in weight_formats.BLOCK_FORMATS:
        stored = weight_formats.dequantize(wq.gptq_quantize(w, wq.hessian(x), fmt), fmt, 64)
        assert wq.output_error(x, w, stored) < 0.95 * wq.output_error(x, w, wq.rounded(w, fmt))


def test_weights_already_on_a_formats_grid_stay_there():
    """Chapter 10's SmolLM2 rows for Q4_1: the file's Q4_1 values re-quantized to Q4_1
    come back exactly, by round to nearest and by GPTQ (no error, nothing to feed back)."""
    rng = np.random.default_rng(5)
    values = wq.rounded(rng.standard_normal((24, 96)).astype(np.float32), "q4_1")
    assert np.array_equal(wq.rounded(values, "q4_1"), values)
    x = correlated_inputs(rng, in_dim=96)
    assert wq.gptq_quantize(values, wq.hessian(x), "q4_1").tobytes() == \
        weight_formats.quantize(values, "q4_1").tobytes()


@pytest.mark.parametrize("method", wq.METHODS)
def test_every_method_gives_weights_a_model_runs_at_the_formats_bytes(tiny, method):
    weights, calibration = tiny
    rtn = wq.quantize_weights(CONFIG, weights, "q4_0")
    got = wq.quantize_weights(CONFIG, weights, "q4_0", method, calibration)
    assert got.formats == rtn.formats and got.nbytes == rtn.nbytes
    assert got.token_embedding is weights.token_embedding     # kept as stored
    # and kept as stored when it is stored in fewer bytes (SmolLM2's Q8_0 embedding): AWQ's
    # fold works on float32 values but leaves the embedding and classifier alone
    q8 = weights.converted("q8_0")
    again = wq.quantize_weights(CONFIG, q8, "q4_0", method, wq.calibrate(CONFIG, q8, range(40)))
    assert again.token_embedding is q8.token_embedding and again.classifier is q8.classifier
    assert again.nbytes == wq.quantize_weights(CONFIG, q8, "q4_0").nbytes
    model = Model(CONFIG, got)
    out = kvlab.generate(model, [1, 2, 3], max_new_tokens=8, stop_at_eos=False)
    assert len(out.tokens) == 8
    # float32 activations: the float32 model over the stored values, as chapter 6 says
    tokens = list(range(10, 30))
    np.testing.assert_allclose(Model(CONFIG, got, activations="fp32").forward(tokens, all_logits=True),
                               reference.forward(CONFIG, got, tokens), rtol=2e-4, atol=2e-4)


def test_bad_requests_are_refused_by_name(tiny):
    weights, calibration = tiny
    with pytest.raises(ValueError, match="fmt must be one of"):
        wq.quantize_weights(CONFIG, weights, "fp16")
    with pytest.raises(ValueError, match="method must be one of"):
        wq.quantize_weights(CONFIG, weights, "q4_0", "smoothquant")
    with pytest.raises(ValueError, match="needs a Calibration"):
        wq.quantize_weights(CONFIG, weights, "q4_0", "gptq")
    with pytest.raises(ValueError, match="layers"):
        wq.quantize_weights(CONFIG, weights, "q4_0", "awq",
                            dataclasses.replace(calibration, attn=calibration.attn[:1]))
    with pytest.raises(ValueError, match="token ids"):
        wq.calibrate(CONFIG, weights, [CONFIG.vocab_size])
    with pytest.raises(ValueError, match="block formats"):
        wq.gptq_quantize(np.zeros((2, 32), np.float32), np.eye(32), "fp16")


def test_compare_models_against_itself_and_another(tiny):
    weights, _ = tiny
    model = Model(CONFIG, weights)
    tokens = np.random.default_rng(6).integers(0, CONFIG.vocab_size, 70)
    exact, rows = accuracy.compare_models(
        model, {"same": model, "q4_0": Model(CONFIG, weights.converted("q4_0"), activations="fp32")},
        tokens, context=32)
    same, q4 = rows
    assert same.kl == pytest.approx(0, abs=1e-12) and same.top1 == 1 and same.perplexity_change == 0
    assert same.perplexity == pytest.approx(exact)
    assert q4.kl > 0 and q4.weight_bytes < same.weight_bytes


def test_a_slow_grading_test_gets_a_multiple_of_the_judges_limit():
    """The lab's SmolLM2 test runs a 135M model: @points(5, slow=3) gives it three times the
    judge's limit for one test, and nothing else does."""
    from kvlab.grading.judge import Judge
    from kvlab.grading.testkit import points

    @points(1)
    def plain(sub, rng):
        pass

    @points(5, slow=3)
    def heavy(sub, rng):
        pass
    judge = Judge.__new__(Judge)
    judge.test_timeout = 60.0
    assert judge._limit(plain) == 60.0 and judge._limit(heavy) == 180.0
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="slow"):
            points(1, slow=bad)
