/* attention.cu: decode attention over the KV cache, split along the sequence (flash-decoding).
 *
 * One query token's attention reads every cached K and V row of its sequence once and does
 * only a few operations per byte, so its speed is the memory's. Two kernels:
 *
 *   attend_split   one thread block per (query, split of the query's positions, KV head):
 *                  the block reads its split's K rows, keeps the scores in shared memory,
 *                  issues its first V loads, takes the scores' softmax (max and sum of the
 *                  split only) while those loads are on their way, then reads the rest of the
 *                  V rows and writes, for each query head of the group, the unnormalized
 *                  weighted sum acc with the split's max m and sum l.
 *   merge_splits   one thread block per (query, query head): combines the splits with the
 *                  online-softmax rule  M = max m_s,  out = sum e^(m_s - M) acc_s / sum e^(m_s - M) l_s,
 *                  in one pass after M: each weight e^(m_s - M) is computed once and serves
 *                  both sums.
 *
 * Why split: a decode step has few queries, and one block per (sequence, KV head) would
 * leave most of the GPU's 132 multiprocessors idle at small batch; splits give every
 * sequence many blocks. How many positions a split takes is a function of the query's own
 * length (split_positions): about 32 splits of 32 to 256 positions, so that a 1K-8K context
 * at batch 1 is already 32 blocks per KV head, while a long context is not cut finer than
 * 256 positions (each split writes head_dim + 2 floats per query head, which the merge reads
 * back: traffic that must stay small next to the split's K and V). Never the batch: a
 * query's result does not depend on what else is in the batch.
 *
 * Grouped-query attention: the kv_mul query heads that share a KV head are done by the same
 * block (up to MAX_GROUP of them), so each K and V row is loaded from memory once for all of
 * them. Inside a warp, a head row is shared by `row_lanes` lanes holding 8 values each (one
 * 16-byte load for fp16/bf16), so a warp reads 32 / row_lanes consecutive rows at once: wide,
 * coalesced loads. The row's lanes then add up their parts of the GROUP dot products by
 * halving (reduce_row): 5 shuffles for 4 heads over 16 lanes, not 4 per head. Both caches
 * come through one view: the contiguous cache is a paged one with a single block, and the
 * block table is looked up once per position, up front.
 *
 * Registers: q (GROUP x 8 floats a lane) during the scores and acc (as many) during the
 * values are the bulk. __launch_bounds__ caps them (Occupancy below) so that 4 to 8 blocks
 * share a multiprocessor: more loads outstanding, which is how the memory's latency is
 * hidden. At no spill: `nvcc -Xptxas -v` shows the counts.
 *
 * It does not: use tensor cores (a decode step is memory-bound, and q stays float32), or
 * handle a residual window or int4/fp8 (kvlab/cuda.py refuses those).
 */
#include "common.cuh"

#define MAX_SPLIT KV_CUDA_MAX_SPLIT   /* the most positions a thread block reads */
#define WARPS 4
#define THREADS (WARPS * 32)
#define UNROLL 4               /* row steps a warp has in flight before it uses the first */
#define MAX_GROUP 8            /* query heads per thread block */

/* Thread blocks that must fit on one multiprocessor at once, for __launch_bounds__: it has
 * 65,536 registers, so 4 blocks of 128 threads leave 128 registers a thread, 5 leave 102,
 * 7 leave 72 and 8 leave 64. The counts are the most each kernel fits in without spilling
 * (nvcc -Xptxas -v, sm_75 to sm_90). An fp32 row step is twice the bytes of an fp16 one
 * (and twice the registers), so there fewer blocks keep as many bytes in flight. */
template <class Format, int GROUP>
struct Occupancy {
    static constexpr bool wide = sizeof(typename Format::Raw) > 16;   /* fp32 */
    static constexpr int blocks = GROUP >= 8 ? (wide ? 3 : 4) : GROUP >= 4 ? 5
                                  : GROUP >= 2 ? 7 : (wide ? 7 : 8);
};

/* Positions per split for a query that sees `seen` positions: about KV_CUDA_TARGET_SPLITS
 * splits, each a multiple of 32 positions (a whole number of the warps' row steps), at least
 * KV_CUDA_MIN_SPLIT and at most MAX_SPLIT. A function of the query's length alone. */
