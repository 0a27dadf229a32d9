/* store.c: one kind of cached tensor (K or V) in any element format.
 *
 * Rows are addressed by (layer, slot); the caches decide what a slot means (kvcache.c:
 * a position; paged.c: a row of a block). Each KV head of a row is stored apart (see
 * kv_store in kvlab.h), with its own codes and scales: an int8 head of 128 values with
 * one scale takes 128 bytes of codes plus 4 bytes of scale, against 512 bytes in fp32.
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

kv_status kv_store_describe(kv_store *store, kv_format format, int group, int n_layers,
                            size_t slots, int n_kv_heads, int head_dim) {
    kv_status status = KV_OK;
    memset(store, 0, sizeof *store);
    group = kv_store_group(format, group, head_dim);
    KV_CHECK(group >= 0 && n_layers > 0 && slots > 0 && n_kv_heads > 0, KV_ERR_INVALID_ARG);
    KV_CHECK(n_layers <= KV_MAX_LAYERS && (int64_t)n_kv_heads * head_dim <= KV_MAX_WIDTH,
             KV_ERR_INVALID_ARG);
    KV_CHECK(format != KV_FMT_I4 || head_dim % 2 == 0, KV_ERR_INVALID_ARG);
    store->format = format;
    store->group = group;
    store->n_layers = n_layers;
    store->n_kv_heads = n_kv_heads;
    store->head_dim = head_dim;
    store->groups_per_head = group ? head_dim / group : 0;
    store->head_bytes = code_bytes(format, (size_t)head_dim);
    store->slots = slots;
    size_t rows = (size_t)n_layers * (size_t)n_kv_heads * slots;   /* head rows */
    KV_CHECK(rows / ((size_t)n_layers * n_kv_heads) == slots &&
             rows <= ((size_t)1 << 40) / (store->head_bytes + 8 * (size_t)store->groups_per_head),
             KV_ERR_NOMEM);   /* no cache of a terabyte or more */
    return KV_OK;
fail:
    memset(store, 0, sizeof *store);
    return status;
}

