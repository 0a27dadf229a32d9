/* swap.c: preemption by swapping: one sequence of a paged pool copied to host memory and
 * back (vLLM's swap-out and swap-in).
 *
 * When the pool runs out of blocks, a request can be preempted two ways. Recompute frees
 * its blocks and, later, runs its prompt and the tokens it generated through the model
 * again. Swap copies its K and V out of the pool first, and later copies them into fresh
 * blocks: no model work, only bytes moved, and the sequence goes on bit for bit.
 *
 * Why this is C and not NumPy views of the stores: the stores are head-major (kvlab.h),
 * so a sequence's rows are a run per (layer, KV head, block) in codes, scales and zero
 * points, and Python sees them only as read-only views; and a sequence swapped in must
 * get its blocks, tokens, rows, positions and window rows together, after every check,
 * so that a refusal changes nothing. Here that is one function each way.
 *
 * The host copy is one buffer, laid out by this file alone:
 *   swap_header, tokens (length int32), then for K and then V: codes
 *   (n_layers, n_kv_heads, length, head_bytes), scales and zero points (n_layers,
 *   n_kv_heads, length, groups_per_head float32) where the format has them; positions
 *   (n_layers, n_kv_heads, length int32) if the sequence dropped rows (kv_pool_keep); its
 *   residual window's rows, K then V, (n_layers, window, kv_dim float32) each.
 * Only a sequence's `length` rows are copied: rows past it in its last block were never
 * written, those before its start in its first block were dropped (kv_pool_keep), and a
 * block is the pool's unit, not the host's: a sequence comes back from row 0 of its first
 * block (start 0), in as few blocks as its rows take, whatever block size it left. A pool
 * whose rows live in a row store (the GPU's) has the store copy them, into and out of the
 * same layout.
 */
#include <string.h>

#include "common.h"
#include "paged.h"
#include "store.h"

#define SWAP_MAGIC 0x6b767377u   /* "kvsw": these bytes are a swapped-out sequence */

/* What the rows are and what the sequence needs to go on: swap-in refuses a buffer whose
 * shape or formats are not the pool's (the rows would be read as something else). */
typedef struct {
    uint32_t magic;
    int32_t n_layers, n_kv_heads, head_dim, window;
    int32_t key_format, key_group, value_format, value_group;
    int32_t length, next_position, compacted;
} swap_header;

/* One array of the pool laid out (n_layers, n_kv_heads, slots, row_bytes): a store's
 * codes, scales or zero points, or the positions of a compacted sequence's rows. */
typedef struct {
    uint8_t *base;
    size_t row_bytes;
} pool_part;

/* The parts a sequence's rows occupy, in the order the host copy holds them; returns how
 * many (at most 7). */
static int parts_of(const kv_pool *pool, int compacted, pool_part parts[7]) {
    int n = 0;
    const kv_store *stores[2] = {&pool->key, &pool->value};
    for (int i = 0; i < 2; i++) {
        const kv_store *s = stores[i];
        size_t params = (size_t)s->groups_per_head * sizeof(float);
        /* (by format, not by pointer: a row store's stores have no memory here) */
        parts[n++] = (pool_part){s->codes, s->head_bytes};
        if (s->groups_per_head > 0) parts[n++] = (pool_part){(uint8_t *)s->scales, params};
        if (s->format == KV_FMT_I4) parts[n++] = (pool_part){(uint8_t *)s->zeros, params};
    }
    if (compacted) parts[n++] = (pool_part){(uint8_t *)pool->positions, sizeof(int32_t)};
    return n;
}

static size_t window_bytes(const kv_pool *pool) {
    return (size_t)pool->n_layers * pool->window * pool->n_kv_heads * pool->head_dim *
           sizeof(float);
}

/* Bytes of the host copy of a sequence of `length` rows. */
static size_t swap_bytes(const kv_pool *pool, int length, int compacted) {
    size_t head_rows = (size_t)pool->n_layers * pool->n_kv_heads * (size_t)length;
    pool_part parts[7];
    int n = parts_of(pool, compacted, parts);
    size_t size = sizeof(swap_header) + (size_t)length * sizeof(int32_t);
    for (int i = 0; i < n; i++) size += head_rows * parts[i].row_bytes;
    return size + 2 * window_bytes(pool);
}

/* The rows of sequence q from row `row` on that lie next to each other in one of its blocks
 * (up to that block's end, or row length - 1): how many, and the slot of the first. */
