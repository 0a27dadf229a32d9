/* model.c: the Llama-family forward pass over a batch of new tokens.
 *
 *   x = embedding[token]
 *   for each layer:  x += Wo . attention(RoPE(Wq . norm(x)), cache K, cache V)
 *                    x += W2 . (silu(W1 . norm(x)) * (W3 . norm(x)))
 *   logits = classifier . norm(x)
 *
 * The same function does prefill (many tokens, matrix-matrix) and decode (one token,
 * matrix-vector): only n_tokens differs. It sees the cache through one kv_layer_view per
 * layer, so the contiguous cache and the paged pool share every line of it. Weights are
 * read in place from the caller's buffers; activations live in one scratch allocation
 * made per call (run_state), a row per token in each buffer (token_rows). A long call runs
 * in chunks through one loop (in_chunks), which can stop between two for Ctrl-C; a forward
 * call's chunks reuse the run state's rows from 0, and the one-layer pass, which keeps
 * every token's rows, finds a chunk's with one function (chunk_view) from one table of the
 * buffers' row widths (ROWS). kv_model_generate is the generation loop built on the same pass: decode steps
 * over a contiguous cache with the token chosen in between (sampling.c), its scratch
 * made once for all the steps. Each kernel is called on the tier the process chose
 * (kv_set_kernels): the fast one (ops.c, attention.c) or the plain one (plain.c), one
 * branch per call. This file does not own the cache layouts (kvcache.c, paged.c) or the
 * attention math (attention.c, plain.c).
 */
#include <assert.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "dispatch.h"
#include "ops.h"
#include "paged.h"
#include "plain.h"
#include "quant.h"
#include "sampling.h"
#include "store.h"
#include "weight_formats.h"

/* How many of n_left tokens, starting at position `start`, one chunk of a long call runs:
 * as many whole kernel passes of KV_CHUNK_MIN tokens as fit in KV_CHUNK_FLOPS of work (the
 * projections' and the classifier's 2 FLOPs per weight per token, plus attention over up
 * to start + n_left positions), at least one. Calls below that much work run in one
 * piece, as before chunking; longer ones stop for the interrupt check between chunks.
 * in_chunks asks it once per call and cuts every chunk but the last to that length.
 * measure.py's chunk_length is the same rule. */
_Static_assert(KV_CHUNK_MIN == KV_TOKEN_CHUNK,
               "a chunk below the kernels' token chunk streams the weights for nothing");
/* The work the rule prices: per token, and per cached position a token's attention reads. */
static double flops_per_token(const kv_config *c) {
    double q_dim = (double)c->n_heads * c->head_dim, kv_dim = (double)c->n_kv_heads * c->head_dim;
    return 2.0 * c->n_layers * ((double)c->dim * (2.0 * q_dim + 2.0 * kv_dim) +
                                3.0 * (double)c->dim * c->hidden_dim) +
           2.0 * (double)c->dim * c->vocab_size;     /* the classifier, at most */
}

static double flops_per_position(const kv_config *c) {
    return 4.0 * c->n_layers * (double)c->n_heads * c->head_dim;   /* QK and weights x V */
}

int kv_chunk_length(const kv_config *c, int start, int n_left) {
    double per_token = flops_per_token(c), per_position = flops_per_position(c);
    double fits = KV_CHUNK_FLOPS / (per_token + per_position * ((double)start + n_left));
    int n = fits >= n_left ? n_left : (int)fits / KV_CHUNK_MIN * KV_CHUNK_MIN;
    if (n < KV_CHUNK_MIN) n = KV_CHUNK_MIN;
    return n < n_left ? n : n_left;
}

kv_status kv_model_check(const kv_model *model) {
    const kv_config *c = &model->config;
    if (c->dim <= 0 || c->hidden_dim <= 0 || c->n_layers <= 0 || c->n_heads <= 0 ||
        c->n_kv_heads <= 0 || c->head_dim <= 0 || c->vocab_size <= 0 || c->max_seq_len <= 0)
        return KV_ERR_INVALID_ARG;
    if (c->dim > KV_MAX_WIDTH || c->hidden_dim > KV_MAX_WIDTH || c->n_layers > KV_MAX_LAYERS ||
        c->vocab_size > KV_MAX_VOCAB || c->head_dim > KV_MAX_WIDTH ||
        (int64_t)c->n_heads * c->head_dim > KV_MAX_WIDTH)
        return KV_ERR_INVALID_ARG;
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0 || !(c->norm_eps > 0.0f) ||
        !isfinite(c->norm_eps))
        return KV_ERR_INVALID_ARG;
    const kv_weights *w = &model->weights;
    const float *vectors[] = {w->attn_norm, w->ffn_norm, w->final_norm, w->rope_inv_freq};
    for (size_t i = 0; i < sizeof vectors / sizeof vectors[0]; i++)
        if (vectors[i] == NULL) return KV_ERR_INVALID_ARG;
    int q_dim = c->n_heads * c->head_dim;
    const kv_matrix *matrices[] = {&w->token_embedding, &w->wq, &w->wk, &w->wv, &w->wo,
                                   &w->w1, &w->w2, &w->w3, &w->classifier};
    const int in_dims[] = {c->dim, c->dim, c->dim, c->dim, q_dim, c->dim, c->hidden_dim,
                           c->dim, c->dim};
    for (size_t i = 0; i < sizeof matrices / sizeof matrices[0]; i++)
        if (matrices[i]->data == NULL || (int)matrices[i]->format < KV_WEIGHT_F32 ||
            (int)matrices[i]->format > KV_WEIGHT_LAST ||
            kv_weight_row_bytes(matrices[i]->format, in_dims[i]) == 0)
            return KV_ERR_INVALID_ARG;
    return KV_OK;
}

/* Matrix `index` of a stack of them (a layer's Wq, say), each n_rows rows of in_dim. */
static kv_matrix nth_matrix(kv_matrix stack, int index, size_t n_rows, int in_dim) {
    size_t bytes = n_rows * kv_weight_row_bytes(stack.format, in_dim);
    return (kv_matrix){(const uint8_t *)stack.data + (size_t)index * bytes, stack.format};
}

/* Does any matrix of the model take the int8 path (int8 = 1: a block format with
 * int8_activations), or need rows made float32 in scratch (int8 = 0: any other format but
 * float32)? */
static int has_matrix_for(const kv_model *m, int int8) {
    const kv_weights *w = &m->weights;
    const kv_matrix *matrices[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w1, &w->w2, &w->w3,
                                   &w->classifier};
    for (size_t i = 0; i < sizeof matrices / sizeof matrices[0]; i++) {
        kv_weight_format f = matrices[i]->format;
        int takes_int8 = kv_weight_takes_int8(f) && m->int8_activations;
        if (int8 ? takes_int8 : f != KV_WEIGHT_F32 && !takes_int8) return 1;
    }
    return 0;
}

/* Floats of the scratch that the fast kernels' AVX-512 tiles allocate for a product (ops.h),
 * where the running variant has the tile its matrices take: the float32 tile's packed copy
 * of a chunk of KV_TOKEN_CHUNK tokens of x, the int8 tile's (Q8_0/Q4_0/Q4_1 with int8
 * activations) starting sums for every token and a panel per thread. One product at a
 * time, so the widest input and the larger of the two. Made and freed by each product,
 * but part of the call's peak all the same. */
