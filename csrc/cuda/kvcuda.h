/* kvcuda.h: the C API of kvlab's CUDA backend (host functions; the kernels live in the .cu files).
 *
 * Plain C, no CUDA headers: the Python binding (_cuda.c) is built by the ordinary C compiler
 * and only calls these functions. Every pointer named "device" points into GPU memory.
 * Every function that can fail returns a kv_cuda_err, which is a cudaError_t value (0 is
 * success), so that the binding can raise an exception naming the CUDA error exactly.
 *
 * The layouts are the CPU core's (kvlab.h): a cache stores K and V in kv_stores whose codes
 * and scales live in device memory here, head-major (n_layers, n_kv_heads, slots, head_dim);
 * a contiguous cache is a paged one with a single block as long as the cache. Weights are
 * float32, as on the CPU, with Wq/Wk/Wv and W1/W3 of each layer stacked one after another so
 * that one matrix product computes all of them.
 *
 * What the GPU path supports: fp32, fp16, bf16 and int8 caches (K and V in the same format
 * and group size; int8 groups a multiple of 8), no residual window, head_dim a multiple of
 * 8 up to 256. kvlab/cuda.py checks these before anything reaches this layer.
 */
#ifndef KVLAB_CUDA_H
#define KVLAB_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvlab.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int kv_cuda_err;   /* a cudaError_t: 0 (cudaSuccess) or the error's number */

/* cudaErrorInvalidValue: what these functions return for arguments that make no sense */
#define KV_CUDA_INVALID_VALUE 1

/* Positions one attention thread block reads: the flash-decoding split. It is chosen from
 * the query's own length (attention.cu, split_positions), never from the batch around it,
 * so that a query's result depends on its context alone: about KV_CUDA_TARGET_SPLITS splits
 * of a multiple of 32 positions, at least KV_CUDA_MIN_SPLIT and at most KV_CUDA_MAX_SPLIT
 * positions each (longer contexts get more splits of KV_CUDA_MAX_SPLIT). */
#define KV_CUDA_MIN_SPLIT 32
#define KV_CUDA_MAX_SPLIT 256
#define KV_CUDA_TARGET_SPLITS 32
/* A grid has at most 65535 splits of a query: the longest context is this many positions. */
#define KV_CUDA_MAX_POSITIONS (KV_CUDA_MAX_SPLIT * 65535)
/* Largest head_dim the attention kernel handles (8 values per lane, 32 lanes). */
#define KV_CUDA_MAX_HEAD_DIM 256
/* Up to this many tokens a projection is a matrix-vector product (every weight read once
 * for all of them: a decode step's batch); more tokens go to the tiled matrix-matrix kernel. */
#define KV_CUDA_MATVEC_MAX_TOKENS 16

/* ---- the device ------------------------------------------------------------------------ */
const char *kv_cuda_error_name(kv_cuda_err err);     /* "cudaErrorMemoryAllocation" */
const char *kv_cuda_error_string(kv_cuda_err err);   /* "out of memory" */
kv_cuda_err kv_cuda_device_count(int *count);
/* The current device's name, compute capability, memory, and CUDA versions (as
 * 1000 * major + 10 * minor). */
kv_cuda_err kv_cuda_device_info(char *name, size_t name_size, int *major, int *minor,
                                size_t *total_memory, int *multiprocessors,
                                int *runtime_version, int *driver_version);
kv_cuda_err kv_cuda_synchronize(void);

/* ---- device memory ------------------------------------------------------------------------ */
kv_cuda_err kv_cuda_alloc(void **ptr, size_t bytes);   /* zero-filled; bytes 0 gives NULL */
void kv_cuda_free(void *ptr);                          /* accepts NULL */
kv_cuda_err kv_cuda_to_device(void *device, const void *host, size_t bytes);
kv_cuda_err kv_cuda_to_host(void *host, const void *device, size_t bytes);

/* ---- the cache's storage (store.cu) -------------------------------------------------------- */

/* A kv_store (kvlab.h) whose codes and scales are in device memory, zero-filled. The group
 * is already resolved (kvlab.quant.check_format): 0 for fp32/fp16/bf16, a multiple of 8
 * dividing head_dim for int8. */
kv_cuda_err kv_cuda_store_init(kv_store *store, kv_format format, int group, int n_layers,
                               size_t slots, int n_kv_heads, int head_dim);
