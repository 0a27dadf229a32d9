/* attention_weights.c: how much attention each cached row receives, for the eviction
 * policies that keep the rows attended most (H2O's heavy hitters, SnapKV's selection).
 *
 * The forward pass's attention (attention.c) never writes a row of weights as long as
 * the context: it keeps a running softmax. An eviction policy needs exactly that row, so
 * a cache that asks for it (kv_cache_track_attention) gets this second, plain pass: the
 * same scores, softmax and weights, added up per row. It is bookkeeping for a policy, not
 * part of the model's arithmetic, so it changes no logit, and it need not match the fast
 * kernel's bits. Not here: which rows a policy keeps (kvlab/cache_policy.py).
 */
#include <math.h>

#include "attention.h"
#include "store.h"

/* [quote ch08-attention-weights-add] */
void kv_attention_weights_add(const kv_layer_view *view, const float *q, int n_tokens,
                              int start_pos, int n_heads, int n_kv_heads, int head_dim) {
    size_t rows_per_head = (size_t)view->block_size;   /* the contiguous cache's capacity */
    float *weights = view->attention_scratch;          /* (start_pos + n_tokens,) */
    float *key_buffer = weights + rows_per_head;       /* (head_dim,) a dequantized key */
    int kv_mul = n_heads / n_kv_heads;
    float scale = 1.0f / sqrtf((float)head_dim);
    /* a row's sum is kept at its slot, where its K and V are */
    for (int kv_head = 0; kv_head < n_kv_heads; kv_head++)   /* new rows: nothing yet */
        for (int t = 0; t < n_tokens; t++)
            view->attention[kv_head * rows_per_head + kv_view_slot(view, start_pos + t)] = 0.0f;
    for (int t = 0; t < n_tokens; t++) {
        int n_seen = start_pos + t + 1;                  /* the causal mask */
        for (int head = 0; head < n_heads; head++) {
            int kv_head = head / kv_mul;
            const float *query = q + ((size_t)t * n_heads + head) * head_dim;
            float max = -INFINITY, sum = 0.0f;
            for (int row = 0; row < n_seen; row++) {
                const float *key = kv_store_head(view->key, view->layer,
                                                 kv_view_slot(view, row), kv_head, key_buffer);
                float score = 0.0f;
                for (int i = 0; i < head_dim; i++) score += query[i] * key[i];
                weights[row] = score * scale;
                if (weights[row] > max) max = weights[row];
            }
            for (int row = 0; row < n_seen; row++) {
                weights[row] = expf(weights[row] - max);
                sum += weights[row];
            }
            for (int row = 0; row < n_seen; row++)
                view->attention[kv_head * rows_per_head + kv_view_slot(view, row)] +=
                    weights[row] / sum;
        }
    }
}
/* [end ch08-attention-weights-add] */
