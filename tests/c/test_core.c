/* test_core.c: tests of kvlab's C core on its own, without Python.
 *
 * Ops against naive loops, the contiguous cache, the paged pool's bookkeeping, every
 * cache element format's round trip, and a tiny random model whose cached, uncached and
 * paged runs must agree bit for bit (and, in quantized caches, prefill with decode), and
 * the two tiers of kernels, plain (plain.c) and fast (ops.c, attention.c), compared with
 * memcmp over formats, shapes and thread counts.
 * Built by the Makefile beside this file and run plainly and under valgrind (CI). Each
 * CHECK that fails prints where; the last line is "N passed, N failed".
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "dispatch.h"
#include "kvlab.h"
#include "ops.h"
#include "simd.h"
#include "paged.h"
#include "plain.h"
#include "quant.h"
#include "sampling.h"
#include "store.h"
#include "weight_formats.h"

static int passed, failed;

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (cond) {                                                         \
            passed++;                                                       \
        } else {                                                            \
            failed++;                                                       \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                   \
    } while (0)

static unsigned long long rng_state = 12345;

static float random_float(void) {   /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}

static float *random_floats(size_t n, float scale) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * random_float();
    return x;
}

/* ---- ops ------------------------------------------------------------------------------ */

/* One score of the softmax tests: mostly ordinary ones, but also -inf (a masked or padded
 * position), ties with the running max, exact zeros of both signs, denormals, very
 * negative ones (whose exponentials are 0) and NaN, each with some chance. */
static float edge_score(int kind) {
    switch (kind) {
    case 0: return -INFINITY;
    case 1: return 2.0f;           /* ties: a head's running max is often 2 as well */
    case 2: return -0.0f;
    case 3: return 0.0f;
    case 4: return 1e-40f * random_float();   /* denormal */
    case 5: return -100.0f + random_float();
    case 6: return NAN;
    default: return 8.0f * random_float();
    }
}

/* The same bits, or both NaN: which of two NaNs an addition passes on (their signs may
 * differ: -inf - -inf gives -NaN on x86) follows the order the compiler put the operands
 * in, which a + b leaves free; every number that is not NaN must match exactly. */
static int same_float(float a, float b) {
    return (a != a && b != b) || memcmp(&a, &b, sizeof a) == 0;
}

/* kv_softmax_tile8 against kv_softmax_tile, head by head, bit for bit: the exponentials
 * written back, the running max and sum and the correction, over tiles of every length,
 * the first tile (max -inf, sum 0), maxes that stay or rise, and edge scores; and that
 * the trials did reach the rare cases: NaN sums, maxes of -0, corrections of 0 and 1. */
static void test_softmax_tile8(void) {
    int exact = 1, nan_sums = 0, negative_zero_maxes = 0, first_tiles = 0, stays = 0;
    for (int trial = 0; trial < 4000; trial++) {
        int n = 1 + trial % 16, stride = trial % 3 == 0 ? 8 : 8 + trial % 11;
        int edgy = trial % 4 != 0;   /* one trial in four ordinary scores only */
        float lanes[16 * 24], heads[8][16], max8_[8], sum8[8], max1[8], sum1[8];
        float corrections[8], correction1[8];
        for (int m = 0; m < 8; m++) {
            int state = (trial / 16 + m) % 4;   /* first tile, a max of 2, one below, above */
            max1[m] = max8_[m] = state == 0 ? -INFINITY : state == 1 ? 2.0f : state * 3.0f - 9.0f;
            sum1[m] = sum8[m] = state == 0 ? 0.0f : 1.0f + random_float();
            for (int j = 0; j < n; j++) {
                int kind = edgy ? (int)((random_float() + 1.0f) * 8.0f) : 7;
                if (kind == 6 && trial % 8 != 1) kind = 7;   /* NaN rarely */
                heads[m][j] = lanes[j * stride + m] = edge_score(kind);
            }
        }
        for (int m = 0; m < 8; m++)
            correction1[m] = kv_softmax_tile(heads[m], n, &max1[m], &sum1[m]);
        kv_softmax_tile8(lanes, n, stride, max8_, sum8, corrections);
        for (int m = 0; m < 8; m++) {
            exact &= same_float(max1[m], max8_[m]) && same_float(sum1[m], sum8[m]);
            exact &= same_float(correction1[m], corrections[m]);
            for (int j = 0; j < n; j++) exact &= same_float(heads[m][j], lanes[j * stride + m]);
            nan_sums += sum8[m] != sum8[m];
            negative_zero_maxes += max8_[m] == 0.0f && signbit(max8_[m]);
            first_tiles += corrections[m] == 0.0f;
            stays += corrections[m] == 1.0f;
        }
    }
    CHECK(exact);
    CHECK(nan_sums > 0 && negative_zero_maxes > 0 && first_tiles > 0 && stays > 0);
}

static void test_ops(void) {
    for (int n = 1; n <= 40; n += 3) {
        float *a = random_floats(n, 1.0f), *b = random_floats(n, 1.0f);
        double want = 0;
        for (int i = 0; i < n; i++) want += (double)a[i] * b[i];
        CHECK(fabs(kv_fast_dot(a, b, n) - want) < 1e-5);
        free(a);
        free(b);
    }
    /* matmul: every element equals kv_dot of its row, bit for bit, whatever the tiling */
    int tokens = 5, in = 19, out = 7;
    float *x = random_floats((size_t)tokens * in, 1.0f), *w = random_floats((size_t)out * in, 1.0f);
    float *y = malloc(sizeof(float) * tokens * out);
    kv_matmul(y, x, w, tokens, in, out);
    int exact = 1;
    for (int t = 0; t < tokens; t++)
        for (int o = 0; o < out; o++)
            exact &= y[t * out + o] == kv_fast_dot(w + o * in, x + t * in, in);
    CHECK(exact);
    free(x); free(w); free(y);

    /* the online softmax over two tiles (the max rises in the second) gives the plain
     * softmax: weights e^(s - max) rescaled by the corrections, divided by the sum */
    float s[20], expected[20], plain_sum = 0;
    for (int i = 0; i < 20; i++) s[i] = i == 4 ? -50.0f : (float)(i % 7) + (i >= 16 ? 3.0f : 0.0f);
    for (int i = 0; i < 20; i++) plain_sum += expected[i] = expf(s[i] - 8.0f);   /* max is 8 */
    float running_max = -INFINITY, running_sum = 0.0f;
    float first = kv_softmax_tile(s, 16, &running_max, &running_sum);
    float second = kv_softmax_tile(s + 16, 4, &running_max, &running_sum);
    CHECK(first == 0.0f && running_max == 8.0f && fabsf(second - expf(6.0f - 8.0f)) < 1e-7f);
    CHECK(fabsf(running_sum - plain_sum) < 1e-5f * plain_sum);
    int close = 1;
    for (int i = 0; i < 20; i++) {
        float weight = (i < 16 ? s[i] * second : s[i]) / running_sum;
        close &= fabsf(weight - expected[i] / plain_sum) < 1e-6f;
    }
    CHECK(close && s[4] < 1e-20f);
    running_max = 2.0f;   /* the max stays: the correction is exactly 1 */
    float again[3] = {1.0f, 2.0f, 0.5f};
    CHECK(kv_softmax_tile(again, 3, &running_max, &running_sum) == 1.0f && again[1] == 1.0f);

    float v[4] = {3, 4, 0, 0}, ones[4] = {1, 1, 1, 1}, normed[4];
    kv_rmsnorm(normed, v, ones, 4, 0.0f + 1e-12f);    /* rms = 2.5 */
    CHECK(fabsf(normed[0] - 1.2f) < 1e-6f && fabsf(normed[1] - 1.6f) < 1e-6f);

    /* RoPE by a quarter turn swaps the pair, in both layouts */
    float c[1] = {0.0f}, sn[1] = {1.0f};
    float inter[2] = {1, 2}, half[2] = {1, 2};
    kv_rope(inter, 1, 2, c, sn, 1);
    kv_rope(half, 1, 2, c, sn, 0);
    CHECK(inter[0] == -2 && inter[1] == 1 && half[0] == -2 && half[1] == 1);

    /* SwiGLU: silu(g) * u to a float's rounding, for large negative and positive gates
     * too, and each value's result independent of where it falls (last partial chunk or
     * inside a longer run) */
    float gates[13], ups[13], long_gates[21], long_ups[21];
    for (int i = 0; i < 13; i++) {
        gates[i] = (float)(i - 6) * 7.5f;   /* -45 .. 45 */
        ups[i] = 0.5f + 0.1f * (float)i;
    }
    for (int i = 0; i < 21; i++) {
        long_gates[i] = gates[i % 13];
        long_ups[i] = ups[i % 13];
    }
    int swiglu_close = 1;
    float expected_swiglu[13];
    for (int i = 0; i < 13; i++) {
        double g = gates[i];
        expected_swiglu[i] = (float)(g / (1.0 + exp(-g)) * ups[i]);
    }
    kv_swiglu(gates, ups, 13);
    kv_swiglu(long_gates, long_ups, 21);
    for (int i = 0; i < 13; i++)
        swiglu_close &= fabsf(gates[i] - expected_swiglu[i]) <= 2e-6f * (1.0f + fabsf(expected_swiglu[i]));
    CHECK(swiglu_close);
    CHECK(memcmp(gates + 8, long_gates + 8, 5 * sizeof(float)) == 0);   /* tail vs inside */

    /* arg-max as numpy.argmax: the first of equal values, the first NaN if any */
    float ties[5] = {1.0f, 3.0f, -2.0f, 3.0f, 0.0f};
    CHECK(kv_argmax(ties, 5) == 1);
    float with_nan[4] = {1.0f, 9.0f, NAN, NAN};
    CHECK(kv_argmax(with_nan, 4) == 2);
    float all_low[3] = {-INFINITY, -INFINITY, -INFINITY};
    CHECK(kv_argmax(all_low, 3) == 0);

    /* sampling: the first token whose cumulative probability passes u, after the cuts */
    float logits[5] = {0.0f, 5.0f, 4.0f, -3.0f, 4.5f};
    double sample_scratch[5 * 4];
    kv_sampling greedy = {0.0, 0, 1.0}, plain = {1.0, 0, 1.0}, top2 = {1.0, 2, 1.0};
    kv_sampling nucleus = {1.0, 0, 0.01}, hot = {100.0, 0, 1.0};
    CHECK(kv_sample_scratch_bytes(5) <= sizeof sample_scratch);
    CHECK(kv_sample(logits, 5, &greedy, 0.7, sample_scratch) == 1);
    CHECK(kv_sample(logits, 5, &plain, 0.0, sample_scratch) == 0);      /* p(0) > 0 */
    CHECK(kv_sample(logits, 5, &plain, 0.9999, sample_scratch) == 4);
    CHECK(kv_sample(logits, 5, &top2, 0.0, sample_scratch) == 1);       /* 0 is cut */
    CHECK(kv_sample(logits, 5, &top2, 0.9999, sample_scratch) == 4);
    CHECK(kv_sample(logits, 5, &nucleus, 0.9999, sample_scratch) == 1);
    /* at a high temperature each token gets about a fifth: u = 0.5 lands on the middle one */
    CHECK(kv_sample(logits, 5, &hot, 0.5, sample_scratch) == 2);
    float with_nan_logit[3] = {1.0f, NAN, 0.0f};
    CHECK(kv_sample(with_nan_logit, 3, &plain, 0.5, sample_scratch) == -1);
    CHECK(kv_sample(with_nan_logit, 3, &greedy, 0.5, sample_scratch) == -1);   /* not argmax's 1 */
    CHECK(kv_sample(all_low, 3, &plain, 0.5, sample_scratch) == -1);
}

/* ---- a tiny random model ---------------------------------------------------------------- */

typedef struct {
    kv_model model;
    float *buffers[13];
} test_model;

static void make_model_sized(test_model *tm, int dim, int hidden_dim, int n_heads,
                             int n_kv_heads, int head_dim) {
    kv_config c = {.dim = dim, .hidden_dim = hidden_dim, .n_layers = 2, .n_heads = n_heads,
                   .n_kv_heads = n_kv_heads, .head_dim = head_dim, .vocab_size = 31,
                   .max_seq_len = 64, .norm_eps = 1e-5f, .rope_interleaved = 1};
    size_t L = c.n_layers, D = c.dim, H = c.hidden_dim, V = c.vocab_size;
    size_t Q = (size_t)n_heads * head_dim, KV = (size_t)n_kv_heads * head_dim;
    size_t sizes[13] = {V * D, L * D, L * Q * D, L * KV * D, L * KV * D, L * D * Q,
                        L * D, L * H * D, L * D * H, L * H * D, D, V * D, (size_t)head_dim / 2};
    memset(tm, 0, sizeof *tm);   /* every matrix float32 (a zeroed format) */
    kv_weights *w = &tm->model.weights;
    const void **slots[13] = {&w->token_embedding.data, (const void **)&w->attn_norm,
                              &w->wq.data, &w->wk.data, &w->wv.data, &w->wo.data,
                              (const void **)&w->ffn_norm, &w->w1.data, &w->w2.data, &w->w3.data,
                              (const void **)&w->final_norm, &w->classifier.data,
                              (const void **)&w->rope_inv_freq};
    tm->model.config = c;
    for (int i = 0; i < 13; i++) {
        tm->buffers[i] = random_floats(sizes[i], 0.3f);
        *slots[i] = tm->buffers[i];
    }
    for (int i = 0; i < head_dim / 2; i++)
        tm->buffers[12][i] = powf(10000.0f, -2.0f * i / head_dim);
}

static void make_model(test_model *tm, int n_heads, int n_kv_heads, int head_dim) {
    make_model_sized(tm, 24, 40, n_heads, n_kv_heads, head_dim);
}

static void free_model(test_model *tm) {
    for (int i = 0; i < 13; i++) free(tm->buffers[i]);
}

static void test_model_paths_agree(int n_heads, int n_kv_heads, int head_dim,
                                   const kv_cache_format *format) {
    test_model tm;
    make_model(&tm, n_heads, n_kv_heads, head_dim);
    const kv_model *m = &tm.model;
    int V = m->config.vocab_size;
    int32_t tokens[20];
    for (int i = 0; i < 20; i++) tokens[i] = (int32_t)(i * 7 % V);
    CHECK(kv_model_check(m) == KV_OK);

    kv_cache cache, stepped;   /* stepped: the same tokens one decode step at a time */
    CHECK(kv_cache_init(&cache, m->config.n_layers, n_kv_heads, head_dim, 20, format) == KV_OK);
    CHECK(kv_cache_init(&stepped, m->config.n_layers, n_kv_heads, head_dim, 20, format) == KV_OK);
    kv_pool pool;
    CHECK(kv_pool_init(&pool, m->config.n_layers, n_kv_heads, head_dim, 16, 3, 4, 16, format) == KV_OK);
    int seq;
    CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);

    float *cached = malloc(sizeof(float) * V), *paged = malloc(sizeof(float) * V);
    float *uncached = malloc(sizeof(float) * V), *step = malloc(sizeof(float) * V);
    kv_counters counters = {0};
    CHECK(kv_model_forward(m, &cache, tokens, 8, cached, 0, &counters) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, seq, tokens, 8, paged, 0, NULL) == KV_OK);
    for (int i = 0; i < 8; i++)
        CHECK(kv_model_forward(m, &stepped, tokens + i, 1, step, 0, NULL) == KV_OK);
    CHECK(counters.tokens == 8 && counters.calls == 1 && counters.flops_mlp > 0);
    int all_equal = memcmp(cached, step, sizeof(float) * V) == 0, uncached_equal = 1;
    for (int i = 8; i < 20; i++) {
        CHECK(kv_model_forward(m, &cache, tokens + i, 1, cached, 0, NULL) == KV_OK);
        CHECK(kv_model_forward_paged(m, &pool, seq, tokens + i, 1, paged, 0, NULL) == KV_OK);
        kv_counters all_layers = {0}, one_layer = {0};
        CHECK(kv_model_forward_uncached(m, tokens, i + 1, uncached, 0, KV_UNCACHED_ALL_LAYERS,
                                        &all_layers) == KV_OK);
        uncached_equal &= memcmp(cached, uncached, sizeof(float) * V) == 0;
        /* one layer's K and V at a time: the same bits, and that layer's K and V fewer
         * bytes of scratch for every other layer */
        CHECK(kv_model_forward_uncached(m, tokens, i + 1, uncached, 0, KV_UNCACHED_ONE_LAYER,
                                        &one_layer) == KV_OK);
        uncached_equal &= memcmp(cached, uncached, sizeof(float) * V) == 0;
        CHECK(all_layers.scratch_bytes - one_layer.scratch_bytes ==
              (int64_t)(m->config.n_layers - 1) * 2 * (i + 1) * n_kv_heads * head_dim *
              (int64_t)sizeof(float));
        CHECK(one_layer.flops_attention == all_layers.flops_attention &&
              one_layer.tokens == all_layers.tokens);
        all_equal &= memcmp(cached, paged, sizeof(float) * V) == 0;
    }
    CHECK(all_equal);
    /* the no-cache path computes in fp32, so only an fp32 cache matches it exactly */
    if (format == NULL) CHECK(uncached_equal);
    char message[256];
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);

    /* errors change nothing */
    int32_t bad = V;
    CHECK(kv_model_forward(m, &cache, &bad, 1, cached, 0, NULL) == KV_ERR_TOKEN_RANGE);
    CHECK(kv_model_forward(m, &cache, tokens, 1, cached, 0, NULL) == KV_ERR_CACHE_FULL);
    CHECK(kv_model_forward_uncached(m, &bad, 1, uncached, 0, KV_UNCACHED_ONE_LAYER, NULL) ==
          KV_ERR_TOKEN_RANGE);
    CHECK(kv_model_forward_uncached(m, tokens, 2, uncached, 0, (kv_uncached_kv)2, NULL) ==
          KV_ERR_INVALID_ARG);
    CHECK(cache.length == 20);

    /* the greedy loop in C: the same picks and the same cache as decode steps with an
     * arg-max between them; no room for all the steps changes nothing */
    kv_cache looped;
    CHECK(kv_cache_init(&looped, m->config.n_layers, n_kv_heads, head_dim, 20, format) == KV_OK);
    /* (a cache with a residual window can only be reset, not cut back to 8) */
    CHECK(kv_cache_truncate(&stepped, 0) == KV_OK);
    CHECK(kv_model_forward(m, &stepped, tokens, 8, step, 0, NULL) == KV_OK);
    {
        CHECK(kv_model_forward(m, &looped, tokens, 8, step, 0, NULL) == KV_OK);
        int32_t picks[12], by_hand[12], first = kv_argmax(step, V), n_steps = 0;
        double seconds[12];
        kv_counters looped_count = {0};
        CHECK(kv_model_generate(m, &looped, first, 13, -1, NULL, NULL, picks, seconds, &n_steps,
                                       NULL) == KV_ERR_CACHE_FULL && looped.length == 8);
        CHECK(kv_model_generate(m, &looped, first, 12, -1, NULL, NULL, picks, seconds, &n_steps,
                                       &looped_count) == KV_OK);
        int32_t token = first;
        for (int i = 0; i < 12; i++) {
            CHECK(kv_model_forward(m, &stepped, &token, 1, step, 0, NULL) == KV_OK);
            by_hand[i] = token = kv_argmax(step, V);
        }
        CHECK(n_steps == 12 && looped.length == 20 && looped_count.calls == 12);
        CHECK(memcmp(picks, by_hand, sizeof picks) == 0 && seconds[11] > 0.0);
        /* stopping: after the step that picks the stop token, which is kept */
        CHECK(kv_cache_truncate(&looped, 0) == KV_OK);
        CHECK(kv_model_forward(m, &looped, tokens, 8, step, 0, NULL) == KV_OK);
        CHECK(kv_model_generate(m, &looped, first, 12, by_hand[4], NULL, NULL, picks, NULL,
                                       &n_steps, NULL) == KV_OK);
        int stop_at = 0;
        while (by_hand[stop_at] != by_hand[4]) stop_at++;
        CHECK(n_steps == stop_at + 1 && picks[stop_at] == by_hand[4] && looped.length == 9 + stop_at);

        /* sampled: the same draws as forward + kv_sample with the same numbers */
        kv_sampling how = {0.8, 5, 0.9};
        double uniforms[12], *sample_scratch = malloc(kv_sample_scratch_bytes(V));
        for (int i = 0; i < 12; i++) uniforms[i] = (double)((i * 37) % 100) / 100.0;
        CHECK(kv_cache_truncate(&looped, 0) == KV_OK && kv_cache_truncate(&stepped, 0) == KV_OK);
        CHECK(kv_model_forward(m, &looped, tokens, 8, step, 0, NULL) == KV_OK);
        CHECK(kv_model_forward(m, &stepped, tokens, 8, step, 0, NULL) == KV_OK);
        CHECK(kv_model_generate(m, &looped, first, 12, -1, &how, NULL, picks, NULL, &n_steps,
                                NULL) == KV_ERR_INVALID_ARG && looped.length == 8);
        CHECK(kv_model_generate(m, &looped, first, 12, -1, &how, uniforms, picks, NULL, &n_steps,
                                NULL) == KV_OK && n_steps == 12);
        token = first;
        for (int i = 0; i < 12; i++) {
            CHECK(kv_model_forward(m, &stepped, &token, 1, step, 0, NULL) == KV_OK);
            by_hand[i] = token = kv_sample(step, V, &how, uniforms[i], sample_scratch);
        }
        CHECK(memcmp(picks, by_hand, sizeof picks) == 0);
        free(sample_scratch);
    }
    kv_cache_free(&looped);

    free(cached); free(paged); free(uncached); free(step);
    kv_cache_free(&cache);
    kv_cache_free(&stepped);
    kv_pool_free(&pool);
    free_model(&tm);
}


