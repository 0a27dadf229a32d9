/* kvcache.c: the contiguous KV cache, one block of memory per request.
 *
 * Layout (n_layers, n_kv_heads, capacity, head_dim) for K and again for V, each in its
 * own element format (store.c): one KV head's keys for consecutive positions are
 * consecutive rows, so attention streams one head's keys front to back. (Python's
 * cache.keys shows the same memory as (n_layers, length, n_kv_heads, head_dim).) The whole
 * capacity is reserved up front; that waste is exactly what the paged pool (paged.c)
 * exists to remove. A residual window keeps the last few positions in float32 as well, in
 * a ring of its own (position p in row p % window).
 *
 * Once rows are dropped (kv_cache_keep) the rows are a ring: row 0 is in slot ring_start
 * and row i in slot (ring_start + i) % capacity, so that a sliding window drops its oldest
 * row by turning the ring one slot on instead of moving every row it keeps one slot down.
 * Attention and the forward pass find rows through the layer view (attention.h), which
 * knows the ring; cache.keys turns it back (kv_cache_straighten) to show rows in order.
 */
#include <string.h>

#include "attention.h"
#include "common.h"
#include "plain.h"
#include "store.h"

static const kv_cache_format fp32_format = {KV_FMT_F32, KV_FMT_F32, 0, 0, 0};

kv_status kv_cache_init(kv_cache *cache, int n_layers, int n_kv_heads, int head_dim,
                        int capacity, const kv_cache_format *format) {
    kv_status status = KV_OK;
    memset(cache, 0, sizeof *cache);
    if (format == NULL) format = &fp32_format;
    KV_CHECK(n_layers > 0 && n_kv_heads > 0 && head_dim > 0 && capacity > 0,
             KV_ERR_INVALID_ARG);
    KV_CHECK(n_layers <= KV_MAX_LAYERS && (int64_t)n_kv_heads * head_dim <= KV_MAX_WIDTH &&
             capacity <= KV_MAX_POSITIONS && format->window >= 0 &&
             format->window <= capacity, KV_ERR_INVALID_ARG);
    cache->n_layers = n_layers;
    cache->n_kv_heads = n_kv_heads;
    cache->head_dim = head_dim;
    cache->capacity = capacity;
    cache->length = 0;
    KV_TRY(kv_store_init(&cache->key, format->key_format, format->key_group, n_layers,
                         (size_t)capacity, n_kv_heads, head_dim));
    KV_TRY(kv_store_init(&cache->value, format->value_format, format->value_group, n_layers,
                         (size_t)capacity, n_kv_heads, head_dim));
    cache->window = format->window;
    if (cache->window > 0) {
        size_t floats = (size_t)n_layers * cache->window * n_kv_heads * head_dim;
        cache->window_key = kv_alloc_floats(floats);
        cache->window_value = kv_alloc_floats(floats);
        KV_CHECK(cache->window_key != NULL && cache->window_value != NULL, KV_ERR_NOMEM);
    }
    return KV_OK;
fail:
    kv_cache_free(cache);
    return status;
}

void kv_cache_free(kv_cache *cache) {
    if (cache == NULL) return;
    kv_store_free(&cache->key);
    kv_store_free(&cache->value);
    free(cache->window_key);
    free(cache->window_value);
    free(cache->positions);
    free(cache->attention);
    free(cache->attention_scratch);
    cache->window_key = cache->window_value = NULL;
    cache->positions = NULL;
    cache->attention = cache->attention_scratch = NULL;
    cache->length = cache->capacity = cache->window = cache->next_position = 0;
    cache->ring_start = 0;
}

static size_t kv_dim(const kv_cache *cache) {
    return (size_t)cache->n_kv_heads * cache->head_dim;
}

/* this layer's ring of residual window rows */
static float *window_rows(float *rows, const kv_cache *cache, int layer) {
    return rows + (size_t)layer * cache->window * kv_dim(cache);
}

size_t kv_cache_nbytes(const kv_cache *cache) {
    size_t window_bytes = 2 * (size_t)cache->n_layers * cache->window * kv_dim(cache) * sizeof(float);
    return kv_store_nbytes(&cache->key) + kv_store_nbytes(&cache->value) + window_bytes;
}

size_t kv_cache_slot(const kv_cache *cache, int row) {
    int at = cache->ring_start + row;
    return (size_t)(at < cache->capacity ? at : at - cache->capacity);
}

