/* pool.c: PagedPool, the paged KV cache (kv_pool), and PagedSequence, a handle to one of
 * its sequences.
 *
 * A handle holds its pool (a strong reference) and the slot's serial when it was made: a
 * freed slot is given to later sequences, and the serial tells a stale handle from the
 * slot's new owner, so a handle to a freed sequence raises instead of touching another's.
 */
#include "binding.h"

int kv_py_pool_ready(PoolObject *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this PagedPool is in use by a forward pass in another thread; "
                        "one thread at a time may use a pool");
        return -1;
    }
    if (self->pool.key.codes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PagedPool was not initialized");
        return -1;
    }
    return 0;
}

int kv_py_sequence_slot(PoolObject *pool, PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &kv_py_sequence_type)) {
        PyErr_Format(PyExc_TypeError, "expected a PagedSequence, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    SequenceObject *handle = (SequenceObject *)obj;
    if (handle->pool != pool) {
        PyErr_SetString(PyExc_ValueError, "this sequence belongs to another pool");
        return -1;
    }
    const kv_seq *q = &pool->pool.seqs[handle->seq];
    if (!q->alive || q->serial != handle->serial) {
        PyErr_SetString(PyExc_ValueError, "this sequence was freed; it cannot be used any more");
        return -1;
    }
    return handle->seq;
}

PyObject *kv_py_pool_refused(const PoolObject *pool, kv_status status, int n_tokens,
                             const kv_config *model) {
    const kv_pool *p = &pool->pool;
    switch (status) {
        case KV_ERR_OUT_OF_BLOCKS:
            return kv_py_raise(status, "out of blocks: appending %d tokens needs more blocks "
                               "than the pool has free (%d) or cached (%d) of %d; the pool is "
                               "unchanged", n_tokens, p->n_free, p->n_cached, p->num_blocks);
        case KV_ERR_TABLE_FULL:
            return kv_py_raise(status, "the sequence's block table is full (%d blocks of %d "
                               "tokens); the pool is unchanged", p->max_blocks_per_seq,
                               p->block_size);
        case KV_ERR_TOO_MANY_SEQUENCES:
            return kv_py_raise(status, "the pool already holds max_seqs=%d sequences; free one",
                               p->max_seqs);
        case KV_ERR_CACHE_MISMATCH:
            if (model == NULL) break;
            return kv_py_raise(status, "this pool holds %d layers x %d KV heads x %d, but the "
                               "model needs %d x %d x %d", p->n_layers, p->n_kv_heads,
                               p->head_dim, model->n_layers, model->n_kv_heads, model->head_dim);
        default: break;
    }
    return kv_py_raise(status, NULL);
}

static PyObject *new_handle(PoolObject *pool, int seq) {
    SequenceObject *handle = PyObject_New(SequenceObject, &kv_py_sequence_type);
    if (handle == NULL) return NULL;
    Py_INCREF(pool);
    handle->pool = pool;
    handle->seq = seq;
    handle->serial = pool->pool.seqs[seq].serial;
    return (PyObject *)handle;
}

/* ---- life -------------------------------------------------------------------------- */

static int pool_init(PoolObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "num_blocks", "block_size",
                             "max_seqs", "max_blocks_per_seq", "hash_bits", "key_format",
                             "value_format", "key_group", "value_group", "window",
                             "prefix_cache", NULL};
    int n_layers, n_kv_heads, head_dim, num_blocks, block_size, max_seqs = 256;
    int max_blocks_per_seq = 0, hash_bits = 64, key_group = 0, value_group = 0, window = 0;
    int prefix_cache = 1;
    const char *key_name = "fp32", *value_name = "fp32";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiiii|iiissiiip", kwlist, &n_layers,
                                     &n_kv_heads, &head_dim, &num_blocks, &block_size, &max_seqs,
                                     &max_blocks_per_seq, &hash_bits, &key_name, &value_name,
                                     &key_group, &value_group, &window, &prefix_cache))
        return -1;
    if (self->pool.key.codes != NULL) {
        /* re-initializing would free memory that existing views and handles still show */
        PyErr_SetString(PyExc_RuntimeError, "PagedPool is already initialized");
        return -1;
    }
    if (hash_bits < 1 || hash_bits > 64) {   /* the binding's own knob (tests narrow hashes) */
        PyErr_Format(PyExc_ValueError, "hash_bits must be between 1 and 64, got %d", hash_bits);
        return -1;
    }
    if (max_blocks_per_seq == 0) max_blocks_per_seq = num_blocks;
    kv_cache_format format;
    if (kv_py_make_format(&format, key_name, value_name, key_group, value_group, window) < 0)
        return -1;
    /* the core checks every number; on refusal it leaves the pool zeroed */
    kv_status status = kv_pool_init(&self->pool, n_layers, n_kv_heads, head_dim, num_blocks,
                                    block_size, max_seqs, max_blocks_per_seq, &format);
    if (status == KV_OK) {
        if (hash_bits < 64) self->pool.hash_mask = ((uint64_t)1 << hash_bits) - 1;
        self->pool.prefix_cache = prefix_cache;
        return 0;
    }
    if (status != KV_ERR_INVALID_ARG)
        kv_py_raise(status, NULL);
    else if (!kv_py_group_refused(&format, head_dim))
        kv_py_raise(status, "PagedPool(n_layers=%d, n_kv_heads=%d, head_dim=%d, num_blocks=%d, "
                    "block_size=%d, max_seqs=%d, max_blocks_per_seq=%d, window=%d) is refused: "
                    "sizes must be positive, block_size at most 256, num_blocks at most 2**24, "
                    "max_seqs at most 2**20, max_seqs * max_blocks_per_seq at most 2**28 "
                    "(n_layers up to 4096, n_kv_heads * head_dim up to 65536) and the window "
                    "between 0 and 2**20", n_layers, n_kv_heads, head_dim, num_blocks,
                    block_size, max_seqs, max_blocks_per_seq, window);
    return -1;
}