static size_t packed_input_floats(const kv_model *m, int kernels, int n_tokens, int widest,
                                  int n_threads) {
    int packs = kernels == KV_KERNELS_PLAIN ? 0 : kv_current_variant()->kernels->packed_inputs;
    const kv_weights *w = &m->weights;
    const kv_matrix *matrices[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w1, &w->w2, &w->w3,
                                   &w->classifier};
    size_t most = 0;
    for (size_t i = 0; i < sizeof matrices / sizeof matrices[0]; i++) {
        int int8 = kv_weight_takes_int8(matrices[i]->format) && m->int8_activations;
        size_t floats = int8 ? kv_int8_tile_floats(n_tokens, widest, n_threads)
                             : kv_packed_input_floats(kv_packed_chunk(n_tokens), widest);
        if ((packs & (int8 ? KV_PACKS_INT8 : KV_PACKS_F32)) && floats > most) most = floats;
    }
    return most;
}

/* One sequence's part of a forward call: n_tokens new tokens at positions start_pos ..
 * start_pos + n_tokens - 1, rows first .. first + n_tokens - 1 of the call's activations.
 * A call runs one sequence (prefill or decode), or a batch of them (kv_model_forward_batch). */
typedef struct {
    int first;
    int n_tokens;
    int start_pos;   /* the cache row of the first new token: where it is written and what
                        the causal mask counts from */
    int position;    /* its position, for RoPE: start_pos, unless the cache dropped rows */
} token_run;

/* Activations of a forward call: a row per token in each buffer. */
typedef struct {
    float *x;         /* (n_tokens, dim) residual stream */
    float *xb;        /* (n_tokens, dim) normalized input of the current sublayer */
    float *q;         /* (n_tokens, n_heads * head_dim) queries */
    float *k;         /* (n_tokens, n_kv_heads * head_dim) new keys, before they go to the cache */
    float *v;         /* (n_tokens, n_kv_heads * head_dim) new values */
    float *att_out;   /* (n_tokens, n_heads * head_dim) attention output, heads concatenated */
    float *proj;      /* (n_tokens, dim) output of Wo or W2, before the residual add */
    float *hb;        /* (n_tokens, hidden_dim) gate, then silu(gate) * up */
    float *hb2;       /* (n_tokens, hidden_dim) up */
    float *rope_cos;  /* (n_tokens, head_dim / 2) */
    float *rope_sin;  /* (n_tokens, head_dim / 2) */
} token_rows;

/* The widths a buffer's rows can have (row_floats: dim, n_heads * head_dim, ...). */
typedef enum { ROW_DIM, ROW_Q_DIM, ROW_KV_DIM, ROW_HIDDEN_DIM, ROW_HALF_HEAD } row_width;

/* Every buffer of token_rows and the width of its rows: the one list that sizes the
 * buffers (run_state_alloc) and finds a chunk's rows in them (chunk_view). A new buffer
 * is a field above and a line here; a field without its line fails the assert below. */
static const struct {
    size_t field;       /* offsetof(token_rows, the buffer) */
    row_width width;
} ROWS[] = {
    {offsetof(token_rows, x), ROW_DIM},
    {offsetof(token_rows, xb), ROW_DIM},
    {offsetof(token_rows, q), ROW_Q_DIM},
    {offsetof(token_rows, k), ROW_KV_DIM},
    {offsetof(token_rows, v), ROW_KV_DIM},
    {offsetof(token_rows, att_out), ROW_Q_DIM},
    {offsetof(token_rows, proj), ROW_DIM},
    {offsetof(token_rows, hb), ROW_HIDDEN_DIM},
    {offsetof(token_rows, hb2), ROW_HIDDEN_DIM},
    {offsetof(token_rows, rope_cos), ROW_HALF_HEAD},
    {offsetof(token_rows, rope_sin), ROW_HALF_HEAD},
};
#define N_ROWS (sizeof ROWS / sizeof ROWS[0])
_Static_assert(N_ROWS == sizeof(token_rows) / sizeof(float *),
               "every buffer of token_rows needs its line in ROWS");

static size_t row_floats(const kv_config *c, row_width width) {
    switch (width) {
    case ROW_DIM: return (size_t)c->dim;
    case ROW_Q_DIM: return (size_t)c->n_heads * c->head_dim;
    case ROW_KV_DIM: return (size_t)c->n_kv_heads * c->head_dim;
    case ROW_HIDDEN_DIM: return (size_t)c->hidden_dim;
    case ROW_HALF_HEAD: return (size_t)c->head_dim / 2;
    }
    return 0;
}

/* The buffer ROWS[i] names, in `rows`. */
static float **row_buffer(token_rows *rows, size_t i) {
    return (float **)((char *)rows + ROWS[i].field);
}

/* Activations and scratch for one forward call over up to n_tokens tokens (a call, or
 * each chunk of a long one). */
typedef struct {
    token_rows rows;  /* (n_tokens, ...) each */
    int n_tokens;     /* the rows each buffer of `rows` has */
    float *scores;    /* (n_threads, attention scratch): a tile of attention weights and the
                         softmax's running max and sum per query head of a group, and rows
                         to dequantize K and V into */
    size_t score_stride;
    int n_threads;    /* threads of this call's attention loops (one scores row each) and of
                         products over weight_rows (four rows each) */
    kv_kernels kernels;    /* the tier of kernels the whole call runs on */
    int int8_activations;  /* the model's: products with Q8_0, Q4_0, Q4_1 matrices quantize x too */
    float *weight_rows;    /* rows of a matrix stored in fewer bytes, made float32 (four
                              rows of the widest input for each of n_threads); NULL if all
                              are float32 */
    float *x_scales;       /* (2 * n_tokens * widest input / 32) scales and d_x * code sums:
                              the plain tier writes (2, n_tokens, blocks), the fast (n_tokens,
                              blocks, 2) */
    int8_t *x_codes;       /* (n_tokens, widest input) activations as int8, for block-format
                              products with int8_activations; NULL otherwise */
    float *block;     /* the single allocation all of the above point into */
    int n_runs;
    token_run *runs;       /* (n_runs,) */
    kv_layer_view *views;  /* (n_layers, n_runs) where each run's K and V live, per layer */
    kv_counters count;     /* what this call did, handed to the caller if it succeeds */
} run_state;

/* One buffer of a call's scratch: where its pointer goes, and how many floats it takes. */
typedef struct {
    float **slot;
    size_t floats;
} scratch_part;

static void run_state_free(run_state *s) {
    free(s->block);
    free(s->views);
    free(s->runs);
    s->block = NULL;
    s->views = NULL;
    s->runs = NULL;
}