void kv_cuda_store_free(kv_store *store);              /* accepts a zeroed store */
size_t kv_cuda_store_nbytes(const kv_store *store);

/* The cache write: row t of rows (device, n_kv_heads * head_dim floats at rows + t *
 * row_stride) quantized into slot slots[t] (device int64) of a layer; slot -1 skips the row
 * (it is already in the cache: a block shared with another sequence). */
kv_cuda_err kv_cuda_store_write(const kv_store *store, int layer, const float *rows,
                                size_t row_stride, const int64_t *slots, int n_rows);
/* Copies out the stored codes (and scales) of n_rows slots (device int64) for every layer:
 * codes (device) (n_layers, n_rows, n_kv_heads, head_bytes), scales (device, or NULL for
 * formats without) (n_layers, n_rows, n_kv_heads, groups_per_head). */
kv_cuda_err kv_cuda_store_read(const kv_store *store, const int64_t *slots, int n_rows,
                               uint8_t *codes, float *scales);
/* kv_cuda_store_read backwards: rows laid out as it gives them (device) stored as they are
 * into n_rows slots (device int64): a sequence swapped back in. */
kv_cuda_err kv_cuda_store_put(const kv_store *store, const int64_t *slots, int n_rows,
                              const uint8_t *codes, const float *scales);
/* Copies n_rows rows starting at slot src to slot dst, every layer and head (copy-on-write). */
kv_cuda_err kv_cuda_store_copy(const kv_store *store, size_t dst, size_t src, size_t n_rows);
/* Fills every slot with pseudo-random rows (benchmarks: never time zeros). */
kv_cuda_err kv_cuda_store_fill_random(const kv_store *store, uint64_t seed);

/* ---- attention (attention.cu) ---------------------------------------------------------------- */

/* Where one layer's K and V are, for a batch of queries: query i reads row query_table[i]
 * of tables (n_tables, max_blocks), and sees positions 0 .. query_seen[i] - 1, position pos
 * in slot tables[row][pos / block_size] * block_size + pos % block_size. All device arrays. */
typedef struct {
    const kv_store *key, *value;    /* host structs describing device memory */
    int layer;
    const int32_t *tables;
    int max_blocks, block_size;
    const int32_t *query_table;
    const int32_t *query_seen;
} kv_cuda_view;

/* Bytes of scratch one query's split results need (at least this much must be passed). */
size_t kv_cuda_attention_query_bytes(int n_heads, int head_dim, int max_seen);
/* out (device, n_queries rows of out_stride floats, n_heads * head_dim used) = attention of
 * q (device, rows of q_stride floats) over the view. max_seen >= every query_seen. The
 * scratch holds split results for as many queries as fit; more queries run in turns. */
kv_cuda_err kv_cuda_attention(float *out, size_t out_stride, const float *q, size_t q_stride,
                              const kv_cuda_view *view, int n_queries, int n_heads,
                              int max_seen, void *scratch, size_t scratch_bytes);

/* ---- the other ops, one .cu each (device pointers; row-major float32) ------------------------ */
kv_cuda_err kv_cuda_embedding(float *x, const float *table, const int32_t *tokens,
                              int n_tokens, int dim);
/* out row r = rmsnorm(x row rows[r]) * weight; rows NULL means rows[r] = r */
kv_cuda_err kv_cuda_rmsnorm(float *out, const float *x, const float *weight, const int32_t *rows,
                            int n_rows, int dim, float eps);
/* rotates the first n_heads heads of each of n_tokens rows (row_stride floats apart) */
kv_cuda_err kv_cuda_rope(float *x, size_t row_stride, const int32_t *positions,
                         const float *inv_freq, int n_tokens, int n_heads, int head_dim,
                         int interleaved);
/* out (n_tokens, out_dim) = x (n_tokens, in_dim) . w^T, w (out_dim, in_dim); with
 * accumulate, added to what out holds (the residual add). matvec: n_tokens <=
 * KV_CUDA_MATVEC_MAX_TOKENS; matmul: any n_tokens. */
kv_cuda_err kv_cuda_matvec(float *out, const float *x, const float *w, int n_tokens, int in_dim,
                           int out_dim, int accumulate);
