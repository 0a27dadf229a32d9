/* bandwidth.c: how fast this machine moves memory, measured by the core's own threads.
 *
 * Decoding one token reads every weight once, so its speed limit is the memory
 * bandwidth; benchmarks/bench_cpu.py compares kvlab against these two numbers, measured
 * in the same run with the same threads:
 *   read:  sum a large array (nothing written), eight lanes per thread;
 *   triad: a[i] = b[i] + s * c[i] (STREAM's triad: two arrays read, one written).
 * Each is the best of `repeats` passes over arrays far larger than the caches.
 */
#include <string.h>
#include <time.h>

#include "common.h"
#include "ops.h"

static double now_seconds(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
#endif
}

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
    (void)n_threads;   /* used by the OpenMP pragmas only */
    long n = (long)n_floats;
    /* first touch by the threads that will use each page */
    #pragma omp parallel for schedule(static) num_threads(n_threads)
    for (long i = 0; i < n; i++) {
        a[i] = 0.0f;
        b[i] = 1.0f;
        c[i] = 2.0f;
    }
    double best_read = 0.0, best_triad = 0.0;
    float total = 0.0f;
    for (int r = 0; r < repeats; r++) {
        double start = now_seconds();
        float sum = 0.0f;
        #pragma omp parallel for schedule(static) num_threads(n_threads) reduction(+ : sum)
        for (long i = 0; i < n; i += 64) {   /* 64 floats (a 256-byte stretch) per step */
            v8f lanes = {0};
            /* ask for memory 2 KiB ahead, as kvlab's own kernels do */
            for (int line = 0; line < 256; line += 64)
                __builtin_prefetch((const char *)(b + i) + 2048 + line);
            for (int j = 0; j < 64; j += 8) lanes += load8(b + i + j);
            sum += reduce_lanes(lanes);
        }
        double seconds = now_seconds() - start;
        total += sum;
        if (n * sizeof(float) / seconds > best_read) best_read = n * sizeof(float) / seconds;

        start = now_seconds();
        #pragma omp parallel for schedule(static) num_threads(n_threads)
        for (long i = 0; i < n; i++) a[i] = b[i] + 3.0f * c[i];
        seconds = now_seconds() - start;
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