static kv_status run_state_alloc(run_state *s, const kv_model *m, int n_tokens, int n_runs) {
    const kv_config *c = &m->config;
    size_t T = (size_t)n_tokens, q_dim = (size_t)c->n_heads * c->head_dim;
    s->n_tokens = n_tokens;
    s->score_stride = kv_attention_scratch(c->n_heads, c->n_kv_heads, c->head_dim);
    s->n_threads = kv_threads();
    s->kernels = kv_get_kernels();
    s->int8_activations = m->int8_activations;
    int widest = c->dim > c->hidden_dim ? c->dim : c->hidden_dim;
    if ((int)q_dim > widest) widest = (int)q_dim;
    int converted = has_matrix_for(m, 0), int8 = has_matrix_for(m, 1);
    float *x_codes_floats = NULL;   /* the int8 codes, in float-sized slots */
    /* the rows (ROWS), then the four buffers of scratch that are not a row per token */
    scratch_part parts[N_ROWS + 4] = {
        [N_ROWS] = {&s->scores, (size_t)s->n_threads * s->score_stride},
        {&s->weight_rows, converted ? kv_weights_scratch_floats(widest, s->n_threads) : 0},
        {&s->x_scales, int8 ? 2 * T * (size_t)(widest / KV_Q8_0_BLOCK) : 0},
        {&x_codes_floats, int8 ? (T * (size_t)widest + 3) / 4 : 0}};
    for (size_t i = 0; i < N_ROWS; i++)
        parts[i] = (scratch_part){row_buffer(&s->rows, i), T * row_floats(c, ROWS[i].width)};
    const size_t n_parts = sizeof parts / sizeof parts[0];
    size_t total = 0;
    for (size_t i = 0; i < n_parts; i++) total += kv_round_up16(parts[i].floats);
    s->count.scratch_bytes = (int64_t)((total + packed_input_floats(m, s->kernels, n_tokens,
                                                                    widest, s->n_threads)) *
                                       sizeof(float));
    s->block = kv_alloc_floats(total);
    s->n_runs = n_runs;
    s->runs = calloc((size_t)n_runs, sizeof *s->runs);
    s->views = malloc((size_t)c->n_layers * n_runs * sizeof *s->views);
    if (s->block == NULL || s->views == NULL || s->runs == NULL) return KV_ERR_NOMEM;
    float *next = s->block;
    for (size_t i = 0; i < n_parts; i++) {
        *parts[i].slot = parts[i].floats > 0 ? next : NULL;
        next += kv_round_up16(parts[i].floats);
    }
    s->x_codes = (int8_t *)x_codes_floats;
    return KV_OK;
}

/* Tokens start .. start + n - 1 of the call as a chunk sees them: every buffer of its rows
 * from token `start` on, each moved by its own row width (ROWS). The only place a pointer
 * into the rows is moved, so that no buffer can be left pointing at the call's first row. */
static token_rows chunk_view(const run_state *s, const kv_config *c, int start, int n) {
    assert(start >= 0 && n >= 0 && start + n <= s->n_tokens);
    token_rows chunk = s->rows;
    for (size_t i = 0; i < N_ROWS; i++)
        *row_buffer(&chunk, i) += (size_t)start * row_floats(c, ROWS[i].width);
    return chunk;
}

/* The tokens one pass through a layer works on: rows of the activations (the whole call's,
 * or a chunk's) and the runs of tokens they hold. */
typedef struct {
    token_rows rows;
    int n_tokens;
    int n_runs;
    const token_run *runs;   /* (n_runs,) each run's `first` counts from rows' first row */
} token_span;

static kv_layer_view *view_of(const run_state *s, int layer, int run) {
    return &s->views[(size_t)layer * s->n_runs + run];
}

/* cos and sin of pos * inv_freq[i] for each new token's position */
static void fill_rope_tables(run_state *s, const kv_model *m) {
    int half = m->config.head_dim / 2;
    for (int r = 0; r < s->n_runs; r++) {
        for (int t = s->runs[r].first; t < s->runs[r].first + s->runs[r].n_tokens; t++) {
            float pos = (float)(s->runs[r].position + t - s->runs[r].first);
            for (int i = 0; i < half; i++) {
                float angle = pos * m->weights.rope_inv_freq[i];
                s->rows.rope_cos[(size_t)t * half + i] = cosf(angle);
                s->rows.rope_sin[(size_t)t * half + i] = sinf(angle);
            }
        }
    }
}

/* ---- the kernels, each on the call's tier ------------------------------------------- */

static void rmsnorm(const run_state *s, float *out, const float *x, const float *weight,
                    int dim, float eps) {
    if (s->kernels == KV_KERNELS_PLAIN) kv_plain_rmsnorm(out, x, weight, dim, eps);
    else kv_rmsnorm(out, x, weight, dim, eps);
}

static void rmsnorm_rows(const run_state *s, float *out, const float *x, const float *weight,
                         int n_rows, int dim, float eps) {
    for (int t = 0; t < n_rows; t++)
        rmsnorm(s, out + (size_t)t * dim, x + (size_t)t * dim, weight, dim, eps);
}

static void rope(const run_state *s, float *vec, int n_heads, const kv_config *c,
                 const float *cos_table, const float *sin_table) {
    if (s->kernels == KV_KERNELS_PLAIN)
        kv_plain_rope(vec, n_heads, c->head_dim, cos_table, sin_table, c->rope_interleaved);
    else
        kv_rope(vec, n_heads, c->head_dim, cos_table, sin_table, c->rope_interleaved);
}

static void swiglu(const run_state *s, float *gate, const float *up, size_t n) {
    if (s->kernels == KV_KERNELS_PLAIN) kv_plain_swiglu(gate, up, n);
    else kv_swiglu(gate, up, n);
}

static void attention(const run_state *s, const kv_config *c, float *out, const float *q,
                      const kv_layer_view *view, int n_tokens, int start_pos, float *scratch,
                      int n_threads) {
    if (s->kernels == KV_KERNELS_PLAIN)
        kv_plain_attention(out, q, view, n_tokens, start_pos, c->n_heads, c->n_kv_heads,
                           c->head_dim, scratch, s->score_stride, n_threads);
    else
        kv_attention(out, q, view, n_tokens, start_pos, c->n_heads, c->n_kv_heads,
                     c->head_dim, scratch, s->score_stride, n_threads);
}

static void add_rows(float *x, const float *delta, size_t count) {
    for (size_t i = 0; i < count; i++) x[i] += delta[i];
}

/* out = W x over a matrix stored in fewer bytes (weight_formats.c) */
static void project_formatted(const run_state *s, float *out, const float *x, kv_matrix w,
                              int n_tokens, int in_dim, int out_dim) {
    int plain = s->kernels == KV_KERNELS_PLAIN;
    if (kv_weight_takes_int8(w.format) && s->int8_activations) {
        if (plain)
            kv_plain_matmul_int8(out, x, w.data, w.format, n_tokens, in_dim, out_dim, s->x_scales,
                                 s->x_codes);
        else
            kv_matmul_int8(out, x, w.data, w.format, n_tokens, in_dim, out_dim, s->x_scales,
                           s->x_codes);
    } else if (plain) {
        kv_plain_matmul_weights(out, x, w.data, w.format, n_tokens, in_dim, out_dim,
                                s->weight_rows, s->n_threads);
    } else {
        kv_matmul_weights(out, x, w.data, w.format, n_tokens, in_dim, out_dim, s->weight_rows,
                          s->n_threads);
    }
}

/* [quote ch05-project-one-pass-over] */
/* out = W x for every token: one pass over W for the whole batch, whichever sequences
 * the tokens belong to */
static void project(const run_state *s, float *out, const float *x, kv_matrix w,
                    int n_tokens, int in_dim, int out_dim) {
    if (w.format != KV_WEIGHT_F32) project_formatted(s, out, x, w, n_tokens, in_dim, out_dim);
    else if (s->kernels == KV_KERNELS_PLAIN) kv_plain_matmul(out, x, w.data, n_tokens, in_dim, out_dim);
    else kv_matmul(out, x, w.data, n_tokens, in_dim, out_dim);
}
/* [end ch05-project-one-pass-over] */

