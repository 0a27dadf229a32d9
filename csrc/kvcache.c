/* kvcache.c: the contiguous KV cache, one block of memory per request.
 *
 * Layout (n_layers, capacity, n_kv_heads, head_dim) for K and again for V: the keys of
 * one layer for consecutive positions are consecutive rows, so the forward pass writes
 * a new token's K straight into its slot with the projection's matrix product, and
 * attention streams one layer's keys front to back. The whole capacity is reserved up
 * front; that waste is exactly what the paged cache (paged.c) exists to remove.
 */
#include <string.h>

#include "common.h"

kv_status kv_cache_init(kv_cache *cache, int n_layers, int n_kv_heads, int head_dim,
                        int capacity) {
    kv_status status = KV_OK;
    memset(cache, 0, sizeof *cache);
    KV_CHECK(n_layers > 0 && n_kv_heads > 0 && head_dim > 0 && capacity > 0,
             KV_ERR_INVALID_ARG);
    KV_CHECK(n_layers <= KV_MAX_LAYERS && (long)n_kv_heads * head_dim <= KV_MAX_WIDTH &&
             capacity <= KV_MAX_POSITIONS, KV_ERR_INVALID_ARG);
    size_t count = (size_t)n_layers * (size_t)capacity * (size_t)n_kv_heads * (size_t)head_dim;
    KV_CHECK(count / (size_t)n_layers / (size_t)capacity == (size_t)n_kv_heads * head_dim,
             KV_ERR_INVALID_ARG);  /* overflow */
    KV_CHECK(count <= ((size_t)1 << 40) / sizeof(float), KV_ERR_NOMEM);
    cache->n_layers = n_layers;
    cache->n_kv_heads = n_kv_heads;
    cache->head_dim = head_dim;
    cache->capacity = capacity;
    cache->length = 0;
    /* calloc: an unfilled slot reads as 0, never as old garbage, and the operating system
     * hands out zero pages only when they are first touched, so a large cache costs
     * physical memory as it fills (watch the process's resident size grow). */
    cache->key = calloc(count, sizeof(float));
    cache->value = calloc(count, sizeof(float));
    KV_CHECK(cache->key != NULL && cache->value != NULL, KV_ERR_NOMEM);
    return KV_OK;
fail:
    kv_cache_free(cache);
    return status;
}

void kv_cache_free(kv_cache *cache) {
    if (cache == NULL) return;
    free(cache->key);
    free(cache->value);
    cache->key = cache->value = NULL;
    cache->length = cache->capacity = 0;
}

size_t kv_cache_nbytes(const kv_cache *cache) {
    return 2 * (size_t)cache->n_layers * (size_t)cache->capacity *
           (size_t)cache->n_kv_heads * (size_t)cache->head_dim * sizeof(float);
}

kv_status kv_cache_truncate(kv_cache *cache, int length) {
    /* Positions past `length` become free again; their bytes are simply overwritten
     * by the next tokens, since attention never reads past cache->length. */
    if (length < 0 || length > cache->length) return KV_ERR_INVALID_ARG;
    cache->length = length;
    return KV_OK;
}

kv_status kv_cache_append(kv_cache *cache, int n_tokens, const float *keys, const float *values) {
    if (cache->key == NULL || keys == NULL || values == NULL || n_tokens <= 0)
        return KV_ERR_INVALID_ARG;
    if (n_tokens > cache->capacity - cache->length) return KV_ERR_CACHE_FULL;
    size_t row = (size_t)cache->n_kv_heads * cache->head_dim;
    for (int layer = 0; layer < cache->n_layers; layer++) {
        for (int t = 0; t < n_tokens; t++) {
            size_t dst = ((size_t)layer * cache->capacity + cache->length + t) * row;
            size_t src = ((size_t)t * cache->n_layers + layer) * row;
            memcpy(cache->key + dst, keys + src, row * sizeof(float));
            memcpy(cache->value + dst, values + src, row * sizeof(float));
        }
    }
    cache->length += n_tokens;
    return KV_OK;
}

kv_status kv_cache_check_fits(const kv_cache *cache, const kv_config *config) {
    if (cache->key == NULL || cache->n_layers != config->n_layers ||
        cache->n_kv_heads != config->n_kv_heads || cache->head_dim != config->head_dim)
        return KV_ERR_CACHE_MISMATCH;
    return KV_OK;
}
