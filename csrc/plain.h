/* plain.h: the plain tier of the core's kernels, written to be read (internal).
 *
 * Attention, the matrix product, RMSNorm, RoPE and SwiGLU as plain loops with shape
 * comments, in llama2.c's style: no intrinsics, no prefetching, no macros that make
 * functions. They are the specification of the kernels' bits (the order of every sum): the
 * fast kernels (ops.c, attention.c) are tested equal to them bit for bit
 * (tests/c/test_core.c), the chapters quote them, and kv_set_kernels(KV_KERNELS_PLAIN)
 * (KVLAB_KERNELS=plain in Python) runs the whole model on them, with the same logits and
 * tokens. The math they compute is specified by their NumPy twins in kvlab/reference.py,
 * which they match to float32 rounding, not bit for bit.
 */
#ifndef KVLAB_PLAIN_H
#define KVLAB_PLAIN_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"

/* sum_i a[i] * b[i] over n values, in the core's one summation order (see plain.c) */
float kv_plain_dot(const float *a, const float *b, int n);

/* kv_plain_matmul over a matrix stored as `format` (kvlab.h): each row made float32 in
 * scratch (in_dim floats per thread), then the same dot products, on at most n_threads
 * threads (the count scratch was sized for) */
void kv_plain_matmul_weights(float *out, const float *x, const uint8_t *w,
                             kv_weight_format format, int n_tokens, int in_dim, int out_dim,
                             float *scratch, int n_threads);

/* Q8_0, Q4_0 or Q4_1 weights against x quantized to int8 per block of 32 (into x_scales,
 * (2, n_tokens, in_dim / 32): scales, then scales times the blocks' sums of codes; and
 * x_codes): integer dot products, in the order plain.c states */
void kv_plain_matmul_int8(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                          int n_tokens, int in_dim, int out_dim, float *x_scales,
                          int8_t *x_codes);

/* out (n_tokens, out_dim) = x (n_tokens, in_dim) . w (out_dim, in_dim)^T */
void kv_plain_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
                     int out_dim);

/* out (dim,) = x / sqrt(mean(x^2) + eps) * weight, one row */
void kv_plain_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps);

/* vec (n_heads, head_dim) rotated in place by one position's angles, cos and sin
 * (head_dim / 2,) each; interleaved picks the pair layout */
void kv_plain_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
                   const float *sin_table, int interleaved);

/* gate (n,) = silu(gate) * up */
void kv_plain_swiglu(float *gate, const float *up, size_t n);

/* Causal grouped-query attention, with the arguments of kv_attention (attention.h): out and
 * q (n_tokens, n_heads * head_dim), the new tokens at start_pos .. start_pos + n_tokens - 1
 * already in the view; scratch holds n_threads rows of scratch_stride >= head_dim floats. */
void kv_plain_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                        int start_pos, int n_heads, int n_kv_heads, int head_dim,
                        float *scratch, size_t scratch_stride, int n_threads);

#endif /* KVLAB_PLAIN_H */