/* ---- the two tiers: plain and fast kernels give the same bits ------------------------------ */

static int same_bits(const float *a, const float *b, size_t n) {
    return memcmp(a, b, n * sizeof(float)) == 0;
}

/* dot products, RMSNorm, RoPE and SwiGLU, over lengths with and without leftovers past the
 * last chunk of eight */
static void test_tiers_small_ops(void) {
    int dot_same = 1, norm_same = 1, rope_same = 1;
    for (int n = 0; n <= 70; n++) {
        float *a = random_floats((size_t)n + 1, 2.0f), *b = random_floats((size_t)n + 1, 2.0f);
        float *w = random_floats((size_t)n + 1, 1.0f);
        float fast[72], plain[72];
        float d_fast = kv_fast_dot(a, b, n), d_plain = kv_plain_dot(a, b, n);
        dot_same &= memcmp(&d_fast, &d_plain, sizeof d_fast) == 0;
        if (n > 0) {
            kv_rmsnorm(fast, a, w, n, 1e-5f);
            kv_plain_rmsnorm(plain, a, w, n, 1e-5f);
            norm_same &= same_bits(fast, plain, (size_t)n);
        }
        free(a); free(b); free(w);
    }
    for (int head_dim = 2; head_dim <= 40; head_dim += 2) {
        for (int interleaved = 0; interleaved <= 1; interleaved++) {
            int n_heads = 3;
            float *fast = random_floats((size_t)n_heads * head_dim, 3.0f);
            float *plain = malloc(sizeof(float) * n_heads * head_dim);
            memcpy(plain, fast, sizeof(float) * n_heads * head_dim);
            float cos_t[20], sin_t[20];
            for (int i = 0; i < head_dim / 2; i++) {
                float angle = 7.0f * powf(10000.0f, -2.0f * i / head_dim);
                cos_t[i] = cosf(angle);
                sin_t[i] = sinf(angle);
            }
            kv_rope(fast, n_heads, head_dim, cos_t, sin_t, interleaved);
            kv_plain_rope(plain, n_heads, head_dim, cos_t, sin_t, interleaved);
            rope_same &= same_bits(fast, plain, (size_t)n_heads * head_dim);
            free(fast); free(plain);
        }
    }
    CHECK(dot_same);
    CHECK(norm_same);
    CHECK(rope_same);

    /* SwiGLU over gates from -100 to 100 (e^-g underflows past 87), zeros of both signs,
     * and lengths that end inside a chunk of eight; the longest is split over threads */
    int swiglu_same = 1;
    size_t lengths[] = {1, 5, 8, 13, 64, 1001, 140007};
    for (size_t k = 0; k < sizeof lengths / sizeof lengths[0]; k++) {
        size_t n = lengths[k];
        float *fast = random_floats(n, 100.0f), *up = random_floats(n, 2.0f);
        if (n > 3) fast[1] = 0.0f, fast[2] = -0.0f, fast[3] = 1e-30f;
        float *plain = malloc(n * sizeof(float));
        memcpy(plain, fast, n * sizeof(float));
        for (int threads = 1; threads <= 2; threads++) {
            memcpy(fast, plain, n * sizeof(float));
            kv_set_num_threads(threads);
            kv_swiglu(fast, up, n);
            float *expected = malloc(n * sizeof(float));
            memcpy(expected, plain, n * sizeof(float));
            kv_plain_swiglu(expected, up, n);
            swiglu_same &= same_bits(fast, expected, n);
            free(expected);
        }
        free(fast); free(plain); free(up);
    }
    kv_set_num_threads(1);
    CHECK(swiglu_same);
}

/* The matrix product over shapes that reach each of the fast kernel's paths: fewer than 16
 * tokens (decode), triples of tokens and the one or two left over, more than KV_TOKEN_CHUNK
 * tokens (chunks of tokens, the last one short), rows longer than 1,024 (panels of columns), out_dim not a multiple
 * of 4, and in_dim not a multiple of 8; one and two threads; several matrices at once. */
static void test_tiers_matmul(void) {
    /* 4-13: the 512-bit tile's sizes (1 to 6 pairs), 5, 9, 11 and 13 with a lone token in
     * the last pair */
    int tokens[] = {1, 2, 3, 4, 5, 9, 11, 12, 13, 16, 17, 50, 97, KV_TOKEN_CHUNK + 2,
                    2 * KV_TOKEN_CHUNK + 5};
    int ins[] = {1, 7, 8, 19, 64, 1030};
    int outs[] = {1, 3, 4, 7, 9, 33};
    int all_same = 1, many_same = 1;
    for (int threads = 1; threads <= 2; threads++) {
        kv_set_num_threads(threads);
        for (size_t a = 0; a < sizeof tokens / sizeof tokens[0]; a++) {
            for (size_t b = 0; b < sizeof ins / sizeof ins[0]; b++) {
                int n_tokens = tokens[a], in_dim = ins[b];
                float *x = random_floats((size_t)n_tokens * in_dim, 1.0f);
                for (size_t c = 0; c < sizeof outs / sizeof outs[0]; c++) {
                    int out_dim = outs[c];
                    float *w = random_floats((size_t)out_dim * in_dim, 1.0f);
                    float *fast = malloc(sizeof(float) * n_tokens * out_dim);
                    float *plain = malloc(sizeof(float) * n_tokens * out_dim);
                    kv_matmul(fast, x, w, n_tokens, in_dim, out_dim);
                    kv_plain_matmul(plain, x, w, n_tokens, in_dim, out_dim);
                    all_same &= same_bits(fast, plain, (size_t)n_tokens * out_dim);
                    free(w); free(fast); free(plain);
                }
                /* Wq, Wk and Wv of different heights in one call */
                int dims[3] = {33, 9, 9};
                float *ws[3], *fast[3], *plain[3];
                for (int m = 0; m < 3; m++) {
                    ws[m] = random_floats((size_t)dims[m] * in_dim, 1.0f);
                    fast[m] = malloc(sizeof(float) * n_tokens * dims[m]);
                    plain[m] = malloc(sizeof(float) * n_tokens * dims[m]);
                    kv_plain_matmul(plain[m], x, ws[m], n_tokens, in_dim, dims[m]);
                }
                kv_matmul_many(3, fast, (const float *const *)ws, dims, x, n_tokens, in_dim);
                for (int m = 0; m < 3; m++) {
                    many_same &= same_bits(fast[m], plain[m], (size_t)n_tokens * dims[m]);
                    free(ws[m]); free(fast[m]); free(plain[m]);
                }
                free(x);
            }
        }
    }
    kv_set_num_threads(1);
    CHECK(all_same);
    CHECK(many_same);
}

/* Both tiers of attention over one layer of n_positions random K/V rows, in a contiguous
 * cache (block_size 0) or a paged pool of blocks of block_size, for a prefill of 7 new
 * tokens and for a decode step; 1 if every output is bit-identical. A format that does not
 * suit head_dim (a group that does not divide it) counts as agreeing. */
static int attention_tiers_agree(int n_heads, int n_kv_heads, int head_dim,
                                 const kv_cache_format *format, int block_size, int n_threads) {
    if (format != NULL &&
        (kv_store_group(format->key_format, format->key_group, head_dim) < 0 ||
         kv_store_group(format->value_format, format->value_group, head_dim) < 0))
        return 1;
    enum { n_positions = 45 };
    int kv_dim = n_kv_heads * head_dim, q_dim = n_heads * head_dim;
    float *keys = random_floats((size_t)n_positions * kv_dim, 2.0f);
    float *values = random_floats((size_t)n_positions * kv_dim, 1.0f);
    int32_t ids[n_positions] = {0};
    kv_cache cache = {0};
    kv_pool pool = {0};
    int seq = 0, same = 1;
    if (block_size == 0) {
        same &= kv_cache_init(&cache, 1, n_kv_heads, head_dim, n_positions, format) == KV_OK;
        same &= kv_cache_append(&cache, n_positions, keys, values) == KV_OK;
    } else {
        int n_blocks = (n_positions + block_size - 1) / block_size;
        same &= kv_pool_init(&pool, 1, n_kv_heads, head_dim, n_blocks + 2, block_size, 1,
                             n_blocks, format) == KV_OK;
        same &= kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK;
        same &= kv_pool_append(&pool, seq, ids, n_positions, keys, values) == KV_OK;
    }
    size_t stride = kv_attention_scratch(n_heads, n_kv_heads, head_dim);
    float *scratch = malloc(sizeof(float) * stride * n_threads);
    float *q = random_floats((size_t)7 * q_dim, 2.0f);
    float *fast = malloc(sizeof(float) * 7 * q_dim), *plain = malloc(sizeof(float) * 7 * q_dim);
    int n_new[2] = {7, 1};
    for (int k = 0; k < 2 && same; k++) {
        int n_tokens = n_new[k], start_pos = n_positions - n_tokens;
        kv_layer_view view = block_size == 0 ? kv_cache_layer_view(&cache, 0)
                                             : kv_pool_layer_view(&pool, seq, 0);
        /* as in a forward call: the newest rows also come as computed (the window's) */
        view.new_key = keys + (size_t)start_pos * kv_dim;
        view.new_value = values + (size_t)start_pos * kv_dim;
        view.new_start = start_pos;
        memset(scratch, 0xFF, sizeof(float) * stride * n_threads);   /* NaN: unread */
        kv_attention(fast, q, &view, n_tokens, start_pos, n_heads, n_kv_heads, head_dim,
                     scratch, stride, n_threads);
        memset(scratch, 0xFF, sizeof(float) * stride * n_threads);
        kv_plain_attention(plain, q, &view, n_tokens, start_pos, n_heads, n_kv_heads, head_dim,
                           scratch, stride, n_threads);
        same &= same_bits(fast, plain, (size_t)n_tokens * q_dim);
    }
    free(keys); free(values); free(scratch); free(q); free(fast); free(plain);
    kv_cache_free(&cache);
    kv_pool_free(&pool);
    return same;
}

static void test_tiers_attention(void) {
    const kv_cache_format formats[] = {
        {KV_FMT_F32, KV_FMT_F32, 0, 0, 0},
        {KV_FMT_F16, KV_FMT_F16, 0, 0, 0},
        {KV_FMT_BF16, KV_FMT_BF16, 0, 0, 0},
        {KV_FMT_I8, KV_FMT_I8, 0, 0, 0},       /* a scale per head */
        {KV_FMT_I4, KV_FMT_I4, 0, 0, 0},       /* groups of 32 where they fit */
        {KV_FMT_FP8, KV_FMT_FP8, 0, 0, 0},
        {KV_FMT_I8, KV_FMT_FP8, 8, 2, 0},      /* groups of 8 (decoded in registers), of 2 */
        {KV_FMT_I4, KV_FMT_I8, 4, 6, 0},       /* groups that are no power of two */
        {KV_FMT_F32, KV_FMT_F32, 0, 0, 4},     /* with residual windows */
        {KV_FMT_I8, KV_FMT_I4, 0, 0, 3},
        {KV_FMT_F16, KV_FMT_BF16, 0, 0, 5},
        {KV_FMT_FP8, KV_FMT_I8, 0, 0, 20},     /* a window wider than the new tokens */
    };
    int heads[][2] = {{4, 4}, {6, 2}, {8, 2}, {7, 1}};   /* MHA, GQA (3 and 4), MQA (7) */
    int head_dims[] = {6, 8, 10, 16, 36, 64};
    int block_sizes[] = {0, 5, 16};
    int cases = 0, agreeing = 0;
    for (size_t f = 0; f < sizeof formats / sizeof formats[0]; f++)
        for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++)
            for (size_t d = 0; d < sizeof head_dims / sizeof head_dims[0]; d++)
                for (size_t b = 0; b < sizeof block_sizes / sizeof block_sizes[0]; b++)
                    for (int threads = 1; threads <= 2; threads++) {
                        int ok = attention_tiers_agree(heads[h][0], heads[h][1], head_dims[d],
                                                       &formats[f], block_sizes[b], threads);
                        if (!ok)
                            fprintf(stderr, "attention tiers differ: format %zu, %d/%d heads, "
                                    "head_dim %d, block %d, %d threads\n", f, heads[h][0],
                                    heads[h][1], head_dims[d], block_sizes[b], threads);
                        cases++;
                        agreeing += ok;
                    }
    CHECK(cases == agreeing);
}

/* ---- attention of a prefill's tokens in blocks (attention.c's QUERY_TILE) ----------------- */

/* K/V rows of positions 0 .. n_rows - 1 laid out three ways: a contiguous cache (layout 0),
 * a contiguous cache turned as a ring so that its rows run past the end of its memory to its
 * beginning (layout 1: n_rows - turn rows from slot `turn` on, the rest from slot 0), or a
 * paged pool of blocks of `layout` rows (layout >= 2); a ring of one row is not turned.
 * Returns 0 where the format cannot be
 * laid out so (a ring refuses a residual window). */
static int lay_out_rows(kv_cache *cache, kv_pool *pool, int *seq, int layout, int n_rows,
                        int turn, int n_kv_heads, int head_dim, const kv_cache_format *format,
                        const float *keys, const float *values) {
    int kv_dim = n_kv_heads * head_dim, ok = 1;
    if (layout >= 2) {
        int n_blocks = (n_rows + layout - 1) / layout;
        int32_t *ids = calloc((size_t)n_rows, sizeof(int32_t));
        ok = kv_pool_init(pool, 1, n_kv_heads, head_dim, n_blocks + 2, layout, 1, n_blocks,
                          format) == KV_OK &&
             kv_blocks_seq_new(&pool->blocks, seq) == KV_OK &&
             kv_pool_append(pool, *seq, ids, n_rows, keys, values) == KV_OK;
        free(ids);
        return ok;
    }
    if (layout == 1 && format != NULL && format->window > 0) return 0;
    /* a cache holds at least its residual window */
    int capacity = format != NULL && format->window > n_rows ? format->window : n_rows;
    ok = kv_cache_init(cache, 1, n_kv_heads, head_dim, capacity, format) == KV_OK;
    if (layout == 1 && turn > 0) {   /* `turn` rows in front, then dropped: the ring turns past them */
        float *front = random_floats((size_t)turn * kv_dim, 1.0f);
        int n_keep = n_rows - turn;
        int32_t *rows = malloc(sizeof(int32_t) * (size_t)n_keep * n_kv_heads);
        for (int i = 0; i < n_keep; i++)
            for (int head = 0; head < n_kv_heads; head++) rows[i * n_kv_heads + head] = turn + i;
        ok = ok && kv_cache_append(cache, turn, front, front) == KV_OK &&
             kv_cache_append(cache, n_keep, keys, values) == KV_OK &&
             kv_cache_keep(cache, n_keep, rows) == KV_OK && cache->ring_start == turn &&
             kv_cache_append(cache, turn, keys + (size_t)n_keep * kv_dim,
                             values + (size_t)n_keep * kv_dim) == KV_OK;
        free(front);
        free(rows);
        return ok;
    }
    return ok && kv_cache_append(cache, n_rows, keys, values) == KV_OK;
}

/* A prefill of n_new tokens after n_before positions: 1 if every token's output is, bit for
 * bit, the plain tier's and the fast tier's for that token alone (a decode step). */
