/* pool.c: PagedPool, the paged pool (kv_pool): a BlockManager (blocks.c), whose methods it
 * inherits, with the C core's K/V stores behind its blocks, or a row store (store=...: the
 * GPU's memory, row_store.c) whose rows the same code keeps the books of.
 *
 * What is a pool's own: its rows (key_codes ... value_zeros, append, gather, swap_out and
 * swap_in) and its format. BlockManager's fork copies a pool sequence's residual-window
 * rows too, and its reserve() and commit() refuse a pool: the forward pass and append()
 * write the rows between the two.
 */
#include "binding.h"

#include "common.h"     /* kv_ceil_div */

int kv_py_pool_ready(PoolObject *self) {
    if (kv_py_blocks_ready(&self->base) < 0) return -1;
    if (self->pool.key.n_layers == 0) {
        PyErr_SetString(PyExc_RuntimeError, "PagedPool was not initialized");
        return -1;
    }
    return 0;
}

PoolObject *kv_py_pool_of(PyObject *obj, int *seq) {
    BlocksObject *owner = ((SequenceObject *)obj)->owner;
    if (!PyObject_TypeCheck((PyObject *)owner, &kv_py_pool_type) ||
        ((PoolObject *)owner)->pool.row_store != NULL) {
        PyErr_Format(PyExc_TypeError, "this sequence's pool (%s) keeps no K and V in host "
                     "memory: run it with the model that made the pool",
                     Py_TYPE(owner)->tp_name);
        return NULL;
    }
    PoolObject *pool = (PoolObject *)owner;
    if (kv_py_pool_ready(pool) < 0 || (*seq = kv_py_sequence_slot(owner, obj)) < 0) return NULL;
    return pool;
}

PyObject *kv_py_pool_refused(const PoolObject *pool, kv_status status, int n_tokens,
                             const kv_config *model) {
    const kv_pool *p = &pool->pool;
    if (status == KV_ERR_CACHE_MISMATCH && model != NULL)
        return kv_py_raise(status, "this pool holds %d layers x %d KV heads x %d, but the "
                           "model needs %d x %d x %d", p->n_layers, p->n_kv_heads, p->head_dim,
                           model->n_layers, model->n_kv_heads, model->head_dim);
    return kv_py_blocks_refused(&pool->base, status, n_tokens);
}

/* ---- life -------------------------------------------------------------------------- */

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PoolObject *self = (PoolObject *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->base.blocks = &self->pool.blocks;
    return (PyObject *)self;
}

static int pool_init(PoolObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "num_blocks", "block_size",
                             "max_seqs", "max_blocks_per_seq", "hash_bits", "key_format",
                             "value_format", "key_group", "value_group", "window",
                             "prefix_cache", "store", NULL};
    int n_layers, n_kv_heads, head_dim, num_blocks, block_size, max_seqs = 256;
    int max_blocks_per_seq = 0, hash_bits = 64, key_group = 0, value_group = 0, window = 0;
    int prefix_cache = 1;
    const char *key_name = "fp32", *value_name = "fp32";
    PyObject *store = Py_None;
    if (kv_py_int_arguments(args, kwds, "iiiii|iiissiiipO", kwlist) < 0) return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiiii|iiissiiipO", kwlist, &n_layers,
                                     &n_kv_heads, &head_dim, &num_blocks, &block_size, &max_seqs,
                                     &max_blocks_per_seq, &hash_bits, &key_name, &value_name,
                                     &key_group, &value_group, &window, &prefix_cache, &store))
        return -1;
    if (self->pool.key.n_layers != 0) {
        /* re-initializing would free memory that existing views and handles still show */
        PyErr_SetString(PyExc_RuntimeError, "PagedPool is already initialized");
        return -1;
    }
    /* the binding's own knob (tests narrow hashes) */
    if (kv_py_int_in("hash_bits", hash_bits, 1, 64, NULL) < 0) return -1;
    if (max_blocks_per_seq == 0) max_blocks_per_seq = num_blocks;
    kv_cache_format format;
    if (kv_py_make_format(&format, key_name, value_name, key_group, value_group, window) < 0)
        return -1;
    if (store != Py_None && kv_py_row_store_init(self, store, &format) < 0) return -1;
    /* the core checks every number; on refusal it leaves the pool zeroed */
    kv_status status = kv_pool_init_with_store(&self->pool, n_layers, n_kv_heads, head_dim,
                                               num_blocks, block_size, max_seqs,
                                               max_blocks_per_seq, &format,
                                               self->store ? &self->row_store : NULL);
    if (status == KV_OK) {
        if (hash_bits < 64) self->pool.blocks.hash_mask = ((uint64_t)1 << hash_bits) - 1;
        if (!prefix_cache) self->pool.blocks.prefix_cache = 0;   /* a window turned it off */
        return 0;
    }
    if (status != KV_ERR_INVALID_ARG)
        kv_py_raise(status, NULL);
    else if (!kv_py_group_refused(&format, head_dim))
        kv_py_raise(status, "PagedPool(n_layers=%d, n_kv_heads=%d, head_dim=%d, num_blocks=%d, "
                    "block_size=%d, max_seqs=%d, max_blocks_per_seq=%d, window=%d) is refused: "
                    "sizes must be positive, " KV_PY_BLOCKS_LIMITS " (" KV_PY_STORE_LIMITS
                    ") and the window between 0 and 2**20", n_layers, n_kv_heads, head_dim,
                    num_blocks, block_size, max_seqs, max_blocks_per_seq, window);
    return -1;
}

