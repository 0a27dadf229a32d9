/* ops.h: the numeric building blocks of a Llama layer (internal to the core).
 *
 * Each op works on row-major float32 rows. Dot products everywhere in the core use one
 * fixed summation order (see ops.c), so a token's numbers come out bit-identical whether
 * it was computed alone (decode) or inside a batch (prefill, or the no-cache path).
 */
#ifndef KVLAB_OPS_H
#define KVLAB_OPS_H

/* sum_i a[i] * b[i], in the core's fixed summation order */
float kv_dot(const float *a, const float *b, int n);

/* out[t, o] = sum_i x[t, i] * w[o, i]  for t < n_tokens, o < out_dim.
 * x (n_tokens, in_dim), w (out_dim, in_dim), out (n_tokens, out_dim). Threaded over o. */
void kv_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
               int out_dim);

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of length dim */
void kv_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps);

/* Rotates each head of one token's q or k (n_heads * head_dim floats) in place by the
 * angles whose cos/sin (head_dim/2 each) are given; interleaved picks the pair layout. */
void kv_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
             const float *sin_table, int interleaved);

/* x = exp(x - max) / sum, in place */
void kv_softmax(float *x, int n);

/* gate = silu(gate) * up, elementwise: the SwiGLU activation */
#include <stddef.h>
void kv_swiglu(float *gate, const float *up, size_t n);

/* y += alpha * x */
void kv_axpy(float *y, float alpha, const float *x, int n);

#endif /* KVLAB_OPS_H */
