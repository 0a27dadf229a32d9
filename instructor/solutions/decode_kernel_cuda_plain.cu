/* Lab 14 on a GPU, the first correct answer: kvlab's plain tier (csrc/plain.c,
 * kv_plain_attention) written as one GPU thread per query head, loop for loop, over the
 * lab's paged int8 view. Every correctness test passes; it uses n_heads threads of a GPU
 * that runs tens of thousands, so it earns no bandwidth points. The planted mistakes of
 * instructor/mistakes/decode_kernel_cuda/ are edits of this file, as lab 14's are of
 * decode_kernel_plain.c, which this follows line for line.
 */
#include "decode_kernel_cuda.cuh"

#define TILE 16                 /* positions per online-softmax step, from position 0 */
#define MAX_HEAD_DIM 256

/* the int8 codes of position pos, KV head `head`, and their scales */
static __device__ void find_row(const kv_cache_view view, int pos, int head, int is_value,
                                const int8_t **codes, const float **scales) {
    int block = view.block_table[pos / view.block_size];
    int row = pos % view.block_size;
    size_t at = ((size_t)block * view.n_kv_heads + head) * view.block_size + row;
    *codes = (is_value ? view.value_codes : view.key_codes) + at * view.head_dim;
    *scales = (is_value ? view.value_scales : view.key_scales) + at * (view.head_dim / view.group);
}

/* row (head_dim,) = the floats position pos's codes stand for: code * its group's scale */
static __device__ void decode_row(const kv_cache_view view, int pos, int head, int is_value,
                                  float *row) {
    const int8_t *codes;
    const float *scales;
    find_row(view, pos, head, is_value, &codes, &scales);
    for (int i = 0; i < view.head_dim; i++) row[i] = (float)codes[i] * scales[i / view.group];
}

/* sum a[i] * b[i] in eight lanes (value i in lane i % 8), the lanes added pairwise */
static __device__ float dot(const float *a, const float *b, int n) {
    float lanes[8] = {0};
    for (int i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] = kv_madd(a[i + j], b[i + j], lanes[j]);
    return kv_add_lanes(lanes);
}

/* one online-softmax step over a tile of n scores: they become e^(s - new max); returns
 * what the outputs summed so far must be multiplied by */
static __device__ float softmax_tile(float *scores, int n, float *running_max,
                                     float *running_sum) {
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

/* thread h: query head h, as the plain tier's loop body */
static __global__ void attend_heads(float *out, const float *q, const kv_cache_view view,
                                    int n_heads) {
    int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= n_heads) return;
    int head_dim = view.head_dim;
    int kv_mul = n_heads / view.n_kv_heads;       /* query heads that share a KV head */
    float row[MAX_HEAD_DIM];
    int kv_head = h / kv_mul;
    const float *q_h = q + (size_t)h * head_dim;
    float *out_h = out + (size_t)h * head_dim;
    float running_max = -INFINITY, running_sum = 0.0f;
    for (int i = 0; i < head_dim; i++) out_h[i] = 0.0f;
    for (int start = 0; start < view.length; start += TILE) {
        int n = view.length - start < TILE ? view.length - start : TILE;
        float weights[TILE];
        for (int r = 0; r < n; r++) {
            decode_row(view, start + r, kv_head, 0, row);
            weights[r] = dot(q_h, row, head_dim) * view.scale;
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

extern "C" void decode_attention(float *out, const float *q, const kv_cache_view *view,
                                 int n_heads) {
    attend_heads<<<(n_heads + 31) / 32, 32>>>(out, q, *view, n_heads);
}