/* The pool takes part in garbage collection for its store: a store written in Python that
 * keeps a reference to its pool makes a cycle (pool -> store -> pool) that the collector
 * can only free if it sees the pool's side. No tp_clear: the store's own __dict__ (or a
 * Python subclass's) is what the collector clears, so the pool's rows never lose their store
 * while the pool can still be called. */
static int pool_traverse(PoolObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->store);
    return 0;
}

static void pool_dealloc(PoolObject *self) {
    PyObject_GC_UnTrack(self);
    kv_pool_free(&self->pool);
    Py_CLEAR(self->store);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- views and attributes ---------------------------------------------------------- */

/* key_codes, key_scales, ... value_zeros of the whole pool: closure = KV_PY_PART(is_value,
 * part). The memory is head-major (n_layers, n_kv_heads, num_blocks, block_size, ...);
 * shown block-first, so that key_codes[b] is everything block b holds. A row store's rows
 * are copied to the host first, into the same layout: the view is then of the copy. */
static PyObject *pool_get_part(PoolObject *self, void *closure) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int which = (int)(intptr_t)closure;
    const kv_pool *p = &self->pool;
    int num_blocks = p->blocks.num_blocks, block_size = p->blocks.block_size;
    npy_intp lead_dims[3] = {num_blocks, p->n_layers, block_size};
    npy_intp slots = (npy_intp)num_blocks * block_size;
    npy_intp lead_strides[3] = {block_size, (npy_intp)p->n_kv_heads * slots, 1};
    PyObject *owner = (PyObject *)self;
    kv_store copies[2] = {p->key, p->value};
    if (p->row_store != NULL && (owner = kv_py_row_store_copy(self, &copies[0], &copies[1])) == NULL)
        return NULL;
    PyObject *view = kv_py_store_view(owner, &copies[which >> 2], which & 3, 3, lead_dims,
                                      lead_strides);
    if (p->row_store != NULL) Py_DECREF(owner);
    return view;
}

/* closure NULL: the keys' attribute; non-NULL: the values' */
static PyObject *pool_get_format(PoolObject *self, void *closure) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    return kv_py_format_name((closure ? &self->pool.value : &self->pool.key)->format);
}

/* key_dtype and value_dtype: the old names of key_format and value_format, one release */
static PyObject *pool_get_old_format(PoolObject *self, void *closure) {
    if (kv_py_warn_renamed(closure ? "PagedPool.value_dtype" : "PagedPool.key_dtype",
                           closure ? "PagedPool.value_format" : "PagedPool.key_format") < 0)
        return NULL;
    return pool_get_format(self, closure);
}

static PyObject *pool_get_group(PoolObject *self, void *closure) {
    return PyLong_FromLong((closure ? &self->pool.value : &self->pool.key)->group);
}

#define POOL_INT_GETTER(name, expr)                                        \
    static PyObject *pool_get_##name(PoolObject *self, void *closure) {    \
        return PyLong_FromLongLong((long long)(expr));                     \
    }
POOL_INT_GETTER(nbytes, self->pool.key.n_layers ? kv_pool_nbytes(&self->pool) : 0)
POOL_INT_GETTER(window, self->pool.window)
/* "cpu", or "cuda" for a pool whose rows a row store holds (the only one kvlab makes is the
 * GPU's, kvlab.cuda.CudaPagedPool; the tests' NumPy stand-in plays it) */
