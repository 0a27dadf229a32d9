/* rmsnorm.cu: out = x / sqrt(mean(x^2) + eps) * weight, one row at a time.
 *
 * One thread block per row: each thread sums the squares of a stride of the row, the warps
 * add theirs with shuffles and then through shared memory, and every thread scales its
 * values. The arithmetic is csrc/ops.c's kv_rmsnorm (the mean, 1 / sqrtf, then x * inv *
 * weight); only the order of the sum of squares differs, so the results agree with the CPU
 * to rounding. `rows` picks which rows of x to normalize (the final norm only needs the rows
 * whose logits are wanted).
 */
#include "common.cuh"

#define THREADS 256

__global__ void __launch_bounds__(THREADS)
rmsnorm_kernel(float *__restrict__ out, const float *__restrict__ x,
               const float *__restrict__ weight, const int32_t *__restrict__ rows, int dim,
               float eps) {
    __shared__ float warp_sums[THREADS / 32];
    __shared__ float inv_rms;
    const int r = blockIdx.x;
    const float *xr = x + (size_t)(rows != NULL ? rows[r] : r) * dim;
    float *o = out + (size_t)r * dim;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < dim; i += THREADS) sum = fmaf(xr[i], xr[i], sum);
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < THREADS / 32; w++) total += warp_sums[w];
        inv_rms = 1.0f / sqrtf(total / (float)dim + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < dim; i += THREADS) o[i] = xr[i] * inv_rms * weight[i];
}

extern "C" kv_cuda_err kv_cuda_rmsnorm(float *out, const float *x, const float *weight,
                                       const int32_t *rows, int n_rows, int dim, float eps) {
    if (n_rows <= 0) return 0;
    rmsnorm_kernel<<<n_rows, THREADS>>>(out, x, weight, rows, dim, eps);
    return KV_CUDA_LAUNCHED();
}
