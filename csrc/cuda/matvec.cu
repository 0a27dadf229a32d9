/* matvec.cu: the decode step's projections, out = x . W^T for a handful of tokens.
 *
 * Decode multiplies every weight matrix by one activation row per sequence, so the time is
 * the time to read W once: the kernel must stream W at the memory's speed. One warp per
 * output row o: its 32 lanes read the row 16 bytes at a time, consecutive lanes consecutive
 * pieces (each warp-wide load is 512 contiguous bytes), UNROLL loads in flight per lane
 * before the first is used, and each piece of W is used for all NT tokens before the next is read.
 * The x rows are small and read by every warp, so they come from the L1/L2 caches. The lanes'
 * partial sums are added with shuffles; lane 0 writes the result (or adds it to out: the
 * residual connection, with `accumulate`).
 *
 * One kernel per token count NT (1 .. KV_CUDA_MATVEC_MAX_TOKENS), so the NT running sums
 * are registers. More tokens than that go to the tiled matrix-matrix kernel (matmul.cu).
 */
#include "common.cuh"

#define THREADS 256
#define ROWS_PER_BLOCK (THREADS / 32)
#define UNROLL 4

template <int NT>
__global__ void __launch_bounds__(THREADS)
matvec_kernel(float *__restrict__ out, const float *__restrict__ x, const float *__restrict__ w,
              int in_dim, int out_dim, int accumulate) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= out_dim) return;   /* the whole warp: row is the same on all its lanes */
    const float *w_row = w + (size_t)row * in_dim;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (in_dim % 4 == 0) {   /* rows start 16-byte aligned: float4 loads */
        const float4 *w4 = (const float4 *)w_row;
        const int n4 = in_dim / 4;
        for (int i0 = lane; i0 < n4; i0 += 32 * UNROLL) {
            float4 a[UNROLL];   /* UNROLL loads in flight before the first is used */
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                a[u] = i0 + 32 * u < n4 ? __ldg(&w4[i0 + 32 * u]) : make_float4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                int i = i0 + 32 * u;
                if (i >= n4) break;
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float4 b = __ldg((const float4 *)(x + (size_t)t * in_dim) + i);
                    acc[t] = fmaf(a[u].x, b.x, acc[t]);
                    acc[t] = fmaf(a[u].y, b.y, acc[t]);
                    acc[t] = fmaf(a[u].z, b.z, acc[t]);
                    acc[t] = fmaf(a[u].w, b.w, acc[t]);
                }
            }
        }
    } else {                 /* odd widths (small test models): one value at a time */
        for (int i = lane; i < in_dim; i += 32) {
            float a = __ldg(&w_row[i]);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = fmaf(a, __ldg(&x[(size_t)t * in_dim + i]), acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float sum = warp_sum(acc[t]);
        if (lane == 0) {
            float *o = out + (size_t)t * out_dim + row;
            *o = accumulate ? *o + sum : sum;
        }
    }
}

typedef void (*matvec_fn)(float *, const float *, const float *, int, int, int);

extern "C" kv_cuda_err kv_cuda_matvec(float *out, const float *x, const float *w, int n_tokens,
                                      int in_dim, int out_dim, int accumulate) {
    static const matvec_fn kernels[KV_CUDA_MATVEC_MAX_TOKENS] = {
        matvec_kernel<1>, matvec_kernel<2>, matvec_kernel<3>, matvec_kernel<4>,
        matvec_kernel<5>, matvec_kernel<6>, matvec_kernel<7>, matvec_kernel<8>};
    if (n_tokens <= 0 || out_dim <= 0) return 0;
    if (n_tokens > KV_CUDA_MATVEC_MAX_TOKENS || in_dim <= 0) return KV_CUDA_INVALID_VALUE;
    unsigned blocks = (unsigned)((out_dim + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK);
    kernels[n_tokens - 1]<<<blocks, THREADS>>>(out, x, w, in_dim, out_dim, accumulate);
    return KV_CUDA_LAUNCHED();
}