static __host__ __device__ inline int split_positions(int seen) {
    int each = (seen + KV_CUDA_TARGET_SPLITS - 1) / KV_CUDA_TARGET_SPLITS;
    each = (each + 31) / 32 * 32;
    return each < KV_CUDA_MIN_SPLIT ? KV_CUDA_MIN_SPLIT : each > MAX_SPLIT ? MAX_SPLIT : each;
}

static __host__ __device__ inline int splits_of(int seen) {
    int each = split_positions(seen);
    return (seen + each - 1) / each;
}

/* The most splits any query with seen <= max_seen has (the grid's y size): up to
 * MIN_SPLIT * TARGET positions a query has ceil(seen / MIN_SPLIT) <= TARGET splits, up to
 * MAX_SPLIT * TARGET at most TARGET, beyond that ceil(seen / MAX_SPLIT), which grows with
 * seen. (splits_of itself does not grow with seen everywhere: 1025 positions are 17 splits
 * of 64, 1024 are 32 of 32.) */
static int max_splits_of(int max_seen) {
    int fine = (max_seen + KV_CUDA_MIN_SPLIT - 1) / KV_CUDA_MIN_SPLIT;
    int coarse = (max_seen + MAX_SPLIT - 1) / MAX_SPLIT;
    int most = fine < KV_CUDA_TARGET_SPLITS ? fine : KV_CUDA_TARGET_SPLITS;
    return most > coarse ? most : coarse;
}

/* Lanes that share a head row: head_dim / 8 rounded up to a power of two, so that a row's
 * lanes form an aligned group that xor shuffles by less than row_lanes never leave. */
static __host__ __device__ inline int lanes_per_row(int head_dim) {
    int lanes = 1;
    while (lanes * 8 < head_dim) lanes *= 2;
    return lanes;
}

/* The row's lanes add up their parts of the GROUP dot products. One head at a time that is
 * log2(row_lanes) shuffles per head. Instead, while a lane holds more than one head, each
 * step swaps halves with the partner lane (lane ^ offset): the lower lane keeps heads
 * [0, half) of what it holds, the upper lane [half, 2 half), and each adds the partner's
 * part of the heads it keeps, so it sends `half` values, not twice as many. Once a lane
 * holds one head the remaining steps are plain butterfly adds (a + b on one lane, b + a on
 * its partner: the same bits). For 4 heads over 16 lanes: 2 + 1 + 1 + 1 = 5 shuffles in
 * place of 16. Every lane of the warp takes part in every shuffle (row_lanes is the same on
 * all of them).
 *
 * Afterwards dot[i] for i < GROUP >> halvings holds the total of head (returned) + i, and
 * lanes that differ only in the bits of the plain steps hold the same totals. */
template <int GROUP>
static __device__ __forceinline__ int reduce_row(float (&dot)[GROUP], int lane, int row_lanes,
                                                 int *halvings) {
    int offset = row_lanes / 2, first = 0, steps = 0;
#pragma unroll
    for (int half = GROUP / 2; half >= 1; half /= 2) {
        if (offset == 0) break;   /* fewer lanes than heads: each lane keeps several */
        const bool upper = (lane & offset) != 0;
#pragma unroll
        for (int i = 0; i < half; i++) {
            float keep = upper ? dot[i + half] : dot[i];
            float give = upper ? dot[i] : dot[i + half];
            dot[i] = keep + __shfl_xor_sync(FULL_MASK, give, offset);
        }
        if (upper) first += half;
        offset /= 2;
        steps++;
    }
    for (; offset > 0; offset /= 2) dot[0] += __shfl_xor_sync(FULL_MASK, dot[0], offset);
    *halvings = steps;
    return first;
}

/* One row step of a warp: UNROLL loads (row base + u * stride + row_in_step, of K or V),
 * all issued before any is used. Rows past the split and lanes past the row's end read
 * zeros. */
template <class Format>
static __device__ __forceinline__ void load_step(typename Format::Raw (&raw)[UNROLL],
                                                 const kv_store &store, size_t store_base,
                                                 const uint32_t *slot, int base, int stride,
                                                 int row_in_step, int n_rows, bool has_values,
                                                 int d0) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        int r = base + u * stride + row_in_step;
        raw[u] = r < n_rows && has_values ? Format::load(store, store_base + slot[r], d0)
                                          : Format::zero();
    }
}

