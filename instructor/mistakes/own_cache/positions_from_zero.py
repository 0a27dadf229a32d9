"""Rotates the new tokens' queries and keys for positions 0, 1, ... whatever the cache holds:
a decode step's RoPE puts it at the start of the sequence, so the cached run drifts from
the uncached one after the prefill (the causal mask is right; only RoPE is wrong)."""
EXPECTED_FAILURES = ["test_prefill_then_decode_matches_the_uncached_run",
                     "test_greedy_tokens_are_the_same_with_and_without_the_cache"]


def forward(model, tokens, cache=None):
    start = 0 if cache is None else cache.length
    positions = np.arange(start, start + len(tokens))
    x = model.embed(tokens)
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, np.arange(len(tokens)))
        if cache is None:
            keys, values = k, v
        else:
            cache.append(layer, k, v)
            keys, values = cache.keys(layer), cache.values(layer)
        x = model.attention_output(layer, x, attention(q, keys, values, positions))
        x = model.mlp(layer, x)
    return model.logits(x)
