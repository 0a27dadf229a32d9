/* paged.c: the paged KV cache: a block pool, block tables, copy-on-write, prefix caching.
 *
 * A contiguous cache reserves max_seq_len positions per request up front; here memory
 * is handed out one block of block_size positions at a time, when a sequence actually
 * reaches it. A sequence is a block table (logical block i -> physical block id) and a
 * length. Blocks are reference counted, so sequences can share them:
 *   - fork: a child shares all of its parent's blocks; the first write into a shared,
 *     partly filled block copies it first (copy-on-write);
 *   - prefix caching: every full block is registered under a hash of (its parent's hash,
 *     its tokens); a new prompt that starts with the same tokens reuses those blocks
 *     and skips their prefill. Unreferenced full blocks stay cached until a block is
 *     needed, then the least recently used one is evicted.
 * Every operation checks everything first and changes nothing when it fails.
 * Bookkeeping is O(1) per block: a free stack, an intrusive LRU list, a chained hash
 * table. The forward pass and attention (model.c, attention.c) read blocks through a
 * kv_layer_view; this file never does arithmetic on K or V.
 */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "paged.h"
#include "store.h"

#define ROOT_HASH 0x6b766c6162ULL  /* the "parent hash" of a sequence's first block */

static size_t row_floats(const kv_pool *p) { return (size_t)p->n_kv_heads * p->head_dim; }

/* one sequence's ring of full-precision rows for one layer (the residual window) */
static float *window_rows(float *rows, const kv_pool *p, int seq, int layer) {
    return rows + ((size_t)seq * p->n_layers + layer) * p->window * row_floats(p);
}

static size_t window_floats_per_seq(const kv_pool *p) {
    return (size_t)p->n_layers * p->window * row_floats(p);
}

static int blocks_for(const kv_pool *p, int length) {
    return (length + p->block_size - 1) / p->block_size;
}

/* ---- setup --------------------------------------------------------------------------- */

