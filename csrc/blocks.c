/* [quote ch04-the-design] */
/* blocks.c: the block manager of the paged pool: block tables, reference counts,
 * copy-on-write, prefix caching. No K or V here.
 *
 * A contiguous cache reserves max_seq_len positions per request up front; a paged pool
 * hands memory out one block of block_size positions at a time, when a sequence actually
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
 * table. This file decides which block holds which rows; it never touches a row. When rows
 * must move (copy-on-write), kv_blocks_reserve returns the copy, and the owner of the
 * stores performs it: paged.c on the CPU, kvlab/cuda.py on the GPU.
 */
/* [end ch04-the-design] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kvlab.h"

#define ROOT_HASH 0x6b766c6162ULL  /* the "parent hash" of a sequence's first block */

static int blocks_for(const kv_blocks *p, int length) {
    return (int)kv_ceil_div(length, p->block_size);
}

/* Where row `row` of a sequence is among the rows of its blocks, counted from its first
 * block's row 0: past the rows dropped from its front (kv_seq.start). Block row_at / bs,
 * row row_at % bs of it. */
static int row_at(const kv_seq *q, int row) { return q->start + row; }

/* ---- setup --------------------------------------------------------------------------- */

kv_status kv_blocks_init(kv_blocks *p, int num_blocks, int block_size, int max_seqs,
                         int max_blocks_per_seq) {
    kv_status status = KV_OK;
    memset(p, 0, sizeof *p);
    KV_CHECK(num_blocks > 0 && block_size >= 1 && block_size <= KV_MAX_BLOCK_SIZE && max_seqs > 0 &&
             max_blocks_per_seq > 0, KV_ERR_INVALID_ARG);
    KV_CHECK(num_blocks <= (1 << 24) && (int64_t)num_blocks * block_size <= ((int64_t)1 << 32) &&
             max_seqs <= (1 << 20) &&
             (int64_t)max_seqs * max_blocks_per_seq <= ((int64_t)1 << 28), KV_ERR_INVALID_ARG);
    p->num_blocks = num_blocks;
    p->block_size = block_size;
    p->prefix_cache = 1;
    p->max_seqs = max_seqs;
    p->max_blocks_per_seq = max_blocks_per_seq;
    p->hash_mask = ~(uint64_t)0;

    size_t n = (size_t)num_blocks;
    p->n_buckets = 1;
    while (p->n_buckets < num_blocks) p->n_buckets *= 2;
    p->ref_count = calloc(n, sizeof(int32_t));
    p->fill = calloc(n, sizeof(int32_t));
    p->tokens = calloc(n * block_size, sizeof(int32_t));
    p->free_stack = malloc(n * sizeof(int32_t));
    p->hash = calloc(n, sizeof(uint64_t));
    p->parent = malloc(n * sizeof(int32_t));
    p->generation = calloc(n, sizeof(uint32_t));
    p->parent_generation = calloc(n, sizeof(uint32_t));
    p->registered = calloc(n, 1);
    p->bucket_head = malloc((size_t)p->n_buckets * sizeof(int32_t));
    p->bucket_next = malloc(n * sizeof(int32_t));
    p->lru_prev = malloc(n * sizeof(int32_t));
    p->lru_next = malloc(n * sizeof(int32_t));
    p->seqs = calloc((size_t)max_seqs, sizeof(kv_seq));
    p->tables = calloc((size_t)max_seqs * max_blocks_per_seq, sizeof(int32_t));
    KV_CHECK(p->ref_count && p->fill && p->tokens && p->free_stack && p->hash && p->parent &&
             p->generation && p->parent_generation && p->registered && p->bucket_head &&
             p->bucket_next && p->lru_prev && p->lru_next && p->seqs && p->tables,
             KV_ERR_NOMEM);
    /* pushed in reverse so that block 0 is handed out first: easier to follow on screen */
    for (int b = 0; b < num_blocks; b++) {
        p->free_stack[b] = num_blocks - 1 - b;
        p->parent[b] = -1;
        p->bucket_next[b] = p->lru_prev[b] = p->lru_next[b] = -1;
    }
    p->n_free = num_blocks;
    for (int i = 0; i < p->n_buckets; i++) p->bucket_head[i] = -1;
    p->lru_head = p->lru_tail = -1;
    for (int s = 0; s < max_seqs; s++)
        p->seqs[s].block_table = p->tables + (size_t)s * max_blocks_per_seq;
    return KV_OK;
fail:
    kv_blocks_free(p);
    return status;
}