/* Several projections of the same input x at once (see kv_matmul_many): float32 matrices
 * in one parallel region, block-format matrices of one format against int8 activations
 * too (x quantized once, kv_matmul_int8_many), others one after another */
static void project_many(const run_state *s, int n, float *const *outs, const kv_matrix *ws,
                         const int *out_dims, const float *x, int n_tokens, int in_dim) {
    int all_f32 = 1, all_int8 = kv_weight_takes_int8(ws[0].format) && s->int8_activations;
    const float *floats[4];
    const uint8_t *bytes[4];
    for (int m = 0; m < n; m++) {
        all_f32 &= ws[m].format == KV_WEIGHT_F32;
        all_int8 &= ws[m].format == ws[0].format;
        floats[m] = ws[m].data;
        bytes[m] = ws[m].data;
    }
    if (s->kernels == KV_KERNELS_PLAIN || !(all_f32 || all_int8))
        for (int m = 0; m < n; m++) project(s, outs[m], x, ws[m], n_tokens, in_dim, out_dims[m]);
    else if (all_int8)
        kv_matmul_int8_many(n, outs, bytes, ws[0].format, out_dims, x, n_tokens, in_dim,
                            s->x_scales, s->x_codes);
    else
        kv_matmul_many(n, outs, floats, out_dims, x, n_tokens, in_dim);
}

/* Attention of every run over its own sequence. One run (a prefill or a decode) spreads
 * its (token, KV head) pairs over the threads; a batch gives each thread whole runs, with
 * a scratch row of its own, since one decode token alone is too little work to split. */
static void attend_runs(const kv_config *c, const run_state *s, const token_span *span,
                        int layer) {
    size_t q_dim = (size_t)c->n_heads * c->head_dim;
    const token_rows *rows = &span->rows;
    if (span->n_runs == 1) {
        const token_run *run = &span->runs[0];
        attention(s, c, rows->att_out, rows->q, view_of(s, layer, 0), run->n_tokens,
                  run->start_pos, s->scores, s->n_threads);
        return;
    }
    int64_t work = 0;   /* 64 bits everywhere: long is 32 on Windows */
    for (const token_run *run = span->runs; run < span->runs + span->n_runs; run++)
        work += (int64_t)run->n_tokens * (run->start_pos + run->n_tokens);
    (void)work;         /* read only by the OpenMP clause */
    #pragma omp parallel for schedule(dynamic) num_threads(s->n_threads) \
        if (work * c->n_heads * c->head_dim >= KV_PARALLEL_MIN_WORK)
    for (int r = 0; r < span->n_runs; r++) {
        const token_run *run = &span->runs[r];
        float *scratch = s->scores + (size_t)omp_get_thread_num() * s->score_stride;
        attention(s, c, rows->att_out + run->first * q_dim, rows->q + run->first * q_dim,
                  view_of(s, layer, r), run->n_tokens, run->start_pos, scratch, 1);
    }
}

static void attention_block(const kv_model *m, const run_state *s, const token_span *span,
                            int layer) {
    const kv_config *c = &m->config;
    const kv_weights *w = &m->weights;
    const token_rows *rows = &span->rows;
    int n_tokens = span->n_tokens;
    size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    size_t dim = (size_t)c->dim, half = (size_t)c->head_dim / 2;

    rmsnorm_rows(s, rows->xb, rows->x, w->attn_norm + layer * dim, n_tokens, c->dim,
                 c->norm_eps);
    /* Q, K and V from the same input, in one pass over the threads */
    float *qkv[3] = {rows->q, rows->k, rows->v};
    kv_matrix wqkv[3] = {nth_matrix(w->wq, layer, q_dim, c->dim),
                         nth_matrix(w->wk, layer, kv_dim, c->dim),
                         nth_matrix(w->wv, layer, kv_dim, c->dim)};
    int qkv_dims[3] = {(int)q_dim, (int)kv_dim, (int)kv_dim};
    /* [quote ch01-attention-block-k-and-v] */
    project_many(s, 3, qkv, wqkv, qkv_dims, rows->xb, n_tokens, c->dim);
    for (int r = 0; r < span->n_runs; r++) {
        const token_run *run = &span->runs[r];
        const kv_layer_view *view = view_of(s, layer, r);
        for (int t = run->first; t < run->first + run->n_tokens; t++) {
            const float *cos_t = rows->rope_cos + t * half, *sin_t = rows->rope_sin + t * half;
            rope(s, rows->q + t * q_dim, c->n_heads, c, cos_t, sin_t);
            rope(s, rows->k + t * kv_dim, c->n_kv_heads, c, cos_t, sin_t);
            /* This is the moment a token's K and V are computed: once, and kept (quantized
             * here if the cache stores fewer bits). */
            size_t slot = kv_view_slot(view, run->start_pos + t - run->first);
            kv_store_write(view->key, view->layer, slot, rows->k + t * kv_dim);
            kv_store_write(view->value, view->layer, slot, rows->v + t * kv_dim);
        }
    }
    attend_runs(c, s, span, layer);
    /* [end ch01-attention-block-k-and-v] */
    for (int r = 0; r < span->n_runs; r++) {   /* for an eviction policy that asked for them */
        const token_run *run = &span->runs[r];
        const kv_layer_view *view = view_of(s, layer, r);
        if (view->attention != NULL)
            kv_attention_weights_add(view, rows->q + run->first * q_dim, run->n_tokens,
                                     run->start_pos, c->n_heads, c->n_kv_heads, c->head_dim);
    }
    /* [quote ch06-attention-block-after-attention-the] */
    for (int r = 0; r < span->n_runs; r++) {
        const token_run *run = &span->runs[r];
        const kv_layer_view *view = view_of(s, layer, r);
        /* the residual window: the newest rows also stay in full precision */
        kv_window_keep(view->window_key, view->window, (int)kv_dim, run->start_pos,
                       rows->k + run->first * kv_dim, kv_dim, run->n_tokens);
        kv_window_keep(view->window_value, view->window, (int)kv_dim, run->start_pos,
                       rows->v + run->first * kv_dim, kv_dim, run->n_tokens);
    }
    /* [end ch06-attention-block-after-attention-the] */
    project(s, rows->proj, rows->att_out, nth_matrix(w->wo, layer, dim, (int)q_dim), n_tokens,
            (int)q_dim, c->dim);
    add_rows(rows->x, rows->proj, (size_t)n_tokens * dim);
}

static void mlp_block(const kv_model *m, const run_state *s, const token_span *span,
                      int layer) {
    const kv_config *c = &m->config;
    const kv_weights *w = &m->weights;
    const token_rows *rows = &span->rows;
    int n_tokens = span->n_tokens;
    size_t dim = (size_t)c->dim, hidden = (size_t)c->hidden_dim;
    rmsnorm_rows(s, rows->xb, rows->x, w->ffn_norm + layer * dim, n_tokens, c->dim,
                 c->norm_eps);
    float *gate_up[2] = {rows->hb, rows->hb2};
    kv_matrix w13[2] = {nth_matrix(w->w1, layer, hidden, c->dim),
                        nth_matrix(w->w3, layer, hidden, c->dim)};
    int hidden_dims[2] = {c->hidden_dim, c->hidden_dim};
    project_many(s, 2, gate_up, w13, hidden_dims, rows->xb, n_tokens, c->dim);
    swiglu(s, rows->hb, rows->hb2, (size_t)n_tokens * c->hidden_dim);
    project(s, rows->proj, rows->hb, nth_matrix(w->w2, layer, dim, c->hidden_dim), n_tokens,
            c->hidden_dim, c->dim);
    add_rows(rows->x, rows->proj, (size_t)n_tokens * dim);
}