static void pool_dealloc(PoolObject *self) {
    kv_pool_free(&self->pool);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- views and attributes ---------------------------------------------------------- */

/* A read-only zero-copy view of pool memory, C order; its base is the pool. */
static PyObject *pool_view(PoolObject *self, void *data, int type, int ndim, npy_intp *dims) {
    if (self->pool.key.codes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PagedPool was not initialized");
        return NULL;
    }
    return kv_py_readonly_view((PyObject *)self, data, type, ndim, dims, NULL);
}

/* key_codes, key_scales, ... value_zeros of the whole pool: closure = KV_PY_PART(is_value,
 * part). The memory is head-major (n_layers, n_kv_heads, num_blocks, block_size, ...);
 * shown block-first, so that key_codes[b] is everything block b holds. */
static PyObject *pool_get_part(PoolObject *self, void *closure) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int which = (int)(intptr_t)closure;
    const kv_pool *p = &self->pool;
    npy_intp lead_dims[3] = {p->num_blocks, p->n_layers, p->block_size};
    npy_intp slots = (npy_intp)p->num_blocks * p->block_size;
    npy_intp lead_strides[3] = {p->block_size, (npy_intp)p->n_kv_heads * slots, 1};
    return kv_py_store_view((PyObject *)self, (which >> 2) ? &p->value : &p->key, which & 3, 3,
                            lead_dims, lead_strides);
}

/* closure NULL: the keys' attribute; non-NULL: the values' */
static PyObject *pool_get_format(PoolObject *self, void *closure) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    return kv_py_format_name((closure ? &self->pool.value : &self->pool.key)->format);
}

static PyObject *pool_get_group(PoolObject *self, void *closure) {
    return PyLong_FromLong((closure ? &self->pool.value : &self->pool.key)->group);
}

static PyObject *pool_get_ref_counts(PoolObject *self, void *closure) {
    npy_intp dims[1] = {self->pool.num_blocks};
    return pool_view(self, self->pool.ref_count, NPY_INT32, 1, dims);
}

