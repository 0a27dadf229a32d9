/* ops.c: matrix products, RMSNorm, RoPE, softmax and SwiGLU for the CPU core: the fast
 * tier. plain.c has the same math as plain loops, to be read first; these must give its
 * bits exactly (tests/c/test_core.c), and KVLAB_KERNELS=plain runs it instead.
 *
 * Why a fixed summation order: floating-point addition is not associative, so a dot
 * product summed in a different order gives slightly different bits. Every dot product
 * here uses the same recipe (eight running lanes over chunks of eight, the lanes added
 * pairwise, then the leftover elements in order), whichever kernel computes it. A token
 * therefore gets bit-identical results alone (decode, n_tokens = 1) or inside a matrix
 * of many tokens (prefill, or the no-cache path recomputing everything). That makes the
 * chapter's claim "the cache is exact" literally true on this machine.
 *
 * The lanes are GCC/Clang vector extensions: one v8f is one AVX register (or two SSE
 * registers on older CPUs). The compiler must not fuse a multiply and an add on its own
 * (contraction), which would fuse some products and not others, and differently on each
 * compiler: kvlab_build.py and tests/c/Makefile pass -ffp-contract=off to every compiler
 * (GCC's ISO C mode, -std=c11, turns it off for GCC alone; clang contracts by default).
 * The dot products fuse explicitly instead (madd in simd.h), all of them, which keeps
 * every kernel consistent and gcc's bits equal to clang's (tests/test_bits.py).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "ops.h"
#include "simd.h"

/* The matrix product's kernels: a few rows of w against a few tokens, every dot product
 * summed in kv_dot's order (eight multiply-add lanes, added pairwise, then the tail), so
 * that which kernel computed an output never changes its bits. Bigger tiles share more
 * loads: 4 rows x 3 tokens keeps 12 running sums, 3 token chunks and one row chunk in
 * the 16 vector registers of AVX2. */

/* Four rows of w, wherever they lie, and where one token's four outputs go: row r's
 * output for token t is outs[r][t * out_strides[r]]. */
typedef struct {
    const float *rows[4];
    float *outs[4];
    size_t out_strides[4];
} four_rows;

/* Four neighbouring rows o .. o + 3 of w (row length in_dim) and their outputs in out
 * (out_dim per token). */
static four_rows neighbours(const float *w, float *out, int o, int in_dim, int out_dim) {
    four_rows f;
    for (int r = 0; r < 4; r++) {
        f.rows[r] = w + (size_t)(o + r) * in_dim;
        f.outs[r] = out + o + r;
        f.out_strides[r] = (size_t)out_dim;
    }
    return f;
}

/* Token t's four dot products with the rows, from their eight running lanes each: the
 * lanes added up (four sums at once), then the leftover elements past n8. */
static inline void finish_four(const four_rows *f, int t, v8f a0, v8f a1, v8f a2, v8f a3,
                               const float *x, int n8, int in_dim) {
    v4f sums = reduce_lanes4(a0, a1, a2, a3);
    for (int r = 0; r < 4; r++)
        f->outs[r][(size_t)t * f->out_strides[r]] = add_tail(sums[r], f->rows[r], x, n8, in_dim);
}

/* The twelve running sums of four rows of w against three tokens: sum[t][r] for token t
 * and row r, eight lanes each. */
typedef struct {
    v8f sum[3][4];
} sums_4x3;

/* Four rows of w against three tokens, over columns from .. to - 1 (a multiple of 8
 * apart): twelve dot products sharing every load. With `carry`, the sums go on from those
 * in *acc and are left there for the next panel of columns; without, they start from zero
 * and the finished dot products go to the outputs of tokens t .. t + 2, which saves a trip
 * through memory when a row is one panel. Inside the loop the sums are named one by one
 * so that they live in registers, never in memory. */
