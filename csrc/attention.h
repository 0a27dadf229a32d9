/* attention.h: causal grouped-query attention over a cache, contiguous or paged (internal).
 *
 * Both caches are seen through one kv_layer_view: a sequence's positions live in
 * blocks of block_size rows, found through a block table. The contiguous cache is the
 * special case of a single block as long as the whole cache.
 */
#ifndef KVLAB_ATTENTION_H
#define KVLAB_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* One layer of one sequence's cache. Row r of logical block b (positions
 * b*block_size .. b*block_size + block_size - 1) holds n_kv_heads * head_dim floats at
 *   key   + block_table[b] * block_stride + r * kv_dim     (and the same for value). */
typedef struct {
    float *key;
    float *value;
    const int32_t *block_table;
    int block_size;
    size_t block_stride;  /* floats from one physical block to the next */
} kv_layer_view;

/* Where position pos's key row lives (value: same offset from view->value). */
static inline size_t kv_view_offset(const kv_layer_view *view, int pos, int kv_dim) {
    int block = pos / view->block_size, row = pos % view->block_size;
    return (size_t)view->block_table[block] * view->block_stride + (size_t)row * kv_dim;
}

/* For each of n_tokens new queries, at positions start_pos .. start_pos + n_tokens - 1,
 * attends over positions 0 .. its own position (the causal mask). q and out are
 * (n_tokens, n_heads * head_dim); the view already holds the new tokens' K and V.
 * scores is scratch of n_threads rows of score_stride floats, one per thread; a row
 * holds n_heads / n_kv_heads runs of score_stride / (n_heads / n_kv_heads) floats, one
 * per query head of a group, each at least start_pos + n_tokens long. */
void kv_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                  int start_pos, int n_heads, int n_kv_heads, int head_dim, float *scores,
                  size_t score_stride, int n_threads);

#endif /* KVLAB_ATTENTION_H */
