/* attention.c: causal grouped-query attention (MHA, GQA and MQA are one code path): the
 * fast tier. kv_plain_attention (plain.c) is the same computation as plain loops, to be
 * read first; this one must give its bits exactly (tests/c/test_core.c).
 *
 * Query head h reads key/value head h / kv_mul, where kv_mul = n_heads / n_kv_heads:
 * with kv_mul = 1 that is multi-head attention, with n_kv_heads = 1 multi-query.
 * One pass over the cache with the online softmax: positions are visited in tiles of
 * TILE rows, the keys of a tile scored, the running max and sum of the softmax updated,
 * then the tile's values added into the outputs, so keys and values are each read once
 * and no row of scores as long as the context is ever written. Rows are found through
 * the view's block table, one lookup per tile (or per block, when blocks are smaller),
 * not per token. A quantized cache is decoded eight values at a time in registers as its
 * rows are used (or, for the rarer group sizes, a tile at a time into a small buffer),
 * never into a full-precision copy of the cache. Every (token, head) pair is computed the
 * same way, over the same tiles counted from position 0, whether it arrives in a prefill
 * batch or alone in a decode step, and whichever cache holds its keys, so the cached,
 * uncached and paged paths agree bit for bit. In a prefill, up to QUERY_TILE tokens are
 * attended together: the tiles all of them see whole are read once for all their query
 * heads, and so is the tile holding their own positions (each head's later positions
 * masked), each query keeping its own order of operations; eight heads' online-softmax
 * steps are then one vector step, a head per lane (kv_softmax_tile8).
 */
#include <math.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "attention.h"
#include "common.h"
#include "ops.h"
#include "simd.h"
#include "quant.h"
#include "store.h"

/* Rows are read TILE at a time: a tile of dequantized head rows (16 x 128 floats = 8 KiB
 * for a typical head) stays in the L1 cache while every query head of the group uses it. */
#define TILE KV_ATTENTION_TILE
/* and the rows AHEAD positions on (the next tile) are asked for while a tile is computed:
 * one tile of keys and one of values in use, one of each on the way, 32 KiB for heads of
 * 128 floats, which is as much as the L1 cache holds. Further ahead measured no faster. */
#define AHEAD TILE
/* Query tokens of a prefill attended together: the tiles every one of them sees whole are
 * read once for all of them, each row loaded once for QUERY_TILE x kv_mul query heads, so
 * that even multi-head attention (kv_mul = 1) keeps several running sums per row loaded.
 * Eight tokens measured 5-8 % faster than four on the 15M and 110M shapes' attention. The
 * tile holding their own positions (the causal edge) is shared too where one tile holds all
 * eight and no residual window makes tokens read its rows differently (attend_edge). */
#define QUERY_TILE 8

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

/* Where a tile's weights lie: head m's weight of the tile's row p (its score, then its
 * exponential) is weights[m * head_step + p * pos_step]. Head by head (head_step TILE,
 * pos_step 1) for kv_softmax_tile, which takes one head's tile; position by position
 * (head_step 1, pos_step = the number of heads, a multiple of 8) for kv_softmax_tile8,
 * which takes eight heads' weights of a row as one vector. The kernels read and write
 * single weights, so either costs them the same. */
typedef struct {
    int head_step, pos_step;
} weight_layout;

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

/* [quote ch07-load-chunk] */
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
/* [end ch07-load-chunk] */
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

/* The rows AHEAD are fetched a share at a time, spread evenly over a kernel's n_steps
 * steps, so that the requests never pile up: a burst of a hundred prefetches stalls the
 * core until the memory system has room for them. Whole cache lines per step. */
static size_t fetch_share(const tile_rows *rows, size_t n_steps) {
    return ((rows->next_bytes + n_steps - 1) / n_steps + 63) & ~(size_t)63;
}