kv_status kv_pool_init(kv_pool *pool, int n_layers, int n_kv_heads, int head_dim,
                       int num_blocks, int block_size, int max_seqs, int max_blocks_per_seq,
                       const kv_cache_format *format) {
    static const kv_cache_format fp32_format = {KV_FMT_F32, KV_FMT_F32, 0, 0, 0};
    kv_status status = KV_OK;
    memset(pool, 0, sizeof *pool);
    if (format == NULL) format = &fp32_format;
    KV_CHECK(n_layers > 0 && n_kv_heads > 0 && head_dim > 0 && num_blocks > 0 &&
             block_size >= 1 && block_size <= 256 && max_seqs > 0 && max_blocks_per_seq > 0,
             KV_ERR_INVALID_ARG);
    KV_CHECK(num_blocks <= (1 << 24) && max_seqs <= (1 << 20) &&
             (int64_t)max_seqs * max_blocks_per_seq <= ((int64_t)1 << 28), KV_ERR_INVALID_ARG);
    pool->n_layers = n_layers;
    pool->n_kv_heads = n_kv_heads;
    pool->head_dim = head_dim;
    pool->num_blocks = num_blocks;
    pool->block_size = block_size;
    pool->prefix_cache = 1;
    pool->max_seqs = max_seqs;
    pool->max_blocks_per_seq = max_blocks_per_seq;
    pool->hash_mask = ~(uint64_t)0;
    KV_CHECK(n_layers <= KV_MAX_LAYERS && (long)n_kv_heads * head_dim <= KV_MAX_WIDTH,
             KV_ERR_INVALID_ARG);
    KV_CHECK(format->window >= 0 && format->window <= (1 << 20), KV_ERR_INVALID_ARG);
    size_t slots = (size_t)num_blocks * block_size;
    KV_TRY(kv_store_init(&pool->key, format->key_format, format->key_group, n_layers, slots,
                         n_kv_heads, head_dim));
    KV_TRY(kv_store_init(&pool->value, format->value_format, format->value_group, n_layers,
                         slots, n_kv_heads, head_dim));
    pool->window = format->window;
    if (pool->window > 0) {
        size_t floats = (size_t)max_seqs * window_floats_per_seq(pool);
        KV_CHECK(floats <= ((size_t)1 << 38), KV_ERR_NOMEM);
        pool->window_key = calloc(floats, sizeof(float));
        pool->window_value = calloc(floats, sizeof(float));
        KV_CHECK(pool->window_key != NULL && pool->window_value != NULL, KV_ERR_NOMEM);
    }

    size_t n = (size_t)num_blocks;
    pool->n_buckets = 1;
    while (pool->n_buckets < num_blocks) pool->n_buckets *= 2;
    pool->ref_count = calloc(n, sizeof(int32_t));
    pool->fill = calloc(n, sizeof(int32_t));
    pool->tokens = calloc(n * block_size, sizeof(int32_t));
    pool->free_stack = malloc(n * sizeof(int32_t));
    pool->hash = calloc(n, sizeof(uint64_t));
    pool->parent = malloc(n * sizeof(int32_t));
    pool->generation = calloc(n, sizeof(uint32_t));
    pool->parent_generation = calloc(n, sizeof(uint32_t));
    pool->registered = calloc(n, 1);
    pool->bucket_head = malloc((size_t)pool->n_buckets * sizeof(int32_t));
    pool->bucket_next = malloc(n * sizeof(int32_t));
    pool->lru_prev = malloc(n * sizeof(int32_t));
    pool->lru_next = malloc(n * sizeof(int32_t));
    pool->seqs = calloc((size_t)max_seqs, sizeof(kv_seq));
    pool->tables = calloc((size_t)max_seqs * max_blocks_per_seq, sizeof(int32_t));
    KV_CHECK(pool->ref_count && pool->fill && pool->tokens && pool->free_stack &&
             pool->hash && pool->parent && pool->generation && pool->parent_generation &&
             pool->registered && pool->bucket_head && pool->bucket_next && pool->lru_prev &&
             pool->lru_next && pool->seqs && pool->tables, KV_ERR_NOMEM);
    /* pushed in reverse so that block 0 is handed out first: easier to follow on screen */
    for (int b = 0; b < num_blocks; b++) {
        pool->free_stack[b] = num_blocks - 1 - b;
        pool->parent[b] = -1;
        pool->bucket_next[b] = pool->lru_prev[b] = pool->lru_next[b] = -1;
    }
    pool->n_free = num_blocks;
    for (int i = 0; i < pool->n_buckets; i++) pool->bucket_head[i] = -1;
    pool->lru_head = pool->lru_tail = -1;
    for (int s = 0; s < max_seqs; s++)
        pool->seqs[s].block_table = pool->tables + (size_t)s * max_blocks_per_seq;
    return KV_OK;
fail:
    kv_pool_free(pool);
    return status;
}

void kv_pool_free(kv_pool *pool) {
    if (pool == NULL) return;
    kv_store_free(&pool->key);
    kv_store_free(&pool->value);
    void *buffers[] = {pool->window_key, pool->window_value, pool->ref_count, pool->fill, pool->tokens, pool->free_stack,
                       pool->hash, pool->parent, pool->generation, pool->parent_generation,
                       pool->registered, pool->bucket_head, pool->bucket_next, pool->lru_prev,
                       pool->lru_next, pool->seqs, pool->tables};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) free(buffers[i]);
    memset(pool, 0, sizeof *pool);
}

size_t kv_pool_nbytes(const kv_pool *pool) {
    size_t window_bytes = 2 * (size_t)pool->max_seqs * window_floats_per_seq(pool) * sizeof(float);
    return kv_store_nbytes(&pool->key) + kv_store_nbytes(&pool->value) + window_bytes;
}

kv_status kv_pool_check_fits(const kv_pool *pool, const kv_config *config) {
    if (pool->key.codes == NULL || pool->n_layers != config->n_layers ||
        pool->n_kv_heads != config->n_kv_heads || pool->head_dim != config->head_dim)
        return KV_ERR_CACHE_MISMATCH;
    return KV_OK;
}

kv_status kv_pool_seq_check(const kv_pool *pool, int seq) {
    if (pool->seqs == NULL || seq < 0 || seq >= pool->max_seqs || !pool->seqs[seq].alive)
        return KV_ERR_NO_SEQUENCE;
    return KV_OK;
}

/* ---- the LRU list of cached (unreferenced, registered) blocks --------------------------- */

static void lru_remove(kv_pool *p, int32_t b) {
    int32_t prev = p->lru_prev[b], next = p->lru_next[b];
    if (prev >= 0) p->lru_next[prev] = next; else p->lru_head = next;
    if (next >= 0) p->lru_prev[next] = prev; else p->lru_tail = prev;
    p->lru_prev[b] = p->lru_next[b] = -1;
    p->n_cached--;
}

