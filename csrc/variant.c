/* variant.c: one variant's table of kernels (dispatch.h), compiled with the kernel files.
 *
 * In the default x86-64 build this file is compiled once per instruction set, like ops.c
 * and the other kernel files, and each compilation's table lists that variant's functions
 * (kv_matmul_avx2 ... : variant_names.h renames them). In a build of one set it lists the
 * one set of kernels, under their own names. dispatch.c chooses among the tables.
 */
#include "dispatch.h"
#include "simd.h"

/* The name the build gave this variant: -DKV_VARIANT=avx2, or for a build of one set
 * -DKV_SINGLE_VARIANT=native (KVLAB_NATIVE=1); else the compiler's default target. */
#define KV_STRING_(x) #x
#define KV_STRING(x) KV_STRING_(x)
#if defined(KV_VARIANT)
#define KV_THIS_VARIANT KV_STRING(KV_VARIANT)
#elif defined(KV_SINGLE_VARIANT)
#define KV_THIS_VARIANT KV_STRING(KV_SINGLE_VARIANT)
#else
#define KV_THIS_VARIANT "baseline"
#endif

float kv_fast_dot(const float *a, const float *b, int n) { return kv_dot(a, b, n); }

const kv_kernel_table kv_variant_kernels = {
    .name = KV_THIS_VARIANT,
#ifdef __FMA__   /* simd.h's madd and plain.c's multiply_add fuse exactly then */
    .fused_multiply_add = 1,
#else
    .fused_multiply_add = 0,
#endif
    .packed_inputs = KV_PACKED_INPUTS,
    .matmul = kv_matmul,
    .matmul_many = kv_matmul_many,
    .matmul_four_rows = kv_matmul_four_rows,
    .rmsnorm = kv_rmsnorm,
    .rope = kv_rope,
    .softmax_tile = kv_softmax_tile,
    .softmax_tile8 = kv_softmax_tile8,
    .swiglu = kv_swiglu,
    .argmax = kv_argmax,
    .attention = kv_attention,
    .attention_scratch = kv_attention_scratch,
    .weights_scratch_floats = kv_weights_scratch_floats,
    .matmul_weights = kv_matmul_weights,
    .matmul_int8 = kv_matmul_int8,
    .matmul_int8_many = kv_matmul_int8_many,
    .weights_matmul = kv_weights_matmul,
    .weights_matmul_int8 = kv_weights_matmul_int8,
    .plain_dot = kv_plain_dot,
    .plain_matmul = kv_plain_matmul,
    .plain_matmul_weights = kv_plain_matmul_weights,
    .plain_matmul_int8 = kv_plain_matmul_int8,
    .plain_rmsnorm = kv_plain_rmsnorm,
    .plain_rope = kv_plain_rope,
    .plain_swiglu = kv_plain_swiglu,
    .plain_attention = kv_plain_attention,
    .measure_bandwidth = kv_measure_bandwidth,
    .measure_attention_walk = kv_measure_attention_walk,
    .measure_compute = kv_measure_compute,
    .fast_dot = kv_fast_dot,
};