void kv_blocks_free(kv_blocks *p) {
    if (p == NULL) return;
    void *buffers[] = {p->ref_count, p->fill, p->tokens, p->free_stack, p->hash, p->parent,
                       p->generation, p->parent_generation, p->registered, p->bucket_head,
                       p->bucket_next, p->lru_prev, p->lru_next, p->seqs, p->tables, p->events};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) free(buffers[i]);
    memset(p, 0, sizeof *p);
}

kv_status kv_blocks_seq_check(const kv_blocks *p, int seq) {
    if (p->seqs == NULL || seq < 0 || seq >= p->max_seqs || !p->seqs[seq].alive)
        return KV_ERR_NO_SEQUENCE;
    return KV_OK;
}

/* ---- the event log ------------------------------------------------------------------------ */

void kv_blocks_record_events(kv_blocks *p, int on) {
    p->record_events = on;
    if (!on) p->n_events = 0;
}

/* An event about a block, concerning no sequence yet (the caller fills in the rest). */
static kv_block_event about(kv_event_kind kind, int32_t block) {
    return (kv_block_event){kind, block, 0, -1, -1, -1, 0, 0};
}

static kv_block_event about_seq(kv_event_kind kind, int32_t block, int seq, int index) {
    kv_block_event event = about(kind, block);
    event.seq = seq;
    event.index = index;
    return event;
}

/* Appends one event, with the block's reference count now, when recording. It cannot fail
 * the operation that calls it: if the log cannot grow, the event is dropped and
 * events_lost says so to whoever reads the log. */
static void note(kv_blocks *p, kv_block_event event) {
    if (!p->record_events) return;
    if (p->n_events == p->events_capacity) {
        size_t capacity = p->events_capacity ? 2 * p->events_capacity : 64;
        kv_block_event *grown = realloc(p->events, capacity * sizeof *grown);
        if (grown == NULL) {
            p->events_lost = 1;
            return;
        }
        p->events = grown;
        p->events_capacity = capacity;
    }
    event.refs = p->ref_count[event.block];
    p->events[p->n_events++] = event;
}

/* ---- the LRU list of cached (unreferenced, registered) blocks --------------------------- */

static void lru_remove(kv_blocks *p, int32_t b) {
    int32_t prev = p->lru_prev[b], next = p->lru_next[b];
    if (prev >= 0) p->lru_next[prev] = next; else p->lru_head = next;
    if (next >= 0) p->lru_prev[next] = prev; else p->lru_tail = prev;
    p->lru_prev[b] = p->lru_next[b] = -1;
    p->n_cached--;
}

