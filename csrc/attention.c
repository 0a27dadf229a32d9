/* attention.c: causal grouped-query attention (MHA, GQA and MQA are one code path).
 *
 * Query head h reads key/value head h / kv_mul, where kv_mul = n_heads / n_kv_heads:
 * with kv_mul = 1 that is multi-head attention, with n_kv_heads = 1 multi-query.
 * Positions are visited block by block through the view's block table, so the paged
 * cache costs one table lookup per block (and one per tile for the look-ahead), not per
 * token, and in tiles of TILE rows. A
 * quantized cache is decoded eight values at a time in registers as its rows are used
 * (or, for the rarer group sizes, a tile at a time into a small buffer), never into a
 * full-precision copy of the cache. Every (token, head) pair is computed the same way
 * whether it arrives in a prefill batch or alone in a decode step, and whichever cache
 * holds its keys, so the cached, uncached and paged paths agree bit for bit.
 */
#include <math.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "attention.h"
#include "common.h"
#include "ops.h"
#include "quant.h"
#include "store.h"

static size_t round_up16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Rows are read TILE at a time: a tile of dequantized head rows (16 x 128 floats = 8 KiB
 * for a typical head) stays in the L1 cache while every query head of the group uses it. */
#define TILE 16
/* and the rows AHEAD positions on are asked for while a tile is computed */
#define AHEAD (2 * TILE)

size_t kv_attention_scratch(int n_heads, int n_kv_heads, int head_dim, int max_positions) {
    return (size_t)(n_heads / n_kv_heads) * round_up16((size_t)max_positions) +
           TILE * round_up16((size_t)head_dim);
}

/* A tile of n consecutive head rows, as attention's inner loops read them: float32 rows
 * (in the cache itself, or decoded into the tile buffer), or codes turned into floats
 * eight at a time in registers: fp16, bf16, and int8, int4 and fp8 whose groups are
 * the whole head or a power of two of at least 8 values (so eight values share one
 * scale, found with a shift). The values are exactly what dequantizing gives
 * (csrc/quant.c), so both ways produce the same bits, and only the memory read differs:
 * a half to an eighth of fp32's, plus the scales. */
enum { ROWS_F32, ROWS_I8, ROWS_F16, ROWS_BF16, ROWS_I4, ROWS_FP8 };

typedef struct {
    const char *next;        /* the rows that come AHEAD positions later, to fetch early */
    size_t next_bytes;       /* 0 when there are none */
    const float *floats;     /* (n, head_dim) float32 (ROWS_F32) */
    const uint8_t *codes;    /* (n, head_bytes) codes (the others) */
    const float *scales;     /* (n, groups_per_head) */
    const float *zeros;      /* (n, groups_per_head), int4 only */
    int groups_per_head;
    int group_shift;         /* value i of a row is in group i >> group_shift */
} tile_rows;

#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef uint32_t v8u32 __attribute__((vector_size(32)));

static ALWAYS_INLINE v8f as_floats(v8u32 bits) {
    v8f chunk;
    memcpy(&chunk, &bits, sizeof chunk);
    return chunk;
}

/* eight bytes, each widened to 32 bits (signed or not) */
static ALWAYS_INLINE v8u32 widen_bytes(const uint8_t *bytes, int is_signed) {
    v8u32 wide;
#ifdef __AVX2__
    /* one widening load: gcc does not find it by itself and would widen byte by byte */
    __m128i packed = _mm_loadl_epi64((const __m128i *)bytes);
    __m256i widened = is_signed ? _mm256_cvtepi8_epi32(packed) : _mm256_cvtepu8_epi32(packed);
    memcpy(&wide, &widened, sizeof wide);
#else
    for (int j = 0; j < 8; j++) wide[j] = is_signed ? (uint32_t)(int32_t)(int8_t)bytes[j] : bytes[j];
#endif
    return wide;
}