/* step `step`'s share of the rows AHEAD (nothing when share is 0) */
static ALWAYS_INLINE void fetch_ahead(const tile_rows *rows, size_t step, size_t share) {
    size_t from = step * share;
    size_t to = from + share < rows->next_bytes ? from + share : rows->next_bytes;
    for (size_t at = from; at < to; at += 64) __builtin_prefetch(rows->next + at);
}

/* Scores of QB query heads against RB rows of a tile (rows r0 .. r0 + RB - 1), times
 * scale, into weight (m, at + r0 + r). Each chunk of eight values of the RB rows is
 * loaded (and decoded) once for all QB queries, and each of the QB x RB dot products keeps
 * kv_dot's order (eight lanes, added pairwise, then the leftover elements). QB and RB are
 * constants at every call, so the loops unroll and the running sums live in registers.
 * Why several rows at once even for one query: a multiply-add takes four cycles to finish
 * and the core starts two per cycle, so a single running sum per row would leave the core
 * waiting on each addition before the next. */
/* [quote ch07-score-block] */
static ALWAYS_INLINE void score_block(float *weights, weight_layout layout, int at,
                                      const float *queries, int head_dim, const tile_rows *rows,
                                      int r0, float scale, int kind, int QB, int RB) {
    int d8 = head_dim & ~7;   /* tiles of codes have head_dim % 8 == 0: no leftovers */
    v8f sums[4][8];
    for (int m = 0; m < QB; m++)
        for (int r = 0; r < RB; r++) sums[m][r] = (v8f){0};
    for (int i = 0; i < d8; i += 8) {
        v8f keys[8];
        for (int r = 0; r < RB; r++) {
            keys[r] = load_chunk(rows, r0 + r, i, head_dim, kind);
            if (QB > 1) IN_REGISTER(keys[r]);
        }
        for (int m = 0; m < QB; m++) {
            v8f query = load8(queries + (size_t)m * head_dim + i);
            if (RB > 1) IN_REGISTER(query);
            for (int r = 0; r < RB; r++) sums[m][r] = madd(query, keys[r], sums[m][r]);
        }
    }
/* [end ch07-score-block] */
    /* the lanes of each running sum added up, four sums at a time where they come in fours;
     * four heads' weights of a row lie side by side when the weights go position by
     * position, and are stored as one (dot * scale in each lane: the same bits) */
    if (QB == 4 && layout.head_step == 1 && !(kind == ROWS_F32 && d8 < head_dim)) {
        for (int r = 0; r < RB; r++) {
            v4f four = reduce_lanes4(sums[0][r], sums[1][r], sums[2][r], sums[3][r]) * scale;
            memcpy(weights + (ptrdiff_t)(at + r0 + r) * layout.pos_step, &four, sizeof four);
        }
        return;
    }
    float dots[4][8];
    if (QB == 4) {
        for (int r = 0; r < RB; r++) {
            v4f four = reduce_lanes4(sums[0][r], sums[1][r], sums[2][r], sums[3][r]);
            for (int m = 0; m < 4; m++) dots[m][r] = four[m];
        }
    } else if (RB % 4 == 0) {
        for (int m = 0; m < QB; m++)
            for (int r = 0; r < RB; r += 4) {
                v4f four = reduce_lanes4(sums[m][r], sums[m][r + 1], sums[m][r + 2],
                                         sums[m][r + 3]);
                for (int j = 0; j < 4; j++) dots[m][r + j] = four[j];
            }
    } else {
        for (int m = 0; m < QB; m++)
            for (int r = 0; r < RB; r++) dots[m][r] = reduce_lanes(sums[m][r]);
    }
    for (int m = 0; m < QB; m++) {
        for (int r = 0; r < RB; r++) {
            float dot = dots[m][r];
            if (kind == ROWS_F32 && d8 < head_dim)   /* leftover elements: head_dim % 8 != 0 */
                dot = add_tail(dot, queries + (size_t)m * head_dim,
                               rows->floats + (size_t)(r0 + r) * head_dim, d8, head_dim);
            weights[m * layout.head_step + (at + r0 + r) * layout.pos_step] = dot * scale;
        }
    }
}

