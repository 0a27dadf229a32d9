/* kvlab.h: the public C API of kvlab's inference core.
 *
 * Plain C11, no Python: a model is a config plus pointers into weight buffers that the
 * caller owns (NumPy arrays, a memory-mapped checkpoint ...), and a KV cache is memory
 * this core owns. Every function that can fail returns a kv_status; nothing here prints,
 * exits or touches Python. The Python binding (csrc/python/) is the only layer above this.
 */
#ifndef KVLAB_H
#define KVLAB_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KV_OK = 0,
    KV_ERR_NOMEM,          /* an allocation failed */
    KV_ERR_INVALID_ARG,    /* a size, count or pointer that makes no sense */
    KV_ERR_TOKEN_RANGE,    /* a token id outside [0, vocab_size) */
    KV_ERR_CACHE_FULL,     /* appending would pass the cache's capacity */
    KV_ERR_CACHE_MISMATCH, /* the cache was shaped for a different model */
    KV_ERR_OUT_OF_BLOCKS,  /* the paged pool has no free (or evictable) block left */
    KV_ERR_NO_SEQUENCE,    /* a sequence id that is not alive in this pool */
    KV_ERR_TABLE_FULL,     /* a sequence's block table has no room for another block */
    KV_ERR_TOO_MANY_SEQUENCES, /* every sequence slot of the pool is taken */
    KV_ERR_CORRUPT,        /* kv_pool_check found a broken invariant */
    KV_ERR_NOT_A_NUMBER,   /* logits with a NaN (or all -inf): no token can be sampled */
    KV_ERR_INTERRUPTED,    /* the caller's interrupt check asked a long call to stop */
    KV_ERR_PENDING,        /* a paged sequence's reservation is not committed yet */
    KV_ERR_STORE,          /* a pool's row store (kv_row_store: the GPU's) failed; it said why */
} kv_status;

/* A human-readable sentence for a status, for error messages. */
const char *kv_strerror(kv_status status);

/* ---- model ------------------------------------------------------------------------ */

typedef struct {
    int dim;              /* residual stream width */
    int hidden_dim;       /* SwiGLU MLP width */
    int n_layers;
    int n_heads;          /* query heads */
    int n_kv_heads;       /* key/value heads; divides n_heads (MHA, GQA, MQA) */
    int head_dim;
    int vocab_size;
    int max_seq_len;      /* the context the model was trained for */
    float norm_eps;       /* RMSNorm epsilon */
    int rope_interleaved; /* 1: rotate (x[2i], x[2i+1]) (llama2.c, Meta, GGUF);
                             0: rotate (x[i], x[i + head_dim/2]) (Hugging Face) */
} kv_config;

/* ---- how a weight matrix is stored ----------------------------------------------- */

/* Element formats of a weight matrix (out_dim rows of in_dim values; kvlab/weight_formats.py
 * defines each in NumPy). Every format's values are exact float32 numbers, so a product
 * over a matrix in any format gives, bit for bit, the float32 product over its values
 * dequantized: the formats change the bytes read, not the arithmetic. */
typedef enum {
    KV_WEIGHT_F32,    /* float32 */
    KV_WEIGHT_F16,    /* IEEE half */
    KV_WEIGHT_BF16,   /* the top 16 bits of a float32 */
    KV_WEIGHT_Q8_0,   /* GGUF's Q8_0: blocks of 32 values, each a half scale d and 32 int8
                         codes q, value = d * q; 34 bytes a block, in_dim a multiple of 32 */
    KV_WEIGHT_Q4_0,   /* GGUF's Q4_0: blocks of 32, a half d, then 16 bytes: byte j holds
                         value j's 4-bit code in its low nibble, value j + 16's in its high;
                         value = d * (code - 8); 18 bytes a block */
    KV_WEIGHT_Q4_1,   /* GGUF's Q4_1: blocks of 32, a half d, a half m, then the same 16
                         bytes of nibbles; value = d * code + m; 20 bytes a block */
} kv_weight_format;

#define KV_WEIGHT_LAST KV_WEIGHT_Q4_1   /* the last valid kv_weight_format */

#define KV_Q8_0_BLOCK 32        /* values per Q8_0 block */
#define KV_Q8_0_BLOCK_BYTES 34  /* its half scale, then its 32 codes */
#define KV_Q4_BLOCK 32          /* values per Q4_0 or Q4_1 block */
#define KV_Q4_0_BLOCK_BYTES 18  /* its half d, then 16 bytes of two codes each */
#define KV_Q4_1_BLOCK_BYTES 20  /* its half d, its half m, then 16 bytes of codes */

/* One weight matrix: rows of kv_weight_row_bytes(format, in_dim) bytes in caller-owned
 * memory (a layer's matrices stacked along a leading n_layers axis). A zeroed format is
 * float32, so code that knows only float32 weights sets data alone. */
typedef struct {
    const void *data;
    kv_weight_format format;
} kv_matrix;

/* Pointers into caller-owned buffers, row-major, matrices (out, in): y = W x. Per-layer
 * tensors are stacked along a leading n_layers axis. The norm vectors and RoPE's speeds
 * are always float32; each matrix has a format of its own. */
typedef struct {
    kv_matrix token_embedding;    /* (vocab_size, dim) */
    const float *attn_norm;       /* (n_layers, dim) */
    kv_matrix wq;                 /* (n_layers, n_heads * head_dim, dim) */
    kv_matrix wk;                 /* (n_layers, n_kv_heads * head_dim, dim) */
    kv_matrix wv;                 /* (n_layers, n_kv_heads * head_dim, dim) */
    kv_matrix wo;                 /* (n_layers, dim, n_heads * head_dim) */
    const float *ffn_norm;        /* (n_layers, dim) */
    kv_matrix w1;                 /* (n_layers, hidden_dim, dim)  gate */
    kv_matrix w2;                 /* (n_layers, dim, hidden_dim)  down */
    kv_matrix w3;                 /* (n_layers, hidden_dim, dim)  up */
    const float *final_norm;      /* (dim,) */
    kv_matrix classifier;         /* (vocab_size, dim); may equal token_embedding (tied) */
    const float *rope_inv_freq;   /* (head_dim / 2,) rotation speed of each pair */
} kv_weights;