static void lru_push_most_recent(kv_blocks *p, int32_t b) {
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

/* [quote ch04-chain-hash-and-lookup] */
static uint64_t chain_hash(const kv_blocks *p, int32_t parent, const int32_t *tokens) {
    uint64_t h = parent >= 0 ? p->hash[parent] : ROOT_HASH;
    for (int i = 0; i < p->block_size; i++) h = splitmix64(h ^ (uint32_t)tokens[i]);
    return h & p->hash_mask;
}

/* The registered block that continues `parent` with exactly these tokens, or -1.
 * The hash only narrows the search: a match must have the same parent block, in the same
 * generation (not evicted and reused since), and the same tokens, so a hash collision
 * can never hand out the wrong K and V. */
static int32_t lookup(const kv_blocks *p, int32_t parent, const int32_t *tokens) {
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
/* [end ch04-chain-hash-and-lookup] */

static void unregister(kv_blocks *p, int32_t b) {
    int32_t *link = &p->bucket_head[p->hash[b] & (uint64_t)(p->n_buckets - 1)];
    while (*link != b) link = &p->bucket_next[*link];
    *link = p->bucket_next[b];
    p->bucket_next[b] = -1;
    p->registered[b] = 0;
}

/* Offers a block that just became full to the prefix cache. */
static void register_full_block(kv_blocks *p, int32_t b, int32_t parent) {
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

/* [quote ch04-take-block-release-block-retain-block] */
int kv_blocks_available(const kv_blocks *p) { return p->n_free + p->n_cached; }

/* A block for new rows: a free one, else the least recently used cached one. Callers
 * check kv_blocks_available() first, so this cannot fail. */
static int32_t take_block(kv_blocks *p) {
    int32_t b;
    if (p->n_free > 0) {
        b = p->free_stack[--p->n_free];
    } else {
        b = p->lru_head;
        lru_remove(p, b);
        unregister(p, b);     /* evicted: its K and V are about to be overwritten */
        note(p, about(KV_EVENT_EVICTED, b));
    }
    p->ref_count[b] = 1;
    p->fill[b] = 0;
    p->parent[b] = -1;
    p->generation[b]++;       /* cached children of its old content no longer match */
    return b;
}

/* Drops one reference; an unreferenced block becomes cached (if registered) or free. */
static void release_block(kv_blocks *p, int32_t b) {
    if (--p->ref_count[b] > 0) {
        note(p, about(KV_EVENT_RELEASED, b));
        return;
    }
    if (p->registered[b])
        lru_push_most_recent(p, b);
    else
        p->free_stack[p->n_free++] = b;
    kv_block_event freed = about(KV_EVENT_FREED, b);
    freed.cached = p->registered[b];
    note(p, freed);
}

/* A new reference to a block, taking it off the LRU list if it was only cached. */
static void retain_block(kv_blocks *p, int32_t b) {
    if (p->ref_count[b]++ == 0) lru_remove(p, b);
}
/* [end ch04-take-block-release-block-retain-block] */

/* ---- sequences ---------------------------------------------------------------------------- */

kv_status kv_blocks_seq_new(kv_blocks *p, int *seq) {
    if (p->seqs == NULL) return KV_ERR_INVALID_ARG;
    for (int s = 0; s < p->max_seqs; s++) {
        if (!p->seqs[s].alive) {
            kv_seq *q = &p->seqs[s];
            q->alive = 1;
            q->n_blocks = q->start = q->length = q->reserved = q->next_position = 0;
            q->compacted = 0;
            q->copied_from = -1;
            q->serial++;
            *seq = s;
            return KV_OK;
        }
    }
    return KV_ERR_TOO_MANY_SEQUENCES;
}

/* [quote ch04-kv-blocks-seq-free] */
kv_status kv_blocks_seq_free(kv_blocks *p, int seq) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &p->seqs[seq];
    /* last block first, so a chain's tail is evicted before its head */
    for (int i = q->n_blocks - 1; i >= 0; i--) release_block(p, q->block_table[i]);
    q->alive = 0;
    q->n_blocks = q->start = q->length = q->reserved = q->next_position = q->compacted = 0;
    q->copied_from = -1;
    return KV_OK;
}
/* [end ch04-kv-blocks-seq-free] */

/* [quote ch04-kv-blocks-seq-fork] */
kv_status kv_blocks_seq_fork(kv_blocks *p, int seq, int *child) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    if (p->seqs[seq].reserved > 0) return KV_ERR_PENDING;   /* its last blocks hold nothing yet */
    status = kv_blocks_seq_new(p, child);
    if (status != KV_OK) return status;
    kv_seq *parent = &p->seqs[seq], *copy = &p->seqs[*child];
    for (int i = 0; i < parent->n_blocks; i++) {
        copy->block_table[i] = parent->block_table[i];
        retain_block(p, parent->block_table[i]);
        note(p, about_seq(KV_EVENT_SHARED, parent->block_table[i], *child, i));
    }
    copy->n_blocks = parent->n_blocks;
    copy->start = parent->start;      /* the same rows in the same blocks */
    copy->length = parent->length;
    copy->next_position = parent->next_position;
    copy->compacted = parent->compacted;
    return KV_OK;
}
/* [end ch04-kv-blocks-seq-fork] */

/* [quote ch04-kv-blocks-reuse-prefix] */
kv_status kv_blocks_reuse_prefix(kv_blocks *p, int seq, const int32_t *tokens, int max_tokens,
                                 int *n_reused) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &p->seqs[seq];
    if (q->reserved > 0) return KV_ERR_PENDING;
    if (q->length != 0 || max_tokens < 0 || (tokens == NULL && max_tokens > 0))
        return KV_ERR_INVALID_ARG;
    int n_full = p->prefix_cache ? max_tokens / p->block_size : 0;
    if (n_full > p->max_blocks_per_seq) n_full = p->max_blocks_per_seq;
    int32_t parent = -1;
    for (int i = 0; i < n_full; i++) {
        int32_t b = lookup(p, parent, tokens + (size_t)i * p->block_size);
        if (b < 0) {
            p->prefix_misses += n_full - i;
            break;
        }
        p->prefix_hits++;
        retain_block(p, b);
        q->block_table[q->n_blocks++] = b;
        kv_block_event hit = about_seq(KV_EVENT_SHARED, b, seq, i);
        hit.prefix_hit = 1;
        note(p, hit);
        parent = b;
    }
    q->length = q->next_position = q->n_blocks * p->block_size;
    *n_reused = q->length;
    return KV_OK;
}
/* [end ch04-kv-blocks-reuse-prefix] */

