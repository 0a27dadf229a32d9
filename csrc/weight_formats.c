/* weight_formats.c: weight matrices in fp16, bf16, Q8_0, Q4_0 and Q4_1, and the fast tier
 * of the matrix product over them.
 *
 * Each weight becomes its float32 value in a register (a half or bf16 widened, a Q8_0 code
 * times its block's scale, which is exact: 8 bits times 11 fit float32's 24; a Q4_0 code
 * minus 8 times d, exact too; a Q4_1 code times d plus m, whose one rounding is the add's,
 * as in kv_weight_row_dequantize) and meets the
 * activations in kv_dot's order: eight running lanes of multiply-adds over chunks of eight,
 * the lanes added pairwise, leftovers in order. So the result is the float32 product over
 * the dequantized matrix, bit for bit (plain.c's kv_plain_matmul_weights is the spec).
 * What changes is the memory read: a decode step streams 2 bytes a weight, or 1.0625,
 * instead of 4. The block formats' other product, against int8 activations
 * (kv_matmul_int8), follows plain.c's kv_plain_matmul_int8 instead: each block's 32 byte
 * products added exactly as integers, then one multiply-add a block into one running sum.
 * Not here: which matrices of a model use which format (model.c, loaders).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "int8_sums.h"
#include "ops.h"
#include "plain.h"
#include "quant.h"
#include "simd.h"
#include "weight_formats.h"

/* ---- eight weights at a time, as float32 ------------------------------------------------- */

/* eight int8 codes as floats (exact) */
static ALWAYS_INLINE v8f int8_to_floats(const int8_t *codes) {
#ifdef __AVX2__
    __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return (v8f)_mm256_cvtepi32_ps(wide);
#else
    v8f out;
    for (int j = 0; j < 8; j++) out[j] = (float)codes[j];
    return out;
#endif
}

/* eight halves or bf16s as floats (exact) */
static ALWAYS_INLINE v8f halves_to_floats(const uint8_t *bytes, int bf16) {
    v8f out;
    if (bf16) {
#ifdef __AVX2__
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bytes));
        return (v8f)_mm256_slli_epi32(wide, 16);
#endif
    } else {
#ifdef __F16C__
        return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bytes));
#endif
    }
    uint16_t codes[8];
    memcpy(codes, bytes, sizeof codes);
    for (int j = 0; j < 8; j++) {
        float value;
        if (bf16) kv_dequantize_bf16(&value, &codes[j], 1);
        else kv_dequantize_f16(&value, &codes[j], 1);
        out[j] = value;
    }
    return out;
}

/* a block's scale d (or Q4_1's m, at block + 2), a half, as a float */
static ALWAYS_INLINE float block_scale(const uint8_t *block) {
#ifdef __F16C__
    uint16_t code;
    memcpy(&code, block, sizeof code);
    return _cvtsh_ss(code);
#else
    uint16_t code;
    float value;
    memcpy(&code, block, sizeof code);
    kv_dequantize_f16(&value, &code, 1);
    return value;
#endif
}

/* eight 4-bit codes as floats (exact): the low nibbles of bytes[0 .. 7], or their high
 * nibbles (high = 1) */
static ALWAYS_INLINE v8f nibbles_to_floats(const uint8_t *bytes, int high) {
#ifdef __AVX2__
    __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    wide = high ? _mm256_srli_epi32(wide, 4) : _mm256_and_si256(wide, _mm256_set1_epi32(0x0F));
    return (v8f)_mm256_cvtepi32_ps(wide);
#else
    v8f out;
    for (int j = 0; j < 8; j++) out[j] = (float)(high ? bytes[j] >> 4 : bytes[j] & 0x0F);
    return out;
#endif
}

/* The 32 float32 values of a Q8_0, Q4_0 or Q4_1 block, eight to a vector, equal to
 * kv_weight_row_dequantize's. A Q4 block's values 0 .. 15 are its bytes' low nibbles,
 * 16 .. 31 their high nibbles. */
static ALWAYS_INLINE void block_to_floats(const uint8_t *block, kv_weight_format format,
                                          v8f out[4]) {
    v8f d = splat(block_scale(block));
    if (format == KV_WEIGHT_Q8_0) {
        for (int j = 0; j < 4; j++) out[j] = int8_to_floats((const int8_t *)block + 2 + 8 * j) * d;
        return;
    }
    const uint8_t *codes = block + (format == KV_WEIGHT_Q4_1 ? 4 : 2);
    for (int j = 0; j < 4; j++) {
        v8f code = nibbles_to_floats(codes + 8 * (j & 1), j >> 1);
        if (format == KV_WEIGHT_Q4_0) out[j] = (code - splat(8.0f)) * d;   /* both exact */
        else out[j] = madd(code, d, splat(block_scale(block + 2)));   /* code * d exact */
    }
}

/* A row of a matrix in a 16-bit or block format against x, in kv_dot's order (eight lanes
 * of multiply-adds, added pairwise, leftovers in order), each weight made float32 on the
 * way. (Four rows at a time, sharing each chunk of x, measured slower here: 0.97-1.09x of
 * fp32 against 1.7-1.9x for this, benchmarks/bench_weights.py.) */
static float dot_row(const uint8_t *row, kv_weight_format format, const float *x, int in_dim) {
    v8f acc = {0};
    if (kv_weight_takes_int8(format)) {    /* a block format */
        size_t block_bytes = kv_weight_block_bytes(format);
        for (int b = 0; b < in_dim / 32; b++) {
            v8f values[4];
            block_to_floats(row + (size_t)b * block_bytes, format, values);
            for (int j = 0; j < 4; j++) acc = madd(values[j], load8(x + 32 * b + 8 * j), acc);
        }
        return reduce_lanes(acc);            /* in_dim is a multiple of 32: no leftovers */
    }
    int bf16 = format == KV_WEIGHT_BF16, n8 = in_dim & ~7;
    for (int i = 0; i < n8; i += 8)
        acc = madd(halves_to_floats(row + 2 * (size_t)i, bf16), load8(x + i), acc);
    float sum = reduce_lanes(acc);
    for (int i = n8; i < in_dim; i++) {      /* the leftovers, in order, as kv_dot */
        float w;
        kv_weight_row_dequantize(format, row + 2 * (size_t)i, 1, &w);
        sum += w * x[i];
    }
    return sum;
}

/* Four rows, wherever they lie, against x: out[r] is row r's dot_row, bit for bit (each
 * row keeps its own eight lanes, in kv_dot's order). Four chains of multiply-adds instead
 * of one: a single row's chain waits on the multiply-add's latency at every chunk of
 * eight, which caps it near two weights a cycle, below what memory delivers. */
static void dot_rows4(const uint8_t *const rows[4], kv_weight_format format, const float *x,
                      int in_dim, float out[4]) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    if (kv_weight_takes_int8(format)) {    /* a block format */
        size_t block_bytes = kv_weight_block_bytes(format);
        for (int b = 0; b < in_dim / 32; b++) {
            size_t at = (size_t)b * block_bytes;
            v8f xv[4], v0[4], v1[4], v2[4], v3[4];
            for (int j = 0; j < 4; j++) xv[j] = load8(x + 32 * b + 8 * j);
            block_to_floats(rows[0] + at, format, v0);
            block_to_floats(rows[1] + at, format, v1);
            block_to_floats(rows[2] + at, format, v2);
            block_to_floats(rows[3] + at, format, v3);
            for (int j = 0; j < 4; j++) {
                a0 = madd(v0[j], xv[j], a0);
                a1 = madd(v1[j], xv[j], a1);
                a2 = madd(v2[j], xv[j], a2);
                a3 = madd(v3[j], xv[j], a3);
            }
        }
        v4f sums = reduce_lanes4(a0, a1, a2, a3);    /* no leftovers: whole blocks */
        for (int r = 0; r < 4; r++) out[r] = sums[r];
        return;
    }
    int bf16 = format == KV_WEIGHT_BF16, n8 = in_dim & ~7;
    for (int i = 0; i < n8; i += 8) {
        v8f xv = load8(x + i);
        a0 = madd(halves_to_floats(rows[0] + 2 * (size_t)i, bf16), xv, a0);
        a1 = madd(halves_to_floats(rows[1] + 2 * (size_t)i, bf16), xv, a1);
        a2 = madd(halves_to_floats(rows[2] + 2 * (size_t)i, bf16), xv, a2);
        a3 = madd(halves_to_floats(rows[3] + 2 * (size_t)i, bf16), xv, a3);
    }
    v4f sums = reduce_lanes4(a0, a1, a2, a3);
    for (int r = 0; r < 4; r++) {
        float sum = sums[r];
        for (int i = n8; i < in_dim; i++) {   /* the leftovers, in order, as kv_dot */
            float w;
            kv_weight_row_dequantize(format, rows[r] + 2 * (size_t)i, 1, &w);
            sum += w * x[i];
        }
        out[r] = sum;
    }
}

/* Rows lo .. hi - 1 of w against few tokens (a decode step): each row is made float32 as
 * it streams past, once per token, which costs little beside the memory read. The rows
 * are read as four runs side by side, a row of each at a time, as ops.c's small batches
 * are: four streams for the hardware prefetcher to follow, four chains of arithmetic. */