/* Index of slot `slot` of (layer, head) in positions and attention */
static size_t slot_index(const kv_cache *cache, int layer, int head, size_t slot) {
    return ((size_t)layer * cache->n_kv_heads + head) * (size_t)cache->capacity + slot;
}

/* ... and of row `row` */
static size_t row_index(const kv_cache *cache, int layer, int head, int row) {
    return slot_index(cache, layer, head, kv_cache_slot(cache, row));
}

/* [quote ch09-kv-cache-truncate] */
kv_status kv_cache_truncate(kv_cache *cache, int length) {
    /* Rows past `length` become free again; their bytes are simply overwritten by the
     * next tokens, since attention never reads past cache->length. */
    if (length < 0 || length > cache->length) return KV_ERR_INVALID_ARG;
    if (cache->window > 0 && length != 0 && length != cache->length) return KV_ERR_INVALID_ARG;
    int cut = cache->length - length;
    if (length > 0 && cut > 0 && cache->positions != NULL) {
        /* only the newest positions can be taken back, or next_position would lie */
        int first_cut = cache->next_position - cut;
        for (int layer = 0; layer < cache->n_layers; layer++)
            for (int head = 0; head < cache->n_kv_heads; head++)
                for (int row = length; row < cache->length; row++)
                    if (cache->positions[row_index(cache, layer, head, row)] !=
                        first_cut + (row - length))
                        return KV_ERR_INVALID_ARG;
    }
    cache->length = length;
    cache->next_position = length == 0 ? 0 : cache->next_position - cut;
    if (length == 0) cache->ring_start = 0;
    return KV_OK;
}
/* [end ch09-kv-cache-truncate] */

/* The n_tokens rows from row cache->length on were just written, at the next positions. */
void kv_cache_note_appended(kv_cache *cache, int n_tokens) {
    for (int layer = 0; layer < cache->n_layers && cache->positions != NULL; layer++)
        for (int head = 0; head < cache->n_kv_heads; head++)
            for (int t = 0; t < n_tokens; t++)
                cache->positions[row_index(cache, layer, head, cache->length + t)] =
                    cache->next_position + t;
    cache->length += n_tokens;
    cache->next_position += n_tokens;
}

/* Row `from` of (layer, head) moves to row `to`: its K, V, position and attention sum. */
static void move_row(kv_cache *cache, int layer, int head, int to, int from) {
    size_t dst = kv_cache_slot(cache, to), src = kv_cache_slot(cache, from);
    kv_store_copy_head(&cache->key, layer, head, dst, src, 1);
    kv_store_copy_head(&cache->value, layer, head, dst, src, 1);
    size_t a = slot_index(cache, layer, head, dst), b = slot_index(cache, layer, head, src);
    cache->positions[a] = cache->positions[b];
    if (cache->attention != NULL) cache->attention[a] = cache->attention[b];
}

/* [quote ch08-kv-cache-keep] */
/* How far the ring turns when the rows `rows` (KEPT below) stay: by none of the dropped
 * rows, the kept ones moving to the front, or by all of them, the kept ones moving to the
 * back, whichever leaves more rows where they are. A sliding window keeps the newest rows:
 * turned by all, it moves none. Attention sinks keep a few first rows and the newest: the
 * few move. */
static int ring_turn(const kv_cache *cache, int n_keep, const int32_t *rows) {
    /* (the paged pool's keep chooses the same way: store.c) */
    return kv_rows_turn(rows, cache->n_layers, n_keep, cache->n_kv_heads, cache->length);
}

