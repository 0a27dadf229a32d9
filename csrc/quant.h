/* quant.h: cache element formats, one row at a time (internal to the core).
 *
 * The formats are defined by kvlab/quant.py (the NumPy reference); these functions
 * produce the same codes bit for bit. They do not know about caches yet: the quantized
 * caches will call them when K and V are written and read.
 */
#ifndef KVLAB_QUANT_H
#define KVLAB_QUANT_H

#include <stddef.h>
#include <stdint.h>

typedef enum { KV_FMT_F32, KV_FMT_F16, KV_FMT_BF16, KV_FMT_I8, KV_FMT_I4 } kv_format;

uint16_t kv_f32_to_f16(float value);
float kv_f16_to_f32(uint16_t bits);
uint16_t kv_f32_to_bf16(float value);
float kv_bf16_to_f32(uint16_t bits);

/* n values in groups of `group` (group divides n): one scale per group,
 * code = rint(x / scale) in -127..127, scale = max|x| / 127 */
void kv_quantize_i8(int8_t *codes, float *scales, const float *x, size_t n, int group);
void kv_dequantize_i8(float *x, const int8_t *codes, const float *scales, size_t n, int group);

/* n values (n even) in groups of `group` (even, divides n): zero = group min,
 * scale = (max - min) / 15, code = rint((x - zero) / scale) in 0..15, two per byte with
 * the even-indexed value in the low nibble */
void kv_quantize_i4(uint8_t *codes, float *scales, float *zeros, const float *x, size_t n,
                    int group);
void kv_dequantize_i4(float *x, const uint8_t *codes, const float *scales, const float *zeros,
                      size_t n, int group);

#endif /* KVLAB_QUANT_H */
