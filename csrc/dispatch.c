/* dispatch.c: which kernel variant runs (dispatch.h), and the kernels' own names passing
 * each call to it.
 *
 * In the default x86-64 build the kernel files are compiled three times (variant_names.h):
 * for any x86-64 CPU (SSE2, the baseline), for AVX2 with FMA and F16C (Haswell, 2013, and
 * later; AMD since 2015), and for AVX-512 with VNNI (Intel's Ice Lake and Cascade Lake
 * servers, 2019, and later; AMD's Zen 4). In the default aarch64 build they are compiled
 * twice: for any ARMv8-A CPU (NEON, which every aarch64 CPU has, is the baseline) and for
 * ARMv8.2-A with the dot-product instructions (sdot: Cortex-A55/A75, 2017, and later; every
 * Apple Silicon Mac; AWS Graviton 2 and later), which the int8 products use. When the core
 * is loaded, before anything can call a kernel, the best of them that this CPU and its
 * operating system run is chosen, asking the CPU (cpuid, through the compiler's
 * __builtin_cpu_supports) on x86-64, and the operating system on ARM (Linux's
 * getauxval(AT_HWCAP), macOS's sysctl; user code cannot read ARM's ID registers itself);
 * each kv_matmul, kv_attention ... here is one indirect call into it. A build of one variant
 * (KVLAB_NATIVE=1 or KVLAB_PORTABLE=1, or another CPU) defines no KV_WITH_* and keeps only
 * the lists below: its kernel files define the kernels' names themselves.
 *
 * What a variant may use is decided here and in kvlab_build.py (VARIANTS and ARM_VARIANTS:
 * the compiler flags of each) together; tests/test_build.py checks that the two agree.
 */
#include <stddef.h>
#include <string.h>

#include "dispatch.h"

#if defined(KV_WITH_AVX2) || defined(KV_WITH_AVX512)
#define KV_DISPATCH 1
#define KV_DISPATCH_X86 1
#include <cpuid.h>
#elif defined(KV_WITH_DOTPROD)
#define KV_DISPATCH 1
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif

/* ---- the variants this build has, best first ------------------------------------------- */

#ifdef KV_DISPATCH_X86
extern const kv_kernel_table kv_variant_kernels_baseline, kv_variant_kernels_avx2,
    kv_variant_kernels_avx512;

/* F16C (half-float conversions) is the one feature of the AVX2 variant that not every
 * compiler's __builtin_cpu_supports can name, so it is asked of cpuid directly: leaf 1. */
