"""Tests of loading weights in fewer bytes: GGUF F16, BF16, Q8_0, Q4_0 and Q4_1 matrices and
16-bit safetensors keep their format, byte for byte; other GGUF types (Q5_0, the K-quants) are
dequantized into a format the core reads, with one warning that says what it cost. Loaded
weights are copies in memory of their own, aligned as the core reads them, even from a file
whose tensors lie at odd offsets.

The GGUF files are written here (tests/support/gguf_files.py) with a tiny random config
whose rows are multiples of 256, the K-quants' block.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import kvlab
from kvlab import weight_formats
from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError
from kvlab.loaders import load_checkpoint, save_gguf, save_hf_llama
from kvlab.loaders.gguf_file import read_gguf
from kvlab.loaders.huggingface import interleaved_to_half
from kvlab.weights import MATRICES, Weights

gguf = pytest.importorskip("gguf")
from gguf_files import GLOBAL_TENSORS, LAYER_TENSORS, write_llama_gguf  # noqa: E402

CONFIG = ModelConfig(dim=256, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                     vocab_size=32, max_seq_len=16, rope_interleaved=True,
                     tied_embeddings=False)
TOKENS = [1, 5, 7, 3, 9, 30, 2]
KEPT = {"F16": "fp16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0",   # GGUF type -> kvlab
        "Q4_1": "q4_1"}


@pytest.fixture(scope="module")
def weights() -> Weights:
    return Weights.random(CONFIG, seed=3)


def tensor_names(config: ModelConfig, key: str) -> list:
    """The GGUF tensors of a kvlab weight: one per layer, or one."""
    if key in LAYER_TENSORS:
        return [LAYER_TENSORS[key].format(i=i) for i in range(config.n_layers)]
    return [GLOBAL_TENSORS[key]]


def file_tensors(path) -> dict:
    return {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}


def layers(array: np.ndarray, key: str) -> list:
    return list(array) if key in LAYER_TENSORS else [array]


def load_quietly(path, **options):
    """kvlab.load, failing on any warning: a kept format costs nothing to say."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return kvlab.load(path, **options)


def load_warning(path, **options):
    """(model, the one warning's text) of kvlab.load on a file that needs dequantizing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = kvlab.load(path, **options)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__      # it points at the caller's line, not kvlab's
    return model, str(caught[0].message)


def assert_same_logits_as_float32(model: kvlab.Model) -> None:
    """The model's logits are the float32 model's over its weights' values, bit for bit."""
    exact = kvlab.Model(model.config, model.weights.float32(), activations="fp32")
    np.testing.assert_array_equal(model.forward(TOKENS, all_logits=True),
                                  exact.forward(TOKENS, all_logits=True))


# ---- GGUF types the core reads: kept as they are -----------------------------------------
@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_kept_gguf_types_are_the_files_bytes(tmp_path, weights, kind) -> None:
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, CONFIG, weights, default=kind)
    model = load_quietly(path, activations="fp32")
    loaded = model.weights
    assert set(loaded.formats.values()) == {KEPT[kind]}
    assert loaded.attn_norm.dtype == loaded.final_norm.dtype == np.float32
    raw = file_tensors(path)
    for key in MATRICES:
        for layer, name in zip(layers(getattr(loaded, key), key), tensor_names(CONFIG, key)):
            assert weight_formats.as_bytes(layer).tobytes() == raw[name].data.tobytes(), name
    assert loaded.nbytes < weights.nbytes * 0.55          # about half of fp32, or less
    assert_same_logits_as_float32(model)


def test_a_tied_gguf_keeps_one_array(tmp_path) -> None:
    config = CONFIG.replace(tied_embeddings=True)
    path = tmp_path / "tied.gguf"
    write_llama_gguf(path, config, Weights.random(config), default="Q8_0")
    loaded = load_checkpoint(path)[1]
    assert loaded.classifier is loaded.token_embedding and loaded.format == "q8_0"


# ---- where loaded weights lie: memory of their own, aligned as the core reads them ----------
def owns_its_memory(array: np.ndarray) -> bool:
    """The array's memory is NumPy's own (itself or an array it views), not a file's map."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array.base is None and array.flags.owndata and not isinstance(array, np.memmap)


def tensors_start_odd(path) -> bool:
    return all(tensor.data.ctypes.data % 2 for tensor in read_gguf(path).tensors)


def write_at_odd_offsets(path, weights: Weights, kind: str) -> None:
    """A GGUF file whose every tensor's data starts at an odd offset (so at an odd address
    in a map of it): general.alignment 1 (no padding, which GGUF allows) and a general.name
    of the length that makes the header's length odd."""
    for name in ("x", "xy"):
        write_llama_gguf(path, CONFIG, weights, default=kind, alignment=1, name=name)
        if tensors_start_odd(path):
            return
    raise AssertionError("neither name put the tensors' data at odd offsets")