typedef struct {
    kv_config config;
    kv_weights weights;
    int int8_activations;  /* 1: products with Q8_0, Q4_0 and Q4_1 matrices quantize the
                              activations to int8 too (kv_weights_matmul_int8, llama.cpp's
                              way: faster, not the
                              float32 product); 0: float32 activations, the product over the
                              dequantized matrix bit for bit */
} kv_model;

/* Checks that the config's sizes are positive and fit together (n_kv_heads divides
 * n_heads, head_dim even), that no weight pointer is NULL and that each matrix's format
 * suits its rows (Q8_0, Q4_0 and Q4_1 need rows of whole blocks of 32). */
kv_status kv_model_check(const kv_model *model);

/* Bytes of one row of in_dim values in a format; 0 if in_dim does not suit it. */
size_t kv_weight_row_bytes(kv_weight_format format, int in_dim);

/* out (n_tokens, out_dim) = x (n_tokens, in_dim) . w^T, w out_dim rows of
 * kv_weight_row_bytes(format, in_dim) bytes, on the process's kernel tier: what a model's
 * projections will do with weights in that format, for tests and benchmarks. */
kv_status kv_weights_matmul(float *out, const float *x, const uint8_t *w,
                            kv_weight_format format, int n_tokens, int in_dim, int out_dim);
/* The same product for Q8_0, Q4_0 or Q4_1 weights with the activations quantized to int8
 * per block of 32 (float32 scales) and integer dot products, as llama.cpp does: not the
 * float32 product, x is rounded too (kvlab.weight_formats.matmul_int8 is its NumPy twin).
 * Every weight code works, Q8_0's -128 too. KV_ERR_INVALID_ARG for any other format. */
kv_status kv_weights_matmul_int8(float *out, const float *x, const uint8_t *w,
                                 kv_weight_format format, int n_tokens, int in_dim, int out_dim);

/* ---- how a cache stores K and V --------------------------------------------------- */

/* Element formats of a cache (kvlab/quant.py defines each one, in NumPy). */
typedef enum {
    KV_FMT_F32,   /* float32, as computed */
    KV_FMT_F16,   /* IEEE half */
    KV_FMT_BF16,  /* the top 16 bits of a float32 */
    KV_FMT_I8,    /* int8 codes, a float32 scale per group of values (symmetric) */
    KV_FMT_I4,    /* 4-bit codes, two per byte, a scale and a zero point per group */
    KV_FMT_FP8,   /* fp8 e4m3 codes, a float32 scale per group */
} kv_format;

/* What a new cache or pool stores: K and V formats (they may differ), their group sizes
 * (values sharing one scale; 0 picks the format's default: all of head_dim for int8 and
 * fp8, 32 for int4 when it divides head_dim, else head_dim), and the residual window:
 * a query reads the `window` most recent positions (itself included) in full precision,
 * as KIVI and Hugging Face's QuantizedCache do. A NULL kv_cache_format means fp32. */
typedef struct {
    kv_format key_format, value_format;
    int key_group, value_group;
    int window;
} kv_cache_format;

/* Where one kind of tensor (K or V) lives for every layer of a cache: a row of head_dim
 * values per (layer, KV head, slot). A contiguous cache has a slot per position; a paged
 * pool has num_blocks * block_size slots, block b's rows at slots b * block_size onwards.
 * Layout (n_layers, n_kv_heads, slots, head): one head's keys for consecutive slots are
 * consecutive in memory, so attention, which reads one KV head's rows front to back,
 * streams memory instead of jumping a whole token's row (all heads) per position.
 *   codes of (layer, head, slot):  codes + ((layer * n_kv_heads + head) * slots + slot) * head_bytes
 *   scales of (layer, head, slot): scales + (same index) * groups_per_head
 * Each group of `group` values inside a head shares one scale (and zero point). */
typedef struct {
    kv_format format;
    int group;            /* values per scale; 0 for fp32, fp16, bf16 */
    int n_layers, n_kv_heads, head_dim;
    int groups_per_head;  /* head_dim / group; 0 without scales */
    size_t head_bytes;    /* bytes of codes per head row */
    size_t slots;         /* rows per (layer, head) */
    uint8_t *codes;       /* (n_layers, n_kv_heads, slots, head_bytes) */
    float *scales;        /* (n_layers, n_kv_heads, slots, groups_per_head), NULL for floats */
    float *zeros;         /* int4's zero points, same shape as scales; NULL otherwise */
} kv_store;

/* ---- contiguous KV cache ---------------------------------------------------------- */

/* One request's cache: every position it may ever hold is reserved up front. */
typedef struct {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int capacity;   /* positions reserved (max_seq_len of this cache) */
    int length;     /* rows filled: rows 0 .. length-1 hold valid K and V */
    kv_store key;   /* (n_layers, n_kv_heads, capacity, head_dim) values, in key.format, one
                       slot per row (kv_cache_slot: which) */
    kv_store value;
    int window;              /* residual window (0: none) */
    float *window_key;       /* (n_layers, window, kv_dim) float32 rows of the last window
                                positions, position p in row p % window; NULL if window 0 */
    float *window_value;
    /* Keeping fewer positions (kvlab/cache_policy.py): rows can be dropped (kv_cache_keep),
     * so row i need not hold position i, nor be in slot i. Both arrays are NULL until first
     * needed. */
    int next_position;       /* position of the next token (RoPE's angle): length, plus every
                                row dropped so far */
    int ring_start;          /* the slot of row 0: the rows are a ring, row i in slot
                                (ring_start + i) % capacity; 0 until rows are dropped */
    int32_t *positions;      /* (n_layers, n_kv_heads, capacity) the position each slot's row
                                holds; NULL: row i holds position i */
    float *attention;        /* (n_layers, n_kv_heads, capacity) attention weight each slot's
                                row has received since it was written, summed over the queries
                                and the query heads of its group; NULL: not tracked */
    float *attention_scratch;  /* (capacity + head_dim) one query's weights, and a key row */
} kv_cache;

/* format may be NULL (fp32, no window). */
kv_status kv_cache_init(kv_cache *cache, int n_layers, int n_kv_heads, int head_dim,
                        int capacity, const kv_cache_format *format);