static ALWAYS_INLINE void kernel_4x3(
        sums_4x3 *acc, const four_rows *f, int t, const float *x0, int from, int to, int in_dim,
        int carry) {
    size_t stride = (size_t)in_dim;
    const float *x1 = x0 + stride, *x2 = x1 + stride;
    const float *w0 = f->rows[0], *w1 = f->rows[1], *w2 = f->rows[2], *w3 = f->rows[3];
    v8f a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0};
    v8f a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    v8f a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0};
    if (carry) {
        a00 = acc->sum[0][0]; a01 = acc->sum[0][1]; a02 = acc->sum[0][2]; a03 = acc->sum[0][3];
        a10 = acc->sum[1][0]; a11 = acc->sum[1][1]; a12 = acc->sum[1][2]; a13 = acc->sum[1][3];
        a20 = acc->sum[2][0]; a21 = acc->sum[2][1]; a22 = acc->sum[2][2]; a23 = acc->sum[2][3];
    }
    for (int i = from; i < to; i += 8) {
        v8f xa = load8(x0 + i), xb = load8(x1 + i), xc = load8(x2 + i), row;
        IN_REGISTER(xa); IN_REGISTER(xb); IN_REGISTER(xc);
        row = load8(w0 + i); IN_REGISTER(row);
        a00 = madd(row, xa, a00); a10 = madd(row, xb, a10); a20 = madd(row, xc, a20);
        row = load8(w1 + i); IN_REGISTER(row);
        a01 = madd(row, xa, a01); a11 = madd(row, xb, a11); a21 = madd(row, xc, a21);
        row = load8(w2 + i); IN_REGISTER(row);
        a02 = madd(row, xa, a02); a12 = madd(row, xb, a12); a22 = madd(row, xc, a22);
        row = load8(w3 + i); IN_REGISTER(row);
        a03 = madd(row, xa, a03); a13 = madd(row, xb, a13); a23 = madd(row, xc, a23);
    }
    if (carry) {
        *acc = (sums_4x3){{{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}}};
    } else {
        finish_four(f, t, a00, a01, a02, a03, x0, to, in_dim);
        finish_four(f, t + 1, a10, a11, a12, a13, x1, to, in_dim);
        finish_four(f, t + 2, a20, a21, a22, a23, x2, to, in_dim);
    }
}

/* Four rows of w, wherever they lie, against token t alone (x is its row of inputs). */
static void kernel_4x1(const four_rows *f, int t, const float *x, int in_dim) {
    const float *w0 = f->rows[0], *w1 = f->rows[1], *w2 = f->rows[2], *w3 = f->rows[3];
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int n8 = in_dim & ~7;
    for (int i = 0; i < n8; i += 8) {
        v8f xv = load8(x + i);
        a0 = madd(load8(w0 + i), xv, a0); a1 = madd(load8(w1 + i), xv, a1);
        a2 = madd(load8(w2 + i), xv, a2); a3 = madd(load8(w3 + i), xv, a3);
    }
    finish_four(f, t, a0, a1, a2, a3, x, n8, in_dim);
}

#ifdef KV_F32_TILE_512   /* ops.h */
#define F32_TILE_512 1
/* The most token pairs kernel_4_pairs_512 takes at once: 4 rows x 6 pairs (twelve tokens)
 * make 24 running sums, with six pairs of inputs and a row in registers 31 of AVX-512's 32. */
#define TILE_PAIRS 6

/* x as kernel_4_pairs_512 reads it (kv_pack_tokens, ops.h), two tokens at a time: pair p's
 * chunk c (columns 8c .. 8c + 7, whole chunks only) is 16 floats, token 2p's eight, then
 * 2p + 1's; chunk after chunk, pair after pair. A lone last token is paired with itself.
 * The same floats as x: made once per product, read by every row. */
void kv_pack_tokens(const float *x, int n_tokens, int in_dim, float *packed, int first,
                    int last) {
    int n_chunks = in_dim / 8;
    for (int p = first; p < last; p++) {
        const float *x0 = x + (size_t)2 * p * in_dim;
        const float *x1 = 2 * p + 1 < n_tokens ? x0 + in_dim : x0;
        float *to = packed + (size_t)p * n_chunks * 16;
        for (int c = 0; c < n_chunks; c++) {
            memcpy(to + 16 * c, x0 + 8 * c, 8 * sizeof(float));
            memcpy(to + 16 * c + 8, x1 + 8 * c, 8 * sizeof(float));
        }
    }
}

/* Within each 128-bit quarter, what _mm256_hadd_ps does within each half: a0 + a1,
 * a2 + a3, b0 + b1, b2 + b3 (two shuffles and an add for sixteen lanes). */
static inline __m512 add_neighbours_512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The first two of reduce_lanes' three rounds for one pair's four sums (rows 0-3): quarter
 * k of the result holds, row by row, (l0 + l1) + (l2 + l3) of lanes 4k .. 4k + 3, so
 * quarters 0 and 1 are token 2p's two halves, quarters 2 and 3 token 2p + 1's. */
static inline __m512 quarter_sums_512(__m512 r0, __m512 r1, __m512 r2, __m512 r3) {
    return add_neighbours_512(add_neighbours_512(r0, r1), add_neighbours_512(r2, r3));
}

