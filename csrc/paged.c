/* paged.c: the paged pool: a block manager and the K/V stores it indexes.
 *
 * Which block holds which positions of which sequence (block tables, reference counts,
 * copy-on-write, the prefix cache) is the block manager's business (blocks.c), and it
 * holds no K or V. This file owns the rows: two kv_stores whose slot b * block_size + r
 * is row r of block b, and each sequence's residual window of full-precision rows. It
 * performs the copies the block manager asks for and gives the forward pass a
 * kv_layer_view per layer (model.c, attention.c read blocks only through it).
 *
 * The same pool keeps the books of rows it cannot touch: those of a row store (kvlab.h),
 * GPU memory that kvlab._cuda reaches. Which slots a call writes or reads, which copies
 * copy-on-write needs, and what a refusal leaves unchanged are worked out here once, for
 * both; only the moving of rows differs (the *_rows helpers below: memcpy and the store.c
 * codecs on the host, the row store's functions elsewhere). The GPU runs its own forward
 * pass, over a batch this file reserves and commits (kv_pool_reserve_batch).
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "paged.h"
#include "store.h"

static size_t row_floats(const kv_pool *p) { return (size_t)p->n_kv_heads * p->head_dim; }

/* one sequence's ring of full-precision rows for one layer (the residual window) */
static float *window_rows(float *rows, const kv_pool *p, int seq, int layer) {
    return rows + ((size_t)seq * p->n_layers + layer) * p->window * row_floats(p);
}

static size_t window_floats_per_seq(const kv_pool *p) {
    return (size_t)p->n_layers * p->window * row_floats(p);
}

/* ---- setup --------------------------------------------------------------------------- */

kv_status kv_pool_init(kv_pool *pool, int n_layers, int n_kv_heads, int head_dim,
                       int num_blocks, int block_size, int max_seqs, int max_blocks_per_seq,
                       const kv_cache_format *format) {
    return kv_pool_init_with_store(pool, n_layers, n_kv_heads, head_dim, num_blocks, block_size,
                                   max_seqs, max_blocks_per_seq, format, NULL);
}

kv_status kv_pool_init_with_store(kv_pool *pool, int n_layers, int n_kv_heads, int head_dim,
                                  int num_blocks, int block_size, int max_seqs,
                                  int max_blocks_per_seq, const kv_cache_format *format,
                                  const kv_row_store *row_store) {
    static const kv_cache_format fp32_format = {KV_FMT_F32, KV_FMT_F32, 0, 0, 0};
    kv_status status = KV_OK;
    memset(pool, 0, sizeof *pool);
    if (format == NULL) format = &fp32_format;
    KV_CHECK(n_layers > 0 && n_kv_heads > 0 && head_dim > 0, KV_ERR_INVALID_ARG);
    /* a row store holds only what the stores' codecs make of a row, on its own */
    KV_CHECK(row_store == NULL || (format->window == 0 && format->key_format != KV_FMT_I4 &&
                                   format->value_format != KV_FMT_I4), KV_ERR_INVALID_ARG);
    KV_CHECK(n_layers <= KV_MAX_LAYERS && (int64_t)n_kv_heads * head_dim <= KV_MAX_WIDTH,
             KV_ERR_INVALID_ARG);
    KV_CHECK(format->window >= 0 && format->window <= (1 << 20), KV_ERR_INVALID_ARG);
    KV_TRY(kv_blocks_init(&pool->blocks, num_blocks, block_size, max_seqs, max_blocks_per_seq));
    /* a sequence's window rows are its own, so with a window no block may be shared by
     * its tokens (kvlab.h) */
    pool->blocks.prefix_cache = format->window == 0;
    pool->n_layers = n_layers;
    pool->n_kv_heads = n_kv_heads;
    pool->head_dim = head_dim;
    size_t slots = (size_t)num_blocks * block_size;
    /* rows in a row store: the stores only describe them */
    kv_status (*make_store)(kv_store *, kv_format, int, int, size_t, int, int) =
        row_store ? kv_store_describe : kv_store_init;
    KV_TRY(make_store(&pool->key, format->key_format, format->key_group, n_layers, slots,
                      n_kv_heads, head_dim));
    KV_TRY(make_store(&pool->value, format->value_format, format->value_group, n_layers,
                      slots, n_kv_heads, head_dim));
    pool->row_store = row_store;
    pool->window = format->window;
    if (pool->window > 0) {
        size_t floats = (size_t)max_seqs * window_floats_per_seq(pool);
        KV_CHECK(floats <= ((size_t)1 << 38), KV_ERR_NOMEM);
        pool->window_key = calloc(floats, sizeof(float));
        pool->window_value = calloc(floats, sizeof(float));
        KV_CHECK(pool->window_key != NULL && pool->window_value != NULL, KV_ERR_NOMEM);
    }
    return KV_OK;
fail:
    kv_pool_free(pool);
    return status;
}