void kv_cache_free(kv_cache *cache);   /* accepts a zeroed or half-built cache */
/* Bytes allocated: codes, scales and zero points of K and V, and the window rows. */
size_t kv_cache_nbytes(const kv_cache *cache);
/* Rolls back to `length` rows, as if the newest tokens never came: next_position goes back
 * by as many. With a residual window only length 0 is possible: the full-precision rows of
 * the positions before a cut are gone (KV_ERR_INVALID_ARG). After rows were dropped, the
 * rows cut must hold the newest positions (they do unless kv_cache_keep dropped one of
 * them since), and rows dropped meanwhile do not come back; length 0 forgets everything,
 * positions included. */
kv_status kv_cache_truncate(kv_cache *cache, int length);
/* Keeps n_keep rows of each layer and KV head and drops the rest: rows is
 * (n_layers, n_keep, n_kv_heads), rows[l][i][h] the i-th row of layer l, head h to keep,
 * strictly increasing in i and below length. The kept rows become rows 0 .. n_keep - 1 in
 * order (K, V, positions, attention weights), length becomes n_keep and next_position
 * stays: the next token still gets the next position. Each head may keep different
 * positions; attention reads rows 0 .. length - 1 of every head, whatever positions they
 * hold. Few rows move: the ring turns past the dropped rows where that leaves more rows in
 * place (a sliding window's newest rows: none moves), else the kept rows move to the
 * front. Refused (KV_ERR_INVALID_ARG, nothing changed) for a cache with a residual window. */
kv_status kv_cache_keep(kv_cache *cache, int n_keep, const int32_t *rows);
/* The slot (of 0 .. capacity - 1) that row `row` (0 <= row < capacity) is in. */
size_t kv_cache_slot(const kv_cache *cache, int row);
/* Turns the ring back so that row i is in slot i (ring_start 0), moving every slot's K, V,
 * position and attention sum: how the binding shows rows in order without a copy.
 * KV_ERR_NOMEM (nothing changed) if its spare rows cannot be allocated. */
kv_status kv_cache_straighten(kv_cache *cache);
/* Starts (1) or stops (0) summing, for every row, the attention weight the queries of later
 * forward calls give it (cache->attention), for eviction policies that keep the rows
 * attended most (H2O, SnapKV). Starting zeroes the sums. Refused with a residual window. */
kv_status kv_cache_track_attention(kv_cache *cache, int on);
/* Appends n_tokens rows of given K and V, each (n_tokens, n_layers, n_kv_heads, head_dim),
 * quantized as the cache stores them: filling a cache without a model, for tests,
 * benchmarks and exercises. */
kv_status kv_cache_append(kv_cache *cache, int n_tokens, const float *keys, const float *values);
/* The K and V that the most recent token's attention read, as float32
 * (n_layers, length, n_kv_heads, head_dim): dequantized codes, with the window's rows
 * in full precision. */
kv_status kv_cache_read(const kv_cache *cache, float *keys, float *values);
/* Does this cache fit this model's layer count and KV head shape? */
kv_status kv_cache_check_fits(const kv_cache *cache, const kv_config *config);

/* Attention in one layer of n_heads query heads, q (n_heads * head_dim), over every cached
 * position, into out (n_heads * head_dim), as the last cached token's query would attend;
 * the cache is not changed. This is a decode step's attention on its own, for benchmarks
 * and for checking by hand. */
kv_status kv_cache_attend(const kv_cache *cache, int layer, const float *q, int n_heads,
                          float *out);

/* ---- paged KV cache --------------------------------------------------------------- */

/* One sequence of a paged pool: which blocks hold its rows, in order. Row i is row
 * (start + i) % block_size of block block_table[(start + i) / block_size]. */
typedef struct {
    int32_t *block_table;  /* (max_blocks_per_seq,) physical block ids; first n_blocks valid */
    int n_blocks;
    int start;             /* rows of its first block before its row 0: the rows dropped from
                              its front (kv_pool_keep) since that block was its first; 0 unless
                              compacted, below block_size, and 0 when it holds no row */
    int length;            /* positions filled */
    int reserved;          /* positions reserved past length and not committed yet (0: none) */
    int next_position;     /* position of the next token (RoPE's angle): length, plus every
                              row dropped (kv_pool_keep) */
    int compacted;         /* rows were dropped: row i no longer holds position i, so its
                              blocks are never offered to the prefix cache */
    int32_t copied_from;   /* the shared block its pending reservation's copy-on-write
                              replaced (-1: none), for a cancel to give back, and that */
    uint32_t copied_generation;   /* block's generation then (has it been reused since?) */
    int alive;
    uint32_t serial;       /* bumped each time this slot gets a new sequence, so a handle
                              to a freed sequence is recognised as stale */
} kv_seq;

/* ---- the block manager: which block holds which positions (blocks.c) ---------------- */

/* Copy rows [0, rows) of block src into block dst, in every layer, K and V: what a store
 * must do before a sequence writes into a block it no longer shares (copy-on-write). */
typedef struct {
    int32_t dst, src, rows;
} kv_block_copy;

/* What happened to a block, for a notebook to replay (recorded only when asked:
 * kv_blocks_record_events). refs is the block's reference count after the event. */
typedef enum {
    KV_EVENT_ALLOCATED,   /* a free (or just evicted) block starts holding a sequence's rows */
    KV_EVENT_EVICTED,     /* a cached block dropped from the prefix cache, to be reused */
    KV_EVENT_SHARED,      /* one more sequence uses a block: fork, prefix hit, duplicate found */
    KV_EVENT_COPIED,      /* copy-on-write: `other` copied into `block` for one sequence */
    KV_EVENT_RELEASED,    /* one sequence fewer uses a block that others still use */
    KV_EVENT_FREED,       /* no sequence uses a block: to the prefix cache or the free stack */
} kv_event_kind;

typedef struct {
    kv_event_kind kind;
    int32_t block, refs;
    int32_t other;        /* COPIED: the source; SHARED: the duplicate replaced (or -1) */
    int32_t seq, index;   /* the sequence and block-table index it concerns, or -1 */
    uint8_t prefix_hit;   /* SHARED by kv_blocks_reuse_prefix */
    uint8_t cached;       /* FREED: kept in the prefix cache (1) or free (0) */
} kv_block_event;