/* The last round for two pairs at once (a, b: quarter_sums_512 of each): each token's lower
 * half plus its upper half, giving sixteen finished dot products, four per token in token
 * order (pair a's two tokens, then b's), rows 0-3 within each. */
static inline __m512 halves_added_512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The 4 x 2 n_pairs running sums of kernel_4_pairs_512 (sums[r][p]: row r, pair p) finished
 * in kv_dot's order, as finish_four would one token at a time, and stored for the n real
 * tokens from t on: the lanes of all of them are added at once, sixteen dot products to a
 * register, then each goes out (with its leftover elements past n8, where in_dim has any).
 * The outputs lie wherever the rows' outputs do, so they leave one float at a time, through
 * memory (cheaper than taking each lane out of the register). */
static ALWAYS_INLINE void finish_pairs_512(const four_rows *f, int t, int n,
                                           __m512 sums[4][TILE_PAIRS], int n_pairs,
                                           const float *x, int n8, int in_dim) {
    float done[8 * TILE_PAIRS];   /* token i's four dot products at 4 i .. 4 i + 3 */
    #pragma GCC unroll 3   /* constant indices into sums: they stay in registers */
    for (int p = 0; p < n_pairs; p += 2) {   /* a lone last pair is finished twice */
        int q = p + 1 < n_pairs ? p + 1 : p;
        __m512 a = quarter_sums_512(sums[0][p], sums[1][p], sums[2][p], sums[3][p]);
        __m512 b = quarter_sums_512(sums[0][q], sums[1][q], sums[2][q], sums[3][q]);
        _mm512_storeu_ps(done + 8 * p, halves_added_512(a, b));
    }
    for (int r = 0; r < 4; r++) {
        float *out = f->outs[r] + (size_t)t * f->out_strides[r];
        size_t stride = f->out_strides[r];
        if (n8 == in_dim) {
            for (int i = 0; i < n; i++) out[i * stride] = done[4 * i + r];
        } else {
            for (int i = 0; i < n; i++)
                out[i * stride] = add_tail(done[4 * i + r], f->rows[r],
                                           x + (size_t)(t + i) * in_dim, n8, in_dim);
        }
    }
}

/* Four rows of w against n_pairs pairs of tokens (pairs p0 .. p0 + n_pairs - 1 of `packed`,
 * tokens t = 2 p0 ..; n of them are real, the rest a lone token's copy), with
 * 512-bit registers: a register holds a pair's two tokens (token 2p's eight lanes, then
 * 2p + 1's) against one row, whose eight columns are loaded into both halves; each
 * multiply-add does two (row, token) dot products' work. Every dot product keeps its own
 * eight lanes, in kv_dot's order, bit for bit kernel_4x3's. The pairs' inputs are loaded
 * once a chunk and kept in registers (IN_REGISTER: else each multiply-add repeats its load);
 * the sums, one register each, stay there too (GCC unrolls every loop here: n_pairs is a
 * constant at each call). With `ahead` (four rows to come, or NULL), it also fetches a
 * quarter of their cache lines, from line line0 of each on. */
#define IN_ZMM(v) __asm__("" : "+v"(v))
static ALWAYS_INLINE void kernel_4_pairs_512(const four_rows *f, int t, int n,
                                             const float *packed, int p0, int n_pairs,
                                             const float *x, int in_dim,
                                             const float *const *ahead, int line0) {
    __m512 sums[4][TILE_PAIRS];
    for (int r = 0; r < 4; r++)
        for (int p = 0; p < n_pairs; p++) sums[r][p] = _mm512_setzero_ps();
    int n_chunks = in_dim / 8;
    const float *pairs = packed + (size_t)p0 * n_chunks * 16;
    for (int c = 0; c < n_chunks; c++) {
        if (ahead != NULL)   /* one cache line a step: line0 + c / 4 of row c % 4 */
            __builtin_prefetch((const char *)ahead[c & 3] + 64 * ((size_t)line0 + (c >> 2)));
        __m512 xs[TILE_PAIRS];
        for (int p = 0; p < n_pairs; p++) {
            xs[p] = _mm512_loadu_ps(pairs + ((size_t)p * n_chunks + c) * 16);
            IN_ZMM(xs[p]);
        }
        for (int r = 0; r < 4; r++) {
            __m512 row = _mm512_broadcast_f32x8(_mm256_loadu_ps(f->rows[r] + 8 * c));
            IN_ZMM(row);
            for (int p = 0; p < n_pairs; p++) sums[r][p] = _mm512_fmadd_ps(row, xs[p], sums[r][p]);
        }
    }
    finish_pairs_512(f, t, n, sums, n_pairs, x, 8 * n_chunks, in_dim);
}
#undef IN_ZMM