void kv_pool_free(kv_pool *pool) {
    if (pool == NULL) return;
    kv_blocks_free(&pool->blocks);
    kv_store_free(&pool->key);
    kv_store_free(&pool->value);
    free(pool->window_key);
    free(pool->window_value);
    free(pool->positions);
    memset(pool, 0, sizeof *pool);
}

size_t kv_pool_nbytes(const kv_pool *pool) {
    size_t window_bytes = 2 * (size_t)pool->blocks.max_seqs * window_floats_per_seq(pool) *
                          sizeof(float);
    return kv_store_nbytes(&pool->key) + kv_store_nbytes(&pool->value) + window_bytes;
}

kv_status kv_pool_check_fits(const kv_pool *pool, const kv_config *config) {
    if (pool->key.codes == NULL || pool->n_layers != config->n_layers ||
        pool->n_kv_heads != config->n_kv_heads || pool->head_dim != config->head_dim)
        return KV_ERR_CACHE_MISMATCH;
    return KV_OK;
}

kv_status kv_pool_seq_fork(kv_pool *pool, int seq, int *child) {
    kv_status status = kv_blocks_seq_fork(&pool->blocks, seq, child);
    if (status != KV_OK) return status;
    if (pool->window > 0) {   /* the window's rows are the sequence's own: the child copies them */
        size_t floats = window_floats_per_seq(pool);
        memcpy(window_rows(pool->window_key, pool, *child, 0),
               window_rows(pool->window_key, pool, seq, 0), floats * sizeof(float));
        memcpy(window_rows(pool->window_value, pool, *child, 0),
               window_rows(pool->window_value, pool, seq, 0), floats * sizeof(float));
    }
    return KV_OK;
}

/* positions' index of (layer, head, slot) */
static size_t position_index(const kv_pool *p, int layer, int head, size_t slot) {
    return ((size_t)layer * p->n_kv_heads + head) * p->key.slots + slot;
}

int kv_pool_position(const kv_pool *pool, int seq, int layer, int head, int row) {
    const kv_seq *q = &pool->blocks.seqs[seq];
    if (!q->compacted) return row;
    kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
    return pool->positions[position_index(pool, layer, head, kv_view_slot(&view, row))];
}