static void rows_streamed(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                          int n_tokens, int in_dim, int out_dim, int lo, int hi) {
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    int per_run = (hi - lo) / 4;
    for (int k = 0; k < per_run; k++) {
        int o[4] = {lo + k, lo + per_run + k, lo + 2 * per_run + k, lo + 3 * per_run + k};
        const uint8_t *rows[4] = {w + (size_t)o[0] * row_bytes, w + (size_t)o[1] * row_bytes,
                                  w + (size_t)o[2] * row_bytes, w + (size_t)o[3] * row_bytes};
        for (int t = 0; t < n_tokens; t++) {
            float sums[4];
            dot_rows4(rows, format, x + (size_t)t * in_dim, in_dim, sums);
            for (int r = 0; r < 4; r++) out[(size_t)t * out_dim + o[r]] = sums[r];
        }
    }
    for (int o = lo + 4 * per_run; o < hi; o++)   /* the last few, one at a time */
        for (int t = 0; t < n_tokens; t++)
            out[(size_t)t * out_dim + o] = dot_row(w + (size_t)o * row_bytes, format,
                                                   x + (size_t)t * in_dim, in_dim);
}

/* A row's float32 values (exact, as kv_weight_row_dequantize), eight at a time */
static void convert_row(kv_weight_format format, const uint8_t *row, int in_dim, float *out) {
    if (kv_weight_takes_int8(format)) {    /* a block format */
        size_t block_bytes = kv_weight_block_bytes(format);
        for (int b = 0; b < in_dim / 32; b++) {
            v8f values[4];
            block_to_floats(row + (size_t)b * block_bytes, format, values);
            memcpy(out + 32 * b, values, sizeof values);
        }
        return;
    }
    int bf16 = format == KV_WEIGHT_BF16, n8 = in_dim & ~7;
    for (int i = 0; i < n8; i += 8) {
        v8f values = halves_to_floats(row + 2 * (size_t)i, bf16);
        memcpy(out + i, &values, sizeof values);
    }
    kv_weight_row_dequantize(format, row + 2 * (size_t)n8, in_dim - n8, out + n8);
}

/* Row blocks lo .. hi - 1 (four rows each) of w against many tokens (a prefill, a big
 * batch): for each chunk of tokens, a block's four rows are made float32 in `rows` (4 *
 * in_dim floats) and go through the float32 kernel (kv_matmul_four_rows), so the rows are
 * converted once per chunk of KV_TOKEN_CHUNK tokens, not once per token. packed: room for
 * a chunk's tokens packed for ops.c's 512-bit tile (every thread calls this, and they pack
 * each chunk together), or NULL. */
static void blocks_converted(float *out, const float *x, float *packed,
                             const uint8_t *w, kv_weight_format format, int n_tokens,
                             int in_dim, int out_dim, int lo, int hi, float *rows) {
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    const float *four[4] = {rows, rows + in_dim, rows + 2 * (size_t)in_dim, rows + 3 * (size_t)in_dim};
    for (int first = 0; first < n_tokens; first += KV_TOKEN_CHUNK) {
        int chunk = n_tokens - first < KV_TOKEN_CHUNK ? n_tokens - first : KV_TOKEN_CHUNK;
        if (packed != NULL) kv_pack_chunk(x, first, chunk, in_dim, packed);
        for (int block = lo; block < hi; block++) {
            int o = 4 * block, n_rows = out_dim - o < 4 ? out_dim - o : 4;
            for (int r = 0; r < n_rows; r++)
                convert_row(format, w + (size_t)(o + r) * row_bytes, in_dim, rows + (size_t)r * in_dim);
            if (n_rows == 4) {
                kv_matmul_four_rows(out, x, packed, four, o, first, chunk, in_dim, out_dim);
                continue;
            }
            for (int r = 0; r < n_rows; r++)   /* the last few rows, one dot product at a time */
                for (int t = first; t < first + chunk; t++)
                    out[(size_t)t * out_dim + o + r] = kv_dot(rows + (size_t)r * in_dim,
                                                              x + (size_t)t * in_dim, in_dim);
        }
    }
}

void kv_matmul_weights(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                       int n_tokens, int in_dim, int out_dim, float *scratch, int n_threads) {
    if (format == KV_WEIGHT_F32) {
        kv_matmul(out, x, (const float *)(const void *)w, n_tokens, in_dim, out_dim);
        return;
    }
    /* Each thread takes a contiguous share of the rows, the same for every chunk of
     * tokens, and its own 4 * in_dim floats of scratch. */
    int n_blocks = (out_dim + 3) / 4;
    /* x packed for ops.c's 512-bit tile where it is built (and the memory had) */
    float *packed = n_tokens < KV_CONVERT_ONCE_TOKENS ? NULL : kv_packed_tokens_alloc(n_tokens, in_dim);
    #pragma omp parallel num_threads(n_threads) \
        if ((int64_t)n_tokens * out_dim * in_dim >= KV_PARALLEL_MIN_WORK && n_blocks > 1)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        if (n_tokens < KV_CONVERT_ONCE_TOKENS) {
            rows_streamed(out, x, w, format, n_tokens, in_dim, out_dim,
                          kv_split(out_dim, me, team), kv_split(out_dim, me + 1, team));
        } else {
            blocks_converted(out, x, packed, w, format, n_tokens, in_dim, out_dim,
                             kv_split(n_blocks, me, team), kv_split(n_blocks, me + 1, team),
                             scratch + (size_t)me * 4 * in_dim);
        }
    }
    free(packed);
}

kv_status kv_weights_matmul(float *out, const float *x, const uint8_t *w,
                            kv_weight_format format, int n_tokens, int in_dim, int out_dim) {
    if (out == NULL || x == NULL || w == NULL || n_tokens <= 0 || out_dim <= 0 ||
        (int)format < KV_WEIGHT_F32 || (int)format > KV_WEIGHT_LAST ||
        kv_weight_row_bytes(format, in_dim) == 0)
        return KV_ERR_INVALID_ARG;
    int n_threads = kv_threads();
    float *scratch = kv_alloc_floats(kv_weights_scratch_floats(in_dim, n_threads));
    if (scratch == NULL) return KV_ERR_NOMEM;
    if (kv_get_kernels() == KV_KERNELS_PLAIN)
        kv_plain_matmul_weights(out, x, w, format, n_tokens, in_dim, out_dim, scratch, n_threads);
    else
        kv_matmul_weights(out, x, w, format, n_tokens, in_dim, out_dim, scratch, n_threads);
    free(scratch);
    return KV_OK;
}

/* ---- Q8_0, Q4_0 and Q4_1 against int8 activations -------------------------------------- */

/* How far ahead of the block being read each row's stream is prefetched in a decode step,
 * in bytes. Its product waits on memory otherwise: four streams a thread, a few hundred
 * bytes a row, which the hardware prefetcher ramps up on too late. 1024 bytes (about three
 * rows of 576 Q4_1 weights) measured best of 256 .. 2048 on SmolLM2's shapes, one thread:
 * 30 layers of Q4_1 products 7.0 -> 4.6 ms, of Q8_0 10.2 -> 7.1 ms. */
#ifndef KV_INT8_PREFETCH
#define KV_INT8_PREFETCH 1024
#endif

/* What one block of a token's quantized activations brings to every row's block: its 32
 * codes, its scale d_x, and what the Q4 formats need besides (made once per token and
 * block, shared by the four rows of a step). */
typedef struct {
#ifdef __AVX2__
    __m256i codes;       /* (32,) int8 */
    __m256i sums4x8;     /* (8,) int32: 8 times codes 4m .. 4m + 3 summed (Q4_0's "- 8") */
    __m128 scale_sum;    /* (d_x, d_x * sum of the 32 codes, 0, 0) (Q4_1) */
#else
    const int8_t *codes;
    float sum;           /* d_x * sum of the 32 codes (Q4_1) */
#endif
    float scale;
} x_block;

/* One block of a weight row: its scale d and its codes (a Q4 block's unpacked, one to a
 * byte, in value order); Q4_1's d and m side by side (d, m, 0, 0). Made once per row and
 * block, shared by the step's tokens. */
typedef struct {
#ifdef __AVX2__
    __m256i codes;       /* (32,) Q8_0: int8; Q4: 0 .. 15 */
    __m128 d_m;          /* (d, m, 0, 0) (Q4_1) */
#else
    const uint8_t *codes;
    float m;
#endif
    float d;
} w_block;

#ifdef __AVX2__
/* The eight exact sums u[4m] s[4m] + ... + u[4m + 3] s[4m + 3] of 32 pairs of an unsigned
 * byte u by a signed byte s (the instructions' operand kinds). With AVX-512 VNNI one
 * instruction adds the four products; otherwise maddubs adds them in pairs and madd adds
 * the pairs: the same integers either way, as long as a pair stays below int16's limit
 * (every caller's does: at most 2 x 128 x 127). */