/* How many of `left` tokens the next tile takes: all of them up to twelve, else an even
 * share of the fewest tiles that hold them (sixteen as two eights, not twelve and four: a
 * tile of few pairs loads each row for little work) */
static int tile_tokens(int left) {
    if (left <= 2 * TILE_PAIRS) return left;
    int n_tiles = (int)kv_ceil_div(left, 2 * TILE_PAIRS);
    return (int)kv_ceil_div(kv_ceil_div(left, n_tiles), 2) * 2;
}

/* Four rows against tokens t .. t + n - 1 (n <= 2 * TILE_PAIRS) of x, packed: the chunk of
 * tokens from `first` on (t - first even), n_pairs a constant at each call of
 * kernel_4_pairs_512 so that its loops unroll, and so is whether it fetches rows ahead */
static void tile_4_rows_512(const four_rows *f, int t, int n, const float *packed, int first,
                            const float *x, int in_dim, const float *const *ahead, int line0) {
    int p0 = (t - first) / 2;
#define TILE_CASE(k)                                                                   \
    case k:                                                                            \
        if (ahead != NULL) kernel_4_pairs_512(f, t, n, packed, p0, k, x, in_dim, ahead, line0); \
        else kernel_4_pairs_512(f, t, n, packed, p0, k, x, in_dim, NULL, 0);            \
        break;
    switch ((n + 1) / 2) {
    TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
    default: kernel_4_pairs_512(f, t, n, packed, p0, 1, x, in_dim, NULL, 0); break;
    }
#undef TILE_CASE
}
#else
void kv_pack_tokens(const float *x, int n_tokens, int in_dim, float *packed, int first,
                    int last) {
    (void)x, (void)n_tokens, (void)in_dim, (void)packed, (void)first, (void)last;
}
#endif

/* Tokens are taken TOKEN_CHUNK (ops.h's KV_TOKEN_CHUNK, 96) at a time, so that a chunk of x
 * (384 KiB of them for dim 1024) stays in the L2 cache while every row of w passes over
 * it. A weight matrix larger than the caches is therefore streamed from memory once per
 * chunk: once per decode step of up to TOKEN_CHUNK sequences, several times for a long
 * prompt. */
#define TOKEN_CHUNK KV_TOKEN_CHUNK
/* Rows longer than twice this are taken PANEL columns at a time: four rows of 2,048 floats
 * (32 KiB) would not stay in the L1 cache while three tokens' columns stream past them;
 * a panel of four rows (8 KiB) does. The running sums wait in memory between panels. */
#define PANEL 512

/* The next `slice` bytes of rows still to fetch (*fetched of total so far), whole cache
 * lines: one share of fetching the next rows while the current ones are used. */
static inline void fetch_slice(const char *rows, size_t total, size_t slice, size_t *fetched) {
    for (size_t end = *fetched + slice; *fetched < end && *fetched < total; *fetched += 64)
        __builtin_prefetch(rows + *fetched);
}

/* Four rows (f) against tokens first .. first + chunk - 1, x the inputs of token 0; the
 * next_bytes bytes at next_rows (the rows to come) are fetched meanwhile. */
static void four_rows_block(const four_rows *f, const float *x, int first, int chunk,
                            int in_dim, const char *next_rows, size_t next_bytes) {
    size_t stride = (size_t)in_dim;
    int n8 = in_dim & ~7, n_triples = chunk / 3;
    int panel = in_dim > 2 * PANEL ? PANEL : n8;
    int n_panels = n8 > 0 ? (int)kv_ceil_div(n8, panel) : 0;
    /* While these four rows work through the chunk's tokens, the next four rows are
     * fetched, a slice before each call of the kernel: at their first use they would
     * otherwise come from memory, one stall after another. */
    size_t slice = (next_bytes / (size_t)(n_panels * n_triples + 1) + 63) & ~(size_t)63;
    size_t fetched = 0;
    if (n_panels <= 1) {   /* the whole row at once: sums straight to the output */
        for (int j = 0; j < n_triples; j++) {
            fetch_slice(next_rows, next_bytes, slice, &fetched);
            int t = first + 3 * j;
            kernel_4x3(NULL, f, t, x + (size_t)t * stride, 0, n8, in_dim, 0);
        }
    } else {
        sums_4x3 sums[TOKEN_CHUNK / 3];
        memset(sums, 0, sizeof sums);
        for (int from = 0; from < n8; from += panel) {
            int to = from + panel < n8 ? from + panel : n8;
            for (int j = 0; j < n_triples; j++) {
                fetch_slice(next_rows, next_bytes, slice, &fetched);
                int t = first + 3 * j;
                kernel_4x3(&sums[j], f, t, x + (size_t)t * stride, from, to, in_dim, 1);
            }
        }
        for (int j = 0; j < n_triples; j++) {
            int t = first + 3 * j;
            for (int k = 0; k < 3; k++)
                finish_four(f, t + k, sums[j].sum[k][0], sums[j].sum[k][1], sums[j].sum[k][2],
                            sums[j].sum[k][3], x + (size_t)(t + k) * stride, n8, in_dim);
        }
    }
    for (int t = first + 3 * n_triples; t < first + chunk; t++)   /* one or two tokens over */
        kernel_4x1(f, t, x + (size_t)t * stride, in_dim);
}

