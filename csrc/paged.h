/* paged.h: what the forward pass and swapping need from the paged pool (internal to the
 * core; the binding's views of a row store's rows use kv_pool_host_rows too). */
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

/* Host kv_stores of n slots (n >= 1) in the pool's formats, laid out one after another from
 * `at`: K's codes, scales and zero points, then V's, each (n_layers, n_kv_heads, n, ...),
 * packed (the layout of a swapped-out sequence's rows, swap.c). Returns the bytes they
 * take; with `at` NULL it only counts them, and key or value may be NULL. What a row
 * store's rows are copied into, and out of. */
size_t kv_pool_host_rows(const kv_pool *pool, int n, uint8_t *at, kv_store *key,
                         kv_store *value);

#endif /* KVLAB_PAGED_H */
