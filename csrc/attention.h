/* attention.h: causal grouped-query attention over a cache, contiguous or paged (internal).
 *
 * Both caches are seen through one kv_layer_view: a sequence's positions live in
 * blocks of block_size rows, found through a block table, and the rows are kept in a
 * kv_store in any element format. The contiguous cache is the special case of a single
 * block as long as the whole cache, whose rows may start anywhere in it and run round
 * its end to its beginning (a ring, once a sliding window has dropped rows).
 */
#ifndef KVLAB_ATTENTION_H
#define KVLAB_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "kvlab.h"

/* One layer of one sequence's cache. Position pos (row pos of the cache, in the order
 * attention visits its rows) lives in slot
 *   block_table[at / block_size] * block_size + at % block_size,  at = pos + start,
 * of the layer's key and value stores. start is 0 but for a contiguous cache whose rows
 * form a ring (kv_cache_keep): its block table names its one block twice, so that the rows
 * past the end of its memory go on at its beginning. With a residual window, a query at position i
 * reads positions i - window + 1 .. i in full precision instead: the positions written
 * by this call from new_key/new_value (rows from position new_start on), older ones from
 * the window rows (position p in row p % window). */
typedef struct {
    const kv_store *key, *value;
    int layer;
    const int32_t *block_table;
    int block_size;
    int start;                 /* slots of the first block before row 0 (a ring's start) */
    int window;
    float *window_key, *window_value;         /* (window, kv_dim), or NULL */
    const float *new_key, *new_value;         /* (n_tokens, kv_dim) of this call, or NULL */
    int new_start;
    float *attention;          /* (n_kv_heads, block_size) weights each slot's row received, to
                                  add this call's to (a contiguous cache that tracks them), or
                                  NULL */
    float *attention_scratch;  /* (block_size + head_dim) floats, with attention */
} kv_layer_view;

/* [quote ch04-kv-view-slot] */
static inline size_t kv_view_slot(const kv_layer_view *view, int pos) {
    int at = pos + view->start;
    return (size_t)view->block_table[at / view->block_size] * (size_t)view->block_size +
           (size_t)(at % view->block_size);
}
/* [end ch04-kv-view-slot] */

/* The first position after pos that is not in pos's block: positions pos .. that - 1 lie in
 * consecutive slots of the store. */
static inline int kv_view_block_end(const kv_layer_view *view, int pos) {
    return pos + view->block_size - (pos + view->start) % view->block_size;
}

/* The view of one layer of a contiguous cache (kvcache.c); the paged pool's is in paged.h. */
kv_layer_view kv_cache_layer_view(const kv_cache *cache, int layer);
/* After a forward call wrote n_tokens rows from row cache->length on, at the next positions:
 * records their positions (if the cache keeps them) and advances length and next_position. */
void kv_cache_note_appended(kv_cache *cache, int n_tokens);

/* For each of n_tokens new queries, at positions start_pos .. start_pos + n_tokens - 1,
 * attends over positions 0 .. its own position (the causal mask). q and out are
 * (n_tokens, n_heads * head_dim); the view already holds the new tokens' K and V.
 * scratch holds n_threads rows of scratch_stride floats, one per thread: for each query
 * head of a group, for each token of a block of a few tokens attended together, a tile of
 * weights (KV_ATTENTION_TILE, below), a running max and a running sum; then a tile of head
 * rows to decode keys or values into when they cannot be read in place; then the block's
 * queries and outputs. Its size does not depend on the context length. */
void kv_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                  int start_pos, int n_heads, int n_kv_heads, int head_dim, float *scratch,
                  size_t scratch_stride, int n_threads);

/* Adds to view->attention the weight each new query (n_tokens of them, at rows start_pos
 * on, q as for kv_attention) gives every row it sees, summed over the query heads that
 * share a KV head: the softmax of kv_attention again, as plain loops (attention_weights.c),
 * for the eviction policies that keep the rows attended most. The new rows start at 0. */
void kv_attention_weights_add(const kv_layer_view *view, const float *q, int n_tokens,
                              int start_pos, int n_heads, int n_kv_heads, int head_dim);

/* Positions attention takes at a time: a tile of keys scored, one online-softmax step
 * (kv_softmax_tile, ops.h, takes up to 16 scores), the tile of values mixed. Counted from
 * position 0 on every path. The bandwidth probe's walk (bandwidth.c) reads the same tiles. */
#define KV_ATTENTION_TILE 16

/* Floats of scratch each thread needs (the scratch_stride above). */
size_t kv_attention_scratch(int n_heads, int n_kv_heads, int head_dim);

#endif /* KVLAB_ATTENTION_H */