/* All n rows of a tile against QB query heads, RB rows at a time, then the last few one
 * at a time; the first group of queries also fetches the rows AHEAD. */
static ALWAYS_INLINE void score_rows(float *weights, weight_layout layout, int at,
                                     const float *queries, int head_dim, const tile_rows *rows,
                                     int n, float scale, int kind, int QB, int RB, int fetch) {
    size_t share = fetch ? fetch_share(rows, (size_t)n) : 0;   /* one step per row */
    int r = 0;
    for (; r + RB <= n; r += RB) {
        for (int j = r; j < r + RB; j++) fetch_ahead(rows, (size_t)j, share);
        score_block(weights, layout, at, queries, head_dim, rows, r, scale, kind, QB, RB);
    }
    for (; r < n; r++) {
        fetch_ahead(rows, (size_t)r, share);
        score_block(weights, layout, at, queries, head_dim, rows, r, scale, kind, QB, 1);
    }
}

/* Rows scored at a time against four query heads: four where the CPU has 32 vector
 * registers (AVX-512: 16 running sums, four rows and a query fit), else two (16 registers). */
#ifdef __AVX512F__
#define ROWS_PER_FOUR_HEADS 4
#else
#define ROWS_PER_FOUR_HEADS 2
#endif

/* [quote ch07-score-tile] */
/* weights[m][at + r] = q_m . row_r * scale for the group's kv_mul query heads and the n
 * rows: four query heads at a time against two rows (four with AVX-512), then two against
 * four and one against eight, so that every group size keeps at least eight sums going
 * (enough to keep both multiply-add units busy) and a full tile of 16 rows leaves no row
 * over. */
static ALWAYS_INLINE void score_tile(float *weights, weight_layout layout, int at,
                                     const float *queries, int kv_mul, int head_dim,
                                     const tile_rows *rows, int n, float scale, int kind) {
    int m = 0;
    for (; m + 4 <= kv_mul; m += 4)
        score_rows(weights + m * layout.head_step, layout, at, queries + (size_t)m * head_dim, head_dim, rows, n,
                   scale, kind, 4, ROWS_PER_FOUR_HEADS, m == 0);
    for (; m + 2 <= kv_mul; m += 2)
        score_rows(weights + m * layout.head_step, layout, at, queries + (size_t)m * head_dim, head_dim, rows, n,
                   scale, kind, 2, 4, m == 0);
    for (; m < kv_mul; m++)
        score_rows(weights + m * layout.head_step, layout, at, queries + (size_t)m * head_dim, head_dim, rows, n,
                   scale, kind, 1, 8, m == 0);
}
/* [end ch07-score-tile] */

/* results_m[i .. i + 8 DB) += sum over the n rows of weight (m, at + r) * row_r, for QB
 * query heads: QB x DB running sums, loaded from the outputs, kept in registers while the
 * rows are added in order (exactly as one axpy per row would add them), stored back. Each
 * row chunk is loaded (and decoded) once for all QB heads. */
static ALWAYS_INLINE void mix_block(float *results, const float *weights, weight_layout layout,
                                    int at, int head_dim, const tile_rows *rows, int n, int i,
                                    int kind, int QB, int DB, size_t first_step, size_t share) {
    v8f sums[4][8];
    for (int m = 0; m < QB; m++)
        for (int d = 0; d < DB; d++) sums[m][d] = load8(results + (size_t)m * head_dim + i + 8 * d);
    for (int r = 0; r < n; r++) {
        fetch_ahead(rows, first_step + (size_t)r, share);
        v8f values[8];
        for (int d = 0; d < DB; d++) {
            values[d] = load_chunk(rows, r, i + 8 * d, head_dim, kind);
            if (QB > 1) IN_REGISTER(values[d]);
        }
        /* row r's weights: heads at constant offsets from one pointer (an int index per
         * head was sign-extended and added anew for every load) */
        const float *row_weights = weights + (ptrdiff_t)(at + r) * layout.pos_step;
        for (int m = 0; m < QB; m++) {
            v8f weight = splat(row_weights[m * layout.head_step]);
            for (int d = 0; d < DB; d++) sums[m][d] = madd(weight, values[d], sums[m][d]);
        }
    }
    for (int m = 0; m < QB; m++)
        for (int d = 0; d < DB; d++)
            memcpy(results + (size_t)m * head_dim + i + 8 * d, &sums[m][d], sizeof(v8f));
}

