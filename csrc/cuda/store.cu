/* store.cu: the cache's storage on the GPU: writes through a slot mapping, reads, copies,
 * and puts back rows read before (a swap).
 *
 * A kv_store (kvlab.h) here has its codes and scales in device memory, laid out as on the
 * CPU: (n_layers, n_kv_heads, slots, head_bytes), so one KV head's rows for consecutive
 * slots are consecutive, which is what lets attention stream them. The cache write is the
 * moment a token's K or V is quantized, as in csrc/store.c; where a row goes is given by a
 * slot mapping, one slot per new token, worked out on the host from the block table (or,
 * for a contiguous cache, the position itself). Slot -1 means "leave it": the row is in a
 * block another sequence shares, which already holds it. This file does no attention.
 */
#include <string.h>

#include "common.cuh"

static int has_scales(kv_format format) { return format == KV_FMT_I8; }

static size_t bytes_per_value(kv_format format) {
    switch (format) {
        case KV_FMT_F32: return 4;
        case KV_FMT_F16:
        case KV_FMT_BF16: return 2;
        case KV_FMT_I8: return 1;
        default: return 0;   /* int4 and fp8 have no GPU kernels */
    }
}

extern "C" kv_cuda_err kv_cuda_store_init(kv_store *store, kv_format format, int group,
                                          int n_layers, size_t slots, int n_kv_heads,
                                          int head_dim) {
    kv_cuda_err err = 0;
    memset(store, 0, sizeof *store);
    int grouped = has_scales(format);
    if (bytes_per_value(format) == 0 || n_layers <= 0 || n_kv_heads <= 0 || slots == 0 ||
        head_dim <= 0 || head_dim % 8 != 0 || head_dim > KV_CUDA_MAX_HEAD_DIM ||
        (grouped && (group < 8 || group % 8 != 0 || head_dim % group != 0)) ||
        (!grouped && group != 0) || slots > ((size_t)1 << 32))
        return KV_CUDA_INVALID_VALUE;
    store->format = format;
    store->group = group;
    store->n_layers = n_layers;
    store->n_kv_heads = n_kv_heads;
    store->head_dim = head_dim;
    store->groups_per_head = grouped ? head_dim / group : 0;
    store->head_bytes = bytes_per_value(format) * (size_t)head_dim;
    store->slots = slots;
    size_t rows = (size_t)n_layers * n_kv_heads * slots;   /* head rows */
    KV_CUDA_TRY(kv_cuda_alloc((void **)&store->codes, rows * store->head_bytes));
    if (grouped)
        KV_CUDA_TRY(kv_cuda_alloc((void **)&store->scales,
                                  rows * store->groups_per_head * sizeof(float)));
    return 0;
fail:
    kv_cuda_store_free(store);
    return err;
}

extern "C" void kv_cuda_store_free(kv_store *store) {
    kv_cuda_free(store->codes);
    kv_cuda_free(store->scales);
    memset(store, 0, sizeof *store);
}

extern "C" size_t kv_cuda_store_nbytes(const kv_store *store) {
    size_t rows = (size_t)store->n_layers * store->n_kv_heads * store->slots;
    return rows * (store->head_bytes + (size_t)store->groups_per_head * sizeof(float));
}

static __device__ __forceinline__ size_t head_row_of(const kv_store &s, int layer, int head,
                                                     size_t slot) {
    return ((size_t)layer * s.n_kv_heads + head) * s.slots + slot;
}

/* One thread per (row, KV head, chunk): a chunk is one int8 group (it shares a scale, so one
 * thread must see all of it), or 8 values of a float format, converted one by one. */