void kv_matmul_four_rows(float *out, const float *x, const float *packed,
                         const float *const rows[4], int o, int first, int chunk, int in_dim,
                         int out_dim) {
    four_rows f;
    for (int r = 0; r < 4; r++) {
        f.rows[r] = rows[r];
        f.outs[r] = out + o + r;
        f.out_strides[r] = (size_t)out_dim;
    }
#ifdef F32_TILE_512
    if (packed != NULL) {
        for (int t = first, n; t < first + chunk; t += n) {
            n = tile_tokens(first + chunk - t);
            tile_4_rows_512(&f, t, n, packed, first, x, in_dim, NULL, 0);
        }
        return;
    }
#endif
    (void)packed;
    four_rows_block(&f, x, first, chunk, in_dim, NULL, 0);
}

/* out rows o .. o+3 (or the last few) for tokens first .. first + chunk - 1 */
static void row_block(float *out, const float *x, const float *w, int first, int chunk,
                      int o, int in_dim, int out_dim) {
    size_t stride = (size_t)in_dim;
    if (o + 4 > out_dim) {   /* the last few rows, one dot product at a time */
        for (int r = o; r < out_dim; r++)
            for (int t = first; t < first + chunk; t++)
                out[(size_t)t * out_dim + r] = kv_dot(w + (size_t)r * stride, x + (size_t)t * stride, in_dim);
        return;
    }
    four_rows f = neighbours(w, out, o, in_dim, out_dim);
    const char *next_rows = (const char *)(w + (size_t)(o + 4) * stride);
    four_rows_block(&f, x, first, chunk, in_dim, next_rows, o + 8 <= out_dim ? 16 * stride : 0);
}

/* Row block `block` of the matrices taken together (each matrix's blocks in turn), for
 * tokens first .. first + chunk - 1. */
static void numbered_block(int block, int n_matrices, float *const *outs, const float *const *ws,
                           const int *out_dims, const float *x, int first, int chunk, int in_dim) {
    int m = 0;
    while (m < n_matrices - 1 && block >= (out_dims[m] + 3) / 4) block -= (out_dims[m++] + 3) / 4;
    row_block(outs[m], x, ws[m], first, chunk, block * 4, in_dim, out_dims[m]);
}

/* Row `row` of the matrices taken together: where it is, where its output for token 0
 * goes, and how far apart its outputs for consecutive tokens are. */
static void numbered_row(int row, int n_matrices, float *const *outs, const float *const *ws,
                         const int *out_dims, int in_dim, const float **w_row, float **out,
                         size_t *out_stride) {
    int m = 0;
    while (m < n_matrices - 1 && row >= out_dims[m]) row -= out_dims[m++];
    *w_row = ws[m] + (size_t)row * in_dim;
    *out = outs[m] + row;
    *out_stride = (size_t)out_dims[m];
}

#ifdef F32_TILE_512
/* Rows at least this long (floats) are fetched one group ahead by the tile (below) */
#define FETCH_AHEAD_MIN 512