static int prefill_blocks_agree(int n_heads, int n_kv_heads, int head_dim,
                                const kv_cache_format *format, int layout, int n_before,
                                int n_new, int n_threads) {
    if (kv_store_group(format->key_format, format->key_group, head_dim) < 0 ||
        kv_store_group(format->value_format, format->value_group, head_dim) < 0)
        return 1;   /* a group that does not divide head_dim: no such cache */
    int n_rows = n_before + n_new, kv_dim = n_kv_heads * head_dim, q_dim = n_heads * head_dim;
    float *keys = random_floats((size_t)n_rows * kv_dim, 2.0f);
    float *values = random_floats((size_t)n_rows * kv_dim, 1.0f);
    kv_cache cache = {0};
    kv_pool pool = {0};
    int seq = 0, same = 1;
    if (!lay_out_rows(&cache, &pool, &seq, layout, n_rows, n_rows / 2, n_kv_heads, head_dim,
                      format, keys, values)) {
        same = layout == 1 && format != NULL && format->window > 0;   /* refused, rightly */
        n_new = 0;
    }
    kv_layer_view view = layout >= 2 ? kv_pool_layer_view(&pool, seq, 0)
                                     : kv_cache_layer_view(&cache, 0);
    /* as in a forward call: the new rows also come as computed (the residual window's) */
    view.new_key = keys + (size_t)n_before * kv_dim;
    view.new_value = values + (size_t)n_before * kv_dim;
    view.new_start = n_before;
    size_t stride = kv_attention_scratch(n_heads, n_kv_heads, head_dim);
    float *scratch = malloc(sizeof(float) * stride * n_threads);
    float *q = random_floats((size_t)n_rows * q_dim, 2.0f);
    float *out[3];
    for (int k = 0; k < 3; k++) out[k] = malloc(sizeof(float) * ((size_t)n_rows * q_dim + 1));
    if (n_new > 0) {
        kv_attention(out[0], q, &view, n_new, n_before, n_heads, n_kv_heads, head_dim,
                     scratch, stride, n_threads);
        kv_plain_attention(out[1], q, &view, n_new, n_before, n_heads, n_kv_heads, head_dim,
                           scratch, stride, n_threads);
        for (int t = 0; t < n_new; t++)
            kv_attention(out[2] + (size_t)t * q_dim, q + (size_t)t * q_dim, &view, 1,
                         n_before + t, n_heads, n_kv_heads, head_dim, scratch, stride, 1);
        same = same_bits(out[0], out[1], (size_t)n_new * q_dim) &&
               same_bits(out[0], out[2], (size_t)n_new * q_dim);
    }
    for (int k = 0; k < 3; k++) free(out[k]);
    free(keys); free(values); free(scratch); free(q);
    kv_cache_free(&cache);
    kv_pool_free(&pool);
    return same;
}

/* Prefills shorter than, as long as and a row longer than a block of tokens, and longer
 * ones (odd ones; ones that start on, just before and just after a tile's edge, so that a
 * block's first token sees whole tiles only, or one row more), over the three layouts, for
 * MHA, GQA (groups of 3 and 4) and MQA, head sizes with and without leftovers, float32 and
 * quantized rows, residual windows narrower and wider than a tile. */
static void test_attention_prefill_blocks(void) {
    const kv_cache_format formats[] = {
        {KV_FMT_F32, KV_FMT_F32, 0, 0, 0},
        {KV_FMT_I8, KV_FMT_I8, 0, 0, 0},
        {KV_FMT_I4, KV_FMT_FP8, 4, 2, 0},      /* groups decoded into the tile buffer */
        {KV_FMT_F16, KV_FMT_BF16, 0, 0, 5},    /* with residual windows */
        {KV_FMT_F32, KV_FMT_F32, 0, 0, 20},
    };
    int heads[][2] = {{4, 4}, {9, 3}, {8, 2}, {7, 1}};
    int head_dims[] = {10, 48};   /* a chunk of eight and leftovers; six chunks */
    int layouts[] = {0, 1, 3, 16};
    int spans[][2] = {{0, 1}, {0, 2}, {0, 3}, {0, 5}, {0, 8}, {0, 9}, {0, 45}, {15, 4},
                      {16, 16}, {31, 14}, {29, 19}, {11, 22}};
    int cases = 0, agreeing = 0;
    for (size_t f = 0; f < sizeof formats / sizeof formats[0]; f++)
        for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++)
            for (size_t d = 0; d < sizeof head_dims / sizeof head_dims[0]; d++)
                for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++)
                    for (size_t s = 0; s < sizeof spans / sizeof spans[0]; s++) {
                        int threads = 1 + (int)(s % 2);
                        int ok = prefill_blocks_agree(heads[h][0], heads[h][1], head_dims[d],
                                                      &formats[f], layouts[l], spans[s][0],
                                                      spans[s][1], threads);
                        if (!ok)
                            fprintf(stderr, "prefill attention differs: format %zu, %d/%d "
                                    "heads, head_dim %d, layout %d, %d after %d, %d threads\n",
                                    f, heads[h][0], heads[h][1], head_dims[d], layouts[l],
                                    spans[s][1], spans[s][0], threads);
                        cases++;
                        agreeing += ok;
                    }
    CHECK(cases == agreeing);
}

/* The whole model on each tier: prefill with every token's logits, decode steps, the
 * paged pool, a batch, and the generation loop give the same bits. */
static void test_model_tiers_agree(int n_heads, int n_kv_heads, int head_dim,
                                   const kv_cache_format *format, int threads) {
    test_model tm;
    make_model(&tm, n_heads, n_kv_heads, head_dim);
    const kv_model *m = &tm.model;
    int V = m->config.vocab_size, L = m->config.n_layers;
    int32_t tokens[20];
    for (int i = 0; i < 20; i++) tokens[i] = (int32_t)(i * 11 % V);
    size_t per_tier = (size_t)V * 20 /* prefill */ + (size_t)V * 6 /* decode */ +
                      (size_t)V * 20 /* paged */ + (size_t)V * 2 /* batch */;
    float *logits[2] = {malloc(sizeof(float) * per_tier), malloc(sizeof(float) * per_tier)};
    int32_t picks[2][6];
    kv_set_num_threads(threads);
    for (int tier = 0; tier < 2; tier++) {
        kv_set_kernels(tier == 0 ? KV_KERNELS_FAST : KV_KERNELS_PLAIN);
        float *out = logits[tier];
        kv_cache cache;
        kv_pool pool;
        int a, b, n_steps = 0;
        CHECK(kv_cache_init(&cache, L, n_kv_heads, head_dim, 40, format) == KV_OK);
        CHECK(kv_model_forward(m, &cache, tokens, 14, out, 1, NULL) == KV_OK);
        out += (size_t)V * 14;
        for (int i = 14; i < 20; i++, out += V)
            CHECK(kv_model_forward(m, &cache, tokens + i, 1, out, 0, NULL) == KV_OK);
        CHECK(kv_model_generate(m, &cache, tokens[0], 6, -1, NULL, NULL, picks[tier], NULL,
                                &n_steps, NULL) == KV_OK);
        CHECK(kv_pool_init(&pool, L, n_kv_heads, head_dim, 24, 5, 2, 12, format) == KV_OK);
        CHECK(kv_blocks_seq_new(&pool.blocks, &a) == KV_OK && kv_blocks_seq_new(&pool.blocks, &b) == KV_OK);
        CHECK(kv_model_forward_paged(m, &pool, a, tokens, 13, out, 1, NULL) == KV_OK);
        out += (size_t)V * 13;
        CHECK(kv_model_forward_paged(m, &pool, b, tokens + 3, 7, out, 0, NULL) == KV_OK);
        out += V;   /* b's last token only */
        int seqs[2] = {a, b}, counts[2] = {1, 3};
        int32_t batch[4] = {tokens[13], tokens[5], tokens[6], tokens[7]};
        CHECK(kv_model_forward_batch(m, &pool, 2, seqs, counts, batch, out, 0, NULL) == KV_OK);
        out += (size_t)V * 2;
        CHECK((size_t)(out - logits[tier]) <= per_tier);
        kv_cache_free(&cache);
        kv_pool_free(&pool);
    }
    kv_set_kernels(KV_KERNELS_FAST);
    kv_set_num_threads(1);
    CHECK(same_bits(logits[0], logits[1], (size_t)V * (14 + 6 + 13 + 1 + 2)));
    CHECK(memcmp(picks[0], picks[1], sizeof picks[0]) == 0);
    free(logits[0]);
    free(logits[1]);
    free_model(&tm);
}

/* ---- element formats ------------------------------------------------------------------------ */

static void test_store_formats(void) {
    /* group sizes: defaults, and the ones refused */
    CHECK(kv_store_group(KV_FMT_I8, 0, 64) == 64 && kv_store_group(KV_FMT_I4, 0, 64) == 32);
    CHECK(kv_store_group(KV_FMT_I4, 0, 16) == 16 && kv_store_group(KV_FMT_F16, 0, 16) == 0);
    CHECK(kv_store_group(KV_FMT_I8, 5, 16) == -1 && kv_store_group(KV_FMT_I4, 1, 16) == -1);
    CHECK(kv_store_group(KV_FMT_F16, 8, 16) == -1 && kv_store_group((kv_format)99, 0, 16) == -1);
    kv_store refused;
    CHECK(kv_store_init(&refused, KV_FMT_I8, 3, 1, 4, 2, 16) == KV_ERR_INVALID_ARG);

    /* each format reads back within its precision: relative to the row's largest value */
    const kv_format formats[] = {KV_FMT_F32, KV_FMT_F16, KV_FMT_BF16, KV_FMT_I8, KV_FMT_I4, KV_FMT_FP8};
    const float tolerance[] = {0.0f, 1e-3f, 8e-3f, 8e-3f, 0.14f, 0.07f};
    const size_t nbytes[] = {2 * 32 * 4, 2 * 32 * 2, 2 * 32 * 2, 2 * (32 + 2 * 4),
                             2 * (16 + 2 * 8), 2 * (32 + 2 * 4)};   /* 2 rows, 2 heads of 16 */
    for (int f = 0; f < 6; f++) {
        kv_store store;
        CHECK(kv_store_init(&store, formats[f], 0, 1, 2, 2, 16) == KV_OK);
        CHECK(kv_store_nbytes(&store) == nbytes[f]);
        float *row = random_floats(32, 3.0f), back[32], again[32], head[16];
        kv_store_write(&store, 0, 1, row);
        kv_store_read(&store, 0, 1, back);
        int close = 1;
        for (int i = 0; i < 32; i++) close &= fabsf(back[i] - row[i]) <= tolerance[f] * 3.0f;
        CHECK(close);
        /* one head alone decodes to the same values as the whole row */
        const float *second = kv_store_head(&store, 0, 1, 1, head);
        CHECK(memcmp(second, back + 16, sizeof head) == 0);
        kv_store_copy(&store, 0, 0, 1, 1);   /* row 1 to row 0: codes, scales, zeros */
        kv_store_read(&store, 0, 0, again);
        CHECK(memcmp(back, again, sizeof back) == 0);
        free(row);
        kv_store_free(&store);
    }
}

/* ---- the paged pool's bookkeeping ---------------------------------------------------------- */

static void append_rows(kv_pool *pool, int seq, const int32_t *tokens, int n, kv_status want) {
    size_t row = (size_t)pool->n_layers * pool->n_kv_heads * pool->head_dim;
    float *rows = random_floats((size_t)n * row, 1.0f);
    CHECK(kv_pool_append(pool, seq, tokens, n, rows, rows) == want);
    free(rows);
}

static void test_pool(void) {
    kv_pool pool, refused;
    char message[256];
    CHECK(kv_pool_init(&refused, 2, 1, 4, 6, 0, 4, 3, NULL) == KV_ERR_INVALID_ARG);  /* block size 0 */
    CHECK(kv_pool_init(&refused, 2, 1, 4, 6, 4097, 4, 3, NULL) == KV_ERR_INVALID_ARG);
    CHECK(kv_pool_init(&refused, 2, 1, 4, 1 << 21, 4096, 4, 3, NULL) == KV_ERR_INVALID_ARG);
    CHECK(kv_pool_init(&pool, 2, 1, 4, 6, 4, 4, 3, NULL) == KV_OK);
    int a, b, c;
    int32_t tokens[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    int32_t other[12] = {21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
    CHECK(kv_blocks_seq_new(&pool.blocks, &a) == KV_OK);
    append_rows(&pool, a, tokens, 6, KV_OK);                 /* blocks 0, 1 (half full) */
    CHECK(pool.blocks.seqs[a].n_blocks == 2 && pool.blocks.n_free == 4);

    CHECK(kv_pool_seq_fork(&pool, a, &b) == KV_OK);           /* shares both, copies nothing */
    CHECK(pool.blocks.ref_count[0] == 2 && pool.blocks.ref_count[1] == 2 && pool.blocks.n_free == 4);
    append_rows(&pool, b, tokens + 6, 1, KV_OK);              /* copy-on-write of block 1 */
    CHECK(pool.blocks.ref_count[1] == 1 && pool.blocks.seqs[b].block_table[1] != 1 && pool.blocks.n_free == 3);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);

    append_rows(&pool, b, tokens + 7, 6, KV_ERR_TABLE_FULL);   /* 13 rows need 4 blocks > 3 */
    CHECK(pool.blocks.seqs[b].length == 7);
    CHECK(kv_blocks_seq_new(&pool.blocks, &c) == KV_OK);
    append_rows(&pool, c, other, 12, KV_OK);                   /* takes the last 3 blocks */
    append_rows(&pool, a, tokens + 6, 3, KV_ERR_OUT_OF_BLOCKS); /* needs one more: none */
    CHECK(pool.blocks.seqs[a].length == 6 && pool.blocks.n_free == 0);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);

    /* freeing c keeps its full blocks cached; a new prompt with the same tokens reuses them */
    CHECK(kv_blocks_seq_free(&pool.blocks, c) == KV_OK);
    CHECK(pool.blocks.n_cached == 3 && pool.blocks.n_free == 0);
    int d, reused = -1;
    CHECK(kv_blocks_seq_new(&pool.blocks, &d) == KV_OK);
    CHECK(kv_blocks_reuse_prefix(&pool.blocks, d, other, 11, &reused) == KV_OK);
    CHECK(reused == 8 && pool.blocks.prefix_hits == 2 && pool.blocks.n_cached == 1);
    /* slot ids are reused (d took c's slot); the Python handles carry a serial number to
     * tell a stale handle apart. Slots never used, or out of range, are refused: */
    CHECK(d == c && kv_blocks_seq_free(&pool.blocks, 3) == KV_ERR_NO_SEQUENCE);
    CHECK(kv_blocks_seq_free(&pool.blocks, -1) == KV_ERR_NO_SEQUENCE && kv_blocks_seq_free(&pool.blocks, 99) == KV_ERR_NO_SEQUENCE);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    kv_pool_free(&pool);
}

/* The block manager alone: no K or V, the copy it asks for, and the events it records
 * (what the engine's tracer and the GPU pool read). */
/* A reservation cancelled after its copy-on-write (the rows were not written) gives the
 * copy back: the sequence reads the shared block again, the pool is as before the reserve.
 * Unless the shared block changed meanwhile (its other reader freed it and it was taken
 * again): then the sequence keeps its copy, the rows it read. */
static void test_cancel_gives_back_a_copy_on_write(void) {
    kv_blocks blocks;
    char message[256];
    kv_block_copy copies[1];
    int n_copies = -1, a, b, c;
    int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK(kv_blocks_init(&blocks, 6, 4, 4, 4) == KV_OK);
    CHECK(kv_blocks_seq_new(&blocks, &a) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, a, 6, copies, &n_copies) == KV_OK);
    kv_blocks_commit(&blocks, a, tokens, 6);                    /* block 0 full, 1 half */
    CHECK(kv_blocks_seq_fork(&blocks, a, &b) == KV_OK);
    int32_t free_before[6];
    int n_free = blocks.n_free;
    memcpy(free_before, blocks.free_stack, sizeof free_before);
    /* b's 5 more positions: a copy of block 1 and one new block, then cancelled */
    CHECK(kv_blocks_reserve(&blocks, b, 5, copies, &n_copies) == KV_OK && n_copies == 1);
    CHECK(blocks.seqs[b].copied_from == 1 && blocks.ref_count[1] == 1);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_cancel(&blocks, b) == KV_OK);
    CHECK(blocks.seqs[b].block_table[1] == 1 && blocks.seqs[b].n_blocks == 2 &&
          blocks.seqs[b].length == 6 && blocks.seqs[b].reserved == 0 &&
          blocks.seqs[b].copied_from == -1 && blocks.ref_count[1] == 2);
    CHECK(blocks.n_free == n_free && memcmp(blocks.free_stack, free_before, sizeof free_before) == 0);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_cancel(&blocks, b) == KV_OK && blocks.ref_count[1] == 2);   /* none pending */
    /* the shared block freed and taken again while b's copy is pending: b keeps the copy */
    CHECK(kv_blocks_reserve(&blocks, b, 1, copies, &n_copies) == KV_OK && n_copies == 1);
    int32_t copy = copies[0].dst;
    CHECK(kv_blocks_seq_free(&blocks, a) == KV_OK && blocks.ref_count[1] == 0);
    CHECK(kv_blocks_seq_new(&blocks, &c) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, c, 8, copies, &n_copies) == KV_OK &&
          blocks.seqs[c].block_table[0] == 1);                      /* block 1 again */
    kv_blocks_commit(&blocks, c, tokens, 8);
    CHECK(kv_blocks_cancel(&blocks, b) == KV_OK);
    CHECK(blocks.seqs[b].block_table[1] == copy && blocks.ref_count[copy] == 1);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    kv_blocks_free(&blocks);
}

