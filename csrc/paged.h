/* paged.h: what the forward pass needs from the paged pool (internal to the core). */
#ifndef KVLAB_PAGED_H
#define KVLAB_PAGED_H

#include "attention.h"
#include "kvlab.h"

/* KV_OK if seq names a live sequence of this pool. */
kv_status kv_pool_seq_check(const kv_pool *pool, int seq);

/* Makes room for n_tokens more positions of seq: copies its last block first if it is
 * shared and partly filled (copy-on-write), then takes fresh blocks, evicting cached
 * ones when the free stack is empty. Either everything succeeds or nothing changes. */
kv_status kv_pool_reserve(kv_pool *pool, int seq, int n_tokens);

/* The view of one layer of seq that the forward pass reads and writes. */
kv_layer_view kv_pool_layer_view(const kv_pool *pool, int seq, int layer);

/* After the rows are written: records their tokens, advances the length, and offers
 * every block that just became full to the prefix cache. */
void kv_pool_commit(kv_pool *pool, int seq, const int32_t *tokens, int n_tokens);

#endif /* KVLAB_PAGED_H */
