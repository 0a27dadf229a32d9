/* store.c: one kind of cached tensor (K or V) in any element format.
 *
 * Rows are addressed by (layer, slot); the caches decide what a slot means (kvcache.c:
 * a position; paged.c: a row of a block). A row's codes are contiguous, and so are its
 * scales: int8 rows of 8 heads x 128 values with one scale per head take 1,024 bytes of
 * codes plus 32 bytes of scales, against 4,096 bytes in fp32.
 */
#include <string.h>

#include "common.h"
#include "quant.h"
#include "store.h"

static int has_scales(kv_format format) {
    return format == KV_FMT_I8 || format == KV_FMT_I4 || format == KV_FMT_FP8;
}

/* bytes of codes for n values */
static size_t code_bytes(kv_format format, size_t n) {
    switch (format) {
        case KV_FMT_F32: return 4 * n;
        case KV_FMT_F16:
        case KV_FMT_BF16: return 2 * n;
        case KV_FMT_I8:
        case KV_FMT_FP8: return n;
        case KV_FMT_I4: return n / 2;
    }
    return 0;
}

int kv_store_group(kv_format format, int group, int head_dim) {
    if (format < KV_FMT_F32 || format > KV_FMT_FP8 || head_dim <= 0) return -1;
    if (!has_scales(format)) return group == 0 ? 0 : -1;
    if (group == 0) {
        if (format != KV_FMT_I4) return head_dim;
        group = head_dim % 32 == 0 ? 32 : head_dim;
    }
    if (group < 1 || head_dim % group != 0) return -1;
    if (format == KV_FMT_I4 && group % 2 != 0) return -1;
    return group;
}

kv_status kv_store_init(kv_store *store, kv_format format, int group, int n_layers,
                        size_t slots, int n_kv_heads, int head_dim) {
    kv_status status = KV_OK;
    memset(store, 0, sizeof *store);
    group = kv_store_group(format, group, head_dim);
    KV_CHECK(group >= 0 && n_layers > 0 && slots > 0 && n_kv_heads > 0, KV_ERR_INVALID_ARG);
    KV_CHECK(n_layers <= KV_MAX_LAYERS && (long)n_kv_heads * head_dim <= KV_MAX_WIDTH,
             KV_ERR_INVALID_ARG);
    store->format = format;
    store->group = group;
    store->kv_dim = n_kv_heads * head_dim;
    store->groups_per_row = group ? store->kv_dim / group : 0;
    store->row_bytes = code_bytes(format, (size_t)store->kv_dim);
    store->slots = slots;
    store->n_layers = n_layers;
    size_t rows = (size_t)n_layers * slots;
    KV_CHECK(rows / (size_t)n_layers == slots &&
             rows <= ((size_t)1 << 40) / (store->row_bytes + 8 * (size_t)store->groups_per_row),
             KV_ERR_NOMEM);   /* no cache of a terabyte or more */
    /* calloc: an unfilled slot reads as 0, never as old garbage, and the operating system
     * hands out zero pages only when they are first touched, so a large cache costs
     * physical memory as it fills (watch the process's resident size grow). */
    store->codes = calloc(rows, store->row_bytes);
    KV_CHECK(store->codes != NULL, KV_ERR_NOMEM);
    if (has_scales(format)) {
        store->scales = calloc(rows * store->groups_per_row, sizeof(float));
        KV_CHECK(store->scales != NULL, KV_ERR_NOMEM);
    }
    if (format == KV_FMT_I4) {
        store->zeros = calloc(rows * store->groups_per_row, sizeof(float));
        KV_CHECK(store->zeros != NULL, KV_ERR_NOMEM);
    }
    return KV_OK;
fail:
    kv_store_free(store);
    return status;
}

void kv_store_free(kv_store *store) {
    if (store == NULL) return;
    free(store->codes);
    free(store->scales);
    free(store->zeros);
    memset(store, 0, sizeof *store);
}

size_t kv_store_row_nbytes(const kv_store *store) {
    size_t params = (store->scales ? 1 : 0) + (store->zeros ? 1 : 0);
    return store->row_bytes + params * store->groups_per_row * sizeof(float);
}

