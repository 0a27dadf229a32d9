/* embedding.cu: the first step of the forward pass, x[t] = token_embedding[tokens[t]].
 *
 * A gather: one thread per value, consecutive threads reading consecutive values of a row,
 * so each warp's reads are one contiguous piece of the table. The binding has checked every
 * token id against vocab_size, so no index here can leave the table.
 */
#include "common.cuh"

__global__ void embedding_kernel(float *__restrict__ x, const float *__restrict__ table,
                                 const int32_t *__restrict__ tokens, int n_tokens, int dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tokens * dim) return;
    size_t t = i / dim, d = i % dim;
    x[i] = table[(size_t)tokens[t] * dim + d];
}

extern "C" kv_cuda_err kv_cuda_embedding(float *x, const float *table, const int32_t *tokens,
                                         int n_tokens, int dim) {
    if (n_tokens <= 0) return 0;
    embedding_kernel<<<blocks_for((size_t)n_tokens * dim, 256), 256>>>(x, table, tokens, n_tokens, dim);
    return KV_CUDA_LAUNCHED();
}
