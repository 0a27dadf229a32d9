/* forward.cu: the Llama forward pass on the GPU, one kernel launch per step of csrc/model.c.
 *
 *   x = embedding[token]
 *   for each layer:  x += Wo . attention(RoPE(Wq . norm(x)), cache K, cache V)
 *                    x += W2 . (silu(W1 . norm(x)) * (W3 . norm(x)))
 *   logits = classifier . norm(x)
 *
 * This file is host code only: it owns the device copy of the weights and a scratch area
 * for activations, and launches the kernels of the other .cu files in order on the default
 * stream. A call is a batch of runs (one sequence's new tokens each), exactly as
 * kv_model_forward_batch on the CPU; a prefill or a decode of one cache is a batch of one.
 * The host works out, once per call, every token's position, where its K and V go (the
 * slot mapping) and which block table its query reads, and copies them over in one transfer;
 * the same numbers serve every layer. Nothing here knows about block allocation: the slots
 * and tables come from the caller (kvlab/cuda.py, through the binding). Only the rows whose
 * logits are returned (each run's last token, or every token with all_logits) go through
 * the classifier, and the scratch holds logits for those rows only.
 */
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

/* The attention scratch holds split results for this many bytes of queries at a time (at
 * least one query's); a larger batch runs its attention in turns (attention.cu). */
#define ATTENTION_SCRATCH_BYTES ((size_t)64 << 20)

