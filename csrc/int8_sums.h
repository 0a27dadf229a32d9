/* int8_sums.h: on aarch64, the exact integer total of a weight block's 32 codes times an
 * activation block's 32 int8 codes, as weight_formats.c's int8 products need it (add_block;
 * x86's AVX2 path has its own, sums_of_four, and other CPUs the plain loops there), made
 * from sums of four products:
 *   - ARM's dot-product instructions (sdot, ARMv8.2-A: the aarch64 "dotprod" kernel
 *     variant, dispatch.h), whose one instruction adds exactly four byte products a lane;
 *   - NEON's widening multiplies and pairwise adds on any other aarch64 CPU (the baseline).
 * Each total is an integer of at most 32 x 128 x 128 in size, exact in int32 and in float32,
 * so both compute the plain loops' total and the choice moves no bit (the C tests compare
 * every variant's products with the plain tier's, tests/c). Defines KV_INT8_SUMS_NEON where
 * it has them. Private to weight_formats.c; not here: the scales that multiply the sums.
 */
#ifndef KVLAB_INT8_SUMS_H
#define KVLAB_INT8_SUMS_H

#include <stdint.h>
#include <string.h>

#include "kvlab.h"
#include "simd.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define KV_INT8_SUMS_NEON 1

/* A weight block's 32 codes as signed bytes in value order, in two registers (values
 * 0 .. 15, then 16 .. 31): Q8_0's as they are; Q4's nibbles (kv_q4_code's order: the low
 * nibbles first), less 8 for Q4_0. */
static ALWAYS_INLINE void weight_codes_neon(const uint8_t *codes, kv_weight_format format,
                                            int8x16_t out[2]) {
    if (format == KV_WEIGHT_Q8_0) {
        out[0] = vld1q_s8((const int8_t *)codes);
        out[1] = vld1q_s8((const int8_t *)codes + 16);
        return;
    }
    uint8x16_t bytes = vld1q_u8(codes);
    out[0] = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0F)));
    out[1] = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
    if (format == KV_WEIGHT_Q4_0) {
        out[0] = vsubq_s8(out[0], vdupq_n_s8(8));
        out[1] = vsubq_s8(out[1], vdupq_n_s8(8));
    }
}

/* Four sums of four products of 16 pairs of signed bytes: lane m adds pairs 4m .. 4m + 3 */
static ALWAYS_INLINE int32x4_t sums_of_four_neon(int8x16_t w, int8x16_t x) {
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(vdupq_n_s32(0), w, x);
#else
    /* byte products (at most 128 x 128: they fit int16), added in pairs, then the pairs */
    int32x4_t low = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x)));
    int32x4_t high = vpaddlq_s16(vmull_high_s8(w, x));
    return vpaddq_s32(low, high);
#endif
}

/* The exact integer total of a weight block's 32 products with x_codes (its codes at
 * `codes`, after its header): the plain tier's block total, whatever order the lanes add. */
static ALWAYS_INLINE int32_t block_total_neon(const uint8_t *codes, const int8_t *x_codes,
                                              kv_weight_format format) {
    int8x16_t w[2];
    weight_codes_neon(codes, format, w);
    int32x4_t sums = vaddq_s32(sums_of_four_neon(w[0], vld1q_s8(x_codes)),
                               sums_of_four_neon(w[1], vld1q_s8(x_codes + 16)));
    return vaddvq_s32(sums);
}
#endif

#endif /* KVLAB_INT8_SUMS_H */