static PyObject *pool_get_device(PoolObject *self, void *closure) {
    return PyUnicode_FromString(self->pool.row_store ? "cuda" : "cpu");
}

POOL_INT_GETTER(n_layers, self->pool.n_layers)
POOL_INT_GETTER(n_kv_heads, self->pool.n_kv_heads)
POOL_INT_GETTER(head_dim, self->pool.head_dim)

/* ---- methods ----------------------------------------------------------------------- */

static const kv_py_array_spec token_ids = {.name = "tokens", .type = NPY_INT32, .ndim = 1,
                                           .shape = {KV_PY_ANY}, .axes = "n_tokens"};

static PyObject *pool_append(PoolObject *self, PyObject *args) {
    PyObject *seq_obj, *tokens_obj, *keys_obj, *values_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &seq_obj, &tokens_obj, &keys_obj, &values_obj))
        return NULL;
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(&self->base, seq_obj);
    if (seq < 0) return NULL;
    PyArrayObject *tokens = kv_py_array(tokens_obj, &token_ids);
    if (tokens == NULL) return NULL;
    int n = (int)PyArray_DIM(tokens, 0);
    const kv_pool *p = &self->pool;
    kv_py_array_spec rows = {.name = "keys", .type = NPY_FLOAT32, .ndim = 4,
                             .shape = {n, p->n_layers, p->n_kv_heads, p->head_dim},
                             .axes = "n_tokens,n_layers,n_kv_heads,head_dim"};
    PyArrayObject *keys = kv_py_array(keys_obj, &rows);
    if (keys == NULL) return NULL;
    rows.name = "values";
    PyArrayObject *values = kv_py_array(values_obj, &rows);
    if (values == NULL) return NULL;
    kv_status status = kv_pool_append(&self->pool, seq, (const int32_t *)PyArray_DATA(tokens), n,
                                      (const float *)PyArray_DATA(keys),
                                      (const float *)PyArray_DATA(values));
    if (status == KV_OK) Py_RETURN_NONE;
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "tokens must not be empty, and a sequence holds at most "
                           "2**30 positions (got %d new tokens)", n);
    return kv_py_pool_refused(self, status, n, NULL);
}

static PyObject *pool_gather(PoolObject *self, PyObject *arg) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(&self->base, arg);
    if (seq < 0) return NULL;
    const kv_pool *p = &self->pool;
    npy_intp dims[4] = {p->n_layers, p->blocks.seqs[seq].length, p->n_kv_heads, p->head_dim};
    PyObject *keys = PyArray_SimpleNew(4, dims, NPY_FLOAT32);
    PyObject *values = keys ? PyArray_SimpleNew(4, dims, NPY_FLOAT32) : NULL;
    if (values == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    kv_status status = kv_pool_gather(p, seq, (float *)PyArray_DATA((PyArrayObject *)keys),
                                      (float *)PyArray_DATA((PyArrayObject *)values));
    if (status == KV_OK) return Py_BuildValue("(NN)", keys, values);
    Py_DECREF(keys);   /* only a row store fails, or memory for its copy */
    Py_DECREF(values);
    return kv_py_pool_refused(self, status, 0, NULL);
}

static PyObject *pool_positions(PoolObject *self, PyObject *arg) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(&self->base, arg);
    if (seq < 0) return NULL;
    const kv_pool *p = &self->pool;
    npy_intp dims[3] = {p->n_layers, p->blocks.seqs[seq].length, p->n_kv_heads};
    PyObject *positions = PyArray_SimpleNew(3, dims, NPY_INT32);
    if (positions == NULL) return NULL;
    for (int layer = 0; layer < dims[0]; layer++)
        for (int row = 0; row < dims[1]; row++)
            for (int head = 0; head < dims[2]; head++)
                *(int32_t *)PyArray_GETPTR3((PyArrayObject *)positions, layer, row, head) =
                    kv_pool_position(p, seq, layer, head, row);
    return positions;
}

