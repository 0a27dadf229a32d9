/* quant.c: converting K and V rows to fewer bits and back (fp16, bf16, int8, int4, fp8).
 *
 * Each function follows kvlab/quant.py step for step: float32 arithmetic in the same
 * order, rounding half to even (nearbyintf in the default rounding mode), so the codes
 * are bit-identical to the NumPy reference. Why these formats, and what each costs in
 * precision, is the subject of the chapter on cache quantization.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "quant.h"

_Static_assert(sizeof(float) == 4 && sizeof(uint32_t) == 4, "float must be IEEE binary32");

static uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static float bits_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* ---- fp16: 1 sign, 5 exponent, 10 mantissa bits ---------------------------------------- */

uint16_t kv_f32_to_f16(float value) {
    uint32_t bits = float_bits(value);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    float magnitude = fabsf(value);
    if (isnan(value)) return sign | 0x7E00;
    /* 65504 is the largest half; from halfway to the next power of two (65520) up,
     * round-to-nearest-even gives infinity */
    if (magnitude >= 65520.0f) return sign | 0x7C00;
    if (magnitude < 6.103515625e-05f) {
        /* below the smallest normal half (2^-14) halves are multiples of 2^-24: scaling by
         * 2^24 is exact, and rounding that to an integer is the rounding we want */
        return sign | (uint16_t)nearbyintf(magnitude * 16777216.0f);
    }
    /* normal: drop 13 mantissa bits, rounding to nearest with ties to even; a carry out of
     * the mantissa correctly bumps the exponent */
    uint32_t magnitude_bits = bits & 0x7FFFFFFF;
    uint32_t rounded = magnitude_bits + 0x0FFF + ((magnitude_bits >> 13) & 1);
    return sign | (uint16_t)((rounded >> 13) - ((127 - 15) << 10));  /* re-bias the exponent */
}

/* ---- bf16: the top half of a float32 ------------------------------------------------------- */

uint16_t kv_f32_to_bf16(float value) {
    uint32_t bits = float_bits(value);
    if (isnan(value)) return (uint16_t)((bits >> 16) | 0x0040);   /* keep it a (quiet) NaN */
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}


/* Rows of float formats. Decoding puts the code's exponent and mantissa bits where a
 * float32 keeps them and multiplies by a power of two that fixes the exponent bias: exact
 * for normal and subnormal codes alike, and a loop gcc turns into vector instructions. */
void kv_quantize_f16(uint16_t *codes, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) codes[i] = kv_f32_to_f16(x[i]);
}

void kv_dequantize_f16(float *x, const uint16_t *codes, size_t n) {
    const float rebias = 0x1p112f;    /* 2^(127 - 15) */
    for (size_t i = 0; i < n; i++) {
        uint32_t magnitude = (uint32_t)(codes[i] & 0x7FFF) << 13;
        float value = bits_float(magnitude) * rebias;
        if ((codes[i] & 0x7C00) == 0x7C00) value = bits_float(magnitude | 0x7F800000);  /* inf, NaN */
        x[i] = bits_float(float_bits(value) | ((uint32_t)(codes[i] & 0x8000) << 16));
    }
}

void kv_quantize_bf16(uint16_t *codes, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) codes[i] = kv_f32_to_bf16(x[i]);
}

void kv_dequantize_bf16(float *x, const uint16_t *codes, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = bits_float((uint32_t)codes[i] << 16);
}

/* fmaxf and fminf as comparisons, which the compiler inlines (the libm calls cannot be,
 * since they promise things about NaN that a plain max instruction does not). With
 * `bound` a number, both give what fmaxf/fminf give, NaN x included: the bound. */
static inline float at_least(float x, float bound) { return x > bound ? x : bound; }
static inline float at_most(float x, float bound) { return x < bound ? x : bound; }

/* The scale of a symmetric group: its largest magnitude maps to the largest code. Stores
 * it, and returns what to divide by (1 for an all-zero group, which stays zero). */
/* [quote ch06-symmetric-scale-and-kv-quantize-i8] */
static float symmetric_scale(float *scale, const float *v, int group, float largest_code) {
    float largest = 0.0f;
    for (int i = 0; i < group; i++) largest = at_least(fabsf(v[i]), largest);
    *scale = largest / largest_code;
    return *scale > 0.0f ? *scale : 1.0f;
}

/* ---- int8: symmetric, one scale per group ---------------------------------------------------- */