static void test_block_manager(void) {
    kv_blocks blocks;
    char message[256];
    kv_block_copy copies[1];
    int n_copies = -1, a, b, reused;
    int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK(kv_blocks_init(&blocks, 4, 4, 3, 2) == KV_OK);
    kv_blocks_record_events(&blocks, 1);
    CHECK(kv_blocks_seq_new(&blocks, &a) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, a, 6, copies, &n_copies) == KV_OK && n_copies == 0);
    kv_blocks_commit(&blocks, a, tokens, 6);                     /* block 0 full, 1 half */
    CHECK(blocks.n_events == 2 && blocks.events[0].kind == KV_EVENT_ALLOCATED &&
          blocks.events[0].block == 0 && blocks.events[1].block == 1 &&
          blocks.events[1].index == 1 && blocks.events[1].refs == 1);
    CHECK(kv_blocks_seq_fork(&blocks, a, &b) == KV_OK);
    CHECK(blocks.n_events == 4 && blocks.events[3].kind == KV_EVENT_SHARED &&
          blocks.events[3].refs == 2 && blocks.events[3].seq == b);
    /* b writes into the shared half block: it gets a copy, which the caller must fill */
    CHECK(kv_blocks_reserve(&blocks, b, 1, copies, &n_copies) == KV_OK && n_copies == 1);
    CHECK(copies[0].src == 1 && copies[0].dst == 2 && copies[0].rows == 2);
    CHECK(blocks.events[4].kind == KV_EVENT_COPIED && blocks.events[4].other == 1 &&
          blocks.events[5].kind == KV_EVENT_RELEASED && blocks.events[5].refs == 1);
    /* the copy could not be made (a row store failed): b reads the shared block again, the
     * copy goes back to the top of the free stack, and only b's own copy is accepted */
    kv_block_copy swapped = {copies[0].src, copies[0].dst, copies[0].rows};
    CHECK(kv_blocks_cancel_copy(&blocks, b, &swapped) == KV_ERR_INVALID_ARG);
    CHECK(kv_blocks_cancel_copy(&blocks, a, &copies[0]) == KV_ERR_INVALID_ARG);  /* none pending */
    CHECK(blocks.n_events == 6 && blocks.seqs[b].reserved == 1);
    CHECK(kv_blocks_cancel_copy(&blocks, b, &copies[0]) == KV_OK);
    CHECK(blocks.seqs[b].block_table[1] == 1 && blocks.seqs[b].reserved == 0 &&
          blocks.ref_count[1] == 2 && blocks.ref_count[2] == 0 && blocks.n_free == 2 &&
          blocks.free_stack[1] == 2);
    CHECK(blocks.events[6].kind == KV_EVENT_SHARED && blocks.events[6].block == 1 &&
          blocks.events[6].other == 2 && blocks.events[6].refs == 2 &&
          blocks.events[7].kind == KV_EVENT_FREED && blocks.events[7].block == 2);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_cancel_copy(&blocks, b, &copies[0]) == KV_ERR_INVALID_ARG);  /* done */
    CHECK(kv_blocks_reserve(&blocks, b, 1, copies, &n_copies) == KV_OK && n_copies == 1 &&
          copies[0].src == 1 && copies[0].dst == 2);                   /* as the first time */
    kv_blocks_commit(&blocks, b, tokens + 6, 1);
    /* while a reservation is pending, nothing else may be asked of that sequence */
    CHECK(kv_blocks_reserve(&blocks, b, 1, copies, &n_copies) == KV_OK && n_copies == 0);
    CHECK(kv_blocks_seq_fork(&blocks, b, &reused) == KV_ERR_PENDING);
    CHECK(kv_blocks_reserve(&blocks, b, 1, copies, &n_copies) == KV_ERR_PENDING);
    CHECK(kv_blocks_needed(&blocks, b, 1, &reused) == KV_ERR_PENDING);
    CHECK(kv_blocks_commit(&blocks, b, tokens, 2) == KV_ERR_INVALID_ARG);   /* 1 reserved */
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_commit(&blocks, b, tokens + 7, 1) == KV_OK);
    /* out of room changes nothing and records nothing */
    size_t seen = blocks.n_events;
    CHECK(kv_blocks_reserve(&blocks, a, 8, copies, &n_copies) == KV_ERR_TABLE_FULL);
    CHECK(blocks.n_events == seen);
    CHECK(kv_blocks_seq_free(&blocks, a) == KV_OK);              /* 1 freed, 0 still b's */
    CHECK(blocks.events[seen].kind == KV_EVENT_FREED && blocks.events[seen].block == 1 &&
          !blocks.events[seen].cached && blocks.events[seen + 1].kind == KV_EVENT_RELEASED);
    CHECK(kv_blocks_seq_free(&blocks, b) == KV_OK);              /* 0 full: kept, cached */
    CHECK(blocks.events[blocks.n_events - 1].kind == KV_EVENT_FREED &&
          blocks.events[blocks.n_events - 1].block == 0 && blocks.events[blocks.n_events - 1].cached);
    CHECK(kv_blocks_seq_new(&blocks, &a) == KV_OK);
    CHECK(kv_blocks_reuse_prefix(&blocks, a, tokens, 8, &reused) == KV_OK && reused == 8);
    CHECK(blocks.events[blocks.n_events - 1].prefix_hit);

    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    kv_blocks_record_events(&blocks, 0);
    CHECK(blocks.n_events == 0);
    kv_blocks_free(&blocks);
}

/* kv_blocks_findable: the blocks reuse_prefix's walk reaches, and no others (a cached
 * child whose parent left the cache is still registered, but not findable) */
static void test_block_findable(void) {
    kv_blocks blocks;
    kv_block_copy copies[1];
    int n_copies, a, b, reused;
    int32_t tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, findable[4];
    CHECK(kv_blocks_init(&blocks, 4, 4, 3, 3) == KV_OK);
    CHECK(kv_blocks_seq_new(&blocks, &a) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, a, 10, copies, &n_copies) == KV_OK);
    CHECK(kv_blocks_commit(&blocks, a, tokens, 10) == KV_OK);      /* blocks 0, 1 full */
    kv_blocks_findable(&blocks, findable);
    CHECK(findable[0] == -1 && findable[1] == 0 && findable[2] == -2 && findable[3] == -2);
    CHECK(kv_blocks_truncate(&blocks, a, 2) == KV_OK);   /* 1 cached; 0, cut alone, leaves */
    kv_blocks_findable(&blocks, findable);
    CHECK(blocks.registered[1] && findable[1] == -2 && findable[0] == -2);
    CHECK(kv_blocks_seq_new(&blocks, &b) == KV_OK);
    CHECK(kv_blocks_reuse_prefix(&blocks, b, tokens, 8, &reused) == KV_OK && reused == 0);
    kv_blocks_free(&blocks);
}

/* truncate: blocks past the cut released; a block cut in two that the sequence holds alone
 * leaves the prefix cache, one it shares stays and is copied on the next write */
static void test_block_truncate(void) {
    kv_blocks blocks;
    kv_block_copy copies[1];
    int n_copies, a, b;
    char message[256];
    int32_t tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    CHECK(kv_blocks_init(&blocks, 8, 4, 3, 4) == KV_OK);
    CHECK(kv_blocks_seq_new(&blocks, &a) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, a, 10, copies, &n_copies) == KV_OK);
    CHECK(kv_blocks_commit(&blocks, a, tokens, 10) == KV_OK);      /* 3 blocks, 2 registered */
    CHECK(kv_blocks_seq_fork(&blocks, a, &b) == KV_OK);
    CHECK(kv_blocks_truncate(&blocks, a, 11) == KV_ERR_INVALID_ARG);
    CHECK(kv_blocks_truncate(&blocks, a, 6) == KV_OK);             /* cuts shared block 1 */
    CHECK(blocks.seqs[a].n_blocks == 2 && blocks.seqs[a].length == 6);
    CHECK(blocks.registered[blocks.seqs[a].block_table[1]]);      /* b still reads it */
    CHECK(kv_blocks_reserve(&blocks, a, 1, copies, &n_copies) == KV_OK && n_copies == 1);
    CHECK(copies[0].rows == 2 && copies[0].dst == blocks.seqs[a].block_table[1]);
    CHECK(kv_blocks_commit(&blocks, a, tokens, 1) == KV_OK);
    CHECK(kv_blocks_seq_free(&blocks, b) == KV_OK);
    CHECK(kv_blocks_truncate(&blocks, a, 5) == KV_OK);             /* its own copy, cut */
    CHECK(blocks.fill[blocks.seqs[a].block_table[1]] == 1);
    CHECK(kv_blocks_truncate(&blocks, a, 3) == KV_OK);             /* a registered block, alone */
    CHECK(!blocks.registered[blocks.seqs[a].block_table[0]] && blocks.fill[blocks.seqs[a].block_table[0]] == 3);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_truncate(&blocks, a, 0) == KV_OK && blocks.seqs[a].n_blocks == 0);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    /* cut while shared, written once it is this sequence's alone: it leaves the prefix
     * cache before the write (found by review: it was registered twice) */
    int32_t four[4] = {1, 2, 4, 4}, five = 5, six = 6;
    CHECK(kv_blocks_reserve(&blocks, a, 4, copies, &n_copies) == KV_OK);
    CHECK(kv_blocks_commit(&blocks, a, four, 4) == KV_OK);
    CHECK(kv_blocks_seq_fork(&blocks, a, &b) == KV_OK);
    CHECK(kv_blocks_truncate(&blocks, a, 3) == KV_OK && kv_blocks_seq_free(&blocks, b) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, a, 1, copies, &n_copies) == KV_OK && n_copies == 0);
    CHECK(!blocks.registered[blocks.seqs[a].block_table[0]]);
    CHECK(kv_blocks_commit(&blocks, a, &five, 1) == KV_OK);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_reserve(&blocks, a, 1, copies, &n_copies) == KV_OK);
    CHECK(kv_blocks_commit(&blocks, a, &six, 1) == KV_OK);
    CHECK(kv_blocks_check(&blocks, message, sizeof message) == KV_OK);
    kv_blocks_free(&blocks);
}

static void test_cache(void) {
    kv_cache cache;
    CHECK(kv_cache_init(&cache, 2, 2, 4, 0, NULL) == KV_ERR_INVALID_ARG);
    CHECK(kv_cache_init(&cache, 2, 2, 4, 5, NULL) == KV_OK);
    CHECK(kv_cache_nbytes(&cache) == 2 * 2 * 5 * 2 * 4 * sizeof(float));
    float *rows = random_floats(3 * 2 * 2 * 4, 1.0f);
    CHECK(kv_cache_append(&cache, 3, rows, rows) == KV_OK);
    CHECK(kv_cache_append(&cache, 3, rows, rows) == KV_ERR_CACHE_FULL && cache.length == 3);
    const float *keys = (const float *)cache.key.codes;
    /* layer 1, head 1, position 2, value 1: stored (n_layers, n_kv_heads, capacity, head_dim) */
    CHECK(keys[((1 * 2 + 1) * 5 + 2) * 4 + 1] == rows[(2 * 2 + 1) * 8 + 4 + 1]);
    CHECK(kv_cache_truncate(&cache, 1) == KV_OK && cache.length == 1);
    CHECK(kv_cache_truncate(&cache, 2) == KV_ERR_INVALID_ARG);
    free(rows);
    kv_cache_free(&cache);
    kv_cache_free(&cache);   /* freeing twice is harmless */
}

/* An interrupt check that always says stop: a generation loop ends after its first step,
 * keeping it; without the check the same call runs to the end. */
static int always_stop(void *arg) {
    (*(int *)arg)++;
    return 1;
}

static void test_interrupts(void) {
    test_model tm;
    make_model(&tm, 4, 2, 6);
    kv_cache cache;
    CHECK(kv_cache_init(&cache, tm.model.config.n_layers, 2, 6, 30, NULL) == KV_OK);
    int32_t picks[10];
    int n_steps = -1;
    int asked = 0;
    kv_set_interrupt_check(always_stop, &asked);
    CHECK(kv_model_generate(&tm.model, &cache, 3, 10, -1, NULL, NULL, picks, NULL, &n_steps,
                            NULL) == KV_ERR_INTERRUPTED);
    CHECK(asked == 1 && n_steps == 1 && cache.length == 1);   /* the first step, whole */
    kv_set_interrupt_check(NULL, NULL);
    CHECK(kv_model_generate(&tm.model, &cache, picks[0], 10, -1, NULL, NULL, picks, NULL,
                            &n_steps, NULL) == KV_OK);
    CHECK(n_steps == 10 && cache.length == 11);
    /* the uncached pass that holds one layer's K and V at a time stops too, between layers
     * (and between the chunks of a long call), keeping and counting nothing */
    float logits[31];
    kv_counters counted = {0};
    asked = 0;
    kv_set_interrupt_check(always_stop, &asked);
    CHECK(kv_model_forward_uncached(&tm.model, picks, 10, logits, 0, KV_UNCACHED_ONE_LAYER,
                                    &counted) == KV_ERR_INTERRUPTED);
    CHECK(asked == 1 && counted.calls == 0 && counted.tokens == 0);
    kv_set_interrupt_check(NULL, NULL);
    CHECK(kv_model_forward_uncached(&tm.model, picks, 10, logits, 0, KV_UNCACHED_ONE_LAYER,
                                    &counted) == KV_OK);
    CHECK(counted.calls == 1 && counted.tokens == 10);
    /* the chunk rule: short calls whole, long ones in equal chunks of whole kernel passes
     * (multiples of KV_TOKEN_CHUNK, at least one) */
    CHECK(kv_chunk_length(&tm.model.config, 0, 20) == 20);
    kv_config big = tm.model.config;
    big.dim = 4096, big.hidden_dim = 11008, big.n_layers = 32, big.n_heads = 32;
    big.n_kv_heads = 32, big.head_dim = 128, big.vocab_size = 32000;
    int n = kv_chunk_length(&big, 0, 4096);
    CHECK(n >= KV_TOKEN_CHUNK && n < 4096 && n % KV_TOKEN_CHUNK == 0);
    CHECK(kv_chunk_length(&big, 100000, 100) == KV_TOKEN_CHUNK &&
          kv_chunk_length(&big, 100000, 40) == 40);
    /* the 110M shape: 2 GFLOP is 9 tokens, and a chunk of fewer than KV_TOKEN_CHUNK would
     * stream every matrix once per chunk all the same (a 0.6x prefill, issue 37) */
    kv_config mid = big;
    mid.dim = 768, mid.hidden_dim = 2048, mid.n_layers = 12, mid.n_heads = 12;
    mid.n_kv_heads = 12, mid.head_dim = 64;
    CHECK(kv_chunk_length(&mid, 0, 256) == KV_TOKEN_CHUNK);
    for (int start = 0; start <= 100000; start += 25000)
        for (int left = 1; left <= 9000; left += 997) {
            int chunk = kv_chunk_length(&tm.model.config, start, left);
            CHECK(chunk == left || chunk % KV_TOKEN_CHUNK == 0);
        }
    kv_cache_free(&cache);
    free_model(&tm);
}

/* Whether seq of pool is as `before` said: the pool's counts, its length, and the ref count
 * of its last block (shared with a fork: 2). */
static int pool_unchanged(const kv_pool *pool, const kv_pool_stats *before, int seq, int length,
                          int last_refs) {
    kv_pool_stats now;
    char message[256];
    const kv_seq *q = &pool->blocks.seqs[seq];
    return kv_blocks_stats(&pool->blocks, &now) == KV_OK &&
           now.blocks_used == before->blocks_used && now.blocks_free == before->blocks_free &&
           now.blocks_cached == before->blocks_cached &&
           now.tokens_stored == before->tokens_stored && q->length == length &&
           pool->blocks.ref_count[q->block_table[q->n_blocks - 1]] == last_refs &&
           kv_blocks_check(&pool->blocks, message, sizeof message) == KV_OK;
}

/* A pass of more than KV_CHUNK_FLOPS stops between its layers when told: a batch changes
 * nothing (its reservations cancelled, a fork's copy-on-write given back) and counts
 * nothing; a chunk of KV_TOKEN_CHUNK tokens at a long context appends nothing (a cache) or
 * gives its blocks back (a pool). A short call never asks. Wide heads make attention the
 * work: 1,480 tokens in one batch, or 96 after 12,000 rows, are each over 2 GFLOP (only the
 * first layer of each runs here). */
static void test_long_passes_stop_between_layers(void) {
    test_model tm;
    make_model_sized(&tm, 64, 64, 8, 8, 32);
    const kv_model *m = &tm.model;
    const int L = m->config.n_layers, n = 1500, rows = 12000, per_row = L * 8 * 32;
    int32_t *tokens = malloc(n * sizeof(int32_t));
    for (int i = 0; i < n; i++) tokens[i] = (int32_t)(i * 7 % m->config.vocab_size);
    float *logits = malloc(2 * sizeof(float) * m->config.vocab_size);
    float *kv = random_floats((size_t)rows * per_row, 1.0f);
    kv_pool pool;
    kv_pool_stats before;
    int a, b, asked = 0;
    kv_counters counted = {0};
    CHECK(kv_pool_init(&pool, L, 8, 32, 900, 16, 3, 800, NULL) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &a) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, a, tokens, 20, logits, 0, NULL) == KV_OK);
    CHECK(kv_pool_seq_fork(&pool, a, &b) == KV_OK);   /* b shares a's partly filled block */
    CHECK(kv_blocks_stats(&pool.blocks, &before) == KV_OK);
    int seqs[2] = {a, b}, counts[2] = {n - 20, 20}, short_counts[2] = {1, 1};
    kv_set_interrupt_check(always_stop, &asked);
    CHECK(kv_model_forward_batch(m, &pool, 2, seqs, counts, tokens, logits, 0, &counted) ==
          KV_ERR_INTERRUPTED);
    CHECK(asked == 1 && counted.calls == 0 && counted.tokens == 0);
    CHECK(pool_unchanged(&pool, &before, a, 20, 2) && pool_unchanged(&pool, &before, b, 20, 2));
    CHECK(kv_model_forward_batch(m, &pool, 2, seqs, short_counts, tokens, logits, 0, NULL) ==
          KV_OK && asked == 1);
    /* one sequence's chunk at a long context: the paged pool's, then a cache's */
    int c;
    CHECK(kv_blocks_seq_new(&pool.blocks, &c) == KV_OK);
    CHECK(kv_pool_append(&pool, c, tokens, 1, kv, kv) == KV_OK);   /* a block partly filled */
    for (int done = 1; done < rows; done += n - 1)
        CHECK(kv_pool_append(&pool, c, tokens, done + n - 1 <= rows ? n - 1 : rows - done,
                             kv, kv) == KV_OK);
    CHECK(kv_blocks_stats(&pool.blocks, &before) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, c, tokens, KV_TOKEN_CHUNK, logits, 0, &counted) ==
          KV_ERR_INTERRUPTED && asked == 2 && counted.calls == 0);
    CHECK(pool_unchanged(&pool, &before, c, rows, 1));
    kv_cache cache;
    CHECK(kv_cache_init(&cache, L, 8, 32, rows + KV_TOKEN_CHUNK, NULL) == KV_OK);
    CHECK(kv_cache_append(&cache, rows, kv, kv) == KV_OK);
    CHECK(kv_model_forward(m, &cache, tokens, KV_TOKEN_CHUNK, logits, 0, &counted) ==
          KV_ERR_INTERRUPTED && asked == 3 && counted.calls == 0 && cache.length == rows);
    kv_set_interrupt_check(NULL, NULL);
    CHECK(kv_model_forward(m, &cache, tokens, 2, logits, 0, &counted) == KV_OK &&
          cache.length == rows + 2);
    kv_cache_free(&cache);
    kv_pool_free(&pool);
    free(kv);
    free(logits);
    free(tokens);
    free_model(&tm);
}

/* Keeping fewer rows: kv_cache_keep keeps the kept rows (per head) as rows 0 .. n_keep - 1
 * and their positions; the next token is still rotated by its true position; truncate takes
 * back only the newest positions; the tracked attention weights sum to one per query head. */