/* The four rows f (the k-th of runs_of_rows' four runs of per_run rows from lo) against
 * tokens first .. first + n - 1, up to twelve at a time. The tile's first pass over a group of rows
 * reads them from memory, and the hardware prefetcher, restarting at every 4 KiB page of each
 * of the four runs, leaves it waiting; so the second and third passes fetch the next group
 * (k_next, or -1 if none), a line per step, while the current rows come from the caches.
 * Products of 48 tokens with rows of 768 and 2,048 floats, matrices in memory, ran
 * 1.03-1.12x, 110M-shaped prefill 1.05-1.07x (ab.py); with rows of 288 (15M's) the fetches
 * cost more than they saved (0.95x), so shorter rows than FETCH_AHEAD_MIN go without.
 * Remeasured with chunks of 96 (ab.py, 1 thread, 4 runs of 6-12 rounds), dropping the
 * fetches ran 110M-shaped prefill 0.95-0.97x and 15M's 0.97-1.06x (its rows of 768 in w2
 * take them): kept, for the shape where kvlab is nearest llama.cpp. */
static void tiles_of_tokens(const four_rows *f, int k_next, int lo, int per_run, int n_matrices,
                            float *const *outs, const float *const *ws, const int *out_dims,
                            const float *x, const float *packed, int first, int n, int in_dim) {
    four_rows next = *f;
    int fetch = k_next >= 0 && in_dim >= FETCH_AHEAD_MIN, lines = in_dim / 16;
    for (int run = 0; fetch && run < 4; run++)
        numbered_row(lo + run * per_run + k_next, n_matrices, outs, ws, out_dims, in_dim,
                     &next.rows[run], &next.outs[run], &next.out_strides[run]);
    for (int t = first, tile, pass = 0; t < first + n; t += tile, pass++) {
        tile = tile_tokens(first + n - t);
        int ahead = fetch && (pass == 1 || pass == 2);
        tile_4_rows_512(f, t, tile, packed, first, x, in_dim, ahead ? next.rows : NULL,
                        (pass - 1) * lines / 2);
    }
}
#endif

/* Rows lo .. hi - 1 of the matrices taken together against tokens first .. first + n - 1
 * (at most TOKEN_CHUNK): a decode step of fewer than SMALL_BATCH sequences, bound by
 * memory, or, with the 512-bit tile, any product a chunk of tokens at a time. The rows are
 * read as four runs side by side, a row from each run at a time, against every token (up
 * to twelve at a time with the 512-bit tile, else three at a time, then one by one), not
 * front to back as one run: the hardware prefetcher follows each run on its own, and on
 * the 2-core development machine four runs read 20-29 GB/s where one run of four
 * neighbouring rows read 16-19 (one 768 x 32,000 matrix, best of 8); with the 512-bit tile
 * a chunk of 48 tokens of a 2048 x 768 matrix ran 1.2x, 16 tokens 1.7x, than row_block's
 * neighbouring rows. Each dot product is still summed in kv_dot's order. */
#define SMALL_BATCH 16
static void runs_of_rows(int lo, int hi, int n_matrices, float *const *outs,
                         const float *const *ws, const int *out_dims, const float *x,
                         const float *packed, int first, int n, int in_dim) {
    int per_run = (hi - lo) / 4, n8 = in_dim & ~7, end = first + n;
    size_t stride = (size_t)in_dim;
    for (int k = 0; k < per_run; k++) {
        four_rows f;
        for (int run = 0; run < 4; run++)
            numbered_row(lo + run * per_run + k, n_matrices, outs, ws, out_dims, in_dim,
                         &f.rows[run], &f.outs[run], &f.out_strides[run]);
        int t = first;
#ifdef F32_TILE_512
        if (packed != NULL) {   /* up to twelve at a time */
            tiles_of_tokens(&f, k + 1 < per_run ? k + 1 : -1, lo, per_run, n_matrices, outs, ws,
                            out_dims, x, packed, first, n, in_dim);
            continue;
        }
#endif
        for (; t + 3 <= end; t += 3) kernel_4x3(NULL, &f, t, x + t * stride, 0, n8, in_dim, 0);
        for (; t < end; t++) kernel_4x1(&f, t, x + t * stride, in_dim);
    }
    for (int row = lo + 4 * per_run; row < hi; row++) {   /* the last few, one at a time */
        const float *w_row;
        float *out;
        size_t out_stride;
        numbered_row(row, n_matrices, outs, ws, out_dims, in_dim, &w_row, &out, &out_stride);
        for (int t = first; t < end; t++)
            out[(size_t)t * out_stride] = kv_dot(w_row, x + t * stride, in_dim);
    }
}

float *kv_packed_tokens_alloc(int n_tokens, int in_dim) {
#ifdef F32_TILE_512
    if (n_tokens >= 4 && in_dim >= 8)
        return kv_alloc_floats(kv_packed_input_floats(kv_packed_chunk(n_tokens), in_dim));
#endif
    (void)n_tokens;
    (void)in_dim;
    return NULL;
}

