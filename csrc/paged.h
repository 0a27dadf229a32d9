/* paged.h: what the forward pass needs from the paged pool (internal to the core). */
#ifndef KVLAB_PAGED_H
#define KVLAB_PAGED_H

#include "attention.h"
#include "kvlab.h"

/* Makes room for n_tokens more positions of seq (kv_blocks_reserve) and performs the
 * copy-on-write it asks for on the stores. Either everything succeeds or nothing changes.
 * After the rows are written, kv_blocks_commit(&pool->blocks, ...) records them. */
kv_status kv_pool_reserve(kv_pool *pool, int seq, int n_tokens);

/* After kv_blocks_commit of n_tokens rows of seq: writes down their positions if the
 * sequence dropped rows before (kv_pool_keep), so that rows and positions stay paired. */
void kv_pool_note_positions(kv_pool *pool, int seq, int n_tokens);

/* The view of one layer of seq that the forward pass reads and writes. */
kv_layer_view kv_pool_layer_view(const kv_pool *pool, int seq, int layer);

#endif /* KVLAB_PAGED_H */