/* Calls of mix_block that cover c chunks of eight, DB at a time, then the chunks left over
 * four, two and one at a time (as mix_rows makes them). */
static int mix_calls(int c, int DB) {
    int calls = c / DB;
    for (int width = 4, left = c % DB; width >= 1; width /= 2) {
        if (width >= DB) continue;
        calls += left / width;
        left %= width;
    }
    return calls;
}

/* The values of QB query heads, DB chunks of eight at a time, then the last chunks four,
 * two and one at a time: a head of 48 values (six chunks) as four and two, not six calls
 * of one running sum per head, each waiting on its multiply-adds in turn row after row.
 * Each output value still adds the rows in order, whichever call holds it: the same bits. */
static ALWAYS_INLINE void mix_rows(float *results, const float *weights, weight_layout layout,
                                   int at, int head_dim, const tile_rows *rows, int n, int kind,
                                   int QB, int DB, int fetch) {
    int d8 = head_dim & ~7, i = 0;
    /* one step per row of each call of mix_block */
    int n_calls = mix_calls(d8 / 8, DB);
    size_t share = fetch && n_calls > 0 ? fetch_share(rows, (size_t)n * (size_t)n_calls) : 0;
    size_t step = 0;
    for (; i + 8 * DB <= d8; i += 8 * DB, step += (size_t)n)
        mix_block(results, weights, layout, at, head_dim, rows, n, i, kind, QB, DB, step, share);
    for (; DB > 4 && i + 32 <= d8; i += 32, step += (size_t)n)
        mix_block(results, weights, layout, at, head_dim, rows, n, i, kind, QB, 4, step, share);
    for (; DB > 2 && i + 16 <= d8; i += 16, step += (size_t)n)
        mix_block(results, weights, layout, at, head_dim, rows, n, i, kind, QB, 2, step, share);
    for (; i < d8; i += 8, step += (size_t)n)
        mix_block(results, weights, layout, at, head_dim, rows, n, i, kind, QB, 1, step, share);
}

/* results_m += sum over the n rows of weight (m, at + r) * row_r for the kv_mul query
 * heads: four heads x two chunks (eight running sums), two x four, one x eight. */
static ALWAYS_INLINE void mix_tile(float *results, const float *weights, weight_layout layout,
                                   int at, int kv_mul, int head_dim, const tile_rows *rows, int n,
                                   int kind) {
    int m = 0;
    for (; m + 4 <= kv_mul; m += 4)
        mix_rows(results + (size_t)m * head_dim, weights + m * layout.head_step, layout, at,
                 head_dim, rows, n,
                 kind, 4, 2, m == 0);
    for (; m + 2 <= kv_mul; m += 2)
        mix_rows(results + (size_t)m * head_dim, weights + m * layout.head_step, layout, at,
                 head_dim, rows, n,
                 kind, 2, 4, m == 0);
    for (; m < kv_mul; m++)
        mix_rows(results + (size_t)m * head_dim, weights + m * layout.head_step, layout, at,
                 head_dim, rows, n,
                 kind, 1, 8, m == 0);
    int d8 = head_dim & ~7;
    if (kind == ROWS_F32 && d8 < head_dim) {   /* leftover elements, head_dim % 8 != 0 */
        for (m = 0; m < kv_mul; m++) {
            const float *p = weights + m * layout.head_step + at * layout.pos_step;
            float *o = results + (size_t)m * head_dim;
            for (int i = d8; i < head_dim; i++) {
                float acc = o[i];
                for (int r = 0; r < n; r++)
                    acc += p[r * layout.pos_step] * rows->floats[(size_t)r * head_dim + i];
                o[i] = acc;
            }
        }
    }
}