template <class Format, int GROUP>
__global__ void __launch_bounds__(THREADS, Occupancy<Format, GROUP>::blocks)
attend_split(float *__restrict__ part_acc, float *__restrict__ part_max,
             float *__restrict__ part_sum, int max_splits, const float *__restrict__ q,
             size_t q_stride, kv_store key, kv_store value, int layer,
             const int32_t *__restrict__ tables, int max_blocks, int block_size,
             const int32_t *__restrict__ query_table, const int32_t *__restrict__ query_seen,
             int n_heads, int groups_per_kv_head, float scale) {
    extern __shared__ float shared[];
    const int query = blockIdx.x, split = blockIdx.y;
    const int seen = query_seen[query];
    const int positions = split_positions(seen);   /* this query's split length */
    const int first = split * positions;
    if (first >= seen) return;   /* the grid fits the query with the most splits */
    const int n_rows = min(positions, seen - first);

    const int head_dim = key.head_dim;
    const int kv_mul = n_heads / key.n_kv_heads;
    const int kv_head = blockIdx.z / groups_per_kv_head;
    const int first_head = kv_head * kv_mul + (blockIdx.z % groups_per_kv_head) * GROUP;
    const int n_q = min(GROUP, kv_head * kv_mul + kv_mul - first_head);   /* query heads here */

    uint32_t *slot = (uint32_t *)shared;           /* [MAX_SPLIT] where each position lives */
    float *score = shared + MAX_SPLIT;              /* [GROUP][MAX_SPLIT] scores, then weights */
    float *warp_acc = score + GROUP * MAX_SPLIT;    /* [WARPS][GROUP][head_dim] */

    /* 0. The block table, looked up once per position for both passes. */
    const int32_t *table = tables + (size_t)query_table[query] * max_blocks;
    for (int r = threadIdx.x; r < n_rows; r += THREADS) {
        int pos = first + r;
        slot[r] = (uint32_t)table[pos / block_size] * (uint32_t)block_size + (uint32_t)(pos % block_size);
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_lanes = lanes_per_row(head_dim);
    const int row_in_step = lane / row_lanes;      /* which of the warp's rows this lane reads */
    const int d0 = (lane % row_lanes) * 8;         /* and which 8 values of it */
    const bool has_values = d0 < head_dim;         /* lanes past a row's end hold zeros */
    /* Warp w reads rows base + row_in_step with base = w * step_rows, then every `stride`
     * rows on (the four warps interleave), UNROLL steps at a time. */
    const int step_rows = 32 / row_lanes;
    const int stride = WARPS * step_rows;
    const int first_base = warp * step_rows;
    const size_t key_base = ((size_t)layer * key.n_kv_heads + kv_head) * key.slots;
    const size_t value_base = ((size_t)layer * value.n_kv_heads + kv_head) * value.slots;

    /* 1. Scores: q_m . k_r * scale for the group's query heads and the split's rows. */
    {
        float qv[GROUP][8];   /* this lane's 8 values of each query head */
#pragma unroll
        for (int m = 0; m < GROUP; m++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                qv[m][j] = m < n_q && has_values
                               ? q[(size_t)query * q_stride + (size_t)(first_head + m) * head_dim + d0 + j]
                               : 0.0f;
        for (int base = first_base; base < n_rows; base += stride * UNROLL) {
            typename Format::Raw raw[UNROLL];
            load_step<Format>(raw, key, key_base, slot, base, stride, row_in_step, n_rows,
                              has_values, d0);   /* every load first ... */
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {    /* ... then the arithmetic */
                int r = base + u * stride + row_in_step;
                float k[8], dot[GROUP];
                Format::decode(raw[u], k);
#pragma unroll
                for (int m = 0; m < GROUP; m++) {
                    dot[m] = 0.0f;
#pragma unroll
                    for (int j = 0; j < 8; j++) dot[m] = fmaf(qv[m][j], k[j], dot[m]);
                }
                int halvings;
                const int held_first = reduce_row<GROUP>(dot, lane, row_lanes, &halvings);
                /* one lane of each set that holds the same totals writes them */
                if (r < n_rows && (lane % row_lanes) % (row_lanes >> halvings) == 0) {
#pragma unroll
                    for (int i = 0; i < GROUP; i++)
                        if (i < (GROUP >> halvings) && held_first + i < n_q)
                            score[(held_first + i) * MAX_SPLIT + r] = dot[i] * scale;
                }
            }
        }
    }
    /* The first V loads of this warp do not depend on the weights: issue them now, so that
     * they are on their way while the block computes the softmax. */
    typename Format::Raw raw[UNROLL];
    load_step<Format>(raw, value, value_base, slot, first_base, stride, row_in_step, n_rows,
                      has_values, d0);
    __syncthreads();

    /* 2. The split's softmax, one warp per query head: weights e^(s - m) in place of the
     * scores, and the split's max m and sum l for the merge. */
    for (int m = warp; m < n_q; m += WARPS) {
        float *s = score + m * MAX_SPLIT;
        float top = -INFINITY;
        for (int r = lane; r < n_rows; r += 32) top = fmaxf(top, s[r]);
        top = warp_max(top);
        float sum = 0.0f;
        for (int r = lane; r < n_rows; r += 32) {
            float p = expf(s[r] - top);
            s[r] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            size_t at = ((size_t)query * n_heads + first_head + m) * max_splits + split;
            part_max[at] = top;
            part_sum[at] = sum;
        }
    }
    __syncthreads();

    /* 3. acc_m = sum_r p_m[r] * v_r: the same walk over the rows, now of V (the first step's
     * rows already loaded above). */
    float acc[GROUP][8];
#pragma unroll
    for (int m = 0; m < GROUP; m++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[m][j] = 0.0f;
    for (int base = first_base; base < n_rows; base += stride * UNROLL) {
        if (base != first_base)
            load_step<Format>(raw, value, value_base, slot, base, stride, row_in_step, n_rows,
                              has_values, d0);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int r = base + u * stride + row_in_step;
            float v[8];
            Format::decode(raw[u], v);
#pragma unroll
            for (int m = 0; m < GROUP; m++) {
                float p = m < n_q && r < n_rows ? score[m * MAX_SPLIT + r] : 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) acc[m][j] = fmaf(p, v[j], acc[m][j]);
            }
        }
    }
    /* The warp's row groups each summed different rows: add them up across the warp ... */
    for (int offset = row_lanes; offset < 32; offset <<= 1)
#pragma unroll
        for (int m = 0; m < GROUP; m++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[m][j] += __shfl_xor_sync(FULL_MASK, acc[m][j], offset);
    if (row_in_step == 0 && has_values) {
#pragma unroll
        for (int m = 0; m < GROUP; m++)
            if (m < n_q)
#pragma unroll
                for (int j = 0; j < 8; j++) warp_acc[(warp * GROUP + m) * head_dim + d0 + j] = acc[m][j];
    }
    __syncthreads();
    /* ... then across the warps, in a fixed order, into this split's result. */
    for (int i = threadIdx.x; i < n_q * head_dim; i += THREADS) {
        int m = i / head_dim, d = i % head_dim;
        float total = 0.0f;
        for (int w = 0; w < WARPS; w++) total += warp_acc[(w * GROUP + m) * head_dim + d];
        size_t at = ((size_t)query * n_heads + first_head + m) * max_splits + split;
        part_acc[at * head_dim + d] = total;
    }
}

/* The splits of one (query, query head), merged; every split holds at least one position.
 * Thread d (blockDim.x >= head_dim) makes output value d. First the largest split max M
 * (max_splits floats), then one pass: the weight e^(m_s - M) once per split, for both sums. */
__global__ void merge_splits(float *__restrict__ out, size_t out_stride,
                             const float *__restrict__ part_acc, const float *__restrict__ part_max,
                             const float *__restrict__ part_sum, int max_splits,
                             const int32_t *__restrict__ query_seen, int n_heads, int head_dim) {
    const int query = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const int n_splits = splits_of(query_seen[query]);
    const size_t first = ((size_t)query * n_heads + head) * max_splits;
    float top = -INFINITY;
    for (int s = 0; s < n_splits; s++) top = fmaxf(top, part_max[first + s]);
    float total = 0.0f, acc = 0.0f;
#pragma unroll 4
    for (int s = 0; s < n_splits; s++) {
        float weight = expf(part_max[first + s] - top);
        total += weight * part_sum[first + s];
        if (d < head_dim) acc += weight * part_acc[(first + s) * head_dim + d];
    }
    if (d < head_dim) out[(size_t)query * out_stride + (size_t)head * head_dim + d] = acc / total;
}

typedef void (*split_kernel)(float *, float *, float *, int, const float *, size_t, kv_store,
                             kv_store, int, const int32_t *, int, int, const int32_t *,
                             const int32_t *, int, int, float);

/* One kernel per (format, group size): the compiler keeps q and acc in registers only when
 * their sizes are known, and a small group needs far fewer of them. */
template <class Format>
static split_kernel kernel_for_group(int group) {
    switch (group) {
        case 1: return attend_split<Format, 1>;
        case 2: return attend_split<Format, 2>;
        case 4: return attend_split<Format, 4>;
        case 8: return attend_split<Format, 8>;
    }
    return NULL;
}

static split_kernel kernel_for(kv_format format, int group) {
    switch (format) {
        case KV_FMT_F32: return kernel_for_group<FormatF32>(group);
        case KV_FMT_F16: return kernel_for_group<FormatF16>(group);
        case KV_FMT_BF16: return kernel_for_group<FormatBF16>(group);
        case KV_FMT_I8: return kernel_for_group<FormatI8>(group);
        default: return NULL;
    }
}

extern "C" size_t kv_cuda_attention_query_bytes(int n_heads, int head_dim, int max_seen) {
    size_t splits = (size_t)max_splits_of(max_seen);
    return (size_t)n_heads * splits * ((size_t)head_dim + 2) * sizeof(float);
}

extern "C" kv_cuda_err kv_cuda_attention(float *out, size_t out_stride, const float *q,
                                         size_t q_stride, const kv_cuda_view *view, int n_queries,
                                         int n_heads, int max_seen, void *scratch,
                                         size_t scratch_bytes) {
    const kv_store *key = view->key, *value = view->value;
    if (n_queries <= 0) return 0;
    if (max_seen <= 0 || max_seen > KV_CUDA_MAX_POSITIONS || n_heads <= 0 ||
        n_heads % key->n_kv_heads != 0 ||
        key->format != value->format || key->group != value->group ||
        key->head_dim != value->head_dim || key->n_kv_heads != value->n_kv_heads ||
        key->slots != value->slots || key->head_dim % 8 != 0 ||
        key->head_dim > KV_CUDA_MAX_HEAD_DIM || view->block_size <= 0)
        return KV_CUDA_INVALID_VALUE;
    const int head_dim = key->head_dim;
    const int max_splits = max_splits_of(max_seen);
    const int kv_mul = n_heads / key->n_kv_heads;
    const int group = kv_mul > 4 ? MAX_GROUP : kv_mul > 2 ? 4 : kv_mul;   /* 1, 2, 4 or 8 */
    const int groups_per_kv_head = (kv_mul + group - 1) / group;
    const size_t per_query = kv_cuda_attention_query_bytes(n_heads, head_dim, max_seen);
    const size_t fit = scratch_bytes / per_query;
    split_kernel kernel = kernel_for(key->format, group);
    if (kernel == NULL || max_splits > 65535 || fit == 0 ||
        (long)key->n_kv_heads * groups_per_kv_head > 65535)
        return KV_CUDA_INVALID_VALUE;
    const size_t shared = ((size_t)MAX_SPLIT + (size_t)group * MAX_SPLIT + (size_t)WARPS * group * head_dim) * sizeof(float);
    const float scale = 1.0f / sqrtf((float)head_dim);
    const unsigned merge_threads = (unsigned)(head_dim + 31) / 32 * 32;   /* >= head_dim */
    /* as many queries at a time as the scratch holds split results for */
    for (int q0 = 0; q0 < n_queries; q0 += (int)fit) {
        int n = n_queries - q0 < (int)fit ? n_queries - q0 : (int)fit;
        float *part_acc = (float *)scratch;
        float *part_max = part_acc + (size_t)n * n_heads * max_splits * head_dim;
        float *part_sum = part_max + (size_t)n * n_heads * max_splits;
        dim3 grid((unsigned)n, (unsigned)max_splits, (unsigned)(key->n_kv_heads * groups_per_kv_head));
        kernel<<<grid, THREADS, shared>>>(part_acc, part_max, part_sum, max_splits,
                                          q + (size_t)q0 * q_stride, q_stride, *key, *value,
                                          view->layer, view->tables, view->max_blocks,
                                          view->block_size, view->query_table + q0,
                                          view->query_seen + q0, n_heads, groups_per_kv_head,
                                          scale);
        kv_cuda_err err = KV_CUDA_LAUNCHED();
        if (err != 0) return err;
        merge_splits<<<dim3((unsigned)n, (unsigned)n_heads), merge_threads>>>(
            out + (size_t)q0 * out_stride, out_stride, part_acc, part_max, part_sum, max_splits,
            view->query_seen + q0, n_heads, head_dim);
        err = KV_CUDA_LAUNCHED();
        if (err != 0) return err;
    }
    return 0;
}