kv_status kv_cache_keep(kv_cache *cache, int n_keep, const int32_t *rows) {
    if (cache->key.codes == NULL || n_keep < 0 || n_keep > cache->length ||
        (rows == NULL && n_keep > 0) || cache->window > 0)
        return KV_ERR_INVALID_ARG;
    int n_heads = cache->n_kv_heads;
    /* rows[layer][i][head]: the i-th row this (layer, head) keeps */
#define KEPT(layer, i, head) rows[((size_t)(layer) * n_keep + (i)) * n_heads + (head)]
    if (!kv_rows_to_keep_valid(rows, cache->n_layers, n_keep, n_heads, cache->length))
        return KV_ERR_INVALID_ARG;
    if (cache->positions == NULL) {   /* from now on row i need not hold position i */
        cache->positions = malloc(slot_index(cache, cache->n_layers, 0, 0) * sizeof(int32_t));
        if (cache->positions == NULL) return KV_ERR_NOMEM;
        for (int layer = 0; layer < cache->n_layers; layer++)
            for (int head = 0; head < n_heads; head++)
                for (int row = 0; row < cache->length; row++)
                    cache->positions[row_index(cache, layer, head, row)] = row;
    }
    /* Kept row i becomes row i + turn, and the ring turns by `turn` slots after: row 0 is
     * then what row `turn` was. turn 0: rows only move towards the front, and row i comes
     * from a row at or after i, so front to back no row is overwritten before it is read.
     * turn = every dropped row: rows only move towards the back, so back to front. */
    int turn = ring_turn(cache, n_keep, rows);
    for (int layer = 0; layer < cache->n_layers; layer++)
        for (int head = 0; head < n_heads; head++)
            for (int k = 0; k < n_keep; k++) {
                int i = turn == 0 ? k : n_keep - 1 - k;
                if (KEPT(layer, i, head) != i + turn)
                    move_row(cache, layer, head, i + turn, KEPT(layer, i, head));
            }
#undef KEPT
    cache->ring_start = (int)kv_cache_slot(cache, turn);
    cache->length = n_keep;   /* next_position stays: the next token comes after them all */
    return KV_OK;
}
/* [end ch08-kv-cache-keep] */

kv_status kv_cache_track_attention(kv_cache *cache, int on) {
    if (cache->key.codes == NULL || cache->window > 0) return KV_ERR_INVALID_ARG;
    if (!on) {
        free(cache->attention);
        free(cache->attention_scratch);
        cache->attention = cache->attention_scratch = NULL;
        return KV_OK;
    }
    float *sums = cache->attention;
    float *scratch = cache->attention_scratch;
    if (sums == NULL) sums = kv_alloc_floats(slot_index(cache, cache->n_layers, 0, 0));
    if (scratch == NULL) scratch = kv_alloc_floats((size_t)cache->capacity + cache->head_dim);
    if (sums == NULL || scratch == NULL) {
        if (sums != cache->attention) free(sums);
        if (scratch != cache->attention_scratch) free(scratch);
        return KV_ERR_NOMEM;
    }
    memset(sums, 0, slot_index(cache, cache->n_layers, 0, 0) * sizeof(float));
    cache->attention = sums;
    cache->attention_scratch = scratch;
    return KV_OK;
}

/* [quote ch01-kv-cache-append] */
kv_status kv_cache_append(kv_cache *cache, int n_tokens, const float *keys, const float *values) {
    if (cache->key.codes == NULL || keys == NULL || values == NULL || n_tokens <= 0)
        return KV_ERR_INVALID_ARG;
    if (n_tokens > cache->capacity - cache->length) return KV_ERR_CACHE_FULL;
    size_t row = kv_dim(cache), token_stride = (size_t)cache->n_layers * row;
    for (int layer = 0; layer < cache->n_layers; layer++) {
        for (int t = 0; t < n_tokens; t++) {
            size_t src = ((size_t)t * cache->n_layers + layer) * row;
            size_t slot = kv_cache_slot(cache, cache->length + t);
            kv_store_write(&cache->key, layer, slot, keys + src);
            kv_store_write(&cache->value, layer, slot, values + src);
            for (int head = 0; head < cache->n_kv_heads && cache->attention != NULL; head++)
                cache->attention[row_index(cache, layer, head, cache->length + t)] = 0.0f;
        }
        kv_window_keep(window_rows(cache->window_key, cache, layer), cache->window, (int)row,
                       cache->length, keys + layer * row, token_stride, n_tokens);
        kv_window_keep(window_rows(cache->window_value, cache, layer), cache->window, (int)row,
                       cache->length, values + layer * row, token_stride, n_tokens);
    }
    kv_cache_note_appended(cache, n_tokens);
    return KV_OK;
}
/* [end ch01-kv-cache-append] */

kv_status kv_cache_read(const kv_cache *cache, float *keys, float *values) {
    if (cache->key.codes == NULL || keys == NULL || values == NULL) return KV_ERR_INVALID_ARG;
    size_t row = kv_dim(cache);
    for (int layer = 0; layer < cache->n_layers; layer++) {
        for (int pos = 0; pos < cache->length; pos++) {
            size_t dst = ((size_t)layer * cache->length + pos) * row;
            if (cache->window > 0 && pos >= cache->length - cache->window) {
                memcpy(keys + dst, kv_window_row(window_rows(cache->window_key, cache, layer),
                                                 cache->window, (int)row, pos), row * sizeof(float));
                memcpy(values + dst, kv_window_row(window_rows(cache->window_value, cache, layer),
                                                   cache->window, (int)row, pos), row * sizeof(float));
            } else {
                kv_store_read(&cache->key, layer, kv_cache_slot(cache, pos), keys + dst);
                kv_store_read(&cache->value, layer, kv_cache_slot(cache, pos), values + dst);
            }
        }
    }
    return KV_OK;
}