/* values i .. i+7 of row r */
static ALWAYS_INLINE v8f load_chunk(const tile_rows *rows, int r, int i, int head_dim,
                                    int kind) {
    if (kind == ROWS_F32) return load8(rows->floats + (size_t)r * head_dim + i);
    /* the scale (and zero point) of values i .. i+7: only the scaled formats have one */
    size_t group = kind == ROWS_I8 || kind == ROWS_I4 || kind == ROWS_FP8
                       ? (size_t)r * rows->groups_per_head + (size_t)(i >> rows->group_shift)
                       : 0;
    if (kind == ROWS_I8) {
        v8u32 codes = widen_bytes(rows->codes + (size_t)r * head_dim + i, 1);
        typedef int32_t v8i32 __attribute__((vector_size(32)));
        return __builtin_convertvector((v8i32)codes, v8f) * rows->scales[group];
    }
    if (kind == ROWS_FP8) {   /* the bit trick of kv_dequantize_fp8, eight lanes at once */
        v8u32 codes = widen_bytes(rows->codes + (size_t)r * head_dim + i, 0);
        v8f magnitude = as_floats((codes & 0x7F) << 20) * 0x1p120f;
        v8u32 nan = (v8u32)((codes & 0x7F) == 0x7F);
        v8u32 bits = (((v8u32)magnitude & ~nan) | (0x7FC00000u & nan)) | ((codes & 0x80) << 24);
        return as_floats(bits) * rows->scales[group];
    }
    if (kind == ROWS_I4) {    /* four bytes hold the eight codes, the even one low */
        const uint8_t *packed = rows->codes + ((size_t)r * head_dim + i) / 2;
        v8u32 shift = {0, 4, 0, 4, 0, 4, 0, 4}, codes;
#ifdef __AVX2__
        int32_t four;
        memcpy(&four, packed, sizeof four);
        __m128i bytes = _mm_cvtsi32_si128(four);
        __m256i twice = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  /* b0 b0 b1 b1 .. */
        memcpy(&codes, &twice, sizeof codes);
#else
        for (int j = 0; j < 8; j++) codes[j] = packed[j / 2];
#endif
        codes = (codes >> shift) & 0x0F;
        typedef int32_t v8i32 __attribute__((vector_size(32)));
        return __builtin_convertvector((v8i32)codes, v8f) * rows->scales[group] + rows->zeros[group];
    }
    const uint16_t *halves = (const uint16_t *)rows->codes + (size_t)r * head_dim + i;
    if (kind == ROWS_F16) {
#ifdef __F16C__
        __m256 values = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)halves));  /* exact */
        v8f chunk;
        memcpy(&chunk, &values, sizeof chunk);
        return chunk;
#else
        /* the bit trick of kv_dequantize_f16, eight lanes at once */
        typedef uint16_t v8u16 __attribute__((vector_size(16)));
        v8u16 packed;
        memcpy(&packed, halves, sizeof packed);
        v8u32 codes = __builtin_convertvector(packed, v8u32);
        v8u32 magnitude = (codes & 0x7FFF) << 13;
        v8u32 special = (v8u32)((codes & 0x7C00) == 0x7C00);          /* inf and NaN */
        v8u32 bits = ((v8u32)(as_floats(magnitude) * 0x1p112f) & ~special) |
                     ((magnitude | 0x7F800000u) & special);
        return as_floats(bits | ((codes & 0x8000) << 16));
#endif
    }
    typedef uint16_t v8u16 __attribute__((vector_size(16)));   /* bf16: a float's top half */
    v8u16 codes;
    memcpy(&codes, halves, sizeof codes);
    return as_floats(__builtin_convertvector(codes, v8u32) << 16);
}

/* While row r of n is used, row r's share of the rows AHEAD is fetched: spread over the
 * tile's work, so that the requests never pile up (a burst of a hundred prefetches stalls
 * the core until the memory system has room for them). */
static ALWAYS_INLINE void fetch_ahead(const tile_rows *rows, int r, int n) {
    size_t from = rows->next_bytes * (size_t)r / (size_t)n;
    size_t to = rows->next_bytes * (size_t)(r + 1) / (size_t)n;
    for (size_t at = from & ~(size_t)63; at < to; at += 64) __builtin_prefetch(rows->next + at);
}

/* att[m][pos + r] = q_m . row_r * scale for the kv_mul queries and n rows: each row is
 * loaded once for four queries at a time, and every dot product keeps kv_dot's order
 * (eight lanes, added pairwise, then the leftover elements). */
