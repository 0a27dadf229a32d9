/* decode_kernel.h: what lab 14's kernel receives, and the arithmetic its bits are held to.
 *
 * The grader builds the student's decode_kernel.c against this header (its own copy, not
 * the student's) with the compiler flags that built kvlab's C core, loads it in the
 * process that runs the student's code, and calls decode_attention. This header is the
 * whole interface: a view of one sequence's int8 K and V in a paged pool, the function to
 * write, and the three pieces of arithmetic every bit of the result depends on, written as
 * kvlab's plain tier (csrc/plain.c) does them. It holds no attention of its own.
 */
#ifndef DECODE_KERNEL_H
#define DECODE_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The grader builds with kvlab's own flags and says whether kvlab's kernels fuse
 * multiply-adds (KVLAB_FMA): a build that would round otherwise is refused here, in words,
 * rather than graded on bits it could never match. */
#if defined(KVLAB_FMA) && (KVLAB_FMA) != defined(__FMA__)
#error "this build and kvlab's disagree on fused multiply-adds: build with kvlab's own flags"
#endif

/* One layer of one sequence's cache in a paged pool, K and V stored as int8 codes with a
 * float32 scale per group of `group` values (kvlab's int8 format: value = code * scale).
 * Position p lives in block block_table[p / block_size], at row p % block_size; a block
 * holds every KV head's rows, each head's block_size rows one after the other:
 *   codes of (p, head):  key_codes  + ((block * n_kv_heads + head) * block_size + row) * head_dim
 *   scales of (p, head): key_scales + ((block * n_kv_heads + head) * block_size + row) * (head_dim / group)
 * and the same for the values. Only positions 0 .. length - 1 are the sequence's: the rest
 * of its last block, and every block its table does not name, may hold anything. */
typedef struct {
    const int8_t *key_codes;    /* (num_blocks, n_kv_heads, block_size, head_dim) */
    const float *key_scales;    /* (num_blocks, n_kv_heads, block_size, head_dim / group) */
    const int8_t *value_codes;  /* (num_blocks, n_kv_heads, block_size, head_dim) */
    const float *value_scales;  /* (num_blocks, n_kv_heads, block_size, head_dim / group) */
    const int32_t *block_table; /* ((length + block_size - 1) / block_size,) block ids */
    int length;                 /* positions in the cache, at least 1 */
    int block_size;             /* rows per block, 1 .. 1024 */
    int n_kv_heads;
    int head_dim;               /* a multiple of 8, 8 .. 256 */
    int group;                  /* values per scale: a multiple of 8 that divides head_dim */
    float scale;                /* the softmax's scale: a score is (q . k) * scale (a plain
                                   model's is 1 / sqrt(head_dim); the grader draws others) */
} kv_cache_view;

/* The lab: one decode step's attention. out and q are (n_heads, head_dim), n_heads a
 * multiple of view->n_kv_heads, at most 32 times it; query head h reads KV head
 * h / (n_heads / n_kv_heads) and attends over every position of the view. The result must
 * equal kvlab's plain tier bit for bit (README.md says what that takes). The kernel may use
 * up to n_threads threads. */
void decode_attention(float *out, const float *q, const kv_cache_view *view, int n_heads,
                      int n_threads);

/* ---- the arithmetic of the plain tier ------------------------------------------------- */

/* acc + a * b with one rounding where the build has fused multiply-adds (kvlab is built for
 * the machine it runs on, and this file with the same flags), else a multiply and an add. */
static inline float kv_madd(float a, float b, float acc) {
#ifdef __FMA__
    return fmaf(a, b, acc);
#else
    return acc + a * b;
#endif
}

/* The eight lanes of a sum, added in the one order kvlab uses: pairs, then pairs of pairs. */
static inline float kv_add_lanes(const float lanes[8]) {
    float low = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    float high = (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]);
    return low + high;
}

/* e^x for x <= 0, kvlab's own (not expf, whose last bits differ between C libraries):
 * x = n ln 2 + r with n whole and |r| <= ln 2 / 2, e^r by a polynomial of degree 6, 2^n
 * put straight into a float's exponent. Below -87 the result is 0; NaN stays NaN. */
static inline float kv_exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    if (x != x) return x;
    const float shift = 12582912.0f;               /* 1.5 * 2^23: rounds to a whole number */
    float n = (x * 1.44269504088896341f + shift) - shift;           /* x / ln 2, rounded */
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;         /* ln 2 in two parts */
    float poly = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    uint32_t exponent = (uint32_t)((int32_t)n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &exponent, sizeof two_to_n);
    return poly * two_to_n;
}

/* The starter's decode_attention says it is not written yet with this: the grader reads
 * the flag after each call, and reports the function as missing rather than as wrong. */
int decode_kernel_not_written;
#define NOT_WRITTEN()                      \
    do {                                   \
        decode_kernel_not_written = 1;     \
        return;                            \
    } while (0)

#endif /* DECODE_KERNEL_H */