/* One version of each kernel per kind of row and weight layout, which the compiler builds
 * separately: with head_step a constant the weights' addresses take no register (a layout
 * passed as variables made mix_f32 spill and run 20 % slower). */
#define KERNELS(NAME, KIND)                                                                   \
    static void score_##NAME(float *weights, weight_layout layout, int at, const float *q,    \
                             int kv_mul, int head_dim, const tile_rows *rows, int n,          \
                             float scale) {                                                   \
        if (layout.head_step == 1)                                                            \
            score_tile(weights, (weight_layout){1, layout.pos_step}, at, q, kv_mul, head_dim,  \
                       rows, n, scale, KIND);                                                 \
        else                                                                                  \
            score_tile(weights, (weight_layout){TILE, 1}, at, q, kv_mul, head_dim, rows, n,    \
                       scale, KIND);                                                          \
    }                                                                                         \
    static void mix_##NAME(float *results, const float *weights, weight_layout layout, int at, \
                           int kv_mul, int head_dim, const tile_rows *rows, int n) {          \
        if (layout.head_step == 1)                                                            \
            mix_tile(results, weights, (weight_layout){1, layout.pos_step}, at, kv_mul,        \
                     head_dim, rows, n, KIND);                                                \
        else                                                                                  \
            mix_tile(results, weights, (weight_layout){TILE, 1}, at, kv_mul, head_dim, rows, n,\
                     KIND);                                                                   \
    }
KERNELS(f32, ROWS_F32)
KERNELS(i8, ROWS_I8)
KERNELS(f16, ROWS_F16)
KERNELS(bf16, ROWS_BF16)
KERNELS(i4, ROWS_I4)
KERNELS(fp8, ROWS_FP8)

typedef void (*score_kernel)(float *, weight_layout, int, const float *, int, int,
                             const tile_rows *, int, float);
typedef void (*mix_kernel)(float *, const float *, weight_layout, int, int, int, const tile_rows *,
                           int);
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
 * of one block), as a query at query_pos reads them: fp32 rows in place; fp16, bf16, and
 * int8, int4 and fp8 whose groups are the whole head or a power of two of at least 8
 * values, in place too, decoded eight at a time in registers (when head_dim is a
 * multiple of 8); others decoded into the tile buffer, and rows inside the residual window
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
        /* a paged pool's next rows are often in another block: look it up, so that
         * small blocks are fetched ahead as well as one long contiguous run */
        int block_end = kv_view_block_end(view, ahead);
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

/* Positions pos .. end - 1, or up to the end of pos's block if that comes first: the run
 * of rows that lie next to each other in the store. */
static int run_length(const kv_layer_view *view, int pos, int end) {
    int block_end = kv_view_block_end(view, pos);
    return (end < block_end ? end : block_end) - pos;
}

/* row *= by: an output row's sum rescaled by the online softmax, and its final division. */
static ALWAYS_INLINE void scale_row(float *row, float by, int n) {
    for (int i = 0; i < n; i++) row[i] *= by;
}

/* The query heads attended together and their running state, n of them: the kv_mul heads
 * of one token in a decode step, those of up to QUERY_TILE tokens in a prefill (token by
 * token, each token's heads in order). Head m's query is row m of queries, its running sum
 * of weighted values row m of results. */
typedef struct {
    float *queries;            /* (n, head_dim) */
    float *results;            /* (n, head_dim) */
    float *weights;            /* n x TILE, laid out as layout says */
    float *running_max;        /* (n,) the online softmax's max so far */
    float *running_sum;        /* (n,) and its sum of exponentials */
    int n;
    weight_layout layout;
} query_heads;

/* Eight heads' softmax steps at once (kv_softmax_tile8) where the heads come in eights:
 * eight tokens of a prefill block, or a group of 8, 16 .. query heads. */
