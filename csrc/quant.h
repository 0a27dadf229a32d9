/* quant.h: cache element formats, a row of values at a time (internal to the core).
 *
 * The formats are defined by kvlab/quant.py (the NumPy reference); these functions
 * produce the same codes bit for bit, and decode them to the same float32 values.
 * store.c uses them to write K and V into a cache and to read them back in attention.
 */
#ifndef KVLAB_QUANT_H
#define KVLAB_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kvlab.h"

uint16_t kv_f32_to_f16(float value);
uint16_t kv_f32_to_bf16(float value);
/* fp8 e4m3 ("E4M3FN"): saturates to +-448, the largest finite value; NaN stays NaN */
uint8_t kv_f32_to_e4m3(float value);

/* n values, n a multiple of group: float formats, rounding to nearest even */
void kv_quantize_f16(uint16_t *codes, const float *x, size_t n);
void kv_dequantize_f16(float *x, const uint16_t *codes, size_t n);
/* The half stored at `bytes` (any alignment: a weight block's scale), as a float (exact). */
float kv_half_at(const uint8_t *bytes);
void kv_quantize_bf16(uint16_t *codes, const float *x, size_t n);
void kv_dequantize_bf16(float *x, const uint16_t *codes, size_t n);

/* int8, symmetric: scale = max|x| / 127 per group, code = rint(x / scale) in -127..127 */
void kv_quantize_i8(int8_t *codes, float *scales, const float *x, size_t n, int group);
void kv_dequantize_i8(float *x, const int8_t *codes, const float *scales, size_t n, int group);

/* int4, asymmetric (group even): zero = group min, scale = (max - min) / 15,
 * code = rint((x - zero) / scale) in 0..15, two per byte, the even-indexed value in the
 * low nibble */
void kv_quantize_i4(uint8_t *codes, float *scales, float *zeros, const float *x, size_t n,
                    int group);
void kv_dequantize_i4(float *x, const uint8_t *codes, const float *scales, const float *zeros,
                      size_t n, int group);

/* fp8 e4m3 with a scale per group: scale = max|x| / 448, code = e4m3(x / scale) */
void kv_quantize_fp8(uint8_t *codes, float *scales, const float *x, size_t n, int group);
void kv_dequantize_fp8(float *x, const uint8_t *codes, const float *scales, size_t n, int group);

/* The float32 values of one row of a weight matrix (in_dim of them) into out: the
 * dequantization kvlab/weight_formats.py defines (kv_weight_row_bytes is in kvlab.h). */
void kv_weight_row_dequantize(kv_weight_format format, const uint8_t *row, int in_dim,
                              float *out);

/* Bytes of one block of 32 values of a block format (Q8_0, Q4_0, Q4_1); 0 for the others. */
size_t kv_weight_block_bytes(kv_weight_format format);

/* Does a product with a matrix in this format take int8 activations (a model's
 * int8_activations)? The block formats do: Q8_0, Q4_0, Q4_1. */
static inline int kv_weight_takes_int8(kv_weight_format format) {
    return format == KV_WEIGHT_Q8_0 || format == KV_WEIGHT_Q4_0 || format == KV_WEIGHT_Q4_1;
}

/* The 4-bit code of value i (0 .. 31) of a Q4_0 or Q4_1 block's 16 code bytes: the low
 * nibble of byte i for the first 16, the high nibble of byte i - 16 for the others. */
static inline int kv_q4_code(const uint8_t *codes, int i) {
    return i < 16 ? codes[i] & 0x0F : codes[i - 16] >> 4;
}

/* A row of activations (in_dim, a multiple of 32) as Q8_0 blocks for the integer dot
 * products of kv_weights_matmul_int8: per block of 32 a float32 scale amax / 127 and codes
 * roundf(x / scale), as ggml quantizes (its scale is a half; this one stays float32); and
 * sums (in_dim / 32,): each block's scale times the exact sum of its codes, the part of a
 * Q4_1 product that the block's m multiplies (llama.cpp's Q8_1 keeps it the same way). */
void kv_quantize_activations_q8(const float *x, int in_dim, float *scales, int8_t *codes,
                                float *sums);

#endif /* KVLAB_QUANT_H */