def assert_laid_out_for_the_core(loaded: Weights) -> None:
    assert loaded.mapped_files == ()
    for key, array in loaded.items():
        assert owns_its_memory(array) and array.flags.c_contiguous, key
        # the core reads a float32, fp16 or bf16 matrix a number at a time from its own
        # address (kv_py_array checks it); a block's scales by memcpy, at any address
        assert array.ctypes.data % array.dtype.alignment == 0, (key, array.ctypes.data)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_weights_of_a_file_with_odd_offsets_are_aligned_copies(tmp_path, weights, kind):
    """GGUF lets a file put its tensors at any offset: each weight is copied out of the map
    into memory of its own, C-ordered and aligned for the core's reads, with the bytes and
    logits of the same weights padded to GGUF's usual 32 bytes."""
    odd, usual = tmp_path / "odd.gguf", tmp_path / "usual.gguf"
    write_at_odd_offsets(odd, weights, kind)
    write_llama_gguf(usual, CONFIG, weights, default=kind)
    model = load_quietly(odd, activations="fp32")
    assert_laid_out_for_the_core(model.weights)
    padded = load_quietly(usual, activations="fp32")
    for key, array in model.weights.items():
        expected = getattr(padded.weights, key)
        assert weight_formats.as_bytes(array).tobytes() == \
            weight_formats.as_bytes(expected).tobytes(), key
    np.testing.assert_array_equal(model.forward(TOKENS, all_logits=True),
                                  padded.forward(TOKENS, all_logits=True))


def test_smollm2_weights_are_aligned_copies(smollm2):
    """The real file's weights (Q4_1 layers, Q8_0 embedding), as kvlab.load gives them."""
    assert_laid_out_for_the_core(smollm2.weights)


# ---- other GGUF types: dequantized into a format the core reads ------------------------------
@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("asked", [None, "fp16"])
def test_other_gguf_types_are_dequantized(tmp_path, weights, kind, asked) -> None:
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, CONFIG, weights, default=kind)
    model, message = load_warning(path, weights=asked, activations="fp32")
    stored_as = asked or "q8_0"
    n_tensors = 2 + 7 * CONFIG.n_layers
    assert f"dequantized {n_tensors} GGUF tensors of type {kind}" in message
    assert re.search(rf"in \d+\.\d\d s .*; stored as {stored_as}, they take [\d,.]+ \w+, "
                     r"against [\d,]+ bytes in the file \(\d+\.\d\dx\)", message), message
    assert model.weights.format == stored_as
    raw = file_tensors(path)
    for key in MATRICES:
        got = weight_formats.values(getattr(model.weights, key))
        for layer, name in zip(layers(got, key), tensor_names(CONFIG, key)):
            tensor = raw[name]
            want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            if stored_as == "fp16":
                np.testing.assert_array_equal(layer, want.astype(np.float16).astype(np.float32))
            else:  # q8_0 of gguf's values: kvlab's own rounding of them, ...
                assert weight_formats.as_bytes(weight_formats.stored(want, "q8_0")).tobytes() \
                    == weight_formats.as_bytes(weight_formats.stored(layer, "q8_0")).tobytes()
                # ... so within half a step of its block, plus up to 127 times the error of
                # storing the step as a half (relative 2**-11, more where it is subnormal)
                step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
                step_error = np.abs(step - step.astype(np.float16).astype(np.float32))
                bound = (0.5 * step + 127 * step_error) * 1.001
                assert np.all(np.abs(layer - want).reshape(-1, 32) <= bound), name
    assert_same_logits_as_float32(model)


def test_a_matrix_whose_layers_differ_in_type(tmp_path, weights) -> None:
    """Q4_K_M files mix Q4_K and Q6_K layers; a matrix whose layers are two kept types (F16
    and Q8_0) cannot keep both either. Each becomes one array in the fallback format."""
    mixed = {key: ["Q4_K", "Q6_K"] for key in LAYER_TENSORS if key not in ("attn_norm", "ffn_norm")}
    mixed["wo"] = ["F16", "Q8_0"]
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path, CONFIG, weights, types=dict(mixed, token_embedding="Q8_0",
                                                       classifier="F16"))
    model, message = load_warning(path, activations="fp32")
    assert "of types F16 (1), Q4_K (6), Q6_K (6) and Q8_0 (1)" in message
    assert model.weights.formats == dict.fromkeys(MATRICES, "q8_0") | {"classifier": "fp16"}
    assert_same_logits_as_float32(model)
    assert np.isfinite(model.forward(TOKENS)).all()


def test_a_tied_gguf_dequantizes_its_embedding_once(tmp_path) -> None:
    config = CONFIG.replace(tied_embeddings=True)
    path = tmp_path / "tied.gguf"
    write_llama_gguf(path, config, Weights.random(config), default="Q8_0",
                     types={"token_embedding": "Q5_0"})
    model, message = load_warning(path)
    assert "dequantized 1 GGUF tensors of type Q5_0" in message
    assert model.weights.classifier is model.weights.token_embedding


