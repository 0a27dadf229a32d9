"""Lab 4: grouped-query attention, and an MHA model converted to GQA. Fill in every
function marked TODO.

Chapter 3 (chapters/03_gqa.md) says GQA divides the cache by n_heads / n_kv_heads: query
heads in a group share one key head and one value head. Here you write that attention, then
turn a trained MHA model (a KV head per query head) into GQA and MQA models by averaging the
key and value heads of each group (the conversion of Ainslie et al., 2023, before they train
it further), run them through your attention, and measure what the bytes saved cost.

The grader lends your functions a `model`: a model's weights behind the building blocks of
a forward pass, everything but attention (the same kind of model as lab 2's):

    model.config                     n_layers, n_heads, n_kv_heads, head_dim, dim, vocab_size, ...
    model.embed(tokens)              (n, dim) float32
    model.qkv(layer, x, positions)   q (n, n_heads, head_dim), k and v (n, n_kv_heads, head_dim),
                                     with RoPE applied for those positions
    model.attention_output(layer, x, out)   x plus out (n, n_heads, head_dim) projected back
    model.mlp(layer, x)              x plus the MLP
    model.logits(x)                  (n, vocab_size)
    model.key_value_weights(layer)   (wk, wv), copies, each (n_kv_heads * head_dim, dim):
                                     rows h * head_dim .. (h + 1) * head_dim - 1 make KV head h
    model.with_key_value_weights(keys, values)
                                     a new model with these wk and wv (a list of one array
                                     per layer each) and every other weight of this one;
                                     its n_kv_heads follows from their rows
    model.encode(text)               the tokens of a text (its UTF-8 bytes)

Try things at the end of the file under `if __name__ == "__main__":`; there
`kvlab.grading.handouts.ReferenceModel(checkpoint="mha")` gives you the bundled MHA model
as the grader lends it ("default" the bundled GQA model).

Check your work with:  kvlab check gqa gqa.py    (the public checks)
Your grade:            kvlab grade gqa gqa.py    (your course runs hidden tests)
You may import numpy, math, Python's standard library, and from kvlab only
`from kvlab.accuracy import perplexity, kl_divergence` (the rest of kvlab is refused).
"""
import math

import numpy as np

from kvlab.accuracy import kl_divergence, perplexity   # noqa: F401 (conversion_table uses them)


def attend(q, keys, values):
    """One decode step of grouped-query attention in one layer.

    q: (n_heads, head_dim); keys, values: (length, n_kv_heads, head_dim).
    Returns (n_heads, head_dim) float32.

    kv_mul = n_heads // n_kv_heads query heads share each KV head, and they are
    consecutive: query head h reads KV head h // kv_mul. (kv_mul = 1 is MHA; n_kv_heads = 1
    is MQA.) Then as in lab 1: scores = keys_of_that_head @ q[h] / sqrt(head_dim), a softmax
    that subtracts the largest score first, output = weights @ values_of_that_head.
    """
    # TODO
    raise NotImplementedError("attend")


def causal_attention(q, k, v):
    """Prefill of T tokens at positions 0..T-1, grouped-query: q (T, n_heads, head_dim),
    k and v (T, n_kv_heads, head_dim); returns (T, n_heads, head_dim) float32. Position t
    sees positions 0..t. Row t must equal attend(q[t], k[:t + 1], v[:t + 1]).
    """
    # TODO
    raise NotImplementedError("causal_attention")


def mean_pool_heads(w, n_kv_heads, head_dim):
    """A layer's wk (or wv), (n_heads * head_dim, dim), turned into n_kv_heads heads:
    returns (n_kv_heads * head_dim, dim) float32 whose head g is the mean of the old heads
    g * group .. (g + 1) * group - 1, group = n_heads // n_kv_heads (the query heads that
    will read it, by attend's rule). Raises ValueError when n_kv_heads does not divide
    n_heads (or is less than 1).
    """
    # TODO
    raise NotImplementedError("mean_pool_heads")


def convert(model, n_kv_heads):
    """The model with n_kv_heads KV heads: every layer's wk and wv mean-pooled, through
    model.key_value_weights and model.with_key_value_weights. The model given is unchanged.
    """
    # TODO
    raise NotImplementedError("convert")


def forward(model, tokens):
    """The logits (n, vocab_size) of an uncached forward pass over tokens (n token ids),
    with your causal_attention: x = model.embed(tokens); then in every layer q, k, v from
    model.qkv at positions 0..n-1, x = model.attention_output(layer, x, your attention),
    x = model.mlp(layer, x); finally model.logits(x). Works for any n_kv_heads.
    """
    # TODO
    raise NotImplementedError("forward")


def conversion_table(model, tokens, kv_head_counts):
    """For each n_kv_heads in kv_head_counts (in that order), the model converted to it and
    run over tokens with your forward, against the model itself. Returns a list of dicts:

        {"n_kv_heads": ...,
         "cache_bytes_per_token": bytes of K and V per token in an fp32 cache (an int),
         "perplexity": perplexity(its logits, tokens),
         "kl": kl_divergence(the model's own logits, its logits)}

    (perplexity and kl_divergence are kvlab.accuracy's: import them at the top.)
    """
    # TODO
    raise NotImplementedError("conversion_table")
