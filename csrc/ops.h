/* ops.h: the numeric building blocks of a Llama layer (internal to the core).
 *
 * Each op works on row-major float32 rows. Dot products everywhere in the core use one
 * fixed summation order (see ops.c), so a token's numbers come out bit-identical whether
 * it was computed alone (decode) or inside a batch (prefill, or the no-cache path).
 * Declarations only: the vector helpers the fast kernels are built from are in simd.h.
 */
#ifndef KVLAB_OPS_H
#define KVLAB_OPS_H

#include <stddef.h>

#include "common.h"

/* out[t, o] = sum_i x[t, i] * w[o, i]  for t < n_tokens, o < out_dim.
 * x (n_tokens, in_dim), w (out_dim, in_dim), out (n_tokens, out_dim). Threaded over o. */
void kv_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
               int out_dim);

/* Several products of the same x at once, outs[m] = x . ws[m]^T (out_dims[m] rows each):
 * one parallel region for all of them, as Wq, Wk and Wv (or W1 and W3) share their input. */
void kv_matmul_many(int n_matrices, float *const *outs, const float *const *ws,
                    const int *out_dims, const float *x, int n_tokens, int in_dim);

/* Tokens a product takes at a time, so that their inputs stay in the L2 cache while the
 * rows of w pass over them (ops.c). Each chunk streams every weight matrix from memory
 * once: 96 reads them half as often as 48 did, and 256-token prefill ran 1.03-1.18x on the
 * 110M shape, 0.99-1.08x on 15M's, 1.00-1.10x on SmolLM2 (F32 and Q8_0, ab.py, CPU time, 1
 * thread, two runs of 6 rounds, issue 37); 64 gained less. The costs: the packed input and
 * an uncached call's chunk of activations are twice as large, and a chunk of a long call
 * (common.h) is at least this many tokens, so Ctrl-C waits for up to twice as much work. */
#define KV_TOKEN_CHUNK 96

/* x (n_tokens, in_dim) as the AVX-512 tile reads it (pairs of tokens side by side, chunk
 * by chunk of eight columns), KV_TOKEN_CHUNK tokens at a time: memory for one chunk of
 * the tokens (kv_packed_tokens_alloc; freed with free), or NULL where the tile is not
 * built in, the tokens are too few for it, or the memory cannot be had (the products then
 * take their other kernels, with the same bits); kv_pack_tokens fills pairs first .. last
 * - 1 of it (of (n_tokens + 1) / 2), so that threads can share the work, and
 * kv_pack_chunk packs tokens first .. first + chunk - 1 with every thread of a parallel
 * region (all must call it, chunk after chunk: it waits for them all before and after). */
float *kv_packed_tokens_alloc(int n_tokens, int in_dim);
void kv_pack_tokens(const float *x, int n_tokens, int in_dim, float *packed, int first,
                    int last);
static inline int kv_packed_chunk(int n_tokens) {
    return n_tokens < KV_TOKEN_CHUNK ? n_tokens : KV_TOKEN_CHUNK;
}
/* (defined here, not in ops.c, so that each kernel variant's file has its own) */
static inline void kv_pack_chunk(const float *x, int first, int chunk, int in_dim,
                                 float *packed) {
    int team = omp_get_num_threads(), me = omp_get_thread_num(), n_pairs = (chunk + 1) / 2;
    if (first > 0) {
        #pragma omp barrier   /* every thread is done with the chunk before */
    }
    kv_pack_tokens(x + (size_t)first * in_dim, chunk, in_dim, packed,
                   kv_split(n_pairs, me, team), kv_split(n_pairs, me + 1, team));
    #pragma omp barrier
}

/* Which AVX-512 tiles this compilation builds (ops.c's float32 one; weight_formats.c's
 * int8 x int8 one), and so what scratch their products allocate. The float32 tile packs
 * its input: a copy of a chunk of x, made once per product with at least 4 tokens,
 * ((chunk + 1) / 2) * (in_dim / 8) * 16 floats (kv_packed_input_floats). The int8 tile
 * puts rows in the lanes and takes a product of KV_INT8_TILE_MIN_TOKENS or more
 * (kv_int8_tile_floats). The kernel table says which a variant has (dispatch.h's
 * packed_inputs), so that the forward call's counters include it. */