static int cpu_has_f16c(void) {
    unsigned int eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

/* What kvlab_build.py compiles the avx2 variant for: -mavx2 -mfma -mf16c -mbmi -mbmi2.
 * __builtin_cpu_supports("avx2") is true only where the OS saves the AVX registers too. */
static int cpu_has_avx2(void) {
    __builtin_cpu_init();   /* this may run before the compiler's own start-up code */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && cpu_has_f16c();
}

/* The avx2 variant's flags and -mavx512f -mavx512bw -mavx512cd -mavx512dq -mavx512vl
 * -mavx512vnni (Skylake's AVX-512 servers, 2017, lack VNNI and run the avx2 variant). */
static int cpu_has_avx512(void) {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

static const kv_variant variants[] = {
#ifdef KV_WITH_AVX512
    {&kv_variant_kernels_avx512, "AVX-512 (F, BW, CD, DQ, VL) with VNNI", cpu_has_avx512},
#endif
#ifdef KV_WITH_AVX2
    {&kv_variant_kernels_avx2, "AVX2, FMA and F16C", cpu_has_avx2},
#endif
    {&kv_variant_kernels_baseline, "any x86-64 CPU (SSE2)", NULL},
};
#elif defined(KV_DISPATCH)   /* aarch64 */
extern const kv_kernel_table kv_variant_kernels_baseline, kv_variant_kernels_dotprod;

/* Linux's bit for the dot-product instructions in AT_HWCAP (asm/hwcap.h), for a C library
 * whose headers are older than it (kernel 4.15). */
#if defined(__linux__) && !defined(HWCAP_ASIMDDP)
#define HWCAP_ASIMDDP (1UL << 20)
#endif

/* What kvlab_build.py compiles the dotprod variant for: -march=armv8.2-a+dotprod (ARMv8.2's
 * other additions, half-float arithmetic and the like, are left to the compiler, which
 * the variant's kernels do not ask for; the dot product is what the int8 products use).
 * The operating system says, since reading ARM's ID registers traps in user code. */
static int cpu_has_dotprod(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
    int has = 0;
    size_t size = sizeof has;
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &has, &size, NULL, 0) == 0 && has;
#else   /* another system (Windows on ARM, the BSDs): not asked, so the baseline runs */
    return 0;
#endif
}

static const kv_variant variants[] = {
    {&kv_variant_kernels_dotprod, "ARMv8.2-A's dot-product instructions (sdot)",
     cpu_has_dotprod},
    {&kv_variant_kernels_baseline, "any ARMv8-A CPU (NEON)", NULL},
};
#else
static const kv_variant variants[] = {
    {&kv_variant_kernels, "the CPU this build was compiled for", NULL},
};
#endif

#define N_VARIANTS ((int)(sizeof variants / sizeof variants[0]))
_Static_assert(N_VARIANTS <= KV_MAX_VARIANTS, "dispatch.h's KV_MAX_VARIANTS is too small");

/* The variant running now, and its kernels; the last (any CPU's) until the choice below. */
static const kv_variant *current = &variants[N_VARIANTS - 1];

const kv_variant *kv_variants(int *count) {
    *count = N_VARIANTS;
    return variants;
}

const kv_variant *kv_current_variant(void) { return current; }

static const kv_variant *best_variant(void) {
    for (int i = 0; i < N_VARIANTS; i++)
        if (variants[i].cpu_has == NULL || variants[i].cpu_has()) return &variants[i];
    return &variants[N_VARIANTS - 1];   /* not reached: the last needs nothing */
}

kv_status kv_use_variant(const char *name) {
    if (name == NULL) {
        current = best_variant();
        return KV_OK;
    }
    for (int i = 0; i < N_VARIANTS; i++) {
        if (strcmp(name, variants[i].kernels->name) != 0) continue;
        if (variants[i].cpu_has != NULL && !variants[i].cpu_has()) return KV_ERR_INVALID_ARG;
        current = &variants[i];
        return KV_OK;
    }
    return KV_ERR_INVALID_ARG;
}

/* The choice, made when the core is loaded (the Python module, or a test program), so that
 * no kernel call can come first. */
__attribute__((constructor)) static void choose_when_loaded(void) { kv_use_variant(NULL); }

/* ---- the kernels' names, each passing its call to the current variant ------------------ */

#ifdef KV_DISPATCH
static inline const kv_kernel_table *kernels(void) { return current->kernels; }

void kv_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
               int out_dim) {
    kernels()->matmul(out, x, w, n_tokens, in_dim, out_dim);
}

void kv_matmul_many(int n_matrices, float *const *outs, const float *const *ws,
                    const int *out_dims, const float *x, int n_tokens, int in_dim) {
    kernels()->matmul_many(n_matrices, outs, ws, out_dims, x, n_tokens, in_dim);
}

void kv_matmul_four_rows(float *out, const float *x, const float *packed,
                         const float *const rows[4], int o, int first, int chunk, int in_dim,
                         int out_dim) {
    kernels()->matmul_four_rows(out, x, packed, rows, o, first, chunk, in_dim, out_dim);
}

void kv_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps) {
    kernels()->rmsnorm(out, x, weight, dim, eps);
}

void kv_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
             const float *sin_table, int interleaved) {
    kernels()->rope(vec, n_heads, head_dim, cos_table, sin_table, interleaved);
}

float kv_softmax_tile(float *scores, int n, float *running_max, float *running_sum) {
    return kernels()->softmax_tile(scores, n, running_max, running_sum);
}

void kv_softmax_tile8(float *scores, int n, int stride, float *running_max, float *running_sum,
                      float *corrections) {
    kernels()->softmax_tile8(scores, n, stride, running_max, running_sum, corrections);
}

void kv_swiglu(float *gate, const float *up, size_t n) { kernels()->swiglu(gate, up, n); }

int kv_argmax(const float *values, int n) { return kernels()->argmax(values, n); }

void kv_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                  int start_pos, int n_heads, int n_kv_heads, int head_dim, float *scratch,
                  size_t scratch_stride, int n_threads) {
    kernels()->attention(out, q, view, n_tokens, start_pos, n_heads, n_kv_heads, head_dim,
                         scratch, scratch_stride, n_threads);
}