void kv_quantize_i8(int8_t *codes, float *scales, const float *x, size_t n, int group) {
    for (size_t g = 0; g < n / (size_t)group; g++) {
        const float *v = x + g * group;
        float divisor = symmetric_scale(&scales[g], v, group, 127.0f);
        for (int i = 0; i < group; i++) {
            float code = nearbyintf(v[i] / divisor);
            codes[g * group + i] = (int8_t)at_most(at_least(code, -127.0f), 127.0f);
        }
    }
}
/* [end ch06-symmetric-scale-and-kv-quantize-i8] */

void kv_dequantize_i8(float *x, const int8_t *codes, const float *scales, size_t n, int group) {
    for (size_t g = 0; g < n / (size_t)group; g++) {
        float scale = scales[g];
        for (int i = 0; i < group; i++) x[g * group + i] = (float)codes[g * group + i] * scale;
    }
}

/* ---- int4: asymmetric (a zero point per group), two codes per byte ------------------------------- */

void kv_quantize_i4(uint8_t *codes, float *scales, float *zeros, const float *x, size_t n,
                    int group) {
    for (size_t g = 0; g < n / (size_t)group; g++) {
        const float *v = x + g * group;
        float low = v[0], high = v[0];
        for (int i = 1; i < group; i++) {
            low = at_most(v[i], low);
            high = at_least(v[i], high);
        }
        float scale = (high - low) / 15.0f;
        scales[g] = scale;
        zeros[g] = low;
        float divisor = scale > 0.0f ? scale : 1.0f;
        for (int i = 0; i < group; i += 2) {
            float c0 = at_most(at_least(nearbyintf((v[i] - low) / divisor), 0.0f), 15.0f);
            float c1 = at_most(at_least(nearbyintf((v[i + 1] - low) / divisor), 0.0f), 15.0f);
            codes[(g * group + i) / 2] = (uint8_t)((uint8_t)c0 | ((uint8_t)c1 << 4));
        }
    }
}

void kv_dequantize_i4(float *x, const uint8_t *codes, const float *scales, const float *zeros,
                      size_t n, int group) {
    for (size_t g = 0; g < n / (size_t)group; g++) {
        float scale = scales[g], zero = zeros[g];
        const uint8_t *packed = codes + g * group / 2;
        float *out = x + g * group;
        for (int i = 0; i < group / 2; i++) {
            out[2 * i] = (float)(packed[i] & 0x0F) * scale + zero;
            out[2 * i + 1] = (float)(packed[i] >> 4) * scale + zero;
        }
    }
}

/* ---- fp8 e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits, a scale per group -------------------- */

uint8_t kv_f32_to_e4m3(float value) {
    uint8_t sign = (uint8_t)((float_bits(value) >> 24) & 0x80);
    if (isnan(value)) return sign | 0x7F;
    /* e4m3 has no infinity: anything beyond the largest value, 448, saturates to it */
    float magnitude = at_most(fabsf(value), 448.0f);
    if (magnitude < 0.015625f) {
        /* below the smallest normal (2^-6) codes are multiples of 2^-9; 8 * 2^-9 rounds up
         * into the first normal code, which is 8 too */
        return sign | (uint8_t)nearbyintf(magnitude * 512.0f);
    }
    /* normal: drop 20 mantissa bits with ties to even, then re-bias the exponent */
    uint32_t bits = float_bits(magnitude);
    uint32_t rounded = bits + 0x7FFFF + ((bits >> 20) & 1);
    return sign | (uint8_t)((rounded >> 20) - ((127 - 7) << 3));
}

void kv_quantize_fp8(uint8_t *codes, float *scales, const float *x, size_t n, int group) {
    for (size_t g = 0; g < n / (size_t)group; g++) {
        const float *v = x + g * group;
        float divisor = symmetric_scale(&scales[g], v, group, 448.0f);
        for (int i = 0; i < group; i++) codes[g * group + i] = kv_f32_to_e4m3(v[i] / divisor);
    }
}

void kv_dequantize_fp8(float *x, const uint8_t *codes, const float *scales, size_t n, int group) {
    for (size_t g = 0; g < n / (size_t)group; g++) {
        float scale = scales[g];
        for (int i = 0; i < group; i++) {
            uint8_t code = codes[g * group + i];
            float value = bits_float((uint32_t)(code & 0x7F) << 20) * 0x1p120f;
            if ((code & 0x7F) == 0x7F) value = NAN;
            value = bits_float(float_bits(value) | ((uint32_t)(code & 0x80) << 24));
            x[g * group + i] = value * scale;
        }
    }
}

/* ---- weight matrices (kvlab.h's kv_weight_format) ---------------------------------- */

