/* cuda_runtime.h of the emulator: runs kvlab's CUDA kernels on the CPU, slowly, for checking.
 *
 * Not the CUDA runtime: just enough of it, and of the CUDA C++ language, to compile
 * csrc/cuda/*.cu with g++ and run them where there is no GPU (see run.sh beside this file).
 * Every CUDA thread of a block is a fiber (ucontext) of one OS thread; the fibers run in
 * turns until each reaches __syncthreads() or a warp shuffle, and a barrier lets them go
 * only when every thread that must arrive has arrived, so a kernel whose threads would
 * disagree about a barrier deadlocks here and is reported. __shfl_xor_sync demands all 32
 * lanes of the warp, alive, as a full-mask shuffle does on the GPU. Dynamic shared memory
 * starts filled with NaN bytes, so that reading what no thread wrote shows. Blocks run one
 * after another; device memory is host memory.
 */
#ifndef KVLAB_EMULATED_CUDA_RUNTIME_H
#define KVLAB_EMULATED_CUDA_RUNTIME_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct int2 { int x, y; };
/* the rounding intrinsics the kernel lab's header uses (decode_kernel_cuda.cuh): each one
 * IEEE operation, rounded to nearest, as the GPU's; this header is compiled with
 * -ffp-contract=off, so none of them is fused with another */
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
/* the GPU's fast exponential is an approximation of its own; the C library's stands in for
 * it (a planted mistake of the kernel lab uses it: any other bits than the plain tier's do) */
static inline float emu_expf(float x) { return expf(x); }
#define __expf emu_expf   /* (glibc declares an __expf of its own) */
struct uint4 { unsigned x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
static inline int min(int a, int b) { return a < b ? a : b; }
using std::isnan;

/* vector loads must be aligned to their size on the GPU (else cudaErrorMisalignedAddress) */
template <typename T> static inline T __ldg(const T *p) {
    if ((uintptr_t)p % sizeof(T) != 0) {
        fprintf(stderr, "emulator: misaligned %zu-byte load at %p\n", sizeof(T), (const void *)p);
        abort();
    }
    return *p;
}
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- the runtime API ------------------------------------------------------------------- */
typedef enum {
    cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
    cudaErrorLaunchFailure = 719
} cudaError_t;
typedef enum { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 } cudaMemcpyKind;
struct cudaDeviceProp {
    char name[256];
    int major, minor, multiProcessorCount;
    size_t totalGlobalMem;
};
typedef struct emu_event *cudaEvent_t;
struct emu_event { std::chrono::steady_clock::time_point at; };

static inline const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        default: return "cudaErrorLaunchFailure";
    }
}
static inline const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument"
                            : e == cudaErrorMemoryAllocation ? "out of memory" : "emulated failure";
}
static inline cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
static inline cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
static inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
    memset(p, 0, sizeof *p);
    strcpy(p->name, "kvlab CPU emulator");
    p->major = 9;
    p->multiProcessorCount = 1;
    p->totalGlobalMem = (size_t)1 << 32;
    return cudaSuccess;
}
static inline cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }
static inline cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return cudaSuccess; }
static inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
static inline cudaError_t cudaMalloc(void **p, size_t n) {
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    if (*p) memset(*p, 0xA5, n);   /* garbage, as fresh device memory is */
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
static inline cudaError_t cudaMemset(void *p, int v, size_t n) { memset(p, v, n); return cudaSuccess; }
static inline cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind) {
    memmove(d, s, n);
    return cudaSuccess;
}
static inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k) {
    return cudaMemcpy(d, s, n, k);
}
static inline cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new emu_event; return cudaSuccess; }
static inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
static inline cudaError_t cudaEventRecord(cudaEvent_t e) { e->at = std::chrono::steady_clock::now(); return cudaSuccess; }
static inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
static inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
    return cudaSuccess;
}

/* ---- threads as fibers ---------------------------------------------------------------------- */
enum { EMU_RUNNABLE, EMU_AT_BLOCK_BARRIER, EMU_AT_WARP_BARRIER, EMU_DONE };

struct emu_thread {
    ucontext_t context;
    dim3 index;
    int state;
};

struct emu_block {
    std::vector<emu_thread> threads;
    dim3 block_index, block_dim, grid_dim;
    int current;
    ucontext_t scheduler;
    std::function<void()> body;
    std::vector<char> shared;
    std::vector<float> lanes;   /* one value per thread: the shuffle's mailbox */
};

inline emu_block *emu_now;
inline cudaError_t emu_last_error = cudaSuccess;
inline std::vector<std::vector<char>> emu_stacks;   /* one per thread of the largest block */

static inline emu_thread &emu_me() { return emu_now->threads[emu_now->current]; }
#define threadIdx (emu_me().index)
#define blockIdx (emu_now->block_index)
#define blockDim (emu_now->block_dim)
#define gridDim (emu_now->grid_dim)

static inline void emu_wait(int state) {
    emu_me().state = state;
    swapcontext(&emu_me().context, &emu_now->scheduler);
}
static inline void __syncthreads() { emu_wait(EMU_AT_BLOCK_BARRIER); }
static inline void *emu_dynamic_shared() { return emu_now->shared.data(); }