static void lru_push_most_recent(kv_pool *p, int32_t b) {
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    p->n_cached++;
}

/* ---- the prefix-cache hash table -------------------------------------------------------- */

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t chain_hash(const kv_pool *p, int32_t parent, const int32_t *tokens) {
    uint64_t h = parent >= 0 ? p->hash[parent] : ROOT_HASH;
    for (int i = 0; i < p->block_size; i++) h = splitmix64(h ^ (uint32_t)tokens[i]);
    return h & p->hash_mask;
}

/* The registered block that continues `parent` with exactly these tokens, or -1.
 * The hash only narrows the search: a match must have the same parent block, in the same
 * generation (not evicted and reused since), and the same tokens, so a hash collision
 * can never hand out the wrong K and V. */
static int32_t lookup(const kv_pool *p, int32_t parent, const int32_t *tokens) {
    uint64_t h = chain_hash(p, parent, tokens);
    for (int32_t b = p->bucket_head[h & (uint64_t)(p->n_buckets - 1)]; b >= 0; b = p->bucket_next[b]) {
        if (p->hash[b] != h || p->parent[b] != parent) continue;
        if (parent >= 0 && p->parent_generation[b] != p->generation[parent]) continue;
        if (memcmp(p->tokens + (size_t)b * p->block_size, tokens,
                   (size_t)p->block_size * sizeof(int32_t)) == 0)
            return b;
    }
    return -1;
}

static void unregister(kv_pool *p, int32_t b) {
    int32_t *link = &p->bucket_head[p->hash[b] & (uint64_t)(p->n_buckets - 1)];
    while (*link != b) link = &p->bucket_next[*link];
    *link = p->bucket_next[b];
    p->bucket_next[b] = -1;
    p->registered[b] = 0;
}

/* Offers a block that just became full to the prefix cache. */
static void register_full_block(kv_pool *p, int32_t b, int32_t parent) {
    if (parent >= 0 && !p->registered[parent]) return;  /* unreachable from the root */
    const int32_t *tokens = p->tokens + (size_t)b * p->block_size;
    if (lookup(p, parent, tokens) >= 0) return;            /* an identical block is cached */
    uint64_t h = chain_hash(p, parent, tokens);
    p->hash[b] = h;
    p->parent[b] = parent;
    p->parent_generation[b] = parent >= 0 ? p->generation[parent] : 0;
    p->registered[b] = 1;
    int32_t *head = &p->bucket_head[h & (uint64_t)(p->n_buckets - 1)];
    p->bucket_next[b] = *head;
    *head = b;
}

/* ---- blocks ------------------------------------------------------------------------------ */

static int blocks_available(const kv_pool *p) { return p->n_free + p->n_cached; }

/* A block for new rows: a free one, else the least recently used cached one.
 * Callers check blocks_available() first, so this cannot fail. */
static int32_t take_block(kv_pool *p) {
    int32_t b;
    if (p->n_free > 0) {
        b = p->free_stack[--p->n_free];
    } else {
        b = p->lru_head;
        lru_remove(p, b);
        unregister(p, b);     /* evicted: its K and V are about to be overwritten */
    }
    p->ref_count[b] = 1;
    p->fill[b] = 0;
    p->parent[b] = -1;
    p->generation[b]++;       /* cached children of its old content no longer match */
    return b;
}

/* Drops one reference; an unreferenced block becomes cached (if registered) or free. */
static void release_block(kv_pool *p, int32_t b) {
    if (--p->ref_count[b] > 0) return;
    if (p->registered[b])
        lru_push_most_recent(p, b);
    else
        p->free_stack[p->n_free++] = b;
}

/* A new reference to a block, taking it off the LRU list if it was only cached. */
static void retain_block(kv_pool *p, int32_t b) {
    if (p->ref_count[b]++ == 0) lru_remove(p, b);
}

/* ---- sequences ---------------------------------------------------------------------------- */

static kv_status new_slot(kv_pool *p, int *seq) {
    for (int s = 0; s < p->max_seqs; s++) {
        if (!p->seqs[s].alive) {
            kv_seq *q = &p->seqs[s];
            q->alive = 1;
            q->n_blocks = q->length = 0;
            q->serial++;
            *seq = s;
            return KV_OK;
        }
    }
    return KV_ERR_TOO_MANY_SEQUENCES;
}