void kv_matmul_many(int n_matrices, float *const *outs, const float *const *ws,
                    const int *out_dims, const float *x, int n_tokens, int in_dim) {
    float *packed = kv_packed_tokens_alloc(n_tokens, in_dim);
    int n_blocks = 0, n_rows = 0;
    int64_t work = 0;
    for (int m = 0; m < n_matrices; m++) {
        n_blocks += (out_dims[m] + 3) / 4;
        n_rows += out_dims[m];
        work += (int64_t)n_tokens * out_dims[m] * in_dim;
    }
    (void)work;   /* read by the OpenMP pragma only, which a build without OpenMP drops */
    /* One parallel region for all the products. Threads split the output rows of all the
     * matrices together, each a contiguous share, the same for every chunk of tokens (so
     * each keeps its slice of w warm), and go from one chunk to the next without waiting
     * for each other: their outputs never overlap. */
    #pragma omp parallel num_threads(kv_threads()) \
        if (work >= KV_PARALLEL_MIN_WORK && n_blocks > 1)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        if (n_tokens < SMALL_BATCH || packed != NULL) {
            int lo = kv_split(n_rows, me, team), hi = kv_split(n_rows, me + 1, team);
            for (int first = 0; first < n_tokens; first += TOKEN_CHUNK) {
                int chunk = n_tokens - first < TOKEN_CHUNK ? n_tokens - first : TOKEN_CHUNK;
                if (packed != NULL) kv_pack_chunk(x, first, chunk, in_dim, packed);
                runs_of_rows(lo, hi, n_matrices, outs, ws, out_dims, x, packed, first, chunk,
                             in_dim);
            }
        } else {
            int lo = kv_split(n_blocks, me, team), hi = kv_split(n_blocks, me + 1, team);
            for (int first = 0; first < n_tokens; first += TOKEN_CHUNK) {
                int chunk = n_tokens - first < TOKEN_CHUNK ? n_tokens - first : TOKEN_CHUNK;
                for (int block = lo; block < hi; block++)
                    numbered_block(block, n_matrices, outs, ws, out_dims, x, first, chunk, in_dim);
            }
        }
    }
    free(packed);
}

void kv_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
               int out_dim) {
    kv_matmul_many(1, &out, &w, &out_dim, x, n_tokens, in_dim);
}

void kv_rmsnorm(float *out, const float *x, const float *weight, int dim, float eps) {
    float mean_square = kv_dot(x, x, dim) / (float)dim;
    float inv_rms = 1.0f / sqrtf(mean_square + eps);
    for (int i = 0; i < dim; i++) out[i] = x[i] * inv_rms * weight[i];
}

void kv_rope(float *vec, int n_heads, int head_dim, const float *cos_table,
             const float *sin_table, int interleaved) {
    int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *head = vec + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            /* the two coordinates that rotate together as one complex number */
            float *re = interleaved ? &head[2 * i] : &head[i];
            float *im = interleaved ? &head[2 * i + 1] : &head[i + half];
            float a = *re, b = *im, c = cos_table[i], s = sin_table[i];
            *re = a * c - b * s;
            *im = b * c + a * s;
        }
    }
}

/* [quote ch07-kv-softmax-tile] */
float kv_softmax_tile(float *scores, int n, float *running_max, float *running_sum) {
    /* the tile as two chunks of eight; a short tile padded with -inf, whose exponential
     * is 0 (a full one, the common case, is read in place) */
    float padded[16];
    const float *tile = scores;
    if (n < 16) {
        for (int i = 0; i < 16; i++) padded[i] = i < n ? scores[i] : -INFINITY;
        tile = padded;
    }
    v8f low = load8(tile), high = load8(tile + 8);
    v8f larger = max8(low, high);
    float tile_max = larger[0];
    for (int i = 1; i < 8; i++) tile_max = larger[i] > tile_max ? larger[i] : tile_max;
    float new_max = tile_max > *running_max ? tile_max : *running_max;
    /* the exponentials, summed in eight lanes, then pairwise: one fixed order */
    low = exp_nonpositive(low - new_max);
    high = exp_nonpositive(high - new_max);
    if (n == 16) {
        memcpy(scores, &low, sizeof low);
        memcpy(scores + 8, &high, sizeof high);
    } else {
        memcpy(padded, &low, sizeof low);
        memcpy(padded + 8, &high, sizeof high);
        memcpy(scores, padded, (size_t)n * sizeof(float));
    }
    /* e^(old max - new max): 1 when the max stayed, 0 before the first tile */
    float correction = 1.0f;
    if (new_max != *running_max) correction = exp_nonpositive(splat(*running_max - new_max))[0];
    *running_sum = *running_sum * correction + reduce_lanes(low + high);
    *running_max = new_max;
    return correction;
}
/* [end ch07-kv-softmax-tile] */