static size_t round256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Where each buffer lives in the scratch area, in bytes from its start. The first three
 * (the call's integer arguments) are laid out exactly as the host staging buffer, so that
 * one copy moves them all. */
typedef struct {
    size_t slots;      /* int64 (T,)   where each new K/V row goes */
    size_t ints;       /* int32 (5, T) tokens, positions, query table row, positions seen,
                          rows whose logits are wanted */
    size_t tables;     /* int32 (n_runs, max_blocks) */
    size_t args_end;
    size_t x, xb, qkv, att, h13, hb, logits, attention;
    size_t attention_bytes;
    size_t total;
} layout;

/* T tokens, of which n_logits rows of logits are wanted: one per run, or every token's with
 * all_logits. The logits buffer is sized by those rows, not by T: a 32K-token prompt with a
 * 128K vocabulary would otherwise reserve 32K x 128K floats (16 GiB) to return one row. */
static void plan(const kv_config *c, int T, int n_runs, int max_blocks, int max_seen,
                 int n_logits, layout *l) {
    size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    size_t f = sizeof(float), t = (size_t)T;
    l->slots = 0;
    l->ints = t * sizeof(int64_t);
    l->tables = l->ints + 5 * t * sizeof(int32_t);
    l->args_end = l->tables + (size_t)n_runs * max_blocks * sizeof(int32_t);
    l->x = round256(l->args_end);
    l->xb = l->x + round256(t * c->dim * f);
    l->qkv = l->xb + round256(t * c->dim * f);
    l->att = l->qkv + round256(t * (q_dim + 2 * kv_dim) * f);
    l->h13 = l->att + round256(t * q_dim * f);
    l->hb = l->h13 + round256(t * 2 * c->hidden_dim * f);
    l->logits = l->hb + round256(t * c->hidden_dim * f);
    l->attention = l->logits + round256((size_t)n_logits * c->vocab_size * f);
    size_t per_query = kv_cuda_attention_query_bytes(c->n_heads, c->head_dim, max_seen);
    size_t all = per_query * t;
    size_t cap = per_query > ATTENTION_SCRATCH_BYTES ? per_query : ATTENTION_SCRATCH_BYTES;
    l->attention_bytes = all < cap ? all : cap;
    l->total = l->attention + round256(l->attention_bytes);
}

/* a float32 host array copied into fresh device memory */
static kv_cuda_err upload(float **device, const float *host, size_t count) {
    kv_cuda_err err = kv_cuda_alloc((void **)device, count * sizeof(float));
    if (err == 0) err = kv_cuda_to_device(*device, host, count * sizeof(float));
    return err;
}

/* a float32 matrix's values */
static const float *f32(kv_matrix m) { return (const float *)m.data; }

extern "C" kv_cuda_err kv_cuda_model_init(kv_cuda_model *m, const kv_model *host) {
    kv_cuda_err err = 0;
    memset(m, 0, sizeof *m);
    const kv_config *c = &host->config;
    const kv_weights *w = &host->weights;
    const kv_matrix *matrices[] = {&w->token_embedding, &w->wq, &w->wk, &w->wv, &w->wo, &w->w1,
                                   &w->w2, &w->w3, &w->classifier};
    for (size_t i = 0; i < sizeof matrices / sizeof matrices[0]; i++)
        if (matrices[i]->format != KV_WEIGHT_F32) return KV_CUDA_INVALID_VALUE;  /* CPU only, for now */
    if (c->dim <= 0 || c->hidden_dim <= 0 || c->n_layers <= 0 || c->n_heads <= 0 ||
        c->n_kv_heads <= 0 || c->n_heads % c->n_kv_heads != 0 || c->vocab_size <= 0 ||
        c->head_dim % 8 != 0 || c->head_dim <= 0 || c->head_dim > KV_CUDA_MAX_HEAD_DIM)
        return KV_CUDA_INVALID_VALUE;
    m->config = *c;
    size_t L = c->n_layers, D = c->dim, H = c->hidden_dim, V = c->vocab_size;
    size_t Q = (size_t)c->n_heads * c->head_dim, KV = (size_t)c->n_kv_heads * c->head_dim;
    size_t f = sizeof(float);
    KV_CUDA_TRY(upload(&m->token_embedding, f32(w->token_embedding), V * D));
    KV_CUDA_TRY(upload(&m->attn_norm, w->attn_norm, L * D));
    /* Wq, Wk and Wv of a layer one after another: (Q + 2 KV) rows that one product fills */
    KV_CUDA_TRY(kv_cuda_alloc((void **)&m->wqkv, L * (Q + 2 * KV) * D * f));
    for (size_t l = 0; l < L; l++) {
        float *layer = m->wqkv + l * (Q + 2 * KV) * D;
        KV_CUDA_TRY(kv_cuda_to_device(layer, f32(w->wq) + l * Q * D, Q * D * f));
        KV_CUDA_TRY(kv_cuda_to_device(layer + Q * D, f32(w->wk) + l * KV * D, KV * D * f));
        KV_CUDA_TRY(kv_cuda_to_device(layer + (Q + KV) * D, f32(w->wv) + l * KV * D, KV * D * f));
    }
    KV_CUDA_TRY(upload(&m->wo, f32(w->wo), L * D * Q));
    KV_CUDA_TRY(upload(&m->ffn_norm, w->ffn_norm, L * D));
    /* W1 (gate) then W3 (up) of a layer: the rows of one product, read by swiglu.cu */
    KV_CUDA_TRY(kv_cuda_alloc((void **)&m->w13, L * 2 * H * D * f));
    for (size_t l = 0; l < L; l++) {
        float *layer = m->w13 + l * 2 * H * D;
        KV_CUDA_TRY(kv_cuda_to_device(layer, f32(w->w1) + l * H * D, H * D * f));
        KV_CUDA_TRY(kv_cuda_to_device(layer + H * D, f32(w->w3) + l * H * D, H * D * f));
    }
    KV_CUDA_TRY(upload(&m->w2, f32(w->w2), L * D * H));
    KV_CUDA_TRY(upload(&m->final_norm, w->final_norm, D));
    if (f32(w->classifier) == f32(w->token_embedding))
        m->classifier = m->token_embedding;   /* tied: one copy serves both */
    else
        KV_CUDA_TRY(upload(&m->classifier, f32(w->classifier), V * D));
    KV_CUDA_TRY(upload(&m->rope_inv_freq, w->rope_inv_freq, (size_t)c->head_dim / 2));
    m->weight_bytes = f * (V * D * (m->classifier == m->token_embedding ? 1 : 2) +
                           L * (2 * D + (Q + 2 * KV) * D + D * Q + 3 * H * D) + D +
                           (size_t)c->head_dim / 2);
    return 0;
fail:
    kv_cuda_model_free(m);
    return err;
}

extern "C" void kv_cuda_model_free(kv_cuda_model *m) {
    if (m->classifier != m->token_embedding) kv_cuda_free(m->classifier);
    float *buffers[] = {m->token_embedding, m->attn_norm, m->wqkv, m->wo, m->ffn_norm,
                        m->w13, m->w2, m->final_norm, m->rope_inv_freq};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) kv_cuda_free(buffers[i]);
    kv_cuda_free(m->work);
    memset(m, 0, sizeof *m);
}

static int grow(int need, int have, int least) {
    if (need <= have) return have;
    long n = 2L * have > need ? 2L * have : need;
    if (n < least) n = least;
    return n > (1 << 30) ? need : (int)n;
}