static PyObject *pool_keep(PoolObject *self, PyObject *args) {
    PyObject *handle, *rows_obj;
    if (!PyArg_ParseTuple(args, "OO", &handle, &rows_obj)) return NULL;
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(&self->base, handle);
    if (seq < 0) return NULL;
    kv_pool *p = &self->pool;
    const kv_seq *q = &p->blocks.seqs[seq];
    if (p->window > 0)
        return kv_py_raise(KV_ERR_INVALID_ARG, "keep(): a pool with a residual window cannot "
                           "drop rows: its full-precision rows are kept by position");
    if (p->row_store != NULL)
        return kv_py_raise(KV_ERR_INVALID_ARG, "keep(): this pool's rows are in GPU memory, "
                           "whose forward pass reads row i as position i: it cannot drop rows");
    PyArrayObject *rows = kv_py_rows_to_keep(rows_obj, p->n_layers, p->n_kv_heads);
    if (rows == NULL) return NULL;
    int n_keep = (int)PyArray_DIM(rows, 1);
    kv_status status = kv_pool_keep(p, seq, n_keep, (const int32_t *)PyArray_DATA(rows));
    if (status == KV_OK) Py_RETURN_NONE;
    if (status == KV_ERR_INVALID_ARG) {
        for (int i = 0; i < q->n_blocks; i++)
            if (p->blocks.ref_count[q->block_table[i]] != 1)
                return kv_py_raise(status, "keep(): block %d of this sequence is shared (a fork "
                                   "or a prefix found in the cache): its rows are another "
                                   "sequence's too, so they cannot be moved", q->block_table[i]);
        return kv_py_raise(status, "keep(seq, rows): rows[layer, :, head] must be strictly "
                           "increasing row numbers below the length %d (got %d rows to keep)",
                           q->length, n_keep);
    }
    return kv_py_pool_refused(self, status, 0, NULL);
}

/* ---- swapping a sequence to host memory and back (csrc/swap.c) ----------------------- */

/* A swap copies a sequence's K and V, as many bytes as the sequence holds (hundreds of
 * megabytes for a long one of a large model), so it runs without the GIL, the pool marked
 * busy meanwhile as for a forward pass. */

/* The slot of sequence `arg` and the bytes its host copy takes; -1 with the exception set
 * for a sequence that cannot be swapped out now. */
static int swap_size_of(PoolObject *self, PyObject *arg, int *seq, size_t *size) {
    if (kv_py_pool_ready(self) < 0) return -1;
    *seq = kv_py_sequence_slot(&self->base, arg);
    if (*seq < 0) return -1;
    kv_status status = kv_pool_swap_size(&self->pool, *seq, size);
    if (status == KV_OK) return 0;
    kv_py_pool_refused(self, status, 0, NULL);
    return -1;
}

static PyObject *pool_swap_nbytes(PoolObject *self, PyObject *arg) {
    int seq;
    size_t size;
    return swap_size_of(self, arg, &seq, &size) < 0 ? NULL : PyLong_FromSize_t(size);
}

static PyObject *pool_swap_out(PoolObject *self, PyObject *arg) {
    int seq;
    size_t size;
    if (swap_size_of(self, arg, &seq, &size) < 0) return NULL;
    kv_status status;
    npy_intp dims[1] = {(npy_intp)size};
    /* made before the swap, so that the sequence is freed only once its copy has a home */
    PyObject *host = PyArray_SimpleNew(1, dims, NPY_UINT8);
    if (host == NULL) return NULL;
    void *data = PyArray_DATA((PyArrayObject *)host);
    self->base.busy = 1;
    Py_BEGIN_ALLOW_THREADS
    status = kv_pool_swap_out(&self->pool, seq, data, size);
    Py_END_ALLOW_THREADS
    self->base.busy = 0;
    if (status == KV_OK) return host;
    Py_DECREF(host);
    return kv_py_pool_refused(self, status, 0, NULL);
}

