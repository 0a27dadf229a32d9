/* kvlab.h: the public C API of kvlab's inference core.
 *
 * Plain C11, no Python: a model is a config plus pointers into weight buffers that the
 * caller owns (NumPy arrays, a memory-mapped checkpoint ...), and a KV cache is memory
 * this core owns. Every function that can fail returns a kv_status; nothing here prints,
 * exits or touches Python. The Python binding (_kvlab.c) is the only layer above this.
 */
#ifndef KVLAB_H
#define KVLAB_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KV_OK = 0,
    KV_ERR_NOMEM,          /* an allocation failed */
    KV_ERR_INVALID_ARG,    /* a size, count or pointer that makes no sense */
    KV_ERR_TOKEN_RANGE,    /* a token id outside [0, vocab_size) */
    KV_ERR_CACHE_FULL,     /* appending would pass the cache's capacity */
    KV_ERR_CACHE_MISMATCH, /* the cache was shaped for a different model */
} kv_status;

/* A human-readable sentence for a status, for error messages. */
const char *kv_strerror(kv_status status);

/* ---- model ------------------------------------------------------------------------ */

typedef struct {
    int dim;              /* residual stream width */
    int hidden_dim;       /* SwiGLU MLP width */
    int n_layers;
    int n_heads;          /* query heads */
    int n_kv_heads;       /* key/value heads; divides n_heads (MHA, GQA, MQA) */
    int head_dim;
    int vocab_size;
    int max_seq_len;      /* the context the model was trained for */
    float norm_eps;       /* RMSNorm epsilon */
    int rope_interleaved; /* 1: rotate (x[2i], x[2i+1]) (llama2.c, Meta, GGUF);
                             0: rotate (x[i], x[i + head_dim/2]) (Hugging Face) */
} kv_config;

/* Pointers into caller-owned float32 buffers, row-major, matrices (out, in): y = W x.
 * Per-layer tensors are stacked along a leading n_layers axis. */
typedef struct {
    const float *token_embedding; /* (vocab_size, dim) */
    const float *attn_norm;       /* (n_layers, dim) */
    const float *wq;              /* (n_layers, n_heads * head_dim, dim) */
    const float *wk;              /* (n_layers, n_kv_heads * head_dim, dim) */
    const float *wv;              /* (n_layers, n_kv_heads * head_dim, dim) */
    const float *wo;              /* (n_layers, dim, n_heads * head_dim) */
    const float *ffn_norm;        /* (n_layers, dim) */
    const float *w1;              /* (n_layers, hidden_dim, dim)  gate */
    const float *w2;              /* (n_layers, dim, hidden_dim)  down */
    const float *w3;              /* (n_layers, hidden_dim, dim)  up */
    const float *final_norm;      /* (dim,) */
    const float *classifier;      /* (vocab_size, dim); may equal token_embedding (tied) */
    const float *rope_inv_freq;   /* (head_dim / 2,) rotation speed of each pair */
} kv_weights;

typedef struct {
    kv_config config;
    kv_weights weights;
} kv_model;

/* Checks that the config's sizes are positive and fit together (n_kv_heads divides
 * n_heads, head_dim even) and that no weight pointer is NULL. */
kv_status kv_model_check(const kv_model *model);

/* ---- contiguous KV cache ---------------------------------------------------------- */

/* One request's cache: every position it may ever hold is reserved up front. */
typedef struct {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int capacity;   /* positions reserved (max_seq_len of this cache) */
    int length;     /* positions filled: 0 .. length-1 hold valid K and V */
    float *key;     /* (n_layers, capacity, n_kv_heads, head_dim) */
    float *value;   /* (n_layers, capacity, n_kv_heads, head_dim) */
} kv_cache;

kv_status kv_cache_init(kv_cache *cache, int n_layers, int n_kv_heads, int head_dim,
                        int capacity);
void kv_cache_free(kv_cache *cache);   /* accepts a zeroed or half-built cache */
size_t kv_cache_nbytes(const kv_cache *cache);
kv_status kv_cache_truncate(kv_cache *cache, int length);  /* roll back to `length` tokens */
/* Does this cache fit this model's layer count and KV head shape? */
kv_status kv_cache_check_fits(const kv_cache *cache, const kv_config *config);

/* ---- forward pass ------------------------------------------------------------------ */

/* Runs n_tokens new tokens, at positions cache->length .. cache->length + n_tokens - 1,
 * through the model in one causal pass (matrix-matrix when n_tokens > 1: that is
 * prefill; n_tokens == 1 is a decode step). Their keys and values are appended to the
 * cache. Writes logits for every new token, (n_tokens, vocab_size), when all_logits is
 * nonzero, else only for the last one, (vocab_size,).
 * On any error nothing is appended and cache->length is unchanged. */
kv_status kv_model_forward(const kv_model *model, kv_cache *cache, const int32_t *tokens,
                           int n_tokens, float *logits, int all_logits);

/* The no-cache path: runs the whole sequence from position 0 in a scratch cache that
 * is thrown away afterwards, as a model without a KV cache must on every step. */
kv_status kv_model_forward_uncached(const kv_model *model, const int32_t *tokens,
                                    int n_tokens, float *logits, int all_logits);

/* ---- threads ----------------------------------------------------------------------- */
void kv_set_num_threads(int n_threads);
int kv_get_num_threads(void);

#endif /* KVLAB_H */