extern "C" kv_cuda_err kv_cuda_model_reserve(kv_cuda_model *m, int n_tokens, int n_runs,
                                             int max_blocks, int max_seen, int n_logits) {
    if (n_tokens <= 0 || n_runs <= 0 || max_blocks <= 0 || max_seen <= 0 || n_logits <= 0 ||
        n_logits > n_tokens)
        return KV_CUDA_INVALID_VALUE;
    if (m->work != NULL && n_tokens <= m->cap_tokens && n_runs <= m->cap_runs &&
        max_blocks <= m->cap_blocks && max_seen <= m->cap_seen && n_logits <= m->cap_logits)
        return 0;
    /* Grow with room to spare (twice the old size, at least what is asked): a decode loop
     * asks for one more position every step, and cudaMalloc / cudaFree wait for the GPU,
     * so the scratch should change rarely. */
    int tokens = grow(n_tokens, m->cap_tokens, 1);
    int runs = grow(n_runs, m->cap_runs, 1);
    int blocks = grow(max_blocks, m->cap_blocks, 64);
    int seen = grow(max_seen, m->cap_seen, 4096);
    int logits = grow(n_logits, m->cap_logits, 1);
    layout l;
    plan(&m->config, tokens, runs, blocks, seen, logits, &l);
    kv_cuda_free(m->work);
    m->work = NULL;
    m->cap_tokens = m->cap_runs = m->cap_blocks = m->cap_seen = m->cap_logits = 0;
    kv_cuda_err err = kv_cuda_alloc(&m->work, l.total);
    if (err != 0) return err;
    m->work_bytes = l.total;
    m->cap_tokens = tokens;
    m->cap_runs = runs;
    m->cap_blocks = blocks;
    m->cap_seen = seen;
    m->cap_logits = logits;
    return 0;
}

/* out = x . W^T: the matrix-vector kernel while it reads W once for all tokens (a decode
 * step's batch, up to KV_CUDA_MATVEC_MAX_TOKENS), else the tiled matrix product */
static kv_cuda_err project(float *out, const float *x, const float *w, int n_tokens, int in_dim,
                           int out_dim, int accumulate) {
    if (n_tokens <= KV_CUDA_MATVEC_MAX_TOKENS)
        return kv_cuda_matvec(out, x, w, n_tokens, in_dim, out_dim, accumulate);
    return kv_cuda_matmul(out, x, w, n_tokens, in_dim, out_dim, accumulate);
}

/* The call's integer arguments, packed on the host as `args` lays them out, then copied to
 * the start of the scratch area in one transfer. */
static kv_cuda_err upload_arguments(uint8_t *work, const layout *args, const kv_cuda_batch *b) {
    const int T = b->n_tokens;
    uint8_t *staging = (uint8_t *)malloc(args->args_end);
    if (staging == NULL) return (kv_cuda_err)cudaErrorMemoryAllocation;
    int32_t *tokens = (int32_t *)(staging + args->ints);
    int32_t *pos = tokens + T, *query_table = tokens + 2 * T, *seen = tokens + 3 * T;
    int32_t *logit_rows = tokens + 4 * T;
    memcpy(staging + args->slots, b->write_slots, (size_t)T * sizeof(int64_t));
    memcpy(tokens, b->tokens, (size_t)T * sizeof(int32_t));
    for (int r = 0, t = 0; r < b->n_runs; r++) {
        for (int i = 0; i < b->run_tokens[r]; i++, t++) {
            pos[t] = b->run_start[r] + i;
            query_table[t] = r;
            seen[t] = pos[t] + 1;              /* the causal mask: itself and before */
            if (b->all_logits) logit_rows[t] = t;
        }
        if (!b->all_logits) logit_rows[r] = t - 1;   /* the run's last token */
    }
    memcpy(staging + args->tables, b->tables, (size_t)b->n_runs * b->max_blocks * sizeof(int32_t));
    kv_cuda_err err = kv_cuda_to_device(work, staging, args->args_end);
    free(staging);
    return err;
}

#define RETURN_IF_FAILED(expr)                 \
    do {                                       \
        kv_cuda_err failed = (expr);           \
        if (failed != 0) return failed;        \
    } while (0)

