/* plain.c: the kernels of a Llama layer written to be read: the plain tier.
 *
 * Attention, the matrix product, RMSNorm, RoPE and SwiGLU as loops, one value at a time,
 * in llama2.c's style. They are the bit-for-bit specification of the fast kernels (ops.c,
 * attention.c), which tile, vectorize and prefetch but must give exactly these bits
 * (tests/c checks it with memcmp); the math itself is specified by kvlab/reference.py. KVLAB_KERNELS=plain runs the model on these, so a debugger can step
 * through every line and see the same tokens. This file is not about speed, and does not
 * own the cache layouts (store.c reads a row of any format back as floats).
 *
 * Why the sums are written the way they are: floating-point addition is not associative,
 * so a sum taken in another order gives slightly different bits. Every dot product of the
 * core is summed in one fixed order, the one eight-wide vector registers make fast: eight
 * running sums ("lanes"), value i going to lane i % 8, each added with a fused
 * multiply-add (one rounding); then the lanes added pairwise; then the values past the last
 * full chunk of eight, in order. Written as loops here, it gives the fast kernels' bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "plain.h"
#include "quant.h"
#include "store.h"

/* acc + a * b. With one rounding where the CPU has fused multiply-add instructions (in a
 * kernel variant built for CPUs with FMA, dispatch.h), as the fast kernels' madd does;
 * else a multiply, then an add, as theirs does too. Either way both tiers round alike. */
static inline float multiply_add(float a, float b, float acc) {
#ifdef __FMA__
    return fmaf(a, b, acc);
#else
    return acc + a * b;
#endif
}

/* the eight lanes of a sum, added pairwise */
static float add_lanes(const float lanes[8]) {
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

float kv_plain_dot(const float *a, const float *b, int n) {
    float lanes[8] = {0};
    int n8 = n - n % 8;                 /* the full chunks of eight */
    for (int i = 0; i < n8; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] = multiply_add(a[i + j], b[i + j], lanes[j]);
    float sum = add_lanes(lanes);
    for (int i = n8; i < n; i++) sum += a[i] * b[i];   /* the leftovers, in order */
    return sum;
}

/* ---- matrix product, RMSNorm, RoPE ---------------------------------------------------- */

/* NumPy twin: x @ w.T in kvlab/reference.py, forward. Every output is one dot product of a
 * row of w with a token's x. Threads take rows of w, as in llama2.c's matmul. */
void kv_plain_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
                     int out_dim) {
    // out (n_tokens, out_dim), x (n_tokens, in_dim), w (out_dim, in_dim)
    #pragma omp parallel for num_threads(kv_threads()) \
        if ((int64_t)n_tokens * out_dim * in_dim >= KV_PARALLEL_MIN_WORK)
    for (int o = 0; o < out_dim; o++)
        for (int t = 0; t < n_tokens; t++)
            out[(size_t)t * out_dim + o] =
                kv_plain_dot(w + (size_t)o * in_dim, x + (size_t)t * in_dim, in_dim);
}

/* NumPy twin: x @ dequantize(w).T (kvlab/weight_formats.py). A matrix stored in fewer bytes
 * (fp16, bf16, Q8_0, Q4_0, Q4_1) is the same product: each row made float32 first, then the
 * same dot products. The fast tier (weight_formats.c) converts in registers instead, and must
 * give these bits. */
void kv_plain_matmul_weights(float *out, const float *x, const uint8_t *w,
                             kv_weight_format format, int n_tokens, int in_dim, int out_dim,
                             float *scratch, int n_threads) {
    // out (n_tokens, out_dim), x (n_tokens, in_dim), w (out_dim, row bytes),
    // scratch (n_threads, in_dim): one row's float32 values per thread
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    #pragma omp parallel for num_threads(n_threads) \
        if ((int64_t)n_tokens * out_dim * in_dim >= KV_PARALLEL_MIN_WORK)
    for (int o = 0; o < out_dim; o++) {
        float *row = scratch + (size_t)omp_get_thread_num() * in_dim;
        kv_weight_row_dequantize(format, w + (size_t)o * row_bytes, in_dim, row);
        for (int t = 0; t < n_tokens; t++)
            out[(size_t)t * out_dim + o] = kv_plain_dot(row, x + (size_t)t * in_dim, in_dim);
    }
}

/* The integer code of value i (0 .. 31) of a block of Q8_0, Q4_0 or Q4_1 weights, `codes`
 * its code bytes: the weight is d * code (Q8_0, Q4_0) or d * code + m (Q4_1). */