/* Bytes of n_rows rows of in_dim values in a matrix's format */
static int64_t matrix_bytes(kv_matrix m, int64_t n_rows, int in_dim) {
    return n_rows * (int64_t)kv_weight_row_bytes(m.format, in_dim);
}

/* Bytes of one layer's weights: its seven matrices and two norm vectors. */
static int64_t layer_weight_bytes(const kv_model *model) {
    const kv_config *c = &model->config;
    const kv_weights *w = &model->weights;
    const int64_t dim = c->dim, hidden = c->hidden_dim;
    const int64_t q_dim = (int64_t)c->n_heads * c->head_dim;
    const int64_t kv_dim = (int64_t)c->n_kv_heads * c->head_dim;
    return matrix_bytes(w->wq, q_dim, c->dim) + matrix_bytes(w->wk, kv_dim, c->dim) +
           matrix_bytes(w->wv, kv_dim, c->dim) + matrix_bytes(w->wo, dim, (int)q_dim) +
           matrix_bytes(w->w1, hidden, c->dim) + matrix_bytes(w->w3, hidden, c->dim) +
           matrix_bytes(w->w2, dim, c->hidden_dim) + (int64_t)sizeof(float) * 2 * dim;
}

/* What one forward_tokens call did, from the shapes alone, added to s->count once the
 * math is done (kvlab/measure.py's forward_counts is the same arithmetic, and the tests
 * hold the two equal). Weights: each matrix and norm vector read once for the whole batch,
 * the embedding rows once per token. Attention, per layer and run: token t sees
 * start_pos + t + 1 positions, the most recent `window` of them in float32 and the rest as
 * stored (codes, scales and zero points); each new row is written as stored, and the last
 * window of them in float32 too. */
static void count_forward(const kv_model *model, run_state *s, int n_tokens, int n_rows) {
    const kv_config *c = &model->config;
    const int64_t f = (int64_t)sizeof(float), n = n_tokens, L = c->n_layers, dim = c->dim;
    const int64_t q_dim = (int64_t)c->n_heads * c->head_dim;
    const int64_t kv_dim = (int64_t)c->n_kv_heads * c->head_dim, hidden = c->hidden_dim;
    const int64_t qkvo = dim * (q_dim + 2 * kv_dim) + q_dim * dim;    /* Wq Wk Wv, then Wo */
    const int64_t mlp = 3 * dim * hidden;                              /* W1 W3, then W2 */
    kv_counters *count = &s->count;
    count->flops_projections += 2 * n * L * qkvo;
    count->flops_mlp += 2 * n * L * mlp;
    count->flops_logits += 2 * (int64_t)n_rows * dim * c->vocab_size;
    const kv_weights *w = &model->weights;
    count->weight_bytes += n * matrix_bytes(w->token_embedding, 1, c->dim)   /* embedding rows */
                           + L * layer_weight_bytes(model)
                           + (n_rows > 0 ? f * dim                      /* final norm */
                                           + matrix_bytes(w->classifier, c->vocab_size, c->dim)
                                         : 0);
    for (int layer = 0; layer < c->n_layers; layer++)
        for (int r = 0; r < s->n_runs; r++) {
            const kv_layer_view *view = view_of(s, layer, r);
            int64_t start = s->runs[r].start_pos, m = s->runs[r].n_tokens, window = view->window;
            int64_t seen = m * start + m * (m + 1) / 2;
            int64_t stored_row = (int64_t)(kv_store_row_nbytes(view->key) +
                                           kv_store_row_nbytes(view->value));
            int64_t in_window = 0;   /* positions read in float32 */
            for (int64_t t = 0; t < m && window > 0; t++)
                in_window += start + t + 1 < window ? start + t + 1 : window;
            count->flops_attention += 4 * seen * q_dim;                /* q.k, then p*v */
            count->kv_read_bytes += (seen - in_window) * stored_row + in_window * 2 * kv_dim * f;
            count->kv_write_bytes += m * stored_row + 2 * kv_dim * f * (m < window ? m : window);
        }
    count->tokens += n_tokens;
    count->calls += 1;
}

/* One layer over a span of tokens: each run's new K and V rows shown to its view (read in
 * full precision inside the residual window), then attention and the MLP. */
static void run_layer(const kv_model *model, run_state *s, const token_span *span,
                      int layer) {
    size_t kv_dim = (size_t)model->config.n_kv_heads * model->config.head_dim;
    for (int r = 0; r < span->n_runs; r++) {
        kv_layer_view *view = view_of(s, layer, r);
        view->new_key = span->rows.k + (size_t)span->runs[r].first * kv_dim;
        view->new_value = span->rows.v + (size_t)span->runs[r].first * kv_dim;
        view->new_start = span->runs[r].start_pos;
    }
    attention_block(model, s, span, layer);
    mlp_block(model, s, span, layer);
}

/* The start of every forward pass: each token's row of the embedding, as float32, and
 * RoPE's tables for its position. */
static void embed_tokens(const kv_model *model, run_state *s, const int32_t *tokens,
                         int n_tokens) {
    const kv_config *c = &model->config;
    for (int t = 0; t < n_tokens; t++) {
        kv_matrix row = nth_matrix(model->weights.token_embedding, tokens[t], 1, c->dim);
        kv_weight_row_dequantize(row.format, row.data, c->dim, s->rows.x + (size_t)t * c->dim);
    }
    fill_rope_tables(s, model);
}

/* The end of every forward pass: the logits (every token's with all_logits, else the last
 * token's of each run, one row per run; none with logits NULL: a chunk of a long call
 * before its last, whose logits nobody reads), and the call's work counted. */
static void finish_forward(const kv_model *model, run_state *s, int n_tokens, float *logits,
                           int all_logits) {
    const kv_config *c = &model->config;
    /* [quote ch09-forward-tokens-logits] */
    /* Only the rows whose logits were asked for go through the final norm and the
     * classifier, the largest matrix of a small model. */
    int n_rows = logits == NULL ? 0 : all_logits ? n_tokens : s->n_runs;
    for (int i = 0; i < n_rows; i++) {
        int t = all_logits ? i : s->runs[i].first + s->runs[i].n_tokens - 1;
        rmsnorm(s, s->rows.xb + (size_t)i * c->dim, s->rows.x + (size_t)t * c->dim,
                model->weights.final_norm, c->dim, c->norm_eps);
    }
    if (n_rows > 0)
        project(s, logits, s->rows.xb, model->weights.classifier, n_rows, c->dim,
                c->vocab_size);
    /* [end ch09-forward-tokens-logits] */
    count_forward(model, s, n_tokens, n_rows);
}