static ALWAYS_INLINE __m256i sums_of_four_unsigned(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The same for two signed bytes w and x: |w| times x with w's sign */
static ALWAYS_INLINE __m256i sums_of_four(__m256i w, __m256i x) {
    return sums_of_four_unsigned(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* A Q4 block's 16 code bytes as its 32 codes in value order, one a byte: the low nibbles
 * (values 0 .. 15) in the low half of the register, the high nibbles (16 .. 31) above. The
 * 16 bytes are loaded into both halves and the upper half shifted right by 4 (a shift of
 * 32-bit lanes: what crosses into a byte from its neighbour is masked off with the rest). */
static ALWAYS_INLINE __m256i unpack_nibbles(const uint8_t *bytes) {
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    __m256i shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

/* acc + a * b on four floats, rounded as madd rounds */
static ALWAYS_INLINE __m128 madd4(__m128 a, __m128 b, __m128 acc) {
#ifdef __FMA__
    return _mm_fmadd_ps(a, b, acc);
#else
    return _mm_add_ps(acc, _mm_mul_ps(a, b));
#endif
}

/* The exact total of eight integer sums (a block's 32 products): integers add in any order */
static ALWAYS_INLINE int32_t block_total(__m256i ints) {
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1));
    return _mm_cvtsi128_si32(four);
}

/* The four totals of four rows' eight integer sums, (total a, b, c, d), in three
 * horizontal adds: what a row's block adds to its one running sum */
static ALWAYS_INLINE __m128i block_totals4(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}
#endif

/* acc + a * b, rounded as madd rounds (plain.c's multiply_add) */
static ALWAYS_INLINE float madd1(float a, float b, float acc) {
#ifdef __FMA__
    return fmaf(a, b, acc);
#else
    return acc + a * b;
#endif
}

static ALWAYS_INLINE x_block load_x_block(const int8_t *codes, float scale, float sum,
                                          kv_weight_format format) {
    x_block xb;
    xb.scale = scale;
#ifdef __AVX2__
    xb.codes = _mm256_loadu_si256((const __m256i *)codes);
    if (format == KV_WEIGHT_Q4_0)
        xb.sums4x8 = _mm256_slli_epi32(sums_of_four_unsigned(_mm256_set1_epi8(1), xb.codes), 3);
    if (format == KV_WEIGHT_Q4_1) xb.scale_sum = _mm_setr_ps(scale, sum, 0.0f, 0.0f);
#else
    xb.codes = codes;
    xb.sum = sum;
#endif
    return xb;
}

static ALWAYS_INLINE w_block load_w_block(const uint8_t *block, kv_weight_format format) {
    w_block wb;
#ifdef __AVX2__
    if (format == KV_WEIGHT_Q4_1) {   /* d and m converted by one instruction */
#ifdef __F16C__
        uint32_t d_m;
        memcpy(&d_m, block, sizeof d_m);
        wb.d_m = _mm_cvtph_ps(_mm_cvtsi32_si128((int)d_m));
#else   /* AVX2 without F16C (a VM may hide it): the same exact conversions, one by one */
        wb.d_m = _mm_setr_ps(block_scale(block), block_scale(block + 2), 0.0f, 0.0f);
#endif
        wb.d = _mm_cvtss_f32(wb.d_m);
    } else {
        wb.d = block_scale(block);
    }
    const uint8_t *codes = block + (format == KV_WEIGHT_Q4_1 ? 4 : 2);
    wb.codes = format == KV_WEIGHT_Q8_0 ? _mm256_loadu_si256((const __m256i *)codes)
                                        : unpack_nibbles(codes);
#else
    wb.d = block_scale(block);
    wb.m = format == KV_WEIGHT_Q4_1 ? block_scale(block + 2) : 0.0f;
    wb.codes = block + (format == KV_WEIGHT_Q4_1 ? 4 : 2);
#endif
    return wb;
}

/* One row's running sums: the sum of its blocks, and Q4_1's m part (in lane 1 of m_part
 * with AVX2, where lane 0 gathers d * d_x products nobody reads) */
typedef struct {
    float sum;
#ifdef __AVX2__
    __m128 m_part;
#else
    float m_part;
#endif
} row_sums;

/* sums + one weight block against one activation block, in kv_plain_matmul_int8's order:
 * the exact integer total of the block's 32 products, times d_w d_x, added to the row's
 * one running sum; for Q4_1 the m part adds m_w times the block's d_x * sum of x codes. */
static ALWAYS_INLINE void add_block(row_sums *sums, const w_block *wb, const x_block *xb,
                                    kv_weight_format format) {
    int32_t total;
#ifdef __AVX2__
    __m256i ints;
    float scale;
    if (format == KV_WEIGHT_Q8_0) {
        ints = sums_of_four(wb->codes, xb->codes);
    } else {
        /* maddubs and dpbusd take the nibbles as they are, unsigned; Q4_0's code - 8 is
         * then the sum of code * x less 8 times the sum of the x codes (exact integers) */
        ints = sums_of_four_unsigned(wb->codes, xb->codes);
        if (format == KV_WEIGHT_Q4_0) ints = _mm256_sub_epi32(ints, xb->sums4x8);
    }
    total = block_total(ints);
    if (format == KV_WEIGHT_Q4_1) {
        /* (d, m) times (d_x, sum): lane 0 is d * d_x; the m part in lane 1, fused */
        scale = _mm_cvtss_f32(_mm_mul_ps(wb->d_m, xb->scale_sum));
        sums->m_part = madd4(wb->d_m, xb->scale_sum, sums->m_part);
    } else {
        scale = wb->d * xb->scale;
    }
    sums->sum = madd1(scale, (float)total, sums->sum);
#else
#ifdef KV_INT8_SUMS_NEON
    total = block_total_neon(wb->codes, xb->codes, format);   /* int8_sums.h: sdot, NEON */
#else
    total = 0;
    for (int i = 0; i < 32; i++) {
        int32_t code = format == KV_WEIGHT_Q8_0 ? (int8_t)wb->codes[i]
                     : format == KV_WEIGHT_Q4_0 ? kv_q4_code(wb->codes, i) - 8
                                                : kv_q4_code(wb->codes, i);
        total += code * xb->codes[i];
    }
#endif
    sums->sum = madd1(wb->d * xb->scale, (float)total, sums->sum);
    if (format == KV_WEIGHT_Q4_1) sums->m_part = madd1(wb->m, xb->sum, sums->m_part);
#endif
}

/* A row's result: its running sum, and Q4_1's m part added at the end */
static ALWAYS_INLINE float row_total(const row_sums *sums, kv_weight_format format) {
    if (format != KV_WEIGHT_Q4_1) return sums->sum;
#ifdef __AVX2__
    return sums->sum + sums->m_part[1];
#else
    return sums->sum + sums->m_part;
#endif
}

/* A token's quantized activations, as the fast tier keeps them: x_pairs (n_blocks, 2), each
 * block's scale d_x beside its d_x * sum of codes (so that one 8-byte load brings both),
 * and x_codes (n_blocks * 32,). */

/* One row against a token's quantized activations: kv_plain_matmul_int8's sum, bit for bit */
static ALWAYS_INLINE float dot_row_int8(const uint8_t *row, kv_weight_format format,
                                        const float *x_pairs, const int8_t *x_codes,
                                        int n_blocks) {
    size_t block_bytes = kv_weight_block_bytes(format);
    row_sums sums;
    memset(&sums, 0, sizeof sums);
    for (int b = 0; b < n_blocks; b++) {
        x_block xb = load_x_block(x_codes + 32 * b, x_pairs[2 * b], x_pairs[2 * b + 1], format);
        w_block wb = load_w_block(row + (size_t)b * block_bytes, format);
        add_block(&sums, &wb, &xb, format);
    }
    return row_total(&sums, format);
}

#ifdef __AVX2__
/* The four rows' block headers at byte `at`, converted at once: (d0, m0, d1, m1, .., d3, m3)
 * for Q4_1; for Q8_0 and Q4_0 lanes 2r hold the d's (the odd lanes convert the first codes,
 * which nobody reads). Gathered in registers: a store of four and a load of them would
 * stall on the store buffer. */
static ALWAYS_INLINE v8f headers4(const uint8_t *const rows[4], size_t at) {
#ifdef __F16C__
    int heads[4];
    for (int r = 0; r < 4; r++) memcpy(&heads[r], rows[r] + at, sizeof heads[r]);
    return (v8f)_mm256_cvtph_ps(_mm_setr_epi32(heads[0], heads[1], heads[2], heads[3]));
#else   /* AVX2 without F16C (a VM may hide it): the same exact conversions, one by one */
    v8f out;
    for (int r = 0; r < 4; r++) {
        out[2 * r] = block_scale(rows[r] + at);
        out[2 * r + 1] = block_scale(rows[r] + at + 2);
    }
    return out;
#endif
}

/* A block's (d_x, d_x * sum of codes) in every pair of lanes: one broadcast load */
static ALWAYS_INLINE v8f x_pair_splat(const float *pair) {
    double both;
    memcpy(&both, pair, sizeof both);
    return (v8f)_mm256_castpd_ps(_mm256_set1_pd(both));
}

/* The exact integer sums of four products of one weight block's codes (Q8_0: int8; Q4:
 * the unpacked nibbles) with one token's block */
static ALWAYS_INLINE __m256i block_ints(__m256i w_codes, const x_block *xb,
                                        kv_weight_format format) {
    if (format == KV_WEIGHT_Q8_0) return sums_of_four(w_codes, xb->codes);
    /* maddubs and dpbusd take the nibbles as they are, unsigned; Q4_0's code - 8 is then
     * the sum of code * x less 8 times the sum of the x codes (exact integers) */
    __m256i ints = sums_of_four_unsigned(w_codes, xb->codes);
    return format == KV_WEIGHT_Q4_0 ? _mm256_sub_epi32(ints, xb->sums4x8) : ints;
}

static ALWAYS_INLINE __m256i load_w_codes(const uint8_t *codes, kv_weight_format format) {
    return format == KV_WEIGHT_Q8_0 ? _mm256_loadu_si256((const __m256i *)codes)
                                    : unpack_nibbles(codes);
}

/* Four rows' running sums (lane r: row r) plus one block each: the exact totals of their
 * integer sums `ints`, times their scales d_w * d_x (lane 2r of `scales`), with madd's
 * rounding: add_block's arithmetic, four rows in one instruction. */
static ALWAYS_INLINE __m128 add_blocks4(__m128 sums, v8f scales, const __m256i ints[4]) {
    __m128 scale4 = _mm256_castps256_ps128(
        _mm256_permutevar8x32_ps((__m256)scales, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
    __m128 totals = _mm_cvtepi32_ps(block_totals4(ints[0], ints[1], ints[2], ints[3]));
    return madd4(scale4, totals, sums);
}
#endif

/* Four rows, wherever they lie, against one token's quantized activations: out[r] is row
 * r's dot_row_int8, bit for bit (each row its own sums); the token's block is loaded once
 * for the four, and four chains of arithmetic run side by side. With AVX2 the four rows'
 * block headers are read as one vector: one conversion of their halves, one multiply for
 * the four scales d_w * d_x (each the same float32 product as add_block's) and, for
 * Q4_1, one multiply-add for the four m parts (lane 2r + 1 is row r's running sum, each
 * lane rounded as madd1 rounds it); the four rows' block totals come out of three
 * horizontal adds side by side, and one multiply-add adds them to the four running sums
 * (add_blocks4). */
static ALWAYS_INLINE void dot_rows4_int8(const uint8_t *const rows[4], kv_weight_format format,
                                         const float *x_pairs, const int8_t *x_codes,
                                         int n_blocks, float out[4]) {
    size_t block_bytes = kv_weight_block_bytes(format);
#ifdef __AVX2__
    size_t header = format == KV_WEIGHT_Q4_1 ? 4 : 2;   /* d, and Q4_1's m, before the codes */
    __m128 sums = _mm_setzero_ps();   /* lane r: row r's running sum */
    v8f m_parts = {0};                /* lane 2r + 1: row r's m part (Q4_1) */
    for (int b = 0; b < n_blocks; b++) {
        size_t at = (size_t)b * block_bytes;
        x_block xb = load_x_block(x_codes + 32 * b, x_pairs[2 * b], x_pairs[2 * b + 1], format);
        for (int r = 0; r < 4; r++) __builtin_prefetch(rows[r] + at + KV_INT8_PREFETCH);
        v8f d_m = headers4(rows, at), x_pair = x_pair_splat(x_pairs + 2 * b);
        if (format == KV_WEIGHT_Q4_1) m_parts = madd(d_m, x_pair, m_parts);
        __m256i ints[4];
        for (int r = 0; r < 4; r++)
            ints[r] = block_ints(load_w_codes(rows[r] + at + header, format), &xb, format);
        sums = add_blocks4(sums, d_m * x_pair, ints);
    }
    for (int r = 0; r < 4; r++)
        out[r] = format == KV_WEIGHT_Q4_1 ? sums[r] + m_parts[2 * r + 1] : sums[r];
#else
    row_sums sums[4];
    memset(sums, 0, sizeof sums);
    for (int b = 0; b < n_blocks; b++) {
        size_t at = (size_t)b * block_bytes;
        x_block xb = load_x_block(x_codes + 32 * b, x_pairs[2 * b], x_pairs[2 * b + 1], format);
        for (int r = 0; r < 4; r++) {
            __builtin_prefetch(rows[r] + at + KV_INT8_PREFETCH);
            w_block wb = load_w_block(rows[r] + at, format);
            add_block(&sums[r], &wb, &xb, format);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = row_total(&sums[r], format);
#endif
}

/* The same for two tokens at once (a batch of two or three, a leftover pair): each row's
 * block is loaded and unpacked once for both tokens; eight chains side by side. out0 and
 * out1 are each token's four dot_row_int8s, bit for bit. */
static ALWAYS_INLINE void dot_rows4_int8_pair(const uint8_t *const rows[4],
                                              kv_weight_format format, const float *pairs0,
                                              const int8_t *codes0, const float *pairs1,
                                              const int8_t *codes1, int n_blocks,
                                              float out0[4], float out1[4]) {
    size_t block_bytes = kv_weight_block_bytes(format);
    row_sums acc0[4], acc1[4];
    memset(acc0, 0, sizeof acc0);
    memset(acc1, 0, sizeof acc1);
    for (int b = 0; b < n_blocks; b++) {
        size_t at = (size_t)b * block_bytes;
        x_block x0 = load_x_block(codes0 + 32 * b, pairs0[2 * b], pairs0[2 * b + 1], format);
        x_block x1 = load_x_block(codes1 + 32 * b, pairs1[2 * b], pairs1[2 * b + 1], format);
        for (int r = 0; r < 4; r++) {
            w_block wb = load_w_block(rows[r] + at, format);
            add_block(&acc0[r], &wb, &x0, format);
            add_block(&acc1[r], &wb, &x1, format);
        }
    }
    for (int r = 0; r < 4; r++) {
        out0[r] = row_total(&acc0[r], format);
        out1[r] = row_total(&acc1[r], format);
    }
}

#ifdef __AVX2__
/* Four rows against n tokens (2 to 4, a constant in each call; a prefill, a batched decode
 * step): each row's block is unpacked once for the n tokens and each token's block loaded
 * once for the four rows; n chains of arithmetic side by side. out[t][r] is token t's
 * dot_row_int8 of row r, bit for bit: each (row, token) pair keeps its own running sum and
 * m part and adds its blocks in the same order with the same roundings; the tile changes
 * only which pairs run together. The scales come as in dot_rows4_int8: the rows' headers
 * converted once a block, times each token's (d_x, d_x * sum) in every pair of lanes;
 * add_blocks4 adds a token's four rows. The rows are prefetched as dot_rows4_int8 does:
 * a batched decode step of 2 to 7 tokens waits on memory as a single token's does. */
static ALWAYS_INLINE void dot_rows4_int8_tokens(const uint8_t *const rows[4],
                                                kv_weight_format format,
                                                const float *const pairs[4],
                                                const int8_t *const codes[4], int n,
                                                int n_blocks, float out[4][4]) {
    size_t block_bytes = kv_weight_block_bytes(format);
    size_t header = format == KV_WEIGHT_Q4_1 ? 4 : 2;   /* d, and Q4_1's m, before the codes */
    __m128 sums[4];    /* [token], lane r: row r's running sum */
    v8f m_parts[4];    /* [token], lane 2r + 1: row r's m part (Q4_1) */
    memset(sums, 0, sizeof sums);
    memset(m_parts, 0, sizeof m_parts);
    for (int b = 0; b < n_blocks; b++) {
        size_t at = (size_t)b * block_bytes;
        for (int r = 0; r < 4; r++) __builtin_prefetch(rows[r] + at + KV_INT8_PREFETCH);
        v8f d_m = headers4(rows, at);
        __m256i w_codes[4];
        for (int r = 0; r < 4; r++) w_codes[r] = load_w_codes(rows[r] + at + header, format);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if (format == KV_WEIGHT_Q8_0)   /* w + 128, dpbusd's unsigned side */
            for (int r = 0; r < 4; r++)
                w_codes[r] = _mm256_xor_si256(w_codes[r], _mm256_set1_epi8((char)0x80));
#endif
        #pragma GCC unroll 4
        for (int t = 0; t < n; t++) {
            x_block xb = load_x_block(codes[t] + 32 * b, 0.0f, 0.0f, format);
            v8f x_pair = x_pair_splat(pairs[t] + 2 * b);
            if (format == KV_WEIGHT_Q4_1) m_parts[t] = madd(d_m, x_pair, m_parts[t]);
            __m256i ints[4];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            if (format == KV_WEIGHT_Q8_0) {
                /* sum (w + 128) x from -128 sum x: each lane the same exact integer as
                 * sums_of_four's, one xor a row block instead of two signs a row and token */
                __m256i zero = _mm256_setzero_si256();
                __m256i start = _mm256_sub_epi32(
                    zero, _mm256_dpbusd_epi32(zero, _mm256_set1_epi8((char)0x80), xb.codes));
                for (int r = 0; r < 4; r++)
                    ints[r] = _mm256_dpbusd_epi32(start, w_codes[r], xb.codes);
            } else
#endif
            for (int r = 0; r < 4; r++) ints[r] = block_ints(w_codes[r], &xb, format);
            sums[t] = add_blocks4(sums[t], d_m * x_pair, ints);
        }
    }
    for (int t = 0; t < n; t++)
        for (int r = 0; r < 4; r++)
            out[t][r] = format == KV_WEIGHT_Q4_1 ? sums[t][r] + m_parts[t][2 * r + 1] : sums[t][r];
}
#endif

#ifdef KV_INT8_TILE_512   /* ops.h */
/* The AVX-512 VNNI prefill tile: rows in the lanes. A 512-bit register holds 16 int32
 * lanes, and here each lane is a different ROW of the matrix: the rule's one running sum
 * per (row, token) is then one lane of one register, and a block costs each lane one
 * conversion and one multiply-add, after eight dpbusd instructions that add its 32 byte
 * products exactly (each adds four products of a lane's row to that lane). For that the 16
 * rows' blocks are repacked (pack_panel) into a panel, once per product and thread, so that
 * one 64-byte load brings the same four codes of the 16 rows; the token's four codes are
 * broadcast to every lane from memory. The panel is a few tens of kilobytes that stay in
 * cache while every token passes over it: against the 8 dpbusd per token and block, the
 * repacking (an 8 x 8 transpose of 4-byte groups a block) is paid once per block for all
 * the tokens. Repacked per product, not once at load, so a model's stored weights stay as
 * users see them. Measured on the 110M shapes, one thread, by packing every panel twice:
 * the repacking is lost in the noise of a 256-token product (under 5 %), 15-20 % of a
 * 16-token one and about 30 % of a 4-token one (a batched decode step). A product of one
 * tile of tokens (up to TILE_TOKENS: a batched decode step) stores no panel: each block is
 * turned in registers and used at once (panel_tokens_streamed), since a stored panel would
 * be read back once only. */

/* Rows a panel holds, and the tokens a tile runs against them at once: 12 tokens' running
 * sums in registers beside the block's 8 code registers (Q4_1: 8 tokens, and their m
 * parts), of AVX-512's 32. */
#define PANEL_ROWS 16
#define TILE_TOKENS 12
#define TILE_TOKENS_Q4_1 8
#define START_Q8_0 128   /* token_starts: Q8_0's codes are taken + 128 */
/* A panel block: codes (8, 16) uint32: group g's four codes of row r at (g, r) (Q8_0's
 * codes + 128, their sign bit flipped, so that dpbusd takes them as unsigned; Q4's nibbles
 * as they are, 0 .. 15); then d (16,) floats; then Q4_1's m (16,) floats. */
#define PANEL_BLOCK_BYTES 640
enum { PANEL_D = 512, PANEL_M = 576 };
/* what forward calls count of this tile's scratch (ops.h, kv_int8_tile_floats) */
_Static_assert(PANEL_BLOCK_BYTES == KV_INT8_PANEL_BLOCK_BYTES, "ops.h counts this panel");

/* The eight 4-byte groups of 16 rows' codes, z[k] holding row k's 8 groups in its low half
 * and row k + 8's in its high half, turned so that out[g] holds group g of rows 0 .. 15 in
 * order: two rounds of unpacks within 128-bit lanes, then one two-source permute a group
 * (an 8 x 8 transpose in each half at once). Moves bytes only. */
static ALWAYS_INLINE void transpose_groups(const __m512i z[8], __m512i out[8]) {
    __m512i t[8], u[8];
    for (int k = 0; k < 8; k += 2) {   /* t[k]: groups 0,1 | 4,5 of rows k, k+1; t[k+1]: 2,3 | 6,7 */
        t[k] = _mm512_unpacklo_epi32(z[k], z[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(z[k], z[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {   /* u[k + j]: group j | j + 4 of rows k .. k + 3 */
        u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
        u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
        u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
        u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    /* u[j] lanes: (rows 0-3, group j), (0-3, j + 4), (8-11, j), (8-11, j + 4); u[4 + j] the
     * same for rows 4-7 and 12-15 */
    __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    __m512i high = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_permutex2var_epi32(u[j], low, u[4 + j]);
        out[j + 4] = _mm512_permutex2var_epi32(u[j], high, u[4 + j]);
    }
}

/* One block of rows first .. first + 15 (row_bytes apart; `block` the first row's block):
 * groups[g] the 16 rows' four codes of group g, in lane order (Q8_0's + 128), d (and Q4_1's
 * m) their scales, converted as block_scale does. The next panel's same rows are
 * prefetched: a decode step's weights come from memory. */
static ALWAYS_INLINE void panel_block(const uint8_t *block, size_t row_bytes,
                                      kv_weight_format format, __m512i groups[8], __m512 *d,
                                      __m512 *m) {
    int header = format == KV_WEIGHT_Q4_1 ? 4 : 2;
    __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                        12, 13, 14, 15),
                                      _mm512_set1_epi32((int)row_bytes));
    /* each row's d (and m): the block's first four bytes */
    __m512i head = _mm512_i32gather_epi32(rows, (const void *)block, 1);
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    if (format == KV_WEIGHT_Q4_1)
        *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    __m512i z[8];
    for (int k = 0; k < 8; k++) {   /* rows k and k + 8, their 32 codes in value order */
        const uint8_t *low = block + (size_t)k * row_bytes + header;
        const uint8_t *high = low + 8 * row_bytes;
        __builtin_prefetch(low + PANEL_ROWS * row_bytes);
        __builtin_prefetch(high + PANEL_ROWS * row_bytes);
        z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(load_w_codes(low, format)),
                                  load_w_codes(high, format), 1);
        if (format == KV_WEIGHT_Q8_0)   /* w + 128: dpbusd's unsigned side */
            z[k] = _mm512_xor_si512(z[k], _mm512_set1_epi8((char)0x80));
    }
    transpose_groups(z, groups);
}

/* Rows first .. first + 15 of w (row_bytes apart), every block, into panel */
static void pack_panel(const uint8_t *first, size_t row_bytes, kv_weight_format format,
                       int n_blocks, uint8_t *panel) {
    size_t block_bytes = kv_weight_block_bytes(format);
    for (int b = 0; b < n_blocks; b++) {
        uint8_t *at = panel + (size_t)b * PANEL_BLOCK_BYTES;
        __m512i groups[8];
        __m512 d, m = _mm512_setzero_ps();
        panel_block(first + (size_t)b * block_bytes, row_bytes, format, groups, &d, &m);
        _mm512_storeu_ps(at + PANEL_D, d);
        if (format == KV_WEIGHT_Q4_1) _mm512_storeu_ps(at + PANEL_M, m);
        for (int g = 0; g < 8; g++) _mm512_storeu_si512(at + 64 * g, groups[g]);
    }
}

/* A tile's running sums: [token], lane r: row o0 + r's sum and m part (Q4_1) */
typedef struct {
    __m512 sums[TILE_TOKENS], m_parts[TILE_TOKENS];
} panel_sums;

/* Block b of 16 rows (w: panel_block's groups, d_w and m_w their scales) against tokens
 * t0 .. t0 + n - 1, added to their running sums in kv_plain_matmul_int8's order: the exact
 * block total, times d_w * d_x, multiply-added; Q4_1's m part apart. */
static ALWAYS_INLINE void panel_block_tokens(panel_sums *acc, const __m512i w[8], __m512 d_w,
                                             __m512 m_w, kv_weight_format format,
                                             const float *x_pairs, const int8_t *x_codes,
                                             const int32_t *starts, int b, int t0, int n,
                                             int in_dim) {
    int n_blocks = in_dim / 32;
    #pragma GCC unroll 16   /* constant indices into sums: they stay in registers */
    for (int i = 0; i < n; i++) {
        size_t tb = (size_t)(t0 + i) * n_blocks + b;
        const int8_t *x = x_codes + (size_t)(t0 + i) * in_dim + 32 * b;
        /* two chains of four dpbusd (each waits for the one before), added at the end:
         * integers, so the total is the same */
        __m512i ints[2] = {_mm512_set1_epi32(starts[tb]), _mm512_setzero_si512()};
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            int32_t four;
            memcpy(&four, x + 4 * g, sizeof four);
            ints[g % 2] = _mm512_dpbusd_epi32(ints[g % 2], w[g], _mm512_set1_epi32(four));
        }
        __m512 scale = _mm512_mul_ps(d_w, _mm512_set1_ps(x_pairs[2 * tb]));
        __m512i total = _mm512_add_epi32(ints[0], ints[1]);
        acc->sums[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(total), acc->sums[i]);
        if (format == KV_WEIGHT_Q4_1)
            acc->m_parts[i] = _mm512_fmadd_ps(m_w, _mm512_set1_ps(x_pairs[2 * tb + 1]),
                                              acc->m_parts[i]);
    }
}

/* The tile's results, out[t * out_dim + o0 + r] for tokens t0 .. t0 + n - 1 */
static ALWAYS_INLINE void panel_store(float *out, const panel_sums *acc, kv_weight_format format,
                                      int t0, int n, int out_dim, int o0) {
    for (int i = 0; i < n; i++) {
        __m512 total = format == KV_WEIGHT_Q4_1 ? _mm512_add_ps(acc->sums[i], acc->m_parts[i])
                                                : acc->sums[i];
        _mm512_storeu_ps(out + (size_t)(t0 + i) * out_dim + o0, total);
    }
}

/* A panel's 16 rows against tokens t0 .. t0 + n - 1 (n <= TILE_TOKENS, a constant in each
 * call so that the loops unroll): out[t * out_dim + o0 + r] is kv_plain_matmul_int8's sum of
 * row o0 + r and token t, bit for bit: the same exact block totals, the same product
 * d_w * d_x, the same multiply-add into one running sum in block order, the same m part. */
static ALWAYS_INLINE void panel_tokens(float *out, const uint8_t *panel, kv_weight_format format,
                                       const float *x_pairs, const int8_t *x_codes,
                                       const int32_t *starts, int t0, int n, int in_dim,
                                       int out_dim, int o0) {
    panel_sums acc;
    for (int i = 0; i < n; i++) acc.sums[i] = acc.m_parts[i] = _mm512_setzero_ps();
    for (int b = 0; b < in_dim / 32; b++) {
        const uint8_t *at = panel + (size_t)b * PANEL_BLOCK_BYTES;
        __m512i w[8];
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(at + 64 * g);
        panel_block_tokens(&acc, w, _mm512_loadu_ps(at + PANEL_D),
                           format == KV_WEIGHT_Q4_1 ? _mm512_loadu_ps(at + PANEL_M)
                                                    : _mm512_setzero_ps(),
                           format, x_pairs, x_codes, starts, b, t0, n, in_dim);
    }
    panel_store(out, &acc, format, t0, n, out_dim, o0);
}

/* The same straight from the rows (first .. first + 15, row_bytes apart), each block turned
 * in registers and used at once: for a product of one tile of tokens (a batched decode
 * step), where a stored panel would be written and read back once only. */
static ALWAYS_INLINE void panel_tokens_streamed(float *out, const uint8_t *first,
                                                size_t row_bytes, kv_weight_format format,
                                                const float *x_pairs, const int8_t *x_codes,
                                                const int32_t *starts, int n, int in_dim,
                                                int out_dim, int o0) {
    size_t block_bytes = kv_weight_block_bytes(format);
    panel_sums acc;
    for (int i = 0; i < n; i++) acc.sums[i] = acc.m_parts[i] = _mm512_setzero_ps();
    for (int b = 0; b < in_dim / 32; b++) {
        __m512i w[8];
        __m512 d_w, m_w = _mm512_setzero_ps();
        panel_block(first + (size_t)b * block_bytes, row_bytes, format, w, &d_w, &m_w);
        panel_block_tokens(&acc, w, d_w, m_w, format, x_pairs, x_codes, starts, b, 0, n,
                           in_dim);
    }
    panel_store(out, &acc, format, 0, n, out_dim, o0);
}

#elif defined(__AVX2__)
/* The same rows-in-lanes tile with AVX2, 8 rows in a 256-bit register's lanes. AVX2 has no
 * dpbusd: maddubs multiplies unsigned by signed bytes and adds neighbouring products to an
 * int16 (saturating), and madd adds those pairs to int32. The int16 pairs are exact, never
 * saturated, because one side stays small: Q8_0 takes |w| (at most 128) against x with w's
 * sign (|x| at most 127: the quantizer clips there), a pair at most 2 x 128 x 127 = 32,512
 * < 32,767 (w + 128 against x, as dpbusd takes them, could reach 2 x 255 x 127 and
 * saturate); Q4 takes its nibbles (at most 15) against x, a pair at most 3,810, so the
 * eight groups' pairs add up in int16 (at most 30,480) before one madd. */
#define PANEL_ROWS 8
#define TILE_TOKENS 4
#define TILE_TOKENS_Q4_1 4
#define START_Q8_0 0   /* token_starts: Q8_0 is multiplied signed */
/* A panel block: codes (8, 8) uint32: group g's four codes of row r at (g, r) (Q8_0: |w|;
 * Q4: the nibbles); then Q8_0's codes as they are, the same way (their signs); d (8,)
 * floats; Q4_1's m (8,) floats. */
#define PANEL_BLOCK_BYTES 576
enum { PANEL_SIGNS = 256, PANEL_D = 512, PANEL_M = 544 };

/* r[k]: row k's eight 4-byte groups, turned so that r[g] holds group g of rows 0 .. 7 (an
 * 8 x 8 transpose: unpacks within 128-bit lanes, then the lanes swapped). Moves bytes only. */
static ALWAYS_INLINE void transpose_groups8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {   /* u[k + j]: group j | j + 4 of rows k .. k + 3 */
        u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
        u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
        u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
        u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* Rows first .. first + 7 of w (row_bytes apart), every block, into panel */
static void pack_panel(const uint8_t *first, size_t row_bytes, kv_weight_format format,
                       int n_blocks, uint8_t *panel) {
    size_t block_bytes = kv_weight_block_bytes(format);
    int header = format == KV_WEIGHT_Q4_1 ? 4 : 2;
    for (int b = 0; b < n_blocks; b++) {
        const uint8_t *block = first + (size_t)b * block_bytes;
        uint8_t *at = panel + (size_t)b * PANEL_BLOCK_BYTES;
        __m256i groups[8];
        float d[8], m[8];
        for (int r = 0; r < 8; r++) {
            const uint8_t *row = block + (size_t)r * row_bytes;
            __builtin_prefetch(row + PANEL_ROWS * row_bytes);   /* the next panel's */
            d[r] = block_scale(row);
            m[r] = format == KV_WEIGHT_Q4_1 ? block_scale(row + 2) : 0.0f;
            groups[r] = load_w_codes(row + header, format);
        }
        memcpy(at + PANEL_D, d, sizeof d);
        memcpy(at + PANEL_M, m, sizeof m);
        transpose_groups8(groups);
        for (int g = 0; g < 8; g++) {
            __m256i codes = groups[g];
            if (format == KV_WEIGHT_Q8_0) {   /* |w| (128 for -128, as unsigned), and w */
                _mm256_storeu_si256((__m256i *)(at + PANEL_SIGNS + 32 * g), codes);
                codes = _mm256_sign_epi8(codes, codes);
            }
            _mm256_storeu_si256((__m256i *)(at + 32 * g), codes);
        }
    }
}

/* The exact integer total of 8 rows' blocks (a panel block at `at`) against one token's
 * block of codes x, from `start` (token_starts) */
static ALWAYS_INLINE __m256i panel_block_ints(const uint8_t *at, const int8_t *x, int32_t start,
                                              kv_weight_format format) {
    __m256i ones = _mm256_set1_epi16(1), pairs = _mm256_setzero_si256();
    __m256i ints[2] = {_mm256_set1_epi32(start), _mm256_setzero_si256()};
    #pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        int32_t four;
        memcpy(&four, x + 4 * g, sizeof four);
        __m256i x4 = _mm256_set1_epi32(four);
        __m256i w = _mm256_loadu_si256((const __m256i *)(at + 32 * g));
        if (format == KV_WEIGHT_Q8_0) {   /* |w| times x with w's sign, to int32 a group */
            __m256i signs = _mm256_loadu_si256((const __m256i *)(at + PANEL_SIGNS + 32 * g));
            __m256i products = _mm256_maddubs_epi16(w, _mm256_sign_epi8(x4, signs));
            ints[g % 2] = _mm256_add_epi32(ints[g % 2], _mm256_madd_epi16(products, ones));
        } else {   /* nibbles times x: the pairs of all eight groups fit int16 */
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w, x4));
        }
    }
    if (format != KV_WEIGHT_Q8_0) ints[1] = _mm256_madd_epi16(pairs, ones);
    return _mm256_add_epi32(ints[0], ints[1]);
}

/* A panel's 8 rows against tokens t0 .. t0 + n - 1 (n <= TILE_TOKENS, a constant in each
 * call): out[t * out_dim + o0 + r] is kv_plain_matmul_int8's sum of row o0 + r and token t,
 * bit for bit, as in the AVX-512 tile. */
static ALWAYS_INLINE void panel_tokens(float *out, const uint8_t *panel, kv_weight_format format,
                                       const float *x_pairs, const int8_t *x_codes,
                                       const int32_t *starts, int t0, int n, int in_dim,
                                       int out_dim, int o0) {
    int n_blocks = in_dim / 32;
    v8f sums[TILE_TOKENS], m_parts[TILE_TOKENS];
    for (int i = 0; i < n; i++) sums[i] = m_parts[i] = splat(0.0f);
    for (int b = 0; b < n_blocks; b++) {
        const uint8_t *at = panel + (size_t)b * PANEL_BLOCK_BYTES;
        v8f d_w = load8((const float *)(at + PANEL_D));
        #pragma GCC unroll 4   /* constant indices into sums: they stay in registers */
        for (int i = 0; i < n; i++) {
            size_t tb = (size_t)(t0 + i) * n_blocks + b;
            __m256i ints = panel_block_ints(at, x_codes + (size_t)(t0 + i) * in_dim + 32 * b,
                                            starts[tb], format);
            sums[i] = madd(d_w * splat(x_pairs[2 * tb]), (v8f)_mm256_cvtepi32_ps(ints), sums[i]);
            if (format == KV_WEIGHT_Q4_1)
                m_parts[i] = madd(load8((const float *)(at + PANEL_M)), splat(x_pairs[2 * tb + 1]),
                                  m_parts[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        v8f total = format == KV_WEIGHT_Q4_1 ? sums[i] + m_parts[i] : sums[i];
        _mm256_storeu_ps(out + (size_t)(t0 + i) * out_dim + o0, (__m256)total);
    }
}
#endif

#if defined(KV_INT8_TILE_512) || defined(__AVX2__)
#define KV_INT8_PANELS 1   /* rows_int8 takes the rows-in-lanes tile */
/* A product takes the tile from this many tokens on (a prefill, a batched decode step);
 * fewer stream the rows once per token or token group instead, with the same bits. In
 * isolation (weights in cache) the AVX-512 tile was 1.2-1.3x the four-token path
 * (dot_rows4_int8_tokens) at 4 tokens on the 110M shapes; but in SmolLM2's batched decode,
 * whose weights come from memory, the four-token path (prefetching as the decode path
 * does) made batch 4 1.1x faster than the streamed tile and 1.2x the packed one, and the
 * streamed tile batch 8 1.05-1.15x faster than the packed one (one thread, CPU time). The
 * AVX2 tile was 0.8-1.0x at 4 tokens, 1.2-1.3x at 16. -DTILE_MIN_TOKENS=n moves it for a
 * measurement. */
#ifndef TILE_MIN_TOKENS
#define TILE_MIN_TOKENS 8
#endif

/* What each token's block starts its integer sum from, so that unsigned weights give the
 * signed rule's total: sum (w + 128) x - 128 sum x = sum w x for Q8_0 with dpbusd
 * (START_Q8_0 = 128; 0 where Q8_0 is multiplied signed), and sum q x - 8 sum x =
 * sum (q - 8) x for Q4_0 (Q4_1's q is unsigned already: 0). Tokens first .. last - 1,
 * starts (n_tokens, n_blocks). */
static void token_starts(kv_weight_format format, const int8_t *x_codes, int in_dim,
                         int32_t *starts, int first, int last) {
    int n_blocks = in_dim / 32, factor = format == KV_WEIGHT_Q8_0 ? START_Q8_0 : 8;
    for (int t = first; t < last; t++)
        for (int b = 0; b < n_blocks; b++) {
            const int8_t *codes = x_codes + (size_t)t * in_dim + 32 * b;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) sum += codes[i];
            starts[(size_t)t * n_blocks + b] = format == KV_WEIGHT_Q4_1 ? 0 : -factor * sum;
        }
}

/* Rows lo .. lo + PANEL_ROWS * n_panels - 1 against every token, a panel at a time (packed into
 * `panel`, n_blocks * PANEL_BLOCK_BYTES bytes), TILE_TOKENS tokens at a time */
static ALWAYS_INLINE void rows_panels(float *out, const uint8_t *w, kv_weight_format format,
                                      int n_tokens, int in_dim, int out_dim,
                                      const float *x_pairs, const int8_t *x_codes,
                                      const int32_t *starts, uint8_t *panel, int lo,
                                      int n_panels) {
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
#ifdef KV_INT8_TILE_512
    if (n_tokens <= (format == KV_WEIGHT_Q4_1 ? TILE_TOKENS_Q4_1 : TILE_TOKENS)) {
        /* one tile of tokens: each block used as it is turned, no panel stored */
        for (int k = 0; k < n_panels; k++) {
            int o0 = lo + PANEL_ROWS * k;
            const uint8_t *first = w + (size_t)o0 * row_bytes;
            switch (n_tokens) {   /* the count a constant in each call */
#define STREAMED(n) case n: panel_tokens_streamed(out, first, row_bytes, format, x_pairs, \
                                                  x_codes, starts, n, in_dim, out_dim, o0); break;
            STREAMED(1) STREAMED(2) STREAMED(3) STREAMED(4) STREAMED(5) STREAMED(6)
            STREAMED(7) STREAMED(8) STREAMED(9) STREAMED(10) STREAMED(11) STREAMED(12)
#undef STREAMED
            default: break;
            }
        }
        return;
    }
#endif
    for (int k = 0; k < n_panels; k++) {
        int o0 = lo + PANEL_ROWS * k;
        pack_panel(w + (size_t)o0 * row_bytes, row_bytes, format, in_dim / 32, panel);
        int t = 0;
#define TILE(n) panel_tokens(out, panel, format, x_pairs, x_codes, starts, t, n, in_dim, out_dim, o0)
        if (format == KV_WEIGHT_Q4_1)
            for (; t + TILE_TOKENS_Q4_1 <= n_tokens; t += TILE_TOKENS_Q4_1) TILE(TILE_TOKENS_Q4_1);
        else
            for (; t + TILE_TOKENS <= n_tokens; t += TILE_TOKENS) TILE(TILE_TOKENS);
        switch (n_tokens - t) {   /* the last few tokens, the count a constant in each call */
#define LAST(n) case n: TILE(n); break;
        LAST(1) LAST(2) LAST(3)
#if TILE_TOKENS > 4
        LAST(4) LAST(5) LAST(6) LAST(7) LAST(8) LAST(9) LAST(10) LAST(11)
#endif
#undef LAST
#undef TILE
        default: break;
        }
    }
}
#endif

/* Rows lo .. hi - 1 of w against every token's quantized activations. With AVX-512 VNNI and
 * TILE_MIN_TOKENS or more tokens, 16 rows at a time in the rows-in-lanes tile (rows_panels);
 * the rows left (all of them otherwise) read as four runs side by side (as rows_streamed
 * does), every token against each four: with AVX2, four at a time; then two, then one.
 * Inlined into one copy
 * per format (rows_int8_q8_0, ...), so that no test of the format is left in the loops. */
static ALWAYS_INLINE void rows_int8(float *out, const uint8_t *w, kv_weight_format format,
                                    int n_tokens, int in_dim, int out_dim,
                                    const float *x_pairs, const int8_t *x_codes,
                                    const int32_t *starts, uint8_t *panel, int lo, int hi) {
    // x_pairs (n_tokens, n_blocks, 2): each block's scale and d_x * sum of codes;
    // starts (n_tokens, n_blocks) and panel: token_starts' sums and this thread's room for
    // pack_panel (with AVX-512 VNNI and TILE_MIN_TOKENS or more tokens; NULL otherwise)
    int n_blocks = in_dim / 32;
#if defined(KV_INT8_PANELS)
    if (starts != NULL && panel != NULL) {   /* PANEL_ROWS rows at a time, the rest below */
        int n_panels = (hi - lo) / PANEL_ROWS;
        rows_panels(out, w, format, n_tokens, in_dim, out_dim, x_pairs, x_codes, starts, panel,
                    lo, n_panels);
        lo += PANEL_ROWS * n_panels;
    }
#else
    (void)starts;
    (void)panel;
#endif
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    int per_run = (hi - lo) / 4;
#define PAIRS(t) (x_pairs + 2 * (size_t)(t) * n_blocks)
#define CODES(t) (x_codes + (size_t)(t) * in_dim)
    for (int k = 0; k < per_run; k++) {
        int o[4] = {lo + k, lo + per_run + k, lo + 2 * per_run + k, lo + 3 * per_run + k};
        const uint8_t *rows[4] = {w + (size_t)o[0] * row_bytes, w + (size_t)o[1] * row_bytes,
                                  w + (size_t)o[2] * row_bytes, w + (size_t)o[3] * row_bytes};
        int t = 0;
#if defined(__AVX2__)
        while (n_tokens - t >= 2) {   /* four tokens against the four rows; the last 2 or 3 */
            int n = n_tokens - t >= 4 ? 4 : n_tokens - t;
            float sums[4][4];
            const float *pairs[4];
            const int8_t *codes[4];
            for (int i = 0; i < 4; i++) {   /* past the n tokens: the last again, not read */
                pairs[i] = PAIRS(t + (i < n ? i : n - 1));
                codes[i] = CODES(t + (i < n ? i : n - 1));
            }
            if (n == 4) dot_rows4_int8_tokens(rows, format, pairs, codes, 4, n_blocks, sums);
            else if (n == 3) dot_rows4_int8_tokens(rows, format, pairs, codes, 3, n_blocks, sums);
            else dot_rows4_int8_tokens(rows, format, pairs, codes, 2, n_blocks, sums);
            for (int i = 0; i < n; i++)
                for (int r = 0; r < 4; r++) out[(size_t)(t + i) * out_dim + o[r]] = sums[i][r];
            t += n;
        }
#endif
        for (; t + 2 <= n_tokens; t += 2) {     /* two tokens share each row's loads */
            float sums0[4], sums1[4];
            dot_rows4_int8_pair(rows, format, PAIRS(t), CODES(t), PAIRS(t + 1), CODES(t + 1),
                                n_blocks, sums0, sums1);
            for (int r = 0; r < 4; r++) {
                out[(size_t)t * out_dim + o[r]] = sums0[r];
                out[(size_t)(t + 1) * out_dim + o[r]] = sums1[r];
            }
        }
        for (; t < n_tokens; t++) {
            float sums[4];
            dot_rows4_int8(rows, format, PAIRS(t), CODES(t), n_blocks, sums);
            for (int r = 0; r < 4; r++) out[(size_t)t * out_dim + o[r]] = sums[r];
        }
    }
    for (int o = lo + 4 * per_run; o < hi; o++)   /* the last few, one at a time */
        for (int t = 0; t < n_tokens; t++)
            out[(size_t)t * out_dim + o] =
                dot_row_int8(w + (size_t)o * row_bytes, format, PAIRS(t), CODES(t), n_blocks);
#undef PAIRS
#undef CODES
}

#define ROWS_INT8_FOR(name, format)                                                         \
    static void name(float *out, const uint8_t *w, int n_tokens, int in_dim, int out_dim,   \
                     const float *x_pairs, const int8_t *x_codes, const int32_t *starts,    \
                     uint8_t *panel, int lo, int hi) {                                       \
        rows_int8(out, w, format, n_tokens, in_dim, out_dim, x_pairs, x_codes, starts, panel, \
                  lo, hi);                                                                   \
    }
ROWS_INT8_FOR(rows_int8_q8_0, KV_WEIGHT_Q8_0)
ROWS_INT8_FOR(rows_int8_q4_0, KV_WEIGHT_Q4_0)
ROWS_INT8_FOR(rows_int8_q4_1, KV_WEIGHT_Q4_1)

#ifdef __AVX2__
/* roundf of eight floats (halves away from zero, as the plain tier's quantizer rounds; the
 * vector instructions' own rounding sends halves to even): the truncation, plus the sign
 * where the part cut off is a half or more. v - trunc(v) is exact. */
static ALWAYS_INLINE __m256 round_half_away(__m256 v) {
    __m256 whole = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 cut = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(v, whole));    /* |v - trunc(v)| */
    __m256 one = _mm256_or_ps(_mm256_and_ps(v, sign_bit), _mm256_set1_ps(1.0f));   /* +-1 */
    __m256 up = _mm256_cmp_ps(cut, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(whole, _mm256_and_ps(up, one));
}
#endif

/* A token's activations quantized as kv_quantize_activations_q8 does it (the same codes,
 * scales and sums, bit for bit), its scales and sums written side by side (n_blocks, 2).
 * With AVX2 a block at a time in four vectors: the largest magnitude (a maximum, in any
 * order), the one scalar scale and inverse, the codes rounded as roundf rounds and packed,
 * their exact integer sum. */
static void quantize_token_pairs(const float *x, int in_dim, float *pairs, int8_t *codes) {
    int n_blocks = in_dim / 32;
#ifdef __AVX2__
    __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int b = 0; b < n_blocks; b++) {
        const float *block = x + 32 * (size_t)b;
        __m256 v[4], amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(block + 8 * j);
            __m256 magnitude = _mm256_and_ps(v[j], abs_mask);
            /* |x| <= FLT_MAX is false for inf and NaN, as in the plain tier */
            finite = _mm256_and_ps(finite, _mm256_cmp_ps(magnitude, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ));
            amax = _mm256_max_ps(magnitude, amax);
        }
        if (_mm256_movemask_ps(finite) != 0xFF) {   /* inf or NaN: scale NaN, codes 0 */
            memset(codes + 32 * (size_t)b, 0, 32);
            pairs[2 * b] = NAN;
            pairs[2 * b + 1] = NAN;
            continue;
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        half = _mm_max_ss(half, _mm_movehdup_ps(half));
        float scale = _mm_cvtss_f32(half) / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        if (inverse > FLT_MAX) inverse = 0.0f;    /* amax below ~4e-37: every code rounds to 0 */
        __m256i ints[4];
        for (int j = 0; j < 4; j++)
            ints[j] = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse))));
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                           _mm256_packs_epi32(ints[2], ints[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(codes + 32 * (size_t)b), bytes);
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]),
                                         _mm256_add_epi32(ints[2], ints[3]));
        __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
        pairs[2 * b] = scale;
        pairs[2 * b + 1] = scale * (float)_mm_cvtsi128_si32(sum4);
    }
