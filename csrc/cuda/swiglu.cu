/* swiglu.cu: the MLP's activation, out = silu(gate) * up, silu(g) = g / (1 + e^-g).
 *
 * One thread per value. The forward pass computes gate and up with one matrix product (W1
 * and W3 stacked), so a token's row holds gate then up, 2 * hidden_dim floats; the result
 * is hidden_dim floats per token. Same formula, in the same order, as csrc/ops.c kv_swiglu.
 */
#include "common.cuh"

__global__ void swiglu_kernel(float *__restrict__ out, const float *__restrict__ gate_up,
                              int n_tokens, int hidden_dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tokens * hidden_dim) return;
    size_t t = i / hidden_dim, j = i % hidden_dim;
    float g = gate_up[t * 2 * hidden_dim + j];
    float u = gate_up[t * 2 * hidden_dim + hidden_dim + j];
    out[i] = g / (1.0f + expf(-g)) * u;
}

extern "C" kv_cuda_err kv_cuda_swiglu(float *out, const float *gate_up, int n_tokens,
                                      int hidden_dim) {
    size_t n = (size_t)n_tokens * hidden_dim;
    if (n == 0) return 0;
    swiglu_kernel<<<blocks_for(n, 256), 256>>>(out, gate_up, n_tokens, hidden_dim);
    return KV_CUDA_LAUNCHED();
}
