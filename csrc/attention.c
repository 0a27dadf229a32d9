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

/* Rows are read TILE at a time: a tile of dequantized head rows (16 x 128 floats = 8 KiB
 * for a typical head) stays in the L1 cache while every query head of the group uses it. */
#define TILE 16

size_t kv_attention_scratch(int n_heads, int n_kv_heads, int head_dim, int max_positions) {
    return (size_t)(n_heads / n_kv_heads) * round_up16((size_t)max_positions) +
           TILE * round_up16((size_t)head_dim);
}

/* int8 head rows decoded inline: the hottest loop of a quantized cache's attention, and
 * small enough that a call and its setup would cost as much as the work. The values are
 * exactly kv_dequantize_i8's (csrc/quant.c): code times its group's scale. */
static inline void decode_i8(float *restrict out, const int8_t *restrict codes,
                             const float *restrict scales, int head_dim, int group) {
    for (int g = 0; g < head_dim / group; g++) {
        float scale = scales[g];
        for (int i = g * group; i < (g + 1) * group; i++) out[i] = (float)codes[i] * scale;
    }
}

/* Head `head` of n consecutive positions pos .. pos + n - 1 (slots slot .. slot + n - 1
 * of one block) as float32 rows of head_dim, as a query at query_pos reads them: fp32
 * rows in place, quantized rows decoded into tile, and rows inside the residual window
 * copied from the full-precision rows instead. */
static const float *head_rows(const kv_layer_view *view, int is_value, int head, int pos,
                              size_t slot, int n, int query_pos, int head_dim, float *tile) {
    const kv_store *store = is_value ? view->value : view->key;
    int kv_dim = store->n_kv_heads * head_dim;
    int first_exact = view->window > 0 ? query_pos - view->window + 1 : query_pos + 1;
    if (store->format == KV_FMT_F32 && pos + n <= first_exact)
        return kv_store_head(store, view->layer, slot, head, NULL);   /* n rows in a row */
    for (int r = 0; r < n; r++) {
        float *row = tile + (size_t)r * head_dim;
        const float *source;
        if (pos + r < first_exact && store->format == KV_FMT_I8) {
            size_t index = kv_store_head_index(store, view->layer, head, slot + r);
            decode_i8(row, (const int8_t *)store->codes + index * store->head_bytes,
                      store->scales + index * store->groups_per_head, head_dim, store->group);
            source = row;
        } else if (pos + r < first_exact) {
            source = kv_store_head(store, view->layer, slot + r, head, row);
        } else if (pos + r >= view->new_start) {   /* written by this call */
            source = (is_value ? view->new_value : view->new_key) +
                     (size_t)(pos + r - view->new_start) * kv_dim + (size_t)head * head_dim;
        } else {
            source = (is_value ? view->window_value : view->window_key) +
                     (size_t)((pos + r) % view->window) * kv_dim + (size_t)head * head_dim;
        }
        if (source != row) memcpy(row, source, (size_t)head_dim * sizeof(float));
    }
    return tile;
}

/* out_m += sum over the n rows of p_m[r] * row[r], for each of kv_mul query heads. Each
 * output element adds the rows in order, exactly as one axpy per row would, but keeps
 * its running sum in a register across the tile instead of memory. */
static void mix_values(float *results, const float *att, size_t head_stride, int pos,
                       const float *rows, int n, int kv_mul, int head_dim) {
    int d8 = head_dim & ~7;
    for (int m = 0; m < kv_mul; m++) {
        const float *p = att + (size_t)m * head_stride + pos;
        float *out = results + (size_t)m * head_dim;
        for (int i = 0; i < d8; i += 8) {
            v8f acc = load8(out + i);
            for (int r = 0; r < n; r++) acc += p[r] * load8(rows + (size_t)r * head_dim + i);
            memcpy(out + i, &acc, sizeof acc);
        }
        for (int i = d8; i < head_dim; i++) {
            float acc = out[i];
            for (int r = 0; r < n; r++) acc += p[r] * rows[(size_t)r * head_dim + i];
            out[i] = acc;
        }
    }
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
            float *tile = att + (size_t)kv_mul * head_stride;

            /* how well each query matches every earlier key (and its own): block by
             * block (one table lookup each), a tile of rows at a time */
            for (int first = 0; first < n_seen; first += view->block_size) {
                int in_block = n_seen - first < view->block_size ? n_seen - first : view->block_size;
                size_t slot = kv_view_slot(view, first);
                for (int r0 = 0; r0 < in_block; r0 += TILE) {
                    int n = in_block - r0 < TILE ? in_block - r0 : TILE;
                    const float *keys = head_rows(view, 0, g, first + r0, slot + r0, n,
                                                  query_pos, head_dim, tile);
                    for (int r = 0; r < n; r++)
                        for (int m = 0; m < kv_mul; m++)
                            att[(size_t)m * head_stride + first + r0 + r] =
                                kv_dot(queries + (size_t)m * head_dim,
                                       keys + (size_t)r * head_dim, head_dim) * scale;
                }
            }
            for (int m = 0; m < kv_mul; m++) kv_softmax(att + (size_t)m * head_stride, n_seen);

            /* the weighted mix of their values */
            float *results = out + t * q_dim + (size_t)g * kv_mul * head_dim;
            memset(results, 0, (size_t)kv_mul * head_dim * sizeof(float));
            for (int first = 0; first < n_seen; first += view->block_size) {
                int in_block = n_seen - first < view->block_size ? n_seen - first : view->block_size;
                size_t slot = kv_view_slot(view, first);
                for (int r0 = 0; r0 < in_block; r0 += TILE) {
                    int n = in_block - r0 < TILE ? in_block - r0 : TILE;
                    const float *values = head_rows(view, 1, g, first + r0, slot + r0, n,
                                                    query_pos, head_dim, tile);
                    mix_values(results, att, head_stride, first + r0, values, n, kv_mul, head_dim);
                }
            }
        }
    }
}
