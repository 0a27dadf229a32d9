/* weight_formats.h: weight matrices stored in fewer bytes, and products over them
 * (internal to the core).
 *
 * A matrix is out_dim rows of kv_weight_row_bytes(format, in_dim) bytes each. Decode reads
 * every weight once per token, so its speed is the read bandwidth over the weights' bytes:
 * fp16 and bf16 halve them, Q8_0 takes 34 bytes for 32 values (1.0625 a value). The
 * activations stay float32, and each weight is turned into its float32 value where it is
 * used, so the products equal the float32 products over the dequantized matrix bit for bit.
 */
#ifndef KVLAB_WEIGHT_FORMATS_H
#define KVLAB_WEIGHT_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#include "kvlab.h"

/* The fast tier: out (n_tokens, out_dim) = x (n_tokens, in_dim) . w^T, w in `format`, equal
 * bit for bit to kv_plain_matmul_weights (plain.c) and to kv_matmul over the dequantized
 * matrix. scratch: in_dim floats per thread (kv_threads()), for products of many tokens. */
void kv_matmul_weights(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                       int n_tokens, int in_dim, int out_dim, float *scratch);

#endif /* KVLAB_WEIGHT_FORMATS_H */