__global__ void store_write_kernel(kv_store s, int layer, const float *__restrict__ rows,
                                   size_t row_stride, const int64_t *__restrict__ slots,
                                   int n_rows, int chunk) {
    int chunks_per_head = s.head_dim / chunk;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * s.n_kv_heads * chunks_per_head) return;
    int c = (int)(i % chunks_per_head);
    int head = (int)(i / chunks_per_head % s.n_kv_heads);
    int t = (int)(i / chunks_per_head / s.n_kv_heads);
    int64_t slot = slots[t];
    if (slot < 0) return;
    const float *x = rows + (size_t)t * row_stride + (size_t)head * s.head_dim + (size_t)c * chunk;
    size_t head_row = head_row_of(s, layer, head, (size_t)slot);
    uint8_t *codes = s.codes + head_row * s.head_bytes;
    int d0 = c * chunk;
    switch (s.format) {
        case KV_FMT_F32:
            for (int j = 0; j < chunk; j++) ((float *)codes)[d0 + j] = x[j];
            break;
        case KV_FMT_F16:
            for (int j = 0; j < chunk; j++) ((uint16_t *)codes)[d0 + j] = f32_to_f16(x[j]);
            break;
        case KV_FMT_BF16:
            for (int j = 0; j < chunk; j++) ((uint16_t *)codes)[d0 + j] = f32_to_bf16(x[j]);
            break;
        case KV_FMT_I8:
            encode_i8((int8_t *)codes + d0, s.scales + head_row * s.groups_per_head + c, x, chunk);
            break;
        default:
            break;
    }
}

extern "C" kv_cuda_err kv_cuda_store_write(const kv_store *store, int layer, const float *rows,
                                           size_t row_stride, const int64_t *slots, int n_rows) {
    if (n_rows <= 0) return 0;
    int chunk = has_scales(store->format) ? store->group : 8;
    size_t threads = (size_t)n_rows * store->n_kv_heads * (store->head_dim / chunk);
    store_write_kernel<<<blocks_for(threads, 128), 128>>>(*store, layer, rows, row_stride, slots,
                                                           n_rows, chunk);
    return KV_CUDA_LAUNCHED();
}

/* One thread per (layer, row, KV head): copies the head row's codes (8 bytes at a time:
 * head_bytes is a multiple of 8) and its scales. Thread i writes output row i, since the
 * output is (n_layers, n_rows, n_kv_heads, ...) in that order. */
__global__ void store_read_kernel(kv_store s, const int64_t *__restrict__ slots, int n_rows,
                                  uint8_t *__restrict__ codes, float *__restrict__ scales) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)s.n_layers * n_rows * s.n_kv_heads) return;
    int head = (int)(i % s.n_kv_heads);
    int row = (int)(i / s.n_kv_heads % n_rows);
    int layer = (int)(i / s.n_kv_heads / n_rows);
    size_t head_row = head_row_of(s, layer, head, (size_t)slots[row]);
    const uint2 *from = (const uint2 *)(s.codes + head_row * s.head_bytes);
    uint2 *to = (uint2 *)(codes + i * s.head_bytes);
    for (size_t j = 0; j < s.head_bytes / 8; j++) to[j] = from[j];
    for (int g = 0; scales != NULL && g < s.groups_per_head; g++)
        scales[i * s.groups_per_head + g] = s.scales[head_row * s.groups_per_head + g];
}

extern "C" kv_cuda_err kv_cuda_store_read(const kv_store *store, const int64_t *slots, int n_rows,
                                          uint8_t *codes, float *scales) {
    if (n_rows <= 0) return 0;
    size_t threads = (size_t)store->n_layers * n_rows * store->n_kv_heads;
    store_read_kernel<<<blocks_for(threads, 128), 128>>>(*store, slots, n_rows, codes,
                                                          store->scales ? scales : NULL);
    return KV_CUDA_LAUNCHED();
}

/* store_read_kernel backwards: thread i's input row (n_layers, n_rows, n_kv_heads order)
 * goes, codes and scales as they are, to its slot. Swapping a sequence back in. */
__global__ void store_put_kernel(kv_store s, const int64_t *__restrict__ slots, int n_rows,
                                 const uint8_t *__restrict__ codes,
                                 const float *__restrict__ scales) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)s.n_layers * n_rows * s.n_kv_heads) return;
    int head = (int)(i % s.n_kv_heads);
    int row = (int)(i / s.n_kv_heads % n_rows);
    int layer = (int)(i / s.n_kv_heads / n_rows);
    size_t head_row = head_row_of(s, layer, head, (size_t)slots[row]);
    const uint2 *from = (const uint2 *)(codes + i * s.head_bytes);
    uint2 *to = (uint2 *)(s.codes + head_row * s.head_bytes);
    for (size_t j = 0; j < s.head_bytes / 8; j++) to[j] = from[j];
    for (int g = 0; scales != NULL && g < s.groups_per_head; g++)
        s.scales[head_row * s.groups_per_head + g] = scales[i * s.groups_per_head + g];
}

