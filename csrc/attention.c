/* attention.c: causal grouped-query attention (MHA, GQA and MQA are one code path).
 *
 * Query head h reads key/value head h / kv_mul, where kv_mul = n_heads / n_kv_heads:
 * with kv_mul = 1 that is multi-head attention, with n_kv_heads = 1 multi-query.
 * Positions are visited block by block through the view's block table, so the paged
 * cache costs one table lookup per block, not per token. A quantized cache is read one
 * head row at a time: dequantized into a small buffer right before use, never into a
 * full-precision copy of the cache. Every (token, head) pair is computed the same way
 * whether it arrives in a prefill batch or alone in a decode step, and whichever cache
 * holds its keys, so the cached, uncached and paged paths agree bit for bit.
 */
#include <math.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "ops.h"
#include "store.h"

static size_t round_up16(size_t n) { return (n + 15) & ~(size_t)15; }

size_t kv_attention_scratch(int n_heads, int n_kv_heads, int head_dim, int max_positions) {
    return (size_t)(n_heads / n_kv_heads) * round_up16((size_t)max_positions) +
           2 * round_up16((size_t)head_dim);
}

/* Head `head` of position pos's key (or value, with is_value) as float32, for a query
 * at position query_pos: full precision inside the residual window, else from the store
 * (where pos lives in slot `slot`). */
static const float *head_row(const kv_layer_view *view, int is_value, int pos, size_t slot,
                             int query_pos, int head, int head_dim, float *buffer) {
    int kv_dim = (is_value ? view->value : view->key)->kv_dim;
    if (view->window > 0 && pos > query_pos - view->window) {
        if (pos >= view->new_start)
            return (is_value ? view->new_value : view->new_key) +
                   (size_t)(pos - view->new_start) * kv_dim + (size_t)head * head_dim;
        return (is_value ? view->window_value : view->window_key) +
               (size_t)(pos % view->window) * kv_dim + (size_t)head * head_dim;
    }
    return kv_store_head(is_value ? view->value : view->key, view->layer, slot, head,
                         head_dim, buffer);
}

void kv_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                  int start_pos, int n_heads, int n_kv_heads, int head_dim, float *scratch,
                  size_t scratch_stride, int max_positions, int n_threads) {
    int kv_mul = n_heads / n_kv_heads;
    size_t q_dim = (size_t)n_heads * head_dim;
    size_t head_stride = round_up16((size_t)max_positions);  /* one row of scores per query head */
    float scale = 1.0f / sqrtf((float)head_dim);

    /* One iteration per (token, KV head): the kv_mul query heads that share a KV head are
     * done together, so each key and value row is read from memory (and dequantized)
     * once for all of them (the point of grouped-query attention), not once per head. */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads) \
        if ((long)n_tokens * n_heads * (start_pos + n_tokens) * head_dim >= KV_PARALLEL_MIN_WORK \
            && (long)n_tokens * n_kv_heads > 1)
    for (int t = 0; t < n_tokens; t++) {
        for (int g = 0; g < n_kv_heads; g++) {
            int query_pos = start_pos + t;
            int n_seen = query_pos + 1;              /* positions 0 .. its own */
            /* the group's query heads are consecutive: heads g*kv_mul .. g*kv_mul + kv_mul-1 */
            const float *queries = q + t * q_dim + (size_t)g * kv_mul * head_dim;
            float *att = scratch + (size_t)omp_get_thread_num() * scratch_stride;
            float *buffer = att + (size_t)kv_mul * head_stride;

            /* how well each query matches every earlier key (and its own) */
            for (int first = 0; first < n_seen; first += view->block_size) {
                int rows = n_seen - first < view->block_size ? n_seen - first : view->block_size;
                size_t slot = kv_view_slot(view, first);   /* one table lookup per block */
                for (int pos = first; pos < first + rows; pos++, slot++) {
                    const float *key = head_row(view, 0, pos, slot, query_pos, g, head_dim, buffer);
                    for (int m = 0; m < kv_mul; m++)
                        att[(size_t)m * head_stride + pos] =
                            kv_dot(queries + (size_t)m * head_dim, key, head_dim) * scale;
                }
            }
            for (int m = 0; m < kv_mul; m++) kv_softmax(att + (size_t)m * head_stride, n_seen);

            /* the weighted mix of their values */
            float *results = out + t * q_dim + (size_t)g * kv_mul * head_dim;
            memset(results, 0, (size_t)kv_mul * head_dim * sizeof(float));
            for (int first = 0; first < n_seen; first += view->block_size) {
                int rows = n_seen - first < view->block_size ? n_seen - first : view->block_size;
                size_t slot = kv_view_slot(view, first);
                for (int pos = first; pos < first + rows; pos++, slot++) {
                    const float *value = head_row(view, 1, pos, slot, query_pos, g, head_dim,
                                                  buffer + round_up16((size_t)head_dim));
                    for (int m = 0; m < kv_mul; m++)
                        kv_axpy(results + (size_t)m * head_dim,
                                att[(size_t)m * head_stride + pos], value, head_dim);
                }
            }
        }
    }
}
