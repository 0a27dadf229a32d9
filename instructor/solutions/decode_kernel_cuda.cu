/* Lab 14 on a GPU, the reference solution: the plain tier's bits, spread over the GPU.
 *
 * Three kernels, each doing in parallel what the plain tier does in an order that does not
 * depend on it:
 *
 *   score_rows     one thread per (position, KV head): the position's key row is read and
 *                  decoded once for all the query heads of its KV head (four at a time, in
 *                  registers), each dot product in the plain tier's eight lanes, the query
 *                  rows in shared memory (every thread reads the same value: a broadcast);
 *   softmax_tiles  one thread block per query head: each tile's max, then the running max
 *                  before every tile by a scan (a max is exact in any order; the scan keeps
 *                  the plain tier's "the later one only if strictly larger"), then each
 *                  tile's weights, its sum in eight lanes and its correction, all tiles at
 *                  once;
 *   mix_values     one thread per (query head, value i): the one thing that cannot be done
 *                  out of order, out[i] = madd(weight, value[i], out[i]) position after
 *                  position, is a chain per output value, and there are n_heads * head_dim
 *                  of them side by side; the loads of a tile do not depend on the chain and
 *                  are issued ahead of it. One more warp per block runs the softmax's
 *                  running sum (running_sum * correction + tile sum, tile after tile) beside
 *                  the chains, for the division at the end.
 *
 * What sets its speed: each chain is `length` dependent multiply-adds (about 4 cycles
 * each), so a long sequence takes at least length * 4 cycles however fast the memory is.
 */
#include "decode_kernel_cuda.cuh"

#define TILE 16
#define SCORE_THREADS 128
#define SOFTMAX_THREADS 256
#define HEADS_AT_ONCE 4          /* query heads a score thread keeps in registers at once */

/* where (position, KV head)'s row starts, in rows of the pool */
static __device__ __forceinline__ size_t row_of(const kv_cache_view &view, int pos, int kv_head) {
    int block = view.block_table[pos / view.block_size];
    return ((size_t)block * view.n_kv_heads + kv_head) * view.block_size + pos % view.block_size;
}

/* score[h][pos] = (q_h . k_pos) * scale for the query heads of KV head blockIdx.y */
static __global__ void score_rows(float *score, size_t stride, const float *q,
                                  const kv_cache_view view, int kv_mul) {
    extern __shared__ float q_group[];            /* (kv_mul, head_dim) */
    const int kv_head = blockIdx.y, head_dim = view.head_dim;
    for (int i = threadIdx.x; i < kv_mul * head_dim; i += blockDim.x)
        q_group[i] = q[(size_t)kv_head * kv_mul * head_dim + i];
    __syncthreads();
    const int pos = blockIdx.x * blockDim.x + threadIdx.x;
    if (pos >= view.length) return;
    const size_t row = row_of(view, pos, kv_head);
    const int8_t *codes = view.key_codes + row * head_dim;
    const float *scales = view.key_scales + row * (head_dim / view.group);
    for (int m0 = 0; m0 < kv_mul; m0 += HEADS_AT_ONCE) {
        float lanes[HEADS_AT_ONCE][8];
#pragma unroll
        for (int m = 0; m < HEADS_AT_ONCE; m++)
#pragma unroll
            for (int j = 0; j < 8; j++) lanes[m][j] = 0.0f;
        for (int c = 0; c < head_dim; c += 8) {
            const int2 packed = *(const int2 *)(codes + c);     /* 8 codes, 8-byte aligned */
            const float s = scales[c / view.group];
            float k[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                int word = j < 4 ? packed.x : packed.y;
                k[j] = __fmul_rn((float)(int8_t)(word >> (8 * (j % 4))), s);
            }
#pragma unroll
            for (int m = 0; m < HEADS_AT_ONCE; m++)
                if (m0 + m < kv_mul)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        lanes[m][j] = kv_madd(q_group[(m0 + m) * head_dim + c + j], k[j], lanes[m][j]);
        }
#pragma unroll
        for (int m = 0; m < HEADS_AT_ONCE; m++)
            if (m0 + m < kv_mul)
                score[(size_t)(kv_head * kv_mul + m0 + m) * stride + pos] =
                    __fmul_rn(kv_add_lanes(lanes[m]), view.scale);
    }
}

/* the plain tier's new_max: the later value only where it is strictly larger */
static __device__ __forceinline__ float later_if_larger(float before, float later) {
    return later > before ? later : before;
}

/* One block per query head: the scores of head blockIdx.x become the plain tier's weights,
 * and each tile t gets its sum (tile_sum[t]) and its correction (correction[t]). Thread k
 * takes a run of consecutive tiles. */