size_t kv_weight_row_bytes(kv_weight_format format, int in_dim) {
    if (in_dim <= 0) return 0;
    switch (format) {
    case KV_WEIGHT_F32: return (size_t)in_dim * 4;
    case KV_WEIGHT_F16:
    case KV_WEIGHT_BF16: return (size_t)in_dim * 2;
    case KV_WEIGHT_Q8_0:
    case KV_WEIGHT_Q4_0:
    case KV_WEIGHT_Q4_1:   /* whole blocks of 32 only */
        return in_dim % 32 ? 0 : (size_t)(in_dim / 32) * kv_weight_block_bytes(format);
    }
    return 0;
}

size_t kv_weight_block_bytes(kv_weight_format format) {
    switch (format) {
    case KV_WEIGHT_Q8_0: return KV_Q8_0_BLOCK_BYTES;
    case KV_WEIGHT_Q4_0: return KV_Q4_0_BLOCK_BYTES;
    case KV_WEIGHT_Q4_1: return KV_Q4_1_BLOCK_BYTES;
    default: return 0;
    }
}

float kv_half_at(const uint8_t *bytes) {
    uint16_t code;
    float value;
    memcpy(&code, bytes, sizeof code);    /* a block's halves need not be 2-byte aligned */
    kv_dequantize_f16(&value, &code, 1);
    return value;
}

void kv_weight_row_dequantize(kv_weight_format format, const uint8_t *row, int in_dim,
                              float *out) {
    switch (format) {
    case KV_WEIGHT_F32:
        memcpy(out, row, (size_t)in_dim * sizeof(float));
        return;
    case KV_WEIGHT_F16:
    case KV_WEIGHT_BF16:
        for (int i = 0; i < in_dim; i++) {
            uint16_t code;
            memcpy(&code, row + 2 * (size_t)i, sizeof code);
            if (format == KV_WEIGHT_F16) kv_dequantize_f16(&out[i], &code, 1);
            else kv_dequantize_bf16(&out[i], &code, 1);
        }
        return;
    case KV_WEIGHT_Q8_0:
        for (int b = 0; b < in_dim / KV_Q8_0_BLOCK; b++) {
            const uint8_t *block = row + (size_t)b * KV_Q8_0_BLOCK_BYTES;
            float scale = kv_half_at(block);
            const int8_t *codes = (const int8_t *)(block + 2);
            for (int i = 0; i < KV_Q8_0_BLOCK; i++) out[b * KV_Q8_0_BLOCK + i] = scale * (float)codes[i];
        }
        return;
    case KV_WEIGHT_Q4_0:
        for (int b = 0; b < in_dim / KV_Q4_BLOCK; b++) {
            const uint8_t *block = row + (size_t)b * KV_Q4_0_BLOCK_BYTES;
            float d = kv_half_at(block);
            for (int i = 0; i < KV_Q4_BLOCK; i++)   /* exact: 11 bits times 4 */
                out[b * KV_Q4_BLOCK + i] = d * (float)(kv_q4_code(block + 2, i) - 8);
        }
        return;
    case KV_WEIGHT_Q4_1:
        for (int b = 0; b < in_dim / KV_Q4_BLOCK; b++) {
            const uint8_t *block = row + (size_t)b * KV_Q4_1_BLOCK_BYTES;
            float d = kv_half_at(block), m = kv_half_at(block + 2);
            /* d * code is exact (11 bits times 4), so the one rounding is the add's, fused
             * multiply-add or not */
            for (int i = 0; i < KV_Q4_BLOCK; i++)
                out[b * KV_Q4_BLOCK + i] = d * (float)kv_q4_code(block + 4, i) + m;
        }
        return;
    }
}

void kv_quantize_activations_q8(const float *x, int in_dim, float *scales, int8_t *codes,
                                float *sums) {
    for (int b = 0; b < in_dim / KV_Q8_0_BLOCK; b++) {
        const float *block = x + b * KV_Q8_0_BLOCK;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < KV_Q8_0_BLOCK; i++) {
            float magnitude = fabsf(block[i]);
            finite &= magnitude <= FLT_MAX;          /* false for inf and NaN */
            amax = magnitude > amax ? magnitude : amax;
        }
        /* A block holding inf or NaN has no int8 codes: its scale is NaN (so every product
         * with it is NaN, as the float32 product would be) and its codes 0. A scale so small
         * that 1 / scale overflows (amax below about 4e-37) rounds every code to 0. */
        float scale = finite ? amax / 127.0f : NAN;
        float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        if (inverse > FLT_MAX) inverse = 0.0f;
        scales[b] = scale;
        int32_t sum = 0;
        for (int i = 0; i < KV_Q8_0_BLOCK; i++) {
            codes[b * KV_Q8_0_BLOCK + i] = finite ? (int8_t)roundf(block[i] * inverse) : 0;
            sum += codes[b * KV_Q8_0_BLOCK + i];
        }
        sums[b] = scale * (float)sum;
    }
}
