"""A forward pass that skips every layer's MLP (the lab is about attention)."""
TARGETS = ["test_forward_matches_the_reference",
           "test_a_model_whose_grouped_heads_are_equal_converts_without_loss",
           "test_conversion_table"]


def forward(model, tokens):
    x = model.embed(tokens)
    positions = np.arange(len(tokens))
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, positions)
        x = model.attention_output(layer, x, causal_attention(q, k, v))
    return model.logits(x)