static void test_cache_keep(const kv_cache_format *format) {
    test_model tm;
    make_model(&tm, 4, 2, 8);
    const kv_model *m = &tm.model;
    const kv_config *c = &m->config;
    int V = c->vocab_size;
    int32_t tokens[12];
    for (int i = 0; i < 12; i++) tokens[i] = (int32_t)(i * 5 % V);
    kv_cache cache, full;
    CHECK(kv_cache_init(&cache, c->n_layers, 2, 8, 12, format) == KV_OK);
    CHECK(kv_cache_init(&full, c->n_layers, 2, 8, 12, format) == KV_OK);
    float *logits = malloc(sizeof(float) * V), *want = malloc(sizeof(float) * V);
    CHECK(kv_model_forward(m, &cache, tokens, 6, logits, 0, NULL) == KV_OK);
    CHECK(kv_model_forward(m, &full, tokens, 6, want, 0, NULL) == KV_OK);
    CHECK(cache.positions == NULL && cache.next_position == 6);
    /* (layer, i, head): head 0 keeps rows 1 4 5, head 1 keeps rows 0 2 5 */
    int32_t rows[2 * 3 * 2] = {1, 0, 4, 2, 5, 5,  1, 0, 4, 2, 5, 5};
    int32_t bad[2 * 3 * 2] = {1, 0, 1, 2, 5, 5,  1, 0, 4, 2, 5, 5};   /* 1 twice in head 0 */
    CHECK(kv_cache_keep(&cache, 3, bad) == KV_ERR_INVALID_ARG && cache.length == 6);
    CHECK(kv_cache_keep(&cache, 7, rows) == KV_ERR_INVALID_ARG);
    CHECK(kv_cache_keep(&cache, 3, rows) == KV_OK);
    CHECK(cache.length == 3 && cache.next_position == 6);
    float a[64], b[64];
    const int32_t kept0[3] = {1, 4, 5}, kept1[3] = {0, 2, 5};
    int same = 1;
    for (int layer = 0; layer < c->n_layers; layer++)
        for (int i = 0; i < 3; i++) {
            size_t slot = kv_cache_slot(&cache, i);    /* row i: slot i, unless the ring turned */
            kv_store_read(&cache.key, layer, slot, a);
            kv_store_read(&full.key, layer, (size_t)kept0[i], b);
            same &= memcmp(a, b, 8 * sizeof(float)) == 0;             /* head 0 */
            kv_store_read(&full.key, layer, (size_t)kept1[i], b);
            same &= memcmp(a + 8, b + 8, 8 * sizeof(float)) == 0;     /* head 1 */
            same &= cache.positions[((size_t)layer * 2 + 0) * 12 + slot] == kept0[i];
            same &= cache.positions[((size_t)layer * 2 + 1) * 12 + slot] == kept1[i];
        }
    CHECK(same);
    /* the next tokens are rotated as positions 6 and 7, whatever rows are left */
    CHECK(kv_cache_track_attention(&cache, 1) == KV_OK);
    CHECK(kv_model_forward(m, &cache, tokens + 6, 2, logits, 0, NULL) == KV_OK);
    CHECK(cache.length == 5 && cache.next_position == 8);
    CHECK(cache.positions[kv_cache_slot(&cache, 3)] == 6 &&
          cache.positions[kv_cache_slot(&cache, 4)] == 7);
    float total = 0.0f;
    for (int row = 0; row < cache.length; row++)       /* layer 0, head 0 */
        total += cache.attention[kv_cache_slot(&cache, row)];
    CHECK(fabsf(total - 2 * 2) < 1e-4f);   /* 2 queries x kv_mul 2, each head's weights sum to 1 */
    CHECK(kv_cache_truncate(&cache, 4) == KV_OK && cache.next_position == 7);
    int32_t drop_newest[2 * 3 * 2] = {0, 0, 1, 1, 2, 2,  0, 0, 1, 1, 2, 2};
    CHECK(kv_cache_keep(&cache, 3, drop_newest) == KV_OK);          /* position 6 dropped */
    CHECK(kv_cache_truncate(&cache, 2) == KV_ERR_INVALID_ARG);      /* 5 is not the newest */
    CHECK(kv_cache_truncate(&cache, 0) == KV_OK && cache.next_position == 0);
    CHECK(kv_cache_track_attention(&cache, 0) == KV_OK && cache.attention == NULL);
    CHECK(kv_model_forward(m, &cache, tokens, 6, logits, 0, NULL) == KV_OK);
    CHECK(memcmp(logits, want, sizeof(float) * V) == 0);           /* like new after a reset */
    kv_cache windowed;
    const kv_cache_format with_window = {KV_FMT_I8, KV_FMT_I8, 0, 0, 2};
    CHECK(kv_cache_init(&windowed, c->n_layers, 2, 8, 12, &with_window) == KV_OK);
    CHECK(kv_cache_keep(&windowed, 0, NULL) == KV_ERR_INVALID_ARG);
    CHECK(kv_cache_track_attention(&windowed, 1) == KV_ERR_INVALID_ARG);
    kv_cache_free(&windowed);
    kv_cache_free(&cache);
    kv_cache_free(&full);
    free(logits);
    free(want);
    free_model(&tm);
}

/* ---- the ring: kv_cache_keep turning the slots instead of moving rows ------------------ */

enum { RING_L = 2, RING_H = 2, RING_D = 8, RING_CAP = 7 };
#define RING_ROW ((size_t)RING_L * RING_H * RING_D)   /* one token's K: every layer and head */

/* What a ring cache must hold, row by row in order: each row's K and V as appended, and
 * its position. A cache filled with these rows from empty is the layout before the ring. */
typedef struct {
    float keys[RING_CAP][RING_ROW], values[RING_CAP][RING_ROW];
    int32_t positions[RING_CAP];
    int length;
} ring_mirror;

/* The mirror of keeping every row but `drop` (the same rows in every layer and head), and
 * the rows argument that asks the cache for it. */
static int drop_one(ring_mirror *m, int drop, int32_t *rows) {
    int n_keep = m->length - 1;
    for (int layer = 0; layer < RING_L; layer++)
        for (int i = 0; i < n_keep; i++)
            for (int head = 0; head < RING_H; head++)
                rows[((size_t)layer * n_keep + i) * RING_H + head] = i < drop ? i : i + 1;
    for (int i = drop; i < n_keep; i++) {
        memcpy(m->keys[i], m->keys[i + 1], sizeof m->keys[i]);
        memcpy(m->values[i], m->values[i + 1], sizeof m->values[i]);
        m->positions[i] = m->positions[i + 1];
    }
    m->length = n_keep;
    return n_keep;
}

/* Whether the ring holds the mirror's rows: positions row by row, and the same K and V
 * read back and the same attention, bit for bit, as a cache filled from empty with them. */
static int ring_matches(const kv_cache *ring, const ring_mirror *m, const kv_cache_format *format) {
    kv_cache twin;
    int same = ring->length == m->length &&
               kv_cache_init(&twin, RING_L, RING_H, RING_D, RING_CAP, format) == KV_OK &&
               kv_cache_append(&twin, m->length, &m->keys[0][0], &m->values[0][0]) == KV_OK;
    size_t n = (size_t)m->length * RING_ROW;
    float got[2][RING_CAP * RING_ROW], want[2][RING_CAP * RING_ROW];
    same = same && kv_cache_read(ring, got[0], got[1]) == KV_OK &&
           kv_cache_read(&twin, want[0], want[1]) == KV_OK &&
           memcmp(got[0], want[0], n * sizeof(float)) == 0 &&
           memcmp(got[1], want[1], n * sizeof(float)) == 0;
    float q[2 * RING_H * RING_D], out[2 * RING_H * RING_D], out_twin[2 * RING_H * RING_D];
    for (int i = 0; i < 2 * RING_H * RING_D; i++) q[i] = 0.3f * (float)((i * 7) % 11) - 1.5f;
    for (int layer = 0; layer < RING_L && same; layer++)
        same = kv_cache_attend(ring, layer, q, 2 * RING_H, out) == KV_OK &&
               kv_cache_attend(&twin, layer, q, 2 * RING_H, out_twin) == KV_OK &&
               memcmp(out, out_twin, sizeof out) == 0;
    for (int layer = 0; layer < RING_L && same && ring->positions; layer++)
        for (int head = 0; head < RING_H; head++)
            for (int i = 0; i < m->length; i++)
                same &= ring->positions[((size_t)layer * RING_H + head) * RING_CAP +
                                        kv_cache_slot(ring, i)] == m->positions[i];
    kv_cache_free(&twin);
    return same;
}

/* A ring turned many times: a window (dropping row 0) turns it one slot and moves no byte
 * of K; dropping row 1 turns it and moves row 0; dropping the row before the newest moves
 * the newest to the front, turning nothing. After each, the rows read back and attention
 * are those of the same rows from slot 0 (the layout before the ring), bit for bit;
 * straightening puts row i in slot i; a refused keep changes nothing. */
static void test_cache_ring(const kv_cache_format *format) {
    kv_cache ring;
    ring_mirror m = {.length = 0};
    int32_t rows[RING_L * RING_CAP * RING_H];
    CHECK(kv_cache_init(&ring, RING_L, RING_H, RING_D, RING_CAP, format) == KV_OK);
    size_t codes = (size_t)RING_L * RING_H * RING_CAP * ring.key.head_bytes;
    uint8_t *before = malloc(codes);
    int same = 1, turned = 1, moved_nothing = 1;
    for (int step = 0; step < 6 * RING_CAP; step++) {
        if (m.length == RING_CAP) {   /* full: drop one row, as a policy would */
            int kind = step % 3, drop = kind == 0 ? 0 : kind == 1 ? 1 : RING_CAP - 2;
            int start = ring.ring_start;
            memcpy(before, ring.key.codes, codes);
            int n_keep = drop_one(&m, drop, rows);
            CHECK(kv_cache_keep(&ring, n_keep, rows) == KV_OK);
            turned &= ring.ring_start == (kind == 2 ? start : (start + 1) % RING_CAP);
            if (kind == 0) moved_nothing &= memcmp(before, ring.key.codes, codes) == 0;
            same &= ring_matches(&ring, &m, format);
        }
        for (size_t i = 0; i < RING_ROW; i++) {
            m.keys[m.length][i] = random_float();
            m.values[m.length][i] = random_float();
        }
        m.positions[m.length++] = step;
        CHECK(kv_cache_append(&ring, 1, m.keys[m.length - 1], m.values[m.length - 1]) == KV_OK);
        same &= ring_matches(&ring, &m, format);
    }
    CHECK(same);
    CHECK(turned);
    CHECK(moved_nothing);
    /* a refused keep (rows out of order) changes nothing, on a turned ring */
    int n_keep = drop_one(&m, 0, rows);
    CHECK(kv_cache_keep(&ring, n_keep, rows) == KV_OK && ring.ring_start != 0);
    int start = ring.ring_start;
    memcpy(before, ring.key.codes, codes);
    int32_t swapped = rows[0];
    rows[0] = rows[RING_H], rows[RING_H] = swapped;
    CHECK(kv_cache_keep(&ring, n_keep, rows) == KV_ERR_INVALID_ARG);
    CHECK(ring.ring_start == start && ring.length == n_keep && ring_matches(&ring, &m, format));
    CHECK(memcmp(before, ring.key.codes, codes) == 0);
    /* straightened: row i in slot i, the same rows and attention */
    CHECK(kv_cache_straighten(&ring) == KV_OK && ring.ring_start == 0);
    CHECK(ring_matches(&ring, &m, format) && kv_cache_slot(&ring, 3) == 3);
    /* truncating to nothing forgets the ring too */
    CHECK(kv_cache_keep(&ring, drop_one(&m, 0, rows), rows) == KV_OK && ring.ring_start != 0);
    CHECK(kv_cache_truncate(&ring, 0) == KV_OK && ring.ring_start == 0);
    free(before);
    kv_cache_free(&ring);
}

/* A model's forward pass over a ring: a window of 5 over 30 tokens (6 turns round the ring)
 * gives the logits of the same window straightened after every step, row i in slot i, as
 * every cache was before the ring, bit for bit. */
static void test_cache_ring_model(void) {
    test_model tm;
    make_model(&tm, 4, 2, 8);
    const kv_model *model = &tm.model;
    int V = model->config.vocab_size, L = model->config.n_layers, W = 5;
    kv_cache ring, straight;
    CHECK(kv_cache_init(&ring, L, 2, 8, W, NULL) == KV_OK);
    CHECK(kv_cache_init(&straight, L, 2, 8, W, NULL) == KV_OK);
    float *logits = malloc(sizeof(float) * V), *want = malloc(sizeof(float) * V);
    int32_t *newest = malloc(sizeof(int32_t) * (size_t)L * (W - 1) * 2);
    for (int layer = 0; layer < L; layer++)
        for (int i = 0; i < W - 1; i++)
            for (int head = 0; head < 2; head++)
                newest[((size_t)layer * (W - 1) + i) * 2 + head] = i + 1;
    int same = 1;
    for (int t = 0; t < 30; t++) {
        int32_t token = (int32_t)(t * 7 % V);
        if (ring.length == W) {
            CHECK(kv_cache_keep(&ring, W - 1, newest) == KV_OK);
            CHECK(kv_cache_keep(&straight, W - 1, newest) == KV_OK);
            CHECK(kv_cache_straighten(&straight) == KV_OK);
        }
        CHECK(kv_model_forward(model, &ring, &token, 1, logits, 0, NULL) == KV_OK);
        CHECK(kv_model_forward(model, &straight, &token, 1, want, 0, NULL) == KV_OK);
        same &= memcmp(logits, want, sizeof(float) * V) == 0;
    }
    CHECK(same && ring.ring_start == 30 % W && ring.next_position == 30);
    kv_cache_free(&ring);
    kv_cache_free(&straight);
    free(logits);
    free(want);
    free(newest);
    free_model(&tm);
}

/* kv_pool_keep does to one sequence of a pool what kv_cache_keep does to a cache: the same
 * rows kept, the same logits after, the blocks past them back in the pool, none of its
 * blocks in the prefix cache, and a shared sequence refused. */
static void test_pool_keep(void) {
    test_model tm;
    make_model(&tm, 4, 2, 8);
    const kv_model *m = &tm.model;
    const kv_config *c = &m->config;
    int V = c->vocab_size;
    int32_t tokens[12];
    for (int i = 0; i < 12; i++) tokens[i] = (int32_t)(i * 5 % V);
    kv_cache cache;
    kv_pool pool;
    char message[256];
    int seq, child, other, reused;
    CHECK(kv_cache_init(&cache, c->n_layers, 2, 8, 12, NULL) == KV_OK);
    CHECK(kv_pool_init(&pool, c->n_layers, 2, 8, 8, 3, 4, 4, NULL) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
    float *logits = malloc(sizeof(float) * V), *want = malloc(sizeof(float) * V);
    CHECK(kv_model_forward(m, &cache, tokens, 9, want, 0, NULL) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, seq, tokens, 9, logits, 0, NULL) == KV_OK);
    int32_t rows[2 * 4 * 2] = {0, 1, 3, 2, 7, 5, 8, 8,  0, 1, 3, 2, 7, 5, 8, 8};
    CHECK(kv_blocks_seq_fork(&pool.blocks, seq, &child) == KV_OK);
    CHECK(kv_pool_keep(&pool, seq, 4, rows) == KV_ERR_INVALID_ARG);    /* shared blocks */
    CHECK(kv_blocks_seq_free(&pool.blocks, child) == KV_OK);
    CHECK(kv_pool_keep(&pool, seq, 4, rows) == KV_OK);
    CHECK(kv_cache_keep(&cache, 4, rows) == KV_OK);
    CHECK(pool.blocks.seqs[seq].length == 4 && pool.blocks.seqs[seq].next_position == 9);
    CHECK(pool.blocks.seqs[seq].n_blocks == 2);                         /* one block back */
    CHECK(kv_pool_position(&pool, seq, 1, 1, 2) == 5 && kv_pool_position(&pool, seq, 1, 0, 2) == 7);
    CHECK(kv_model_forward(m, &cache, tokens + 9, 2, want, 0, NULL) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, seq, tokens + 9, 2, logits, 0, NULL) == KV_OK);
    CHECK(memcmp(logits, want, sizeof(float) * V) == 0);
    CHECK(kv_pool_position(&pool, seq, 0, 0, 5) == 10);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &other) == KV_OK);
    CHECK(kv_blocks_reuse_prefix(&pool.blocks, other, tokens, 6, &reused) == KV_OK && reused == 0);
    CHECK(kv_pool_truncate(&pool, seq, 5) == KV_OK && pool.blocks.seqs[seq].next_position == 10);
    CHECK(kv_pool_truncate(&pool, seq, 0) == KV_OK && pool.blocks.seqs[seq].next_position == 0);
    CHECK(!pool.blocks.seqs[seq].compacted);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    kv_pool_free(&pool);
    kv_cache_free(&cache);
    free(logits);
    free(want);
    free_model(&tm);
}

/* ---- a paged sequence's start: rows dropped from its front without moving the rest ------ */

/* Whether seq holds the mirror's rows (ring_mirror, above): positions row by row, and the
 * same K and V read back and the same attention on both tiers, bit for bit, as a sequence
 * of a fresh pool filled from empty with them (start 0: the layout before the start). */
static int pool_rows_match(const kv_pool *pool, int seq, const ring_mirror *m,
                           const kv_cache_format *format) {
    enum { Q_DIM = 2 * RING_H * RING_D };
    kv_pool twin;
    int t = 0, bs = pool->blocks.block_size;
    int32_t ids[RING_CAP] = {0};
    int same = pool->blocks.seqs[seq].length == m->length &&
               kv_pool_init(&twin, RING_L, RING_H, RING_D, RING_CAP, bs, 1, RING_CAP,
                            format) == KV_OK &&
               kv_blocks_seq_new(&twin.blocks, &t) == KV_OK && m->length > 0 &&
               kv_pool_append(&twin, t, ids, m->length, &m->keys[0][0], &m->values[0][0]) == KV_OK;
    size_t n = (size_t)m->length * RING_ROW;
    float got[2][RING_CAP * RING_ROW], want[2][RING_CAP * RING_ROW];
    same = same && kv_pool_gather(pool, seq, got[0], got[1]) == KV_OK &&
           kv_pool_gather(&twin, t, want[0], want[1]) == KV_OK &&
           memcmp(got[0], want[0], n * sizeof(float)) == 0 &&
           memcmp(got[1], want[1], n * sizeof(float)) == 0;
    size_t stride = kv_attention_scratch(2 * RING_H, RING_H, RING_D);
    float *scratch = malloc(sizeof(float) * stride), q[Q_DIM], out[2][Q_DIM], out_twin[2][Q_DIM];
    for (int i = 0; i < Q_DIM; i++) q[i] = 0.3f * (float)((i * 7) % 11) - 1.5f;
    for (int layer = 0; layer < RING_L && same; layer++) {
        kv_layer_view view = kv_pool_layer_view(pool, seq, layer);
        kv_layer_view straight = kv_pool_layer_view(&twin, t, layer);
        int at = m->length - 1;              /* a query after every row: it sees them all */
        int H = RING_H, D = RING_D;
        kv_attention(out[0], q, &view, 1, at, 2 * H, H, D, scratch, stride, 1);
        kv_plain_attention(out[1], q, &view, 1, at, 2 * H, H, D, scratch, stride, 1);
        kv_attention(out_twin[0], q, &straight, 1, at, 2 * H, H, D, scratch, stride, 1);
        kv_plain_attention(out_twin[1], q, &straight, 1, at, 2 * H, H, D, scratch, stride, 1);
        same = memcmp(out, out_twin, sizeof out) == 0 &&
               memcmp(out[0], out[1], sizeof out[0]) == 0;
    }
    for (int layer = 0; layer < RING_L && same; layer++)
        for (int head = 0; head < RING_H; head++)
            for (int i = 0; i < m->length; i++)
                same &= kv_pool_position(pool, seq, layer, head, i) == m->positions[i];
    free(scratch);
    kv_pool_free(&twin);
    return same;
}

