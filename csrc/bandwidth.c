/* bandwidth.c: how fast this machine moves memory, and how fast it multiplies, measured by
 * the core's own threads.
 *
 * Decoding one token reads every weight once, so its speed limit is the memory
 * bandwidth; benchmarks/bench_cpu.py compares kvlab against these numbers, measured in
 * the same run with the same threads:
 *   read:  sum a large array (nothing written), each thread its own slice, read as
 *          READ_STREAMS runs side by side;
 *   triad: a[i] = b[i] + s * c[i] (STREAM's triad: two arrays read, one written);
 *   walk:  decode attention's reads of a cache, with none of its arithmetic.
 * Each is the best of `repeats` passes over arrays far larger than the caches. A prefill,
 * or a decode step of many sequences, reuses each weight for many tokens and is bound by
 * arithmetic instead: the compute roof (kv_measure_compute, at the end) is the rate of
 * the widest float32 multiply-add and int8 dot-product instructions this build has, and of
 * the int8 product's own sequence (weight_formats.c), with no memory traffic at all.
 */
#if defined(__linux__) || defined(__APPLE__)
#define _POSIX_C_SOURCE 200809L   /* clock_gettime's per-thread clock, for the compute roof */
#define KV_THREAD_CLOCK 1
#endif
#include <string.h>
#include <time.h>

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

/* ---- the compute roof ----------------------------------------------------------------- */

/* Independent chains of one instruction each, so that the CPU can issue them back to back
 * without waiting on a result: ten, more than latency (4 cycles) times the units (2) of
 * today's cores. ROOF_STEPS rounds of the ten make one pass (milliseconds). */
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define N_CHAINS 10
#define ROOF_STEPS (1 << 20)

/* Keeps the compiler from treating v as a known value across iterations (so that it cannot
 * compute an instruction once for all chains, or fold a loop of them): costs nothing. */
#if defined(__GNUC__) && defined(__AVX__)
#define OPAQUE(v) __asm__("" : "+v"(v))
#else
#define OPAQUE(v) ((void)0)
#endif

/* The body of a chains function: DECLARE(i) starts chain i, ONE(i) is its step (ending with
 * OPAQUE of what it reads), SUM(i) adds its result to a float total, which is returned. */
#define RUN_CHAINS()                                     \
    CHAINS(DECLARE)                                      \
    for (int k = 0; k < ROOF_STEPS; k++) { CHAINS(ONE) } \
    return 0.0f CHAINS(SUM);

#if defined(__AVX512F__) && defined(__GNUC__)
#define ROOF_F32 "AVX-512 fused multiply-add, 16 lanes"
#define F32_FLOPS_PER_CHAIN_STEP 32.0
static float f32_chains(void) {
    __m512 step = _mm512_set1_ps(0.999f), add = _mm512_set1_ps(1e-7f);
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)(i) * 1e-3f);
#define ONE(i) a##i = _mm512_fmadd_ps(a##i, step, add); OPAQUE(step);
#define SUM(i) +_mm512_reduce_add_ps(a##i)
    RUN_CHAINS()
}
#else
#define ROOF_F32 "multiply-add of eight lanes (v8f, simd.h's madd)"
#define F32_FLOPS_PER_CHAIN_STEP 16.0
static float f32_chains(void) {
    v8f step = splat(0.999f), add = splat(1e-7f);
#define DECLARE(i) v8f a##i = splat((float)(i) * 1e-3f);
#define ONE(i) a##i = madd(a##i, step, add); OPAQUE(step);
#define SUM(i) +reduce_lanes(a##i)
    RUN_CHAINS()
}
#endif
#undef DECLARE
#undef ONE
#undef SUM