#if defined(__AVX512F__) && defined(__FMA__) && defined(__GNUC__)
#define KV_F32_TILE_512 1
#endif
#if defined(KV_F32_TILE_512) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define KV_INT8_TILE_512 1
#endif
#define KV_PACKS_F32 1
#define KV_PACKS_INT8 2
#if defined(KV_INT8_TILE_512)
#define KV_PACKED_INPUTS (KV_PACKS_F32 | KV_PACKS_INT8)
#elif defined(KV_F32_TILE_512)
#define KV_PACKED_INPUTS KV_PACKS_F32
#else
#define KV_PACKED_INPUTS 0
#endif
static inline size_t kv_packed_input_floats(int n_tokens, int in_dim) {
    if (n_tokens < 4 || in_dim < 8) return 0;
    return ((size_t)n_tokens + 1) / 2 * (size_t)(in_dim / 8) * 16;
}
/* What weight_formats.c's AVX-512 VNNI int8 tile allocates for a product of n_tokens
 * tokens of in_dim, in floats: from KV_INT8_TILE_MIN_TOKENS (its TILE_MIN_TOKENS) on, each
 * token's blocks' starting sums (n_tokens x in_dim / 32 int32), and for each of the team's
 * n_threads room for a panel of 16 rows (in_dim / 32 blocks of PANEL_BLOCK_BYTES, 640),
 * allocated from 8 tokens though only products of more than one tile of tokens (13 on,
 * Q4_1 9) store one; fewer tokens stream the rows and allocate nothing. (The AVX2
 * variant's int8 tile allocates the like, with panels of 8 rows; KV_PACKED_INPUTS does not
 * flag it, so its counters leave it out.) */
#define KV_INT8_TILE_MIN_TOKENS 8
#define KV_INT8_PANEL_BLOCK_BYTES 640
static inline size_t kv_int8_tile_floats(int n_tokens, int in_dim, int n_threads) {
    if (n_tokens < KV_INT8_TILE_MIN_TOKENS) return 0;
    size_t blocks = (size_t)(in_dim / 32);
    return (size_t)n_tokens * blocks +
           (size_t)n_threads * blocks * KV_INT8_PANEL_BLOCK_BYTES / sizeof(float);
}

/* Four rows of a matrix, float32 wherever they lie (rows[r] is output o + r), against tokens
 * first .. first + chunk - 1 (chunk <= KV_TOKEN_CHUNK) of x (in_dim each):
 * out[t * out_dim + o + r], in kv_dot's order. packed: kv_pack_chunk's copy of those
 * tokens, or NULL.
 * For rows made float32 on the way (weight_formats.c). */
void kv_matmul_four_rows(float *out, const float *x, const float *packed,
                         const float *const rows[4], int o, int first, int chunk, int in_dim,
                         int out_dim);

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of length dim */
void kv_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps);

/* Rotates each head of one token's q or k (n_heads * head_dim floats) in place by the
 * angles whose cos/sin (head_dim/2 each) are given; interleaved picks the pair layout. */
void kv_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
             const float *sin_table, int interleaved);

/* One step of the online softmax, for a tile of n scores (1 <= n <= 16) of one query head.
 * running_max and running_sum hold the largest score so far and the sum of e^(s - max)
 * over the earlier tiles (-inf and 0 before the first). Replaces each score s with
 * e^(s - new max), updates both, and returns e^(old max - new max): the factor by which
 * whatever was summed under the old max must be scaled to join the new terms. */
float kv_softmax_tile(float *scores, int n, float *running_max, float *running_sum);

/* The same step for eight query heads at once, bit for bit what kv_softmax_tile gives each:
 * head m's score j (j < n <= 16) is scores[j * stride + m], its running max and sum
 * running_max[m] and running_sum[m]; its correction goes to corrections[m]. */
void kv_softmax_tile8(float *scores, int n, int stride, float *running_max, float *running_sum,
                      float *corrections);

/* gate = silu(gate) * up, elementwise: the SwiGLU activation */
void kv_swiglu(float *gate, const float *up, size_t n);

/* The index of the largest of n values, the first of equal ones; the first NaN if there is
 * one. The same choice as numpy.argmax, so greedy decoding in C and in Python agree. */
int kv_argmax(const float *values, int n);

#endif /* KVLAB_OPS_H */
