/* variant_names.h: gives each kernel variant's functions names of their own.
 *
 * The default x86-64 and aarch64 builds compile the kernel files (KERNEL_SOURCES in
 * setup.py: ops.c, attention.c, weight_formats.c, plain.c, bandwidth.c, variant.c) several
 * times, once per instruction set, with -DKV_VARIANT=baseline, avx2 or avx512 (aarch64:
 * baseline or dotprod) and this header forced in first (-include). Each compilation then
 * defines kv_matmul_avx2 where the source says kv_matmul, and so on for every function those
 * files export, so that the sets link into one module side by side; calls between the
 * kernel files stay inside their own set.
 * dispatch.c defines the plain names, each passing its call to the set chosen at run time.
 *
 * Without KV_VARIANT (a build of one set, such as KVLAB_NATIVE=1 or tests/c's first build)
 * this header renames nothing. A function added to a kernel file and called from elsewhere
 * needs a line here, a field in dispatch.h's kv_kernel_table, its entry in variant.c and its
 * wrapper in dispatch.c; the linker names any that is missing (a symbol defined once per
 * variant, or not at all).
 */
#ifndef KVLAB_VARIANT_NAMES_H
#define KVLAB_VARIANT_NAMES_H

#ifdef KV_VARIANT
#define KV_PASTE_(name, variant) name##_##variant
#define KV_PASTE(name, variant) KV_PASTE_(name, variant)
#define KV_VARIANT_NAME(name) KV_PASTE(name, KV_VARIANT)

/* ops.c */
#define kv_matmul KV_VARIANT_NAME(kv_matmul)
#define kv_matmul_many KV_VARIANT_NAME(kv_matmul_many)
#define kv_matmul_four_rows KV_VARIANT_NAME(kv_matmul_four_rows)
#define kv_packed_tokens_alloc KV_VARIANT_NAME(kv_packed_tokens_alloc)
#define kv_pack_tokens KV_VARIANT_NAME(kv_pack_tokens)
#define kv_rmsnorm KV_VARIANT_NAME(kv_rmsnorm)
#define kv_rope KV_VARIANT_NAME(kv_rope)
#define kv_softmax_tile KV_VARIANT_NAME(kv_softmax_tile)
#define kv_softmax_tile8 KV_VARIANT_NAME(kv_softmax_tile8)
#define kv_swiglu KV_VARIANT_NAME(kv_swiglu)
#define kv_argmax KV_VARIANT_NAME(kv_argmax)
/* attention.c */
#define kv_attention KV_VARIANT_NAME(kv_attention)
#define kv_attention_scratch KV_VARIANT_NAME(kv_attention_scratch)
/* weight_formats.c */
#define kv_weights_scratch_floats KV_VARIANT_NAME(kv_weights_scratch_floats)
#define kv_matmul_weights KV_VARIANT_NAME(kv_matmul_weights)
#define kv_matmul_int8 KV_VARIANT_NAME(kv_matmul_int8)
#define kv_matmul_int8_many KV_VARIANT_NAME(kv_matmul_int8_many)
#define kv_weights_matmul KV_VARIANT_NAME(kv_weights_matmul)
#define kv_weights_matmul_int8 KV_VARIANT_NAME(kv_weights_matmul_int8)
/* plain.c */
#define kv_plain_dot KV_VARIANT_NAME(kv_plain_dot)
#define kv_plain_matmul KV_VARIANT_NAME(kv_plain_matmul)
#define kv_plain_matmul_weights KV_VARIANT_NAME(kv_plain_matmul_weights)
#define kv_plain_matmul_int8 KV_VARIANT_NAME(kv_plain_matmul_int8)
#define kv_plain_rmsnorm KV_VARIANT_NAME(kv_plain_rmsnorm)
#define kv_plain_rope KV_VARIANT_NAME(kv_plain_rope)
#define kv_plain_swiglu KV_VARIANT_NAME(kv_plain_swiglu)
#define kv_plain_attention KV_VARIANT_NAME(kv_plain_attention)
/* bandwidth.c */
#define kv_measure_bandwidth KV_VARIANT_NAME(kv_measure_bandwidth)
#define kv_measure_attention_walk KV_VARIANT_NAME(kv_measure_attention_walk)
#define kv_measure_compute KV_VARIANT_NAME(kv_measure_compute)
/* variant.c */
#define kv_fast_dot KV_VARIANT_NAME(kv_fast_dot)
#define kv_variant_kernels KV_VARIANT_NAME(kv_variant_kernels)
#endif

#endif /* KVLAB_VARIANT_NAMES_H */