/* Whether a pass over s's runs is more than one chunk's work (KV_CHUNK_FLOPS, priced as
 * kv_chunk_length prices it, each token at its own position): a chunk cut to KV_CHUNK_MIN
 * tokens at a long context, or a big batch, can be many times that, seconds of work. */
static int long_pass(const kv_config *c, const run_state *s) {
    double work = 0.0;
    for (int r = 0; r < s->n_runs; r++) {
        double n = s->runs[r].n_tokens, start = s->runs[r].start_pos;
        work += n * flops_per_token(c) + flops_per_position(c) * (n * start + n * (n + 1) / 2);
    }
    return work > KV_CHUNK_FLOPS;
}

/* The forward pass proper, every layer over every token of the call at once. The caller
 * has checked every argument, filled s->runs and s->views, and made room in the cache for
 * every run's new positions. `stoppable`: the caller can undo what the pass writes (rows
 * past each run's cache length, and nothing else: no residual window, no attention sums),
 * so a long pass (long_pass) asks the interrupt check between its layers, and stops there,
 * told to: KV_ERR_INTERRUPTED, no logits, nothing counted, for the caller to undo. A
 * layer's time, not the pass's: 96 tokens at 8,000 positions of a 110M model are about
 * a second of two threads' work. Otherwise it cannot fail. */
static kv_status forward_tokens(const kv_model *model, run_state *s, const int32_t *tokens,
                                int n_tokens, float *logits, int all_logits, int stoppable) {
    assert(n_tokens <= s->n_tokens);   /* its buffers hold that many rows */
    stoppable = stoppable && long_pass(&model->config, s);
    embed_tokens(model, s, tokens, n_tokens);
    const token_span all = {s->rows, n_tokens, s->n_runs, s->runs};
    for (int layer = 0; layer < model->config.n_layers; layer++) {
        if (layer > 0 && stoppable && kv_interrupted()) return KV_ERR_INTERRUPTED;
        run_layer(model, s, &all, layer);
    }
    finish_forward(model, s, n_tokens, logits, all_logits);
    return KV_OK;
}

void kv_counters_add(kv_counters *total, const kv_counters *call) {
    if (total == NULL) return;
    total->flops_projections += call->flops_projections;
    total->flops_attention += call->flops_attention;
    total->flops_mlp += call->flops_mlp;
    total->flops_logits += call->flops_logits;
    total->weight_bytes += call->weight_bytes;
    total->kv_read_bytes += call->kv_read_bytes;
    total->kv_write_bytes += call->kv_write_bytes;
    if (call->scratch_bytes > total->scratch_bytes) total->scratch_bytes = call->scratch_bytes;
    total->tokens += call->tokens;
    total->calls += call->calls;
}

kv_status kv_check_tokens(const kv_config *config, const int32_t *tokens, int n_tokens) {
    if (tokens == NULL || n_tokens <= 0 || n_tokens > KV_MAX_TOKENS_PER_CALL)
        return KV_ERR_INVALID_ARG;
    for (int t = 0; t < n_tokens; t++)
        if (tokens[t] < 0 || tokens[t] >= config->vocab_size) return KV_ERR_TOKEN_RANGE;
    return KV_OK;
}

/* What a call over a contiguous cache checks before it changes anything, so that a failed
 * call leaves the cache exactly as it was: the model, the cache's shape, the n_tokens ids
 * it starts from, and room for n_positions more positions. */
static kv_status check_cache_call(const kv_model *model, const kv_cache *cache,
                                  const int32_t *tokens, int n_tokens, int n_positions) {
    kv_status status = KV_OK;
    KV_TRY(kv_model_check(model));
    KV_TRY(kv_cache_check_fits(cache, &model->config));
    KV_TRY(kv_check_tokens(&model->config, tokens, n_tokens));
    KV_CHECK(n_positions <= cache->capacity - cache->length, KV_ERR_CACHE_FULL);
    /* a cache that drops rows runs on forever, but positions stay where RoPE means them */
    KV_CHECK(n_positions <= KV_MAX_POSITIONS - cache->next_position, KV_ERR_CACHE_FULL);
fail:
    return status;
}

/* ---- the chunk loop ------------------------------------------------------------------ */

/* What a long call does with one of its chunks: the n tokens from its token `done` on. */
typedef kv_status chunk_step(void *call, int done, int n);

/* [quote ch01-in-chunks] */
/* The one loop over the chunks of a long call (kv_model_forward, kv_model_forward_paged,
 * each layer of the one-layer uncached pass): n_tokens tokens, the first at position
 * `start`, in chunks of kv_chunk_length's size, `step` doing what the call does with each.
 * Between two chunks it asks the interrupt check, and stops if told to: the chunks before
 * are done, the rest are not begun. `ask_first`: ask before the first chunk too (work
 * came before this loop in the same call). */
static kv_status in_chunks(const kv_config *c, int start, int n_tokens, int ask_first,
                           chunk_step *step, void *call) {
    /* One length for every chunk but the last, the first's: the run state is sized for it
     * (asked again for what is left, the rule could give a later chunk up to 47 rows more
     * than its whole passes of the first) */
    const int chunk = kv_chunk_length(c, start, n_tokens);
    for (int done = 0, n = 0; done < n_tokens; done += n) {
        if ((done > 0 || ask_first) && kv_interrupted()) return KV_ERR_INTERRUPTED;
        n = n_tokens - done < chunk ? n_tokens - done : chunk;
        kv_status status = step(call, done, n);
        if (status != KV_OK) return status;
    }
    return KV_OK;
}
/* [end ch01-in-chunks] */

/* A forward call over the next positions of a contiguous cache (cache_chunk) or of a
 * sequence of a paged pool (pool_chunk): what each of its chunks needs. */
typedef struct {
    const kv_model *model;
    run_state *s;           /* sized for the call's first (and longest) chunk */
    const int32_t *tokens;  /* (n_tokens,) */
    int n_tokens;
    float *logits;          /* (n_tokens, vocab_size) with all_logits, else (vocab_size,) */
    int all_logits;
    kv_cache *cache;        /* cache_chunk's */
    kv_pool *pool;          /* pool_chunk's, with the sequence seq */
    int seq;
} forward_call;

/* Where the chunk of n tokens from `done` on writes its logits: its rows of every token's,
 * or, with only the last token's wanted, the last chunk alone (NULL: the chunks before skip
 * the final norm and the classifier). */
static float *chunk_logits(const forward_call *call, int done, int n) {
    if (call->all_logits) return call->logits + (size_t)done * call->model->config.vocab_size;
    return done + n == call->n_tokens ? call->logits : NULL;
}

/* n_tokens new tokens through the model at the cache's next positions, their K and V
 * appended: a chunk of kv_model_forward, and each step of kv_model_generate. Stopped
 * between layers (stoppable, see forward_tokens), it appends nothing: the rows it wrote
 * are past the cache's length, which stays. */
/* [quote ch01-kv-model-forward-and-the-step] */
static kv_status run_over_cache(const kv_model *model, run_state *s, kv_cache *cache,
                                const int32_t *tokens, int n_tokens, float *logits,
                                int all_logits, int stoppable) {
    s->runs[0] = (token_run){0, n_tokens, cache->length, cache->next_position};
    for (int layer = 0; layer < model->config.n_layers; layer++)
        *view_of(s, layer, 0) = kv_cache_layer_view(cache, layer);
    kv_status status = forward_tokens(model, s, tokens, n_tokens, logits, all_logits,
                                      stoppable);
    if (status == KV_OK) kv_cache_note_appended(cache, n_tokens);
    return status;
}