#else
    enum { CHUNK = 64 };
    float scales[CHUNK], sums[CHUNK];
    for (int first = 0; first < n_blocks; first += CHUNK) {
        int n = n_blocks - first < CHUNK ? n_blocks - first : CHUNK;
        kv_quantize_activations_q8(x + 32 * (size_t)first, 32 * n, scales,
                                   codes + 32 * (size_t)first, sums);
        for (int b = 0; b < n; b++) {
            pairs[2 * (first + b)] = scales[b];
            pairs[2 * (first + b) + 1] = sums[b];
        }
    }
#endif
}

/* Tokens first .. last - 1 of x quantized (quantize_token_pairs) */
static void quantize_tokens(const float *x, int in_dim, float *x_pairs, int8_t *x_codes,
                            int first, int last) {
    int n_blocks = in_dim / 32;
    for (int t = first; t < last; t++)
        quantize_token_pairs(x + (size_t)t * in_dim, in_dim, x_pairs + 2 * (size_t)t * n_blocks,
                             x_codes + (size_t)t * in_dim);
}

/* The memory token_starts fills for n_tokens tokens of in_dim (freed by the caller), or NULL
 * where the 512-bit tile is not built in, the tokens are too few for it (a decode step of
 * a few sequences streams the rows once per token instead), or the memory cannot be had:
 * then the products take the smaller tiles, with the same bits. */