static PyObject *pool_swap_in(PoolObject *self, PyObject *arg) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    /* a long sequence of a large model is gigabytes: its size goes to the core as size_t */
    static const kv_py_array_spec bytes = {.name = "host", .type = NPY_UINT8, .ndim = 1,
                                           .shape = {KV_PY_ANY}, .axes = "nbytes",
                                           .flags = KV_PY_SIZE_T_AXES};
    PyArrayObject *host = kv_py_array(arg, &bytes);
    if (host == NULL) return NULL;
    const kv_blocks *p = &self->pool.blocks;
    const void *data = PyArray_DATA(host);
    size_t size = (size_t)PyArray_NBYTES(host);
    int seq;
    kv_status status;
    /* the array stays alive (its caller holds it); the core copies what it checks before
     * it checks it, so another thread writing into it meanwhile cannot get past a check */
    self->base.busy = 1;
    Py_BEGIN_ALLOW_THREADS
    status = kv_pool_swap_in(&self->pool, data, size, &seq);
    Py_END_ALLOW_THREADS
    self->base.busy = 0;
    /* the header's length, for the messages: the core refuses for room only after checking
     * the header */
    int length = kv_swap_length(data, size);
    int needed = length < 0 ? 0 : (int)kv_ceil_div(length, p->block_size);
    switch (status) {
        case KV_OK: return kv_py_new_sequence_handle(&self->base, seq);
        case KV_ERR_INVALID_ARG:
            return kv_py_raise(status, "swap_in: these %zd bytes are not a sequence that "
                               "swap_out copied out of a pool: their header, size or row "
                               "positions are not ones a swap-out writes",
                               (Py_ssize_t)size);
        case KV_ERR_CACHE_MISMATCH:
            return kv_py_raise(status, "swap_in: this sequence was swapped out of a pool of "
                               "another shape or cache format (layers, KV heads, head_dim, "
                               "key and value formats and groups, and window must all match)");
        case KV_ERR_OUT_OF_BLOCKS:
            return kv_py_raise(status, "swap_in of a sequence of %d tokens needs %d blocks of "
                               "%d; the pool has %d free or cached of %d; the pool is "
                               "unchanged", length, needed, p->block_size,
                               p->n_free + p->n_cached, p->num_blocks);
        case KV_ERR_TABLE_FULL:
            return kv_py_raise(status, "swap_in of a sequence of %d tokens needs %d blocks of "
                               "%d, more than a sequence of this pool may hold "
                               "(max_blocks_per_seq=%d); the pool is unchanged", length,
                               needed, p->block_size, p->max_blocks_per_seq);
        default: return kv_py_pool_refused(self, status, 0, NULL);
    }
}

static PyGetSetDef pool_getset[] = {
    {"key_codes", (getter)pool_get_part, NULL,
     "Every block's stored keys, zero-copy and read-only, block first:\n"
     "(num_blocks, n_layers, block_size, n_kv_heads, per head), in the key format's code\n"
     "type (float32 for fp32). The memory underneath is head-major (n_layers, n_kv_heads,\n"
     "num_blocks, block_size, ...), so this view is strided.", KV_PY_PART(0, KV_PY_CODES)},
    {"key_scales", (getter)pool_get_part, NULL,
     "Scales of the key groups, (num_blocks, n_layers, block_size, n_kv_heads,\n"
     "head_dim / group), or None.", KV_PY_PART(0, KV_PY_SCALES)},
    {"key_zeros", (getter)pool_get_part, NULL, "Zero points of int4 keys, or None.",
     KV_PY_PART(0, KV_PY_ZEROS)},
    {"value_codes", (getter)pool_get_part, NULL, "As key_codes, for V.",
     KV_PY_PART(1, KV_PY_CODES)},
    {"value_scales", (getter)pool_get_part, NULL, "As key_scales, for V.",
     KV_PY_PART(1, KV_PY_SCALES)},
    {"value_zeros", (getter)pool_get_part, NULL, "As key_zeros, for V.",
     KV_PY_PART(1, KV_PY_ZEROS)},
    {"key_format", (getter)pool_get_format, NULL,
     "Element format of the keys: fp32, fp16, bf16, int8, int4 or fp8 (with key_group and\n"
     "window, the pool's cache format).", NULL},
    {"value_format", (getter)pool_get_format, NULL, "Element format of the values.", (void *)1},
    {"key_dtype", (getter)pool_get_old_format, NULL,
     "Deprecated: the old name of key_format (warns; goes in the next release).", NULL},
    {"value_dtype", (getter)pool_get_old_format, NULL,
     "Deprecated: the old name of value_format (warns; goes in the next release).", (void *)1},
    {"key_group", (getter)pool_get_group, NULL, "Key values per scale (0: no scales).", NULL},
    {"value_group", (getter)pool_get_group, NULL, "Value values per scale.", (void *)1},
    {"window", (getter)pool_get_window, NULL,
     "Residual window: each query reads this many most recent positions in float32.", NULL},
    {"nbytes", (getter)pool_get_nbytes, NULL, "Bytes of K/V storage the pool allocated.", NULL},
    {"device", (getter)pool_get_device, NULL,
     "Where the rows are: 'cpu' (host memory) or 'cuda' (GPU memory, through a row store).",
     NULL},
    {"n_layers", (getter)pool_get_n_layers, NULL, NULL, NULL},
    {"n_kv_heads", (getter)pool_get_n_kv_heads, NULL, NULL, NULL},
    {"head_dim", (getter)pool_get_head_dim, NULL, NULL, NULL},
    {NULL}
};

