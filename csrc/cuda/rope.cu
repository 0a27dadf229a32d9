/* rope.cu: rotary position embedding, in place, for both pair layouts.
 *
 * One thread per (token, head, pair): the pair (a, b) turns by the angle pos * inv_freq[i],
 * as in csrc/ops.c's kv_rope. interleaved: pairs (x[2i], x[2i+1]) (llama2.c, Meta, GGUF);
 * otherwise (x[i], x[i + head_dim/2]) (Hugging Face). The forward pass rotates the queries
 * and keys of a token in one launch: in its row of Q, K and V the key heads follow the query
 * heads, so "the first n_heads + n_kv_heads heads" are exactly the ones to rotate.
 * sincosf is CUDA's full-precision one (within 2 units in the last place of the exact value,
 * as glibc's cosf and sinf are within 1), not the fast approximate __sincosf.
 */
#include "common.cuh"

__global__ void rope_kernel(float *__restrict__ x, size_t row_stride,
                            const int32_t *__restrict__ positions,
                            const float *__restrict__ inv_freq, int n_tokens, int n_heads,
                            int head_dim, int interleaved) {
    const int half = head_dim / 2;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tokens * n_heads * half) return;
    int pair = (int)(i % half);
    int head = (int)(i / half % n_heads);
    int t = (int)(i / half / n_heads);
    float *h = x + (size_t)t * row_stride + (size_t)head * head_dim;
    float angle = (float)positions[t] * inv_freq[pair];
    float s, c;
    sincosf(angle, &s, &c);
    float *re = interleaved ? &h[2 * pair] : &h[pair];
    float *im = interleaved ? &h[2 * pair + 1] : &h[pair + half];
    float a = *re, b = *im;
    *re = a * c - b * s;
    *im = b * c + a * s;
}

extern "C" kv_cuda_err kv_cuda_rope(float *x, size_t row_stride, const int32_t *positions,
                                    const float *inv_freq, int n_tokens, int n_heads,
                                    int head_dim, int interleaved) {
    size_t threads = (size_t)n_tokens * n_heads * (head_dim / 2);
    if (threads == 0) return 0;
    rope_kernel<<<blocks_for(threads, 256), 256>>>(x, row_stride, positions, inv_freq, n_tokens,
                                                   n_heads, head_dim, interleaved);
    return KV_CUDA_LAUNCHED();
}
