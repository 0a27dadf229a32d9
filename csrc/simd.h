/* simd.h: the vector helpers the fast tier is built from (private to ops.c, attention.c
 * and bandwidth.c; the plain tier, plain.c, uses none of it).
 *
 * Eight-float vectors (GCC's vector extension: one AVX register), the one fused
 * multiply-add and the one order of adding lanes every dot product uses, and the hints
 * (ALWAYS_INLINE, IN_REGISTER) that make the compiler keep sums in registers; the lane-wise
 * max and e^x of the online softmax, shared by its one-head and eight-head steps (ops.c).
 */
#ifndef KVLAB_SIMD_H
#define KVLAB_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif

/* Eight float lanes: one AVX register (or two SSE registers on older CPUs). */
typedef float v8f __attribute__((vector_size(32)));

/* For kernels whose loops must be unrolled and their sums kept in registers at every call
 * site: inlined even where the compiler's own heuristics would not. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);  /* unaligned load; compiles to one vmovups */
    return v;
}

/* acc + a * b, lane by lane: one fused multiply-add (one rounding) in a kernel variant
 * built for CPUs with them (avx2 and avx512: x86 since 2013; dispatch.h), else a multiply
 * and an add. Every dot product of the matrix products uses this, so all of them still
 * round the same way. */
static inline v8f madd(v8f a, v8f b, v8f acc) {
#ifdef __FMA__
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* Keeps a loaded vector in a register. Without it GCC folds each load into every
 * multiply-add that uses it ("vfmadd231ps (mem), ..."), which looks free but repeats the
 * load: the matrix product's 4 x 3 kernel made 24 loads for 12 multiply-adds instead of 7,
 * and ran at about half of the multiply-add rate, waiting on loads. */
#if defined(__GNUC__) && defined(__AVX__)   /* a v8f fits one AVX register */
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* The one association order for the eight lanes. */
static inline float reduce_lanes(v8f lanes) {
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* Four floats: what reduce_lanes4 returns. */
typedef float v4f __attribute__((vector_size(16)));

/* reduce_lanes of four vectors at once: lane j of the result is reduce_lanes of the j-th
 * argument, bit for bit (the same additions; a + b and b + a round alike). Three
 * horizontal adds and one add, instead of four rounds of shuffles and scalar adds. */
static inline v4f reduce_lanes4(v8f a, v8f b, v8f c, v8f d) {
#ifdef __AVX__
    __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b);    /* a0+a1 a2+a3 b0+b1 b2+b3 | a4+a5 .. */
    __m256 cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    __m256 quarters = _mm256_hadd_ps(ab, cd);             /* (a0+a1)+(a2+a3) (b..) (c..) (d..) | .. */
    return (v4f)_mm_add_ps(_mm256_castps256_ps128(quarters), _mm256_extractf128_ps(quarters, 1));
#else
    return (v4f){reduce_lanes(a), reduce_lanes(b), reduce_lanes(c), reduce_lanes(d)};
#endif
}

/* x in all eight lanes (one broadcast; "zero + x" would cost an addition as well). */
static inline v8f splat(float x) {
    return (v8f){x, x, x, x, x, x, x, x};
}

/* the larger of a and b, lane by lane */
static inline v8f max8(v8f a, v8f b) {
#ifdef __AVX__
    return (v8f)_mm256_max_ps((__m256)a, (__m256)b);
#else
    v8f larger;
    for (int i = 0; i < 8; i++) larger[i] = a[i] > b[i] ? a[i] : b[i];
    return larger;
#endif
}

/* e^x for eight values at once, x <= 0 (softmax and SiLU only need those): x = n ln 2 + r with
 * |r| <= ln2 / 2, e^r from a degree-6 polynomial (Taylor terms, accurate to about one
 * unit in the last place there), times 2^n built from its exponent bits. glibc's expf
 * gives the same to within that last unit but one value at a time; attention calls this
 * once per query head and position. */
static inline v8f exp_nonpositive(v8f x) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f;   /* 1.5 * 2^23: adding it rounds to an integer */
    v8i too_small = x < -87.0f;              /* e^-87 is below 2^-125: counts as 0 */
    v8f floor87 = x * 0.0f - 87.0f;
    x = (v8f)(((v8i)x & ~too_small) | ((v8i)floor87 & too_small));
    v8f n = (x * log2e + round_magic) - round_magic;
    v8f r = (x - n * ln2_hi) - n * ln2_lo;
    v8f p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8i exponent = (__builtin_convertvector(n, v8i) + 127) << 23;   /* 2^n as a float */
    v8f result = p * (v8f)exponent;
    return (v8f)((v8i)result & ~too_small);
}

/* Leftover elements after the last full chunk of eight, added in order. */
static inline float add_tail(float sum, const float *a, const float *b, int from, int n) {
    for (int i = from; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* sum_i a[i] * b[i], in the core's fixed summation order: eight running lanes over
 * chunks of eight (multiply-adds), the lanes added pairwise, then the leftover elements
 * in order (plain.c's kv_plain_dot is the same, as loops).
 * Defined here, not in ops.c, so that attention's inner loops inline it. */
static inline float kv_dot(const float *a, const float *b, int n) {
    v8f acc = {0};
    int n8 = n & ~7;
    for (int i = 0; i < n8; i += 8) acc = madd(load8(a + i), load8(b + i), acc);
    return add_tail(reduce_lanes(acc), a, b, n8, n);
}

#endif /* KVLAB_SIMD_H */