kv_cuda_err kv_cuda_matmul(float *out, const float *x, const float *w, int n_tokens, int in_dim,
                           int out_dim, int accumulate);
/* out (n_tokens, hidden) = silu(gate) * up, gate_up rows (gate, up) of 2 * hidden floats */
kv_cuda_err kv_cuda_swiglu(float *out, const float *gate_up, int n_tokens, int hidden_dim);

/* ---- the model (forward.cu) ------------------------------------------------------------------- */

typedef struct {
    kv_config config;
    float *token_embedding;  /* (vocab_size, dim) */
    float *attn_norm;        /* (n_layers, dim) */
    float *wqkv;             /* (n_layers, q_dim + 2 * kv_dim, dim): Wq, Wk, Wv stacked */
    float *wo;               /* (n_layers, dim, q_dim) */
    float *ffn_norm;         /* (n_layers, dim) */
    float *w13;              /* (n_layers, 2 * hidden_dim, dim): W1 (gate), then W3 (up) */
    float *w2;               /* (n_layers, dim, hidden_dim) */
    float *final_norm;       /* (dim,) */
    float *classifier;       /* (vocab_size, dim); token_embedding itself when tied */
    float *rope_inv_freq;    /* (head_dim / 2,) */
    size_t weight_bytes;
    /* activations and call arguments, grown as calls need (see forward.cu) */
    void *work;
    size_t work_bytes;
    int cap_tokens, cap_runs, cap_blocks, cap_seen, cap_logits;
} kv_cuda_model;

/* Copies a CPU model's weights (host pointers, kvlab.h) to the device. */
kv_cuda_err kv_cuda_model_init(kv_cuda_model *model, const kv_model *host);
void kv_cuda_model_free(kv_cuda_model *model);   /* accepts a zeroed or half-built model */

/* One forward call, as kv_model_forward_batch on the CPU: n_runs sequences, run r with
 * run_tokens[r] new tokens at positions run_start[r].., their ids one run after another
 * in tokens. All arrays here are host memory. */
typedef struct {
    int n_tokens;               /* all runs together */
    const int32_t *tokens;      /* (n_tokens,) */
    int n_runs;
    const int32_t *run_tokens;  /* (n_runs,) */
    const int32_t *run_start;   /* (n_runs,) */
    const int32_t *tables;      /* (n_runs, max_blocks) each run's block table */
    int max_blocks, block_size;
    const int64_t *write_slots; /* (n_tokens,) where each new row goes; -1: already cached */
    int all_logits;             /* logits of every token, else of each run's last token */
} kv_cuda_batch;

/* Makes sure the device scratch holds a call of this size (the one step that may run out
 * of memory): n_logits rows of logits are wanted (n_runs, or n_tokens with all_logits);
 * kv_cuda_forward on a batch no larger then allocates nothing. */
kv_cuda_err kv_cuda_model_reserve(kv_cuda_model *model, int n_tokens, int n_runs, int max_blocks,
                                  int max_seen, int n_logits);
/* The forward pass: writes every new token's K and V into the stores and logits (host)
 * (n_tokens or n_runs rows of vocab_size floats). The caller has checked every id, slot
 * and block (the binding does). Returns once the logits are on the host. */
kv_cuda_err kv_cuda_forward(kv_cuda_model *model, const kv_store *key, const kv_store *value,
                            const kv_cuda_batch *batch, float *logits);

/* ---- measuring (bench.cu) ------------------------------------------------------------------- */

/* seconds[i] = time of one device-to-device copy of `bytes` bytes, over `repeats` runs. */
kv_cuda_err kv_cuda_time_copy(size_t bytes, int repeats, double *seconds);
/* seconds[i] = time of one attention call (split and merge kernels) over the view, the
 * average of `inner` calls, for `repeats` runs. Call j reads tables + (j % n_rotations) *
 * rotation_stride, so that rotating over disjoint parts of a large store keeps the
 * measurement out of the L2 cache. */
kv_cuda_err kv_cuda_time_attention(const kv_cuda_view *view, size_t rotation_stride,
                                   int n_rotations, float *out, const float *q, int n_queries,
                                   int n_heads, int max_seen, void *scratch,
                                   size_t scratch_bytes, int inner, int repeats,
                                   double *seconds);

#ifdef __cplusplus
}
#endif

#endif /* KVLAB_CUDA_H */
