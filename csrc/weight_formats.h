/* weight_formats.h: weight matrices stored in fewer bytes, and products over them
 * (internal to the core).
 *
 * A matrix is out_dim rows of kv_weight_row_bytes(format, in_dim) bytes each. Decode reads
 * every weight once per token, so its speed is the read bandwidth over the weights' bytes:
 * fp16 and bf16 halve them, Q8_0 takes 34 bytes for 32 values (1.0625 a value), Q4_0 18
 * and Q4_1 20 (0.5625 and 0.625). In kv_matmul_weights the activations stay float32 and
 * each weight is turned into its float32 value where it is used, so the products equal the
 * float32 products over the dequantized matrix bit for bit. kv_matmul_int8 is the other way
 * for Q8_0, Q4_0 and Q4_1 (a model's int8_activations): the activations are rounded to
 * int8 too, and the products have their own spec.
 */
#ifndef KVLAB_WEIGHT_FORMATS_H
#define KVLAB_WEIGHT_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#include "kvlab.h"

/* From this many tokens on, a product converts each row to float32 once per chunk of
 * tokens and runs the float32 kernel over it; below, each row is converted as it streams
 * past, once per token. */
#define KV_CONVERT_ONCE_TOKENS 4

/* Floats of scratch kv_matmul_weights and kv_plain_matmul_weights need for rows of in_dim
 * on n_threads threads: four rows per thread. The products take the same n_threads (not
 * kv_threads() again: another thread may change that between the allocation and the use). */
size_t kv_weights_scratch_floats(int in_dim, int n_threads);

/* The fast tier: out (n_tokens, out_dim) = x (n_tokens, in_dim) . w^T, w in `format`, equal
 * bit for bit to kv_plain_matmul_weights (plain.c) and to kv_matmul over the dequantized
 * matrix. scratch: kv_weights_scratch_floats(in_dim, n_threads) floats. */
void kv_matmul_weights(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                       int n_tokens, int in_dim, int out_dim, float *scratch, int n_threads);

/* The fast tier of kv_plain_matmul_int8 (Q8_0, Q4_0 or Q4_1 weights against x quantized to
 * int8 per block of 32), bit for bit: x_scales (2 * n_tokens * in_dim / 32 floats) and
 * x_codes (n_tokens, in_dim) are the caller's scratch, filled here (x_scales as (n_tokens,
 * in_dim / 32, 2): each block's scale beside its scale times the sum of its codes, where
 * the plain tier writes all the scales, then all the sums). */
void kv_matmul_int8(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                    int n_tokens, int in_dim, int out_dim, float *x_scales, int8_t *x_codes);

/* kv_matmul_int8 of several matrices in one format against the same x (a layer's Q, K and
 * V; its gate and up projections): outs[m] (n_tokens, out_dims[m]) = x . ws[m]^T, each
 * bit for bit kv_matmul_int8's, with x quantized once and one parallel region for all. */
void kv_matmul_int8_many(int n_matrices, float *const *outs, const uint8_t *const *ws,
                         kv_weight_format format, const int *out_dims, const float *x,
                         int n_tokens, int in_dim, float *x_scales, int8_t *x_codes);

#endif /* KVLAB_WEIGHT_FORMATS_H */