static weight_layout layout_for(int n) {
    return n % 8 == 0 ? (weight_layout){1, n} : (weight_layout){TILE, 1};
}

/* heads from..from + n - 1 of a group (the heads of one token of a block); the weights of
 * a tile live only while it is attended, so these reuse the group's, laid out for n heads */
static query_heads some_heads(const query_heads *all, int from, int n, int head_dim) {
    return (query_heads){all->queries + (size_t)from * head_dim,
                         all->results + (size_t)from * head_dim, all->weights,
                         all->running_max + from, all->running_sum + from, n, layout_for(n)};
}

/* Where a thread's scratch puts a block's state (see kv_attention_scratch): the weights,
 * running maxes and sums of up to QUERY_TILE x kv_mul heads, a tile of rows to decode keys
 * or values into, the heads' queries and their results. */
static query_heads block_scratch(float *scratch, int n, int kv_mul, int head_dim,
                                 float **tile) {
    size_t most = (size_t)QUERY_TILE * kv_mul, head = kv_round_up16((size_t)head_dim);
    float *weights = scratch;
    *tile = weights + kv_round_up16(most * (TILE + 2));
    float *queries = *tile + TILE * head;
    return (query_heads){queries, queries + most * head_dim, weights, weights + most * TILE,
                         weights + most * (TILE + 1), n, layout_for(n)};
}

size_t kv_attention_scratch(int n_heads, int n_kv_heads, int head_dim) {
    size_t most = (size_t)QUERY_TILE * (size_t)(n_heads / n_kv_heads);
    return kv_round_up16(most * (TILE + 2)) + TILE * kv_round_up16((size_t)head_dim) +
           2 * most * (size_t)head_dim;
}

/* The online softmax's step over a tile of n scored rows for every head of `heads`: each
 * head's scores become e^(s - max so far), and what its output summed under an older,
 * smaller max is scaled down. Eight heads at a time where they are laid out for it, one
 * head per lane: the same bits as one at a time (ops.h). */
static void softmax_step(const query_heads *heads, int n, int head_dim) {
    float corrections[8];
    int at_once = heads->layout.head_step == 1 ? 8 : 1;
    for (int m = 0; m < heads->n; m += at_once) {
        if (at_once == 8)
            kv_softmax_tile8(heads->weights + m, n, heads->layout.pos_step,
                             &heads->running_max[m], &heads->running_sum[m], corrections);
        else
            corrections[0] = kv_softmax_tile(heads->weights + m * TILE, n,
                                             &heads->running_max[m], &heads->running_sum[m]);
        for (int j = 0; j < at_once; j++)
            if (corrections[j] != 1.0f)
                scale_row(heads->results + (size_t)(m + j) * head_dim, corrections[j], head_dim);
    }
}

/* Positions from .. to - 1 of a tile that starts at origin, for every head of `heads`: the
 * keys scored into the weights (is_value 0), or the values mixed by them into the outputs
 * (1), a run of rows at a time (one run, unless the tile spans blocks of a paged pool),
 * read as a query at query_pos that sees n_seen positions reads them. */
static void walk_rows(const kv_layer_view *view, int is_value, int g, int origin, int from,
                      int to, int n_seen, int query_pos, const query_heads *heads, int head_dim,
                      float scale, float *tile) {
    for (int pos = from; pos < to;) {
        int n = run_length(view, pos, to);
        tile_rows rows;
        int kind = head_rows(view, is_value, g, pos, kv_view_slot(view, pos), n, n_seen,
                             query_pos, head_dim, tile, &rows);
        if (is_value)
            mix_kernels[kind](heads->results, heads->weights, heads->layout, pos - origin,
                              heads->n, head_dim, &rows, n);
        else
            score_kernels[kind](heads->weights, heads->layout, pos - origin, heads->queries,
                                heads->n, head_dim, &rows, n, scale);
        pos += n;
    }
}