kv_status kv_pool_truncate(kv_pool *pool, int seq, int length) {
    kv_status status = kv_blocks_seq_check(&pool->blocks, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->blocks.seqs[seq];
    int current = q->length;
    if (pool->window > 0 && length != 0 && length != current) return KV_ERR_INVALID_ARG;
    if (q->compacted && length > 0 && length <= current && q->reserved == 0) {
        /* only the newest positions can be taken back, or next_position would lie */
        int first_cut = q->next_position - (current - length);
        for (int layer = 0; layer < pool->n_layers; layer++)
            for (int head = 0; head < pool->n_kv_heads; head++)
                for (int row = length; row < current; row++)
                    if (kv_pool_position(pool, seq, layer, head, row) != first_cut + row - length)
                        return KV_ERR_INVALID_ARG;
    }
    return kv_blocks_truncate(&pool->blocks, seq, length);
}

void kv_pool_note_positions(kv_pool *pool, int seq, int n_tokens) {
    const kv_seq *q = &pool->blocks.seqs[seq];
    if (!q->compacted) return;     /* row i holds position i: nothing to write down */
    for (int layer = 0; layer < pool->n_layers; layer++) {
        kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
        for (int head = 0; head < pool->n_kv_heads; head++)
            for (int row = q->length - n_tokens; row < q->length; row++)
                pool->positions[position_index(pool, layer, head, kv_view_slot(&view, row))] =
                    q->next_position - (q->length - row);
    }
}

/* Row `from` of seq's (layer, head) moves to row `to` (of the view of seq's layer): its K,
 * V and position. */
static void move_row(kv_pool *pool, const kv_layer_view *view, int head, int to, int from) {
    size_t dst = kv_view_slot(view, to), src = kv_view_slot(view, from);
    kv_store_copy_head(&pool->key, view->layer, head, dst, src, 1);
    kv_store_copy_head(&pool->value, view->layer, head, dst, src, 1);
    pool->positions[position_index(pool, view->layer, head, dst)] =
        pool->positions[position_index(pool, view->layer, head, src)];
}

/* Whether kv_pool_keep may drop rows of seq: KV_OK, or why not (nothing is changed). */
static kv_status keep_allowed(const kv_pool *pool, int seq, int n_keep, const int32_t *rows) {
    kv_status status = kv_blocks_seq_check(&pool->blocks, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->blocks.seqs[seq];
    if (q->reserved > 0) return KV_ERR_PENDING;
    /* (a row store's rows hold positions 0 .. length - 1: the GPU's forward pass reads them so) */
    if (pool->window > 0 || pool->row_store || n_keep < 0 || n_keep > q->length ||
        (rows == NULL && n_keep > 0))
        return KV_ERR_INVALID_ARG;
    for (int i = 0; i < q->n_blocks; i++)     /* shared rows belong to the others too */
        if (pool->blocks.ref_count[q->block_table[i]] != 1) return KV_ERR_INVALID_ARG;
    if (!kv_rows_to_keep_valid(rows, pool->n_layers, n_keep, pool->n_kv_heads, q->length))
        return KV_ERR_INVALID_ARG;
    return KV_OK;
}

/* Whether q, its rows become n_keep rows from row `at` of its first block (the blocks
 * before that one gone back), could then take one more row: the blocks it would hold fit
 * its table, and those beyond the ones it holds now are free or cached in the pool. A
 * start costs up to one block, which a table or pool sized for the rows alone lacks. */
static int room_for_next_row(const kv_blocks *blocks, const kv_seq *q, int at, int n_keep) {
    int bs = blocks->block_size;
    int64_t needed = kv_ceil_div((int64_t)at % bs + n_keep + 1, bs);
    return needed <= blocks->max_blocks_per_seq &&
           needed <= (int64_t)q->n_blocks + kv_blocks_available(blocks);
}

kv_status kv_pool_keep(kv_pool *pool, int seq, int n_keep, const int32_t *rows) {
    kv_status status = keep_allowed(pool, seq, n_keep, rows);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->blocks.seqs[seq];
    int n_heads = pool->n_kv_heads;
#define KEPT(layer, i, head) rows[((size_t)(layer) * n_keep + (i)) * n_heads + (head)]
    if (pool->positions == NULL) {
        pool->positions = malloc(position_index(pool, pool->n_layers, 0, 0) * sizeof(int32_t));
        if (pool->positions == NULL) return KV_ERR_NOMEM;
    }
    if (!q->compacted) {     /* its first drop: write down the positions its rows hold */
        for (int layer = 0; layer < pool->n_layers; layer++) {
            kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
            for (int head = 0; head < n_heads; head++)
                for (int row = 0; row < q->length; row++)
                    pool->positions[position_index(pool, layer, head, kv_view_slot(&view, row))] = row;
        }
    }
    /* As kv_cache_keep: kept row i becomes row i + shift, and the sequence's start then moves
     * to row `shift` (kv_blocks_drop_rows). shift is the turn that moves fewest rows, or
     * minus the start, every row going to the front of the first block as before there was
     * a start, where the turn's start would cost a block for the next row that the table
     * or the pool lacks and the front would not. shift <= 0: rows only move towards the
     * front, from a row at or after their own, so front to back none is overwritten before
     * it is read; shift > 0 (every dropped row): only towards the back, so back to front. */
    int shift = kv_rows_turn(rows, pool->n_layers, n_keep, n_heads, q->length);
    if (!room_for_next_row(&pool->blocks, q, q->start + shift, n_keep) &&
        room_for_next_row(&pool->blocks, q, 0, n_keep))
        shift = -q->start;
    for (int layer = 0; layer < pool->n_layers; layer++) {
        kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
        for (int head = 0; head < n_heads; head++)
            for (int k = 0; k < n_keep; k++) {
                int i = shift <= 0 ? k : n_keep - 1 - k;
                if (KEPT(layer, i, head) != i + shift)
                    move_row(pool, &view, head, i + shift, KEPT(layer, i, head));
            }
    }
#undef KEPT
    return kv_blocks_drop_rows(&pool->blocks, seq, shift, n_keep);   /* cannot fail: checked */
}

/* ---- moving rows: in host memory, or by the row store ------------------------------- */

/* Copy-on-write: n_rows rows from slot src to slot dst, K and V of every layer (and the
 * positions they hold, for a sequence that dropped rows). */
static kv_status copy_rows(kv_pool *pool, size_t dst, size_t src, size_t n_rows) {
    if (pool->row_store) return pool->row_store->copy(pool->row_store->ctx, dst, src, n_rows);
    for (int layer = 0; layer < pool->n_layers; layer++) {
        kv_store_copy(&pool->key, layer, dst, src, n_rows);
        kv_store_copy(&pool->value, layer, dst, src, n_rows);
        for (int head = 0; head < pool->n_kv_heads && pool->positions != NULL; head++)
            memcpy(pool->positions + position_index(pool, layer, head, dst),
                   pool->positions + position_index(pool, layer, head, src),
                   n_rows * sizeof(int32_t));
    }
    return KV_OK;
}

/* Rows t = 0 .. n_tokens - 1 of keys and values, (n_tokens, n_layers, n_kv_heads, head_dim),
 * as positions start + t of seq (reserved), into their slots, quantized; on the host the
 * residual window keeps its full-precision copy too. */
static kv_status write_rows(kv_pool *pool, int seq, int start, int n_tokens, const float *keys,
                            const float *values) {
    size_t row = row_floats(pool), token_stride = (size_t)pool->n_layers * row;
    if (pool->row_store) {
        int64_t *slots = malloc((size_t)n_tokens * sizeof(int64_t));
        if (slots == NULL) return KV_ERR_NOMEM;
        kv_pool_slots(pool, seq, start, n_tokens, slots);
        kv_status status = pool->row_store->write(pool->row_store->ctx, slots, n_tokens, keys,
                                                  values);
        free(slots);
        return status;
    }
    for (int layer = 0; layer < pool->n_layers; layer++) {
        kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
        for (int t = 0; t < n_tokens; t++) {
            size_t slot = kv_view_slot(&view, start + t);
            size_t src = ((size_t)t * pool->n_layers + layer) * row;
            kv_store_write(&pool->key, layer, slot, keys + src);
            kv_store_write(&pool->value, layer, slot, values + src);
        }
        kv_window_keep(view.window_key, pool->window, (int)row, start, keys + layer * row,
                       token_stride, n_tokens);
        kv_window_keep(view.window_value, pool->window, (int)row, start, values + layer * row,
                       token_stride, n_tokens);
    }
    return KV_OK;
}

size_t kv_pool_host_rows(const kv_pool *pool, int n, uint8_t *at, kv_store *key,
                         kv_store *value) {
    const kv_store *stores[2] = {&pool->key, &pool->value};
    kv_store *out[2] = {key, value};
    size_t bytes = 0;
    for (int i = 0; i < 2; i++) {
        const kv_store *s = stores[i];
        kv_store host;
        /* cannot fail for n >= 1: the pool's stores passed the same checks with more slots */
        kv_store_describe(&host, s->format, s->group, s->n_layers, (size_t)n, s->n_kv_heads,
                          s->head_dim);
        size_t head_rows = (size_t)s->n_layers * s->n_kv_heads * (size_t)n;
        size_t codes = head_rows * s->head_bytes;
        size_t params = head_rows * (size_t)s->groups_per_head * sizeof(float);
        int n_params = (s->groups_per_head > 0) + (s->format == KV_FMT_I4);   /* scales, zeros */
        if (at != NULL) {
            host.codes = at + bytes;
            if (n_params >= 1) host.scales = (float *)(at + bytes + codes);
            if (n_params == 2) host.zeros = (float *)(at + bytes + codes + params);
        }
        bytes += codes + (size_t)n_params * params;
        if (out[i] != NULL) *out[i] = host;
    }
    return bytes;
}

/* The K and V of seq's positions 0 .. length - 1 from the row store, dequantized as
 * kv_pool_gather gives them: the stored rows are copied to the host first. */
static kv_status gather_from_row_store(const kv_pool *pool, int seq, float *keys,
                                       float *values) {
    kv_status status = KV_OK;
    int length = pool->blocks.seqs[seq].length;
    if (length == 0) return KV_OK;
    size_t row = row_floats(pool);
    int64_t *slots = malloc((size_t)length * sizeof(int64_t));
    uint8_t *rows = malloc(kv_pool_host_rows(pool, length, NULL, NULL, NULL));
    kv_store key, value;
    KV_CHECK(slots != NULL && rows != NULL, KV_ERR_NOMEM);
    kv_pool_slots(pool, seq, 0, length, slots);
    kv_pool_host_rows(pool, length, rows, &key, &value);
    KV_TRY(pool->row_store->read(pool->row_store->ctx, slots, length, &key, &value));
    for (int layer = 0; layer < pool->n_layers; layer++)
        for (int pos = 0; pos < length; pos++) {
            size_t dst = ((size_t)layer * length + pos) * row;
            kv_store_read(&key, layer, (size_t)pos, keys + dst);
            kv_store_read(&value, layer, (size_t)pos, values + dst);
        }
fail:
    free(slots);
    free(rows);
    return status;
}

/* ---- writing rows: reserve, write, commit -------------------------------------------------- */

/* [quote ch04-kv-pool-reserve] */
kv_status kv_pool_reserve(kv_pool *pool, int seq, int n_tokens) {
    kv_block_copy copies[1];
    int n_copies = 0;
    kv_status status = kv_blocks_reserve(&pool->blocks, seq, n_tokens, copies, &n_copies);
    if (status != KV_OK) return status;
    size_t bs = (size_t)pool->blocks.block_size;
    for (int i = 0; i < n_copies && status == KV_OK; i++)   /* copy-on-write */
        status = copy_rows(pool, copies[i].dst * bs, copies[i].src * bs, (size_t)copies[i].rows);
    /* (only a row store can fail: the sequence goes back to the shared block it read
     * before, and the pool is as it was) */
    if (status != KV_OK) kv_blocks_cancel_copy(&pool->blocks, seq, &copies[0]);
    return status;
}
/* [end ch04-kv-pool-reserve] */

/* [quote ch07-kv-pool-layer-view] */
kv_layer_view kv_pool_layer_view(const kv_pool *pool, int seq, int layer) {
    const kv_seq *q = &pool->blocks.seqs[seq];
    kv_layer_view view = {.key = &pool->key, .value = &pool->value, .layer = layer,
                          .block_table = q->block_table, .block_size = pool->blocks.block_size,
                          .start = q->start, .window = pool->window, .new_start = q->length};
    if (pool->window > 0) {
        view.window_key = window_rows(pool->window_key, pool, seq, layer);
        view.window_value = window_rows(pool->window_value, pool, seq, layer);
    }
    return view;
}
/* [end ch07-kv-pool-layer-view] */

void kv_pool_slots(const kv_pool *pool, int seq, int start, int n, int64_t *slots) {
    kv_layer_view view = kv_pool_layer_view(pool, seq, 0);   /* every layer's are the same */
    for (int t = 0; t < n; t++) slots[t] = (int64_t)kv_view_slot(&view, start + t);
}

kv_status kv_pool_append(kv_pool *pool, int seq, const int32_t *tokens, int n_tokens,
                         const float *keys, const float *values) {
    kv_status status = kv_blocks_seq_check(&pool->blocks, seq);
    if (status != KV_OK) return status;
    if (tokens == NULL || keys == NULL || values == NULL || n_tokens <= 0)
        return KV_ERR_INVALID_ARG;
    status = kv_pool_reserve(pool, seq, n_tokens);
    if (status != KV_OK) return status;
    status = write_rows(pool, seq, pool->blocks.seqs[seq].length, n_tokens, keys, values);
    if (status != KV_OK) {   /* a row store failed: as if the call never came */
        kv_blocks_cancel(&pool->blocks, seq);
        return status;
    }
    kv_blocks_commit(&pool->blocks, seq, tokens, n_tokens);
    kv_pool_note_positions(pool, seq, n_tokens);
    return KV_OK;
}

kv_status kv_pool_gather(const kv_pool *pool, int seq, float *keys, float *values) {
    kv_status status = kv_blocks_seq_check(&pool->blocks, seq);
    if (status != KV_OK) return status;
    if (pool->row_store) return gather_from_row_store(pool, seq, keys, values);
    const kv_seq *q = &pool->blocks.seqs[seq];
    size_t row = row_floats(pool);
    for (int layer = 0; layer < pool->n_layers; layer++) {
        kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
        for (int pos = 0; pos < q->length; pos++) {
            size_t dst = ((size_t)layer * q->length + pos) * row;
            if (pool->window > 0 && pos >= q->length - pool->window) {   /* full precision */
                memcpy(keys + dst, kv_window_row(view.window_key, pool->window, (int)row, pos),
                       row * sizeof(float));
                memcpy(values + dst, kv_window_row(view.window_value, pool->window, (int)row, pos),
                       row * sizeof(float));
            } else {
                kv_store_read(&pool->key, layer, kv_view_slot(&view, pos), keys + dst);
                kv_store_read(&pool->value, layer, kv_view_slot(&view, pos), values + dst);
            }
        }
    }
    return KV_OK;
}

/* ---- a batch for a forward pass run elsewhere (the GPU's) ---------------------------------- */

kv_status kv_pool_check_batch(const kv_pool *pool, int n_seqs, const int *seqs,
                              const int *n_tokens) {
    const kv_blocks *blocks = &pool->blocks;
    if (seqs == NULL || n_tokens == NULL || n_seqs < 1 || n_seqs > blocks->max_seqs)
        return KV_ERR_INVALID_ARG;
    int64_t total = 0;
    int needed = 0;
    for (int i = 0; i < n_seqs; i++) {
        kv_status status = kv_blocks_seq_check(blocks, seqs[i]);
        if (status != KV_OK) return status;
        for (int j = 0; j < i; j++)
            if (seqs[j] == seqs[i]) return KV_ERR_INVALID_ARG;
        if (n_tokens[i] < 1 || n_tokens[i] > KV_MAX_TOKENS_PER_CALL) return KV_ERR_INVALID_ARG;
        if (n_tokens[i] > KV_MAX_POSITIONS - blocks->seqs[seqs[i]].next_position)
            return KV_ERR_CACHE_FULL;
        total += n_tokens[i];
        if (total > KV_MAX_TOKENS_PER_CALL) return KV_ERR_INVALID_ARG;
        int blocks_of_seq;
        status = kv_blocks_needed(blocks, seqs[i], n_tokens[i], &blocks_of_seq);
        if (status != KV_OK) return status;
        needed += blocks_of_seq;
    }
    /* (a copy-on-write counted for two forks of one block happens only once, if at all) */
    return needed <= kv_blocks_available(blocks) ? KV_OK : KV_ERR_OUT_OF_BLOCKS;
}

kv_status kv_pool_reserve_batch(kv_pool *pool, int n_seqs, const int *seqs, const int *n_tokens,
                                int max_blocks, int32_t *starts, int32_t *tables,
                                int64_t *slots) {
    kv_status status = kv_pool_check_batch(pool, n_seqs, seqs, n_tokens);
    if (status != KV_OK) return status;
    int bs = pool->blocks.block_size;
    for (int i = 0; i < n_seqs; i++) {
        const kv_seq *q = &pool->blocks.seqs[seqs[i]];
        /* (a row store's sequences start at row 0 of their first block: they drop no row) */
        if (kv_ceil_div((int64_t)q->start + q->length + n_tokens[i], bs) > max_blocks)
            return KV_ERR_INVALID_ARG;
    }
    for (int i = 0, first = 0; i < n_seqs; first += n_tokens[i], i++) {
        const kv_seq *q = &pool->blocks.seqs[seqs[i]];
        starts[i] = q->length;
        status = kv_pool_reserve(pool, seqs[i], n_tokens[i]);  /* only a row store can fail */
        if (status != KV_OK) {
            kv_pool_cancel_batch(pool, i, seqs);
            return status;
        }
        int32_t *table = tables + (size_t)i * max_blocks;
        memcpy(table, q->block_table, (size_t)q->n_blocks * sizeof(int32_t));
        memset(table + q->n_blocks, 0, (size_t)(max_blocks - q->n_blocks) * sizeof(int32_t));
        kv_pool_slots(pool, seqs[i], q->length, n_tokens[i], slots + first);
    }
    return KV_OK;
}

void kv_pool_commit_batch(kv_pool *pool, int n_seqs, const int *seqs, const int *n_tokens,
                          const int32_t *tokens) {
    for (int i = 0, first = 0; i < n_seqs; first += n_tokens[i], i++) {
        kv_blocks_commit(&pool->blocks, seqs[i], tokens + first, n_tokens[i]);
        kv_pool_note_positions(pool, seqs[i], n_tokens[i]);
    }
}

void kv_pool_cancel_batch(kv_pool *pool, int n_seqs, const int *seqs) {
    for (int i = 0; i < n_seqs; i++) kv_blocks_cancel(&pool->blocks, seqs[i]);
}
