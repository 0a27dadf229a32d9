/* matvec.cu: the decode step's projections, out = x . W^T for a handful of tokens.
 *
 * Decode multiplies every weight matrix by one activation row per sequence, so the time is
 * the time to read W once: the kernel must stream W at the memory's speed. Each warp takes
 * ROWS consecutive output rows; its 32 lanes read each row 16 bytes at a time, consecutive
 * lanes consecutive pieces (each warp-wide load is 512 contiguous bytes), several loads in
 * flight per lane before the first is used, and each piece of W is used for all NT tokens
 * before the next is read: W is read once for the whole batch.
 *
 * The x rows are small and every warp reads all of them (from the L1/L2 caches): with one
 * row per warp that is NT pieces of x loaded for every piece of W, and at eight tokens or
 * more those loads, not W's, would set the speed (the L1 cache serves a few times the
 * memory's bandwidth, not NT + 1 times). So a warp takes ROWS rows when NT is larger, and
 * each piece of x it loads serves all of them: at most 4 pieces of x per piece of W for
 * any NT. The CPU core blocks its product the same way (4 rows x 3 tokens, csrc/ops.c).
 *
 * Every output is summed in the same order whatever NT and ROWS are (lane l adds pieces
 * l, l + 32, ... in turn, then warp_sum adds the lanes), so a token's projection has the
 * same bits alone and in a batch of up to KV_CUDA_MATVEC_MAX_TOKENS. The lanes' sums are
 * added with shuffles; lane 0 writes the result (or adds it to out: the residual
 * connection, with `accumulate`).
 *
 * One kernel per token count NT (1 .. KV_CUDA_MATVEC_MAX_TOKENS), so the ROWS x NT running
 * sums are registers. More tokens than that go to the tiled matrix-matrix kernel (matmul.cu).
 */
#include "common.cuh"

#define THREADS 256
#define WARPS (THREADS / 32)

/* Output rows per warp and row steps in flight, by token count: one row while NT pieces of
 * x per piece of W stay few (NT <= 4), else enough rows to keep it at 4 or fewer; and
 * 4 (one row) or 8 (more rows) loads of W in flight per lane. */
template <int NT>
struct Tiling {
    static constexpr int rows = NT <= 4 ? 1 : NT <= 8 ? 2 : 4;
    static constexpr int unroll = rows == 1 ? 4 : 8 / rows;
};

template <int NT>
__global__ void __launch_bounds__(THREADS)
matvec_kernel(float *__restrict__ out, const float *__restrict__ x, const float *__restrict__ w,
              int in_dim, int out_dim, int accumulate) {
    constexpr int ROWS = Tiling<NT>::rows, UNROLL = Tiling<NT>::unroll;
    const int row0 = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    const int lane = threadIdx.x % 32;
    if (row0 >= out_dim) return;   /* the whole warp: row0 is the same on all its lanes */
    /* rows past the matrix's end read its last row again, and are not written */
    const float *w_row[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) w_row[r] = w + (size_t)min(row0 + r, out_dim - 1) * in_dim;
    float acc[ROWS][NT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
    if (in_dim % 4 == 0) {   /* rows start 16-byte aligned: float4 loads */
        const int n4 = in_dim / 4;
        for (int i0 = lane; i0 < n4; i0 += 32 * UNROLL) {
            float4 a[UNROLL][ROWS];   /* every load of W in flight before the first is used */
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
#pragma unroll
                for (int r = 0; r < ROWS; r++)
                    a[u][r] = i0 + 32 * u < n4 ? __ldg((const float4 *)w_row[r] + i0 + 32 * u)
                                               : make_float4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                int i = i0 + 32 * u;
                if (i >= n4) continue;   /* past the row's end (and so are the later ones) */
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float4 b = __ldg((const float4 *)(x + (size_t)t * in_dim) + i);   /* once for ROWS rows */
#pragma unroll
                    for (int r = 0; r < ROWS; r++) {
                        acc[r][t] = fmaf(a[u][r].x, b.x, acc[r][t]);
                        acc[r][t] = fmaf(a[u][r].y, b.y, acc[r][t]);
                        acc[r][t] = fmaf(a[u][r].z, b.z, acc[r][t]);
                        acc[r][t] = fmaf(a[u][r].w, b.w, acc[r][t]);
                    }
                }
            }
        }
    } else {                 /* odd widths (small test models): one value at a time */
        for (int i = lane; i < in_dim; i += 32) {
            float a[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; r++) a[r] = __ldg(&w_row[r][i]);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float b = __ldg(&x[(size_t)t * in_dim + i]);
#pragma unroll
                for (int r = 0; r < ROWS; r++) acc[r][t] = fmaf(a[r], b, acc[r][t]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float sum = warp_sum(acc[r][t]);
            if (lane == 0 && row0 + r < out_dim) {
                float *o = out + (size_t)t * out_dim + row0 + r;
                *o = accumulate ? *o + sum : sum;
            }
        }
}

typedef void (*matvec_fn)(float *, const float *, const float *, int, int, int);

extern "C" kv_cuda_err kv_cuda_matvec(float *out, const float *x, const float *w, int n_tokens,
                                      int in_dim, int out_dim, int accumulate) {
    static const matvec_fn kernels[KV_CUDA_MATVEC_MAX_TOKENS] = {
        matvec_kernel<1>, matvec_kernel<2>, matvec_kernel<3>, matvec_kernel<4>,
        matvec_kernel<5>, matvec_kernel<6>, matvec_kernel<7>, matvec_kernel<8>,
        matvec_kernel<9>, matvec_kernel<10>, matvec_kernel<11>, matvec_kernel<12>,
        matvec_kernel<13>, matvec_kernel<14>, matvec_kernel<15>, matvec_kernel<16>};
    static const int rows[KV_CUDA_MATVEC_MAX_TOKENS] = {
        Tiling<1>::rows, Tiling<2>::rows, Tiling<3>::rows, Tiling<4>::rows,
        Tiling<5>::rows, Tiling<6>::rows, Tiling<7>::rows, Tiling<8>::rows,
        Tiling<9>::rows, Tiling<10>::rows, Tiling<11>::rows, Tiling<12>::rows,
        Tiling<13>::rows, Tiling<14>::rows, Tiling<15>::rows, Tiling<16>::rows};
    if (n_tokens <= 0 || out_dim <= 0) return 0;
    if (n_tokens > KV_CUDA_MATVEC_MAX_TOKENS || in_dim <= 0) return KV_CUDA_INVALID_VALUE;
    const int rows_per_block = WARPS * rows[n_tokens - 1];
    unsigned blocks = (unsigned)((out_dim + rows_per_block - 1) / rows_per_block);
    kernels[n_tokens - 1]<<<blocks, THREADS>>>(out, x, w, in_dim, out_dim, accumulate);
    return KV_CUDA_LAUNCHED();
}
