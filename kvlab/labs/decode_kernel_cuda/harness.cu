/* harness.cu: the GPU side of the lab's harness, built into one library with the student's
 * decode_kernel_cuda.cu (the grader's copy of this file, never the student's).
 *
 * It keeps a paged int8 pool in device memory between calls, calls the student's
 * decode_attention on it and copies the results back: harness.py calls these functions
 * through ctypes. The chain of timed calls runs here, on the device, one call after the
 * other on the default stream, each call's query made from the output before by a kernel of
 * this file (q = q_base + out, one float32 addition, as NumPy adds on the grader's side):
 * no call can start before the one before it has ended, nor skip it, and no host round trip
 * sits between them. The outputs stay on the device until the judge asks for some.
 *
 * This runs beside the student's code, in its process: nothing here decides a grade. The
 * judge checks every output it asks for and times the chain with its own clock.
 */
#include <stdio.h>
#include <string.h>

#include "decode_kernel_cuda.cuh"

extern "C" {
int decode_kernel_not_written;
}

struct lab_pool {
    kv_cache_view view;          /* the pointers into the arrays below */
    int8_t *codes[2];            /* key, value: (num_blocks, n_kv_heads, block_size, head_dim) */
    float *scales[2];            /* (num_blocks, n_kv_heads, block_size, head_dim / group) */
    size_t code_bytes, scale_bytes;
    int32_t *table;              /* the call's block table */
    float *q, *q_base;           /* (n_heads, head_dim) each */
    float *outputs;              /* (n_outputs, n_heads, head_dim): the last call's or chain's */
    void *workspace;
    size_t table_bytes, q_bytes, q_base_bytes, outputs_bytes, workspace_bytes;   /* allocated */
    int n_outputs;
};

static char last_error[512];

extern "C" const char *lab_error(void) { return last_error; }

static int failed(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return 0;
    snprintf(last_error, sizeof last_error, "%s: %s (%s)", what, cudaGetErrorString(err),
             cudaGetErrorName(err));
    return 1;
}

/* the CUDA error the student's kernels left, if any: a launch that failed, or (after the
 * wait) one that faulted */
static int kernel_failed(const char *when) {
    if (failed(cudaGetLastError(), when)) return 1;
    return failed(cudaDeviceSynchronize(), when);
}

extern "C" void lab_pool_free(lab_pool *pool) {
    if (pool == NULL) return;
    for (int i = 0; i < 2; i++) {
        cudaFree(pool->codes[i]);
        cudaFree(pool->scales[i]);
    }
    cudaFree(pool->table);
    cudaFree(pool->q);
    cudaFree(pool->q_base);
    cudaFree(pool->outputs);
    cudaFree(pool->workspace);
    free(pool);
}

extern "C" lab_pool *lab_pool_new(int num_blocks, int n_kv_heads, int block_size, int head_dim,
                                  int group) {
    lab_pool *pool = (lab_pool *)calloc(1, sizeof *pool);
    if (pool == NULL) {
        snprintf(last_error, sizeof last_error, "no host memory for a pool");
        return NULL;
    }
    size_t rows = (size_t)num_blocks * n_kv_heads * block_size;
    pool->code_bytes = rows * head_dim;
    pool->scale_bytes = rows * (head_dim / group) * sizeof(float);
    for (int i = 0; i < 2; i++) {
        if (failed(cudaMalloc((void **)&pool->codes[i], pool->code_bytes), "allocating the pool") ||
            failed(cudaMalloc((void **)&pool->scales[i], pool->scale_bytes), "allocating the pool")) {
            lab_pool_free(pool);
            return NULL;
        }
    }
    kv_cache_view *v = &pool->view;
    v->key_codes = pool->codes[0];
    v->value_codes = pool->codes[1];
    v->key_scales = pool->scales[0];
    v->value_scales = pool->scales[1];
    v->block_size = block_size;
    v->n_kv_heads = n_kv_heads;
    v->head_dim = head_dim;
    v->group = group;
    return pool;
}

/* bytes [first, first + bytes) of array `which` (0 key codes, 1 key scales, 2 value codes,
 * 3 value scales) from the host */
extern "C" int lab_pool_put(lab_pool *pool, int which, size_t first, const void *host,
                            size_t bytes) {
    if (which < 0 || which > 3) {
        snprintf(last_error, sizeof last_error, "lab_pool_put: no array %d", which);
        return 1;
    }
    char *base = which % 2 == 0 ? (char *)pool->codes[which / 2] : (char *)pool->scales[which / 2];
    size_t size = which % 2 == 0 ? pool->code_bytes : pool->scale_bytes;
    if (first > size || bytes > size - first) {
        snprintf(last_error, sizeof last_error, "lab_pool_put: bytes outside the array");
        return 1;
    }
    return failed(cudaMemcpy(base + first, host, bytes, cudaMemcpyHostToDevice), "copying rows in");
}