static PyMethodDef pool_methods[] = {
    {"append", (PyCFunction)pool_append, METH_VARARGS,
     "append(seq, tokens, keys, values): write given K/V rows, each\n"
     "(n_tokens, n_layers, n_kv_heads, head_dim) float32, without a model. The prefix\n"
     "cache takes rows to be what the model computes for these tokens: full blocks with\n"
     "the same tokens after the same prefix are shared. For rows that are not (random\n"
     "test data), use distinct tokens or a pool made with prefix_cache=False."},
    {"keep", (PyCFunction)pool_keep, METH_VARARGS,
     "keep(seq, rows): keep only these rows of seq, int32 (n_layers, n_keep, n_kv_heads),\n"
     "strictly increasing along n_keep, and drop the rest, as KVCache.keep: the kept rows\n"
     "become its rows 0 .. n_keep - 1, the blocks that hold none of them go back to the\n"
     "pool, next_position stays, and its blocks are no longer offered to the prefix cache.\n"
     "Few rows move: a sliding window's keep moves none (seq.start moves past the dropped\n"
     "rows), attention sinks move their first rows. Refused for a sequence that shares a\n"
     "block (a fork, a prefix found in the cache)."},
    {"positions", (PyCFunction)pool_positions, METH_O,
     "positions(seq) -> int32 (n_layers, length, n_kv_heads): the position each row of seq\n"
     "holds (arange(length) until keep() drops rows)."},
    {"swap_out", (PyCFunction)pool_swap_out, METH_O,
     "swap_out(seq) -> uint8 array: seq's K and V, tokens and state copied to host memory\n"
     "(its rows exactly as stored), then seq freed (only its own references: blocks it\n"
     "shares keep their rows). kvlab.PagedPool.swap_out wraps the bytes in a\n"
     "SwappedSequence."},
    {"swap_nbytes", (PyCFunction)pool_swap_nbytes, METH_O,
     "swap_nbytes(seq) -> int: the bytes swap_out(seq) would copy to host memory, before\n"
     "copying them (refused as swap_out refuses)."},
    {"swap_in", (PyCFunction)pool_swap_in, METH_O,
     "swap_in(host) -> PagedSequence: a new sequence in fresh blocks holding the bytes\n"
     "swap_out gave, bit for bit. Refused, changing nothing, when the pool lacks blocks or\n"
     "a sequence slot, or the bytes come from a pool of another shape or format."},
    {"gather", (PyCFunction)pool_gather, METH_O,
     "gather(seq) -> (keys, values): float32 copies, (n_layers, length, n_kv_heads,\n"
     "head_dim), of what seq's most recent token's attention read (dequantized)."},
    {"_reserve_batch", (PyCFunction)kv_py_pool_reserve_batch, METH_VARARGS,
     "_reserve_batch(seqs, n_tokens) -> (starts, tables, slots): a row-store pool's side of\n"
     "a forward pass run elsewhere (the GPU's): checks and reserves, then holds the pool\n"
     "until _commit_batch(seqs, tokens, n_tokens) or _cancel_batch(seqs)."},
    {"_commit_batch", (PyCFunction)kv_py_pool_commit_batch, METH_VARARGS,
     "_commit_batch(seqs, tokens, n_tokens): the reserved rows are written."},
    {"_cancel_batch", (PyCFunction)kv_py_pool_cancel_batch, METH_O,
     "_cancel_batch(seqs): they were not: every reservation the pool holds is given back,\n"
     "every sequence as it was (no-op unless held)."},
    {NULL}
};

PyTypeObject kv_py_pool_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.PagedPool",
    .tp_doc = PyDoc_STR("PagedPool(n_layers, n_kv_heads, head_dim, num_blocks, block_size,\n"
                        "          max_seqs=256, max_blocks_per_seq=num_blocks, hash_bits=64,\n"
                        "          key_format='fp32', value_format='fp32', key_group=0,\n"
                        "          value_group=0, window=0, prefix_cache=True, store=None)\n\n"
                        "A paged pool: fixed-size blocks of K and V shared by many\n"
                        "sequences. Usually made with model.new_paged_pool(...). With store,\n"
                        "its rows live in that object (the GPU's kvlab._cuda.KVStore: see\n"
                        "kvlab.cuda.CudaPagedPool), which copies, writes and reads them."),
    .tp_base = &kv_py_blocks_type,
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)pool_traverse,
    .tp_free = PyObject_GC_Del,
    .tp_new = pool_new,
    .tp_init = (initproc)pool_init,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};