size_t kv_store_nbytes(const kv_store *store) {
    return (size_t)store->n_layers * store->slots * kv_store_row_nbytes(store);
}

static size_t row_index(const kv_store *store, int layer, size_t slot) {
    return (size_t)layer * store->slots + slot;
}

void kv_store_write(const kv_store *store, int layer, size_t slot, const float *row) {
    size_t r = row_index(store, layer, slot), n = (size_t)store->kv_dim;
    uint8_t *codes = store->codes + r * store->row_bytes;
    float *scales = store->scales ? store->scales + r * store->groups_per_row : NULL;
    switch (store->format) {
        case KV_FMT_F32: memcpy(codes, row, n * sizeof(float)); break;
        case KV_FMT_F16: kv_quantize_f16((uint16_t *)codes, row, n); break;
        case KV_FMT_BF16: kv_quantize_bf16((uint16_t *)codes, row, n); break;
        case KV_FMT_I8: kv_quantize_i8((int8_t *)codes, scales, row, n, store->group); break;
        case KV_FMT_I4:
            kv_quantize_i4(codes, scales, store->zeros + r * store->groups_per_row, row, n,
                           store->group);
            break;
        case KV_FMT_FP8: kv_quantize_fp8(codes, scales, row, n, store->group); break;
    }
}

/* n values starting at value `first` of row r, decoded into out (first and n are whole
 * groups, and even for int4) */
static void decode(const kv_store *store, size_t r, size_t first, size_t n, float *out) {
    const uint8_t *codes = store->codes + r * store->row_bytes;
    size_t group_index = store->group ? first / store->group : 0;
    const float *scales = store->scales ? store->scales + r * store->groups_per_row + group_index
                                        : NULL;
    switch (store->format) {
        case KV_FMT_F32: memcpy(out, (const float *)codes + first, n * sizeof(float)); break;
        case KV_FMT_F16: kv_dequantize_f16(out, (const uint16_t *)codes + first, n); break;
        case KV_FMT_BF16: kv_dequantize_bf16(out, (const uint16_t *)codes + first, n); break;
        case KV_FMT_I8:
            kv_dequantize_i8(out, (const int8_t *)codes + first, scales, n, store->group);
            break;
        case KV_FMT_I4:
            kv_dequantize_i4(out, codes + first / 2, scales,
                             store->zeros + r * store->groups_per_row + group_index, n,
                             store->group);
            break;
        case KV_FMT_FP8: kv_dequantize_fp8(out, codes + first, scales, n, store->group); break;
    }
}

void kv_store_read(const kv_store *store, int layer, size_t slot, float *row) {
    decode(store, row_index(store, layer, slot), 0, (size_t)store->kv_dim, row);
}

const float *kv_store_head(const kv_store *store, int layer, size_t slot, int head,
                           int head_dim, float *buffer) {
    size_t r = row_index(store, layer, slot), first = (size_t)head * head_dim;
    if (store->format == KV_FMT_F32)
        return (const float *)(store->codes + r * store->row_bytes) + first;
    decode(store, r, first, (size_t)head_dim, buffer);
    return buffer;
}

void kv_store_copy(const kv_store *store, int layer, size_t dst, size_t src, size_t n_rows) {
    size_t d = row_index(store, layer, dst), s = row_index(store, layer, src);
    memcpy(store->codes + d * store->row_bytes, store->codes + s * store->row_bytes,
           n_rows * store->row_bytes);
    size_t per_row = (size_t)store->groups_per_row;
    if (store->scales)
        memcpy(store->scales + d * per_row, store->scales + s * per_row,
               n_rows * per_row * sizeof(float));
    if (store->zeros)
        memcpy(store->zeros + d * per_row, store->zeros + s * per_row,
               n_rows * per_row * sizeof(float));
}

void kv_window_keep(float *ring, int window, int kv_dim, int first_pos, const float *rows,
                    size_t row_stride, int n_tokens) {
    if (window <= 0) return;
    for (int t = n_tokens > window ? n_tokens - window : 0; t < n_tokens; t++)
        memcpy(kv_window_row(ring, window, kv_dim, first_pos + t), rows + (size_t)t * row_stride,
               (size_t)kv_dim * sizeof(float));
}
