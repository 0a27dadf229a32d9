/* bench.cu: timing on the GPU's own clock, for benchmarks/bench_gpu.py.
 *
 * A decode attention call over a small cache takes microseconds, too little to time from
 * Python (a host clock would mostly measure the launch and the copies). These functions
 * time with CUDA events recorded in the stream around `inner` back-to-back calls, and
 * report each of `repeats` runs, so that the caller can take the median. The yardstick is a
 * device-to-device copy measured in the same process: the bandwidth a plain streaming read
 * and write gets on this GPU, which is what decode attention, bound by its reads, should
 * come close to.
 */
#include "common.cuh"

extern "C" kv_cuda_err kv_cuda_time_copy(size_t bytes, int repeats, double *seconds) {
    kv_cuda_err err = 0;
    void *src = NULL, *dst = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    KV_CUDA_TRY(kv_cuda_alloc(&src, bytes));
    KV_CUDA_TRY(kv_cuda_alloc(&dst, bytes));
    KV_CUDA_TRY(cudaEventCreate(&start));
    KV_CUDA_TRY(cudaEventCreate(&stop));
    for (int i = 0; i < 2; i++) KV_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice));
    for (int r = 0; r < repeats; r++) {
        float ms = 0.0f;
        KV_CUDA_TRY(cudaEventRecord(start));
        KV_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice));
        KV_CUDA_TRY(cudaEventRecord(stop));
        KV_CUDA_TRY(cudaEventSynchronize(stop));
        KV_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
        seconds[r] = ms * 1e-3;
    }
fail:
    if (start != NULL) cudaEventDestroy(start);
    if (stop != NULL) cudaEventDestroy(stop);
    kv_cuda_free(src);
    kv_cuda_free(dst);
    return err;
}

extern "C" kv_cuda_err kv_cuda_time_attention(const kv_cuda_view *view, size_t rotation_stride,
                                              int n_rotations, float *out, const float *q,
                                              int n_queries, int n_heads, int max_seen,
                                              void *scratch, size_t scratch_bytes, int inner,
                                              int repeats, double *seconds) {
    kv_cuda_err err = 0;
    cudaEvent_t start = NULL, stop = NULL;
    kv_cuda_view turn = *view;
    size_t out_stride = (size_t)n_heads * view->key->head_dim;
    if (n_rotations < 1 || inner < 1) return KV_CUDA_INVALID_VALUE;
    KV_CUDA_TRY(cudaEventCreate(&start));
    KV_CUDA_TRY(cudaEventCreate(&stop));
    for (int j = 0; j < 2 * n_rotations; j++) {   /* warm-up: first launches load the module */
        turn.tables = view->tables + (size_t)(j % n_rotations) * rotation_stride;
        KV_CUDA_TRY(kv_cuda_attention(out, out_stride, q, out_stride, &turn, n_queries, n_heads,
                                      max_seen, scratch, scratch_bytes));
    }
    for (int r = 0; r < repeats; r++) {
        float ms = 0.0f;
        KV_CUDA_TRY(cudaEventRecord(start));
        for (int j = 0; j < inner; j++) {
            turn.tables = view->tables + (size_t)(j % n_rotations) * rotation_stride;
            KV_CUDA_TRY(kv_cuda_attention(out, out_stride, q, out_stride, &turn, n_queries,
                                          n_heads, max_seen, scratch, scratch_bytes));
        }
        KV_CUDA_TRY(cudaEventRecord(stop));
        KV_CUDA_TRY(cudaEventSynchronize(stop));
        KV_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
        seconds[r] = ms * 1e-3 / inner;
    }
fail:
    if (start != NULL) cudaEventDestroy(start);
    if (stop != NULL) cudaEventDestroy(stop);
    return err;
}
