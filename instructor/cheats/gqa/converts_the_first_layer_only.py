"""Pools the first layer's wk and wv and gives every other layer the first layer's pooled
weights too: one layer's work, copied."""
TARGETS = ["test_convert_pools_every_layer_and_leaves_the_model",
           "test_a_model_whose_grouped_heads_are_equal_converts_without_loss",
           "test_conversion_table"]


def convert(model, n_kv_heads):
    wk, wv = model.key_value_weights(0)
    keys = mean_pool_heads(wk, n_kv_heads, model.config.head_dim)
    values = mean_pool_heads(wv, n_kv_heads, model.config.head_dim)
    n_layers = model.config.n_layers
    return model.with_key_value_weights([keys] * n_layers, [values] * n_layers)