/* [quote ch04-kv-cache-layer-view] */
kv_layer_view kv_cache_layer_view(const kv_cache *cache, int layer) {
    /* the contiguous cache is one big block, named twice: a ring's rows run past its end
     * on to its beginning */
    static const int32_t one_block_twice[2] = {0, 0};
    kv_layer_view view = {.key = &cache->key, .value = &cache->value, .layer = layer,
                          .block_table = one_block_twice, .block_size = cache->capacity,
                          .start = cache->ring_start, .window = cache->window,
                          .new_start = cache->length};
    if (cache->window > 0) {
        view.window_key = window_rows(cache->window_key, cache, layer);
        view.window_value = window_rows(cache->window_value, cache, layer);
    }
    if (cache->attention != NULL) {
        view.attention = cache->attention + slot_index(cache, layer, 0, 0);
        view.attention_scratch = cache->attention_scratch;
    }
    return view;
}
/* [end ch04-kv-cache-layer-view] */

kv_status kv_cache_straighten(kv_cache *cache) {
    if (cache->key.codes == NULL) return KV_ERR_INVALID_ARG;
    if (cache->ring_start == 0) return KV_OK;
    size_t by = (size_t)cache->ring_start, n = (size_t)cache->capacity;
    size_t rings = (size_t)cache->n_layers * cache->n_kv_heads;
    size_t widest = sizeof(float);   /* a position or an attention sum, or a part of a row */
    if (kv_store_widest(&cache->key) > widest) widest = kv_store_widest(&cache->key);
    if (kv_store_widest(&cache->value) > widest) widest = kv_store_widest(&cache->value);
    uint8_t *spare = malloc(by * widest);
    if (spare == NULL) return KV_ERR_NOMEM;
    kv_store_turn(&cache->key, by, spare);
    kv_store_turn(&cache->value, by, spare);
    if (cache->positions != NULL)   /* (it is: only keep turns the ring, and it makes them) */
        kv_turn_rings(cache->positions, rings, n, sizeof(int32_t), by, spare);
    if (cache->attention != NULL) kv_turn_rings(cache->attention, rings, n, sizeof(float), by, spare);
    free(spare);
    cache->ring_start = 0;
    return KV_OK;
}

kv_status kv_cache_attend(const kv_cache *cache, int layer, const float *q, int n_heads,
                          float *out) {
    kv_status status = KV_OK;
    float *scratch = NULL;
    KV_CHECK(cache->key.codes != NULL && q != NULL && out != NULL && cache->length > 0 &&
             layer >= 0 && layer < cache->n_layers && n_heads > 0 &&
             n_heads % cache->n_kv_heads == 0 &&
             (int64_t)n_heads * cache->head_dim <= KV_MAX_WIDTH, KV_ERR_INVALID_ARG);
    int n_threads = kv_threads();
    size_t stride = kv_attention_scratch(n_heads, cache->n_kv_heads, cache->head_dim);
    scratch = kv_alloc_floats((size_t)n_threads * stride);
    KV_CHECK(scratch != NULL, KV_ERR_NOMEM);
    /* q is the query of the last cached token: it sees every position, itself included */
    kv_layer_view view = kv_cache_layer_view(cache, layer);
    if (kv_get_kernels() == KV_KERNELS_PLAIN)
        kv_plain_attention(out, q, &view, 1, cache->length - 1, n_heads, cache->n_kv_heads,
                           cache->head_dim, scratch, stride, n_threads);
    else
        kv_attention(out, q, &view, 1, cache->length - 1, n_heads, cache->n_kv_heads,
                     cache->head_dim, scratch, stride, n_threads);
fail:
    free(scratch);
    return status;
}

kv_status kv_cache_check_fits(const kv_cache *cache, const kv_config *config) {
    if (cache->key.codes == NULL || cache->n_layers != config->n_layers ||
        cache->n_kv_heads != config->n_kv_heads || cache->head_dim != config->head_dim)
        return KV_ERR_CACHE_MISMATCH;
    return KV_OK;
}