/* kv_softmax_tile for eight query heads at once, one head per lane, so that the maxes, the
 * sums of exponentials and the corrections take one vector operation for all eight instead
 * of a pass across the lanes of each head. Each lane does exactly kv_softmax_tile's
 * operations on its head, in its order (tests/c checks the bits): max8(s_i, s_i+8) for i < 8,
 * then those eight in turn; the -inf of a short tile's padding; the sum as reduce_lanes adds
 * its lanes. */
void kv_softmax_tile8(float *scores, int n, int stride, float *running_max, float *running_sum,
                      float *corrections) {
    v8f exps[16];
    for (int j = 0; j < 16; j++)
        exps[j] = j < n ? load8(scores + (size_t)j * stride) : splat(-INFINITY);
    v8f tile_max = max8(exps[0], exps[8]);
    for (int i = 1; i < 8; i++) tile_max = max8(max8(exps[i], exps[i + 8]), tile_max);
    v8f old_max = load8(running_max), new_max = max8(tile_max, old_max);
    for (int j = 0; j < 16; j++) exps[j] = exp_nonpositive(exps[j] - new_max);
    for (int j = 0; j < n; j++) memcpy(scores + (size_t)j * stride, &exps[j], sizeof(v8f));
    v8f pairs[8];   /* lane k of kv_softmax_tile's low + high */
    for (int k = 0; k < 8; k++) pairs[k] = exps[k] + exps[k + 8];
    v8f tile_sum = ((pairs[0] + pairs[1]) + (pairs[2] + pairs[3])) +
                   ((pairs[4] + pairs[5]) + (pairs[6] + pairs[7]));
    /* e^(old max - new max) where the max rose, else exactly 1 */
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8i rose = new_max != old_max;
    v8f correction = (v8f)(((v8i)exp_nonpositive(old_max - new_max) & rose) |
                           ((v8i)splat(1.0f) & ~rose));
    v8f sum = load8(running_sum) * correction + tile_sum;
    memcpy(running_sum, &sum, sizeof sum);
    memcpy(running_max, &new_max, sizeof new_max);
    memcpy(corrections, &correction, sizeof correction);
}

/* silu(g) * u for eight values. silu(g) = g / (1 + e^-g); with e = e^-|g|, always the
 * exponential of a number <= 0, that is g / (1 + e) for g >= 0 and g e / (1 + e) for
 * g < 0: the same value, written so that no exponential can overflow. */
static inline v8f swiglu8(v8f g, v8f u) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8i negative = g < 0.0f;
    v8f e = exp_nonpositive((v8f)((v8i)g | (v8i)splat(-0.0f)));   /* e^-|g| */
    v8f numerator = (v8f)(((v8i)(g * e) & negative) | ((v8i)g & ~negative));
    return numerator / (1.0f + e) * u;
}

void kv_swiglu(float *gate, const float *up, size_t n) {
    int64_t n8 = (int64_t)(n & ~(size_t)7);
    /* each chunk of eight on its own: threads may split them any way */
    #pragma omp parallel for schedule(static) num_threads(kv_threads()) \
        if (n8 >= 16 * KV_PARALLEL_MIN_WORK / 8)
    for (int64_t i = 0; i < n8; i += 8) {
        v8f result = swiglu8(load8(gate + i), load8(up + i));
        memcpy(gate + i, &result, sizeof result);
    }
    if ((size_t)n8 < n) {   /* the last few through one more padded chunk: the same bits
                               as in a longer run where they would fall inside a chunk */
        float g[8] = {0}, u[8] = {0};
        memcpy(g, gate + n8, (n - (size_t)n8) * sizeof(float));
        memcpy(u, up + n8, (n - (size_t)n8) * sizeof(float));
        v8f result = swiglu8(load8(g), load8(u));
        memcpy(gate + n8, &result, (n - (size_t)n8) * sizeof(float));
    }
}

int kv_argmax(const float *values, int n) {
    int best = 0;
    for (int i = 0; i < n; i++) {
        if (values[i] != values[i]) return i;   /* NaN: numpy.argmax reports the first */
        if (values[i] > values[best]) best = i;
    }
    return best;
}