static PyObject *pool_get_fill(PoolObject *self, void *closure) {
    npy_intp dims[1] = {self->pool.num_blocks};
    return pool_view(self, self->pool.fill, NPY_INT32, 1, dims);
}

static PyObject *pool_get_block_tokens(PoolObject *self, void *closure) {
    npy_intp dims[2] = {self->pool.num_blocks, self->pool.block_size};
    return pool_view(self, self->pool.tokens, NPY_INT32, 2, dims);
}

static PyObject *pool_get_free_blocks(PoolObject *self, void *closure) {
    const kv_pool *p = &self->pool;
    PyObject *list = PyList_New(p->n_free);
    for (int i = 0; list != NULL && i < p->n_free; i++) {
        PyObject *item = PyLong_FromLong(p->free_stack[i]);
        if (item == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *pool_get_cached_blocks(PoolObject *self, void *closure) {
    PyObject *list = PyList_New(0);
    if (list == NULL || self->pool.lru_next == NULL) return list;
    for (int32_t b = self->pool.lru_head; b >= 0; b = self->pool.lru_next[b]) {
        PyObject *item = PyLong_FromLong(b);
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return list;
}

#define POOL_INT_GETTER(name, expr)                                        \
    static PyObject *pool_get_##name(PoolObject *self, void *closure) {    \
        return PyLong_FromLongLong((long long)(expr));                     \
    }
POOL_INT_GETTER(num_blocks, self->pool.num_blocks)
POOL_INT_GETTER(block_size, self->pool.block_size)
POOL_INT_GETTER(max_seqs, self->pool.max_seqs)
POOL_INT_GETTER(max_blocks_per_seq, self->pool.max_blocks_per_seq)
POOL_INT_GETTER(nbytes, self->pool.key.codes ? kv_pool_nbytes(&self->pool) : 0)
POOL_INT_GETTER(window, self->pool.window)
POOL_INT_GETTER(available_blocks, self->pool.n_free + self->pool.n_cached)

static PyObject *pool_get_live_sequences(PoolObject *self, void *closure) {
    long live = 0;
    for (int s = 0; self->pool.seqs != NULL && s < self->pool.max_seqs; s++)
        live += self->pool.seqs[s].alive;
    return PyLong_FromLong(live);
}

/* ---- methods ----------------------------------------------------------------------- */

static PyObject *pool_new_sequence(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq;
    kv_status status = kv_pool_seq_new(&self->pool, &seq);
    if (status != KV_OK) return kv_py_pool_refused(self, status, 0, NULL);
    return new_handle(self, seq);
}

static PyObject *pool_fork(PoolObject *self, PyObject *arg) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(self, arg);
    if (seq < 0) return NULL;
    int child;
    kv_status status = kv_pool_seq_fork(&self->pool, seq, &child);
    if (status != KV_OK) return kv_py_pool_refused(self, status, 0, NULL);
    return new_handle(self, child);
}

static PyObject *pool_free_sequence(PoolObject *self, PyObject *arg) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(self, arg);
    if (seq < 0) return NULL;
    kv_pool_seq_free(&self->pool, seq);
    Py_RETURN_NONE;
}

static const kv_py_array_spec token_ids = {.name = "tokens", .type = NPY_INT32, .ndim = 1,
                                           .shape = {KV_PY_ANY}, .axes = "n_tokens"};

static PyObject *pool_reuse_prefix(PoolObject *self, PyObject *args) {
    PyObject *seq_obj, *tokens_obj, *max_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O", &seq_obj, &tokens_obj, &max_obj)) return NULL;
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(self, seq_obj);
    if (seq < 0) return NULL;
    PyArrayObject *tokens = kv_py_array(tokens_obj, &token_ids);
    if (tokens == NULL) return NULL;
    int n = (int)PyArray_DIM(tokens, 0), max_tokens = n;
    long requested = n;
    if (max_obj != Py_None) {
        requested = PyLong_AsLong(max_obj);
        if (requested == -1 && PyErr_Occurred()) return NULL;
        /* at most the tokens given; any negative number (which the core refuses) as -1 */
        if (requested < n) max_tokens = requested < 0 ? -1 : (int)requested;
    }
    int reused = 0;
    kv_status status = kv_pool_reuse_prefix(&self->pool, seq,
                                            (const int32_t *)PyArray_DATA(tokens), max_tokens,
                                            &reused);
    if (status == KV_OK) return PyLong_FromLong(reused);
    if (status != KV_ERR_INVALID_ARG) return kv_py_pool_refused(self, status, 0, NULL);
    if (max_tokens < 0)
        return kv_py_raise(status, "max_tokens must be >= 0, got %ld", requested);
    return kv_py_raise(status, "reuse_prefix needs an empty sequence; this one holds %d "
                       "positions", self->pool.seqs[seq].length);
}

static PyObject *pool_append(PoolObject *self, PyObject *args) {
    PyObject *seq_obj, *tokens_obj, *keys_obj, *values_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &seq_obj, &tokens_obj, &keys_obj, &values_obj))
        return NULL;
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(self, seq_obj);
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