/* grows a device buffer to `bytes` (its contents are not kept) */
static int reserve(void **buffer, size_t *capacity, size_t bytes, const char *what) {
    if (bytes <= *capacity) return 0;
    cudaFree(*buffer);
    *buffer = NULL;
    *capacity = 0;
    if (failed(cudaMalloc(buffer, bytes), what)) return 1;
    *capacity = bytes;
    return 0;
}

/* the call's view: its table, length and scale in place, and room for n_outputs results */
static int prepare(lab_pool *pool, const int32_t *table, int n_table, int length, float scale,
                   int n_heads, int n_outputs) {
    size_t query_bytes = (size_t)n_heads * pool->view.head_dim * sizeof(float);
    size_t workspace = KV_WORKSPACE_BYTES(n_heads, length);
    if (reserve((void **)&pool->table, &pool->table_bytes, (size_t)n_table * sizeof(int32_t), "a table") ||
        reserve((void **)&pool->q, &pool->q_bytes, query_bytes, "a query") ||
        reserve((void **)&pool->q_base, &pool->q_base_bytes, query_bytes, "a query") ||
        reserve((void **)&pool->outputs, &pool->outputs_bytes, (size_t)n_outputs * query_bytes, "outputs") ||
        reserve(&pool->workspace, &pool->workspace_bytes, workspace, "the workspace"))
        return 1;
    if (failed(cudaMemcpy(pool->table, table, (size_t)n_table * sizeof(int32_t),
                          cudaMemcpyHostToDevice), "copying the table in"))
        return 1;
    kv_cache_view *v = &pool->view;
    v->block_table = pool->table;
    v->length = length;
    v->scale = scale;
    v->workspace = pool->workspace;
    v->workspace_bytes = workspace;
    pool->n_outputs = n_outputs;
    /* NaN in every output, so that a value the kernel never writes shows */
    return failed(cudaMemset(pool->outputs, 0xff, (size_t)n_outputs * query_bytes), "clearing outputs");
}

/* q = q_base + out, one float32 addition each */
__global__ static void next_query(float *q, const float *q_base, const float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) q[i] = __fadd_rn(q_base[i], out[i]);
}

/* One call: out (host, n_heads * head_dim floats) = decode_attention of q (host). 1 when
 * the starter says it is not written, -1 with lab_error() on a CUDA error, else 0. */
extern "C" int lab_attend(lab_pool *pool, const float *q, const int32_t *table, int n_table,
                          int length, float scale, int n_heads, float *out) {
    size_t n = (size_t)n_heads * pool->view.head_dim;
    if (prepare(pool, table, n_table, length, scale, n_heads, 1) ||
        failed(cudaMemcpy(pool->q, q, n * sizeof(float), cudaMemcpyHostToDevice), "copying q in"))
        return -1;
    decode_kernel_not_written = 0;
    decode_attention(pool->outputs, pool->q, &pool->view, n_heads);
    if (decode_kernel_not_written) return 1;
    if (kernel_failed("your kernel")) return -1;
    return failed(cudaMemcpy(out, pool->outputs, n * sizeof(float), cudaMemcpyDeviceToHost),
                  "copying the output back") ? -1 : 0;
}

/* n_runs calls back to back on the device, call k's query q_base + call k-1's output (the
 * first's q); the outputs stay on the device (lab_outputs). Returns as lab_attend. */
extern "C" int lab_chain(lab_pool *pool, const float *q, const float *q_base, const int32_t *table,
                         int n_table, int length, float scale, int n_heads, int n_runs) {
    int n = n_heads * pool->view.head_dim;
    if (prepare(pool, table, n_table, length, scale, n_heads, n_runs) ||
        failed(cudaMemcpy(pool->q, q, n * sizeof(float), cudaMemcpyHostToDevice), "copying q in") ||
        failed(cudaMemcpy(pool->q_base, q_base, n * sizeof(float), cudaMemcpyHostToDevice),
               "copying q_base in"))
        return -1;
    decode_kernel_not_written = 0;
    for (int run = 0; run < n_runs; run++) {
        float *out = pool->outputs + (size_t)run * n;
        decode_attention(out, pool->q, &pool->view, n_heads);
        if (decode_kernel_not_written) return 1;
        next_query<<<(n + 255) / 256, 256>>>(pool->q, pool->q_base, out, n);
    }
    return kernel_failed("your kernel, in the chain of timed calls") ? -1 : 0;
}

/* outputs `indices` of the last chain, (n, n_heads * head_dim) floats, to the host */
extern "C" int lab_outputs(lab_pool *pool, const int *indices, int n, int n_heads, float *out) {
    size_t floats = (size_t)n_heads * pool->view.head_dim;
    for (int i = 0; i < n; i++) {
        if (indices[i] < 0 || indices[i] >= pool->n_outputs) {
            snprintf(last_error, sizeof last_error, "no output %d kept", indices[i]);
            return -1;
        }
        if (failed(cudaMemcpy(out + i * floats, pool->outputs + (size_t)indices[i] * floats,
                              floats * sizeof(float), cudaMemcpyDeviceToHost), "copying outputs back"))
            return -1;
    }
    return 0;
}
