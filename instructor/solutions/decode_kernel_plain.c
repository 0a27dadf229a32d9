/* Lab 14, the first correct answer: kvlab's plain tier (csrc/plain.c, kv_plain_attention)
 * written over the lab's paged int8 view, loop for loop. Every correctness test passes;
 * it reads each KV head's rows once per query head, decodes them one value at a time and
 * runs on one thread, so it earns only the lowest bandwidth tier, if that. The planted
 * mistakes of instructor/mistakes/decode_kernel/ are edits of this file (readable ones:
 * each changes a line or two of what a student writes first), and benchmarks/bench_kernel_lab.py
 * times it beside the reference solution (decode_kernel.c).
 */
#include "decode_kernel.h"

#define TILE 16                 /* positions per online-softmax step, from position 0 */
#define MAX_HEAD_DIM 256

/* the int8 codes of position pos, KV head `head`, and their scales */
static void find_row(const kv_cache_view *view, int pos, int head, int is_value,
                     const int8_t **codes, const float **scales) {
    int block = view->block_table[pos / view->block_size];
    int row = pos % view->block_size;
    size_t at = ((size_t)block * view->n_kv_heads + head) * view->block_size + row;
    *codes = (is_value ? view->value_codes : view->key_codes) + at * view->head_dim;
    *scales = (is_value ? view->value_scales : view->key_scales) + at * (view->head_dim / view->group);
}

/* row (head_dim,) = the floats position pos's codes stand for: code * its group's scale */
static void decode_row(const kv_cache_view *view, int pos, int head, int is_value, float *row) {
    const int8_t *codes;
    const float *scales;
    find_row(view, pos, head, is_value, &codes, &scales);
    for (int i = 0; i < view->head_dim; i++) row[i] = (float)codes[i] * scales[i / view->group];
}

/* sum a[i] * b[i] in eight lanes (value i in lane i % 8), the lanes added pairwise */
static float dot(const float *a, const float *b, int n) {
    float lanes[8] = {0};
    for (int i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] = kv_madd(a[i + j], b[i + j], lanes[j]);
    return kv_add_lanes(lanes);
}

/* one online-softmax step over a tile of n scores: they become e^(s - new max); returns
 * what the outputs summed so far must be multiplied by */
static float softmax_tile(float *scores, int n, float *running_max, float *running_sum) {
    float tile_max = -INFINITY;
    for (int i = 0; i < n; i++)
        if (scores[i] > tile_max) tile_max = scores[i];
    float new_max = tile_max > *running_max ? tile_max : *running_max;
    float lanes[8] = {0};
    for (int i = 0; i < n; i++) {
        scores[i] = kv_exp_nonpositive(scores[i] - new_max);
        lanes[i % 8] += scores[i];
    }
    float correction = new_max == *running_max ? 1.0f : kv_exp_nonpositive(*running_max - new_max);
    *running_sum = *running_sum * correction + kv_add_lanes(lanes);
    *running_max = new_max;
    return correction;
}

void decode_attention(float *out, const float *q, const kv_cache_view *view, int n_heads,
                      int n_threads) {
    int head_dim = view->head_dim;
    int kv_mul = n_heads / view->n_kv_heads;       /* query heads that share a KV head */
    float scale = view->scale;
    float row[MAX_HEAD_DIM];
    for (int h = 0; h < n_heads; h++) {
        int kv_head = h / kv_mul;
        const float *q_h = q + (size_t)h * head_dim;
        float *out_h = out + (size_t)h * head_dim;
        float running_max = -INFINITY, running_sum = 0.0f;
        for (int i = 0; i < head_dim; i++) out_h[i] = 0.0f;
        for (int start = 0; start < view->length; start += TILE) {
            int n = view->length - start < TILE ? view->length - start : TILE;
            float weights[TILE];
            for (int r = 0; r < n; r++) {
                decode_row(view, start + r, kv_head, 0, row);
                weights[r] = dot(q_h, row, head_dim) * scale;
            }
            float correction = softmax_tile(weights, n, &running_max, &running_sum);
            for (int i = 0; i < head_dim; i++) out_h[i] *= correction;
            for (int r = 0; r < n; r++) {
                decode_row(view, start + r, kv_head, 1, row);
                for (int i = 0; i < head_dim; i++) out_h[i] = kv_madd(weights[r], row[i], out_h[i]);
            }
        }
        float inv_sum = 1.0f / running_sum;
        for (int i = 0; i < head_dim; i++) out_h[i] *= inv_sum;
    }
}