/* The int8 dot product: 64 (512-bit VNNI), 32 (AVX2) or 4 byte products a chain and step,
 * each product and its addition two operations; and the int8 product's sequence as
 * weight_formats.c's rows-in-lanes tiles run it, a block of 32 for each lane's row: eight
 * steps of sums of four (two chains of four, as the tiles add them) make the block's exact
 * integer total in every lane, which is made float, scaled by a product of two scales and
 * added to the lane's running sum with a multiply-add: 512 byte products a chain and step
 * with 512-bit VNNI (16 lanes), 256 with AVX2 (8 lanes, Q8_0's way: |w| times x with w's
 * sign, maddubs then madd). */
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__GNUC__)
#define ROOF_INT8 "AVX-512 VNNI dpbusd, 64 byte products"
#define INT8_OPS_PER_CHAIN_STEP 128.0
static float int8_chains(void) {
    __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
#define DECLARE(i) __m512i a##i = _mm512_set1_epi32(i);
#define ONE(i) a##i = _mm512_dpbusd_epi32(a##i, u, s); OPAQUE(u);
#define SUM(i) +(float)_mm512_reduce_add_epi32(a##i)   /* each in range; their total in float */
    RUN_CHAINS()
}
#undef DECLARE
#undef ONE
#undef SUM
#define INT8_PRODUCT_OPS_PER_CHAIN_STEP 1024.0
/* one block's exact integer totals, 16 rows in the lanes, against the four codes x */
static ALWAYS_INLINE __m512i block_totals_512(const __m512i w[8], __m512i x) {
    __m512i ints[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int g = 0; g < 8; g++) ints[g % 2] = _mm512_dpbusd_epi32(ints[g % 2], w[g], x);
    return _mm512_add_epi32(ints[0], ints[1]);
}
static float int8_product_chains(void) {
    __m512i w[8], x = _mm512_set1_epi8(3);
    for (int g = 0; g < 8; g++) w[g] = _mm512_set1_epi8((char)(5 + g));
    __m512 d_w = _mm512_set1_ps(1e-3f), d_x = _mm512_set1_ps(0.5f);
#define DECLARE(i) __m512 a##i = _mm512_setzero_ps();
#define ONE(i)                                                                       \
    a##i = _mm512_fmadd_ps(_mm512_mul_ps(d_w, d_x),                                  \
                           _mm512_cvtepi32_ps(block_totals_512(w, x)), a##i);        \
    OPAQUE(x);                                                                       \
    OPAQUE(d_x);
#define SUM(i) +_mm512_reduce_add_ps(a##i)
    RUN_CHAINS()
}
#elif defined(__AVX2__) && defined(__GNUC__)
#define ROOF_INT8 "AVX2 maddubs and madd, 32 byte products"
#define INT8_OPS_PER_CHAIN_STEP 64.0
static ALWAYS_INLINE __m256i products32(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
static float int8_chains(void) {
    __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-2);
#define DECLARE(i) __m256i a##i = _mm256_set1_epi32(i);
#define ONE(i) a##i = _mm256_add_epi32(a##i, products32(u, s)); OPAQUE(u);
#define SUM(i) +(float)_mm256_extract_epi32(a##i, 0)
    RUN_CHAINS()
}
#undef DECLARE
#undef ONE
#undef SUM
#define INT8_PRODUCT_OPS_PER_CHAIN_STEP 512.0
/* one block's exact integer totals, 8 rows in the lanes, against the four codes x: |w|
 * times x with w's sign in pairs (maddubs), the pairs to int32 (madd) and added */
