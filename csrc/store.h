/* store.h: writing K or V rows into a kv_store and reading them back (internal).
 *
 * A kv_store (kvlab.h) is where one kind of tensor lives in a cache: codes, plus scales
 * and zero points for the integer and fp8 formats. Writing a row quantizes it (the
 * moment a token's K and V are computed); reading dequantizes it, one head at a time, on
 * the fly inside attention, so no full-precision copy of a quantized cache ever exists.
 */
#ifndef KVLAB_STORE_H
#define KVLAB_STORE_H

#include <stddef.h>

#include "kvlab.h"

/* The group size a format uses in a head of head_dim values (0 picks the default), or -1
 * if the group does not suit it: it must divide head_dim (and be even for int4). */
int kv_store_group(kv_format format, int group, int head_dim);

/* Allocates zeroed storage for n_layers x slots rows of n_kv_heads * head_dim values. */
kv_status kv_store_init(kv_store *store, kv_format format, int group, int n_layers,
                        size_t slots, int n_kv_heads, int head_dim);
/* The same checks and fields, no memory (codes, scales and zeros NULL): a store whose rows
 * are elsewhere (a pool's row store), or whose memory the caller points at. */
kv_status kv_store_describe(kv_store *store, kv_format format, int group, int n_layers,
                            size_t slots, int n_kv_heads, int head_dim);
void kv_store_free(kv_store *store);   /* accepts a zeroed or half-built store */
size_t kv_store_nbytes(const kv_store *store);
/* Bytes one row takes: codes, scales and zero points. */
size_t kv_store_row_nbytes(const kv_store *store);

/* Index of the head row (layer, head, slot): its codes start at codes + index *
 * head_bytes, its scales at scales + index * groups_per_head. */
static inline size_t kv_store_head_index(const kv_store *store, int layer, int head,
                                         size_t slot) {
    return ((size_t)layer * store->n_kv_heads + head) * store->slots + slot;
}

/* Quantizes one row of n_kv_heads * head_dim float32 values into (layer, slot). */
void kv_store_write(const kv_store *store, int layer, size_t slot, const float *row);

/* Dequantizes the row at (layer, slot) into n_kv_heads * head_dim floats. */
void kv_store_read(const kv_store *store, int layer, size_t slot, float *row);

/* One head of the row at (layer, slot) as float32: a pointer into the store itself for
 * fp32, else the head dequantized into buffer (head_dim floats). */
const float *kv_store_head(const kv_store *store, int layer, size_t slot, int head,
                           float *buffer);

/* Copies n_rows rows (codes, scales, zero points) of one KV head from slot src to slot dst
 * of a layer; the two ranges may overlap. */
void kv_store_copy_head(const kv_store *store, int layer, int head, size_t dst, size_t src,
                        size_t n_rows);

/* Copies n_rows rows (codes, scales, zero points) from slot src to slot dst of a layer. */
void kv_store_copy(const kv_store *store, int layer, size_t dst, size_t src, size_t n_rows);

/* Turns each of n_rings rings of ring_length elements of `size` bytes, one after another
 * from base, by `by` elements: element `by` comes first, and the `by` before it go last.
 * spare holds by * size bytes. */
void kv_turn_rings(void *base, size_t n_rings, size_t ring_length, size_t size, size_t by,
                   void *spare);

/* Turns every (layer, head)'s slots of a store (codes, scales, zero points) by `by`: slot
 * `by` becomes slot 0 (a contiguous cache's ring put back in order, kv_cache_straighten).
 * spare holds by * kv_store_widest(store) bytes. */
void kv_store_turn(const kv_store *store, size_t by, void *spare);
/* Bytes of the widest part of one head row: its codes, or its scales. */
size_t kv_store_widest(const kv_store *store);

/* Whether rows, (n_layers, n_keep, n_kv_heads), names rows a cache or sequence of `length`
 * rows can keep (kv_cache_keep, kv_pool_keep): in each layer and head, row numbers that
 * only go up and stay below length. */
int kv_rows_to_keep_valid(const int32_t *rows, int n_layers, int n_keep, int n_kv_heads,
                          int length);

/* Where the kept rows go, for as few of them as possible to move: kept row i becomes row
 * i + turn, and the rows before `turn` are dropped (a contiguous cache's ring turns past
 * them, a paged sequence's first row moves past them). turn is 0, the kept rows moving to
 * the front, or every dropped row (length - n_keep), the kept rows moving to the back,
 * whichever leaves more of them where they are. A sliding window keeps the newest rows:
 * turned by all, none moves. Attention sinks keep a few first rows and the newest: the few
 * move. rows as kv_rows_to_keep_valid takes them, valid. */
int kv_rows_turn(const int32_t *rows, int n_layers, int n_keep, int n_kv_heads, int length);

/* The residual window keeps full-precision rows of a sequence's last `window` positions
 * in a ring of `window` rows per layer: position pos lives in row pos % window. */
static inline float *kv_window_row(float *ring, int window, int kv_dim, int pos) {
    return ring + (size_t)(pos % window) * (size_t)kv_dim;
}

/* Keeps the last `window` of n_tokens new rows (row t is position first_pos + t, found
 * at rows + t * row_stride) in the ring: the older rows of a call are never read at full
 * precision again, so only the last window of them are copied. */
void kv_window_keep(float *ring, int window, int kv_dim, int first_pos, const float *rows,
                    size_t row_stride, int n_tokens);

#endif /* KVLAB_STORE_H */