def test_rows_that_are_not_whole_q8_0_blocks_fall_back_to_fp16(tmp_path) -> None:
    config = ModelConfig(dim=48, hidden_dim=64, n_layers=2, n_heads=2, n_kv_heads=1,
                         vocab_size=20, max_seq_len=8, rope_interleaved=True,
                         tied_embeddings=False)
    path = tmp_path / "odd.gguf"
    write_llama_gguf(path, config, Weights.random(config), types={"wq": ["F32", "F16"]})
    model, message = load_warning(path)
    assert "stored as fp16" in message
    assert model.weights.formats["wq"] == "fp16" and model.weights.formats["wk"] == "fp16"


def test_a_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path, weights) -> None:
    path = tmp_path / "int8.gguf"
    write_llama_gguf(path, CONFIG, weights, types={"wv": "I8"})
    with pytest.raises(CheckpointError, match=r"int8.gguf: tensor 'blk.0.attn_v.weight' has "
                                              r"type I8, which the gguf package cannot"):
        load_checkpoint(path)


def test_big_endian_files_keep_f16_and_refuse_byte_types(tmp_path, weights) -> None:
    path = tmp_path / "big.gguf"
    write_llama_gguf(path, CONFIG, weights, default="F16", big_endian=True)
    loaded = load_checkpoint(path)[1]
    assert loaded.format == "fp16"
    np.testing.assert_array_equal(loaded.w2, weights.w2.astype(np.float16))
    write_llama_gguf(path, CONFIG, weights, default="F16", types={"w3": "Q8_0"}, big_endian=True)
    with pytest.raises(CheckpointError, match="has type Q8_0 in a big-endian GGUF file"):
        load_checkpoint(path)


# ---- Hugging Face: 16-bit safetensors stay 16-bit ---------------------------------------------
@pytest.mark.parametrize("dtype, fmt", [("f16", "fp16"), ("bf16", "bf16")])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_16_bit_checkpoints_keep_their_format(tmp_path, dtype, fmt, tied) -> None:
    config = CONFIG.replace(rope_interleaved=False, tied_embeddings=tied, name="hf")
    original = Weights.random(config, seed=4)
    save_hf_llama(tmp_path / "hf", config, original, dtype=dtype)
    model = load_quietly(tmp_path / "hf")
    loaded = model.weights
    assert loaded.format == fmt and loaded.final_norm.dtype == np.float32
    assert (loaded.classifier is loaded.token_embedding) == tied
    assert 0.5 <= loaded.nbytes / original.nbytes < 0.51
    expected = original.converted(fmt)          # the same rounding (nearest, ties to even)
    for key in MATRICES:
        assert weight_formats.as_bytes(getattr(loaded, key)).tobytes() == \
            weight_formats.as_bytes(getattr(expected, key)).tobytes(), key
    assert_same_logits_as_float32(model)


def test_saving_weights_in_fewer_bytes_writes_their_values(tmp_path, weights) -> None:
    q8 = weights.converted("q8_0")
    save_hf_llama(tmp_path / "hf", CONFIG, q8, dtype="float32")
    loaded = load_checkpoint(tmp_path / "hf")[1]
    for key in MATRICES:
        values = weight_formats.values(getattr(q8, key))
        if key in ("wq", "wk"):     # saved for the rotate-half RoPE layout
            values = interleaved_to_half(values, CONFIG.head_dim)
        np.testing.assert_array_equal(getattr(loaded, key), values, err_msg=key)


# ---- writing GGUF files (kvlab.loaders.save_gguf) ------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_save_gguf_writes_each_format_as_it_is_stored(tmp_path, fmt, interleaved):
    config = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16, vocab_size=300, max_seq_len=64,
                               rope_interleaved=interleaved)
    stored = kvlab.Weights.random(config, seed=5).converted(fmt)
    path = tmp_path / f"model-{fmt}.gguf"
    save_gguf(path, config, stored, placeholder_vocabulary=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # nothing was dequantized
        back = kvlab.load(path, activations="fp32")
    assert back.weights.formats == stored.formats and back.tokenizer is not None
    tokens = [1, 7, 200, 299, 4]
    want = kvlab.Model(config, stored, activations="fp32").forward(tokens, all_logits=True)
    got = back.forward(tokens, all_logits=True)
    if interleaved:        # the same bytes: the same logits, bit for bit
        for name in ("wq", "w2", "classifier"):
            np.testing.assert_array_equal(weight_formats.as_bytes(getattr(back.weights, name)),
                                          weight_formats.as_bytes(getattr(stored, name)))
        np.testing.assert_array_equal(got, want)
    else:                  # Wq, Wk rows permuted to GGUF's interleaved pairs: attention's sums
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)   # run in another order


def test_save_gguf_refuses_what_it_cannot_write(tmp_path):
    small = kvlab.ModelConfig(dim=32, hidden_dim=64, n_layers=1, n_heads=2, n_kv_heads=2,
                              head_dim=16, vocab_size=100, max_seq_len=32)
    with pytest.raises(CheckpointError, match="at least 259 tokens"):
        save_gguf(tmp_path / "x.gguf", small, kvlab.Weights.random(small), placeholder_vocabulary=True)
    scaled = small.replace(vocab_size=300, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    with pytest.raises(CheckpointError, match="RoPE scaling"):
        save_gguf(tmp_path / "y.gguf", scaled, kvlab.Weights.random(scaled))
