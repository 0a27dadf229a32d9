/* attention.h: causal grouped-query attention over a contiguous cache (internal). */
#ifndef KVLAB_ATTENTION_H
#define KVLAB_ATTENTION_H

/* For each of n_tokens new queries, at positions start_pos .. start_pos + n_tokens - 1,
 * attends over the cached positions 0 .. its own position (the causal mask).
 * q and out are (n_tokens, n_heads * head_dim); key_layer and value_layer are one
 * layer's slice of the cache, (capacity, n_kv_heads, head_dim), already holding the new
 * tokens' K and V. scores is scratch of omp_get_max_threads() rows of score_stride. */
void kv_attention(float *out, const float *q, const float *key_layer,
                  const float *value_layer, int n_tokens, int start_pos, int n_heads,
                  int n_kv_heads, int head_dim, float *scores, int score_stride);

#endif /* KVLAB_ATTENTION_H */
