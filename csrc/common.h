/* common.h: small helpers shared by the core's .c files (not part of the public API).
 *
 * KV_TRY propagates a failing kv_status to the caller's `fail:` label, so each
 * function has exactly one cleanup path. OpenMP is optional: without it the pragmas
 * are ignored and these stubs report a single thread.
 */
#ifndef KVLAB_COMMON_H
#define KVLAB_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include "kvlab.h"

#define KV_TRY(expr)                       \
    do {                                   \
        status = (expr);                   \
        if (status != KV_OK) goto fail;    \
    } while (0)

#define KV_CHECK(cond, err)                \
    do {                                   \
        if (!(cond)) {                     \
            status = (err);                \
            goto fail;                     \
        }                                  \
    } while (0)

/* Float buffers start on a 64-byte boundary (a cache line): tidy, and what SIMD code
 * written for aligned loads would need. The kernels here use unaligned loads anyway, so
 * where C11's aligned_alloc is missing (Windows' C library: mingw-w64, MSVC) plain malloc
 * does (16-byte aligned there) rather than _aligned_malloc, whose memory only
 * _aligned_free may release: every buffer of the core is released with free(). */
static inline float *kv_alloc_floats(size_t count) {
    size_t bytes = count * sizeof(float);
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes == 0) bytes = 64;
#ifdef _WIN32
    return (float *)malloc(bytes);
#else
    return (float *)aligned_alloc(64, bytes);
#endif
}

/* n rounded up to a multiple of 16 (floats): scratch carved out of one allocation keeps
 * each piece 64-byte aligned when the allocation is. */
static inline size_t kv_round_up16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Where part i of n things split into `parts` nearly equal parts starts (part i is
 * kv_split(n, i, parts) .. kv_split(n, i + 1, parts)): a thread's rows of a parallel loop.
 * The product is 64-bit, so that n * i cannot overflow an int. */
static inline int kv_split(int n, int i, int parts) { return (int)((int64_t)n * i / parts); }

/* ceil(n / d) for n >= 0 and d > 0, in 64 bits so that n + d - 1 cannot overflow an int:
 * the blocks a length takes (blocks.c, swap.c, the binding's messages), the panels of a row. */
static inline int64_t kv_ceil_div(int64_t n, int64_t d) { return (n + d - 1) / d; }

/* Below this many multiply-adds a loop runs on one thread: waking the other threads
 * costs a few microseconds, more than small work takes, and far more when the cores
 * are busy with something else. Work is counted in int64_t, never long: long is 32 bits
 * on Windows, where a big matrix product's count would overflow. */
#define KV_PARALLEL_MIN_WORK ((int64_t)1 << 16)

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_num_procs(void) { return 1; }
#endif

/* Wall-clock seconds from an arbitrary start, for timing inside the core (the bandwidth
 * probe, the generation loop's steps, the interrupt check's clock): runtime.c. */
double kv_seconds(void);

/* Threads every parallel loop of the core uses (kv_set_num_threads). One process-wide
 * number, passed to each loop with num_threads(), because OpenMP's own setting belongs
 * to the calling thread and Python code often calls from several threads. */
int kv_threads(void);

/* Whether the caller's interrupt check (kv_set_interrupt_check) says stop; asked at most
 * every 20 ms, so long loops may call it as often as they like (runtime.c). */
int kv_interrupted(void);

/* Largest sizes the core accepts, so that every product of them used as an index fits. */
#define KV_MAX_WIDTH (1 << 16)       /* dim, hidden_dim, n_heads * head_dim, kv_dim */
#define KV_MAX_VOCAB (1 << 24)
#define KV_MAX_LAYERS 4096
#define KV_MAX_POSITIONS (1 << 28)   /* cache capacity */
#define KV_MAX_TOKENS_PER_CALL (1 << 16)

/* A long forward call runs in chunks of about this much work, and looks at the caller's
 * interrupt check between them (model.c, kv_chunk_length): 2 GFLOP is a few tenths of a
 * second on one laptop core. Calls with less work run whole, as they always did.
 * A chunk is whole passes of the matrix kernels: at least KV_CHUNK_MIN tokens, and a
 * multiple of it. The kernels stream each weight matrix from memory once per ops.h's
 * KV_TOKEN_CHUNK tokens (96, which model.c checks this equals), and a chunk of 16 paid for
 * a whole pass all the same: on the 110M shape, where 2 GFLOP is 9 tokens, that made
 * prefill read its weights three times as often and run at 0.6x (issue 37). */
#define KV_CHUNK_FLOPS 2e9
#define KV_CHUNK_MIN 96

#endif /* KVLAB_COMMON_H */