extern "C" kv_cuda_err kv_cuda_forward(kv_cuda_model *m, const kv_store *key, const kv_store *value,
                                       const kv_cuda_batch *b, float *logits) {
    const kv_config *c = &m->config;
    const int T = b->n_tokens;
    const int n_out = b->all_logits ? T : b->n_runs;
    int max_seen = 0;
    for (int r = 0; r < b->n_runs; r++)
        if (b->run_start[r] + b->run_tokens[r] > max_seen) max_seen = b->run_start[r] + b->run_tokens[r];
    RETURN_IF_FAILED(kv_cuda_model_reserve(m, T, b->n_runs, b->max_blocks, max_seen, n_out));

    /* Where everything is: the activations at their places in the reserved layout, this
     * call's integer arguments packed at the start in its own (no larger) layout. */
    layout l, args;
    plan(c, m->cap_tokens, m->cap_runs, m->cap_blocks, m->cap_seen, m->cap_logits, &l);
    plan(c, T, b->n_runs, b->max_blocks, max_seen, n_out, &args);
    uint8_t *work = (uint8_t *)m->work;
    RETURN_IF_FAILED(upload_arguments(work, &args, b));
    const int64_t *slots = (const int64_t *)(work + args.slots);
    const int32_t *tokens = (const int32_t *)(work + args.ints);
    const int32_t *pos = tokens + T, *query_table = tokens + 2 * T;
    const int32_t *query_seen = tokens + 3 * T, *logit_rows = tokens + 4 * T;
    const int32_t *tables = (const int32_t *)(work + args.tables);
    float *x = (float *)(work + l.x), *xb = (float *)(work + l.xb);
    float *qkv = (float *)(work + l.qkv), *att = (float *)(work + l.att);
    float *h13 = (float *)(work + l.h13), *hb = (float *)(work + l.hb);
    float *d_logits = (float *)(work + l.logits);
    const int D = c->dim, H = c->hidden_dim, hd = c->head_dim;
    const int q_dim = c->n_heads * hd, kv_dim = c->n_kv_heads * hd;
    const int qkv_dim = q_dim + 2 * kv_dim;
    /* the view every layer's attention reads through; only the layer changes */
    kv_cuda_view view = {key, value, 0, tables, b->max_blocks, b->block_size, query_table, query_seen};

    RETURN_IF_FAILED(kv_cuda_embedding(x, m->token_embedding, tokens, T, D));
    for (int layer = 0; layer < c->n_layers; layer++) {
        RETURN_IF_FAILED(kv_cuda_rmsnorm(xb, x, m->attn_norm + (size_t)layer * D, NULL, T, D, c->norm_eps));
        RETURN_IF_FAILED(project(qkv, xb, m->wqkv + (size_t)layer * qkv_dim * D, T, D, qkv_dim, 0));
        /* queries and keys in one launch: in a row of qkv the key heads follow the query heads */
        RETURN_IF_FAILED(kv_cuda_rope(qkv, qkv_dim, pos, m->rope_inv_freq, T,
                                      c->n_heads + c->n_kv_heads, hd, c->rope_interleaved));
        /* the moment a token's K and V are computed: once, and kept */
        RETURN_IF_FAILED(kv_cuda_store_write(key, layer, qkv + q_dim, qkv_dim, slots, T));
        RETURN_IF_FAILED(kv_cuda_store_write(value, layer, qkv + q_dim + kv_dim, qkv_dim, slots, T));
        view.layer = layer;
        RETURN_IF_FAILED(kv_cuda_attention(att, q_dim, qkv, qkv_dim, &view, T, c->n_heads, max_seen,
                                           work + l.attention, l.attention_bytes));
        RETURN_IF_FAILED(project(x, att, m->wo + (size_t)layer * D * q_dim, T, q_dim, D, 1));
        RETURN_IF_FAILED(kv_cuda_rmsnorm(xb, x, m->ffn_norm + (size_t)layer * D, NULL, T, D, c->norm_eps));
        RETURN_IF_FAILED(project(h13, xb, m->w13 + (size_t)layer * 2 * H * D, T, D, 2 * H, 0));
        RETURN_IF_FAILED(kv_cuda_swiglu(hb, h13, T, H));
        RETURN_IF_FAILED(project(x, hb, m->w2 + (size_t)layer * D * H, T, H, D, 1));
    }
    /* only the rows whose logits are wanted go through the final norm and the classifier */
    RETURN_IF_FAILED(kv_cuda_rmsnorm(xb, x, m->final_norm, logit_rows, n_out, D, c->norm_eps));
    RETURN_IF_FAILED(project(d_logits, xb, m->classifier, n_out, D, c->vocab_size, 0));
    /* waits for every kernel above: a fault in any of them is reported here */
    return kv_cuda_to_host(logits, d_logits, (size_t)n_out * c->vocab_size * sizeof(float));
}
