"""kvlab against Hugging Face transformers' LlamaForCausalLM on the same weights.

transformers writes the checkpoint (save_pretrained, safetensors) and computes the
oracle logits in float32 on the CPU; kvlab loads the folder with its own NumPy reader
and must agree to 1e-4. Skipped where torch/transformers (the `test` extra) are absent.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvlab  # noqa: E402
from kvlab import reference  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CONFIGS = {
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24),
    "llama3-rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling=LLAMA3_SCALING),
}


def hf_model(name, seed=0):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
        **{"tie_word_embeddings": False, **CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():   # norms away from 1.0 so a wrong norm cannot hide
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.mul_(1.0 + 0.2 * torch.randn_like(param))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        return model(ids, use_cache=False).logits[0].float().numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = kvlab.load(tmp_path)
    assert not model.config.rope_interleaved
    tokens = np.random.default_rng(0).integers(0, 97, size=40)
    want = hf_logits(hf, tokens)

    np.testing.assert_allclose(model.forward(tokens, all_logits=True), want, atol=1e-4, rtol=0)
    cache = model.new_cache(40)
    got = [model.prefill(tokens[:25], cache, all_logits=True)]
    got += [model.decode(int(t), cache)[None] for t in tokens[25:]]
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(reference.forward(model.config, model.weights, tokens), want,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints(dtype, tmp_path):
    half = getattr(torch, dtype)
    hf = hf_model("gqa", seed=1)
    with torch.no_grad():                   # the oracle: half-rounded weights, fp32 math
        for param in hf.parameters():
            param.copy_(param.to(half).float())
    # (converting the whole model would also round its RoPE buffer, so copy first)
    copy.deepcopy(hf).to(half).save_pretrained(tmp_path, safe_serialization=True)
    model = kvlab.load(tmp_path)
    tokens = np.random.default_rng(1).integers(0, 97, size=16)
    np.testing.assert_allclose(model.forward(tokens, all_logits=True), hf_logits(hf, tokens),
                               atol=1e-4, rtol=0)


def test_shared_tiny_llama3_matches_transformers(shared_models):
    folder = shared_models / "mlxd-tiny-llama3-random"
    if not folder.exists():
        pytest.skip("mlxd-tiny-llama3-random not in ../shared/models")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = kvlab.load(folder)
    assert model.config.rope_scaling is not None
    tokens = np.random.default_rng(2).integers(0, 256, size=64)
    np.testing.assert_allclose(model.forward(tokens, all_logits=True), hf_logits(hf, tokens),
                               atol=1e-4, rtol=0)
