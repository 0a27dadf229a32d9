/* dispatch.h: kernel variants, one per instruction set, and the choice among them (internal).
 *
 * The hot kernels (ops.c, attention.c, weight_formats.c, bandwidth.c) and their plain twins
 * (plain.c) are the same C for every CPU; what differs is the instructions the compiler may
 * use: SSE2 on any x86-64 (the baseline), AVX2 with fused multiply-adds, AVX-512 with VNNI's
 * int8 dot products; on aarch64, NEON (every aarch64 CPU's) or NEON with ARMv8.2's int8 dot
 * products (sdot). The default x86-64 and aarch64 builds compile those files once per
 * instruction set (variant_names.h gives each set its own names) and dispatch.c picks, once
 * when the module loads, the best set this CPU runs: one wheel, fast on a new CPU and
 * working on an old one. A build of one set (KVLAB_NATIVE=1, KVLAB_PORTABLE=1, or a CPU
 * other than these two) has a single variant and no choice to make.
 *
 * The plain tier is in every variant: it is the specification of each variant's bits (its
 * multiply-adds are fused exactly where the fast tier's are), so each variant is tested
 * against its own plain tier, bit for bit (tests/c, tests/test_bits.py).
 */
#ifndef KVLAB_DISPATCH_H
#define KVLAB_DISPATCH_H

#include "attention.h"
#include "kvlab.h"
#include "ops.h"
#include "plain.h"
#include "weight_formats.h"

/* The fast tier's dot product (simd.h's kv_dot, which every kernel inlines) as a function
 * of its variant, for the tests that compare it with kv_plain_dot (variant.c). */
float kv_fast_dot(const float *a, const float *b, int n);

/* One variant's kernels: every function of the kernel files that the rest of the core (or
 * a test) calls, as that variant compiled it (variant.c fills it in). */
typedef struct {
    const char *name;            /* "baseline", "avx2", "avx512"; "dotprod" (aarch64);
                                    "native" for KVLAB_NATIVE=1 */
    int fused_multiply_add;      /* whether its multiply-adds round once (built with FMA) */
    int packed_inputs;           /* which products pack their input (ops.h's KV_PACKS_) */
    __typeof__(kv_matmul) *matmul;
    __typeof__(kv_matmul_many) *matmul_many;
    __typeof__(kv_matmul_four_rows) *matmul_four_rows;
    __typeof__(kv_rmsnorm) *rmsnorm;
    __typeof__(kv_rope) *rope;
    __typeof__(kv_softmax_tile) *softmax_tile;
    __typeof__(kv_softmax_tile8) *softmax_tile8;
    __typeof__(kv_swiglu) *swiglu;
    __typeof__(kv_argmax) *argmax;
    __typeof__(kv_attention) *attention;
    __typeof__(kv_attention_scratch) *attention_scratch;
    __typeof__(kv_weights_scratch_floats) *weights_scratch_floats;
    __typeof__(kv_matmul_weights) *matmul_weights;
    __typeof__(kv_matmul_int8) *matmul_int8;
    __typeof__(kv_matmul_int8_many) *matmul_int8_many;
    __typeof__(kv_weights_matmul) *weights_matmul;
    __typeof__(kv_weights_matmul_int8) *weights_matmul_int8;
    __typeof__(kv_plain_dot) *plain_dot;
    __typeof__(kv_plain_matmul) *plain_matmul;
    __typeof__(kv_plain_matmul_weights) *plain_matmul_weights;
    __typeof__(kv_plain_matmul_int8) *plain_matmul_int8;
    __typeof__(kv_plain_rmsnorm) *plain_rmsnorm;
    __typeof__(kv_plain_rope) *plain_rope;
    __typeof__(kv_plain_swiglu) *plain_swiglu;
    __typeof__(kv_plain_attention) *plain_attention;
    __typeof__(kv_measure_bandwidth) *measure_bandwidth;
    __typeof__(kv_measure_attention_walk) *measure_attention_walk;
    __typeof__(kv_measure_compute) *measure_compute;
    __typeof__(kv_fast_dot) *fast_dot;
} kv_kernel_table;

/* This compilation's table (variant.c): kv_variant_kernels_avx2 and so on in a build of
 * several variants, where dispatch.c names each. */
extern const kv_kernel_table kv_variant_kernels;

/* A variant this build has: its kernels, and what a CPU needs to run them. */
typedef struct {
    const kv_kernel_table *kernels;
    const char *needs;           /* the instruction sets, in words ("AVX2, FMA and F16C") */
    int (*cpu_has)(void);        /* whether this CPU (and its OS) runs them; NULL: any does */
} kv_variant;

/* The variants this build has, best first (the last is the one every CPU runs), and their
 * number in *count (at most KV_MAX_VARIANTS). */
#define KV_MAX_VARIANTS 4
const kv_variant *kv_variants(int *count);

/* The variant whose kernels run now: the best one this CPU has, from the moment the core is
 * loaded, unless kv_use_variant chose another. */
const kv_variant *kv_current_variant(void);

/* Runs every later kernel call on the variant of that name; NULL: the best this CPU has.
 * KV_ERR_INVALID_ARG (nothing changes) for a name this build does not have or a variant this
 * CPU cannot run. Like kv_set_kernels, for the start of a program or a test: calls already
 * running may mix the two variants' bits. */
kv_status kv_use_variant(const char *name);

#endif /* KVLAB_DISPATCH_H */