static PyObject *pool_blocks_needed(PoolObject *self, PyObject *args) {
    PyObject *handle;
    int n_tokens;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &n_tokens)) return NULL;
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(self, handle);
    if (seq < 0) return NULL;
    int needed;
    kv_status status = kv_pool_blocks_needed(&self->pool, seq, n_tokens, &needed);
    if (status == KV_OK) return PyLong_FromLong(needed);
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "n_tokens must be at least 1 (and a sequence holds at most "
                           "2**30 positions), got %d", n_tokens);
    return kv_py_pool_refused(self, status, n_tokens, NULL);
}

static PyObject *pool_gather(PoolObject *self, PyObject *arg) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    int seq = kv_py_sequence_slot(self, arg);
    if (seq < 0) return NULL;
    const kv_pool *p = &self->pool;
    npy_intp dims[4] = {p->n_layers, p->seqs[seq].length, p->n_kv_heads, p->head_dim};
    PyObject *keys = PyArray_SimpleNew(4, dims, NPY_FLOAT32);
    PyObject *values = keys ? PyArray_SimpleNew(4, dims, NPY_FLOAT32) : NULL;
    if (values == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    kv_pool_gather(p, seq, (float *)PyArray_DATA((PyArrayObject *)keys),
                   (float *)PyArray_DATA((PyArrayObject *)values));
    return Py_BuildValue("(NN)", keys, values);
}

static PyObject *pool_stats(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    kv_pool_stats st;
    kv_pool_stats_get(&self->pool, &st);
    return Py_BuildValue("{s:i,s:i,s:i,s:L,s:L,s:i,s:L,s:L}", "blocks_used", st.blocks_used,
                         "blocks_free", st.blocks_free, "blocks_cached", st.blocks_cached,
                         "tokens_stored", (long long)st.tokens_stored, "slots_unused",
                         (long long)st.slots_unused, "n_sequences", st.n_sequences,
                         "prefix_hits", (long long)st.prefix_hits, "prefix_misses",
                         (long long)st.prefix_misses);
}

static PyObject *pool_check(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    char message[256];
    kv_status status = kv_pool_check(&self->pool, message, sizeof message);
    if (status == KV_ERR_CORRUPT)
        return kv_py_raise(status, "pool invariant broken: %s", message);
    if (status != KV_OK) return kv_py_raise(status, NULL);
    Py_RETURN_NONE;
}