static int block_run(const kv_pool *pool, const kv_seq *q, int row, int length, size_t *slot) {
    int block_size = pool->blocks.block_size, at = q->start + row;   /* past a dropped front */
    int to_block_end = block_size - at % block_size;
    *slot = (size_t)q->block_table[at / block_size] * block_size + (size_t)(at % block_size);
    return length - row < to_block_end ? length - row : to_block_end;
}

/* Copies the first `length` rows of one part of sequence q between the pool and host
 * memory: to_host 1 copies out, 0 copies in (host is then only read: swap-in's buffer is
 * the caller's, const). Returns where the host memory goes on. */
static uint8_t *copy_part(const kv_pool *pool, pool_part part, const kv_seq *q, int length,
                          uint8_t *host, int to_host) {
    size_t slots = pool->key.slots;
    for (int layer = 0; layer < pool->n_layers; layer++)
        for (int head = 0; head < pool->n_kv_heads; head++)
            for (int row = 0, n; row < length; row += n) {
                size_t slot;
                n = block_run(pool, q, row, length, &slot);
                uint8_t *pooled = part.base + (((size_t)layer * pool->n_kv_heads + head) * slots +
                                               slot) * part.row_bytes;
                if (to_host)
                    memcpy(host, pooled, (size_t)n * part.row_bytes);
                else
                    memcpy(pooled, host, (size_t)n * part.row_bytes);
                host += (size_t)n * part.row_bytes;
            }
    return host;
}

/* The sequence's window rows, K and V, (n_layers, window, kv_dim) each: contiguous per
 * sequence (paged.c), so layer 0's view is where they start. */
static float *window_key_of(const kv_pool *pool, int seq) {
    return kv_pool_layer_view(pool, seq, 0).window_key;
}

static float *window_value_of(const kv_pool *pool, int seq) {
    return kv_pool_layer_view(pool, seq, 0).window_value;
}

/* A row store's rows of seq's first `length` positions copied into the host copy's stores'
 * parts at `at` (to_host 1), or from them into the store (0). */
static kv_status move_store_rows(const kv_pool *pool, int seq, int length, uint8_t *at,
                                 int to_host) {
    if (length == 0) return KV_OK;
    int64_t *slots = malloc((size_t)length * sizeof(int64_t));
    if (slots == NULL) return KV_ERR_NOMEM;
    const kv_row_store *store = pool->row_store;
    kv_store key, value;
    kv_pool_slots(pool, seq, 0, length, slots);
    kv_pool_host_rows(pool, length, at, &key, &value);
    kv_status status = to_host ? store->read(store->ctx, slots, length, &key, &value)
                               : store->put(store->ctx, slots, length, &key, &value);
    free(slots);
    return status;
}