/* Which blocks kv_blocks_reuse_prefix's walk from the root can reach (see kvlab.h). A
 * registered block is reachable when its parent is, in the generation it was registered
 * under (lookup's test); the passes settle one level of every chain each, so a chain's
 * depth (at most max_blocks_per_seq) bounds them, and a block still unsettled after them
 * (a chain that never reaches the root) is not findable. */
void kv_blocks_findable(const kv_blocks *p, int32_t *findable) {
    enum { UNSETTLED = -3, NOT_FOUND = -2 };
    for (int b = 0; b < p->num_blocks; b++)
        findable[b] = p->prefix_cache && p->registered[b] ? UNSETTLED : NOT_FOUND;
    for (int changed = 1, pass = 0; changed && pass <= p->max_blocks_per_seq; pass++) {
        changed = 0;
        for (int b = 0; b < p->num_blocks; b++) {
            if (findable[b] != UNSETTLED) continue;
            int32_t parent = p->parent[b];
            if (parent < 0) findable[b] = -1;
            else if (findable[parent] == NOT_FOUND ||
                     p->parent_generation[b] != p->generation[parent]) findable[b] = NOT_FOUND;
            else if (findable[parent] != UNSETTLED) findable[b] = parent;
            changed |= findable[b] != UNSETTLED;
        }
    }
    for (int b = 0; b < p->num_blocks; b++)
        if (findable[b] == UNSETTLED) findable[b] = NOT_FOUND;
}

/* [quote ch09-kv-blocks-truncate] */
kv_status kv_blocks_truncate(kv_blocks *p, int seq, int length) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &p->seqs[seq];
    if (q->reserved > 0) return KV_ERR_PENDING;
    if (length < 0 || length > q->length) return KV_ERR_INVALID_ARG;
    if (length == 0) q->start = 0;        /* no row left: no block either */
    int keep = blocks_for(p, row_at(q, length));
    for (int i = q->n_blocks - 1; i >= keep; i--) release_block(p, q->block_table[i]);
    q->n_blocks = keep;
    q->next_position = length == 0 ? 0 : q->next_position - (q->length - length);
    if (length == 0) q->compacted = 0;    /* empty: row i holds position i again */
    q->length = length;
    int rows = row_at(q, length) % p->block_size;
    if (rows > 0 && p->ref_count[q->block_table[keep - 1]] == 1) {
        /* its own block, cut: rows past the cut will be overwritten, so it may no longer be
         * found by its tokens, nor may blocks cached after it (a new generation) */
        int32_t b = q->block_table[keep - 1];
        if (p->registered[b]) unregister(p, b);
        p->generation[b]++;
        p->fill[b] = rows;
    }
    return KV_OK;
}
/* [end ch09-kv-blocks-truncate] */

