/* decode_kernel_cuda.cuh: what the GPU edition of lab 14 receives, and the arithmetic its
 * bits are held to.
 *
 * The grader builds the student's decode_kernel_cuda.cu with nvcc, together with the lab's
 * harness.cu and against this header (its own copies), loads the library in the process
 * that runs the student's code, and calls decode_attention through the harness. This header
 * is the whole interface: a view of one sequence's int8 K and V in a paged pool, in GPU
 * memory; the host function to write; and the three pieces of arithmetic every bit of the
 * result depends on, written as kvlab's plain tier (csrc/plain.c) does them, as device
 * functions whose roundings no compiler flag can change. It holds no attention of its own.
 */
#ifndef DECODE_KERNEL_CUDA_CUH
#define DECODE_KERNEL_CUDA_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

/* The grader says whether kvlab's CPU kernels fuse multiply-adds (KVLAB_FMA, 0 or 1): the
 * expected bits are the plain tier's on the grader's CPU, so kv_madd must round as it does. */
#ifndef KVLAB_FMA
#error "build with -DKVLAB_FMA=1 or 0, as kvlab's CPU kernels fuse multiply-adds or not (README.md)"
#endif

/* One layer of one sequence's cache in a paged pool, as lab 14's kv_cache_view, every
 * pointer a device pointer (the struct itself lives in host memory: pass what a kernel
 * needs by value). Position p lives in block block_table[p / block_size], at row
 * p % block_size; a block holds every KV head's rows, each head's block_size rows one after
 * the other:
 *   codes of (p, head):  key_codes  + ((block * n_kv_heads + head) * block_size + row) * head_dim
 *   scales of (p, head): key_scales + ((block * n_kv_heads + head) * block_size + row) * (head_dim / group)
 * and the same for the values. Only positions 0 .. length - 1 are the sequence's. */
typedef struct {
    const int8_t *key_codes;    /* (num_blocks, n_kv_heads, block_size, head_dim), device */
    const float *key_scales;    /* (num_blocks, n_kv_heads, block_size, head_dim / group), device */
    const int8_t *value_codes;  /* (num_blocks, n_kv_heads, block_size, head_dim), device */
    const float *value_scales;  /* (num_blocks, n_kv_heads, block_size, head_dim / group), device */
    const int32_t *block_table; /* ((length + block_size - 1) / block_size,) block ids, device */
    int length;                 /* positions in the cache, at least 1 */
    int block_size;             /* rows per block, 1 .. 1024 */
    int n_kv_heads;
    int head_dim;               /* a multiple of 8, 8 .. 256 */
    int group;                  /* values per scale: a multiple of 8 that divides head_dim */
    float scale;                /* the softmax's scale: a score is (q . k) * scale */
    void *workspace;            /* device memory of yours during the call, its contents
                                   undefined at the start: workspace_bytes of it */
    size_t workspace_bytes;     /* KV_WORKSPACE_BYTES(n_heads, length) */
} kv_cache_view;

/* The workspace each call gets: 16 bytes per position per query head (room for a score
 * and a weight each, and more), plus 1 MiB. */
#define KV_WORKSPACE_BYTES(n_heads, length) \
    ((size_t)(n_heads) * ((size_t)(length) + 16) * 16 + ((size_t)1 << 20))

/* The lab: one decode step's attention, launched from the host. out and q are device
 * pointers to (n_heads, head_dim) float32; n_heads is a multiple of view->n_kv_heads, at
 * most 32 times it; query head h reads KV head h / (n_heads / n_kv_heads). Launch your
 * kernels on the default stream (<<<grid, block>>> or stream 0): the harness queues the
 * next call's work behind them there. The result must equal kvlab's plain tier bit for
 * bit (README.md says what that takes). */
extern "C" void decode_attention(float *out, const float *q, const kv_cache_view *view,
                                 int n_heads);

/* ---- the arithmetic of the plain tier -------------------------------------------------- */

/* acc + a * b: one rounding where kvlab's CPU kernels fuse (KVLAB_FMA 1), else a multiply
 * and an add, each rounded. The _rn intrinsics are never contracted or reassociated. */
static __device__ __forceinline__ float kv_madd(float a, float b, float acc) {
#if KVLAB_FMA
    return __fmaf_rn(a, b, acc);
#else
    return __fadd_rn(acc, __fmul_rn(a, b));
#endif
}

/* The eight lanes of a sum, added in the one order kvlab uses: pairs, then pairs of pairs. */
static __device__ __forceinline__ float kv_add_lanes(const float lanes[8]) {
    float low = __fadd_rn(__fadd_rn(lanes[0], lanes[1]), __fadd_rn(lanes[2], lanes[3]));
    float high = __fadd_rn(__fadd_rn(lanes[4], lanes[5]), __fadd_rn(lanes[6], lanes[7]));
    return __fadd_rn(low, high);
}

/* e^x for x <= 0, kvlab's own (not expf, whose last bits differ between C libraries and
 * from the GPU's): x = n ln 2 + r with n whole and |r| <= ln 2 / 2, e^r by a polynomial of
 * degree 6, 2^n put straight into a float's exponent. Below -87 the result is 0; NaN stays
 * NaN. Every operation rounded as the CPU's -ffp-contract=off build rounds it. */
static __device__ __forceinline__ float kv_exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    if (x != x) return x;
    const float shift = 12582912.0f;               /* 1.5 * 2^23: rounds to a whole number */
    float n = __fsub_rn(__fadd_rn(__fmul_rn(x, 1.44269504088896341f), shift), shift);
    float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.693359375f)), __fmul_rn(n, -2.12194440e-4f));
    float poly = __fadd_rn(__fmul_rn(r, 1.0f / 720.0f), 1.0f / 120.0f);
    poly = __fadd_rn(__fmul_rn(poly, r), 1.0f / 24.0f);
    poly = __fadd_rn(__fmul_rn(poly, r), 1.0f / 6.0f);
    poly = __fadd_rn(__fmul_rn(poly, r), 0.5f);
    poly = __fadd_rn(__fmul_rn(poly, r), 1.0f);
    poly = __fadd_rn(__fmul_rn(poly, r), 1.0f);
    float two_to_n = __int_as_float((int)(((unsigned)((int)n + 127)) << 23));
    return __fmul_rn(poly, two_to_n);
}

/* The starter's decode_attention says it is not written yet with this (a host flag the
 * harness defines and reads after each call), so that the grader reports the function as
 * missing rather than as wrong. */
extern "C" int decode_kernel_not_written;
#define NOT_WRITTEN()                      \
    do {                                   \
        decode_kernel_not_written = 1;     \
        return;                            \
    } while (0)

#endif /* DECODE_KERNEL_CUDA_CUH */