/* A sequence whose rows are dropped one at a time, many times over, in blocks of 1, 3, 4
 * and 8 rows: a window (dropping row 0) moves its start one row on and moves no byte of K,
 * releasing its first block when the start reaches the block's end; dropping row 1 moves
 * the start and row 0; dropping the row before the newest moves the newest, not the start.
 * After each, the rows, positions and attention are those of the same rows from the first
 * slot of a fresh sequence, bit for bit, its blocks are exactly those its start and length
 * cover, and kv_blocks_check finds every invariant; a refused keep changes nothing. */
static void test_pool_start(const kv_cache_format *format) {
    const int block_sizes[] = {1, 3, 4, 8};
    for (size_t k = 0; k < sizeof block_sizes / sizeof block_sizes[0]; k++) {
        int bs = block_sizes[k], seq, same = 1, started = 1, fits = 1, moved_nothing = 1;
        int checked = 1, saw_start = 0;
        kv_pool pool;
        char message[256];
        ring_mirror m = {.length = 0};
        int32_t rows[RING_L * RING_CAP * RING_H], id = 0;
        CHECK(kv_pool_init(&pool, RING_L, RING_H, RING_D, RING_CAP + 2, bs, 2, RING_CAP + 2,
                           format) == KV_OK);
        CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
        const kv_seq *q = &pool.blocks.seqs[seq];
        size_t codes = (size_t)RING_L * RING_H * pool.key.slots * pool.key.head_bytes;
        uint8_t *before = malloc(codes);
        for (int step = 0; step < 6 * RING_CAP; step++) {
            if (m.length == RING_CAP) {
                int kind = step % 3, drop = kind == 0 ? 0 : kind == 1 ? 1 : RING_CAP - 2;
                int start = q->start;
                memcpy(before, pool.key.codes, codes);
                int n_keep = drop_one(&m, drop, rows);
                CHECK(kv_pool_keep(&pool, seq, n_keep, rows) == KV_OK);
                started &= q->start == (kind == 2 ? start : (start + 1) % bs);
                saw_start |= q->start > 0;
                if (kind == 0) moved_nothing &= memcmp(before, pool.key.codes, codes) == 0;
                same &= pool_rows_match(&pool, seq, &m, format);
            }
            for (size_t i = 0; i < RING_ROW; i++) {
                m.keys[m.length][i] = random_float();
                m.values[m.length][i] = random_float();
            }
            m.positions[m.length++] = step;
            CHECK(kv_pool_append(&pool, seq, &id, 1, m.keys[m.length - 1],
                                 m.values[m.length - 1]) == KV_OK);
            same &= pool_rows_match(&pool, seq, &m, format);
            kv_pool_stats stats;
            kv_blocks_stats(&pool.blocks, &stats);
            fits &= q->n_blocks == (q->start + q->length + bs - 1) / bs &&
                    stats.blocks_used == q->n_blocks;
            checked &= kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK;
        }
        CHECK(same && started && fits && moved_nothing && checked);
        CHECK(saw_start == (bs > 1));
        /* a refused keep (rows out of order) changes nothing */
        int n_keep = drop_one(&m, 0, rows), start = q->start;
        int32_t swapped = rows[0];
        rows[0] = rows[RING_H], rows[RING_H] = swapped;
        memcpy(before, pool.key.codes, codes);
        CHECK(kv_pool_keep(&pool, seq, n_keep, rows) == KV_ERR_INVALID_ARG);
        CHECK(q->start == start && q->length == RING_CAP);
        CHECK(memcmp(before, pool.key.codes, codes) == 0);
        free(before);
        kv_pool_free(&pool);
    }
}

/* The rows that keep the first `sinks` rows of `length` and the newest after them, n_keep
 * in all (sinks 0: a sliding window), for every layer and KV head. */
static void sinks_and_newest(int32_t *rows, int n_layers, int n_heads, int sinks, int n_keep,
                             int length) {
    for (int layer = 0; layer < n_layers; layer++)
        for (int i = 0; i < n_keep; i++)
            for (int head = 0; head < n_heads; head++)
                rows[((size_t)layer * n_keep + i) * n_heads + head] =
                    i < sinks ? i : length - n_keep + i;
}

/* A model's window of 20 rows (more than a tile of attention) over 60 tokens of a pool in
 * blocks of 3, and attention sinks (2 first rows and the newest): the logits of every step
 * equal, bit for bit, those of the same rows moved to the front of the sequence after every
 * keep (swapped out and in: a sequence comes back from row 0 of its first block, the layout
 * of every sequence before its start could move) and of a contiguous cache straightened
 * after every keep. The window's start goes round its blocks and its blocks stay 7 or 8;
 * the sinks move two rows a step. */
static void test_pool_start_model(int sinks) {
    test_model tm;
    make_model(&tm, 4, 2, 8);
    const kv_model *model = &tm.model;
    int V = model->config.vocab_size, L = model->config.n_layers, W = 20, bs = 3;
    kv_pool pool;
    kv_cache straight;
    char message[256];
    int seq, moved, same = 1, fits = 1, went_round = 0, checked = 1;
    CHECK(kv_pool_init(&pool, L, 2, 8, 24, bs, 3, 24, NULL) == KV_OK);
    pool.blocks.prefix_cache = 0;   /* else the two sequences share the blocks of their tokens */
    CHECK(kv_cache_init(&straight, L, 2, 8, W, NULL) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &moved) == KV_OK);
    float *logits = malloc(sizeof(float) * V), *want = malloc(sizeof(float) * V);
    float *front = malloc(sizeof(float) * V);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)L * (W - 1) * 2);
    sinks_and_newest(rows, L, 2, sinks, W - 1, W);
    for (int t = 0; t < 60; t++) {
        int32_t token = (int32_t)(t * 7 % V);
        if (straight.length == W) {
            CHECK(kv_pool_keep(&pool, seq, W - 1, rows) == KV_OK);
            CHECK(kv_pool_keep(&pool, moved, W - 1, rows) == KV_OK);
            size_t size = 0;
            CHECK(kv_pool_swap_size(&pool, moved, &size) == KV_OK);
            uint8_t *host = malloc(size);
            CHECK(kv_pool_swap_out(&pool, moved, host, size) == KV_OK);
            CHECK(kv_pool_swap_in(&pool, host, size, &moved) == KV_OK);
            free(host);
            CHECK(kv_cache_keep(&straight, W - 1, rows) == KV_OK);
            CHECK(kv_cache_straighten(&straight) == KV_OK);
        }
        CHECK(kv_model_forward_paged(model, &pool, seq, &token, 1, logits, 0, NULL) == KV_OK);
        CHECK(kv_model_forward_paged(model, &pool, moved, &token, 1, front, 0, NULL) == KV_OK);
        CHECK(kv_model_forward(model, &straight, &token, 1, want, 0, NULL) == KV_OK);
        same &= memcmp(logits, want, sizeof(float) * V) == 0 &&
                memcmp(front, want, sizeof(float) * V) == 0;
        const kv_seq *q = &pool.blocks.seqs[seq];
        went_round |= q->start == bs - 1;
        fits &= q->n_blocks <= (W + bs - 1) / bs + 1 && pool.blocks.seqs[moved].start == 0;
        checked &= kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK;
    }
    CHECK(same && fits && went_round && checked);
    CHECK(pool.blocks.seqs[seq].next_position == 60);
    CHECK(kv_pool_position(&pool, seq, 0, 1, W - 1) == 59);
    CHECK(kv_pool_position(&pool, seq, 1, 1, 0) == (sinks > 0 ? 0 : 60 - W));
    kv_pool_free(&pool);
    kv_cache_free(&straight);
    free(logits);
    free(want);
    free(front);
    free(rows);
    free_model(&tm);
}

/* The start through the rest of the pool's bookkeeping: blocks needed, a fork (which keeps
 * the start) and its copy-on-write of a first block that is also the last, truncation,
 * a reservation cancelled, swapping (back from row 0, in as few blocks as its rows take),
 * a keep of no row, kv_blocks_drop_rows' refusals and kv_blocks_check's view of a start. */
static void test_pool_start_books(void) {
    enum { L = 2, H = 2, D = 8, ROW = L * H * D };
    kv_pool pool;
    char message[256];
    int seq, child, needed, back;
    int32_t tokens[16] = {0}, rows[L * 8 * H];
    float got[2][12 * ROW], want[2][12 * ROW];
    CHECK(kv_pool_init(&pool, L, H, D, 12, 4, 4, 6, NULL) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
    const kv_seq *q = &pool.blocks.seqs[seq];
    append_rows(&pool, seq, tokens, 10, KV_OK);              /* 4 + 4 + 2 rows */
    CHECK(kv_pool_gather(&pool, seq, want[0], want[1]) == KV_OK);
    int32_t second = q->block_table[1], third = q->block_table[2];
    sinks_and_newest(rows, L, H, 0, 4, 10);                   /* rows 6 .. 9 */
    CHECK(kv_pool_keep(&pool, seq, 4, rows) == KV_OK);
    CHECK(q->start == 2 && q->length == 4 && q->n_blocks == 2 && q->block_table[0] == second &&
          q->block_table[1] == third && kv_blocks_available(&pool.blocks) == 10);
    CHECK(kv_pool_gather(&pool, seq, got[0], got[1]) == KV_OK);
    for (int layer = 0; layer < L; layer++)   /* gather is (n_layers, length, ...) */
        CHECK(memcmp(got[0] + (size_t)layer * 4 * H * D, want[0] + ((size_t)layer * 10 + 6) * H * D,
                     sizeof(float) * 4 * H * D) == 0);
    CHECK(kv_blocks_needed(&pool.blocks, seq, 2, &needed) == KV_OK && needed == 0);
    CHECK(kv_blocks_needed(&pool.blocks, seq, 3, &needed) == KV_OK && needed == 1);
    /* 18 more rows take 4 blocks (6 in all); 19 would not fit a table of 6, counted from
     * row 2 of its first block */
    CHECK(kv_blocks_needed(&pool.blocks, seq, 18, &needed) == KV_OK && needed == 4);
    CHECK(kv_blocks_needed(&pool.blocks, seq, 19, &needed) == KV_ERR_TABLE_FULL);
    /* a reservation cancelled gives back the blocks it took */
    CHECK(kv_pool_reserve(&pool, seq, 7) == KV_OK && q->n_blocks == 4);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_cancel(&pool.blocks, seq) == KV_OK && q->n_blocks == 2 && q->start == 2);
    /* a window of 2 in blocks of 4: rows 2 and 3 of one block, first and last */
    sinks_and_newest(rows, L, H, 0, 2, 4);
    CHECK(kv_pool_keep(&pool, seq, 2, rows) == KV_OK);
    CHECK(q->start == 0 && q->n_blocks == 1 && q->block_table[0] == third);
    append_rows(&pool, seq, tokens, 1, KV_OK);
    sinks_and_newest(rows, L, H, 0, 2, 3);
    CHECK(kv_pool_keep(&pool, seq, 2, rows) == KV_OK && q->start == 1 && q->n_blocks == 1);
    CHECK(kv_pool_gather(&pool, seq, want[0], want[1]) == KV_OK);
    /* a fork shares the block and the start; its write copies the block first */
    CHECK(kv_pool_seq_fork(&pool, seq, &child) == KV_OK);
    const kv_seq *c = &pool.blocks.seqs[child];
    CHECK(c->start == 1 && c->length == 2 && c->block_table[0] == third && c->compacted);
    CHECK(kv_blocks_needed(&pool.blocks, child, 1, &needed) == KV_OK && needed == 1);
    append_rows(&pool, child, tokens, 2, KV_OK);              /* its rows 2 and 3: a second block */
    CHECK(c->block_table[0] != third && c->n_blocks == 2 && pool.blocks.ref_count[third] == 1);
    CHECK(kv_pool_position(&pool, child, 1, 1, 3) == kv_pool_position(&pool, seq, 1, 1, 1) + 2);
    CHECK(kv_pool_gather(&pool, child, got[0], got[1]) == KV_OK);
    for (int layer = 0; layer < L; layer++)
        CHECK(memcmp(got[1] + (size_t)layer * 4 * H * D, want[1] + (size_t)layer * 2 * H * D,
                     sizeof(float) * 2 * H * D) == 0);
    CHECK(kv_pool_gather(&pool, seq, got[0], got[1]) == KV_OK);
    CHECK(memcmp(got[0], want[0], sizeof(float) * 2 * ROW) == 0 &&
          memcmp(got[1], want[1], sizeof(float) * 2 * ROW) == 0);     /* the parent's intact */
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    /* truncated: the newest row goes, then every row, and the start with them */
    CHECK(kv_pool_truncate(&pool, child, 2) == KV_OK && c->n_blocks == 1 && c->start == 1);
    CHECK(kv_pool_truncate(&pool, child, 0) == KV_OK && c->n_blocks == 0 && c->start == 0);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    /* swapped out and in: the same rows and positions from row 0 of one block */
    append_rows(&pool, seq, tokens, 2, KV_OK);                /* start 1, length 4: 2 blocks */
    CHECK(q->start == 1 && q->n_blocks == 2);
    int position = kv_pool_position(&pool, seq, 0, 1, 3);
    CHECK(kv_pool_gather(&pool, seq, want[0], want[1]) == KV_OK);
    size_t size = 0;
    CHECK(kv_pool_swap_size(&pool, seq, &size) == KV_OK);
    uint8_t *host = malloc(size);
    CHECK(kv_pool_swap_out(&pool, seq, host, size) == KV_OK);
    CHECK(kv_pool_swap_in(&pool, host, size, &back) == KV_OK);
    const kv_seq *b = &pool.blocks.seqs[back];
    CHECK(b->start == 0 && b->n_blocks == 1 && b->length == 4 && b->compacted);
    CHECK(kv_pool_position(&pool, back, 0, 1, 3) == position);
    CHECK(kv_pool_gather(&pool, back, got[0], got[1]) == KV_OK);
    CHECK(memcmp(got[0], want[0], sizeof(float) * 4 * ROW) == 0 &&
          memcmp(got[1], want[1], sizeof(float) * 4 * ROW) == 0);
    free(host);
    /* the block manager's own refusals, and a keep of nothing */
    CHECK(kv_blocks_drop_rows(&pool.blocks, back, -1, 2) == KV_ERR_INVALID_ARG);
    CHECK(kv_blocks_drop_rows(&pool.blocks, back, 3, 2) == KV_ERR_INVALID_ARG);
    CHECK(kv_blocks_drop_rows(&pool.blocks, back, 1, 2) == KV_OK && b->start == 1 && b->length == 2);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_drop_rows(&pool.blocks, back, -2, 2) == KV_ERR_INVALID_ARG);  /* before row 0 */
    CHECK(kv_blocks_drop_rows(&pool.blocks, back, -1, 3) == KV_OK && b->start == 0 && b->length == 3);
    CHECK(kv_blocks_drop_rows(&pool.blocks, back, 1, 2) == KV_OK && b->start == 1 && b->length == 2);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    kv_seq *broken = &pool.blocks.seqs[back];
    broken->start = 4;                                         /* past its block's end */
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_ERR_CORRUPT);
    broken->start = 1;
    broken->compacted = 0;                                     /* dropped rows, it says none */
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_ERR_CORRUPT);
    broken->compacted = 1;
    CHECK(kv_pool_keep(&pool, back, 0, NULL) == KV_OK && b->start == 0 && b->n_blocks == 0);
    CHECK(b->next_position == 13 && b->compacted);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    CHECK(kv_blocks_available(&pool.blocks) == 12);
    kv_pool_free(&pool);
    /* a table of 2 blocks of 4: a window of 8 has no block to spare for a start, so its
     * rows move to the front of its first block instead, as before there was a start */
    CHECK(kv_pool_init(&pool, L, H, D, 12, 4, 4, 2, NULL) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
    q = &pool.blocks.seqs[seq];
    append_rows(&pool, seq, tokens, 8, KV_OK);
    CHECK(kv_pool_gather(&pool, seq, want[0], want[1]) == KV_OK);
    sinks_and_newest(rows, L, H, 0, 7, 8);
    CHECK(kv_pool_keep(&pool, seq, 7, rows) == KV_OK && q->start == 0 && q->n_blocks == 2);
    CHECK(kv_pool_gather(&pool, seq, got[0], got[1]) == KV_OK);
    for (int layer = 0; layer < L; layer++)
        CHECK(memcmp(got[0] + (size_t)layer * 7 * H * D, want[0] + ((size_t)layer * 8 + 1) * H * D,
                     sizeof(float) * 7 * H * D) == 0);
    append_rows(&pool, seq, tokens, 1, KV_OK);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    kv_pool_free(&pool);
}

/* Preemption by swapping (swap.c): a sequence copied to host memory and back goes on bit
 * for bit (its next logits equal those of a twin never swapped), in every cache format and
 * with a residual window; swapping out a sequence that shares blocks leaves them intact for
 * the other; every refusal changes nothing; the host copy may come back twice; and a
 * sequence that dropped rows comes back with the positions its rows hold. */
