/* Lab 14's reference solution: decode attention over a paged int8 cache, bit for bit the
 * plain tier's, at a good share of the memory's read bandwidth.
 *
 * The plain tier's order, kept exactly: positions in tiles of 16 counted from position 0;
 * each score a dot product of eight fused multiply-add lanes added pairwise, times
 * the view's scale; each tile's online-softmax step; the values added in, a fused
 * multiply-add per value and row in position order; one division at the end. What makes
 * it fast, none of which changes a bit:
 *   - the kv_mul query heads of a KV head are done together, so each row is read from
 *     memory (and its codes turned into floats) once for all of them;
 *   - eight values at a time in vector registers (GCC's vector extension), the codes
 *     widened and scaled in registers, never into a float copy of the cache;
 *   - several dot products at once (rows x heads), so that the multiply-adds do not wait
 *     on each other, and each tile's value rows mixed into register-held outputs;
 *   - the next tile's rows asked for while this one is computed (they are in another
 *     block, where the hardware prefetcher would not look);
 *   - the KV heads dealt to the threads.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "decode_kernel.h"

#if defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define TILE 16           /* positions per online-softmax step: the plain tier's */
#define MAX_KV_MUL 32     /* query heads per KV head the header allows */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));

#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE v8f splat(float x) {
    return (v8f){x, x, x, x, x, x, x, x};
}