/* [quote ch07-kv-attention] */
/* One step of the pass over KV head g's positions: positions tile_start .. tile_end - 1 (a
 * tile, or the first rows of the last one), read as a query at query_pos that sees n_seen
 * positions reads them, for every head of `heads`. The tile's keys are scored, a run of
 * rows at a time (one run, unless the tile spans blocks of a paged pool); the online
 * softmax turns the scores into e^(s - max so far) and scales down whatever the outputs
 * summed under an older, smaller max; the values, weighted by those exponentials, are
 * added into the outputs. Each key and value row is loaded once for all the heads. */
static void attend_tile(const kv_layer_view *view, int g, int tile_start, int tile_end,
                        int n_seen, int query_pos, const query_heads *heads, int head_dim,
                        float scale, float *tile) {
    walk_rows(view, 0, g, tile_start, tile_start, tile_end, n_seen, query_pos, heads, head_dim,
              scale, tile);
    softmax_step(heads, tile_end - tile_start, head_dim);
    walk_rows(view, 1, g, tile_start, tile_start, tile_end, n_seen, query_pos, heads, head_dim,
              scale, tile);
}

/* The causal edge of a block all at once: the tile holding every token's own position
 * (tile_start .. on, one tile: the caller checks), where each token of the block sees the
 * rows up to its own. All count x kv_mul heads are scored against the rows the last token
 * sees; each head's scores past its own token's position are set to -inf, which is what
 * kv_softmax_tile pads a short tile with, so each head's step gives the bits of its own
 * token's short tile; the rows every token sees are mixed into all the heads, then each
 * token's own further rows into its heads, every output adding its rows in order as before. */
static void attend_edge(const kv_layer_view *view, int g, int tile_start, int first_pos,
                        int count, int kv_mul, const query_heads *all, int head_dim,
                        float scale, float *tile) {
    int n_seen = first_pos + count, query_pos = n_seen - 1, shared = first_pos + 1;
    walk_rows(view, 0, g, tile_start, tile_start, n_seen, n_seen, query_pos, all, head_dim,
              scale, tile);
    for (int m = 0; m < all->n; m++)
        for (int pos = first_pos + 1 + m / kv_mul; pos < n_seen; pos++)
            all->weights[m * all->layout.head_step + (pos - tile_start) * all->layout.pos_step] =
                -INFINITY;
    softmax_step(all, n_seen - tile_start, head_dim);
    walk_rows(view, 1, g, tile_start, tile_start, shared, n_seen, query_pos, all, head_dim,
              scale, tile);
    for (int i = 1; i < count; i++) {
        query_heads own = some_heads(all, i * kv_mul, kv_mul, head_dim);
        own.weights = all->weights + i * kv_mul * all->layout.head_step;
        own.layout = all->layout;
        walk_rows(view, 1, g, tile_start, shared, first_pos + i + 1, n_seen, query_pos, &own,
                  head_dim, scale, tile);
    }
}

/* Attention of `count` consecutive tokens, the first at position first_pos, for the kv_mul
 * query heads that share KV head g (queries and outputs (count, n_heads * head_dim), from
 * the group's first head on). One pass over the positions, TILE at a time, counted from
 * position 0, so that a query meets the same tiles whether it came alone or in a prefill,
 * and whatever the cache's block size: its numbers come out bit-identical. The tiles
 * before the first token's own are whole for every token of the block and are attended by
 * all count x kv_mul heads at once, each row loaded once for all of them; so is the tile of
 * their own positions where attend_edge can; otherwise from there on each token goes on
 * alone, to its own position (the causal mask). */