/* ---- writing rows: reserve, (the owner writes them), commit ---------------------------- */

kv_status kv_blocks_needed(const kv_blocks *p, int seq, int n_tokens, int *needed) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &p->seqs[seq];
    if (q->reserved > 0) return KV_ERR_PENDING;
    /* at most 2**30 positions: rows, and positions too (next_position, which a sequence
     * that dropped rows carries past its length), so that neither ever overflows */
    if (n_tokens <= 0 || n_tokens > (1 << 30) - q->next_position) return KV_ERR_INVALID_ARG;
    int32_t last = q->n_blocks > 0 ? q->block_table[q->n_blocks - 1] : -1;
    int copy_last = row_at(q, q->length) % p->block_size > 0 && p->ref_count[last] > 1;
    int new_blocks = blocks_for(p, row_at(q, q->length) + n_tokens) - q->n_blocks;
    if (q->n_blocks + new_blocks > p->max_blocks_per_seq) return KV_ERR_TABLE_FULL;
    *needed = new_blocks + copy_last;
    return KV_OK;
}

/* [quote ch04-kv-blocks-reserve] */
kv_status kv_blocks_reserve(kv_blocks *p, int seq, int n_tokens, kv_block_copy *copies,
                            int *n_copies) {
    int bs = p->block_size, needed;
    kv_status status = kv_blocks_needed(p, seq, n_tokens, &needed);
    if (status != KV_OK) return status;
    if (needed > kv_blocks_available(p)) return KV_ERR_OUT_OF_BLOCKS;
    kv_seq *q = &p->seqs[seq];
    int partial_rows = row_at(q, q->length) % bs;   /* (rows its start passed included) */
    int32_t last = q->n_blocks > 0 ? q->block_table[q->n_blocks - 1] : -1;
    int copy_last = partial_rows > 0 && p->ref_count[last] > 1;
    int new_blocks = blocks_for(p, row_at(q, q->length) + n_tokens) - q->n_blocks;

    /* From here on nothing can fail. */
    *n_copies = 0;
    q->copied_from = -1;
    if (copy_last) {
        /* copy-on-write: this sequence is about to write row partial_rows of a block that
         * another sequence also reads; it gets its own copy and leaves the original alone.
         * The original keeps a reference (its other reader), so nothing can evict it
         * before the caller has copied its rows. */
        int32_t copy = take_block(p);
        memcpy(p->tokens + (size_t)copy * bs, p->tokens + (size_t)last * bs,
               (size_t)partial_rows * sizeof(int32_t));
        p->fill[copy] = partial_rows;
        q->block_table[q->n_blocks - 1] = copy;
        kv_block_event copied = about_seq(KV_EVENT_COPIED, copy, seq, q->n_blocks - 1);
        copied.other = last;
        note(p, copied);
        q->copied_from = last;              /* for a cancel: the block to go back to */
        q->copied_generation = p->generation[last];
        release_block(p, last);
        copies[(*n_copies)++] = (kv_block_copy){copy, last, partial_rows};
    } else if (partial_rows > 0 && p->registered[last]) {
        /* a full block the prefix cache knows, cut by a truncate and now this sequence's
         * alone: its rows past the cut are about to change, so it leaves the cache first
         * (and blocks cached after it with it: a new generation) */
        unregister(p, last);
        p->generation[last]++;
        p->fill[last] = partial_rows;
    }
    for (int i = 0; i < new_blocks; i++) {
        int32_t b = take_block(p);
        note(p, about_seq(KV_EVENT_ALLOCATED, b, seq, q->n_blocks));
        q->block_table[q->n_blocks++] = b;
    }
    q->reserved = n_tokens;
    return KV_OK;
}
/* [end ch04-kv-blocks-reserve] */

