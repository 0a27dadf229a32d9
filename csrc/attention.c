/* attention.c: causal grouped-query attention (MHA, GQA and MQA are one code path).
 *
 * Query head h reads key/value head h / kv_mul, where kv_mul = n_heads / n_kv_heads:
 * with kv_mul = 1 that is multi-head attention, with n_kv_heads = 1 multi-query.
 * Every (token, head) pair is computed the same way whether it arrives in a prefill
 * batch or alone in a decode step, so the cached and uncached paths agree bit for bit.
 */
#include <math.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "ops.h"

void kv_attention(float *out, const float *q, const float *key_layer,
                  const float *value_layer, int n_tokens, int start_pos, int n_heads,
                  int n_kv_heads, int head_dim, float *scores, int score_stride) {
    int kv_mul = n_heads / n_kv_heads;
    int q_dim = n_heads * head_dim;
    int kv_dim = n_kv_heads * head_dim;
    float scale = 1.0f / sqrtf((float)head_dim);

    #pragma omp parallel for collapse(2) schedule(static) if (n_tokens * n_heads > 1)
    for (int t = 0; t < n_tokens; t++) {
        for (int h = 0; h < n_heads; h++) {
            int pos = start_pos + t;
            int kv_head = h / kv_mul;
            const float *query = q + (size_t)t * q_dim + (size_t)h * head_dim;
            float *att = scores + (size_t)omp_get_thread_num() * score_stride;

            /* how well this query matches every earlier key (and its own) */
            for (int j = 0; j <= pos; j++) {
                const float *key = key_layer + (size_t)j * kv_dim + (size_t)kv_head * head_dim;
                att[j] = kv_dot(query, key, head_dim) * scale;
            }
            kv_softmax(att, pos + 1);

            /* the weighted mix of their values */
            float *result = out + (size_t)t * q_dim + (size_t)h * head_dim;
            memset(result, 0, (size_t)head_dim * sizeof(float));
            for (int j = 0; j <= pos; j++) {
                const float *value = value_layer + (size_t)j * kv_dim + (size_t)kv_head * head_dim;
                kv_axpy(result, att[j], value, head_dim);
            }
        }
    }
}
