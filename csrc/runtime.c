/* runtime.c: what every part of the core shares at run time, and nothing else: the
 * clock, the threads parallel loops use, the kernel tier (fast or plain), the caller's
 * interrupt check, and the text of each status. The math files call into this one; it
 * calls none of them.
 */
#include "common.h"
#include "kvlab.h"

#if defined(_WIN32) && !defined(_OPENMP)
#define WIN32_LEAN_AND_MEAN
#include <windows.h>    /* QueryPerformanceCounter: Windows' C library has no TIME_UTC */
#endif

/* ---- the clock -------------------------------------------------------------------------- */

double kv_seconds(void) {
#if defined(_OPENMP)
    return omp_get_wtime();
#elif defined(_WIN32)
    LARGE_INTEGER now, per_second;
    QueryPerformanceCounter(&now);
    QueryPerformanceFrequency(&per_second);
    return (double)now.QuadPart / (double)per_second.QuadPart;
#else
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
#endif
}

/* ---- the text of each status ------------------------------------------------------------ */

const char *kv_strerror(kv_status status) {
    switch (status) {
        case KV_OK: return "success";
        case KV_ERR_NOMEM: return "out of memory";
        case KV_ERR_INVALID_ARG: return "invalid argument";
        case KV_ERR_TOKEN_RANGE: return "token id out of range [0, vocab_size)";
        case KV_ERR_CACHE_FULL: return "the KV cache is full (max_seq_len reached)";
        case KV_ERR_CACHE_MISMATCH: return "the KV cache was made for a different model shape";
        case KV_ERR_OUT_OF_BLOCKS: return "the paged pool has no free block left";
        case KV_ERR_NO_SEQUENCE: return "no such sequence in this pool (freed, or never created)";
        case KV_ERR_TABLE_FULL: return "the sequence's block table is full";
        case KV_ERR_TOO_MANY_SEQUENCES: return "the pool has no room for another sequence";
        case KV_ERR_CORRUPT: return "a pool invariant is broken";
        case KV_ERR_NOT_A_NUMBER: return "the logits are not numbers (NaN, or all -inf): no token can be sampled";
        case KV_ERR_INTERRUPTED: return "interrupted";
        case KV_ERR_PENDING:
            return "the sequence has reserved positions not committed yet: commit (or free) it first";
        case KV_ERR_STORE: return "the pool's row store failed";
    }
    return "unknown error";
}

/* ---- stopping early ------------------------------------------------------------------ */

/* The calling thread's interrupt check (kvlab.h): per thread, because each Python thread
 * that runs a model has its own call in flight. */
static _Thread_local kv_interrupt_check interrupt_check;
static _Thread_local void *interrupt_arg;
static _Thread_local double interrupt_last_asked;

void kv_set_interrupt_check(kv_interrupt_check check, void *arg) {
    interrupt_check = check;
    interrupt_arg = arg;
    interrupt_last_asked = 0.0;
}

/* Whether to stop now. The check may be costly (Python's takes the GIL), so it is asked at
 * most every 20 ms: a person pressing Ctrl-C cannot tell the difference. */
int kv_interrupted(void) {
    if (interrupt_check == NULL) return 0;
    double now = kv_seconds();
    if (now - interrupt_last_asked < 0.02) return 0;
    interrupt_last_asked = now;
    return interrupt_check(interrupt_arg) != 0;
}

/* ---- threads and the kernel tier -------------------------------------------------------- */

static int num_threads;      /* 0 until set: then OpenMP's default (the available cores) */
static kv_kernels kernels;   /* KV_KERNELS_FAST until set */

void kv_set_num_threads(int n_threads) {
    if (n_threads > 0) num_threads = n_threads;
}

int kv_get_num_threads(void) { return kv_threads(); }

int kv_available_cores(void) {
    int n = omp_get_num_procs();      /* OpenMP counts the process's affinity mask */
    return n > 0 ? n : 1;
}

void kv_set_kernels(kv_kernels tier) {
    if (tier == KV_KERNELS_FAST || tier == KV_KERNELS_PLAIN) kernels = tier;
}

kv_kernels kv_get_kernels(void) { return kernels; }

int kv_threads(void) {
    int n = num_threads;
    return n > 0 ? n : omp_get_max_threads();
}
