/* common.cuh: what several .cu files share (internal to the CUDA backend).
 *
 * Warp reductions, the launch-error check, and the cache formats seen from a kernel: how
 * eight values of a head row are read and turned into floats (decode), and how a float row
 * becomes codes (encode). The encoders follow csrc/quant.c step for step (float32 arithmetic
 * in the same order, round half to even), so the GPU writes the same codes as the CPU, bit
 * for bit; nvcc fuses a * b + c into one instruction by default, which is harmless here:
 * no encoder or decoder has a multiply followed by an add.
 */
#ifndef KVLAB_COMMON_CUH
#define KVLAB_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kvcuda.h"

#define FULL_MASK 0xffffffffu

/* After a launch: a bad configuration shows up here at once, a fault in the kernel later
 * (the next call that waits, e.g. the copy of the logits, returns it). */
#define KV_CUDA_LAUNCHED() ((kv_cuda_err)cudaGetLastError())

#define KV_CUDA_TRY(expr)                          \
    do {                                           \
        err = (kv_cuda_err)(expr);                 \
        if (err != 0) goto fail;                   \
    } while (0)

static inline unsigned blocks_for(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

/* Every lane of the warp takes part (FULL_MASK), and gets the same total: the xor
 * butterfly adds the same numbers in the same order on every lane. */
static __device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

/* ---- encoding: csrc/quant.c on the GPU ------------------------------------------------------ */

static __device__ __forceinline__ uint16_t f32_to_f16(float value) {
    uint32_t bits = __float_as_uint(value);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    float magnitude = fabsf(value);
    if (isnan(value)) return sign | 0x7E00;
    if (magnitude >= 65520.0f) return sign | 0x7C00;
    if (magnitude < 6.103515625e-05f) return sign | (uint16_t)rintf(magnitude * 16777216.0f);
    uint32_t magnitude_bits = bits & 0x7FFFFFFF;
    uint32_t rounded = magnitude_bits + 0x0FFF + ((magnitude_bits >> 13) & 1);
    return sign | (uint16_t)((rounded >> 13) - ((127 - 15) << 10));
}

static __device__ __forceinline__ uint16_t f32_to_bf16(float value) {
    uint32_t bits = __float_as_uint(value);
    if (isnan(value)) return (uint16_t)((bits >> 16) | 0x0040);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

static __device__ __forceinline__ float at_least(float x, float bound) { return x > bound ? x : bound; }
static __device__ __forceinline__ float at_most(float x, float bound) { return x < bound ? x : bound; }

/* One group of int8 values: the scale maps the largest magnitude to 127 (kv_quantize_i8). */
static __device__ __forceinline__ void encode_i8(int8_t *codes, float *scale, const float *v,
                                                 int group) {
    float largest = 0.0f;
    for (int i = 0; i < group; i++) largest = at_least(fabsf(v[i]), largest);
    *scale = largest / 127.0f;
    float divisor = *scale > 0.0f ? *scale : 1.0f;
    for (int i = 0; i < group; i++)
        codes[i] = (int8_t)at_most(at_least(rintf(v[i] / divisor), -127.0f), 127.0f);
}

/* ---- decoding: eight values of a head row, as the attention kernel reads them ---------------- */

/* Each format is a small struct: Raw is what one lane loads for eight values (one or two
 * 16-byte loads, or 8 bytes and a scale for int8), load() reads it, decode() turns it into
 * floats. Loading and decoding are apart so that a kernel can issue several loads before
 * it needs the first one (memory latency is hidden by having many bytes in flight). The
 * decoded values are exactly what csrc/quant.c's dequantizers give. */
struct FormatF32 {
    struct Raw { float4 a, b; };
    static __device__ __forceinline__ Raw load(const kv_store &s, size_t head_row, int d0) {
        const float4 *p = (const float4 *)(s.codes + head_row * s.head_bytes) + d0 / 4;
        return Raw{__ldg(p), __ldg(p + 1)};
    }
    static __device__ __forceinline__ Raw zero() { return Raw{make_float4(0, 0, 0, 0), make_float4(0, 0, 0, 0)}; }
    static __device__ __forceinline__ void decode(const Raw &r, float v[8]) {
        v[0] = r.a.x; v[1] = r.a.y; v[2] = r.a.z; v[3] = r.a.w;
        v[4] = r.b.x; v[5] = r.b.y; v[6] = r.b.z; v[7] = r.b.w;
    }
};

/* fp16 and bf16 read alike: eight 16-bit codes are one 16-byte load. */
struct SixteenBitCodes {
    struct Raw { uint4 bits; };
    static __device__ __forceinline__ Raw load(const kv_store &s, size_t head_row, int d0) {
        return Raw{__ldg((const uint4 *)(s.codes + head_row * s.head_bytes) + d0 / 8)};
    }
    static __device__ __forceinline__ Raw zero() { return Raw{make_uint4(0, 0, 0, 0)}; }
};

struct FormatF16 : SixteenBitCodes {
    static __device__ __forceinline__ void decode(const Raw &r, float v[8]) {
        const uint32_t words[4] = {r.bits.x, r.bits.y, r.bits.z, r.bits.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {   /* two halves per word, the lower one first; exact */
            v[2 * i] = __half2float(__ushort_as_half((unsigned short)(words[i] & 0xFFFFu)));
            v[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(words[i] >> 16)));
        }
    }
};

struct FormatBF16 : SixteenBitCodes {
    static __device__ __forceinline__ void decode(const Raw &r, float v[8]) {
        const uint32_t words[4] = {r.bits.x, r.bits.y, r.bits.z, r.bits.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {   /* a bf16 is the top half of a float32 */
            v[2 * i] = __uint_as_float(words[i] << 16);
            v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
        }
    }
};

struct FormatI8 {
    /* the eight values lie in one group (groups are a multiple of 8), so one scale */
    struct Raw { uint2 bytes; float scale; };
    static __device__ __forceinline__ Raw load(const kv_store &s, size_t head_row, int d0) {
        uint2 bytes = __ldg((const uint2 *)(s.codes + head_row * s.head_bytes) + d0 / 8);
        float scale = __ldg(s.scales + head_row * s.groups_per_head + d0 / s.group);
        return Raw{bytes, scale};
    }
    static __device__ __forceinline__ Raw zero() { return Raw{make_uint2(0, 0), 0.0f}; }
    static __device__ __forceinline__ void decode(const Raw &r, float v[8]) {
        const uint32_t words[2] = {r.bytes.x, r.bytes.y};
#pragma unroll
        for (int i = 0; i < 8; i++) {   /* byte i: shift it to the top, then back with its sign */
            int code = (int)(words[i / 4] << (24 - 8 * (i % 4))) >> 24;
            v[i] = (float)code * r.scale;
        }
    }
};

#endif /* KVLAB_COMMON_CUH */