kv_status kv_store_init(kv_store *store, kv_format format, int group, int n_layers,
                        size_t slots, int n_kv_heads, int head_dim) {
    kv_status status = kv_store_describe(store, format, group, n_layers, slots, n_kv_heads,
                                         head_dim);
    if (status != KV_OK) return status;
    size_t rows = (size_t)n_layers * (size_t)n_kv_heads * slots;   /* head rows */
    /* [quote ch02-kv-store-init-reserving-the-codes] */
    /* calloc: an unfilled slot reads as 0, never as old garbage, and the operating system
     * hands out zero pages only when they are first touched, so a large cache costs
     * physical memory as it fills (watch the process's resident size grow). */
    store->codes = calloc(rows, store->head_bytes);
    KV_CHECK(store->codes != NULL, KV_ERR_NOMEM);
    /* [end ch02-kv-store-init-reserving-the-codes] */
    if (has_scales(format)) {
        store->scales = calloc(rows * store->groups_per_head, sizeof(float));
        KV_CHECK(store->scales != NULL, KV_ERR_NOMEM);
    }
    if (format == KV_FMT_I4) {
        store->zeros = calloc(rows * store->groups_per_head, sizeof(float));
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

/* [quote ch02-kv-store-row-nbytes-and-kv-store-nbytes] */
size_t kv_store_row_nbytes(const kv_store *store) {
    size_t params = (has_scales(store->format) ? 1 : 0) + (store->format == KV_FMT_I4 ? 1 : 0);
    return (size_t)store->n_kv_heads *
           (store->head_bytes + params * store->groups_per_head * sizeof(float));
}

size_t kv_store_nbytes(const kv_store *store) {
    return (size_t)store->n_layers * store->slots * kv_store_row_nbytes(store);
}
/* [end ch02-kv-store-row-nbytes-and-kv-store-nbytes] */

#define head_index kv_store_head_index

/* Quantizes head_dim values into head row r. */
static void encode(const kv_store *store, size_t r, const float *x) {
    size_t n = (size_t)store->head_dim;
    uint8_t *codes = store->codes + r * store->head_bytes;
    float *scales = store->scales ? store->scales + r * store->groups_per_head : NULL;
    switch (store->format) {
        case KV_FMT_F32: memcpy(codes, x, n * sizeof(float)); break;
        case KV_FMT_F16: kv_quantize_f16((uint16_t *)codes, x, n); break;
        case KV_FMT_BF16: kv_quantize_bf16((uint16_t *)codes, x, n); break;
        case KV_FMT_I8: kv_quantize_i8((int8_t *)codes, scales, x, n, store->group); break;
        case KV_FMT_I4:
            kv_quantize_i4(codes, scales, store->zeros + r * store->groups_per_head, x, n,
                           store->group);
            break;
        case KV_FMT_FP8: kv_quantize_fp8(codes, scales, x, n, store->group); break;
    }
}

/* Dequantizes head row r into head_dim floats. */
static void decode(const kv_store *store, size_t r, float *out) {
    size_t n = (size_t)store->head_dim;
    const uint8_t *codes = store->codes + r * store->head_bytes;
    const float *scales = store->scales ? store->scales + r * store->groups_per_head : NULL;
    switch (store->format) {
        case KV_FMT_F32: memcpy(out, codes, n * sizeof(float)); break;
        case KV_FMT_F16: kv_dequantize_f16(out, (const uint16_t *)codes, n); break;
        case KV_FMT_BF16: kv_dequantize_bf16(out, (const uint16_t *)codes, n); break;
        case KV_FMT_I8: kv_dequantize_i8(out, (const int8_t *)codes, scales, n, store->group); break;
        case KV_FMT_I4:
            kv_dequantize_i4(out, codes, scales, store->zeros + r * store->groups_per_head, n,
                             store->group);
            break;
        case KV_FMT_FP8: kv_dequantize_fp8(out, codes, scales, n, store->group); break;
    }
}

void kv_store_write(const kv_store *store, int layer, size_t slot, const float *row) {
    for (int head = 0; head < store->n_kv_heads; head++)
        encode(store, head_index(store, layer, head, slot), row + (size_t)head * store->head_dim);
}

void kv_store_read(const kv_store *store, int layer, size_t slot, float *row) {
    for (int head = 0; head < store->n_kv_heads; head++)
        decode(store, head_index(store, layer, head, slot), row + (size_t)head * store->head_dim);
}

const float *kv_store_head(const kv_store *store, int layer, size_t slot, int head,
                           float *buffer) {
    size_t r = head_index(store, layer, head, slot);
    if (store->format == KV_FMT_F32) return (const float *)(store->codes + r * store->head_bytes);
    decode(store, r, buffer);
    return buffer;
}

void kv_store_copy_head(const kv_store *store, int layer, int head, size_t dst, size_t src,
                        size_t n_rows) {
    size_t per_head = (size_t)store->groups_per_head;
    size_t d = head_index(store, layer, head, dst), s = head_index(store, layer, head, src);
    /* memmove: a cache that drops rows moves later rows down over earlier ones */
    memmove(store->codes + d * store->head_bytes, store->codes + s * store->head_bytes,
            n_rows * store->head_bytes);
    if (store->scales)
        memmove(store->scales + d * per_head, store->scales + s * per_head,
                n_rows * per_head * sizeof(float));
    if (store->zeros)
        memmove(store->zeros + d * per_head, store->zeros + s * per_head,
                n_rows * per_head * sizeof(float));
}

void kv_store_copy(const kv_store *store, int layer, size_t dst, size_t src, size_t n_rows) {
    for (int head = 0; head < store->n_kv_heads; head++)
        kv_store_copy_head(store, layer, head, dst, src, n_rows);
}

size_t kv_store_widest(const kv_store *store) {
    size_t scales = (size_t)store->groups_per_head * sizeof(float);
    return store->head_bytes > scales ? store->head_bytes : scales;
}

void kv_turn_rings(void *base, size_t n_rings, size_t ring_length, size_t size, size_t by,
                   void *spare) {
    for (size_t k = 0; k < n_rings; k++) {
        uint8_t *ring = (uint8_t *)base + k * ring_length * size;
        memcpy(spare, ring, by * size);
        memmove(ring, ring + by * size, (ring_length - by) * size);
        memcpy(ring + (ring_length - by) * size, spare, by * size);
    }
}

void kv_store_turn(const kv_store *store, size_t by, void *spare) {
    size_t rings = (size_t)store->n_layers * store->n_kv_heads;
    size_t scales = (size_t)store->groups_per_head * sizeof(float);
    kv_turn_rings(store->codes, rings, store->slots, store->head_bytes, by, spare);
    if (store->scales) kv_turn_rings(store->scales, rings, store->slots, scales, by, spare);
    if (store->zeros) kv_turn_rings(store->zeros, rings, store->slots, scales, by, spare);
}

int kv_rows_to_keep_valid(const int32_t *rows, int n_layers, int n_keep, int n_kv_heads,
                          int length) {
    for (int layer = 0; layer < n_layers; layer++)
        for (int head = 0; head < n_kv_heads; head++) {
            int previous = -1;
            for (int i = 0; i < n_keep; i++) {
                int row = rows[((size_t)layer * n_keep + i) * n_kv_heads + head];
                int increasing = row > previous, inside = row < length;
                if (!increasing || !inside) return 0;
                previous = row;
            }
        }
    return 1;
}

int kv_rows_turn(const int32_t *rows, int n_layers, int n_keep, int n_kv_heads, int length) {
    int dropped = length - n_keep;
    int64_t stay_if_none = 0, stay_if_all = 0;
    for (int layer = 0; layer < n_layers; layer++)
        for (int i = 0; i < n_keep; i++)
            for (int head = 0; head < n_kv_heads; head++) {
                int row = rows[((size_t)layer * n_keep + i) * n_kv_heads + head];
                stay_if_none += row == i;
                stay_if_all += row == i + dropped;
            }
    return stay_if_all > stay_if_none ? dropped : 0;
}

void kv_window_keep(float *ring, int window, int kv_dim, int first_pos, const float *rows,
                    size_t row_stride, int n_tokens) {
    if (window <= 0) return;
    for (int t = n_tokens > window ? n_tokens - window : 0; t < n_tokens; t++)
        memcpy(kv_window_row(ring, window, kv_dim, first_pos + t), rows + (size_t)t * row_stride,
               (size_t)kv_dim * sizeof(float));
}