static int32_t weight_code(kv_weight_format format, const uint8_t *codes, int i) {
    if (format == KV_WEIGHT_Q8_0) return (int8_t)codes[i];
    if (format == KV_WEIGHT_Q4_0) return kv_q4_code(codes, i) - 8;
    return kv_q4_code(codes, i);   /* Q4_1: 0 .. 15, the block's min m added apart */
}

/* Q8_0, Q4_0 or Q4_1 weights against activations quantized to int8 per block of 32 (the
 * other way to use them: integer products, as llama.cpp does). Not the float32 product of
 * the dequantized matrix: x is rounded too. The order is the spec the fast tier
 * (weight_formats.c) keeps, llama.cpp's reference rule for q8_0 x q8_0: in each block the
 * 32 products code * x_code are added exactly, as integers (at most 32 x 128 x 128 = 2^19,
 * exact in int32 and in float32, so the order inside a block cannot matter); that block
 * total times d_w * d_x is added to ONE running float sum, block after block in order,
 * with one multiply-add (one rounding where the build fuses it). So a row's dot product
 * costs one float operation per 32 byte products: the fast kernels put 16 rows side by side
 * in a vector and do the integer part with dot-product instructions. Q4_1's weight is
 * d_w * code + m_w: its m part comes to m_w times the block's d_x * (sum of its 32 x
 * codes), computed once per activation block (llama.cpp's Q8_1 idea), and these are summed
 * block after block in a running sum of their own (one rounding each), added to the main
 * sum at the end. NumPy twin: kvlab.weight_formats.matmul_int8. */
void kv_plain_matmul_int8(float *out, const float *x, const uint8_t *w, kv_weight_format format,
                          int n_tokens, int in_dim, int out_dim, float *x_scales,
                          int8_t *x_codes) {
    // out (n_tokens, out_dim), x (n_tokens, in_dim), w (out_dim, row bytes),
    // x_scales (2, n_tokens, in_dim / 32): each block's scale d_x, then its d_x * sum of codes;
    // x_codes (n_tokens, in_dim): x quantized here
    int n_blocks = in_dim / 32;
    size_t row_bytes = kv_weight_row_bytes(format, in_dim);
    size_t block_bytes = kv_weight_block_bytes(format);
    int header = format == KV_WEIGHT_Q4_1 ? 4 : 2;   /* d, and Q4_1's m, before the codes */
    float *x_sums = x_scales + (size_t)n_tokens * n_blocks;
    for (int t = 0; t < n_tokens; t++)
        kv_quantize_activations_q8(x + (size_t)t * in_dim, in_dim, x_scales + (size_t)t * n_blocks,
                                   x_codes + (size_t)t * in_dim, x_sums + (size_t)t * n_blocks);
    #pragma omp parallel for num_threads(kv_threads()) \
        if ((int64_t)n_tokens * out_dim * in_dim >= KV_PARALLEL_MIN_WORK)
    for (int o = 0; o < out_dim; o++) {
        const uint8_t *row = w + (size_t)o * row_bytes;
        for (int t = 0; t < n_tokens; t++) {
            const int8_t *xq = x_codes + (size_t)t * in_dim;
            float sum = 0.0f, m_part = 0.0f;
            for (int b = 0; b < n_blocks; b++) {
                const uint8_t *block = row + (size_t)b * block_bytes;
                float scale = kv_half_at(block) * x_scales[(size_t)t * n_blocks + b];
                /* the block's 32 products, exactly; two loops, not one: GCC 12.2 -O3
                 * -mavx512vnni vectorizes the fused loop's signed byte products with
                 * vpdpbusd, which reads one side as unsigned: wrong totals (tests/c
                 * caught it; a 20-line reproduction gives them on any random block) */
                int32_t codes[32], total = 0;
                for (int i = 0; i < 32; i++) codes[i] = weight_code(format, block + header, i);
                for (int i = 0; i < 32; i++) total += codes[i] * xq[b * 32 + i];
                sum = multiply_add(scale, (float)total, sum);
                if (format == KV_WEIGHT_Q4_1)
                    m_part = multiply_add(kv_half_at(block + 2), x_sums[(size_t)t * n_blocks + b],
                                          m_part);
            }
            out[(size_t)t * out_dim + o] = format == KV_WEIGHT_Q4_1 ? sum + m_part : sum;
        }
    }
}