/* acc + a * b lane by lane, rounded as kv_madd rounds one value */
static ALWAYS_INLINE v8f madd(v8f a, v8f b, v8f acc) {
#ifdef __FMA__
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* eight codes as the floats they stand for: (float)code * scale, as kvlab dequantizes
 * them. One widening load where AVX2 has it (GCC does not find it on its own). */
static ALWAYS_INLINE v8f decode8(const int8_t *codes, v8f scale) {
#ifdef __AVX2__
    __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return (v8f)_mm256_cvtepi32_ps(wide) * scale;
#else
    v8b packed;
    memcpy(&packed, codes, sizeof packed);
    return __builtin_convertvector(__builtin_convertvector(packed, v8i), v8f) * scale;
#endif
}

static ALWAYS_INLINE float add_lanes(v8f v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* Where a tile's rows of one KV head are: codes and scales, row by row. */
typedef struct {
    const int8_t *codes[TILE];
    const float *scales[TILE];
    int n;
} tile_rows;

/* The rows of positions first .. first + n - 1 of KV head `head`, for keys and values (the
 * two pools share their layout): one division for the tile, then counted row by row. */
static void find_rows(tile_rows *keys, tile_rows *values, const kv_cache_view *view, int head,
                      int first, int n) {
    int groups = view->head_dim / view->group;
    int index = first / view->block_size, row = first % view->block_size;
    keys->n = values->n = n;
    for (int r = 0; r < n; r++) {
        size_t at = ((size_t)view->block_table[index] * view->n_kv_heads + head)
                        * view->block_size + (size_t)row;
        keys->codes[r] = view->key_codes + at * view->head_dim;
        keys->scales[r] = view->key_scales + at * groups;
        values->codes[r] = view->value_codes + at * view->head_dim;
        values->scales[r] = view->value_scales + at * groups;
        if (++row == view->block_size) {
            row = 0;
            index++;
        }
    }
}

/* Asks for row r of the next tile (when it has one), to be read a tile later. One row at
 * a time, between rows of work: a burst of a tile's worth of requests stalls the core
 * until the memory system has room for them (it took 40 % of the time). */
static ALWAYS_INLINE void fetch_row(const tile_rows *ahead, int r, int head_dim) {
    if (r >= ahead->n) return;
    for (int at = 0; at < head_dim; at += 64) __builtin_prefetch(ahead->codes[r] + at);
    __builtin_prefetch(ahead->scales[r]);
}

/* scores[m][r0 + r] = q_m . key_r * scale for QB query heads and RB rows: each chunk of
 * eight values of a row decoded once for the QB heads, QB x RB sums kept in registers */
static ALWAYS_INLINE void score_block(float scores[][TILE], const float *queries,
                                      const tile_rows *keys, int r0, int head_dim, int group,
                                      float scale, int QB, int RB) {
    v8f sums[4][8];
    for (int m = 0; m < QB; m++)
        for (int r = 0; r < RB; r++) sums[m][r] = splat(0.0f);
    for (int start = 0; start < head_dim; start += group) {   /* a scale per group */
        v8f scales[8];
        for (int r = 0; r < RB; r++) scales[r] = splat(keys->scales[r0 + r][start / group]);
        for (int i = start; i < start + group; i += 8) {
            v8f key[8];
            for (int r = 0; r < RB; r++) key[r] = decode8(keys->codes[r0 + r] + i, scales[r]);
            for (int m = 0; m < QB; m++) {
                v8f query = load8(queries + (size_t)m * head_dim + i);
                for (int r = 0; r < RB; r++) sums[m][r] = madd(query, key[r], sums[m][r]);
            }
        }
    }
    for (int m = 0; m < QB; m++)
        for (int r = 0; r < RB; r++) scores[m][r0 + r] = add_lanes(sums[m][r]) * scale;
}

/* QB query heads against the n rows of a tile, RB rows at a time, then one at a time */
static ALWAYS_INLINE void score_heads(float scores[][TILE], const float *queries,
                                      const tile_rows *keys, const tile_rows *ahead, int n,
                                      int head_dim, int group, float scale, int QB, int RB) {
    int r = 0;
    for (; r + RB <= n; r += RB) {
        for (int j = r; j < r + RB; j++) fetch_row(ahead, j, head_dim);
        score_block(scores, queries, keys, r, head_dim, group, scale, QB, RB);
    }
    for (; r < n; r++) {
        fetch_row(ahead, r, head_dim);
        score_block(scores, queries, keys, r, head_dim, group, scale, QB, 1);
    }
}

/* every query head of the group against the tile: four heads x two rows, two x four,
 * one x eight, so that eight sums are always on the go; the first heads ask for the next
 * tile's keys as they go */
static void score_tile(float scores[][TILE], const float *queries, int kv_mul,
                       const tile_rows *keys, const tile_rows *ahead, int head_dim, int group,
                       float scale) {
    static const tile_rows none = {.n = 0};
    int m = 0, n = keys->n;
    for (; m + 4 <= kv_mul; m += 4)
        score_heads(scores + m, queries + (size_t)m * head_dim, keys, m ? &none : ahead, n,
                    head_dim, group, scale, 4, 2);
    for (; m + 2 <= kv_mul; m += 2)
        score_heads(scores + m, queries + (size_t)m * head_dim, keys, m ? &none : ahead, n,
                    head_dim, group, scale, 2, 4);
    for (; m < kv_mul; m++)
        score_heads(scores + m, queries + (size_t)m * head_dim, keys, m ? &none : ahead, n,
                    head_dim, group, scale, 1, 8);
}

/* outputs_m[i .. i + 8 DB) += weights[m][r] * value_r over the tile's rows in order, for
 * QB query heads, the sums held in registers for the whole tile */
static ALWAYS_INLINE void mix_block(float *outputs, float weights[][TILE],
                                    const tile_rows *values, const tile_rows *ahead, int n,
                                    int i, int head_dim, int group, int QB, int DB) {
    v8f sums[4][8];
    int scale_at[8];                        /* the group of each chunk (a division each, */
    for (int d = 0; d < DB; d++) scale_at[d] = (i + 8 * d) / group;    /* not one a row) */
    for (int m = 0; m < QB; m++)
        for (int d = 0; d < DB; d++) sums[m][d] = load8(outputs + (size_t)m * head_dim + i + 8 * d);
    for (int r = 0; r < n; r++) {
        fetch_row(ahead, r, head_dim);
        v8f value[8];
        for (int d = 0; d < DB; d++)
            value[d] = decode8(values->codes[r] + i + 8 * d,
                               splat(values->scales[r][scale_at[d]]));
        for (int m = 0; m < QB; m++) {
            v8f weight = splat(weights[m][r]);
            for (int d = 0; d < DB; d++) sums[m][d] = madd(weight, value[d], sums[m][d]);
        }
    }
    for (int m = 0; m < QB; m++)
        for (int d = 0; d < DB; d++)
            memcpy(outputs + (size_t)m * head_dim + i + 8 * d, &sums[m][d], sizeof(v8f));
}

/* QB heads' outputs, 8 DB values at a time; the first block asks for the next tile's
 * values (when `ahead` is not empty) */
static ALWAYS_INLINE void mix_heads(float *outputs, float weights[][TILE],
                                    const tile_rows *values, const tile_rows *ahead,
                                    int head_dim, int group, int QB, int DB) {
    static const tile_rows none = {.n = 0};
    int i = 0, n = values->n;
    for (; i + 8 * DB <= head_dim; i += 8 * DB)
        mix_block(outputs, weights, values, i ? &none : ahead, n, i, head_dim, group, QB, DB);
    for (; i < head_dim; i += 8)
        mix_block(outputs, weights, values, i ? &none : ahead, n, i, head_dim, group, QB, 1);
}

/* every query head's outputs += the tile's weighted values: four heads x two chunks, two x
 * four, one x eight */
static void mix_tile(float *outputs, float weights[][TILE], int kv_mul, const tile_rows *values,
                     const tile_rows *ahead, int head_dim, int group) {
    static const tile_rows none = {.n = 0};
    int m = 0;
    for (; m + 4 <= kv_mul; m += 4)
        mix_heads(outputs + (size_t)m * head_dim, weights + m, values, m ? &none : ahead,
                  head_dim, group, 4, 2);
    for (; m + 2 <= kv_mul; m += 2)
        mix_heads(outputs + (size_t)m * head_dim, weights + m, values, m ? &none : ahead,
                  head_dim, group, 2, 4);
    for (; m < kv_mul; m++)
        mix_heads(outputs + (size_t)m * head_dim, weights + m, values, m ? &none : ahead,
                  head_dim, group, 1, 8);
}

/* kv_exp_nonpositive of eight values at once: the same operations lane by lane, so the
 * same bits; a value below -87 is computed as -87 (no lane may overflow the exponent)
 * and then set to 0, as the scalar version returns. */
static ALWAYS_INLINE v8f exp8(v8f x) {
    v8i tiny = x < -87.0f;
    x = (v8f)(((v8i)x & ~tiny) | ((v8i)splat(-87.0f) & tiny));
    v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v8f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v8f poly = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    v8i exponent = (__builtin_convertvector(n, v8i) + 127) << 23;
    return (v8f)((v8i)(poly * (v8f)exponent) & ~tiny);
}

/* The plain tier's online-softmax step for one head's tile of n scores (padded to 16
 * with -inf, whose weight is 0): they become e^(score - new max), summed in eight lanes
 * (score r in lane r % 8) added pairwise; returns e^(old max - new max), by which the
 * outputs so far are multiplied. */
static float softmax_step(float *scores, int n, float *running_max, float *running_sum) {
    for (int r = n; r < TILE; r++) scores[r] = -INFINITY;
    v8f low = load8(scores), high = load8(scores + 8);
    v8f larger = (v8f)((v8i)low & (low >= high)) + (v8f)((v8i)high & (low < high));
    float tile_max = larger[0];
    for (int j = 1; j < 8; j++) tile_max = larger[j] > tile_max ? larger[j] : tile_max;
    float new_max = tile_max > *running_max ? tile_max : *running_max;
    low = exp8(low - splat(new_max));
    high = exp8(high - splat(new_max));
    memcpy(scores, &low, sizeof low);
    memcpy(scores + 8, &high, sizeof high);
    float correction = new_max == *running_max ? 1.0f : kv_exp_nonpositive(*running_max - new_max);
    *running_sum = *running_sum * correction + add_lanes(low + high);
    *running_max = new_max;
    return correction;
}

static void scale_rows(float *rows, float by, int n) {
    for (int i = 0; i < n; i++) rows[i] *= by;
}

/* the kv_mul query heads of KV head g, over every position */
static void attend_group(float *outputs, const float *queries, const kv_cache_view *view,
                         int g, int kv_mul) {
    int head_dim = view->head_dim, group = view->group;
    float scale = view->scale;
    float weights[MAX_KV_MUL][TILE], running_max[MAX_KV_MUL], running_sum[MAX_KV_MUL];
    tile_rows keys, values, next_keys, next_values;
    for (int m = 0; m < kv_mul; m++) {
        running_max[m] = -INFINITY;
        running_sum[m] = 0.0f;
    }
    memset(outputs, 0, (size_t)kv_mul * head_dim * sizeof(float));
    find_rows(&next_keys, &next_values, view, g, 0, view->length < TILE ? view->length : TILE);
    for (int start = 0; start < view->length; start += TILE) {
        keys = next_keys;
        values = next_values;
        int next = start + TILE, left = view->length - next;
        find_rows(&next_keys, &next_values, view, g, next, left < 0 ? 0 : left < TILE ? left : TILE);
        score_tile(weights, queries, kv_mul, &keys, &next_keys, head_dim, group, scale);
        for (int m = 0; m < kv_mul; m++) {
            float correction = softmax_step(weights[m], keys.n, &running_max[m], &running_sum[m]);
            scale_rows(outputs + (size_t)m * head_dim, correction, head_dim);
        }
        mix_tile(outputs, weights, kv_mul, &values, &next_values, head_dim, group);
    }
    for (int m = 0; m < kv_mul; m++)
        scale_rows(outputs + (size_t)m * head_dim, 1.0f / running_sum[m], head_dim);
}

void decode_attention(float *out, const float *q, const kv_cache_view *view, int n_heads,
                      int n_threads) {
    int kv_mul = n_heads / view->n_kv_heads;
    size_t group_floats = (size_t)kv_mul * view->head_dim;
    #pragma omp parallel for schedule(static, 1) num_threads(n_threads)
    for (int g = 0; g < view->n_kv_heads; g++)
        attend_group(out + g * group_floats, q + g * group_floats, view, g, kv_mul);
}