static int32_t *starts_memory(int n_tokens, int in_dim) {
#ifdef KV_INT8_PANELS
    if (n_tokens >= TILE_MIN_TOKENS)
        return (int32_t *)kv_alloc_floats((size_t)n_tokens * (size_t)(in_dim / 32));
#endif
    (void)n_tokens;
    (void)in_dim;
    return NULL;
}

void kv_matmul_int8_many(int n_matrices, float *const *outs, const uint8_t *const *ws,
                         kv_weight_format format, const int *out_dims, const float *x,
                         int n_tokens, int in_dim, float *x_scales, int8_t *x_codes) {
    float *x_pairs = x_scales;   /* (n_tokens, n_blocks, 2): the same floats, side by side */
    /* many tokens (a prefill) are quantized by the team, each thread a share; a few before */
    int team_quantizes = n_tokens >= 8;
    if (!team_quantizes)
        quantize_tokens(x, in_dim, x_pairs, x_codes, 0, n_tokens);
    int32_t *starts = starts_memory(n_tokens, in_dim);
    void (*rows)(float *, const uint8_t *, int, int, int, const float *, const int8_t *,
                 const int32_t *, uint8_t *, int, int) =
        format == KV_WEIGHT_Q4_0 ? rows_int8_q4_0 :
        format == KV_WEIGHT_Q4_1 ? rows_int8_q4_1 : rows_int8_q8_0;
    int64_t work = 0;
    int most_rows = 0;
    for (int m = 0; m < n_matrices; m++) {
        work += (int64_t)n_tokens * out_dims[m] * in_dim;
        most_rows = out_dims[m] > most_rows ? out_dims[m] : most_rows;
    }
    (void)work;   /* read by the OpenMP pragma only, which a build without OpenMP drops */
    /* One parallel region for all the matrices (a decode step pays its start and its end
     * once, not once a matrix): each thread a contiguous share of every matrix's rows, one
     * matrix after another, without waiting for the others (no output is shared). */
    #pragma omp parallel num_threads(kv_threads()) \
        if (work >= KV_PARALLEL_MIN_WORK && most_rows > 1)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        if (team_quantizes) {
            quantize_tokens(x, in_dim, x_pairs, x_codes, kv_split(n_tokens, me, team),
                            kv_split(n_tokens, me + 1, team));
            #pragma omp barrier
        }
        uint8_t *panel = NULL;   /* this thread's 16 rows, repacked (the 512-bit tile) */
#ifdef KV_INT8_PANELS
        if (starts != NULL) {   /* each thread a share of the tokens, all read them all */
            token_starts(format, x_codes, in_dim, starts, kv_split(n_tokens, me, team),
                         kv_split(n_tokens, me + 1, team));
            panel = (uint8_t *)kv_alloc_floats((size_t)(in_dim / 32) * PANEL_BLOCK_BYTES /
                                               sizeof(float));
            #pragma omp barrier
        }
#endif
        for (int m = 0; m < n_matrices; m++)
            rows(outs[m], ws[m], n_tokens, in_dim, out_dims[m], x_pairs, x_codes, starts, panel,
                 kv_split(out_dims[m], me, team), kv_split(out_dims[m], me + 1, team));
        free(panel);
    }
    free(starts);
}