static void test_pool_swap(const kv_cache_format *format) {
    test_model tm;
    make_model(&tm, 4, 2, 8);
    const kv_model *m = &tm.model;
    size_t V = (size_t)m->config.vocab_size, logits_bytes = V * sizeof(float);
    int32_t tokens[16];
    for (int i = 0; i < 16; i++) tokens[i] = (int32_t)(i * 7 % (int)V);
    kv_pool pool, other;
    char message[256];
    /* blocks of 3 rows: 10 tokens end in a partly filled block */
    CHECK(kv_pool_init(&pool, 2, 2, 8, 16, 3, 5, 16, format) == KV_OK);
    int twin, seq, child, hog, back, again, spare[5], n_spare = 0;
    float *want = malloc(logits_bytes), *got = malloc(logits_bytes);
    CHECK(kv_blocks_seq_new(&pool.blocks, &twin) == KV_OK);
    CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, twin, tokens, 10, want, 0, NULL) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, seq, tokens, 10, got, 0, NULL) == KV_OK);
    CHECK(kv_pool_seq_fork(&pool, seq, &child) == KV_OK);      /* shares every block of seq */

    /* a pending reservation, or a buffer of the wrong size: refused, nothing changes */
    size_t size = 0;
    int pending;
    CHECK(kv_blocks_seq_new(&pool.blocks, &pending) == KV_OK);
    CHECK(kv_pool_reserve(&pool, pending, 1) == KV_OK);
    CHECK(kv_pool_swap_size(&pool, pending, &size) == KV_ERR_PENDING);
    CHECK(kv_pool_swap_out(&pool, pending, got, sizeof(float)) == KV_ERR_PENDING);
    CHECK(kv_blocks_seq_free(&pool.blocks, pending) == KV_OK);
    CHECK(kv_pool_swap_size(&pool, seq, &size) == KV_OK && size > 0);
    uint8_t *host = malloc(size);
    CHECK(kv_pool_swap_out(&pool, seq, host, size - 1) == KV_ERR_INVALID_ARG);
    CHECK(kv_pool_swap_out(&pool, seq, NULL, size) == KV_ERR_INVALID_ARG);
    CHECK(pool.blocks.seqs[seq].alive && pool.blocks.seqs[seq].length == 10);

    int refs_before = pool.blocks.ref_count[pool.blocks.seqs[seq].block_table[0]];
    CHECK(kv_pool_swap_out(&pool, seq, host, size) == KV_OK);
    CHECK(!pool.blocks.seqs[seq].alive);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    CHECK(pool.blocks.ref_count[pool.blocks.seqs[child].block_table[0]] == refs_before - 1);
    /* the twin's next logits, to compare the swapped sequence's with when it is back */
    CHECK(kv_model_forward_paged(m, &pool, twin, tokens + 10, 1, want, 0, NULL) == KV_OK);

    /* refusals, each changing nothing: too few blocks, no sequence slot, not a swapped
     * sequence, a pool of another shape */
    CHECK(kv_blocks_seq_new(&pool.blocks, &hog) == KV_OK);
    int32_t filler[48];
    for (int i = 0; i < 48; i++) filler[i] = 100 + i;       /* no prefix to share */
    int short_by_one = (kv_blocks_available(&pool.blocks) - 3) * 3;   /* seq needs 4 */
    append_rows(&pool, hog, filler, short_by_one, KV_OK);
    int available = kv_blocks_available(&pool.blocks), live = 0;
    CHECK(available == 3);
    CHECK(kv_pool_swap_in(&pool, host, size, &back) == KV_ERR_OUT_OF_BLOCKS);
    CHECK(kv_blocks_available(&pool.blocks) == available);
    CHECK(kv_blocks_seq_free(&pool.blocks, hog) == KV_OK);
    while (kv_blocks_seq_new(&pool.blocks, &spare[n_spare]) == KV_OK) n_spare++;
    CHECK(kv_pool_swap_in(&pool, host, size, &back) == KV_ERR_TOO_MANY_SEQUENCES);
    for (int i = 0; i < n_spare; i++) CHECK(kv_blocks_seq_free(&pool.blocks, spare[i]) == KV_OK);
    for (int s = 0; s < pool.blocks.max_seqs; s++) live += pool.blocks.seqs[s].alive;
    CHECK(live == 2);                                          /* twin and child */
    host[0] ^= 1;
    CHECK(kv_pool_swap_in(&pool, host, size, &back) == KV_ERR_INVALID_ARG);
    host[0] ^= 1;
    CHECK(kv_pool_swap_in(&pool, host, size + 1, &back) == KV_ERR_INVALID_ARG);
    CHECK(kv_pool_init(&other, 2, 1, 8, 16, 3, 5, 16, format) == KV_OK);
    CHECK(kv_pool_swap_in(&other, host, size, &back) == KV_ERR_CACHE_MISMATCH);
    kv_pool_free(&other);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);

    /* back, twice (the host copy is only read), in a pool of another block size too: each
     * goes on as the twin does */
    CHECK(kv_pool_swap_in(&pool, host, size, &back) == KV_OK);
    CHECK(pool.blocks.seqs[back].length == 10 && pool.blocks.seqs[back].next_position == 10);
    CHECK(kv_pool_swap_in(&pool, host, size, &again) == KV_OK);
    CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
    CHECK(kv_model_forward_paged(m, &pool, back, tokens + 10, 1, got, 0, NULL) == KV_OK);
    CHECK(memcmp(got, want, logits_bytes) == 0);
    CHECK(kv_model_forward_paged(m, &pool, again, tokens + 10, 1, got, 0, NULL) == KV_OK);
    CHECK(memcmp(got, want, logits_bytes) == 0);
    CHECK(kv_pool_init(&other, 2, 2, 8, 8, 5, 2, 8, format) == KV_OK);
    CHECK(kv_pool_swap_in(&other, host, size, &back) == KV_OK);
    CHECK(kv_model_forward_paged(m, &other, back, tokens + 10, 1, got, 0, NULL) == KV_OK);
    CHECK(memcmp(got, want, logits_bytes) == 0);
    CHECK(kv_blocks_check(&other.blocks, message, sizeof message) == KV_OK);
    kv_pool_free(&other);
    free(host);

    /* a sequence that dropped rows (no window: kv_pool_keep refuses one) comes back with
     * its rows' positions, next_position and all: it goes on as a contiguous cache that
     * dropped the same rows */
    if (pool.window == 0) {
        kv_cache cache;
        int32_t rows[2 * 4 * 2] = {0, 1, 3, 2, 7, 5, 8, 8,  0, 1, 3, 2, 7, 5, 8, 8};
        int32_t own[9];
        for (int i = 0; i < 9; i++) own[i] = (int32_t)((i * 5 + 3) % (int)V);
        int solo;
        CHECK(kv_cache_init(&cache, 2, 2, 8, 16, format) == KV_OK);
        CHECK(kv_blocks_seq_new(&pool.blocks, &solo) == KV_OK);
        CHECK(kv_model_forward(m, &cache, own, 9, want, 0, NULL) == KV_OK);
        CHECK(kv_model_forward_paged(m, &pool, solo, own, 9, got, 0, NULL) == KV_OK);
        CHECK(kv_cache_keep(&cache, 4, rows) == KV_OK);
        CHECK(kv_pool_keep(&pool, solo, 4, rows) == KV_OK);
        int position = kv_pool_position(&pool, solo, 1, 1, 2);
        CHECK(kv_pool_swap_size(&pool, solo, &size) == KV_OK);
        host = malloc(size);
        CHECK(kv_pool_swap_out(&pool, solo, host, size) == KV_OK);
        /* positions no swap-out writes (the last ones in the buffer, (layers, heads, 4)),
         * or a next position past 2**30: refused, nothing changes */
        int32_t *positions = (int32_t *)(host + size - 2 * 2 * 4 * sizeof(int32_t)), keep_one;
        int32_t *next_position = (int32_t *)(host + 10 * sizeof(int32_t)), next = *next_position;
        int free_before = kv_blocks_available(&pool.blocks), bad[][2] = {
            {15, 9}, {15, 1000}, {0, -1}, {1, 0}, {6, 1}};   /* (index, value) */
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            keep_one = positions[bad[i][0]];
            positions[bad[i][0]] = bad[i][1];    /* >= next, negative, repeated, decreasing */
            CHECK(kv_pool_swap_in(&pool, host, size, &solo) == KV_ERR_INVALID_ARG);
            positions[bad[i][0]] = keep_one;
        }
        *next_position = (1 << 30) + 1;
        CHECK(kv_pool_swap_in(&pool, host, size, &solo) == KV_ERR_INVALID_ARG);
        *next_position = next;
        CHECK(kv_blocks_available(&pool.blocks) == free_before);
        CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
        CHECK(kv_pool_swap_in(&pool, host, size, &solo) == KV_OK);
        CHECK(pool.blocks.seqs[solo].compacted && pool.blocks.seqs[solo].next_position == 9);
        CHECK(kv_pool_position(&pool, solo, 1, 1, 2) == position && position == 5);
        CHECK(kv_model_forward(m, &cache, own + 4, 2, want, 0, NULL) == KV_OK);
        CHECK(kv_model_forward_paged(m, &pool, solo, own + 4, 2, got, 0, NULL) == KV_OK);
        CHECK(memcmp(got, want, logits_bytes) == 0);
        CHECK(kv_blocks_check(&pool.blocks, message, sizeof message) == KV_OK);
        /* and into a pool where no sequence has dropped rows yet (no positions array) */
        kv_pool fresh;
        int there;
        CHECK(kv_pool_init(&fresh, 2, 2, 8, 16, 3, 5, 16, format) == KV_OK);
        CHECK(fresh.positions == NULL);
        CHECK(kv_pool_swap_in(&fresh, host, size, &there) == KV_OK);
        CHECK(kv_pool_position(&fresh, there, 1, 1, 2) == position);
        CHECK(kv_model_forward_paged(m, &fresh, there, own + 4, 2, got, 0, NULL) == KV_OK);
        CHECK(memcmp(got, want, logits_bytes) == 0);
        kv_pool_free(&fresh);
        free(host);
        kv_cache_free(&cache);
    }
    kv_pool_free(&pool);
    free(want);
    free(got);
    free_model(&tm);
}

/* A weight matrix in fp16, bf16, Q8_0, Q4_0 or Q4_1 gives, bit for bit, the float32 product over its
 * dequantized values, on both tiers, for a decode step and for a prefill, with leftover
 * columns (16-bit formats) and rows. */
static void test_weight_formats(void) {
    const kv_weight_format formats[] = {KV_WEIGHT_F32, KV_WEIGHT_F16, KV_WEIGHT_BF16, KV_WEIGHT_Q8_0,
                                        KV_WEIGHT_Q4_0, KV_WEIGHT_Q4_1};
    const int in_dims[] = {64, 70, 96};
    const int token_counts[] = {1, 3, 5, 17, 50};
    int out_dim = 13;
    CHECK(kv_weight_row_bytes(KV_WEIGHT_Q8_0, 70) == 0 && kv_weight_row_bytes(KV_WEIGHT_Q8_0, 64) == 68);
    CHECK(kv_weight_row_bytes(KV_WEIGHT_BF16, 70) == 140 && kv_weight_row_bytes(KV_WEIGHT_F32, 0) == 0);
    CHECK(kv_weight_row_bytes(KV_WEIGHT_Q4_0, 64) == 36 && kv_weight_row_bytes(KV_WEIGHT_Q4_1, 64) == 40);
    CHECK(kv_weight_row_bytes(KV_WEIGHT_Q4_0, 48) == 0 && kv_weight_row_bytes(KV_WEIGHT_Q4_1, 70) == 0);
    {   /* GGUF's nibble order: byte j holds value j (low nibble) and value j + 16 (high) */
        uint8_t block[20] = {0};
        uint16_t d = kv_f32_to_f16(0.5f), m = kv_f32_to_f16(-1.0f);
        memcpy(block, &d, 2);
        memcpy(block + 2, &m, 2);
        block[2 + 3] = 0x9 | 0xF << 4;             /* Q4_0: value 3 is 9, value 19 is 15 */
        float v[32];
        kv_weight_row_dequantize(KV_WEIGHT_Q4_0, block, 32, v);
        CHECK(v[3] == 0.5f && v[19] == 3.5f && v[0] == -4.0f);
        block[4 + 3] = 0x2 | 0x7 << 4;             /* Q4_1: value 3 is 2, value 19 is 7 */
        kv_weight_row_dequantize(KV_WEIGHT_Q4_1, block, 32, v);
        CHECK(v[3] == 0.0f && v[19] == 2.5f && v[0] == -1.0f);
    }
    for (int f = 0; f < 6; f++)
        for (int d = 0; d < 3; d++) {
            int in_dim = in_dims[d];
            size_t row_bytes = kv_weight_row_bytes(formats[f], in_dim);
            if (row_bytes == 0) continue;
            uint8_t *w = malloc(row_bytes * out_dim);
            float *values = malloc(sizeof(float) * in_dim * out_dim);
            float *source = random_floats((size_t)in_dim * out_dim, 1.0f);
            for (int o = 0; o < out_dim; o++) {     /* the matrix, written in its format */
                uint8_t *row = w + row_bytes * o;
                const float *src = source + (size_t)o * in_dim;
                for (int i = 0; i < in_dim; i++) {
                    if (formats[f] == KV_WEIGHT_F32) memcpy(row + 4 * i, &src[i], 4);
                    if (formats[f] == KV_WEIGHT_F16 || formats[f] == KV_WEIGHT_BF16) {
                        uint16_t code = formats[f] == KV_WEIGHT_F16 ? kv_f32_to_f16(src[i])
                                                                    : kv_f32_to_bf16(src[i]);
                        memcpy(row + 2 * i, &code, 2);
                    }
                }
                for (int b = 0; formats[f] == KV_WEIGHT_Q8_0 && b < in_dim / 32; b++) {
                    uint16_t scale = kv_f32_to_f16(0.01f * (float)(b + o + 1));
                    memcpy(row + 34 * b, &scale, 2);
                    for (int i = 0; i < 32; i++)
                        row[34 * b + 2 + i] = (uint8_t)(int8_t)((o * 31 + b * 7 + i * 13) % 255 - 127);
                }
                int q4_header = formats[f] == KV_WEIGHT_Q4_1 ? 4 : 2;
                size_t q4_bytes = kv_weight_block_bytes(formats[f]);
                for (int b = 0; formats[f] >= KV_WEIGHT_Q4_0 && b < in_dim / 32; b++) {
                    uint16_t d = kv_f32_to_f16(0.01f * (float)(b + o + 1));
                    uint16_t m = kv_f32_to_f16(-0.07f * (float)(b - o));
                    memcpy(row + q4_bytes * b, &d, 2);
                    memcpy(row + q4_bytes * b + 2, &m, 2);   /* Q4_0: the first code byte */
                    for (int i = q4_header; i < (int)q4_bytes; i++)
                        row[q4_bytes * b + i] = (uint8_t)((o * 37 + b * 11 + i * 29) % 256);
                }
                kv_weight_row_dequantize(formats[f], row, in_dim, values + (size_t)o * in_dim);
            }
            for (int n = 0; n < 5; n++) {
                int n_tokens = token_counts[n];
                float *x = random_floats((size_t)n_tokens * in_dim, 1.0f);
                size_t outs = (size_t)n_tokens * out_dim;
                float *fast = malloc(sizeof(float) * outs), *plain = malloc(sizeof(float) * outs);
                float *want = malloc(sizeof(float) * outs);
                int n_threads = kv_threads();
                float *scratch = malloc(sizeof(float) * kv_weights_scratch_floats(in_dim, n_threads));
                kv_matmul(want, x, values, n_tokens, in_dim, out_dim);
                kv_matmul_weights(fast, x, w, formats[f], n_tokens, in_dim, out_dim, scratch, n_threads);
                kv_plain_matmul_weights(plain, x, w, formats[f], n_tokens, in_dim, out_dim, scratch,
                                        n_threads);
                CHECK(memcmp(fast, want, sizeof(float) * outs) == 0);
                CHECK(memcmp(plain, want, sizeof(float) * outs) == 0);
                free(x); free(fast); free(plain); free(want); free(scratch);
            }
            free(w); free(values); free(source);
        }
    /* The products run on the threads their scratch was sized for, whatever kv_threads()
     * says by then (another thread may have changed it since the allocation): scratch for
     * one thread, then a canary that more threads' rows would overwrite. */
    {
        int in = 64, out = 64, tokens = 48;   /* enough work for a parallel region */
        size_t one = kv_weights_scratch_floats(in, 1);
        float *scratch = malloc(sizeof(float) * 4 * one);
        for (size_t i = one; i < 4 * one; i++) scratch[i] = -7.0f;
        uint8_t *w16 = calloc((size_t)out, kv_weight_row_bytes(KV_WEIGHT_F16, in));
        float *xs = random_floats((size_t)tokens * in, 1.0f);
        float *ys = malloc(sizeof(float) * tokens * out);
        int threads_before = kv_threads();
        kv_set_num_threads(4);
        kv_matmul_weights(ys, xs, w16, KV_WEIGHT_F16, tokens, in, out, scratch, 1);
        kv_plain_matmul_weights(ys, xs, w16, KV_WEIGHT_F16, tokens, in, out, scratch, 1);
        kv_set_num_threads(threads_before);
        int intact = 1;
        for (size_t i = one; i < 4 * one; i++) intact &= scratch[i] == -7.0f;
        CHECK(intact);
        free(scratch); free(w16); free(xs); free(ys);
    }
    /* Q8_0, Q4_0 and Q4_1 against int8 activations: the fast tier gives the plain tier's
     * bits, for 1 to 9 tokens (lone ones, pairs, fours, the 512-bit tile's one to four
     * pairs with a lone token paired with itself), 12 and 13 (the most the AVX-512 tile
     * takes straight from the rows, and the fewest it packs a panel for), 16, 17 and 50
     * (tiles of eight and what is left over) and 13 rows (four runs and a leftover); and 37
     * rows, for the AVX-512 tile's panels of 16 rows and the rows past them; any bytes at
     * all as codes (Q8_0's -128 too) */
    const kv_weight_format blocks[] = {KV_WEIGHT_Q8_0, KV_WEIGHT_Q4_0, KV_WEIGHT_Q4_1};
    const int int8_tokens[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 50};
    enum { N_INT8_TOKENS = sizeof int8_tokens / sizeof int8_tokens[0] };
    int in_dim = 96, rows_13 = out_dim;
    kv_kernels before = kv_get_kernels();
    for (int f = 0; f < 3; f++)
        for (int n = 0; n < 2 * N_INT8_TOKENS; n++) {
            int n_tokens = int8_tokens[n % N_INT8_TOKENS];
            out_dim = n < N_INT8_TOKENS ? rows_13 : 37;
            size_t row_bytes = kv_weight_row_bytes(blocks[f], in_dim);
            size_t block_bytes = kv_weight_block_bytes(blocks[f]);
            uint8_t *w = malloc(row_bytes * out_dim);
            for (int o = 0; o < out_dim; o++)
                for (int b = 0; b < in_dim / 32; b++) {
                    uint8_t *block = w + row_bytes * o + block_bytes * b;
                    for (size_t i = 0; i < block_bytes; i++)
                        block[i] = (uint8_t)((o * 29 + b * 5 + (int)i * 11 + f) % 255);
                    uint16_t scale = kv_f32_to_f16(0.02f * (float)(b + o + 1));
                    uint16_t min = kv_f32_to_f16(-0.3f * (float)(b - o + 2));
                    memcpy(block, &scale, 2);
                    if (blocks[f] == KV_WEIGHT_Q4_1) memcpy(block + 2, &min, 2);
                }
            float *x = random_floats((size_t)n_tokens * in_dim, 2.0f);
            float *fast = malloc(sizeof(float) * n_tokens * out_dim);
            float *plain = malloc(sizeof(float) * n_tokens * out_dim);
            CHECK(kv_weights_matmul_int8(fast, x, w, blocks[f], n_tokens, in_dim, out_dim) == KV_OK);
            kv_set_kernels(KV_KERNELS_PLAIN);
            CHECK(kv_weights_matmul_int8(plain, x, w, blocks[f], n_tokens, in_dim, out_dim) == KV_OK);
            kv_set_kernels(before);
            CHECK(memcmp(fast, plain, sizeof(float) * n_tokens * out_dim) == 0);
            CHECK(kv_weights_matmul_int8(fast, x, w, blocks[f], n_tokens, 70, out_dim) == KV_ERR_INVALID_ARG);
            CHECK(kv_weights_matmul_int8(fast, x, w, KV_WEIGHT_F16, n_tokens, 64, out_dim) ==
                  KV_ERR_INVALID_ARG);
            free(w); free(x); free(fast); free(plain);
        }
    out_dim = rows_13;
    /* Activations whose scaled values fall on halves (k + 0.5 and -(k + 0.5): roundf sends
     * them away from zero, the vector rounding to even), for 1 and 9 tokens: the tiers still
     * quantize them alike */
    for (int n = 0; n < 2; n++) {
        int n_tokens = n == 0 ? 1 : 9, ties_dim = 64, ties_out = 8;
        size_t row_bytes = kv_weight_row_bytes(KV_WEIGHT_Q8_0, ties_dim);
        uint8_t *w = malloc(row_bytes * ties_out);
        for (size_t i = 0; i < row_bytes * ties_out; i++) w[i] = (uint8_t)(i * 37 % 251);
        for (int o = 0; o < ties_out; o++)
            for (int b = 0; b < ties_dim / 32; b++) {
                uint16_t scale = kv_f32_to_f16(0.01f * (float)(o + b + 1));
                memcpy(w + row_bytes * o + 34 * b, &scale, 2);
            }
        float *x = malloc(sizeof(float) * n_tokens * ties_dim);
        for (int t = 0; t < n_tokens; t++)
            for (int i = 0; i < ties_dim; i++) {
                /* block 0: largest 127, so d_x = 1; block 1: largest 63.5, d_x = 0.5 */
                float *at = x + (size_t)t * ties_dim + i;
                int k = (i * 7 + t) % 31 - 15, sign = (i + t) % 2 ? -1 : 1;
                if (i < 32) *at = i == 0 ? 127.0f : (float)sign * ((float)k + 0.5f);
                else *at = i == 32 ? -63.5f : (float)sign * 0.5f * ((float)k + 0.5f);
            }
        float *fast = malloc(sizeof(float) * n_tokens * ties_out);
        float *plain = malloc(sizeof(float) * n_tokens * ties_out);
        CHECK(kv_weights_matmul_int8(fast, x, w, KV_WEIGHT_Q8_0, n_tokens, ties_dim, ties_out) == KV_OK);
        kv_set_kernels(KV_KERNELS_PLAIN);
        CHECK(kv_weights_matmul_int8(plain, x, w, KV_WEIGHT_Q8_0, n_tokens, ties_dim, ties_out) == KV_OK);
        kv_set_kernels(before);
        CHECK(memcmp(fast, plain, sizeof(float) * n_tokens * ties_out) == 0);
        free(w); free(x); free(fast); free(plain);
    }
}

