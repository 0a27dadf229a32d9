/* Lab 14: a decode-attention kernel in C over a paged int8 cache, at the memory's speed.
 *
 * Write decode_attention below (decode_kernel.h says what it receives; the README says
 * what it must compute, bit for bit, and how fast). Until you do, it says it is not
 * written yet.
 *
 * Check your work:  kvlab check decode_kernel decode_kernel.c   (the public checks)
 * Your grade:       kvlab grade decode_kernel decode_kernel.c   (your course runs hidden tests)
 * The grader builds this file with kvlab's own compiler flags (-O3, -ffp-contract=off,
 * OpenMP where the compiler has it) plus the -m flags of the kernel variant kvlab runs on
 * this CPU (`kvlab info` names it), against its own copy of decode_kernel.h. Those flags
 * decide whether multiply-adds are fused, and so the bits: "Which flags" in the README
 * (section "Checking, building, grading") gives the exact command for your machine.
 */
#include "decode_kernel.h"

void decode_attention(float *out, const float *q, const kv_cache_view *view, int n_heads,
                      int n_threads) {
    /* TODO: for each query head h (KV head h / (n_heads / view->n_kv_heads)):
     *   walk positions 0 .. view->length - 1 in tiles of 16, through view->block_table;
     *   score each key (its int8 codes times their group's scale) against q's row h,
     *   take the tile's online-softmax step, add the tile's values in;
     *   divide by the softmax's sum at the end. */
    NOT_WRITTEN();
}