static ALWAYS_INLINE __m256i block_totals_256(const __m256i w[8], const __m256i signs[8],
                                              __m256i x) {
    __m256i ones = _mm256_set1_epi16(1);
    __m256i ints[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int g = 0; g < 8; g++) {
        __m256i pairs = _mm256_maddubs_epi16(w[g], _mm256_sign_epi8(x, signs[g]));
        ints[g % 2] = _mm256_add_epi32(ints[g % 2], _mm256_madd_epi16(pairs, ones));
    }
    return _mm256_add_epi32(ints[0], ints[1]);
}
static float int8_product_chains(void) {
    __m256i w[8], signs[8], x = _mm256_set1_epi8(3);
    for (int g = 0; g < 8; g++) {
        w[g] = _mm256_set1_epi8((char)(5 + g));
        /* a distinct sign vector a group, as the panel's are: equal ones would let the
         * compiler share one sign operation among the groups, which the tile cannot */
        signs[g] = _mm256_set1_epi8((char)(g % 2 ? -1 - g : 1 + g));
    }
    v8f d_w = splat(1e-3f), d_x = splat(0.5f);
#define DECLARE(i) v8f a##i = {0};
#define ONE(i)                                                                       \
    a##i = madd(d_w * d_x, (v8f)_mm256_cvtepi32_ps(block_totals_256(w, signs, x)), \
                a##i);                                                               \
    OPAQUE(x);                                                                       \
    OPAQUE(d_x);
#define SUM(i) +reduce_lanes(a##i)
    RUN_CHAINS()
}
#else
#define ROOF_INT8 "scalar int32 multiply-adds, 4 byte products"
#define INT8_OPS_PER_CHAIN_STEP 8.0
/* four byte products of one chain and step, summed in int32 as the plain tier sums them */
static float int8_chains(void) {
    volatile int8_t u = 3, s = -2;   /* read each step: not folded */
    int32_t acc[N_CHAINS] = {0};
    for (int k = 0; k < ROOF_STEPS; k++)
        for (int c = 0; c < N_CHAINS; c++) acc[c] += u * s + u * s + u * s + u * s;
    float total = 0.0f;
    for (int c = 0; c < N_CHAINS; c++) total += (float)acc[c];
    return total;
}
#define INT8_PRODUCT_OPS_PER_CHAIN_STEP INT8_OPS_PER_CHAIN_STEP
static float int8_product_chains(void) { return int8_chains(); }
#endif
#undef DECLARE
#undef ONE
#undef SUM
#undef OPAQUE
#undef RUN_CHAINS

/* Seconds of CPU time this thread has run, where the system keeps them (else the wall
 * clock): a pass's time on a shared machine is then its own, not the neighbours' too. */
static double thread_seconds(void) {
#ifdef KV_THREAD_CLOCK
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
#else
    return kv_seconds();
#endif
}

/* The best rate of `repeats` rounds of `chains` on n_threads threads at once, in operations
 * per second: in a round each thread runs one pass and times it on its own clock, and the
 * round's rate is the sum of the threads' rates. */
static double best_rate(float (*chains)(void), double ops_per_pass, int n_threads,
                        int repeats, float *checksum) {
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        float sum = 0.0f;
        double rate = 0.0;
        #pragma omp parallel num_threads(n_threads) reduction(+ : sum, rate)
        {
            double start = thread_seconds();
            sum += chains();
            rate += ops_per_pass / (thread_seconds() - start);
        }
        *checksum += sum;
        best = rate > best ? rate : best;
    }
    return best;
}

kv_status kv_measure_compute(int n_threads, int repeats, kv_compute_roof *roof) {
    if (roof == NULL || n_threads < 1 || n_threads > 4096 || repeats < 1 || repeats > 1000)
        return KV_ERR_INVALID_ARG;
    double steps = (double)ROOF_STEPS * N_CHAINS;
    float checksum = 0.0f;
    roof->f32_flops = best_rate(f32_chains, steps * F32_FLOPS_PER_CHAIN_STEP, n_threads,
                                repeats, &checksum);
    roof->int8_ops = best_rate(int8_chains, steps * INT8_OPS_PER_CHAIN_STEP, n_threads,
                               repeats, &checksum);
    roof->int8_product_ops = best_rate(int8_product_chains,
                                       steps * INT8_PRODUCT_OPS_PER_CHAIN_STEP, n_threads,
                                       repeats, &checksum);
    roof->f32_instruction = ROOF_F32;
    roof->int8_instruction = ROOF_INT8;
    roof->checksum = checksum;
    return KV_OK;
}
