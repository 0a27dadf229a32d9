/* bandwidth.c: how fast this machine moves memory, measured by the core's own threads.
 *
 * Decoding one token reads every weight once, so its speed limit is the memory
 * bandwidth; benchmarks/bench_cpu.py compares kvlab against these numbers, measured in
 * the same run with the same threads:
 *   read:  sum a large array (nothing written), each thread its own slice, read as
 *          READ_STREAMS runs side by side;
 *   triad: a[i] = b[i] + s * c[i] (STREAM's triad: two arrays read, one written);
 *   walk:  decode attention's reads of a cache, with none of its arithmetic.
 * Each is the best of `repeats` passes over arrays far larger than the caches.
 */
#include <string.h>

#include "attention.h"
#include "common.h"
#include "ops.h"
#include "simd.h"

/* Why several runs at once: one core reading one run front to back gets only about
 * 16 GB/s of this 2-core machine's memory, the same with or without software prefetch,
 * while 4 or 8 runs side by side get 21-22 GB/s (measured). The hardware prefetcher
 * follows each run separately and keeps more reads in flight for more runs, so a single
 * run understates what the memory can deliver, and what a kernel reading several rows at
 * once gets. */
#define READ_STREAMS 8

kv_status kv_measure_bandwidth(size_t n_floats, int repeats, double *read_bytes_per_s,
                               double *triad_bytes_per_s, float *checksum) {
    kv_status status = KV_OK;
    float *a = NULL, *b = NULL, *c = NULL;
    KV_CHECK(n_floats >= 64 && repeats >= 1 && n_floats <= ((size_t)1 << 32), KV_ERR_INVALID_ARG);
    n_floats &= ~(size_t)7;
    a = kv_alloc_floats(n_floats);
    b = kv_alloc_floats(n_floats);
    c = kv_alloc_floats(n_floats);
    KV_CHECK(a != NULL && b != NULL && c != NULL, KV_ERR_NOMEM);
    int n_threads = kv_threads();
    (void)n_threads;   /* used by the OpenMP pragmas only, when built without OpenMP */
    int64_t n = (int64_t)n_floats;
    /* first touch by the threads that will use each page */
    #pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t i = 0; i < n; i++) {
        a[i] = 0.0f;
        b[i] = 1.0f;
        c[i] = 2.0f;
    }
    double best_read = 0.0, best_triad = 0.0;
    float total = 0.0f;
    for (int r = 0; r < repeats; r++) {
        double start = kv_seconds();
        float sum = 0.0f;
        int64_t covered = 0;   /* floats the slices hold (n, less a few left over) */
        #pragma omp parallel num_threads(n_threads) reduction(+ : sum, covered)
        {
            /* this thread's slice, in READ_STREAMS runs read side by side, 64 bytes each */
            int thread = omp_get_thread_num(), team = omp_get_num_threads();
            int64_t slice = n / team / (16 * READ_STREAMS) * (16 * READ_STREAMS);
            int64_t run = slice / READ_STREAMS;
            const float *mine = b + (int64_t)thread * slice;
            v8f lanes = {0};
            for (int64_t i = 0; i < run; i += 16)
                for (int s = 0; s < READ_STREAMS; s++) {
                    const float *at = mine + s * run + i;
                    lanes += load8(at) + load8(at + 8);
                }
            sum += reduce_lanes(lanes);
            covered += slice;
        }
        double seconds = kv_seconds() - start;
        total += sum;
        double read = (double)covered * sizeof(float);
        if (read / seconds > best_read) best_read = read / seconds;

        start = kv_seconds();
        #pragma omp parallel for schedule(static) num_threads(n_threads)
        for (int64_t i = 0; i < n; i++) a[i] = b[i] + 3.0f * c[i];
        seconds = kv_seconds() - start;
        if (3.0 * n * sizeof(float) / seconds > best_triad) best_triad = 3.0 * n * sizeof(float) / seconds;
        total += a[n / 2];
    }
    *read_bytes_per_s = best_read;
    *triad_bytes_per_s = best_triad;
    *checksum = total;   /* the sums are used, so the reads cannot be optimized away */