static ALWAYS_INLINE void score_tile(float *att, size_t head_stride, int pos,
                                     const float *queries, int kv_mul, int head_dim,
                                     const tile_rows *rows, int n, float scale, int kind) {
    int d8 = head_dim & ~7;   /* tiles of codes have head_dim % 8 == 0: no leftovers */
    int is_codes = kind != ROWS_F32;
    int m = 0;
    for (; m + 4 <= kv_mul; m += 4) {
        const float *q0 = queries + (size_t)m * head_dim, *q1 = q0 + head_dim;
        const float *q2 = q1 + head_dim, *q3 = q2 + head_dim;
        for (int r = 0; r < n; r++) {
            if (m == 0) fetch_ahead(rows, r, n);
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int i = 0; i < d8; i += 8) {
                v8f k = load_chunk(rows, r, i, head_dim, kind);
                a0 = madd(load8(q0 + i), k, a0); a1 = madd(load8(q1 + i), k, a1);
                a2 = madd(load8(q2 + i), k, a2); a3 = madd(load8(q3 + i), k, a3);
            }
            const float *row = is_codes ? NULL : rows->floats + (size_t)r * head_dim;
            float *out = att + (size_t)m * head_stride + pos + r;
            out[0] = (is_codes ? reduce_lanes(a0) : add_tail(reduce_lanes(a0), q0, row, d8, head_dim)) * scale;
            out[head_stride] = (is_codes ? reduce_lanes(a1) : add_tail(reduce_lanes(a1), q1, row, d8, head_dim)) * scale;
            out[2 * head_stride] = (is_codes ? reduce_lanes(a2) : add_tail(reduce_lanes(a2), q2, row, d8, head_dim)) * scale;
            out[3 * head_stride] = (is_codes ? reduce_lanes(a3) : add_tail(reduce_lanes(a3), q3, row, d8, head_dim)) * scale;
        }
    }
    for (; m < kv_mul; m++) {   /* the rest one query at a time (all of them for MHA) */
        const float *q0 = queries + (size_t)m * head_dim;
        for (int r = 0; r < n; r++) {
            if (m == 0) fetch_ahead(rows, r, n);
            v8f a0 = {0};
            for (int i = 0; i < d8; i += 8)
                a0 = madd(load8(q0 + i), load_chunk(rows, r, i, head_dim, kind), a0);
            float sum = is_codes ? reduce_lanes(a0)
                                : add_tail(reduce_lanes(a0), q0, rows->floats + (size_t)r * head_dim, d8, head_dim);
            att[(size_t)m * head_stride + pos + r] = sum * scale;
        }
    }
}

/* out_m += sum over the n rows of p_m[r] * row_r, for the kv_mul query heads. Each
 * output element adds the rows in order, exactly as one axpy per row would, but keeps
 * its running sum in a register across the tile, and loads each row once for four
 * queries at a time. */