kv_status kv_pool_swap_size(const kv_pool *pool, int seq, size_t *size) {
    kv_status status = kv_blocks_seq_check(&pool->blocks, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->blocks.seqs[seq];
    if (q->reserved > 0) return KV_ERR_PENDING;   /* its last blocks hold nothing yet */
    *size = swap_bytes(pool, q->length, q->compacted);
    return KV_OK;
}

kv_status kv_pool_swap_out(kv_pool *pool, int seq, void *host, size_t size) {
    size_t want;
    kv_status status = kv_pool_swap_size(pool, seq, &want);
    if (status != KV_OK) return status;
    if (host == NULL || size != want) return KV_ERR_INVALID_ARG;
    const kv_seq *q = &pool->blocks.seqs[seq];
    swap_header header = {SWAP_MAGIC, pool->n_layers, pool->n_kv_heads, pool->head_dim,
                          pool->window, pool->key.format, pool->key.group, pool->value.format,
                          pool->value.group, q->length, q->next_position, q->compacted};
    uint8_t *at = host;
    memcpy(at, &header, sizeof header);
    at += sizeof header;
    for (int row = 0, n; row < q->length; row += n) {
        size_t slot;
        n = block_run(pool, q, row, q->length, &slot);
        memcpy(at, pool->blocks.tokens + slot, (size_t)n * sizeof(int32_t));
        at += (size_t)n * sizeof(int32_t);
    }
    if (pool->row_store) {   /* (no window, no dropped rows: kv_pool_init_with_store) */
        status = move_store_rows(pool, seq, q->length, at, 1);
        return status == KV_OK ? kv_blocks_seq_free(&pool->blocks, seq) : status;
    }
    pool_part parts[7];
    int n_parts = parts_of(pool, q->compacted, parts);
    for (int i = 0; i < n_parts; i++)
        at = copy_part(pool, parts[i], q, q->length, at, 1);
    if (pool->window > 0) {
        memcpy(at, window_key_of(pool, seq), window_bytes(pool));
        memcpy(at + window_bytes(pool), window_value_of(pool, seq), window_bytes(pool));
    }
    /* Only this sequence's references go: a block another sequence shares keeps its rows
     * (its reference count drops by one), and its full blocks stay cached. */
    return kv_blocks_seq_free(&pool->blocks, seq);
}

/* Whether the header describes rows this pool stores the same way. */
static int same_layout(const kv_pool *pool, const swap_header *h) {
    return h->n_layers == pool->n_layers && h->n_kv_heads == pool->n_kv_heads &&
           h->head_dim == pool->head_dim && h->window == pool->window &&
           h->key_format == (int32_t)pool->key.format && h->key_group == pool->key.group &&
           h->value_format == (int32_t)pool->value.format && h->value_group == pool->value.group;
}

/* Whether the positions of a compacted sequence's rows, (n_layers, n_kv_heads, length) as the
 * host copy holds them, are ones kv_pool_keep and the forward pass can leave: for each
 * (layer, head), strictly increasing and below next_position (row i holds a position at
 * least i). Other numbers would be read as positions by truncate() and by the sliding-window
 * check (kvlab/model.py), so a host copy that holds them is refused. */
static int positions_valid(const int32_t *positions, size_t n_lists, int length,
                           int next_position) {
    for (size_t list = 0; list < n_lists; list++) {
        const int32_t *p = positions + list * (size_t)length;
        for (int row = 0; row < length; row++)
            if (p[row] < row || p[row] >= next_position || (row > 0 && p[row] <= p[row - 1]))
                return 0;
    }
    return 1;
}

/* The header of a host copy, if it is one this pool can take in: the same layout, and
 * numbers that a swap-out writes (KV_ERR_INVALID_ARG, KV_ERR_CACHE_MISMATCH otherwise). */
static kv_status read_header(const kv_pool *pool, const void *host, size_t size,
                             swap_header *h) {
    memcpy(h, host, sizeof *h);
    if (h->magic != SWAP_MAGIC) return KV_ERR_INVALID_ARG;
    if (!same_layout(pool, h)) return KV_ERR_CACHE_MISMATCH;
    /* a row store's rows hold positions 0 .. length - 1 (kv_pool_init_with_store) */
    if (h->compacted == 1 && pool->row_store) return KV_ERR_CACHE_MISMATCH;
    /* a sequence with a window never drops rows (kv_pool_keep refuses it) */
    if (h->length < 0 || h->length > (1 << 30) || (h->compacted != 0 && h->compacted != 1) ||
        (h->compacted && pool->window > 0) ||
        h->next_position < h->length || h->next_position > (1 << 30) ||
        (!h->compacted && h->next_position != h->length) ||
        size != swap_bytes(pool, h->length, h->compacted))
        return KV_ERR_INVALID_ARG;
    return KV_OK;
}

/* Whether the pool has room for a new sequence of `length` rows: a sequence slot, and
 * blocks for its table and in the pool. */
static kv_status room_for(const kv_blocks *blocks, int length) {
    int n_blocks = (int)kv_ceil_div(length, blocks->block_size);
    if (n_blocks > blocks->max_blocks_per_seq) return KV_ERR_TABLE_FULL;
    if (n_blocks > kv_blocks_available(blocks)) return KV_ERR_OUT_OF_BLOCKS;
    for (int s = 0; s < blocks->max_seqs; s++)
        if (!blocks->seqs[s].alive) return KV_OK;
    return KV_ERR_TOO_MANY_SEQUENCES;
}

/* The tokens of the host copy (h->length of them), and the positions of a compacted
 * sequence's rows after them, copied out of the host buffer into *tokens (malloc'd, the
 * caller frees it): aligned for kv_blocks_commit (the host buffer need not be), and checked
 * on this copy, which is the one that goes into the pool (the caller's buffer may change
 * meanwhile: swap-in runs without the GIL). */
static kv_status read_tokens(const kv_pool *pool, const swap_header *h, const void *host,
                             int32_t **tokens) {
    pool_part parts[7];
    int n_parts = parts_of(pool, h->compacted, parts);
    size_t n_lists = (size_t)pool->n_layers * pool->n_kv_heads;
    size_t n_positions = h->compacted ? n_lists * (size_t)h->length : 0;
    *tokens = malloc(((size_t)h->length + n_positions + 1) * sizeof(int32_t));
    if (*tokens == NULL) return KV_ERR_NOMEM;
    const uint8_t *at = (const uint8_t *)host + sizeof *h;
    memcpy(*tokens, at, (size_t)h->length * sizeof(int32_t));
    if (!h->compacted) return KV_OK;
    /* the positions are the last part, after the stores' rows */
    at += (size_t)h->length * sizeof(int32_t);
    for (int i = 0; i < n_parts - 1; i++) at += n_lists * h->length * parts[i].row_bytes;
    int32_t *positions = *tokens + h->length;
    memcpy(positions, at, n_positions * sizeof(int32_t));
    if (!positions_valid(positions, n_lists, h->length, h->next_position)) {
        free(*tokens);
        *tokens = NULL;
        return KV_ERR_INVALID_ARG;
    }
    return KV_OK;
}

/* The host copy's rows from *at (the stores' parts, then a compacted sequence's positions,
 * of which `positions` is the checked copy) into seq's new blocks; *at moves past them.
 * Only a row store can fail. */
static kv_status put_rows(kv_pool *pool, int seq, const swap_header *h, const uint8_t **at,
                          const int32_t *positions) {
    if (pool->row_store) return move_store_rows(pool, seq, h->length, (uint8_t *)*at, 0);
    pool_part parts[7];
    int n_parts = parts_of(pool, h->compacted, parts);
    const kv_seq *q = &pool->blocks.seqs[seq];   /* (its h->length rows reserved) */
    for (int i = 0; i < n_parts; i++) {
        if (h->compacted && i == n_parts - 1)    /* the positions: the checked copy */
            copy_part(pool, parts[i], q, h->length, (uint8_t *)positions, 0);
        else
            *at = copy_part(pool, parts[i], q, h->length, (uint8_t *)*at, 0);
    }
    return KV_OK;
}

kv_status kv_pool_swap_in(kv_pool *pool, const void *host, size_t size, int *seq) {
    kv_blocks *blocks = &pool->blocks;
    swap_header h;
    if (blocks->seqs == NULL || host == NULL || seq == NULL || size < sizeof h)
        return KV_ERR_INVALID_ARG;
    /* Everything that could refuse, before anything changes. */
    kv_status status = read_header(pool, host, size, &h);
    if (status == KV_OK) status = room_for(blocks, h.length);
    if (status != KV_OK) return status;
    int32_t *tokens;
    status = read_tokens(pool, &h, host, &tokens);
    if (status != KV_OK) return status;
    if (h.compacted && pool->positions == NULL) {   /* kv_pool_keep makes it the same way */
        pool->positions = malloc((size_t)pool->n_layers * pool->n_kv_heads * pool->key.slots *
                                 sizeof(int32_t));
        if (pool->positions == NULL) {
            free(tokens);
            return KV_ERR_NOMEM;
        }
    }

    /* From here on nothing can fail, the checks above being the ones these calls make, but
     * a row store: the new sequence then goes again, and the pool is as it was. */
    kv_blocks_seq_new(blocks, seq);
    kv_seq *q = &blocks->seqs[*seq];
    q->compacted = h.compacted;   /* before the commit: such blocks are never cached */
    const uint8_t *at = (const uint8_t *)host + sizeof h + (size_t)h.length * sizeof(int32_t);
    if (h.length > 0) {
        kv_block_copy copies[1];   /* a new sequence shares no block: nothing to copy */
        int n_copies = 0;
        kv_blocks_reserve(blocks, *seq, h.length, copies, &n_copies);
        status = put_rows(pool, *seq, &h, &at, tokens + h.length);
        if (status != KV_OK) {
            kv_blocks_seq_free(blocks, *seq);
            free(tokens);
            return status;
        }
        /* (a compacted sequence has no window rows: nothing follows its positions) */
        /* The rows are in: the commit records the tokens and offers full blocks to the
         * prefix cache, which may find one computed meanwhile and share it instead (the
         * same bits: the core computes a prefix the same way every time). */
        kv_blocks_commit(blocks, *seq, tokens, h.length);
    }
    q->next_position = h.next_position;
    if (pool->window > 0) {
        memcpy(window_key_of(pool, *seq), at, window_bytes(pool));
        memcpy(window_value_of(pool, *seq), at + window_bytes(pool), window_bytes(pool));
    }
    free(tokens);
    return KV_OK;
}

int kv_swap_length(const void *host, size_t size) {
    swap_header h;
    if (host == NULL || size < sizeof h) return -1;
    memcpy(&h, host, sizeof h);
    return h.magic == SWAP_MAGIC && h.length >= 0 ? h.length : -1;
}
