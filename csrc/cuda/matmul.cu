/* matmul.cu: prefill's projections, out = x . W^T for many tokens: a tiled matrix product.
 *
 * With T tokens each weight is used T times, so the work can be arranged to read W (and x)
 * from memory far fewer times than it is used: each thread block computes a 64 x 64 tile of
 * out (64 tokens by 64 output rows), walking the shared dimension 16 at a time. A step loads
 * a 64 x 16 piece of x and of W into shared memory (each value read from memory once for the
 * whole tile), and each of the 256 threads computes a 4 x 4 patch of the tile from it, so
 * every value loaded from shared memory is used four times from a register.
 * The patch of thread (ty, tx) is tokens ty + 16 i and outputs tx + 16 j (i, j < 4): a warp
 * then reads 16 consecutive outputs' W values (no shared-memory bank conflicts) and two
 * tokens' x values (broadcasts).
 *
 * Both operands are row-major with the shared dimension contiguous (x: tokens x in_dim, W:
 * out_dim x in_dim), so the tiles are stored transposed in shared memory. Sizes need not be
 * multiples of anything: out-of-range loads read 0. Each output is one sequential sum over
 * in_dim (fused multiply-adds), not the matrix-vector kernel's lane-split order, so prefill
 * and decode agree to rounding, not bit for bit. Plain CUDA cores, float32 throughout: the
 * tensor cores would round x and W to tf32 or bf16.
 */
#include "common.cuh"

#define TILE 64
#define STEP 16
#define THREADS 256

__global__ void __launch_bounds__(THREADS)
matmul_kernel(float *__restrict__ out, const float *__restrict__ x, const float *__restrict__ w,
              int n_tokens, int in_dim, int out_dim, int accumulate) {
    /* +1: the transposed stores of a warp then fall in different banks */
    __shared__ float xs[STEP][TILE + 1];
    __shared__ float ws[STEP][TILE + 1];
    const int token0 = blockIdx.y * TILE, out0 = blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {{0.0f}};
    for (int k0 = 0; k0 < in_dim; k0 += STEP) {
        /* 64 x 16 values of each operand, 4 per thread; a warp reads two rows' 16 consecutive
         * values, two 64-byte pieces */
#pragma unroll
        for (int l = 0; l < (TILE * STEP) / THREADS; l++) {
            int e = threadIdx.x + l * THREADS;
            int r = e / STEP, k = e % STEP;
            int token = token0 + r, o = out0 + r, col = k0 + k;
            xs[k][r] = token < n_tokens && col < in_dim ? x[(size_t)token * in_dim + col] : 0.0f;
            ws[k][r] = o < out_dim && col < in_dim ? w[(size_t)o * in_dim + col] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < STEP; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = xs[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = ws[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();   /* before the next step overwrites the tiles */
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int token = token0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int o = out0 + tx + 16 * j;
            if (token < n_tokens && o < out_dim) {
                float *dst = out + (size_t)token * out_dim + o;
                *dst = accumulate ? *dst + acc[i][j] : acc[i][j];
            }
        }
    }
}

extern "C" kv_cuda_err kv_cuda_matmul(float *out, const float *x, const float *w, int n_tokens,
                                      int in_dim, int out_dim, int accumulate) {
    if (n_tokens <= 0 || out_dim <= 0) return 0;
    if (in_dim <= 0 || (n_tokens + TILE - 1) / TILE > 65535) return KV_CUDA_INVALID_VALUE;
    dim3 grid((unsigned)((out_dim + TILE - 1) / TILE), (unsigned)((n_tokens + TILE - 1) / TILE));
    matmul_kernel<<<grid, THREADS>>>(out, x, w, n_tokens, in_dim, out_dim, accumulate);
    return KV_CUDA_LAUNCHED();
}