/* Block tables, reference counts, the free stack and the prefix cache (a hash chain plus
 * an LRU list) of num_blocks blocks of block_size positions. It holds no K or V (no float
 * anywhere): the pool below pairs one with stores, its own in host memory or a row store
 * (the GPU's), which perform the copies it asks for.
 * A block with ref_count 0 is either free (on the free stack) or cached: a full block
 * kept for prefix reuse, findable by hash, evicted least-recently-used first. */
typedef struct {
    int num_blocks, block_size;
    int max_seqs, max_blocks_per_seq;
    int32_t *ref_count;     /* (num_blocks,) block-table entries pointing at each block */
    int32_t *fill;          /* (num_blocks,) rows written (a block is full at block_size) */
    int32_t *tokens;        /* (num_blocks, block_size) token id of every written row */
    int32_t *free_stack;    /* (num_blocks,) ids of free blocks; the top n_free are valid */
    int n_free;
    /* prefix cache: a full block's identity is (parent block, its tokens) */
    int prefix_cache;       /* 1 (the default): full blocks are registered and reused; 0: never */
    uint64_t *hash;         /* (num_blocks,) hash of (parent's hash, tokens) */
    int32_t *parent;        /* (num_blocks,) previous block of the chain, -1 for the first */
    uint32_t *generation;   /* (num_blocks,) bumped each time a block is handed out */
    uint32_t *parent_generation; /* (num_blocks,) parent's generation when registered */
    uint8_t *registered;    /* (num_blocks,) 1 if findable in the prefix cache */
    int32_t *bucket_head;   /* (n_buckets,) hash table: first block of each bucket */
    int32_t *bucket_next;   /* (num_blocks,) next block in the same bucket */
    int n_buckets;          /* a power of two */
    int32_t *lru_prev, *lru_next;  /* (num_blocks,) cached blocks, least recently used first */
    int lru_head, lru_tail, n_cached;
    int64_t prefix_hits, prefix_misses;  /* full blocks found / not found in the cache */
    uint64_t hash_mask;     /* all ones; tests narrow it to force hash collisions */
    kv_seq *seqs;           /* (max_seqs,) */
    int32_t *tables;        /* (max_seqs, max_blocks_per_seq) storage of every block table */
    /* the event log, when recording (kv_blocks_record_events) */
    int record_events;
    kv_block_event *events;
    size_t n_events, events_capacity;
    int events_lost;        /* growing the log failed: some events are missing */
} kv_blocks;

/* The longest block: as long as a whole context, so that a pool of one block per sequence
 * is a set of contiguous caches, reserved whole (chapter 5). */
#define KV_MAX_BLOCK_SIZE 4096

kv_status kv_blocks_init(kv_blocks *blocks, int num_blocks, int block_size, int max_seqs,
                         int max_blocks_per_seq);
void kv_blocks_free(kv_blocks *blocks);      /* accepts a zeroed or half-built one */
kv_status kv_blocks_seq_check(const kv_blocks *blocks, int seq);
kv_status kv_blocks_seq_new(kv_blocks *blocks, int *seq);
kv_status kv_blocks_seq_free(kv_blocks *blocks, int seq);
/* A child that shares every block of seq (ref counts go up, nothing is copied). */
kv_status kv_blocks_seq_fork(kv_blocks *blocks, int seq, int *child);
/* For an empty sequence: attach the cached full blocks that hold the longest prefix of
 * tokens[0 .. max_tokens) and set its length; *n_reused = tokens covered. */
kv_status kv_blocks_reuse_prefix(kv_blocks *blocks, int seq, const int32_t *tokens,
                                 int max_tokens, int *n_reused);
/* Which blocks the prefix cache can find by their tokens (what kv_blocks_reuse_prefix's
 * walk from the root can reach, used or cached): findable[b] (num_blocks entries) is b's
 * parent block, -1 for the first block of a chain, or -2 where b cannot be found. Changes
 * nothing: a lookup-only view, for checking a prefix cache written elsewhere (kvlab.plugins). */
void kv_blocks_findable(const kv_blocks *blocks, int32_t *findable);
/* Blocks that can be handed out now: free ones, and cached ones that would be evicted. */
int kv_blocks_available(const kv_blocks *blocks);
/* How many blocks kv_blocks_reserve(blocks, seq, n_tokens) would take (new blocks, plus one
 * if the last block is shared and partly filled); KV_ERR_TABLE_FULL if they would not fit
 * the sequence's block table. Changes nothing. */
kv_status kv_blocks_needed(const kv_blocks *blocks, int seq, int n_tokens, int *needed);
/* Makes room for n_tokens more positions of seq: a private copy of its last block if that
 * one is shared and partly filled (copy-on-write), then fresh blocks, evicting cached ones
 * when the free stack is empty. *n_copies (0 or 1) copies are written to copies: the caller
 * performs them on its stores before any row is written. Either everything succeeds or
 * nothing changes. Until kv_blocks_commit of exactly these n_tokens (or a free), the
 * reservation is pending: reserving, forking, reusing a prefix or asking blocks_needed
 * for that sequence is refused (KV_ERR_PENDING). */
kv_status kv_blocks_reserve(kv_blocks *blocks, int seq, int n_tokens, kv_block_copy *copies,
                            int *n_copies);
/* After the rows are written: records their tokens, advances the length, and offers every
 * block that just became full to the prefix cache (swapping in the cached twin when the
 * same block was computed twice). KV_ERR_INVALID_ARG, changing nothing, unless a pending
 * kv_blocks_reserve made room for exactly these n_tokens; after it, it cannot fail. */
kv_status kv_blocks_commit(kv_blocks *blocks, int seq, const int32_t *tokens, int n_tokens);
/* Instead of the commit, when the rows were not written (the writer failed): the blocks
 * taken for positions past seq's length go back, and a copy-on-write is undone as
 * kv_blocks_cancel_copy undoes it (the sequence reads the shared block again, the copy is
 * freed): the sequence and the pool are as they were. One exception: if the shared block
 * changed since the reserve (freed and taken again, cut and rewritten by its other reader:
 * a new generation, or other tokens in the rows the copy holds), the sequence keeps its
 * copy, whose rows are the ones it read. (A pool's own calls never meet it: nothing else
 * runs on the pool between their reserve and cancel.) */