size_t kv_attention_scratch(int n_heads, int n_kv_heads, int head_dim) {
    return kernels()->attention_scratch(n_heads, n_kv_heads, head_dim);
}

size_t kv_weights_scratch_floats(int in_dim, int n_threads) {
    return kernels()->weights_scratch_floats(in_dim, n_threads);
}

void kv_matmul_weights(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                       int n_tokens, int in_dim, int out_dim, float *scratch, int n_threads) {
    kernels()->matmul_weights(out, x, w, format, n_tokens, in_dim, out_dim, scratch, n_threads);
}

void kv_matmul_int8(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                    int n_tokens, int in_dim, int out_dim, float *x_scales, int8_t *x_codes) {
    kernels()->matmul_int8(out, x, w, format, n_tokens, in_dim, out_dim, x_scales, x_codes);
}

void kv_matmul_int8_many(int n_matrices, float *const *outs, const uint8_t *const *ws,
                         kv_weight_format format, const int *out_dims, const float *x,
                         int n_tokens, int in_dim, float *x_scales, int8_t *x_codes) {
    kernels()->matmul_int8_many(n_matrices, outs, ws, format, out_dims, x, n_tokens, in_dim,
                                x_scales, x_codes);
}

kv_status kv_weights_matmul(float *out, const float *x, const uint8_t *w,
                            kv_weight_format format, int n_tokens, int in_dim, int out_dim) {
    return kernels()->weights_matmul(out, x, w, format, n_tokens, in_dim, out_dim);
}

kv_status kv_weights_matmul_int8(float *out, const float *x, const uint8_t *w,
                                 kv_weight_format format, int n_tokens, int in_dim, int out_dim) {
    return kernels()->weights_matmul_int8(out, x, w, format, n_tokens, in_dim, out_dim);
}

float kv_plain_dot(const float *a, const float *b, int n) { return kernels()->plain_dot(a, b, n); }

void kv_plain_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
                     int out_dim) {
    kernels()->plain_matmul(out, x, w, n_tokens, in_dim, out_dim);
}

void kv_plain_matmul_weights(float *out, const float *x, const uint8_t *w,
                             kv_weight_format format, int n_tokens, int in_dim, int out_dim,
                             float *scratch, int n_threads) {
    kernels()->plain_matmul_weights(out, x, w, format, n_tokens, in_dim, out_dim, scratch,
                                    n_threads);
}

void kv_plain_matmul_int8(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                          int n_tokens, int in_dim, int out_dim, float *x_scales,
                          int8_t *x_codes) {
    kernels()->plain_matmul_int8(out, x, w, format, n_tokens, in_dim, out_dim, x_scales, x_codes);
}

void kv_plain_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps) {
    kernels()->plain_rmsnorm(out, x, weight, dim, eps);
}

void kv_plain_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
                   const float *sin_table, int interleaved) {
    kernels()->plain_rope(vec, n_heads, head_dim, cos_table, sin_table, interleaved);
}

void kv_plain_swiglu(float *gate, const float *up, size_t n) {
    kernels()->plain_swiglu(gate, up, n);
}

void kv_plain_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                        int start_pos, int n_heads, int n_kv_heads, int head_dim,
                        float *scratch, size_t scratch_stride, int n_threads) {
    kernels()->plain_attention(out, q, view, n_tokens, start_pos, n_heads, n_kv_heads,
                               head_dim, scratch, scratch_stride, n_threads);
}

kv_status kv_measure_bandwidth(size_t n_floats, int repeats, double *read_bytes_per_s,
                               double *triad_bytes_per_s, float *checksum) {
    return kernels()->measure_bandwidth(n_floats, repeats, read_bytes_per_s,
                                        triad_bytes_per_s, checksum);
}

kv_status kv_measure_attention_walk(int n_kv_heads, int head_dim, int context, int repeats,
                                    double *bytes_per_s, float *checksum) {
    return kernels()->measure_attention_walk(n_kv_heads, head_dim, context, repeats,
                                             bytes_per_s, checksum);
}

kv_status kv_measure_compute(int n_threads, int repeats, kv_compute_roof *roof) {
    return kernels()->measure_compute(n_threads, repeats, roof);
}

float kv_fast_dot(const float *a, const float *b, int n) { return kernels()->fast_dot(a, b, n); }
#endif /* KV_DISPATCH */
