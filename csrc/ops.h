/* ops.h: the numeric building blocks of a Llama layer (internal to the core).
 *
 * Each op works on row-major float32 rows. Dot products everywhere in the core use one
 * fixed summation order (see ops.c), so a token's numbers come out bit-identical whether
 * it was computed alone (decode) or inside a batch (prefill, or the no-cache path).
 * Declarations only: the vector helpers the fast kernels are built from are in simd.h.
 */
#ifndef KVLAB_OPS_H
#define KVLAB_OPS_H

#include <stddef.h>

/* out[t, o] = sum_i x[t, i] * w[o, i]  for t < n_tokens, o < out_dim.
 * x (n_tokens, in_dim), w (out_dim, in_dim), out (n_tokens, out_dim). Threaded over o. */
void kv_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
               int out_dim);

/* Several products of the same x at once, outs[m] = x . ws[m]^T (out_dims[m] rows each):
 * one parallel region for all of them, as Wq, Wk and Wv (or W1 and W3) share their input. */
void kv_matmul_many(int n_matrices, float *const *outs, const float *const *ws,
                    const int *out_dims, const float *x, int n_tokens, int in_dim);

/* Tokens a product takes at a time, so that their inputs stay in the L2 cache while the
 * rows of w pass over them (ops.c). */
#define KV_TOKEN_CHUNK 48

/* x (n_tokens, in_dim) as the AVX-512 tile reads it (pairs of tokens side by side, chunk
 * by chunk): memory for it (kv_packed_tokens_alloc; freed with free), or NULL where the
 * tile is not built in, the tokens are too few for it, or the memory cannot be had (the
 * products then take their other kernels, with the same bits); kv_pack_tokens fills pairs
 * first .. last - 1 of it (of (n_tokens + 1) / 2), so that threads can share the work. */
float *kv_packed_tokens_alloc(int n_tokens, int in_dim);
void kv_pack_tokens(const float *x, int n_tokens, int in_dim, float *packed, int first,
                    int last);

/* Four rows of a matrix, float32 wherever they lie (rows[r] is output o + r), against tokens
 * first .. first + chunk - 1 (chunk <= KV_TOKEN_CHUNK, first even) of x (in_dim each):
 * out[t * out_dim + o + r], in kv_dot's order. packed: kv_pack_tokens' copy of x, or NULL.
 * For rows made float32 on the way (weight_formats.c). */
void kv_matmul_four_rows(float *out, const float *x, const float *packed,
                         const float *const rows[4], int o, int first, int chunk, int in_dim,
                         int out_dim);

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of length dim */
void kv_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps);

/* Rotates each head of one token's q or k (n_heads * head_dim floats) in place by the
 * angles whose cos/sin (head_dim/2 each) are given; interleaved picks the pair layout. */
void kv_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
             const float *sin_table, int interleaved);

/* One step of the online softmax, for a tile of n scores (1 <= n <= 16) of one query head.
 * running_max and running_sum hold the largest score so far and the sum of e^(s - max)
 * over the earlier tiles (-inf and 0 before the first). Replaces each score s with
 * e^(s - new max), updates both, and returns e^(old max - new max): the factor by which
 * whatever was summed under the old max must be scaled to join the new terms. */
float kv_softmax_tile(float *scores, int n, float *running_max, float *running_sum);

/* gate = silu(gate) * up, elementwise: the SwiGLU activation */
void kv_swiglu(float *gate, const float *up, size_t n);

/* The index of the largest of n values, the first of equal ones; the first NaN if there is
 * one. The same choice as numpy.argmax, so greedy decoding in C and in Python agree. */
int kv_argmax(const float *values, int n);

#endif /* KVLAB_OPS_H */
