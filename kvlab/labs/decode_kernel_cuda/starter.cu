/* Lab 14 on a GPU: a decode-attention kernel in CUDA over a paged int8 cache, at the
 * memory's speed.
 *
 * Write decode_attention below (decode_kernel_cuda.cuh says what it receives; the README
 * says what it must compute, bit for bit, and how fast). It runs on the host and launches
 * kernels of yours; every pointer it is given but `view` is device memory. Until you write
 * it, it says it is not written yet.
 *
 * Check your work:  kvlab check decode_kernel_cuda decode_kernel_cuda.cu   (needs an NVIDIA GPU)
 * Your grade:       kvlab grade decode_kernel_cuda decode_kernel_cuda.cu
 * The grader builds this file with nvcc for the GPU present, --fmad=false (so a * b + c is
 * a multiply and an add, two roundings, as kvlab's CPU build rounds it) and
 * -DKVLAB_FMA=0 or 1 (whether kv_madd fuses, as kvlab's CPU kernels do), against its own
 * copy of decode_kernel_cuda.cuh. The README ("Building it yourself") gives the command.
 */
#include "decode_kernel_cuda.cuh"

extern "C" void decode_attention(float *out, const float *q, const kv_cache_view *view,
                                 int n_heads) {
    /* TODO: kernels of your own, launched here on the default stream: for each query head
     * h (KV head h / (n_heads / view->n_kv_heads)):
     *   score every position's key (its int8 codes times their group's scale) against q's
     *   row h, in eight lanes, times view->scale;
     *   take the online softmax's steps tile by tile (16 positions from position 0);
     *   add the values in, position by position, and divide by the softmax's sum.
     * view->workspace is device memory for your scores and weights. */
    NOT_WRITTEN();
}