kv_status kv_blocks_commit(kv_blocks *p, int seq, const int32_t *tokens, int n_tokens) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &p->seqs[seq];
    int bs = p->block_size, old_length = q->length;
    if (tokens == NULL || n_tokens <= 0 || n_tokens != q->reserved)
        return KV_ERR_INVALID_ARG;           /* not what was reserved: no blocks to hold them */
    q->reserved = 0;
    q->copied_from = -1;
    for (int t = 0; t < n_tokens; t++) {
        int at = row_at(q, old_length + t);
        int32_t b = q->block_table[at / bs];
        p->tokens[(size_t)b * bs + at % bs] = tokens[t];
        if (p->fill[b] < at % bs + 1) p->fill[b] = at % bs + 1;
    }
    q->length = old_length + n_tokens;
    q->next_position += n_tokens;
    /* Blocks that became full in this call join the prefix cache (unless it is off). A
     * block the cache already knows (two sequences computed the same prefix side by side,
     * as a batch does) is a duplicate: the sequence switches to the known block and this
     * copy is freed, so the memory is shared and the next blocks chain on from a registered
     * parent. The K and V are the same bits, since the core computes a prefix the same way
     * every time. (Only a sequence that dropped no row offers blocks: its start is 0, row i
     * in block i / bs.) */
    for (int i = old_length / bs; p->prefix_cache && !q->compacted && i < q->length / bs; i++) {
        int32_t b = q->block_table[i], parent = i > 0 ? q->block_table[i - 1] : -1;
        int32_t twin = parent < 0 || p->registered[parent]
                           ? lookup(p, parent, p->tokens + (size_t)b * bs) : -1;
        if (twin >= 0 && twin != b) {
            retain_block(p, twin);
            q->block_table[i] = twin;
            kv_block_event shared = about_seq(KV_EVENT_SHARED, twin, seq, i);
            shared.other = b;              /* the duplicate it replaces */
            note(p, shared);
            release_block(p, b);
        } else {
            register_full_block(p, b, parent);
        }
    }
    return KV_OK;
}

/* Whether the shared block q's pending copy-on-write copied from still holds the rows the
 * copy holds: not taken again since (its generation), still read by someone, and its rows
 * up to the copy's end recording the same tokens (its other reader, alone with it after
 * the copy, may have cut it and written others). */
static int copied_block_unchanged(const kv_blocks *p, const kv_seq *q, int32_t copy) {
    int32_t src = q->copied_from;
    size_t bs = (size_t)p->block_size;
    int rows = row_at(q, q->length) % p->block_size;
    return src >= 0 && p->ref_count[src] >= 1 && p->generation[src] == q->copied_generation &&
           p->fill[src] >= rows &&
           memcmp(p->tokens + (size_t)src * bs, p->tokens + (size_t)copy * bs,
                  (size_t)rows * sizeof(int32_t)) == 0;
}

/* The cancel of seq's pending reservation: the blocks past its length go back, then, if
 * the reservation copied a shared block and `give_back` says so, the sequence reads the
 * shared block again and the copy is freed. */
static void cancel(kv_blocks *p, int seq, int give_back) {
    kv_seq *q = &p->seqs[seq];
    /* the blocks past the length hold no row of it: they go back as a truncate's do (a
     * block cut in two stays, its rows before the cut intact) */
    int keep = blocks_for(p, row_at(q, q->length));
    for (int i = q->n_blocks - 1; i >= keep; i--) release_block(p, q->block_table[i]);
    q->n_blocks = keep;
    int32_t src = q->copied_from, index = keep - 1;   /* (the block that was copied) */
    if (q->reserved > 0 && src >= 0 && give_back) {
        /* The sequence reads the shared block again: its other readers kept it, rows and
         * all (the copy only read it). The copy goes back to the free stack, never to the
         * prefix cache: a failed copy may have written some of its rows. (Its generation,
         * counted up when it was taken, stays so: a free block's generation matches
         * nothing.) */
        int32_t copy = q->block_table[index];
        retain_block(p, src);
        q->block_table[index] = src;
        kv_block_event back = about_seq(KV_EVENT_SHARED, src, seq, index);
        back.other = copy;               /* the copy it replaces, freed next */
        note(p, back);
        release_block(p, copy);
    }
    q->reserved = 0;
    q->copied_from = -1;
}