fail:
    free(a);
    free(b);
    free(c);
    return status;
}

/* Decode attention's walk through memory (attention.c), without its arithmetic: the KV
 * heads dealt to the threads in turn; for each head, a tile of KV_ATTENTION_TILE key rows
 * read front to back, then the tile's value rows, the rows one tile on fetched while a
 * tile is read. Attention cannot read K and V faster than this walk can, so its bandwidth
 * is the ceiling of that access pattern, to set beside the plain read above. */
#define WALK_TILE KV_ATTENTION_TILE
static float walk_rows(const float *rows, size_t row_floats, int tile_start, int context) {
    v8f lanes = {0};
    int end = tile_start + WALK_TILE < context ? tile_start + WALK_TILE : context;
    for (int r = tile_start; r < end; r++) {
        const float *row = rows + (size_t)r * row_floats;
        if (r + WALK_TILE < context)
            for (size_t at = 0; at < row_floats; at += 16)
                __builtin_prefetch(row + WALK_TILE * row_floats + at);
        for (size_t i = 0; i + 8 <= row_floats; i += 8) lanes += load8(row + i);
    }
    return reduce_lanes(lanes);
}

kv_status kv_measure_attention_walk(int n_kv_heads, int head_dim, int context, int repeats,
                                    double *bytes_per_s, float *checksum) {
    kv_status status = KV_OK;
    float *keys = NULL, *values = NULL;
    KV_CHECK(n_kv_heads >= 1 && n_kv_heads <= 1024 && head_dim >= 8 && head_dim % 8 == 0 &&
             head_dim <= 1024 && context >= WALK_TILE && context <= (1 << 22) && repeats >= 1,
             KV_ERR_INVALID_ARG);
    size_t head_floats = (size_t)context * head_dim, floats = (size_t)n_kv_heads * head_floats;
    /* enough copies that each pass reads from memory what the last pass left in the
     * caches least recently: 64 MiB of K and V in all at least */
    size_t bytes = 2 * floats * sizeof(float);
    int n_copies = bytes >= ((size_t)64 << 20) ? 1 : (int)(((size_t)64 << 20) / bytes) + 1;
    keys = kv_alloc_floats(floats * n_copies);
    values = kv_alloc_floats(floats * n_copies);
    KV_CHECK(keys != NULL && values != NULL, KV_ERR_NOMEM);
    int n_threads = kv_threads();
    (void)n_threads;
    /* first touch by the thread that reads each head, dealt out as in the walk */
    for (int copy = 0; copy < n_copies; copy++) {
        #pragma omp parallel for schedule(static, 1) num_threads(n_threads)
        for (int h = 0; h < n_kv_heads; h++) {
            size_t first = ((size_t)copy * n_kv_heads + h) * head_floats;
            for (size_t i = first; i < first + head_floats; i++) keys[i] = values[i] = 1.0f;
        }
    }
    double best = 0.0;
    float total = 0.0f;
    for (int r = 0; r < repeats * n_copies; r++) {
        size_t copy = (size_t)(r % n_copies) * floats;
        float sum = 0.0f;
        double start = kv_seconds();
        #pragma omp parallel for schedule(static, 1) num_threads(n_threads) reduction(+ : sum)
        for (int h = 0; h < n_kv_heads; h++) {
            const float *k = keys + copy + (size_t)h * head_floats;
            const float *v = values + copy + (size_t)h * head_floats;
            for (int tile = 0; tile < context; tile += WALK_TILE)
                sum += walk_rows(k, (size_t)head_dim, tile, context) +
                       walk_rows(v, (size_t)head_dim, tile, context);
        }
        double seconds = kv_seconds() - start;
        total += sum;
        if ((double)bytes / seconds > best) best = (double)bytes / seconds;
    }
    *bytes_per_s = best;
    *checksum = total;
fail:
    free(keys);
    free(values);
    return status;
}
