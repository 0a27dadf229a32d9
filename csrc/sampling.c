/* sampling.c: temperature, top-k and top-p (nucleus) sampling of one token.
 *
 * Everything is computed in double, in the same steps as kvlab.reference.sample in NumPy
 * (whose sums are pairwise, so a total can differ in its last bit): scale by the temperature, drop what is below the k-th largest (ties with it are
 * kept), exponentiate against the max, normalize, keep the smallest most-likely set that
 * reaches top_p, normalize again, then walk the cumulative sum in token order until it
 * passes u. The random number comes from the caller, so that Python owns the generator
 * and a seed reproduces a run whichever side draws the token.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "sampling.h"

/* a token and its probability, for sorting by probability */
typedef struct {
    double probability;
    int32_t token;
} ranked_token;

size_t kv_sample_scratch_bytes(int n) {
    return (size_t)n * (2 * sizeof(double) + sizeof(ranked_token));
}

/* The k-th largest of n values (1 <= k <= n), found by partitioning `work` (a copy). */
static double kth_largest(double *work, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;   /* index of the answer in descending order */
    while (lo < hi) {
        double pivot = work[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {   /* larger values to the left, smaller to the right */
            while (work[i] > pivot) i++;
            while (work[j] < pivot) j--;
            if (i <= j) {
                double swap = work[i];
                work[i++] = work[j];
                work[j--] = swap;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return work[want];
    }
    return work[want];
}

/* order of tokens for top-p: most likely first, the lower id first among equals (what a
 * stable sort of the negated probabilities gives) */
static int by_probability(const void *a, const void *b) {
    const ranked_token *x = a, *y = b;
    if (x->probability != y->probability) return x->probability > y->probability ? -1 : 1;
    return (x->token > y->token) - (x->token < y->token);
}

int kv_sample(const float *logits, int n, const kv_sampling *how, double u, void *scratch) {
    if (how->temperature == 0.0) {
        /* greedy: the arg-max, unless a NaN makes "the largest" meaningless (numpy.argmax
         * would pick the NaN's index, and a loop would then repeat it forever) */
        for (int i = 0; i < n; i++)
            if (logits[i] != logits[i]) return -1;
        return kv_argmax(logits, n);
    }
    double *probs = scratch, *work = probs + n;
    ranked_token *order = (ranked_token *)(work + n);
    double max = -INFINITY;
    for (int i = 0; i < n; i++) {
        probs[i] = (double)logits[i] / how->temperature;
        if (probs[i] != probs[i]) return -1;
        if (probs[i] > max) max = probs[i];
    }
    if (how->top_k > 0 && how->top_k < n) {
        memcpy(work, probs, (size_t)n * sizeof(double));
        double threshold = kth_largest(work, n, how->top_k);
        for (int i = 0; i < n; i++)
            if (probs[i] < threshold) probs[i] = -INFINITY;
    }
    if (max == -INFINITY) return -1;
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        probs[i] = exp(probs[i] - max);
        total += probs[i];
    }
    if (!(total > 0.0) || total == INFINITY) return -1;
    for (int i = 0; i < n; i++) probs[i] /= total;
    if (how->top_p < 1.0) {
        /* keep the smallest set of most likely tokens whose probability reaches top_p */
        for (int i = 0; i < n; i++) order[i] = (ranked_token){probs[i], i};
        qsort(order, (size_t)n, sizeof *order, by_probability);
        double cumulative = 0.0;
        int keep = 0;
        while (keep < n - 1 && cumulative + order[keep].probability < how->top_p)
            cumulative += order[keep++].probability;
        keep++;   /* the token that reaches top_p is kept too */
        for (int i = 0; i < n; i++) work[i] = 0.0;
        for (int r = 0; r < keep; r++) work[order[r].token] = order[r].probability;
        double kept = 0.0;
        for (int i = 0; i < n; i++) kept += work[i];
        for (int i = 0; i < n; i++) probs[i] = work[i] / kept;
    }
    /* inverse transform: the first token whose cumulative probability exceeds u */
    double cumulative = 0.0;
    for (int i = 0; i < n; i++) probs[i] = (cumulative += probs[i]);
    for (int i = 0; i < n; i++)
        if (probs[i] / cumulative > u) return i;
    return n - 1;
}