kv_status kv_blocks_cancel(kv_blocks *p, int seq) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &p->seqs[seq];
    int keep = blocks_for(p, row_at(q, q->length));
    cancel(p, seq, q->reserved > 0 && q->copied_from >= 0 &&
                   copied_block_unchanged(p, q, q->block_table[keep - 1]));
    return KV_OK;
}

kv_status kv_blocks_cancel_copy(kv_blocks *p, int seq, const kv_block_copy *copy) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    const kv_seq *q = &p->seqs[seq];
    int index = blocks_for(p, row_at(q, q->length)) - 1;   /* the block that was copied */
    if (copy == NULL || q->reserved == 0 || index < 0 || q->block_table[index] != copy->dst ||
        copy->src < 0 || copy->src != q->copied_from || p->ref_count[copy->src] < 1)
        return KV_ERR_INVALID_ARG;   /* not the copy of this sequence's pending reservation */
    cancel(p, seq, 1);               /* the copy failed: its rows are not to be read */
    return KV_OK;
}

/* Releases the blocks of q wholly before its start (as the start just moved, maybe past
 * several): its first block is then the one that holds its row 0. */
static void release_front(kv_blocks *p, kv_seq *q) {
    int gone = q->start / p->block_size;
    for (int i = gone - 1; i >= 0; i--) release_block(p, q->block_table[i]);
    memmove(q->block_table, q->block_table + gone, (size_t)(q->n_blocks - gone) * sizeof(int32_t));
    q->n_blocks -= gone;
    q->start %= p->block_size;
}

kv_status kv_blocks_drop_rows(kv_blocks *p, int seq, int first, int n_keep) {
    kv_status status = kv_blocks_seq_check(p, seq);
    if (status != KV_OK) return status;
    kv_seq *q = &p->seqs[seq];
    if (q->reserved > 0) return KV_ERR_PENDING;
    if (first < -q->start || n_keep < 0 || n_keep > q->length - first) return KV_ERR_INVALID_ARG;
    for (int i = 0; i < q->n_blocks; i++)
        if (p->ref_count[q->block_table[i]] != 1) return KV_ERR_INVALID_ARG;
    /* Its rows no longer follow its tokens: no block of it may be found by them, nor any
     * block cached after it (a new generation). */
    for (int i = 0; i < q->n_blocks; i++) {
        int32_t b = q->block_table[i];
        if (p->registered[b]) unregister(p, b);
        p->generation[b]++;
    }
    int next_position = q->next_position;
    q->start += first;          /* row 0 is now the first kept row: no row moves */
    q->length -= first;
    kv_blocks_truncate(p, seq, n_keep);     /* the rows after the kept ones (checked above) */
    release_front(p, q);
    q->next_position = next_position;
    q->compacted = 1;
    return KV_OK;
}

/* ---- looking at it ---------------------------------------------------------------------------- */

kv_status kv_blocks_stats(const kv_blocks *p, kv_pool_stats *stats) {
    memset(stats, 0, sizeof *stats);
    for (int b = 0; b < p->num_blocks; b++) {
        if (p->ref_count[b] > 0) {
            stats->blocks_used++;
            stats->tokens_stored += p->fill[b];
        }
    }
    stats->blocks_free = p->n_free;
    stats->blocks_cached = p->n_cached;
    stats->slots_unused = (int64_t)stats->blocks_used * p->block_size - stats->tokens_stored;
    for (int s = 0; s < p->max_seqs; s++) stats->n_sequences += p->seqs[s].alive;
    stats->prefix_hits = p->prefix_hits;
    stats->prefix_misses = p->prefix_misses;
    return KV_OK;
}

#define BROKEN(...)                                        \
    do {                                                   \
        snprintf(message, message_size, __VA_ARGS__);      \
        status = KV_ERR_CORRUPT;                           \
        goto fail;                                         \
    } while (0)