kv_status kv_pool_seq_new(kv_pool *pool, int *seq) {
    if (pool->seqs == NULL) return KV_ERR_INVALID_ARG;
    return new_slot(pool, seq);
}

kv_status kv_pool_seq_free(kv_pool *pool, int seq) {
    kv_status status = kv_pool_seq_check(pool, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &pool->seqs[seq];
    /* last block first, so a chain's tail is evicted before its head */
    for (int i = q->n_blocks - 1; i >= 0; i--) release_block(pool, q->block_table[i]);
    q->alive = 0;
    q->n_blocks = q->length = 0;
    return KV_OK;
}

kv_status kv_pool_seq_fork(kv_pool *pool, int seq, int *child) {
    kv_status status = kv_pool_seq_check(pool, seq);
    if (status != KV_OK) return status;
    status = new_slot(pool, child);
    if (status != KV_OK) return status;
    kv_seq *parent = &pool->seqs[seq], *copy = &pool->seqs[*child];
    for (int i = 0; i < parent->n_blocks; i++) {
        copy->block_table[i] = parent->block_table[i];
        retain_block(pool, parent->block_table[i]);
    }
    copy->n_blocks = parent->n_blocks;
    copy->length = parent->length;
    if (pool->window > 0) {   /* the window's rows are the sequence's own: the child copies them */
        size_t floats = window_floats_per_seq(pool);
        memcpy(window_rows(pool->window_key, pool, *child, 0),
               window_rows(pool->window_key, pool, seq, 0), floats * sizeof(float));
        memcpy(window_rows(pool->window_value, pool, *child, 0),
               window_rows(pool->window_value, pool, seq, 0), floats * sizeof(float));
    }
    return KV_OK;
}

kv_status kv_pool_reuse_prefix(kv_pool *pool, int seq, const int32_t *tokens, int max_tokens,
                               int *n_reused) {
    kv_status status = kv_pool_seq_check(pool, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &pool->seqs[seq];
    if (q->length != 0 || max_tokens < 0 || (tokens == NULL && max_tokens > 0))
        return KV_ERR_INVALID_ARG;
    int n_full = pool->window > 0 || !pool->prefix_cache ? 0 : max_tokens / pool->block_size;
    if (n_full > pool->max_blocks_per_seq) n_full = pool->max_blocks_per_seq;
    int32_t parent = -1;
    for (int i = 0; i < n_full; i++) {
        int32_t b = lookup(pool, parent, tokens + (size_t)i * pool->block_size);
        if (b < 0) {
            pool->prefix_misses += n_full - i;
            break;
        }
        pool->prefix_hits++;
        retain_block(pool, b);
        q->block_table[q->n_blocks++] = b;
        parent = b;
    }
    q->length = q->n_blocks * pool->block_size;
    *n_reused = q->length;
    return KV_OK;
}

/* ---- writing rows: reserve, write, commit -------------------------------------------------- */

int kv_pool_blocks_available(const kv_pool *pool) { return blocks_available(pool); }

kv_status kv_pool_blocks_needed(const kv_pool *pool, int seq, int n_tokens, int *needed) {
    kv_status status = kv_pool_seq_check(pool, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->seqs[seq];
    if (n_tokens <= 0 || n_tokens > (1 << 30) - q->length) return KV_ERR_INVALID_ARG;
    int32_t last = q->n_blocks > 0 ? q->block_table[q->n_blocks - 1] : -1;
    int copy_last = q->length % pool->block_size > 0 && pool->ref_count[last] > 1;
    int new_blocks = blocks_for(pool, q->length + n_tokens) - q->n_blocks;
    if (q->n_blocks + new_blocks > pool->max_blocks_per_seq) return KV_ERR_TABLE_FULL;
    *needed = new_blocks + copy_last;
    return KV_OK;
}

kv_status kv_pool_reserve(kv_pool *pool, int seq, int n_tokens) {
    kv_seq *q = &pool->seqs[seq];
    int bs = pool->block_size, needed;
    kv_status status = kv_pool_blocks_needed(pool, seq, n_tokens, &needed);
    if (status != KV_OK) return status;
    if (needed > blocks_available(pool)) return KV_ERR_OUT_OF_BLOCKS;
    int partial_rows = q->length % bs;
    int32_t last = q->n_blocks > 0 ? q->block_table[q->n_blocks - 1] : -1;
    int copy_last = partial_rows > 0 && pool->ref_count[last] > 1;
    int new_blocks = blocks_for(pool, q->length + n_tokens) - q->n_blocks;

    /* From here on nothing can fail. */
    if (copy_last) {
        /* copy-on-write: this sequence is about to write row partial_rows of a block that
         * another sequence also reads; it gets its own copy and leaves the original alone */
        int32_t copy = take_block(pool);
        for (int layer = 0; layer < pool->n_layers; layer++) {   /* K and V of every layer */
            kv_store_copy(&pool->key, layer, (size_t)copy * bs, (size_t)last * bs,
                          (size_t)partial_rows);
            kv_store_copy(&pool->value, layer, (size_t)copy * bs, (size_t)last * bs,
                          (size_t)partial_rows);
        }
        memcpy(pool->tokens + (size_t)copy * bs, pool->tokens + (size_t)last * bs,
               (size_t)partial_rows * sizeof(int32_t));
        pool->fill[copy] = partial_rows;
        release_block(pool, last);
        q->block_table[q->n_blocks - 1] = copy;
    }
    for (int i = 0; i < new_blocks; i++) q->block_table[q->n_blocks++] = take_block(pool);
    return KV_OK;
}

kv_layer_view kv_pool_layer_view(const kv_pool *pool, int seq, int layer) {
    kv_layer_view view = {&pool->key, &pool->value, layer, pool->seqs[seq].block_table,
                          pool->block_size, pool->window, NULL, NULL, NULL, NULL,
                          pool->seqs[seq].length};
    if (pool->window > 0) {
        view.window_key = window_rows(pool->window_key, pool, seq, layer);
        view.window_value = window_rows(pool->window_value, pool, seq, layer);
    }
    return view;
}

void kv_pool_commit(kv_pool *pool, int seq, const int32_t *tokens, int n_tokens) {
    kv_seq *q = &pool->seqs[seq];
    int bs = pool->block_size, old_length = q->length;
    for (int t = 0; t < n_tokens; t++) {
        int pos = old_length + t;
        int32_t b = q->block_table[pos / bs];
        pool->tokens[(size_t)b * bs + pos % bs] = tokens[t];
        if (pool->fill[b] < pos % bs + 1) pool->fill[b] = pos % bs + 1;
    }
    q->length = old_length + n_tokens;
    /* Blocks that became full in this call join the prefix cache (unless it is off, and
     * not with a residual window: kv_pool_reuse_prefix could never hand them out). A block the cache already
     * knows (two sequences computed the same prefix side by side, as a batch does) is a
     * duplicate: the sequence switches to the known block and this copy is freed, so the
     * memory is shared and the next blocks chain on from a registered parent. The K and V
     * are the same bits, since the core computes a prefix the same way every time. */
    int cacheable = pool->window == 0 && pool->prefix_cache;
    for (int i = old_length / bs; cacheable && i < q->length / bs; i++) {
        int32_t b = q->block_table[i], parent = i > 0 ? q->block_table[i - 1] : -1;
        int32_t twin = parent < 0 || pool->registered[parent]
                           ? lookup(pool, parent, pool->tokens + (size_t)b * bs) : -1;
        if (twin >= 0 && twin != b) {
            retain_block(pool, twin);
            q->block_table[i] = twin;
            release_block(pool, b);
        } else {
            register_full_block(pool, b, parent);
        }
    }
}

kv_status kv_pool_append(kv_pool *pool, int seq, const int32_t *tokens, int n_tokens,
                         const float *keys, const float *values) {
    kv_status status = kv_pool_seq_check(pool, seq);
    if (status != KV_OK) return status;
    if (tokens == NULL || keys == NULL || values == NULL || n_tokens <= 0)
        return KV_ERR_INVALID_ARG;
    status = kv_pool_reserve(pool, seq, n_tokens);
    if (status != KV_OK) return status;
    size_t row = row_floats(pool), token_stride = (size_t)pool->n_layers * row;
    int start = pool->seqs[seq].length;
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
    kv_pool_commit(pool, seq, tokens, n_tokens);
    return KV_OK;
}

kv_status kv_pool_gather(const kv_pool *pool, int seq, float *keys, float *values) {
    kv_status status = kv_pool_seq_check(pool, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->seqs[seq];
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

/* ---- looking at it ---------------------------------------------------------------------------- */

kv_status kv_pool_stats_get(const kv_pool *pool, kv_pool_stats *stats) {
    memset(stats, 0, sizeof *stats);
    for (int b = 0; b < pool->num_blocks; b++) {
        if (pool->ref_count[b] > 0) {
            stats->blocks_used++;
            stats->tokens_stored += pool->fill[b];
        }
    }
    stats->blocks_free = pool->n_free;
    stats->blocks_cached = pool->n_cached;
    stats->slots_unused = (int64_t)stats->blocks_used * pool->block_size - stats->tokens_stored;
    for (int s = 0; s < pool->max_seqs; s++) stats->n_sequences += pool->seqs[s].alive;
    stats->prefix_hits = pool->prefix_hits;
    stats->prefix_misses = pool->prefix_misses;
    return KV_OK;
}

#define BROKEN(...)                                        \
    do {                                                   \
        snprintf(message, message_size, __VA_ARGS__);      \
        status = KV_ERR_CORRUPT;                           \
        goto fail;                                         \
    } while (0)

kv_status kv_pool_check(const kv_pool *pool, char *message, size_t message_size) {
    kv_status status = KV_OK;
    int n = pool->num_blocks, bs = pool->block_size;
    int32_t *refs = calloc((size_t)n, sizeof(int32_t));
    uint8_t *where = calloc((size_t)n, 1);   /* 1 free, 2 cached */
    if (message_size > 0) message[0] = '\0';
    KV_CHECK(refs != NULL && where != NULL, KV_ERR_NOMEM);

    for (int s = 0; s < pool->max_seqs; s++) {
        const kv_seq *q = &pool->seqs[s];
        if (!q->alive) continue;
        if (q->length < 0 || q->n_blocks != blocks_for(pool, q->length) ||
            q->n_blocks > pool->max_blocks_per_seq)
            BROKEN("sequence %d: length %d does not fit its %d blocks", s, q->length, q->n_blocks);
        for (int i = 0; i < q->n_blocks; i++) {
            int32_t b = q->block_table[i];
            if (b < 0 || b >= n) BROKEN("sequence %d: block id %d out of range", s, b);
            refs[b]++;
            int rows = i < q->n_blocks - 1 ? bs : q->length - i * bs;
            if (pool->fill[b] < rows)
                BROKEN("sequence %d reads %d rows of block %d, which holds %d", s, rows, b,
                       pool->fill[b]);
        }
    }
    for (int i = 0; i < pool->n_free; i++) {
        int32_t b = pool->free_stack[i];
        if (b < 0 || b >= n || where[b]) BROKEN("free stack holds block %d twice or out of range", b);
        where[b] = 1;
    }
    int cached = 0;
    for (int32_t b = pool->lru_head, prev = -1; b >= 0; prev = b, b = pool->lru_next[b]) {
        if (where[b] || pool->lru_prev[b] != prev || ++cached > n)
            BROKEN("LRU list is broken at block %d", b);
        if (!pool->registered[b]) BROKEN("cached block %d is not in the prefix cache", b);
        where[b] = 2;
    }
    if (cached != pool->n_cached) BROKEN("LRU holds %d blocks, n_cached says %d", cached, pool->n_cached);
    for (int b = 0; b < n; b++) {
        if (pool->ref_count[b] != refs[b])
            BROKEN("block %d: ref_count %d but %d block-table entries", b, pool->ref_count[b], refs[b]);
        if ((refs[b] > 0) == (where[b] != 0))
            BROKEN("block %d is %s", b, refs[b] > 0 ? "both used and free/cached"
                                                     : "neither used, free nor cached");
        if (pool->registered[b] && pool->fill[b] != bs)
            BROKEN("block %d is in the prefix cache but not full", b);
        if (pool->registered[b]) {
            int32_t link = pool->bucket_head[pool->hash[b] & (uint64_t)(pool->n_buckets - 1)];
            while (link >= 0 && link != b) link = pool->bucket_next[link];
            if (link != b) BROKEN("block %d is registered but missing from its hash bucket", b);
        }
    }
fail:
    free(refs);
    free(where);
    return status;
}