static inline float __shfl_xor_sync(unsigned mask, float value, int offset) {
    int me = emu_now->current, warp = me / 32 * 32;
    if (mask != 0xffffffffu || offset <= 0 || offset >= 32) {
        fprintf(stderr, "emulator: __shfl_xor_sync(%#x, ., %d) is not a full-mask warp shuffle\n", mask, offset);
        abort();
    }
    for (int lane = 0; lane < 32; lane++) {
        if (warp + lane >= (int)emu_now->threads.size() || emu_now->threads[warp + lane].state == EMU_DONE) {
            fprintf(stderr, "emulator: a full-mask shuffle in warp %d while lane %d has exited\n", warp / 32, lane);
            abort();
        }
    }
    emu_now->lanes[me] = value;
    emu_wait(EMU_AT_WARP_BARRIER);            /* every lane has written */
    float got = emu_now->lanes[warp + ((me - warp) ^ offset)];
    emu_wait(EMU_AT_WARP_BARRIER);            /* every lane has read */
    return got;
}

static void emu_thread_main() {
    emu_now->body();
    emu_me().state = EMU_DONE;
    swapcontext(&emu_me().context, &emu_now->scheduler);
}

/* Lets waiting threads go: a warp when all its live lanes wait at the warp barrier, the
 * block when every live thread waits at __syncthreads. False if nobody can move. */
static bool emu_release(emu_block &b) {
    bool released = false;
    int n = (int)b.threads.size(), live = 0, at_block = 0;
    for (auto &t : b.threads) {
        live += t.state != EMU_DONE;
        at_block += t.state == EMU_AT_BLOCK_BARRIER;
    }
    if (live > 0 && at_block == live) {
        for (auto &t : b.threads) if (t.state == EMU_AT_BLOCK_BARRIER) t.state = EMU_RUNNABLE;
        return true;
    }
    for (int w = 0; w < n; w += 32) {
        int waiting = 0, alive = 0;
        for (int i = w; i < std::min(w + 32, n); i++) {
            alive += b.threads[i].state != EMU_DONE;
            waiting += b.threads[i].state == EMU_AT_WARP_BARRIER;
        }
        if (waiting > 0 && waiting == alive) {
            for (int i = w; i < std::min(w + 32, n); i++)
                if (b.threads[i].state == EMU_AT_WARP_BARRIER) b.threads[i].state = EMU_RUNNABLE;
            released = true;
        }
    }
    return released;
}

static void emu_run_block(emu_block &b) {
    int n = (int)(b.block_dim.x * b.block_dim.y * b.block_dim.z);
    b.threads.resize(n);
    b.lanes.assign(n, 0.0f);
    emu_now = &b;
    while ((int)emu_stacks.size() < n) emu_stacks.emplace_back(128 << 10);
    for (int i = 0; i < n; i++) {
        emu_thread &t = b.threads[i];
        t.index = dim3(i % b.block_dim.x, i / b.block_dim.x % b.block_dim.y, i / b.block_dim.x / b.block_dim.y);
        t.state = EMU_RUNNABLE;
        getcontext(&t.context);
        t.context.uc_stack.ss_sp = emu_stacks[i].data();
        t.context.uc_stack.ss_size = emu_stacks[i].size();
        t.context.uc_link = NULL;
        makecontext(&t.context, emu_thread_main, 0);
    }
    for (;;) {
        bool ran = false;
        for (int i = 0; i < n; i++) {
            if (b.threads[i].state != EMU_RUNNABLE) continue;
            b.current = i;
            swapcontext(&b.scheduler, &b.threads[i].context);
            ran = true;
        }
        bool done = true;
        for (auto &t : b.threads) done = done && t.state == EMU_DONE;
        if (done) return;
        if (!emu_release(b) && !ran) {
            fprintf(stderr, "emulator: deadlock in block (%u, %u, %u): threads wait at barriers "
                    "that not all of them reach\n", b.block_index.x, b.block_index.y, b.block_index.z);
            abort();
        }
    }
}

/* kernel<<<grid, block, shared>>>(args) is rewritten as emu_launch(kernel, grid, block, shared)(args) */
template <typename F>
struct emu_launcher {
    F kernel;
    dim3 grid, block;
    size_t shared;
    template <typename... A>
    void operator()(A... args) {
        size_t threads = (size_t)block.x * block.y * block.z;
        if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
            grid.y > 65535 || grid.z > 65535 || shared > 48 * 1024) {
            fprintf(stderr, "emulator: bad launch grid (%u, %u, %u) block (%u, %u, %u) shared %zu\n",
                    grid.x, grid.y, grid.z, block.x, block.y, block.z, shared);
            emu_last_error = cudaErrorInvalidValue;
            return;
        }
        for (unsigned z = 0; z < grid.z; z++)
            for (unsigned y = 0; y < grid.y; y++)
                for (unsigned x = 0; x < grid.x; x++) {
                    emu_block b;
                    b.block_index = dim3(x, y, z);
                    b.block_dim = block;
                    b.grid_dim = grid;
                    b.shared.assign(shared + 16, (char)0xFF);   /* NaN until written */
                    F k = kernel;
                    b.body = [&]() { k(args...); };
                    emu_run_block(b);
                }
    }
};
template <typename F>
static emu_launcher<F> emu_launch(F kernel, dim3 grid, dim3 block, size_t shared = 0) {
    return emu_launcher<F>{kernel, grid, block, shared};
}
static inline cudaError_t cudaGetLastError() {
    cudaError_t e = emu_last_error;
    emu_last_error = cudaSuccess;
    return e;
}

#endif