kv_status kv_blocks_cancel(kv_blocks *blocks, int seq);
/* Instead of the commit, when the copy-on-write the reservation asked for could not be made
 * (copy: what kv_blocks_reserve returned; a row store failed): the reservation is cancelled
 * and the sequence takes back the shared block it read before; the copy goes back to the
 * free stack. Its table, length and every reference count are as before the reserve (a
 * cached block evicted for the copy stays evicted, and free: the failed copy may have
 * written its rows). KV_ERR_INVALID_ARG, changing nothing, if copy is not that of seq's
 * pending reservation. */
kv_status kv_blocks_cancel_copy(kv_blocks *blocks, int seq, const kv_block_copy *copy);
/* Forgets positions length .. of seq (0 <= length <= its length): blocks past the new end
 * are released, and a block cut in two keeps the rows before the cut. A block the sequence
 * shares keeps its rows for the others (the next write copies it first); one it holds alone
 * leaves the prefix cache, since its rows past the cut will be overwritten. Rollback of
 * speculative decoding's refused drafts. */
kv_status kv_blocks_truncate(kv_blocks *blocks, int seq, int length);
/* After the pool moved the rows seq keeps to rows first .. first + n_keep - 1
 * (kv_pool_keep; first from -start: rows of its first block before its start count too):
 * they become its rows 0 .. n_keep - 1 without moving, its start moving to the first of
 * them (whole blocks that fall out before it are released), the rows after them
 * are forgotten (blocks past the new end released), its blocks leave the prefix cache,
 * and next_position stays. KV_ERR_INVALID_ARG, changing nothing, if a block of seq is
 * shared (its rows are others' too) or first and n_keep do not fit. */
kv_status kv_blocks_drop_rows(kv_blocks *blocks, int seq, int first, int n_keep);
/* Starts (1) or stops (0) recording events; stopping drops the ones not taken. */
void kv_blocks_record_events(kv_blocks *blocks, int on);
/* Verifies every invariant; on failure writes what broke into message. */
kv_status kv_blocks_check(const kv_blocks *blocks, char *message, size_t message_size);

/* ---- the paged KV cache (paged.c): a block manager and the K/V stores ---------------- */

/* Where a pool's rows are when they are not in its own kv_stores: the GPU's memory, which
 * the core cannot touch (kvlab._cuda reaches it; tests put a NumPy stand-in there). The
 * pool keeps the books (which slots, which copies: paged.c, swap.c) and asks the store to
 * move the rows; its key and value then only describe them (formats and sizes, codes NULL).
 * Rows are addressed by slot as in kv_store: slot b * block_size + r is row r of block b.
 * Each function returns KV_OK or KV_ERR_STORE (the store keeps why: kvlab's binding leaves
 * its Python exception set). */
typedef struct {
    void *ctx;
    /* copy-on-write: n_rows rows from slot src to slot dst, every layer and KV head, K and V */
    kv_status (*copy)(void *ctx, size_t dst, size_t src, size_t n_rows);
    /* rows t = 0 .. n - 1 of keys and values, each (n, n_layers, n_kv_heads, head_dim)
     * float32, quantized into slots[t] */
    kv_status (*write)(void *ctx, const int64_t *slots, int n, const float *keys,
                       const float *values);
    /* the stored rows of slots[0 .. n - 1] as they are (codes, scales) into host kv_stores
     * of n slots (key, value: the pool's formats) */
    kv_status (*read)(void *ctx, const int64_t *slots, int n, const kv_store *key,
                      const kv_store *value);
    /* and back: host kv_stores' n rows, as they are, into slots[0 .. n - 1] */
    kv_status (*put)(void *ctx, const int64_t *slots, int n, const kv_store *key,
                     const kv_store *value);
} kv_row_store;

/* A pool of fixed-size blocks shared by many sequences (vLLM's PagedAttention idea).
 * Block b holds block_size rows of K and of V for every layer and KV head, in two
 * kv_stores whose slots b * block_size .. b * block_size + block_size - 1 are its rows:
 *   key, value: (n_layers, n_kv_heads, num_blocks, block_size, head_dim) in their formats
 * Why layer- and head-major: attention reads one KV head of one layer of a sequence's
 * blocks at a time, so blocks that are neighbours in the pool (as they are when handed
 * out in order) are neighbours in memory and stream like a contiguous cache; a
 * block-major layout would interleave other layers' rows and make every block a separate
 * short read. Copy-on-write therefore copies 2 x n_layers x n_kv_heads runs of rows.
 * Python shows the same memory block-first, (num_blocks, n_layers, block_size,
 * n_kv_heads, head_dim), as strided views. Which block holds what is `blocks`' business. */
typedef struct {
    kv_blocks blocks;       /* the bookkeeping: block tables, ref counts, prefix cache */
    int n_layers, n_kv_heads, head_dim;
    kv_store key, value;    /* (n_layers, n_kv_heads, num_blocks * block_size slots, head_dim) */
    int window;             /* residual window (0: none) */
    float *window_key;      /* (max_seqs, n_layers, window, kv_dim): each sequence's rows of
                               its last window positions, position p in row p % window */
    float *window_value;
    int32_t *positions;     /* (n_layers, n_kv_heads, slots) the position each row of a
                               compacted sequence holds; NULL until a sequence drops rows */
    const kv_row_store *row_store;  /* NULL: the rows are key's and value's, in host memory;
                               else they live in this store (no window, no dropped rows) */
} kv_pool;

typedef struct {
    int blocks_used, blocks_free, blocks_cached;
    int64_t tokens_stored;       /* rows written in blocks that are in use */
    int64_t slots_unused;        /* rows of in-use blocks not (yet) written */
    int n_sequences;
    int64_t prefix_hits, prefix_misses;
} kv_pool_stats;

/* format may be NULL (fp32, no window). */
kv_status kv_pool_init(kv_pool *pool, int n_layers, int n_kv_heads, int head_dim,
                       int num_blocks, int block_size, int max_seqs, int max_blocks_per_seq,
                       const kv_cache_format *format);
/* A pool whose rows live in a row store (which the caller keeps alive as long as the pool):
 * the same bookkeeping, no K or V in host memory. The format may have no window and no zero
 * points (int4). KV_ERR_INVALID_ARG otherwise, as kv_pool_init. */