void kv_matmul_int8(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                    int n_tokens, int in_dim, int out_dim, float *x_scales, int8_t *x_codes) {
    kv_matmul_int8_many(1, &out, &w, format, &out_dim, x, n_tokens, in_dim, x_scales, x_codes);
}

kv_status kv_weights_matmul_int8(float *out, const float *x, const uint8_t *w,
                                 kv_weight_format format, int n_tokens, int in_dim, int out_dim) {
    if (out == NULL || x == NULL || w == NULL || n_tokens <= 0 || out_dim <= 0 ||
        !kv_weight_takes_int8(format) || kv_weight_row_bytes(format, in_dim) == 0)
        return KV_ERR_INVALID_ARG;
    int n_blocks = in_dim / 32;
    float *x_scales = kv_alloc_floats(2 * (size_t)n_tokens * n_blocks);   /* and the sums */
    int8_t *x_codes = malloc((size_t)n_tokens * in_dim);
    if (x_scales == NULL || x_codes == NULL) {
        free(x_scales);
        free(x_codes);
        return KV_ERR_NOMEM;
    }
    if (kv_get_kernels() == KV_KERNELS_PLAIN)
        kv_plain_matmul_int8(out, x, w, format, n_tokens, in_dim, out_dim, x_scales, x_codes);
    else
        kv_matmul_int8(out, x, w, format, n_tokens, in_dim, out_dim, x_scales, x_codes);
    free(x_scales);
    free(x_codes);
    return KV_OK;
}

size_t kv_weights_scratch_floats(int in_dim, int n_threads) {
    return (size_t)n_threads * 4 * (size_t)in_dim;
}