extern "C" kv_cuda_err kv_cuda_store_put(const kv_store *store, const int64_t *slots, int n_rows,
                                         const uint8_t *codes, const float *scales) {
    if (n_rows <= 0) return 0;
    size_t threads = (size_t)store->n_layers * n_rows * store->n_kv_heads;
    store_put_kernel<<<blocks_for(threads, 128), 128>>>(*store, slots, n_rows, codes,
                                                         store->scales ? scales : NULL);
    return KV_CUDA_LAUNCHED();
}

/* One thread per (layer, KV head, row): copy-on-write of a partly filled block copies its
 * first rows, in every layer and head, to the sequence's own new block. */
__global__ void store_copy_kernel(kv_store s, size_t dst, size_t src, size_t n_rows) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)s.n_layers * s.n_kv_heads * n_rows) return;
    size_t row = i % n_rows, layer_head = i / n_rows;   /* (layer * n_kv_heads + head) */
    size_t to = layer_head * s.slots + dst + row, from = layer_head * s.slots + src + row;
    const uint2 *a = (const uint2 *)(s.codes + from * s.head_bytes);
    uint2 *b = (uint2 *)(s.codes + to * s.head_bytes);
    for (size_t j = 0; j < s.head_bytes / 8; j++) b[j] = a[j];
    for (int g = 0; g < s.groups_per_head; g++)
        s.scales[to * s.groups_per_head + g] = s.scales[from * s.groups_per_head + g];
}

extern "C" kv_cuda_err kv_cuda_store_copy(const kv_store *store, size_t dst, size_t src,
                                          size_t n_rows) {
    if (n_rows == 0) return 0;
    if (dst + n_rows > store->slots || src + n_rows > store->slots) return KV_CUDA_INVALID_VALUE;
    size_t threads = (size_t)store->n_layers * store->n_kv_heads * n_rows;
    store_copy_kernel<<<blocks_for(threads, 128), 128>>>(*store, dst, src, n_rows);
    return KV_CUDA_LAUNCHED();
}

static __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* Pseudo-random values in [-1, 1) for every value of every slot: int8 gets random codes and
 * a scale per group, the float formats the codes of random floats. A grid-stride loop, since
 * a benchmark's store can hold billions of values. */
__global__ void store_fill_kernel(kv_store s, uint64_t seed) {
    size_t chunks_per_row = (size_t)s.head_dim / 8;
    size_t total = (size_t)s.n_layers * s.n_kv_heads * s.slots * chunks_per_row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t head_row = i / chunks_per_row;
        int d0 = (int)(i % chunks_per_row) * 8;
        uint8_t *codes = s.codes + head_row * s.head_bytes;
        for (int j = 0; j < 8; j++) {
            uint64_t h = splitmix64(seed ^ (i * 8 + j));
            float x = (float)(h >> 40) * 0x1p-23f - 1.0f;   /* 24 random bits -> [-1, 1) */
            switch (s.format) {
                case KV_FMT_F32: ((float *)codes)[d0 + j] = x; break;
                case KV_FMT_F16: ((uint16_t *)codes)[d0 + j] = f32_to_f16(x); break;
                case KV_FMT_BF16: ((uint16_t *)codes)[d0 + j] = f32_to_bf16(x); break;
                case KV_FMT_I8: ((int8_t *)codes)[d0 + j] = (int8_t)((int)(h % 255) - 127); break;
                default: break;
            }
        }
        if (s.format == KV_FMT_I8 && d0 % s.group == 0)
            s.scales[head_row * s.groups_per_head + d0 / s.group] =
                0.01f * (1.0f + (float)(splitmix64(~seed ^ i) >> 40) * 0x1p-24f);
    }
}

extern "C" kv_cuda_err kv_cuda_store_fill_random(const kv_store *store, uint64_t seed) {
    size_t total = (size_t)store->n_layers * store->n_kv_heads * store->slots * (store->head_dim / 8);
    unsigned blocks = blocks_for(total, 256);
    if (blocks > 65536) blocks = 65536;
    store_fill_kernel<<<blocks, 256>>>(*store, seed);
    return KV_CUDA_LAUNCHED();
}