/* NumPy twin: rmsnorm in kvlab/reference.py. */
void kv_plain_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps) {
    // out (dim,), x (dim,), weight (dim,)
    float mean_square = kv_plain_dot(x, x, dim) / (float)dim;
    float inv_rms = 1.0f / sqrtf(mean_square + eps);
    for (int i = 0; i < dim; i++) out[i] = x[i] * inv_rms * weight[i];
}

/* NumPy twin: rope in kvlab/reference.py. The angles' cos and sin come from the caller
 * (model.c computes them once per token for every layer and head). */
void kv_plain_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
                   const float *sin_table, int interleaved) {
    // vec (n_heads, head_dim), cos_table and sin_table (head_dim / 2,)
    int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *head = vec + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            /* the pair that turns as one complex number: neighbours (llama2.c, Meta) or
             * half a head apart (Hugging Face) */
            int re = interleaved ? 2 * i : i;
            int im = interleaved ? 2 * i + 1 : i + half;
            float a = head[re], b = head[im], c = cos_table[i], s = sin_table[i];
            head[re] = a * c - b * s;
            head[im] = b * c + a * s;
        }
    }
}

/* ---- SwiGLU and the softmax: e^x -------------------------------------------------------- */

/* e^x for x <= 0 (the softmax and SiLU need no others), to about one unit in the last
 * place. Not expf: the fast kernels compute eight of these at once with this recipe, so
 * the plain tier uses it too. x = n ln 2 + r with n a whole number and |r| <= ln 2 / 2;
 * e^r from its Taylor polynomial of degree 6; 2^n written straight into a float's
 * exponent bits. */
static float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;      /* e^-87 is below 2^-125: counted as 0 */
    if (x != x) return x;             /* NaN stays NaN */
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;   /* ln 2 in two parts */
    const float round_magic = 12582912.0f;   /* 1.5 * 2^23: adding it rounds to a whole number */
    float n = (x * log2e + round_magic) - round_magic;
    float r = (x - n * ln2_hi) - n * ln2_lo;
    float p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;   /* 2^n as a float */
    float two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return p * two_to_n;
}

/* NumPy twin: silu(h @ w1.T) * (h @ w3.T) in kvlab/reference.py, forward. */
void kv_plain_swiglu(float *gate, const float *up, size_t n) {
    // gate (n,), up (n,)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        /* silu(g) = g / (1 + e^-g). With e = e^-|g|, never an overflow: g / (1 + e) for
         * g >= 0, and g e / (1 + e) for g < 0 (top and bottom multiplied by e^g) */
        float e = exp_nonpositive(-fabsf(g));
        float numerator = g < 0.0f ? g * e : g;
        gate[i] = numerator / (1.0f + e) * up[i];
    }
}

/* ---- attention ---------------------------------------------------------------------- */

/* One step of the online softmax, for a tile of n <= KV_ATTENTION_TILE scores of one query
 * head. *running_max and *running_sum are the largest score so far and the sum of
 * e^(score - max) over the earlier tiles (-inf and 0 before the first). Replaces each
 * score s with e^(s - new max) and returns e^(old max - new max): what everything summed
 * under the old max must be multiplied by to join the new terms. */
static float softmax_tile(float *scores, int n, float *running_max, float *running_sum) {
    float tile_max = -INFINITY;
    for (int i = 0; i < n; i++)
        if (scores[i] > tile_max) tile_max = scores[i];
    float new_max = tile_max > *running_max ? tile_max : *running_max;
    float lanes[8] = {0};   /* the tile's sum, in lanes like a dot product's */
    for (int i = 0; i < n; i++) {
        scores[i] = exp_nonpositive(scores[i] - new_max);
        lanes[i % 8] += scores[i];
    }
    float correction = new_max == *running_max ? 1.0f : exp_nonpositive(*running_max - new_max);
    *running_sum = *running_sum * correction + add_lanes(lanes);
    *running_max = new_max;
    return correction;
}

/* Head `head` of the key row (is_value 0) or value row (1) at position pos, as float32, as
 * a query at query_pos reads it: inside the residual window (its last `window` positions)
 * the exact rows kept beside the cache, else the row the cache stores, found through the
 * block table and decoded into buffer (head_dim floats) unless it is float32 already. */