kv_status kv_pool_init_with_store(kv_pool *pool, int n_layers, int n_kv_heads, int head_dim,
                                  int num_blocks, int block_size, int max_seqs,
                                  int max_blocks_per_seq, const kv_cache_format *format,
                                  const kv_row_store *row_store);
void kv_pool_free(kv_pool *pool);          /* accepts a zeroed or half-built pool */
/* Bytes of K/V storage: codes, scales, zero points and every sequence's window rows. */
size_t kv_pool_nbytes(const kv_pool *pool);
kv_status kv_pool_check_fits(const kv_pool *pool, const kv_config *config);

/* Sequences are made, freed and matched against the prefix cache on pool->blocks
 * (kv_blocks_seq_new, kv_blocks_seq_free, kv_blocks_reuse_prefix). A pool with a residual
 * window caches no block (blocks.prefix_cache is 0): the window's full-precision rows
 * belong to a sequence, not to the shared blocks, so a new sequence could not get them
 * back. A fork needs the pool, for those rows: */
kv_status kv_pool_seq_fork(kv_pool *pool, int seq, int *child);
/* kv_blocks_truncate; a pool with a residual window truncates only to 0 or to the length it
 * has (the window's full-precision rows before the cut are gone), as a contiguous cache.
 * After a sequence dropped rows, only rows holding its newest positions can be cut. */
kv_status kv_pool_truncate(kv_pool *pool, int seq, int length);
/* kv_cache_keep for one sequence of the pool: its kept rows become its rows 0 .. n_keep - 1
 * (per layer and KV head), the blocks that no longer hold a row are released,
 * next_position stays, and from then on its blocks are not offered to the prefix cache.
 * Few rows move, as in kv_cache_keep: where that leaves more rows in place, the sequence's
 * start moves past the dropped rows (seq.start, a whole block at a time released from its
 * front) and only kept rows before the last dropped one move, to just before the rest (a
 * sliding window moves none; attention sinks move their few); else the kept rows move to
 * the front. Refused, changing nothing:
 * a pool with a residual window, a pending reservation (KV_ERR_PENDING), a block the
 * sequence shares with another (its rows are the other's too: KV_ERR_INVALID_ARG). */
kv_status kv_pool_keep(kv_pool *pool, int seq, int n_keep, const int32_t *rows);
/* The position row `row` of seq holds (row itself, unless the sequence dropped rows). */
int kv_pool_position(const kv_pool *pool, int seq, int layer, int head, int row);
/* Appends n_tokens rows of given K and V, each (n_tokens, n_layers, n_kv_heads, head_dim):
 * the pool's bookkeeping without a model, for tests and exercises. */
kv_status kv_pool_append(kv_pool *pool, int seq, const int32_t *tokens, int n_tokens,
                         const float *keys, const float *values);

/* Copies a sequence's K and V, as its most recent token's attention read them, into
 * float32 (n_layers, length, n_kv_heads, head_dim) buffers (see kv_cache_read). */
kv_status kv_pool_gather(const kv_pool *pool, int seq, float *keys, float *values);
kv_status kv_blocks_stats(const kv_blocks *blocks, kv_pool_stats *stats);
/* The slots of positions start .. start + n - 1 of seq (blocks it holds or has reserved). */
void kv_pool_slots(const kv_pool *pool, int seq, int start, int n, int64_t *slots);

/* A forward pass over a batch that runs outside the core (the GPU's), as
 * kv_model_forward_batch runs one inside: n_seqs sequences, n_tokens[i] new tokens for
 * seqs[i]. The check: sequences alive, distinct, each with 1 or more tokens and room for
 * them (block table, positions), and blocks for all of them together; changes nothing.
 * The reservation: that check, then each sequence's blocks (copy-on-write by the pool's
 * stores), and for the caller's forward pass each run's start (starts: n_seqs), block
 * table (tables: n_seqs rows of max_blocks, zero past its blocks; KV_ERR_INVALID_ARG if a
 * table is longer) and the slots its new rows go to (slots: sum of n_tokens, run after
 * run). Refused, nothing changes; a row store that fails a copy-on-write has that
 * sequence's reservation undone (kv_blocks_cancel_copy) and the others' cancelled. After
 * the forward pass, commit (tokens: the runs' ids, run after run), or cancel if it failed:
 * the sequences are then as they were. */
kv_status kv_pool_check_batch(const kv_pool *pool, int n_seqs, const int *seqs,
                              const int *n_tokens);
kv_status kv_pool_reserve_batch(kv_pool *pool, int n_seqs, const int *seqs, const int *n_tokens,
                                int max_blocks, int32_t *starts, int32_t *tables,
                                int64_t *slots);
void kv_pool_commit_batch(kv_pool *pool, int n_seqs, const int *seqs, const int *n_tokens,
                          const int32_t *tokens);
void kv_pool_cancel_batch(kv_pool *pool, int n_seqs, const int *seqs);

/* Preemption by swapping (vLLM): a sequence's K and V go to host memory that the caller
 * owns, its blocks go back to the pool, and later it comes back in fresh blocks and goes
 * on exactly where it stopped, with no prefill of its tokens again. The host copy is one
 * buffer: a header (the pool's shape and formats, the sequence's length, next position and
 * whether it dropped rows), its tokens, then its rows exactly as the stores hold them
 * (codes, scales and zero points of K, then of V, each (n_layers, n_kv_heads, length, ...)),
 * the positions of its rows if it dropped rows, and its residual window's float32 rows.
 * Bytes of that buffer for seq now: KV_ERR_PENDING while a reservation is pending. */
kv_status kv_pool_swap_size(const kv_pool *pool, int seq, size_t *size);
/* Copies seq into host (size bytes, as kv_pool_swap_size says), then frees seq: only its
 * own references go, so a block it shares (a fork, a prefix found in the cache) keeps its
 * rows for the others, and its full blocks stay in the prefix cache as a freed sequence's
 * do. On any refusal nothing changes. */