kv_status kv_blocks_check(const kv_blocks *p, char *message, size_t message_size) {
    kv_status status = KV_OK;
    int n = p->num_blocks, bs = p->block_size;
    int32_t *refs = calloc((size_t)n, sizeof(int32_t));
    uint8_t *where = calloc((size_t)n, 1);   /* 1 free, 2 cached */
    if (message_size > 0) message[0] = '\0';
    KV_CHECK(refs != NULL && where != NULL, KV_ERR_NOMEM);

    for (int s = 0; s < p->max_seqs; s++) {
        const kv_seq *q = &p->seqs[s];
        if (!q->alive) continue;
        if (q->next_position < q->length || (!q->compacted && q->next_position != q->length))
            BROKEN("sequence %d: next position %d with %d rows%s", s, q->next_position,
                   q->length, q->compacted ? "" : " none dropped");
        if (q->start < 0 || q->start >= bs || (q->start > 0 && !q->compacted) ||
            (q->start > 0 && q->length + q->reserved == 0))
            BROKEN("sequence %d: start %d with %d rows%s", s, q->start, q->length,
                   q->compacted ? "" : " none dropped");
        if (q->length < 0 || q->reserved < 0 ||
            q->n_blocks != blocks_for(p, row_at(q, q->length + q->reserved)) ||
            q->n_blocks > p->max_blocks_per_seq)
            BROKEN("sequence %d: length %d (and %d reserved) from row %d of its first block "
                   "does not fit its %d blocks", s, q->length, q->reserved, q->start,
                   q->n_blocks);
        if (q->copied_from < -1 || q->copied_from >= n || (q->reserved == 0 && q->copied_from >= 0))
            BROKEN("sequence %d: a copy-on-write from block %d noted with %d rows reserved", s,
                   q->copied_from, q->reserved);
        for (int i = 0; i < q->n_blocks; i++) {
            int32_t b = q->block_table[i];
            if (b < 0 || b >= n) BROKEN("sequence %d: block id %d out of range", s, b);
            refs[b]++;
            int rows = row_at(q, q->length) - i * bs;   /* rows committed in this block */
            rows = rows > bs ? bs : rows < 0 ? 0 : rows;
            if (p->fill[b] < rows)
                BROKEN("sequence %d reads %d rows of block %d, which holds %d", s, rows, b,
                       p->fill[b]);
        }
    }
    for (int i = 0; i < p->n_free; i++) {
        int32_t b = p->free_stack[i];
        if (b < 0 || b >= n || where[b]) BROKEN("free stack holds block %d twice or out of range", b);
        where[b] = 1;
    }
    int cached = 0;
    for (int32_t b = p->lru_head, prev = -1; b >= 0; prev = b, b = p->lru_next[b]) {
        if (where[b] || p->lru_prev[b] != prev || ++cached > n)
            BROKEN("LRU list is broken at block %d", b);
        if (!p->registered[b]) BROKEN("cached block %d is not in the prefix cache", b);
        where[b] = 2;
    }
    if (cached != p->n_cached) BROKEN("LRU holds %d blocks, n_cached says %d", cached, p->n_cached);
    for (int b = 0; b < n; b++) {
        if (p->ref_count[b] != refs[b])
            BROKEN("block %d: ref_count %d but %d block-table entries", b, p->ref_count[b], refs[b]);
        if ((refs[b] > 0) == (where[b] != 0))
            BROKEN("block %d is %s", b, refs[b] > 0 ? "both used and free/cached"
                                                     : "neither used, free nor cached");
        if (p->registered[b] && p->fill[b] != bs)
            BROKEN("block %d is in the prefix cache but not full", b);
        if (p->registered[b]) {
            int32_t link = p->bucket_head[p->hash[b] & (uint64_t)(p->n_buckets - 1)];
            while (link >= 0 && link != b) link = p->bucket_next[link];
            if (link != b) BROKEN("block %d is registered but missing from its hash bucket", b);
        }
    }
fail:
    free(refs);
    free(where);
    return status;
}
