/* sampling.h: choosing the next token from a row of logits, in C, so that a generation
 * loop can run without returning to Python between tokens (kvlab/sampling.py calls the
 * same function; kvlab.reference.sample is its NumPy twin). */
#ifndef KVLAB_SAMPLING_H
#define KVLAB_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

#include "kvlab.h"   /* kv_sampling */

/* Working memory kv_sample needs for a vocabulary of n: doubles, then int32s. */
size_t kv_sample_scratch_bytes(int n);

/* The token chosen from logits (n values) with the uniform number u in [0, 1): the first
 * token whose cumulative probability, in token order, exceeds u (inverse transform
 * sampling, as numpy's Generator.choice draws). scratch: kv_sample_scratch_bytes(n)
 * bytes, 8-byte aligned. Greedy ignores u and scratch and returns kv_argmax's choice, or -1
 * if a logit is NaN. When sampling, returns -1 if the probabilities are not numbers (a NaN
 * logit, or every logit -inf). */
int kv_sample(const float *logits, int n, const kv_sampling *how, double u, void *scratch);

#endif /* KVLAB_SAMPLING_H */