/* [quote ch04-cached-row] */
static const float *cached_row(const kv_layer_view *view, int is_value, int pos, int head,
                               int query_pos, int head_dim, float *buffer) {
    const kv_store *store = is_value ? view->value : view->key;
    size_t kv_dim = (size_t)store->n_kv_heads * head_dim;
    int in_window = view->window > 0 && pos > query_pos - view->window;
    if (!in_window)
        return kv_store_head(store, view->layer, kv_view_slot(view, pos), head, buffer);
    if (pos >= view->new_start)   /* written by this call */
        return (is_value ? view->new_value : view->new_key) +
               (size_t)(pos - view->new_start) * kv_dim + (size_t)head * head_dim;
    return (is_value ? view->window_value : view->window_key) +
           (size_t)(pos % view->window) * kv_dim + (size_t)head * head_dim;
}
/* [end ch04-cached-row] */

/* y += a * x, rounded as the fast kernels round it: their chunks of eight values take a
 * fused multiply-add each, the leftovers past them a multiply and an add. */
static void add_scaled(float *y, float a, const float *x, int n) {
    int n8 = n - n % 8;
    for (int i = 0; i < n8; i++) y[i] = multiply_add(a, x[i], y[i]);
    for (int i = n8; i < n; i++) y[i] += a * x[i];
}

#define TILE KV_ATTENTION_TILE   /* positions scored, softmaxed and mixed at a time */

/* NumPy twin: attention in kvlab/reference.py. One pass over the positions, a tile of 16 at
 * a time with the online softmax (chapter 7): a tile's scores, then its values mixed in,
 * so no row of scores as long as the context is ever needed. The fast kernel's bits
 * depend on where its tiles start, so these start where its do: at position 0, for every
 * query, alone in a decode step or in a prefill. */
/* [quote ch01-kv-plain-attention] */
void kv_plain_attention(float *out, const float *q, const kv_layer_view *view, int n_tokens,
                        int start_pos, int n_heads, int n_kv_heads, int head_dim,
                        float *scratch, size_t scratch_stride, int n_threads) {
    // out and q (n_tokens, n_heads, head_dim); the view holds K and V of positions
    // 0 .. start_pos + n_tokens - 1, (n_kv_heads, head_dim) each
    int kv_mul = n_heads / n_kv_heads;   /* query heads that share one KV head */
    float scale = 1.0f / sqrtf((float)head_dim);
    #pragma omp parallel for collapse(2) num_threads(n_threads) \
        if ((int64_t)n_tokens * n_heads * (start_pos + n_tokens) * head_dim >= KV_PARALLEL_MIN_WORK)
    for (int t = 0; t < n_tokens; t++) {
        for (int h = 0; h < n_heads; h++) {
            int query_pos = start_pos + t;
            int n_seen = query_pos + 1;       /* positions 0 .. its own: the causal mask */
            int kv_head = h / kv_mul;         /* GQA: query head h reads KV head h / kv_mul */
            const float *q_h = q + ((size_t)t * n_heads + h) * head_dim;   // (head_dim,)
            float *out_h = out + ((size_t)t * n_heads + h) * head_dim;     // (head_dim,)
            /* this thread's scratch: where a row of a quantized cache is decoded */
            float *row = scratch + (size_t)omp_get_thread_num() * scratch_stride;  // (head_dim,)
            float running_max = -INFINITY, running_sum = 0.0f;
            for (int i = 0; i < head_dim; i++) out_h[i] = 0.0f;
            for (int tile_start = 0; tile_start < n_seen; tile_start += TILE) {
                int n = n_seen - tile_start < TILE ? n_seen - tile_start : TILE;
                float weights[TILE];   // (n,) the tile's scores, then e^(score - max)
                for (int r = 0; r < n; r++) {
                    const float *key = cached_row(view, 0, tile_start + r, kv_head, query_pos,
                                                  head_dim, row);
                    weights[r] = kv_plain_dot(q_h, key, head_dim) * scale;
                }
/* [end ch01-kv-plain-attention] */
                /* the online softmax: the scores become e^(score - max so far), and what
                 * the outputs summed under an older, smaller max is scaled to match */
                float correction = softmax_tile(weights, n, &running_max, &running_sum);
                for (int i = 0; i < head_dim; i++) out_h[i] *= correction;
                for (int r = 0; r < n; r++) {
                    const float *value = cached_row(view, 1, tile_start + r, kv_head, query_pos,
                                                    head_dim, row);
                    add_scaled(out_h, weights[r], value, head_dim);
                }
            }
            float inv_sum = 1.0f / running_sum;   /* the softmax's normalization, once */
            for (int i = 0; i < head_dim; i++) out_h[i] *= inv_sum;
        }
    }
}