static PyObject *pool_sequences(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_pool_ready(self) < 0) return NULL;
    PyObject *list = PyList_New(0);
    for (int s = 0; list != NULL && s < self->pool.max_seqs; s++) {
        if (!self->pool.seqs[s].alive) continue;
        PyObject *handle = new_handle(self, s);
        if (handle == NULL || PyList_Append(list, handle) < 0) {
            Py_XDECREF(handle);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(handle);
    }
    return list;
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
    {"key_dtype", (getter)pool_get_format, NULL, "Element format of the keys.", NULL},
    {"value_dtype", (getter)pool_get_format, NULL, "Element format of the values.", (void *)1},
    {"key_group", (getter)pool_get_group, NULL, "Key values per scale (0: no scales).", NULL},
    {"value_group", (getter)pool_get_group, NULL, "Value values per scale.", (void *)1},
    {"window", (getter)pool_get_window, NULL,
     "Residual window: each query reads this many most recent positions in float32.", NULL},
    {"ref_counts", (getter)pool_get_ref_counts, NULL, "Block-table references per block (view).", NULL},
    {"fill", (getter)pool_get_fill, NULL, "Rows written per block (view).", NULL},
    {"block_tokens", (getter)pool_get_block_tokens, NULL,
     "Token id of every written row, (num_blocks, block_size) (view).", NULL},
    {"free_blocks", (getter)pool_get_free_blocks, NULL, "Free block ids, next to be used last.", NULL},
    {"cached_blocks", (getter)pool_get_cached_blocks, NULL,
     "Unreferenced blocks kept for prefix reuse, least recently used first.", NULL},
    {"num_blocks", (getter)pool_get_num_blocks, NULL, NULL, NULL},
    {"block_size", (getter)pool_get_block_size, NULL, NULL, NULL},
    {"max_seqs", (getter)pool_get_max_seqs, NULL, NULL, NULL},
    {"max_blocks_per_seq", (getter)pool_get_max_blocks_per_seq, NULL, NULL, NULL},
    {"nbytes", (getter)pool_get_nbytes, NULL, "Bytes of K/V storage the pool allocated.", NULL},
    {"live_sequences", (getter)pool_get_live_sequences, NULL,
     "Sequences alive in the pool (at most max_seqs).", NULL},
    {"available_blocks", (getter)pool_get_available_blocks, NULL,
     "Blocks that can be handed out now: free ones and cached ones (evicted if needed).", NULL},
    {NULL}
};

static PyMethodDef pool_methods[] = {
    {"new_sequence", (PyCFunction)pool_new_sequence, METH_NOARGS, "A new, empty sequence."},
    {"fork", (PyCFunction)pool_fork, METH_O,
     "fork(seq): a child sharing all of seq's blocks (copy-on-write on the next write)."},
    {"free", (PyCFunction)pool_free_sequence, METH_O,
     "free(seq): drop seq's blocks (full ones stay cached for prefix reuse)."},
    {"reuse_prefix", (PyCFunction)pool_reuse_prefix, METH_VARARGS,
     "reuse_prefix(seq, tokens, max_tokens=len(tokens)) -> tokens reused: attach the cached\n"
     "full blocks holding the longest prefix of tokens[:max_tokens] to an empty seq."},
    {"append", (PyCFunction)pool_append, METH_VARARGS,
     "append(seq, tokens, keys, values): write given K/V rows, each\n"
     "(n_tokens, n_layers, n_kv_heads, head_dim) float32, without a model. The prefix\n"
     "cache takes rows to be what the model computes for these tokens: full blocks with\n"
     "the same tokens after the same prefix are shared. For rows that are not (random\n"
     "test data), use distinct tokens or a pool made with prefix_cache=False."},
    {"blocks_needed", (PyCFunction)pool_blocks_needed, METH_VARARGS,
     "blocks_needed(seq, n_tokens) -> blocks that appending n_tokens to seq would take\n"
     "(new blocks, plus one if its last block is shared and partly filled: copy-on-write)."},
    {"gather", (PyCFunction)pool_gather, METH_O,
     "gather(seq) -> (keys, values): float32 copies, (n_layers, length, n_kv_heads,\n"
     "head_dim), of what seq's most recent token's attention read (dequantized)."},
    {"stats", (PyCFunction)pool_stats, METH_NOARGS, "Counts of blocks, rows and prefix hits."},
    {"check", (PyCFunction)pool_check, METH_NOARGS,
     "Verify every invariant; raises PoolInvariantError if one is broken."},
    {"sequences", (PyCFunction)pool_sequences, METH_NOARGS, "Handles of every live sequence."},
    {NULL}
};