static kv_status cache_chunk(void *p, int done, int n) {
    const forward_call *call = p;
    /* a residual window's ring and attention sums are written in place: no stop inside */
    int stoppable = call->cache->window == 0 && call->cache->attention == NULL;
    return run_over_cache(call->model, call->s, call->cache, call->tokens + done, n,
                          chunk_logits(call, done, n), call->all_logits, stoppable);
}

kv_status kv_model_forward(const kv_model *model, kv_cache *cache, const int32_t *tokens,
                           int n_tokens, float *logits, int all_logits, kv_counters *counters) {
    kv_status status = KV_OK;
    run_state s = {0};
    KV_CHECK(model != NULL && cache != NULL && logits != NULL, KV_ERR_INVALID_ARG);
    KV_TRY(check_cache_call(model, cache, tokens, n_tokens, n_tokens));
    const kv_config *c = &model->config;
    KV_TRY(run_state_alloc(&s, model, kv_chunk_length(c, cache->length, n_tokens), 1));
    /* A chunk at a time, each committed to the cache: the same results as one pass (a
     * prefill in parts equals one prefill, bit for bit), and a place to stop between. */
    forward_call call = {model, &s, tokens, n_tokens, logits, all_logits, .cache = cache};
    status = in_chunks(c, cache->length, n_tokens, 0, cache_chunk, &call);
    if (s.count.calls > 1) s.count.calls = 1;      /* one call, however many chunks */
    kv_counters_add(counters, &s.count);
fail:
    run_state_free(&s);
    return status;
}
/* [end ch01-kv-model-forward-and-the-step] */

kv_status kv_model_generate(const kv_model *model, kv_cache *cache, int32_t token,
                            int max_steps, int32_t stop_token, const kv_sampling *how,
                            const double *uniforms, int32_t *tokens_out, double *seconds_out,
                            int *n_steps, kv_counters *counters) {
    kv_status status = KV_OK;
    run_state s = {0};
    float *logits = NULL;
    void *sample_scratch = NULL;
    const kv_sampling greedy = {0.0, 0, 1.0};
    if (how == NULL) how = &greedy;
    KV_CHECK(model != NULL && cache != NULL && tokens_out != NULL && n_steps != NULL &&
             max_steps >= 1 && how->temperature >= 0.0 && how->top_k >= 0 &&
             how->top_p > 0.0 && how->top_p <= 1.0 &&
             (how->temperature == 0.0 || uniforms != NULL), KV_ERR_INVALID_ARG);
    *n_steps = 0;
    KV_TRY(check_cache_call(model, cache, &token, 1, max_steps));   /* a position per step */
    const kv_config *c = &model->config;
    KV_CHECK(stop_token < c->vocab_size, KV_ERR_TOKEN_RANGE);
    KV_TRY(run_state_alloc(&s, model, 1, 1));
    logits = kv_alloc_floats((size_t)c->vocab_size);
    sample_scratch = malloc(kv_sample_scratch_bytes(c->vocab_size));
    KV_CHECK(logits != NULL && sample_scratch != NULL, KV_ERR_NOMEM);
    /* Each step is what kv_model_forward does for one token, then the choice. */
    for (int step = 0; step < max_steps; step++) {
        if (step > 0 && kv_interrupted()) {    /* between tokens: every step before is whole */
            status = KV_ERR_INTERRUPTED;
            break;
        }
        double start = kv_seconds();
        run_over_cache(model, &s, cache, &token, 1, logits, 0, 0);
        token = kv_sample(logits, c->vocab_size, how,
                          how->temperature == 0.0 ? 0.0 : uniforms[step], sample_scratch);
        if (token < 0) {
            status = KV_ERR_NOT_A_NUMBER;
            break;
        }
        tokens_out[step] = token;
        if (seconds_out != NULL) seconds_out[step] = kv_seconds() - start;
        *n_steps = step + 1;
        if (token == stop_token) break;
    }
    kv_counters_add(counters, &s.count);
fail:
    free(sample_scratch);
    free(logits);
    run_state_free(&s);
    return status;
}

/* [quote ch04-kv-model-forward-paged] */
/* A chunk of kv_model_forward_paged: reserve its blocks (copy-on-write included), run the
 * layers through the sequence's views, commit its tokens; stopped between layers (see
 * forward_tokens; not with a residual window, whose ring is written in place), cancel the
 * reservation instead: the sequence is as before the chunk. */
static kv_status pool_chunk(void *p, int done, int n) {
    const forward_call *call = p;
    kv_pool *pool = call->pool;
    run_state *s = call->s;
    /* cannot fail: kv_model_forward_paged counted the blocks of every chunk first; were it
     * to, the chunks before stay */
    kv_status status = kv_pool_reserve(pool, call->seq, n);
    if (status != KV_OK) return status;
    const kv_seq *q = &pool->blocks.seqs[call->seq];
    s->runs[0] = (token_run){0, n, q->length, q->next_position};
    for (int layer = 0; layer < call->model->config.n_layers; layer++)
        *view_of(s, layer, 0) = kv_pool_layer_view(pool, call->seq, layer);
    status = forward_tokens(call->model, s, call->tokens + done, n, chunk_logits(call, done, n),
                            call->all_logits, pool->window == 0);
    if (status != KV_OK) {
        kv_blocks_cancel(&pool->blocks, call->seq);
        return status;
    }
    kv_blocks_commit(&pool->blocks, call->seq, call->tokens + done, n);
    kv_pool_note_positions(pool, call->seq, n);
    return KV_OK;
}

kv_status kv_model_forward_paged(const kv_model *model, kv_pool *pool, int seq,
                                 const int32_t *tokens, int n_tokens, float *logits,
                                 int all_logits, kv_counters *counters) {
    kv_status status = KV_OK;
    run_state s = {0};
    KV_CHECK(model != NULL && pool != NULL && logits != NULL, KV_ERR_INVALID_ARG);
    KV_TRY(kv_model_check(model));
    const kv_config *c = &model->config;
    KV_TRY(kv_pool_check_fits(pool, c));
    KV_TRY(kv_check_tokens(c, tokens, n_tokens));
    KV_TRY(kv_blocks_seq_check(&pool->blocks, seq));
    const kv_seq *q = &pool->blocks.seqs[seq];
    KV_CHECK(n_tokens <= KV_MAX_POSITIONS - q->next_position, KV_ERR_CACHE_FULL);
    /* Blocks for every new position must be there now, so that a call refused for want of
     * them changes nothing. (Each chunk then reserves its own: committing a chunk never
     * leaves fewer blocks available, so those reservations cannot fail.) */
    int needed;
    KV_TRY(kv_blocks_needed(&pool->blocks, seq, n_tokens, &needed));
    KV_CHECK(needed <= kv_blocks_available(&pool->blocks), KV_ERR_OUT_OF_BLOCKS);
    KV_TRY(run_state_alloc(&s, model, kv_chunk_length(c, q->length, n_tokens), 1));
    forward_call call = {model, &s, tokens, n_tokens, logits, all_logits, .pool = pool,
                         .seq = seq};
    status = in_chunks(c, q->length, n_tokens, 0, pool_chunk, &call);
    if (s.count.calls > 1) s.count.calls = 1;      /* one call, however many chunks */
    kv_counters_add(counters, &s.count);
fail:
    run_state_free(&s);
    return status;
}
/* [end ch04-kv-model-forward-paged] */