static __global__ void softmax_tiles(float *score, size_t stride, float *tile_sum,
                                     float *correction, int length) {
    __shared__ float run_max[SOFTMAX_THREADS];
    const int n_tiles = (length + TILE - 1) / TILE;
    const int per_thread = (n_tiles + SOFTMAX_THREADS - 1) / SOFTMAX_THREADS;
    const int first = threadIdx.x * per_thread;
    const int last = min(first + per_thread, n_tiles);
    float *s = score + (size_t)blockIdx.x * stride;
    /* 1. the largest score of this thread's tiles */
    float mine = -INFINITY;
    for (int p = first * TILE; p < min(last * TILE, length); p++) mine = later_if_larger(mine, s[p]);
    run_max[threadIdx.x] = mine;
    __syncthreads();
    /* 2. the running max before this thread's first tile: a scan of the threads' maxima
     * (each step reads, waits, then writes) */
    for (int offset = 1; offset < SOFTMAX_THREADS; offset *= 2) {
        float earlier = threadIdx.x >= offset ? run_max[threadIdx.x - offset] : -INFINITY;
        __syncthreads();
        run_max[threadIdx.x] = later_if_larger(earlier, run_max[threadIdx.x]);
        __syncthreads();
    }
    float running = threadIdx.x == 0 ? -INFINITY : run_max[threadIdx.x - 1];
    /* 3. each tile's step, as softmax_tile in the plain tier */
    for (int t = first; t < last; t++) {
        const int start = t * TILE, n = min(TILE, length - start);
        float tile_max = -INFINITY;
        for (int r = 0; r < n; r++) tile_max = later_if_larger(tile_max, s[start + r]);
        const float new_max = later_if_larger(running, tile_max);
        float lanes[8] = {0};
        for (int r = 0; r < n; r++) {
            float w = kv_exp_nonpositive(__fsub_rn(s[start + r], new_max));
            s[start + r] = w;
            lanes[r % 8] = __fadd_rn(lanes[r % 8], w);
        }
        tile_sum[(size_t)blockIdx.x * n_tiles + t] = kv_add_lanes(lanes);
        correction[(size_t)blockIdx.x * n_tiles + t] =
            new_max == running ? 1.0f : kv_exp_nonpositive(__fsub_rn(running, new_max));
        running = new_max;
    }
}

/* the value of (position, KV head) at index i: its code times its group's scale */
static __device__ __forceinline__ float value_at(const kv_cache_view &view, int pos, int kv_head,
                                                 int i, int groups) {
    const size_t row = row_of(view, pos, kv_head);
    return __fmul_rn((float)view.value_codes[row * view.head_dim + i],
                     view.value_scales[row * groups + i / view.group]);
}

/* One block per query head: thread i < head_dim makes out[h][i]; the block's last warp
 * computes the running sum meanwhile. */
static __global__ void mix_values(float *out, const float *weight, size_t stride,
                                  const float *tile_sum, const float *correction,
                                  const kv_cache_view view, int kv_mul, int chain_threads) {
    __shared__ float inv_sum;
    const int h = blockIdx.x, i = threadIdx.x, kv_head = h / kv_mul;
    const int length = view.length, n_tiles = (length + TILE - 1) / TILE;
    const int groups = view.head_dim / view.group;
    const float *w = weight + (size_t)h * stride;
    const float *c = correction + (size_t)h * n_tiles;
    if (i == chain_threads) {          /* the running sum, tile after tile */
        const float *sums = tile_sum + (size_t)h * n_tiles;
        float running = 0.0f;
        for (int t = 0; t < n_tiles; t++) running = __fadd_rn(__fmul_rn(running, c[t]), sums[t]);
        inv_sum = __fdiv_rn(1.0f, running);
    }
    float acc = 0.0f;
    if (i < view.head_dim) {
        int t = 0;
        for (; (t + 1) * TILE <= length; t++) {       /* whole tiles: every load first */
            float v[TILE], p[TILE];
#pragma unroll
            for (int r = 0; r < TILE; r++) {
                v[r] = value_at(view, t * TILE + r, kv_head, i, groups);
                p[r] = w[t * TILE + r];
            }
            acc = __fmul_rn(acc, c[t]);
#pragma unroll
            for (int r = 0; r < TILE; r++) acc = kv_madd(p[r], v[r], acc);
        }
        if (t < n_tiles) {                            /* the last, shorter tile */
            acc = __fmul_rn(acc, c[t]);
            for (int pos = t * TILE; pos < length; pos++)
                acc = kv_madd(w[pos], value_at(view, pos, kv_head, i, groups), acc);
        }
    }
    __syncthreads();
    if (i < view.head_dim) out[(size_t)h * view.head_dim + i] = __fmul_rn(acc, inv_sum);
}

extern "C" void decode_attention(float *out, const float *q, const kv_cache_view *view,
                                 int n_heads) {
    const int kv_mul = n_heads / view->n_kv_heads;
    const int n_tiles = (view->length + TILE - 1) / TILE;
    const size_t stride = (size_t)n_tiles * TILE;           /* floats per head's scores */
    float *score = (float *)view->workspace;                /* (n_heads, stride) */
    float *tile_sum = score + (size_t)n_heads * stride;     /* (n_heads, n_tiles) */
    float *correction = tile_sum + (size_t)n_heads * n_tiles;
    dim3 grid((view->length + SCORE_THREADS - 1) / SCORE_THREADS, view->n_kv_heads);
    score_rows<<<grid, SCORE_THREADS, (size_t)kv_mul * view->head_dim * sizeof(float)>>>(
        score, stride, q, *view, kv_mul);
    softmax_tiles<<<n_heads, SOFTMAX_THREADS>>>(score, stride, tile_sum, correction, view->length);
    const int chain_threads = (view->head_dim + 31) / 32 * 32;
    mix_values<<<n_heads, chain_threads + 32>>>(out, score, stride, tile_sum, correction, *view,
                                                kv_mul, chain_threads);
}