static void attend_block(float *out, const float *q, const kv_layer_view *view, int count,
                         int first_pos, int g, int kv_mul, int n_heads, int head_dim,
                         float *scratch) {
    size_t q_dim = (size_t)n_heads * head_dim, group_dim = (size_t)kv_mul * head_dim;
    float scale = 1.0f / sqrtf((float)head_dim), *tile;
    query_heads all = block_scratch(scratch, count * kv_mul, kv_mul, head_dim, &tile);
    for (int i = 0; i < count; i++)     /* the block's queries side by side */
        memcpy(all.queries + i * group_dim, q + i * q_dim, group_dim * sizeof(float));
    for (int m = 0; m < all.n; m++) {
        all.running_max[m] = -INFINITY;
        all.running_sum[m] = 0.0f;
    }
    memset(all.results, 0, (size_t)all.n * head_dim * sizeof(float));

    /* a row is read alike by every token when it is older than the first token's residual
     * window (a quantized cache's newest rows are read in full precision) */
    int first_exact = view->window > 0 ? first_pos - view->window + 1 : first_pos + 1;
    int tile_start = 0;
    for (; tile_start + TILE <= first_exact; tile_start += TILE)
        attend_tile(view, g, tile_start, tile_start + TILE, first_pos + 1, first_pos, &all,
                    head_dim, scale, tile);
    /* no residual window: every token reads the edge tile's rows alike, in place */
    int edge_at_once = view->window == 0 && all.layout.head_step == 1 &&
                       first_pos + count <= tile_start + TILE;
    if (edge_at_once)
        attend_edge(view, g, tile_start, first_pos, count, kv_mul, &all, head_dim, scale, tile);
    for (int i = 0; i < count && !edge_at_once; i++) {
        query_heads own = some_heads(&all, i * kv_mul, kv_mul, head_dim);
        int n_seen = first_pos + i + 1;        /* positions 0 .. its own */
        for (int start = tile_start; start < n_seen; start += TILE)
            attend_tile(view, g, start, n_seen - start < TILE ? n_seen : start + TILE, n_seen,
                        first_pos + i, &own, head_dim, scale, tile);
    }
    /* divide by the sum of the exponentials: the softmax's normalization, once */
    for (int m = 0; m < all.n; m++) {
        float *result = all.results + (size_t)m * head_dim;
        scale_row(result, 1.0f / all.running_sum[m], head_dim);
        memcpy(out + (size_t)(m / kv_mul) * q_dim + (size_t)(m % kv_mul) * head_dim, result,
               (size_t)head_dim * sizeof(float));
    }
}

void kv_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                  int start_pos, int n_heads, int n_kv_heads, int head_dim, float *scratch,
                  size_t scratch_stride, int n_threads) {
    int kv_mul = n_heads / n_kv_heads;
    int n_blocks = (n_tokens + QUERY_TILE - 1) / QUERY_TILE;
    size_t q_dim = (size_t)n_heads * head_dim;
    /* One iteration per (block of QUERY_TILE tokens, KV head): the kv_mul query heads that
     * share a KV head are done together, for every token of the block, so each key and
     * value row is read from memory (and dequantized) once for all of them (the point of
     * grouped-query attention), not once per head and token. Iterations are dealt out one
     * at a time in turn: in a prefill a later token sees more positions, so handing each
     * thread a contiguous half would give the last thread most of the work. */
    #pragma omp parallel for collapse(2) schedule(static, 1) num_threads(n_threads) \
        if ((int64_t)n_tokens * n_heads * (start_pos + n_tokens) * head_dim >= KV_PARALLEL_MIN_WORK \
            && (int64_t)n_blocks * n_kv_heads > 1)
    for (int b = 0; b < n_blocks; b++) {
        for (int g = 0; g < n_kv_heads; g++) {
            int t = b * QUERY_TILE, count = n_tokens - t < QUERY_TILE ? n_tokens - t : QUERY_TILE;
            /* the group's query heads are consecutive: heads g*kv_mul .. g*kv_mul + kv_mul-1 */
            size_t first = t * q_dim + (size_t)g * kv_mul * head_dim;
            attend_block(out + first, q + first, view, count, start_pos + t, g, kv_mul, n_heads,
                         head_dim, scratch + (size_t)omp_get_thread_num() * scratch_stride);
        }
    }
}
/* [end ch07-kv-attention] */