/* n_rows rows of in_dim floats written in `format` (Q8_0 as ggml quantizes: a half scale
 * amax / 127 per block, codes rounded), and their values read back into `values`. */
static uint8_t *encode_rows(const float *src, size_t n_rows, int in_dim, kv_weight_format format,
                            float *values) {
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    uint8_t *out = malloc(row_bytes * n_rows);
    for (size_t o = 0; o < n_rows; o++) {
        uint8_t *row = out + row_bytes * o;
        const float *x = src + o * in_dim;
        int blocks = format == KV_WEIGHT_Q8_0 || format == KV_WEIGHT_Q4_0 || format == KV_WEIGHT_Q4_1;
        for (int i = 0; !blocks && i < in_dim; i++) {
            uint16_t code = format == KV_WEIGHT_F16 ? kv_f32_to_f16(x[i]) : kv_f32_to_bf16(x[i]);
            memcpy(row + 2 * i, &code, 2);
        }
        for (int b = 0; format == KV_WEIGHT_Q8_0 && b < in_dim / 32; b++) {
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
            float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            uint16_t scale = kv_f32_to_f16(d);
            memcpy(row + 34 * b, &scale, 2);
            for (int i = 0; i < 32; i++) row[34 * b + 2 + i] = (uint8_t)(int8_t)roundf(x[32 * b + i] * inverse);
        }
        size_t q4_bytes = kv_weight_block_bytes(format);
        for (int b = 0; (format == KV_WEIGHT_Q4_0 || format == KV_WEIGHT_Q4_1) && b < in_dim / 32; b++) {
            /* min and max: Q4_1 codes (x - min) / d, d = (max - min) / 15; Q4_0 codes x / d + 8,
             * d = max|x| / 8 (not ggml's choice of sign, which does not matter here) */
            float lo = x[32 * b], hi = x[32 * b], amax = 0.0f;
            for (int i = 0; i < 32; i++) {
                lo = fminf(lo, x[32 * b + i]);
                hi = fmaxf(hi, x[32 * b + i]);
                amax = fmaxf(amax, fabsf(x[32 * b + i]));
            }
            int q4_1 = format == KV_WEIGHT_Q4_1;
            float d = q4_1 ? (hi - lo) / 15.0f : amax / 8.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            uint16_t d_half = kv_f32_to_f16(d), m_half = kv_f32_to_f16(lo);
            uint8_t *block = row + q4_bytes * b, *codes = block + (q4_1 ? 4 : 2);
            memcpy(block, &d_half, 2);
            if (q4_1) memcpy(block + 2, &m_half, 2);
            memset(codes, 0, 16);
            for (int i = 0; i < 32; i++) {
                float q = q4_1 ? (x[32 * b + i] - lo) * inverse + 0.5f : x[32 * b + i] * inverse + 8.5f;
                int code = q < 0.0f ? 0 : q > 15.0f ? 15 : (int)q;
                codes[i % 16] |= (uint8_t)(code << (i < 16 ? 0 : 4));
            }
        }
        kv_weight_row_dequantize(format, row, in_dim, values + o * in_dim);
    }
    return out;
}

/* Logits of 10 tokens, all of them: a prefill of 6 on a cache, then 4 decode steps, on
 * whichever tier is set (cache capacity 10) */
static void run_ten(const kv_model *m, const int32_t *tokens, float *logits) {
    const kv_config *c = &m->config;
    kv_cache cache;
    CHECK(kv_cache_init(&cache, c->n_layers, c->n_kv_heads, c->head_dim, 10, NULL) == KV_OK);
    CHECK(kv_model_forward(m, &cache, tokens, 6, logits, 1, NULL) == KV_OK);
    for (int i = 6; i < 10; i++)
        CHECK(kv_model_forward(m, &cache, tokens + i, 1, logits + (size_t)i * c->vocab_size, 0, NULL) == KV_OK);
    kv_cache_free(&cache);
}

/* A model whose matrices are fp16, bf16, Q8_0, Q4_0 or Q4_1 gives, bit for bit, the logits of the
 * float32 model over their dequantized values (float32 activations); on both tiers;
 * prefill and decode alike, and paged alike; with int8 activations the tiers agree and
 * prefill equals decode. */
static void test_model_weight_formats(void) {
    test_model tm;
    make_model_sized(&tm, 64, 96, 4, 2, 16);
    const kv_config *c = &tm.model.config;
    size_t L = c->n_layers, D = c->dim, H = c->hidden_dim, V = c->vocab_size;
    size_t Q = (size_t)c->n_heads * c->head_dim, KV = (size_t)c->n_kv_heads * c->head_dim;
    int32_t tokens[10];
    for (int i = 0; i < 10; i++) tokens[i] = (int32_t)(i * 11 % (int)V);
    kv_weight_format formats[] = {KV_WEIGHT_F16, KV_WEIGHT_BF16, KV_WEIGHT_Q8_0, KV_WEIGHT_Q4_0,
                                  KV_WEIGHT_Q4_1};
    kv_kernels before = kv_get_kernels();
    for (int f = 0; f < 5; f++) {
        kv_model stored = tm.model, dequantized = tm.model;
        kv_matrix *matrices[] = {&stored.weights.token_embedding, &stored.weights.wq,
                                 &stored.weights.wk, &stored.weights.wv, &stored.weights.wo,
                                 &stored.weights.w1, &stored.weights.w2, &stored.weights.w3,
                                 &stored.weights.classifier};
        kv_matrix *floats[] = {&dequantized.weights.token_embedding, &dequantized.weights.wq,
                               &dequantized.weights.wk, &dequantized.weights.wv,
                               &dequantized.weights.wo, &dequantized.weights.w1,
                               &dequantized.weights.w2, &dequantized.weights.w3,
                               &dequantized.weights.classifier};
        size_t rows[] = {V, L * Q, L * KV, L * KV, L * D, L * H, L * D, L * H, V};
        int in_dims[] = {(int)D, (int)D, (int)D, (int)D, (int)Q, (int)D, (int)H, (int)D, (int)D};
        void *buffers[18];
        for (int i = 0; i < 9; i++) {
            float *values = malloc(sizeof(float) * rows[i] * in_dims[i]);
            uint8_t *bytes = encode_rows(matrices[i]->data, rows[i], in_dims[i], formats[f], values);
            *matrices[i] = (kv_matrix){bytes, formats[f]};
            *floats[i] = (kv_matrix){values, KV_WEIGHT_F32};
            buffers[2 * i] = bytes;
            buffers[2 * i + 1] = values;
        }
        CHECK(kv_model_check(&stored) == KV_OK);
        size_t n = 10 * V;
        float *want = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
        float *plain = malloc(sizeof(float) * n), *paged = malloc(sizeof(float) * n);
        run_ten(&dequantized, tokens, want);
        run_ten(&stored, tokens, got);
        CHECK(memcmp(want, got, sizeof(float) * n) == 0);
        kv_set_kernels(KV_KERNELS_PLAIN);
        run_ten(&stored, tokens, plain);
        kv_set_kernels(before);
        CHECK(memcmp(want, plain, sizeof(float) * n) == 0);
        kv_pool pool;   /* all ten tokens in one paged call */
        int seq;
        CHECK(kv_pool_init(&pool, c->n_layers, c->n_kv_heads, c->head_dim, 4, 4, 1, 4, NULL) == KV_OK);
        CHECK(kv_blocks_seq_new(&pool.blocks, &seq) == KV_OK);
        CHECK(kv_model_forward_paged(&stored, &pool, seq, tokens, 10, paged, 1, NULL) == KV_OK);
        CHECK(memcmp(want, paged, sizeof(float) * n) == 0);
        kv_pool_free(&pool);
        kv_counters counts = {0}, float_counts = {0};
        CHECK(kv_model_forward_uncached(&stored, tokens, 3, got, 0, KV_UNCACHED_ALL_LAYERS, &counts) ==
              KV_OK);
        CHECK(kv_model_forward_uncached(&dequantized, tokens, 3, got, 0, KV_UNCACHED_ALL_LAYERS,
                                        &float_counts) == KV_OK);
        /* the bytes read shrink with the matrices (1/2, or 34/128), the norms stay float32 */
        double ratio = (double)counts.weight_bytes / (double)float_counts.weight_bytes;
        double least = formats[f] == KV_WEIGHT_F16 || formats[f] == KV_WEIGHT_BF16
                           ? 0.5 : (double)kv_weight_block_bytes(formats[f]) / 128.0;
        CHECK(ratio > least && ratio < least * 1.05 && counts.flops_mlp == float_counts.flops_mlp);
        if (kv_weight_takes_int8(formats[f])) {   /* int8 activations: prefill = decode, tiers agree */
            stored.int8_activations = 1;
            float *stepped = malloc(sizeof(float) * n);
            run_ten(&stored, tokens, got);
            kv_cache cache;
            CHECK(kv_cache_init(&cache, c->n_layers, c->n_kv_heads, c->head_dim, 10, NULL) == KV_OK);
            for (int i = 0; i < 10; i++)
                CHECK(kv_model_forward(&stored, &cache, tokens + i, 1, stepped + (size_t)i * V, 0, NULL) == KV_OK);
            kv_cache_free(&cache);
            CHECK(memcmp(got, stepped, sizeof(float) * n) == 0);
            CHECK(memcmp(got, want, sizeof(float) * n) != 0);   /* x was rounded */
            kv_set_kernels(KV_KERNELS_PLAIN);
            run_ten(&stored, tokens, plain);
            kv_set_kernels(before);
            CHECK(memcmp(got, plain, sizeof(float) * n) == 0);
            free(stepped);
        }
        /* a block-format matrix whose rows are not whole blocks is refused */
        stored.config.hidden_dim = 80;
        if (kv_weight_takes_int8(formats[f])) CHECK(kv_model_check(&stored) == KV_ERR_INVALID_ARG);
        free(want); free(got); free(plain); free(paged);
        for (int i = 0; i < 18; i++) free(buffers[i]);
    }
    free_model(&tm);
}

/* The choice of kernel variant (dispatch.c): the core loads with the best one this CPU runs,
 * an unknown name changes nothing, and the last variant runs anywhere. */
static void test_dispatch(const kv_variant *loaded) {
    int count;
    const kv_variant *variants = kv_variants(&count), *asked = kv_current_variant();
    CHECK(count >= 1 && variants[count - 1].cpu_has == NULL);
    int best = 0;
    while (variants[best].cpu_has != NULL && !variants[best].cpu_has()) best++;
    CHECK(loaded == &variants[best]);
    CHECK(kv_use_variant("no such variant") == KV_ERR_INVALID_ARG);
    CHECK(kv_current_variant() == asked);
    CHECK(kv_use_variant(NULL) == KV_OK && kv_current_variant() == &variants[best]);
    CHECK(kv_use_variant(asked->kernels->name) == KV_OK && kv_current_variant() == asked);
}

/* The kernel variant to test, named by the first argument (a build of several variants is
 * run once per variant, tests/c/Makefile): chosen, or skipped with a line saying why where
 * this CPU cannot run it. Without one, the variant the core chose when it was loaded. */
static int use_variant(int argc, char **argv) {
    if (argc < 2) return 1;
    int count;
    const kv_variant *variants = kv_variants(&count);
    for (int i = 0; i < count; i++) {
        if (strcmp(argv[1], variants[i].kernels->name) != 0) continue;
        if (kv_use_variant(argv[1]) == KV_OK) return 1;
        printf("variant %s: skipped, this CPU lacks %s\n", argv[1], variants[i].needs);
        return 0;
    }
    fprintf(stderr, "variant %s: this build has no such variant\n", argv[1]);
    exit(2);
}

/* The compute roof: every rate measured and positive on one thread and on two, the
 * instructions named; bad arguments refused before anything runs. */
static void test_compute_roof(void) {
    for (int threads = 1; threads <= 2; threads++) {
        kv_compute_roof roof = {0};
        CHECK(kv_measure_compute(threads, 1, &roof) == KV_OK);
        CHECK(roof.f32_flops > 1e6 && roof.int8_ops > 1e6 && roof.int8_product_ops > 1e6);
        CHECK(roof.f32_instruction != NULL && roof.int8_instruction != NULL);
    }
    kv_compute_roof roof;
    CHECK(kv_measure_compute(0, 1, &roof) == KV_ERR_INVALID_ARG);
    CHECK(kv_measure_compute(1, 0, &roof) == KV_ERR_INVALID_ARG);
    CHECK(kv_measure_compute(1, 1, NULL) == KV_ERR_INVALID_ARG);
}

int main(int argc, char **argv) {
    const kv_variant *loaded = kv_current_variant();
    if (!use_variant(argc, argv)) return 0;
    printf("variant %s\n", kv_current_variant()->kernels->name);
    test_dispatch(loaded);
    test_ops();
    test_softmax_tile8();
    test_compute_roof();
    test_cache();
    test_pool();
    test_block_manager();
    test_cancel_gives_back_a_copy_on_write();
    test_block_truncate();
    test_block_findable();
    test_store_formats();
    test_model_weight_formats();
    test_model_paths_agree(4, 4, 6, NULL);   /* MHA */
    test_model_paths_agree(6, 2, 8, NULL);   /* GQA */
    test_model_paths_agree(4, 1, 10, NULL);  /* MQA */
    const kv_cache_format int8 = {KV_FMT_I8, KV_FMT_I8, 0, 0, 0};
    const kv_cache_format mixed = {KV_FMT_I4, KV_FMT_FP8, 4, 2, 3};   /* with a window of 3 */
    const kv_cache_format halves = {KV_FMT_F16, KV_FMT_BF16, 0, 0, 5};
    test_model_paths_agree(6, 2, 8, &int8);
    test_model_paths_agree(6, 2, 8, &mixed);
    test_model_paths_agree(4, 1, 10, &halves);
    test_cache_keep(NULL);
    test_cache_keep(&int8);
    test_cache_ring(NULL);
    test_cache_ring(&int8);
    const kv_cache_format int4 = {KV_FMT_I4, KV_FMT_FP8, 4, 2, 0};   /* zero points, groups */
    test_cache_ring(&int4);
    test_cache_ring_model();
    test_pool_keep();
    test_pool_start(NULL);
    test_pool_start(&int8);
    test_pool_start(&int4);
    test_pool_start_model(0);
    test_pool_start_model(2);
    test_pool_start_books();
    test_pool_swap(NULL);
    test_pool_swap(&int8);
    test_pool_swap(&mixed);
    test_pool_swap(&halves);
    test_weight_formats();
    test_interrupts();
    test_long_passes_stop_between_layers();
    test_tiers_small_ops();
    test_tiers_matmul();
    test_tiers_attention();
    test_attention_prefill_blocks();
    for (int threads = 1; threads <= 2; threads++) {
        test_model_tiers_agree(4, 4, 6, NULL, threads);    /* MHA, head_dim with leftovers */
        test_model_tiers_agree(6, 2, 8, NULL, threads);    /* GQA */
        test_model_tiers_agree(4, 1, 10, NULL, threads);   /* MQA */
        test_model_tiers_agree(6, 2, 8, &int8, threads);
        test_model_tiers_agree(6, 2, 8, &mixed, threads);
        test_model_tiers_agree(4, 1, 10, &halves, threads);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
