/* weight_formats.c: weight matrices in fp16, bf16 and Q8_0, and the fast tier of the
 * matrix product over them.
 *
 * Each weight becomes its float32 value in a register (a half or bf16 widened, a Q8_0 code
 * times its block's scale, which is exact: 8 bits times 11 fit float32's 24) and meets the
 * activations in kv_dot's order: eight running lanes of multiply-adds over chunks of eight,
 * the lanes added pairwise, leftovers in order. So the result is the float32 product over
 * the dequantized matrix, bit for bit (plain.c's kv_plain_matmul_weights is the spec).
 * What changes is the memory read: a decode step streams 2 bytes a weight, or 1.0625,
 * instead of 4. Not here: which matrices of a model use which format (model.c, loaders).
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
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

/* a Q8_0 block's scale, a half, as a float */
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

/* A row of a matrix in a 16-bit or Q8_0 format against x, in kv_dot's order (eight lanes
 * of multiply-adds, added pairwise, leftovers in order), each weight made float32 on the
 * way. (Four rows at a time, sharing each chunk of x, measured slower here: 0.97-1.09x of
 * fp32 against 1.7-1.9x for this, benchmarks/bench_weights.py.) */
static float dot_row(const uint8_t *row, kv_weight_format format, const float *x, int in_dim) {
    v8f acc = {0};
    if (format == KV_WEIGHT_Q8_0) {
        for (int b = 0; b < in_dim / KV_Q8_0_BLOCK; b++) {
            const uint8_t *block = row + (size_t)b * KV_Q8_0_BLOCK_BYTES;
            v8f scale = splat(block_scale(block));
            const int8_t *codes = (const int8_t *)(block + 2);
            const float *xb = x + b * KV_Q8_0_BLOCK;
            for (int j = 0; j < KV_Q8_0_BLOCK; j += 8)
                acc = madd(int8_to_floats(codes + j) * scale, load8(xb + j), acc);
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
    if (format == KV_WEIGHT_Q8_0) {
        for (int b = 0; b < in_dim / KV_Q8_0_BLOCK; b++) {
            size_t at = (size_t)b * KV_Q8_0_BLOCK_BYTES;
            v8f s0 = splat(block_scale(rows[0] + at)), s1 = splat(block_scale(rows[1] + at));
            v8f s2 = splat(block_scale(rows[2] + at)), s3 = splat(block_scale(rows[3] + at));
            const float *xb = x + b * KV_Q8_0_BLOCK;
            for (int j = 0; j < KV_Q8_0_BLOCK; j += 8) {
                v8f xv = load8(xb + j);
                size_t c = at + 2 + (size_t)j;
                a0 = madd(int8_to_floats((const int8_t *)rows[0] + c) * s0, xv, a0);
                a1 = madd(int8_to_floats((const int8_t *)rows[1] + c) * s1, xv, a1);
                a2 = madd(int8_to_floats((const int8_t *)rows[2] + c) * s2, xv, a2);
                a3 = madd(int8_to_floats((const int8_t *)rows[3] + c) * s3, xv, a3);
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
    if (format == KV_WEIGHT_Q8_0) {
        for (int b = 0; b < in_dim / KV_Q8_0_BLOCK; b++) {
            const uint8_t *block = row + (size_t)b * KV_Q8_0_BLOCK_BYTES;
            v8f scale = splat(block_scale(block));
            for (int j = 0; j < KV_Q8_0_BLOCK; j += 8) {
                v8f values = int8_to_floats((const int8_t *)block + 2 + j) * scale;
                memcpy(out + b * KV_Q8_0_BLOCK + j, &values, sizeof values);
            }
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
 * converted once per chunk of KV_TOKEN_CHUNK tokens, not once per token. */
static void blocks_converted(float *out, const float *x, const uint8_t *w,
                             kv_weight_format format, int n_tokens, int in_dim, int out_dim,
                             int lo, int hi, float *rows) {
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    const float *four[4] = {rows, rows + in_dim, rows + 2 * (size_t)in_dim, rows + 3 * (size_t)in_dim};
    for (int first = 0; first < n_tokens; first += KV_TOKEN_CHUNK) {
        int chunk = n_tokens - first < KV_TOKEN_CHUNK ? n_tokens - first : KV_TOKEN_CHUNK;
        for (int block = lo; block < hi; block++) {
            int o = 4 * block, n_rows = out_dim - o < 4 ? out_dim - o : 4;
            for (int r = 0; r < n_rows; r++)
                convert_row(format, w + (size_t)(o + r) * row_bytes, in_dim, rows + (size_t)r * in_dim);
            if (n_rows == 4) {
                kv_matmul_four_rows(out, x, four, o, first, chunk, in_dim, out_dim);
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
    #pragma omp parallel num_threads(n_threads) \
        if ((long)n_tokens * out_dim * in_dim >= KV_PARALLEL_MIN_WORK && n_blocks > 1)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        if (n_tokens < KV_CONVERT_ONCE_TOKENS) {
            rows_streamed(out, x, w, format, n_tokens, in_dim, out_dim,
                          (int)((long)out_dim * me / team), (int)((long)out_dim * (me + 1) / team));
        } else {
            blocks_converted(out, x, w, format, n_tokens, in_dim, out_dim,
                             (int)((long)n_blocks * me / team), (int)((long)n_blocks * (me + 1) / team),
                             scratch + (size_t)me * 4 * in_dim);
        }
    }
}

kv_status kv_weights_matmul(float *out, const float *x, const uint8_t *w,
                            kv_weight_format format, int n_tokens, int in_dim, int out_dim) {
    if (out == NULL || x == NULL || w == NULL || n_tokens <= 0 || out_dim <= 0 ||
        (int)format < KV_WEIGHT_F32 || (int)format > KV_WEIGHT_Q8_0 ||
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

/* ---- Q8_0 against int8 activations ------------------------------------------------------ */

#ifdef __AVX2__
/* The eight exact sums w[4m] x[4m] + ... + w[4m + 3] x[4m + 3] of 32 int8 pairs: |w| times
 * x with w's sign, as unsigned by signed bytes (the instructions' operand kinds). With
 * AVX-512 VNNI one instruction adds the four products; otherwise maddubs adds them in pairs
 * (at most 2 x 128 x 127, below int16's limit, so never saturated) and madd adds the pairs:
 * the same integers either way. */
static ALWAYS_INLINE __m256i sums_of_four(__m256i w, __m256i x, __m256i ones) {
    __m256i magnitude = _mm256_sign_epi8(w, w), signed_x = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)ones;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones);
#endif
}
#endif

/* One Q8_0 row against a token's quantized activations, in kv_plain_matmul_int8's order:
 * per block, the products of 32 byte pairs summed four at a time as exact integers
 * (sums_of_four), made float and added times the two scales into eight lanes. */
static float dot_row_int8(const uint8_t *row, const float *x_scales, const int8_t *x_codes,
                          int n_blocks) {
    v8f acc = {0};
    for (int b = 0; b < n_blocks; b++) {
        const uint8_t *block = row + (size_t)b * KV_Q8_0_BLOCK_BYTES;
        v8f scale = splat(block_scale(block) * x_scales[b]);
        const int8_t *wq = (const int8_t *)(block + 2), *xq = x_codes + b * KV_Q8_0_BLOCK;
        v8f partial;
#ifdef __AVX2__
        __m256i wv = _mm256_loadu_si256((const __m256i *)wq);
        __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
        partial = (v8f)_mm256_cvtepi32_ps(sums_of_four(wv, xv, _mm256_set1_epi16(1)));
#else
        for (int m = 0; m < 8; m++) {
            int32_t sum = 0;
            for (int i = 4 * m; i < 4 * m + 4; i++) sum += (int32_t)wq[i] * xq[i];
            partial[m] = (float)sum;
        }
#endif
        acc = madd(scale, partial, acc);
    }
    return reduce_lanes(acc);
}

/* Four Q8_0 rows, wherever they lie, against one token's quantized activations: out[r] is
 * row r's dot_row_int8, bit for bit (each row its own eight lanes); the token's codes are
 * loaded once for the four, and four chains of arithmetic run side by side. */
static void dot_rows4_int8(const uint8_t *const rows[4], const float *x_scales,
                           const int8_t *x_codes, int n_blocks, float out[4]) {
#ifdef __AVX2__
    v8f acc[4] = {{0}, {0}, {0}, {0}};
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < n_blocks; b++) {
        size_t at = (size_t)b * KV_Q8_0_BLOCK_BYTES;
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x_codes + b * KV_Q8_0_BLOCK));
        for (int r = 0; r < 4; r++) {
            v8f scale = splat(block_scale(rows[r] + at) * x_scales[b]);
            __m256i wv = _mm256_loadu_si256((const __m256i *)(rows[r] + at + 2));
            acc[r] = madd(scale, (v8f)_mm256_cvtepi32_ps(sums_of_four(wv, xv, ones)), acc[r]);
        }
    }
    v4f sums = reduce_lanes4(acc[0], acc[1], acc[2], acc[3]);
    for (int r = 0; r < 4; r++) out[r] = sums[r];
#else
    for (int r = 0; r < 4; r++) out[r] = dot_row_int8(rows[r], x_scales, x_codes, n_blocks);
#endif
}

/* The same for two tokens at once (a prefill, a batch): each row's codes are loaded, and
 * their magnitudes taken, once for both tokens; eight chains side by side. out0 and out1
 * are each token's four dot_row_int8s, bit for bit. */
static void dot_rows4_int8_pair(const uint8_t *const rows[4], const float *scales0,
                                const int8_t *codes0, const float *scales1,
                                const int8_t *codes1, int n_blocks, float out0[4],
                                float out1[4]) {
#ifdef __AVX2__
    v8f acc0[4] = {{0}, {0}, {0}, {0}}, acc1[4] = {{0}, {0}, {0}, {0}};
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < n_blocks; b++) {
        size_t at = (size_t)b * KV_Q8_0_BLOCK_BYTES;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(codes0 + b * KV_Q8_0_BLOCK));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(codes1 + b * KV_Q8_0_BLOCK));
        for (int r = 0; r < 4; r++) {
            float w_scale = block_scale(rows[r] + at);
            __m256i wv = _mm256_loadu_si256((const __m256i *)(rows[r] + at + 2));
            acc0[r] = madd(splat(w_scale * scales0[b]),
                           (v8f)_mm256_cvtepi32_ps(sums_of_four(wv, x0, ones)), acc0[r]);
            acc1[r] = madd(splat(w_scale * scales1[b]),
                           (v8f)_mm256_cvtepi32_ps(sums_of_four(wv, x1, ones)), acc1[r]);
        }
    }
    v4f sums0 = reduce_lanes4(acc0[0], acc0[1], acc0[2], acc0[3]);
    v4f sums1 = reduce_lanes4(acc1[0], acc1[1], acc1[2], acc1[3]);
    for (int r = 0; r < 4; r++) {
        out0[r] = sums0[r];
        out1[r] = sums1[r];
    }
#else
    dot_rows4_int8(rows, scales0, codes0, n_blocks, out0);
    dot_rows4_int8(rows, scales1, codes1, n_blocks, out1);
#endif
}

void kv_matmul_int8(float *out, const float *x, const uint8_t *w, int n_tokens, int in_dim,
                    int out_dim, float *x_scales, int8_t *x_codes) {
    int n_blocks = in_dim / KV_Q8_0_BLOCK;
    size_t row_bytes = kv_weight_row_bytes(KV_WEIGHT_Q8_0, in_dim);
    for (int t = 0; t < n_tokens; t++)
        kv_quantize_activations_q8(x + (size_t)t * in_dim, in_dim, x_scales + (size_t)t * n_blocks,
                                   x_codes + (size_t)t * in_dim);
    /* Each thread a contiguous share of the rows, read as four runs side by side (as
     * rows_streamed does), every token against each four. */
    #pragma omp parallel num_threads(kv_threads()) \
        if ((long)n_tokens * out_dim * in_dim >= KV_PARALLEL_MIN_WORK && out_dim > 1)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        int lo = (int)((long)out_dim * me / team), hi = (int)((long)out_dim * (me + 1) / team);
        int per_run = (hi - lo) / 4;
        for (int k = 0; k < per_run; k++) {
            int o[4] = {lo + k, lo + per_run + k, lo + 2 * per_run + k, lo + 3 * per_run + k};
            const uint8_t *rows[4] = {w + (size_t)o[0] * row_bytes, w + (size_t)o[1] * row_bytes,
                                      w + (size_t)o[2] * row_bytes, w + (size_t)o[3] * row_bytes};
            int t = 0;
            for (; t + 2 <= n_tokens; t += 2) {     /* two tokens share each row's loads */
                float sums0[4], sums1[4];
                dot_rows4_int8_pair(rows, x_scales + (size_t)t * n_blocks, x_codes + (size_t)t * in_dim,
                                    x_scales + (size_t)(t + 1) * n_blocks,
                                    x_codes + (size_t)(t + 1) * in_dim, n_blocks, sums0, sums1);
                for (int r = 0; r < 4; r++) {
                    out[(size_t)t * out_dim + o[r]] = sums0[r];
                    out[(size_t)(t + 1) * out_dim + o[r]] = sums1[r];
                }
            }
            for (; t < n_tokens; t++) {
                float sums[4];
                dot_rows4_int8(rows, x_scales + (size_t)t * n_blocks, x_codes + (size_t)t * in_dim,
                               n_blocks, sums);
                for (int r = 0; r < 4; r++) out[(size_t)t * out_dim + o[r]] = sums[r];
            }
        }
        for (int o = lo + 4 * per_run; o < hi; o++)   /* the last few, one at a time */
            for (int t = 0; t < n_tokens; t++)
                out[(size_t)t * out_dim + o] =
                    dot_row_int8(w + (size_t)o * row_bytes, x_scales + (size_t)t * n_blocks,
                                 x_codes + (size_t)t * in_dim, n_blocks);
    }
}

kv_status kv_weights_matmul_int8(float *out, const float *x, const uint8_t *w, int n_tokens,
                                 int in_dim, int out_dim) {
    if (out == NULL || x == NULL || w == NULL || n_tokens <= 0 || out_dim <= 0 ||
        kv_weight_row_bytes(KV_WEIGHT_Q8_0, in_dim) == 0)
        return KV_ERR_INVALID_ARG;
    int n_blocks = in_dim / KV_Q8_0_BLOCK;
    float *x_scales = kv_alloc_floats((size_t)n_tokens * n_blocks);
    int8_t *x_codes = malloc((size_t)n_tokens * in_dim);
    if (x_scales == NULL || x_codes == NULL) {
        free(x_scales);
        free(x_codes);
        return KV_ERR_NOMEM;
    }
    if (kv_get_kernels() == KV_KERNELS_PLAIN)
        kv_plain_matmul_int8(out, x, w, n_tokens, in_dim, out_dim, x_scales, x_codes);
    else
        kv_matmul_int8(out, x, w, n_tokens, in_dim, out_dim, x_scales, x_codes);
    free(x_scales);
    free(x_codes);
    return KV_OK;
}

size_t kv_weights_scratch_floats(int in_dim, int n_threads) {
    return (size_t)n_threads * 4 * (size_t)in_dim;
}