kv_status kv_pool_swap_out(kv_pool *pool, int seq, void *host, size_t size);
/* A new sequence *seq holding what host holds (kv_pool_swap_out of a pool of the same
 * shape and formats: any block size), in fresh blocks from their first row (start 0: rows
 * dropped from its front before the swap take no room): the same rows bit for bit, tokens,
 * length, next position, positions and window rows, so that its next forward calls give
 * the logits they would have given before the swap. Its full blocks join the prefix cache
 * as a prefill's do. The host buffer is only read: it may be swapped in again. Refused,
 * changing nothing: KV_ERR_CACHE_MISMATCH (another shape or format; or rows dropped, for a
 * pool whose rows a row store holds), KV_ERR_INVALID_ARG
 * (not such a buffer: a header, size or row positions that no swap-out writes),
 * KV_ERR_TABLE_FULL, KV_ERR_OUT_OF_BLOCKS, KV_ERR_TOO_MANY_SEQUENCES, KV_ERR_NOMEM. The rows
 * and tokens themselves are taken as they are, as kv_pool_append takes any rows: bytes
 * changed there are not detected (there is no checksum). */
kv_status kv_pool_swap_in(kv_pool *pool, const void *host, size_t size, int *seq);
/* The length (positions) the host copy's header gives, or -1 if host is not big enough to
 * hold a header or does not start as one. */
int kv_swap_length(const void *host, size_t size);

/* ---- counting what a forward pass does -------------------------------------------- */

/* What forward calls did, counted by the core as it runs each operation (kvlab.measure
 * derives the same numbers from the shapes alone; the tests hold them equal). A FLOP is
 * one multiply or one add: a multiply-add counts 2. Norms, RoPE, softmax and SwiGLU's
 * elementwise work are not counted; they are tiny next to the matrix products. */
typedef struct {
    int64_t flops_projections;  /* Wq, Wk, Wv and Wo */
    int64_t flops_attention;    /* q . k for every visible position, and the mix of V */
    int64_t flops_mlp;          /* W1, W3 and W2 */
    int64_t flops_logits;       /* the classifier */
    int64_t weight_bytes;       /* weights read: every matrix and norm once per call, plus
                                   one embedding row per token */
    int64_t kv_read_bytes;      /* K and V rows read by attention (once per KV head) */
    int64_t kv_write_bytes;     /* K and V rows written */
    int64_t scratch_bytes;      /* activation scratch of the largest call (a peak, not a sum);
                                   the no-cache path adds the K/V it rebuilds */
    int64_t tokens;             /* tokens run through the model */
    int64_t calls;
} kv_counters;

/* total += call, except scratch_bytes, which keeps the larger (a peak, not a sum).
 * total may be NULL (nothing is counted). */
void kv_counters_add(kv_counters *total, const kv_counters *call);

/* ---- forward pass ------------------------------------------------------------------ */

/* Runs n_tokens new tokens, at positions cache->length .. cache->length + n_tokens - 1,
 * through the model in one causal pass (matrix-matrix when n_tokens > 1: that is
 * prefill; n_tokens == 1 is a decode step). Their keys and values are appended to the
 * cache. Writes logits for every new token, (n_tokens, vocab_size), when all_logits is
 * nonzero, else only for the last one, (vocab_size,). counters, if not NULL, get what
 * the call did added to them.
 * On any error nothing is appended and cache->length is unchanged, with one exception: a
 * long call runs in chunks of positions (each at most about KV_CHUNK_FLOPS of work), and if
 * the interrupt check (below) says stop between two chunks, the chunks before stay in the
 * cache (cache->length counts them) and the result is KV_ERR_INTERRUPTED. A chunk that is
 * itself more than KV_CHUNK_FLOPS of work (KV_CHUNK_MIN tokens at a long context) also
 * asks between its layers, unless the cache has a residual window or tracks attention, and
 * stopped there it appends nothing: the chunks before stay, as above. The logits of a
 * call are the same whatever the chunks (a prefill in parts equals one prefill). */
kv_status kv_model_forward(const kv_model *model, kv_cache *cache, const int32_t *tokens,
                           int n_tokens, float *logits, int all_logits, kv_counters *counters);

/* The same over a sequence of a paged pool. Blocks for the new positions are taken
 * (copying a shared partial block first) before anything is written; on
 * KV_ERR_OUT_OF_BLOCKS or any other error the pool is exactly as it was, except that a
 * long call interrupted between its chunks (or inside one, between its layers: not with a
 * residual window) keeps the chunks before (KV_ERR_INTERRUPTED, as kv_model_forward). */
kv_status kv_model_forward_paged(const kv_model *model, kv_pool *pool, int seq,
                                 const int32_t *tokens, int n_tokens, float *logits,
                                 int all_logits, kv_counters *counters);

/* One step of a continuous-batching engine: n_seqs sequences of one pool, each with
 * n_tokens[i] new tokens (a chunk of its prompt, or one decode token), concatenated in
 * `tokens`, run through the model together. Every weight matrix is streamed once per
 * KV_TOKEN_CHUNK (96) tokens of the batch (matrix-matrix, see ops.h); attention is each
 * sequence's own. logits gets one row per sequence, (n_seqs, vocab_size): its last new
 * token's; with all_logits, one row per token (sum of n_tokens, vocab_size), in the order
 * of `tokens` (speculative decoding verifies every draft of every sequence at once). Each
 * sequence's results are bit-identical to running it alone. The sequences must be
 * distinct; blocks for all of them are checked first, so on KV_ERR_OUT_OF_BLOCKS (or any
 * error) the pool is as it was. A call of more than KV_CHUNK_FLOPS of work asks the
 * interrupt check between its layers (not in a pool with a residual window, whose rings
 * are written in place) and, told to stop, returns KV_ERR_INTERRUPTED with every
 * reservation cancelled (kv_blocks_cancel): the sequences as they were, nothing counted;
 * only a cached block a reservation evicted stays evicted, now free. */
kv_status kv_model_forward_batch(const kv_model *model, kv_pool *pool, int n_seqs,
                                 const int *seqs, const int *n_tokens, const int32_t *tokens,
                                 float *logits, int all_logits, kv_counters *counters);

/* How to choose: temperature 0 takes the arg-max (greedy); otherwise the logits are divided
 * by the temperature, cut to the top_k largest (0: no cut) and then to the smallest set of
 * most likely tokens whose probability reaches top_p (1: no cut), and a token is drawn. */