static ALWAYS_INLINE void mix_tile(float *results, const float *att, size_t head_stride,
                                   int pos, int kv_mul, int head_dim, const tile_rows *rows,
                                   int n, int kind) {
    int d8 = head_dim & ~7;
    int m = 0;
    for (; m + 4 <= kv_mul; m += 4) {
        const float *p0 = att + (size_t)m * head_stride + pos, *p1 = p0 + head_stride;
        const float *p2 = p1 + head_stride, *p3 = p2 + head_stride;
        float *o0 = results + (size_t)m * head_dim, *o1 = o0 + head_dim;
        float *o2 = o1 + head_dim, *o3 = o2 + head_dim;
        int i = 0;
        /* sixteen values of each of the four heads at a time: each weight p_m[r] is
         * broadcast once for two chunks of the row, which halves the loads per
         * multiply-add (the loop is bound by loads, not by arithmetic) */
        for (; i + 16 <= d8; i += 16) {
            v8f a0 = load8(o0 + i), a1 = load8(o1 + i), a2 = load8(o2 + i), a3 = load8(o3 + i);
            v8f b0 = load8(o0 + i + 8), b1 = load8(o1 + i + 8), b2 = load8(o2 + i + 8);
            v8f b3 = load8(o3 + i + 8);
            for (int r = 0; r < n; r++) {
                if (m == 0 && i == 0) fetch_ahead(rows, r, n);
                v8f v = load_chunk(rows, r, i, head_dim, kind);
                v8f w = load_chunk(rows, r, i + 8, head_dim, kind), zero = {0};
                v8f q0 = zero + p0[r], q1 = zero + p1[r], q2 = zero + p2[r], q3 = zero + p3[r];
                a0 = madd(q0, v, a0); a1 = madd(q1, v, a1); a2 = madd(q2, v, a2); a3 = madd(q3, v, a3);
                b0 = madd(q0, w, b0); b1 = madd(q1, w, b1); b2 = madd(q2, w, b2); b3 = madd(q3, w, b3);
            }
            memcpy(o0 + i, &a0, sizeof a0); memcpy(o1 + i, &a1, sizeof a1);
            memcpy(o2 + i, &a2, sizeof a2); memcpy(o3 + i, &a3, sizeof a3);
            memcpy(o0 + i + 8, &b0, sizeof b0); memcpy(o1 + i + 8, &b1, sizeof b1);
            memcpy(o2 + i + 8, &b2, sizeof b2); memcpy(o3 + i + 8, &b3, sizeof b3);
        }
        for (; i < d8; i += 8) {
            v8f a0 = load8(o0 + i), a1 = load8(o1 + i), a2 = load8(o2 + i), a3 = load8(o3 + i);
            for (int r = 0; r < n; r++) {
                v8f v = load_chunk(rows, r, i, head_dim, kind), zero = {0};
                a0 = madd(zero + p0[r], v, a0); a1 = madd(zero + p1[r], v, a1);
                a2 = madd(zero + p2[r], v, a2); a3 = madd(zero + p3[r], v, a3);
            }
            memcpy(o0 + i, &a0, sizeof a0); memcpy(o1 + i, &a1, sizeof a1);
            memcpy(o2 + i, &a2, sizeof a2); memcpy(o3 + i, &a3, sizeof a3);
        }
    }
    for (; m < kv_mul; m++) {
        const float *p0 = att + (size_t)m * head_stride + pos;
        float *o0 = results + (size_t)m * head_dim;
        for (int i = 0; i < d8; i += 8) {
            v8f a0 = load8(o0 + i);
            for (int r = 0; r < n; r++) {
                if (m == 0 && i == 0) fetch_ahead(rows, r, n);
                v8f zero = {0};
                a0 = madd(zero + p0[r], load_chunk(rows, r, i, head_dim, kind), a0);
            }
            memcpy(o0 + i, &a0, sizeof a0);
        }
    }
    if (kind == ROWS_F32) {   /* leftover elements when head_dim is not a multiple of 8 */
        for (m = 0; m < kv_mul; m++) {
            const float *p0 = att + (size_t)m * head_stride + pos;
            float *o0 = results + (size_t)m * head_dim;
            for (int i = d8; i < head_dim; i++) {
                float acc = o0[i];
                for (int r = 0; r < n; r++) acc += p0[r] * rows->floats[(size_t)r * head_dim + i];
                o0[i] = acc;
            }
        }
    }
}

/* One version of each kernel per kind of row, which the compiler builds separately. */
#define KERNELS(NAME, KIND)                                                                  \
    static void score_##NAME(float *att, size_t stride, int pos, const float *q, int kv_mul, \
                             int head_dim, const tile_rows *rows, int n, float scale) {      \
        score_tile(att, stride, pos, q, kv_mul, head_dim, rows, n, scale, KIND);             \
    }                                                                                        \
    static void mix_##NAME(float *results, const float *att, size_t stride, int pos,         \
                           int kv_mul, int head_dim, const tile_rows *rows, int n) {         \
        mix_tile(results, att, stride, pos, kv_mul, head_dim, rows, n, KIND);                \
    }
KERNELS(f32, ROWS_F32)
KERNELS(i8, ROWS_I8)
KERNELS(f16, ROWS_F16)
KERNELS(bf16, ROWS_BF16)
KERNELS(i4, ROWS_I4)
KERNELS(fp8, ROWS_FP8)

typedef void (*score_kernel)(float *, size_t, int, const float *, int, int, const tile_rows *,
                             int, float);
typedef void (*mix_kernel)(float *, const float *, size_t, int, int, int, const tile_rows *, int);
static const score_kernel score_kernels[] = {score_f32, score_i8, score_f16, score_bf16,
                                             score_i4, score_fp8};
static const mix_kernel mix_kernels[] = {mix_f32, mix_i8, mix_f16, mix_bf16, mix_i4, mix_fp8};

