"""SmolLM2-135M-Instruct through kvlab against Hugging Face transformers on the same GGUF file.

transformers reads the GGUF itself (it dequantizes every tensor to float32) and runs its
own LlamaForCausalLM: an implementation kvlab shares nothing with, on the real trained
model. kvlab runs float32 activations, over the file's values (weights="fp32": dequantized
once, exactly; the logits only) and over the matrices kept in their GGUF bytes.
The token ids come from transformers' tokenizer, so these tests check the forward pass
alone (tests/test_gguf_tokenizer.py checks the tokenizer).

About 40 s on 2 cores, most of it transformers loading the file; skipped where torch,
transformers or the model cannot be had.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import kvlab  # noqa: E402
from kvlab.next_token_metrics import perplexity  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
    "Les chats dorment 16 heures par jour, et 3,14159 est à peu près pi.",
]
# Written for this test: plain English, a few hundred tokens, for the perplexity check.
TEXT = (
    "When a language model writes a sentence, it produces one token at a time. Each new token "
    "looks back at every token before it, through the attention layers. Without a cache, the "
    "model would compute the keys and values of the whole sentence again at every step, so the "
    "work would grow with the square of the length. A key-value cache keeps those keys and "
    "values in memory once they are computed. Because a token never changes after it is "
    "written, the cached numbers stay correct, and each step only has to process the newest "
    "token. The price is memory: every layer keeps two vectors for every token of every "
    "request, and for long conversations this cache can grow larger than the model itself. "
    "That is why serving systems page the cache in blocks, share the blocks of common "
    "prefixes between requests, and store the numbers in fewer bits.")


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    folder, name = smollm2_path.parent, smollm2_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, torch_dtype=torch.float32).eval()
    return tokenizer, model


_HF_LOGITS: dict = {}


def _hf_logits(model, ids):
    """transformers' logits for ids, computed once for every variant of kvlab."""
    key = tuple(ids)
    if key not in _HF_LOGITS:
        with torch.no_grad():
            _HF_LOGITS[key] = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    return _HF_LOGITS[key]


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


VARIANTS = {
    "fp32 weights": dict(weights="fp32"),
    "kept weights, fp32 activations": dict(activations="fp32"),
}


def _load(path, variant):
    model = kvlab.load(path, **VARIANTS[variant])
    kept = set(model.weights.formats.values())
    if variant.startswith("kept") and not kept & {"q4_0", "q4_1"}:
        pytest.skip(f"this kvlab stores SmolLM2's Q4_1 matrices as {sorted(kept)}, not as "
                    f"they are in the file, so its values differ from the file's")
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ours(request, smollm2_path):
    """kvlab both ways: the file's values as float32 matrices, and its matrices as kept."""
    return _load(smollm2_path, request.param)


@pytest.fixture(scope="module")
def kept(smollm2_path):
    """The model as kvlab keeps it (Q4_1 and Q8_0 bytes), with float32 activations."""
    return _load(smollm2_path, "kept weights, fp32 activations")


def _relative_rms(got, want):
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(oracle, ours, prompt):
    tokenizer, hf = oracle
    ids = _ids(tokenizer, prompt)
    want = _hf_logits(hf, ids)
    got = ours.forward(ids, all_logits=True)
    assert _relative_rms(got, want) < 1e-3
    # and through the cache, one token at a time, the same as kvlab's own forward
    cache = ours.new_cache(len(ids))
    steps = np.stack([ours.decode(t, cache) for t in ids])
    assert _relative_rms(steps, want) < 1e-3


def test_greedy_tokens_match_transformers(oracle, kept):
    """kvlab's 64 greedy tokens are transformers' greedy choices: one transformers pass
    over the prompt and kvlab's tokens gives the argmax after every prefix, which is what
    its step-by-step greedy generation would pick (and 64 times cheaper to run)."""
    tokenizer, hf = oracle
    ids = _ids(tokenizer, PROMPTS[2])
    got = kvlab.generate(kept, ids, max_new_tokens=64, stop_at_eos=False).tokens
    want = _hf_logits(hf, ids + got[:-1])[len(ids) - 1:].argmax(axis=-1).tolist()
    assert got == want


def test_perplexity_matches_transformers(oracle, kept):
    tokenizer, hf = oracle
    ids = _ids(tokenizer, TEXT)
    assert len(ids) > 150
    want = perplexity(_hf_logits(hf, ids), np.array(ids))
    got = perplexity(kept.forward(ids, all_logits=True), np.array(ids))
    assert abs(got - want) < 1e-3, (got, want)
    assert 2 < want < 100       # a trained model on English: a sanity bound, not the check
