/* attention.c: causal grouped-query attention (MHA, GQA and MQA are one code path).
 *
 * Query head h reads key/value head h / kv_mul, where kv_mul = n_heads / n_kv_heads:
 * with kv_mul = 1 that is multi-head attention, with n_kv_heads = 1 multi-query.
 * Positions are visited block by block through the view's block table, each block a
 * contiguous run of rows, so the paged cache costs one table lookup per block, not per
 * token. Every (token, head) pair is computed the same way whether it arrives in a
 * prefill batch or alone in a decode step, and whichever cache holds its keys, so the
 * cached, uncached and paged paths agree bit for bit.
 */
#include <math.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "ops.h"

void kv_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                  int start_pos, int n_heads, int n_kv_heads, int head_dim, float *scores,
                  size_t score_stride, int n_threads) {
    int kv_mul = n_heads / n_kv_heads;
    size_t q_dim = (size_t)n_heads * head_dim;
    int kv_dim = n_kv_heads * head_dim;
    int block_size = view->block_size;
    size_t head_stride = score_stride / kv_mul;   /* one row of scores per query head */
    float scale = 1.0f / sqrtf((float)head_dim);

    /* One iteration per (token, KV head): the kv_mul query heads that share a KV head are
     * done together, so each key and value row is read from memory once for all of them
     * (the point of grouped-query attention), not once per query head. */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads) \
        if ((long)n_tokens * n_heads * (start_pos + n_tokens) * head_dim >= KV_PARALLEL_MIN_WORK \
            && (long)n_tokens * n_kv_heads > 1)
    for (int t = 0; t < n_tokens; t++) {
        for (int g = 0; g < n_kv_heads; g++) {
            int n_seen = start_pos + t + 1;          /* positions 0 .. its own */
            size_t head_offset = (size_t)g * head_dim;
            /* the group's query heads are consecutive: heads g*kv_mul .. g*kv_mul + kv_mul-1 */
            const float *queries = q + t * q_dim + (size_t)g * kv_mul * head_dim;
            float *att = scores + (size_t)omp_get_thread_num() * score_stride;

            /* how well each query matches every earlier key (and its own) */
            for (int first = 0; first < n_seen; first += block_size) {
                int rows = n_seen - first < block_size ? n_seen - first : block_size;
                const float *keys = view->key + kv_view_offset(view, first, kv_dim) + head_offset;
                for (int r = 0; r < rows; r++) {
                    const float *key = keys + (size_t)r * kv_dim;
                    for (int m = 0; m < kv_mul; m++)
                        att[(size_t)m * head_stride + first + r] =
                            kv_dot(queries + (size_t)m * head_dim, key, head_dim) * scale;
                }
            }
            for (int m = 0; m < kv_mul; m++) kv_softmax(att + (size_t)m * head_stride, n_seen);

            /* the weighted mix of their values */
            float *results = out + t * q_dim + (size_t)g * kv_mul * head_dim;
            memset(results, 0, (size_t)kv_mul * head_dim * sizeof(float));
            for (int first = 0; first < n_seen; first += block_size) {
                int rows = n_seen - first < block_size ? n_seen - first : block_size;
                const float *values = view->value + kv_view_offset(view, first, kv_dim) + head_offset;
                for (int r = 0; r < rows; r++) {
                    const float *value = values + (size_t)r * kv_dim;
                    for (int m = 0; m < kv_mul; m++)
                        kv_axpy(results + (size_t)m * head_dim,
                                att[(size_t)m * head_stride + first + r], value, head_dim);
                }
            }
        }
    }
}