/* [quote ch05-kv-model-forward-batch] */
kv_status kv_model_forward_batch(const kv_model *model, kv_pool *pool, int n_seqs,
                                 const int *seqs, const int *n_tokens, const int32_t *tokens,
                                 float *logits, int all_logits, kv_counters *counters) {
    kv_status status = KV_OK;
    run_state s = {0};
    KV_CHECK(model != NULL && pool != NULL && logits != NULL && seqs != NULL &&
             n_tokens != NULL && n_seqs > 0 && n_seqs <= pool->blocks.max_seqs, KV_ERR_INVALID_ARG);
    KV_TRY(kv_model_check(model));
    const kv_config *c = &model->config;
    KV_TRY(kv_pool_check_fits(pool, c));
    /* Every check before the first change: sequences alive and distinct, sizes sane, enough
     * blocks for all of them together (the pool's), and token ids in range. */
    KV_TRY(kv_pool_check_batch(pool, n_seqs, seqs, n_tokens));
    int total = 0;
    for (int i = 0; i < n_seqs; i++) total += n_tokens[i];   /* at most 65536: checked */
    KV_TRY(kv_check_tokens(c, tokens, total));
    KV_TRY(run_state_alloc(&s, model, total, n_seqs));
    /* No reservation below can fail: each fits in what was counted above (a copy-on-write
     * counted for two forks of one block happens only once, if at all). A long pass may
     * stop between its layers (forward_tokens; not with a residual window, whose rings are
     * written in place): every reservation is cancelled then, and the pool is as it was. */
    for (int i = 0, first = 0; i < n_seqs; first += n_tokens[i], i++) {
        const kv_seq *q = &pool->blocks.seqs[seqs[i]];
        s.runs[i] = (token_run){first, n_tokens[i], q->length, q->next_position};
        kv_pool_reserve(pool, seqs[i], n_tokens[i]);
        for (int layer = 0; layer < c->n_layers; layer++)
            *view_of(&s, layer, i) = kv_pool_layer_view(pool, seqs[i], layer);
    }
    status = forward_tokens(model, &s, tokens, total, logits, all_logits, pool->window == 0);
    if (status != KV_OK) {
        kv_pool_cancel_batch(pool, n_seqs, seqs);
        goto fail;
    }
    kv_pool_commit_batch(pool, n_seqs, seqs, n_tokens, tokens);
    kv_counters_add(counters, &s.count);
fail:
    run_state_free(&s);
    return status;
}
/* [end ch05-kv-model-forward-batch] */

/* The one-layer uncached pass at one layer: what its chunks need. */
typedef struct {
    const kv_model *model;
    run_state *s;   /* sized for every token of the call */
    int layer;
} layer_call;

/* A chunk of one layer of the one-layer pass: the layer over the chunk's rows of the
 * call's buffers. It gives the one pass's numbers bit for bit: every layer before is done
 * for every token, this layer's K and V of the chunks before are in the one-layer cache
 * for the chunk's attention, and a token's products and attention do not depend on the
 * tokens run beside it (a prefill in parts equals one prefill). */
static kv_status layer_chunk(void *p, int done, int n) {
    const layer_call *call = p;
    const token_run run = {0, n, done, done};   /* the call starts at position 0 */
    const token_span chunk = {chunk_view(call->s, &call->model->config, done, n), n, 1, &run};
    run_layer(call->model, call->s, &chunk, call->layer);
    /* each chunk reads the layer's weights, as kv_model_forward's chunks do (the first
     * chunk's are counted with the call's, by finish_forward) */
    if (done > 0) call->s->count.weight_bytes += layer_weight_bytes(call->model);
    return KV_OK;
}

/* The uncached forward that holds one layer's K and V at a time: a scratch cache of one
 * layer, which every layer's view points into, each layer writing over the last one's.
 * It cannot go a chunk through every layer at a time (a later chunk would need the earlier
 * chunks' K and V of every layer), so each layer goes over all the tokens, in the chunks
 * kv_model_forward would run, the interrupt check asked between them: one pass over
 * thousands of tokens could otherwise run for minutes deaf to Ctrl-C. */
static kv_status forward_one_layer_kv(const kv_model *model, const int32_t *tokens,
                                      int n_tokens, float *logits, int all_logits,
                                      kv_counters *counters) {
    kv_status status = KV_OK;
    kv_cache one_layer = {0};
    run_state s = {0};
    const kv_config *c = &model->config;
    KV_TRY(kv_cache_init(&one_layer, 1, c->n_kv_heads, c->head_dim, n_tokens, NULL));
    KV_TRY(run_state_alloc(&s, model, n_tokens, 1));
    s.runs[0] = (token_run){0, n_tokens, 0, 0};
    for (int layer = 0; layer < c->n_layers; layer++)
        *view_of(&s, layer, 0) = kv_cache_layer_view(&one_layer, 0);
    embed_tokens(model, &s, tokens, n_tokens);
    for (int layer = 0; layer < c->n_layers; layer++) {
        layer_call call = {model, &s, layer};
        /* stopped: an uncached call keeps nothing, and counts nothing (as kv_model_forward
         * over its scratch cache) */
        KV_TRY(in_chunks(c, 0, n_tokens, layer > 0, layer_chunk, &call));
    }
    finish_forward(model, &s, n_tokens, logits, all_logits);
    s.count.scratch_bytes += (int64_t)kv_cache_nbytes(&one_layer);
    kv_counters_add(counters, &s.count);
fail:
    run_state_free(&s);
    kv_cache_free(&one_layer);
    return status;
}

/* [quote ch01-kv-model-forward-uncached] */
kv_status kv_model_forward_uncached(const kv_model *model, const int32_t *tokens,
                                    int n_tokens, float *logits, int all_logits,
                                    kv_uncached_kv keep, kv_counters *counters) {
    kv_status status = KV_OK;
    kv_cache scratch = {0};
    kv_counters count = {0};
    KV_CHECK(model != NULL && logits != NULL && n_tokens > 0 &&
             (keep == KV_UNCACHED_ALL_LAYERS || keep == KV_UNCACHED_ONE_LAYER),
             KV_ERR_INVALID_ARG);
    KV_TRY(kv_model_check(model));
    const kv_config *c = &model->config;
    if (keep == KV_UNCACHED_ONE_LAYER) {
        KV_TRY(kv_check_tokens(c, tokens, n_tokens));
        return forward_one_layer_kv(model, tokens, n_tokens, logits, all_logits, counters);
    }
    KV_TRY(kv_cache_init(&scratch, c->n_layers, c->n_kv_heads, c->head_dim, n_tokens, NULL));
    KV_TRY(kv_model_forward(model, &scratch, tokens, n_tokens, logits, all_logits, &count));
    /* the K and V this call rebuilt from scratch are working memory too */
    count.scratch_bytes += (int64_t)kv_cache_nbytes(&scratch);
    kv_counters_add(counters, &count);
fail:
    kv_cache_free(&scratch);
/* [end ch01-kv-model-forward-uncached] */
    return status;
}