typedef struct {
    double temperature;   /* doubles, as Python gives them: the same cut-offs to the bit */
    int top_k;
    double top_p;
} kv_sampling;

/* Generation with the whole per-token loop in C: from `token` (the newest token, chosen
 * but not yet in the cache), up to max_steps decode steps, each running the newest token
 * through the model (appending its K and V) and choosing the next one with kv_sample
 * (sampling.h): the arg-max when how is NULL or its temperature 0, else a draw that uses
 * uniforms[step], numbers in [0, 1) the caller drew. Stops after the step that chooses
 * stop_token, if stop_token >= 0. tokens_out gets each step's choice (a stop_token
 * included), seconds_out (unless NULL) each step's wall time, *n_steps how many steps
 * ran. Everything is allocated once before the first step: no allocation and no caller
 * code between tokens. The steps are exactly kv_model_forward decode steps, so the tokens
 * are the same as calling it token by token and sampling in between. The cache needs room
 * for max_steps more positions (else KV_ERR_CACHE_FULL, and nothing is run). If a step's
 * logits are not numbers, that step stays in the cache, *n_steps counts the steps before
 * it, and the result is KV_ERR_NOT_A_NUMBER. If the interrupt check (below) says stop
 * between two steps, the result is KV_ERR_INTERRUPTED: the *n_steps completed steps are
 * in the cache and in tokens_out, nothing else. */
kv_status kv_model_generate(const kv_model *model, kv_cache *cache, int32_t token,
                            int max_steps, int32_t stop_token, const kv_sampling *how,
                            const double *uniforms, int32_t *tokens_out, double *seconds_out,
                            int *n_steps, kv_counters *counters);

/* Stopping a long call early. A caller (Python, for Ctrl-C) may set, for the calling thread,
 * a function that says whether to stop; kv_model_generate asks it between steps and
 * kv_model_forward between the chunks it splits a long call into, so it is asked at least
 * every few tenths of a second. When it says stop, the call returns KV_ERR_INTERRUPTED,
 * having kept only what it completed: the steps before, the chunks before (each chunk's
 * positions are in the cache; see each function). NULL (the default) never stops. */
typedef int (*kv_interrupt_check)(void *arg);
void kv_set_interrupt_check(kv_interrupt_check check, void *arg);

/* The positions one chunk of a kv_model_forward call runs, of n_left starting at `start`. */
int kv_chunk_length(const kv_config *config, int start, int n_left);

/* Checks that every token id is in [0, vocab_size). */
kv_status kv_check_tokens(const kv_config *config, const int32_t *tokens, int n_tokens);

/* What the no-cache path holds of the K and V it rebuilds: every layer's, in a scratch
 * cache the size of the one a cached run keeps (the cached path run over a cache that is
 * thrown away), or one layer's at a time, since each layer attends only to the K and V it
 * has just computed. The same logits either way, bit for bit. */
typedef enum {
    KV_UNCACHED_ALL_LAYERS = 0,
    KV_UNCACHED_ONE_LAYER = 1,
} kv_uncached_kv;

/* The no-cache path: runs the whole sequence from position 0, as a model without a KV
 * cache must on every step, holding its K and V as `keep` says. ALL_LAYERS runs in chunks
 * of tokens through every layer (a place to stop between them); ONE_LAYER cannot (a later
 * chunk would need the earlier chunks' K and V of every layer), so it goes layer by layer,
 * its buffers sized for all the tokens, and each layer over the tokens in the same chunks,
 * the interrupt check asked between them (stopped: KV_ERR_INTERRUPTED, nothing counted). */
kv_status kv_model_forward_uncached(const kv_model *model, const int32_t *tokens,
                                    int n_tokens, float *logits, int all_logits,
                                    kv_uncached_kv keep, kv_counters *counters);

/* ---- the machine -------------------------------------------------------------------- */

/* Memory bandwidth with the core's threads (bandwidth.c): the best of `repeats` passes
 * over arrays of n_floats (make them far larger than the caches), reading only, and
 * STREAM's triad. checksum is the sum read, so that the compiler keeps the reads. */
kv_status kv_measure_bandwidth(size_t n_floats, int repeats, double *read_bytes_per_s,
                               double *triad_bytes_per_s, float *checksum);

/* The bytes per second at which decode attention's walk through a cache (n_kv_heads heads
 * of `context` rows of head_dim floats, keys and values, fp32) reads memory when nothing
 * is computed: the best of `repeats` passes, each reading from memory. The ceiling of
 * attention's access pattern, beside the plain read of kv_measure_bandwidth. */
kv_status kv_measure_attention_walk(int n_kv_heads, int head_dim, int context, int repeats,
                                    double *bytes_per_s, float *checksum);

/* The compute roof on n_threads threads (bandwidth.c), each running the same chains of
 * independent instructions from registers, no memory traffic: the best of `repeats`
 * passes. Operations count a multiply and an add as two. */
typedef struct {
    double f32_flops;              /* the widest float32 multiply-add this build has */
    double int8_ops;               /* the widest int8 dot-product instruction (byte products) */
    double int8_product_ops;       /* byte products through the int8 product's own sequence:
                                      exact sums of four, made float, scaled, multiply-added
                                      (kv_plain_matmul_int8's spec; weight_formats.c) */
    const char *f32_instruction;   /* what was timed, in words */
    const char *int8_instruction;
    float checksum;                /* what the chains summed to: keeps them computed */
} kv_compute_roof;
kv_status kv_measure_compute(int n_threads, int repeats, kv_compute_roof *roof);

/* ---- threads ----------------------------------------------------------------------- */
void kv_set_num_threads(int n_threads);
int kv_get_num_threads(void);
/* The cores this process may run on, at least 1. */
int kv_available_cores(void);

/* ---- kernels ------------------------------------------------------------------------ */
/* Which kernels the CPU core runs, for the whole process: the fast ones (ops.c,
 * attention.c; the default) or the plain ones written to be read (plain.c), which give
 * the same bits. A forward call runs on the tier set when it started. */
typedef enum { KV_KERNELS_FAST = 0, KV_KERNELS_PLAIN = 1 } kv_kernels;
void kv_set_kernels(kv_kernels kernels);
kv_kernels kv_get_kernels(void);

#endif /* KVLAB_H */