PyTypeObject kv_py_pool_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.PagedPool",
    .tp_doc = PyDoc_STR("PagedPool(n_layers, n_kv_heads, head_dim, num_blocks, block_size,\n"
                        "          max_seqs=256, max_blocks_per_seq=num_blocks, hash_bits=64,\n"
                        "          key_format='fp32', value_format='fp32', key_group=0,\n"
                        "          value_group=0, window=0, prefix_cache=True)\n\n"
                        "A paged KV cache: one pool of fixed-size blocks shared by many\n"
                        "sequences. Usually made with model.new_paged_pool(...)."),
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pool_init,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

/* ---- PagedSequence ----------------------------------------------------------------- */

static void sequence_dealloc(SequenceObject *self) {
    Py_XDECREF(self->pool);
    PyObject_Free(self);
}

static int sequence_alive(const SequenceObject *self) {
    const kv_seq *q = &self->pool->pool.seqs[self->seq];
    return q->alive && q->serial == self->serial;
}

static PyObject *sequence_get_alive(SequenceObject *self, void *closure) {
    return PyBool_FromLong(sequence_alive(self));
}

static PyObject *sequence_get_length(SequenceObject *self, void *closure) {
    if (kv_py_sequence_slot(self->pool, (PyObject *)self) < 0) return NULL;
    return PyLong_FromLong(self->pool->pool.seqs[self->seq].length);
}

static PyObject *sequence_get_id(SequenceObject *self, void *closure) {
    return PyLong_FromLong(self->seq);
}

static PyObject *sequence_get_serial(SequenceObject *self, void *closure) {
    return PyLong_FromUnsignedLong(self->serial);
}

static PyObject *sequence_get_pool(SequenceObject *self, void *closure) {
    Py_INCREF(self->pool);
    return (PyObject *)self->pool;
}

static PyObject *sequence_get_block_table(SequenceObject *self, void *closure) {
    if (kv_py_sequence_slot(self->pool, (PyObject *)self) < 0) return NULL;
    const kv_seq *q = &self->pool->pool.seqs[self->seq];
    npy_intp dims[1] = {q->n_blocks};
    return pool_view(self->pool, q->block_table, NPY_INT32, 1, dims);
}

static PyObject *sequence_repr(SequenceObject *self) {
    if (!sequence_alive(self)) return PyUnicode_FromFormat("PagedSequence(id=%d, freed)", self->seq);
    const kv_seq *q = &self->pool->pool.seqs[self->seq];
    return PyUnicode_FromFormat("PagedSequence(id=%d, length=%d, blocks=%d)", self->seq,
                                q->length, q->n_blocks);
}

static PyGetSetDef sequence_getset[] = {
    {"length", (getter)sequence_get_length, NULL, "Positions filled.", NULL},
    {"block_table", (getter)sequence_get_block_table, NULL,
     "Physical block id of each logical block, an int32 read-only view. Position pos\n"
     "lives in row pos % block_size of block block_table[pos // block_size].", NULL},
    {"id", (getter)sequence_get_id, NULL, "Slot number in the pool.", NULL},
    {"serial", (getter)sequence_get_serial, NULL,
     "How many sequences the slot had held when this one was made: (id, serial) names a\n"
     "sequence for good, since a freed slot's id is given to a later sequence.", NULL},
    {"alive", (getter)sequence_get_alive, NULL, "False once freed.", NULL},
    {"pool", (getter)sequence_get_pool, NULL, "The pool holding this sequence.", NULL},
    {NULL}
};

PyTypeObject kv_py_sequence_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.PagedSequence",
    .tp_doc = PyDoc_STR("A sequence of a PagedPool: a block table and a length. Made by\n"
                        "pool.new_sequence() or pool.fork(seq)."),
    .tp_basicsize = sizeof(SequenceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)sequence_dealloc,
    .tp_repr = (reprfunc)sequence_repr,
    .tp_getset = sequence_getset,
};