/* Where the rows AHEAD positions on live, for the kernels to fetch early (see
 * fetch_ahead): a tile's rows are one contiguous run, but the kernels walk them in an
 * order the hardware prefetcher does not follow well, so without this a long context's
 * decode waits on memory row by row. */
static void plan_fetch(tile_rows *rows, const kv_store *store, int layer, int head,
                       size_t slot, int n) {
    rows->next = (const char *)store->codes +
                 kv_store_head_index(store, layer, head, slot) * store->head_bytes;
    rows->next_bytes = n > 0 ? (size_t)n * store->head_bytes : 0;
}

/* Head `head` of n consecutive positions pos .. pos + n - 1 (slots slot .. slot + n - 1
 * of one block), as a query at query_pos reads them: fp32, fp16, bf16 rows and int8
 * rows with one scale per head in place (the last three when head_dim is a multiple
 * of 8), others decoded into the tile buffer, and rows inside the residual window
 * copied from the full-precision rows instead; the rows AHEAD positions on (up to
 * n_seen, in whichever block holds them) are planned for fetching early. Returns the
 * ROWS_ kind of *rows. */
static int head_rows(const kv_layer_view *view, int is_value, int head, int pos, size_t slot,
                     int n, int n_seen, int query_pos, int head_dim, float *tile,
                     tile_rows *rows) {
    const kv_store *store = is_value ? view->value : view->key;
    *rows = (tile_rows){0};
    int ahead = pos + AHEAD;
    if (ahead < n_seen) {
        /* a paged cache's next rows are often in another block: look it up, so that
         * small blocks are fetched ahead as well as one long contiguous run */
        int block_end = ahead - ahead % view->block_size + view->block_size;
        int n_ahead = n_seen < block_end ? n_seen - ahead : block_end - ahead;
        plan_fetch(rows, store, view->layer, head, kv_view_slot(view, ahead),
                   n_ahead < TILE ? n_ahead : TILE);
    }
    int kv_dim = store->n_kv_heads * head_dim;
    int first_exact = view->window > 0 ? query_pos - view->window + 1 : query_pos + 1;
    if (pos + n <= first_exact) {
        size_t index = kv_store_head_index(store, view->layer, head, slot);
        const uint8_t *codes = store->codes + index * store->head_bytes;
        if (store->format == KV_FMT_F32) {
            rows->floats = (const float *)codes;
            return ROWS_F32;
        }
        rows->codes = codes;
        if (head_dim % 8 == 0) {
            if (store->format == KV_FMT_F16) return ROWS_F16;
            if (store->format == KV_FMT_BF16) return ROWS_BF16;
            /* eight values must share a scale: one group per head, or groups of 2^k >= 8 */
            int shift = 31;
            if (store->groups_per_head > 1)
                for (shift = 3; (1 << shift) < store->group; shift++) {}
            if (store->groups_per_head == 1 || (1 << shift) == store->group) {
                rows->scales = store->scales + index * store->groups_per_head;
                rows->zeros = store->zeros ? store->zeros + index * store->groups_per_head : NULL;
                rows->groups_per_head = store->groups_per_head;
                rows->group_shift = shift;
                if (store->format == KV_FMT_I8) return ROWS_I8;
                if (store->format == KV_FMT_I4) return ROWS_I4;
                if (store->format == KV_FMT_FP8) return ROWS_FP8;
            }
        }
    }
    for (int r = 0; r < n; r++) {
        float *row = tile + (size_t)r * head_dim;
        const float *source;
        if (pos + r < first_exact) {
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
    rows->floats = tile;
    return ROWS_F32;
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
                    tile_rows keys;
                    int kind = head_rows(view, 0, g, first + r0, slot + r0, n, n_seen,
                                         query_pos, head_dim, tile, &keys);
                    score_kernels[kind](att, head_stride, first + r0, queries, kv_mul,
                                        head_dim, &keys, n, scale);
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
                    tile_rows values;
                    int kind = head_rows(view, 1, g, first + r0, slot + r0, n, n_seen,
                                         query_pos, head_dim, tile, &values);
                    mix_kernels[kind](results, att, head_stride, first + r0, kv_mul, head_dim,
                                      &values, n);
                }
            }
        }
    }
}
