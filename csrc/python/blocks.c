/* blocks.c: BlockManager, a paged pool's bookkeeping (kv_blocks) as a Python object, and
 * PagedSequence, a handle to one of its sequences.
 *
 * A BlockManager holds no K or V. On its own it is the GPU pool's bookkeeping
 * (kvlab/cuda.py keeps the rows in GPU memory and performs the copies reserve() returns);
 * a PagedPool (pool.c) is a BlockManager whose rows are the C core's stores.
 *
 * A handle holds its pool (a strong reference) and the slot's serial when it was made: a
 * freed slot is given to later sequences, and the serial tells a stale handle from the
 * slot's new owner, so a handle to a freed sequence raises instead of touching another's.
 */
#include "binding.h"

#include <limits.h>

int kv_py_blocks_ready(BlocksObject *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this PagedPool is in use by a forward pass in another thread; "
                        "one thread at a time may use a pool");
        return -1;
    }
    if (self->blocks == NULL || self->blocks->seqs == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s was not initialized", Py_TYPE(self)->tp_name);
        return -1;
    }
    return 0;
}

int kv_py_sequence_slot(BlocksObject *owner, PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &kv_py_sequence_type)) {
        PyErr_Format(PyExc_TypeError, "expected a PagedSequence, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    SequenceObject *handle = (SequenceObject *)obj;
    if (handle->owner != owner) {
        PyErr_SetString(PyExc_ValueError, "this sequence belongs to another pool");
        return -1;
    }
    const kv_seq *q = &owner->blocks->seqs[handle->seq];
    if (!q->alive || q->serial != handle->serial) {
        PyErr_SetString(PyExc_ValueError, "this sequence was freed; it cannot be used any more");
        return -1;
    }
    return handle->seq;
}

PyObject *kv_py_blocks_refused(const BlocksObject *owner, kv_status status, int n_tokens) {
    const kv_blocks *p = owner->blocks;
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
        default: break;
    }
    return kv_py_raise(status, NULL);
}

PyObject *kv_py_new_sequence_handle(BlocksObject *owner, int seq) {
    SequenceObject *handle = PyObject_GC_New(SequenceObject, &kv_py_sequence_type);
    if (handle == NULL) return NULL;
    Py_INCREF(owner);
    handle->owner = owner;
    handle->seq = seq;
    handle->serial = owner->blocks->seqs[seq].serial;
    PyObject_GC_Track(handle);
    return (PyObject *)handle;
}

/* The slot of handle, a live sequence of this block manager, which is ready for use; or -1
 * with the exception (the prologue of every method that takes a sequence). */
static int ready_slot(BlocksObject *self, PyObject *handle) {
    if (kv_py_blocks_ready(self) < 0) return -1;
    return kv_py_sequence_slot(self, handle);
}

/* ---- life -------------------------------------------------------------------------- */

static PyObject *blocks_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    BlocksObject *self = (BlocksObject *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->blocks = &self->own;
    return (PyObject *)self;
}

/* 1 if self is a PagedPool, whose rows the core's stores hold: reserve and commit, which
 * leave the writing of rows to the caller, are not for it. */
static int is_pool(BlocksObject *self) {
    return PyObject_TypeCheck((PyObject *)self, &kv_py_pool_type);
}

static int blocks_init(BlocksObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"num_blocks", "block_size", "max_seqs", "max_blocks_per_seq",
                             "hash_bits", "prefix_cache", NULL};
    int num_blocks, block_size, max_seqs = 256, max_blocks_per_seq = 0, hash_bits = 64;
    int prefix_cache = 1;
    if (kv_py_int_arguments(args, kwds, "ii|iiip", kwlist) < 0) return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii|iiip", kwlist, &num_blocks, &block_size,
                                     &max_seqs, &max_blocks_per_seq, &hash_bits, &prefix_cache))
        return -1;
    if (self->blocks != &self->own) {
        PyErr_SetString(PyExc_TypeError, "a PagedPool is made with PagedPool's arguments "
                        "(BlockManager.__init__ does not apply to it)");
        return -1;
    }
    if (self->own.seqs != NULL) {
        /* re-initializing would free what existing handles and views still show */
        PyErr_SetString(PyExc_RuntimeError, "BlockManager is already initialized");
        return -1;
    }
    /* the binding's own knob (tests narrow hashes) */
    if (kv_py_int_in("hash_bits", hash_bits, 1, 64, NULL) < 0) return -1;
    if (max_blocks_per_seq == 0) max_blocks_per_seq = num_blocks;
    kv_status status = kv_blocks_init(&self->own, num_blocks, block_size, max_seqs,
                                      max_blocks_per_seq);
    if (status != KV_OK) {
        kv_py_raise(status, status != KV_ERR_INVALID_ARG ? NULL :
                    "BlockManager(num_blocks=%d, block_size=%d, max_seqs=%d, "
                    "max_blocks_per_seq=%d) is refused: sizes must be positive, "
                    KV_PY_BLOCKS_LIMITS, num_blocks, block_size, max_seqs, max_blocks_per_seq);
        return -1;
    }
    if (hash_bits < 64) self->own.hash_mask = ((uint64_t)1 << hash_bits) - 1;
    self->own.prefix_cache = prefix_cache;
    return 0;
}

static void blocks_dealloc(BlocksObject *self) {
    kv_blocks_free(&self->own);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- attributes -------------------------------------------------------------------- */

/* A read-only zero-copy view of bookkeeping memory, C order; its base is the pool. */
static PyObject *blocks_view(BlocksObject *self, void *data, int type, int ndim, npy_intp *dims) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    return kv_py_readonly_view((PyObject *)self, data, type, ndim, dims, NULL);
}

static PyObject *blocks_get_ref_counts(BlocksObject *self, void *closure) {
    npy_intp dims[1] = {self->blocks->num_blocks};
    return blocks_view(self, self->blocks->ref_count, NPY_INT32, 1, dims);
}

static PyObject *blocks_get_fill(BlocksObject *self, void *closure) {
    npy_intp dims[1] = {self->blocks->num_blocks};
    return blocks_view(self, self->blocks->fill, NPY_INT32, 1, dims);
}

static PyObject *blocks_get_block_tokens(BlocksObject *self, void *closure) {
    npy_intp dims[2] = {self->blocks->num_blocks, self->blocks->block_size};
    return blocks_view(self, self->blocks->tokens, NPY_INT32, 2, dims);
}

/* A new array (not a view: it is computed, and stays as it was when asked). */
static PyObject *blocks_get_prefix_parents(BlocksObject *self, void *closure) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    npy_intp dims[1] = {self->blocks->num_blocks};
    PyObject *array = PyArray_SimpleNew(1, dims, NPY_INT32);
    if (array != NULL)
        kv_blocks_findable(self->blocks, (int32_t *)PyArray_DATA((PyArrayObject *)array));
    return array;
}

static PyObject *int_list(const int32_t *values, int n) {
    PyObject *list = PyList_New(n);
    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *item = PyLong_FromLong(values[i]);
        if (item == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *blocks_get_free_blocks(BlocksObject *self, void *closure) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    return int_list(self->blocks->free_stack, self->blocks->n_free);
}

static PyObject *blocks_get_cached_blocks(BlocksObject *self, void *closure) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    PyObject *list = PyList_New(0);
    for (int32_t b = self->blocks->lru_head; list != NULL && b >= 0; b = self->blocks->lru_next[b]) {
        PyObject *item = PyLong_FromLong(b);
        if (item == NULL || PyList_Append(list, item) < 0) Py_CLEAR(list);
        Py_XDECREF(item);
    }
    return list;
}

#define BLOCKS_INT_GETTER(name, expr)                                           \
    static PyObject *blocks_get_##name(BlocksObject *self, void *closure) {     \
        if (kv_py_blocks_ready(self) < 0) return NULL;                          \
        return PyLong_FromLongLong((long long)(expr));                          \
    }
BLOCKS_INT_GETTER(num_blocks, self->blocks->num_blocks)
BLOCKS_INT_GETTER(block_size, self->blocks->block_size)
BLOCKS_INT_GETTER(max_seqs, self->blocks->max_seqs)
BLOCKS_INT_GETTER(max_blocks_per_seq, self->blocks->max_blocks_per_seq)
BLOCKS_INT_GETTER(available_blocks, kv_blocks_available(self->blocks))

static PyObject *blocks_get_live_sequences(BlocksObject *self, void *closure) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    long live = 0;
    for (int s = 0; s < self->blocks->max_seqs; s++) live += self->blocks->seqs[s].alive;
    return PyLong_FromLong(live);
}

static PyObject *blocks_get_record_events(BlocksObject *self, void *closure) {
    return PyBool_FromLong(self->blocks != NULL && self->blocks->record_events);
}

static int blocks_set_record_events(BlocksObject *self, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "record_events cannot be deleted");
        return -1;
    }
    int on = PyObject_IsTrue(value);
    if (on < 0 || kv_py_blocks_ready(self) < 0) return -1;
    kv_blocks_record_events(self->blocks, on);
    return 0;
}

/* ---- methods ----------------------------------------------------------------------- */

static PyObject *blocks_new_sequence(BlocksObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    int seq;
    kv_status status = kv_blocks_seq_new(self->blocks, &seq);
    if (status != KV_OK) return kv_py_blocks_refused(self, status, 0);
    return kv_py_new_sequence_handle(self, seq);
}

static PyObject *blocks_fork(BlocksObject *self, PyObject *arg) {
    int seq = ready_slot(self, arg);
    if (seq < 0) return NULL;
    int child;
    /* a pool's fork also copies the sequence's residual-window rows */
    kv_status status = is_pool(self) ? kv_pool_seq_fork(&((PoolObject *)self)->pool, seq, &child)
                                     : kv_blocks_seq_fork(self->blocks, seq, &child);
    if (status != KV_OK) return kv_py_blocks_refused(self, status, 0);
    return kv_py_new_sequence_handle(self, child);
}

static PyObject *blocks_free_sequence(BlocksObject *self, PyObject *arg) {
    int seq = ready_slot(self, arg);
    if (seq < 0) return NULL;
    kv_blocks_seq_free(self->blocks, seq);
    Py_RETURN_NONE;
}

static const kv_py_array_spec token_ids = {.name = "tokens", .type = NPY_INT32, .ndim = 1,
                                           .shape = {KV_PY_ANY}, .axes = "n_tokens"};

static PyObject *blocks_reuse_prefix(BlocksObject *self, PyObject *args) {
    PyObject *seq_obj, *tokens_obj, *max_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O", &seq_obj, &tokens_obj, &max_obj)) return NULL;
    int seq = ready_slot(self, seq_obj);
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
    kv_status status = kv_blocks_reuse_prefix(self->blocks, seq,
                                              (const int32_t *)PyArray_DATA(tokens), max_tokens,
                                              &reused);
    if (status == KV_OK) return PyLong_FromLong(reused);
    if (status != KV_ERR_INVALID_ARG) return kv_py_blocks_refused(self, status, 0);
    if (max_tokens < 0)
        return kv_py_raise(status, "max_tokens must be >= 0, got %ld", requested);
    return kv_py_raise(status, "reuse_prefix needs an empty sequence; this one holds %d "
                       "positions", self->blocks->seqs[seq].length);
}

static PyObject *blocks_blocks_needed(BlocksObject *self, PyObject *args) {
    PyObject *handle;
    int n_tokens;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &n_tokens)) return NULL;
    int seq = ready_slot(self, handle);
    if (seq < 0) return NULL;
    int needed;
    kv_status status = kv_blocks_needed(self->blocks, seq, n_tokens, &needed);
    if (status == KV_OK) return PyLong_FromLong(needed);
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "n_tokens must be at least 1 (and a sequence holds at most "
                           "2**30 positions), got %d", n_tokens);
    return kv_py_blocks_refused(self, status, n_tokens);
}

static PyObject *refuse_rows_of_a_pool(void) {
    PyErr_SetString(PyExc_TypeError, "a PagedPool writes K and V between reserve and commit "
                    "itself: use model.prefill(tokens, seq) or pool.append(seq, tokens, keys, "
                    "values) (reserve/commit are for a BlockManager whose rows live elsewhere)");
    return NULL;
}

static PyObject *blocks_reserve(BlocksObject *self, PyObject *args) {
    PyObject *handle;
    int n_tokens;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &n_tokens)) return NULL;
    if (is_pool(self)) return refuse_rows_of_a_pool();
    int seq = ready_slot(self, handle);
    if (seq < 0) return NULL;
    /* made before the reservation, so that nothing can fail after it */
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    kv_block_copy copies[1];
    int n_copies = 0;
    kv_status status = kv_blocks_reserve(self->blocks, seq, n_tokens, copies, &n_copies);
    if (status != KV_OK) {
        Py_DECREF(list);
        if (status == KV_ERR_INVALID_ARG)
            return kv_py_raise(status, "n_tokens must be at least 1 (and a sequence holds at "
                               "most 2**30 positions), got %d", n_tokens);
        return kv_py_blocks_refused(self, status, n_tokens);
    }
    for (int i = 0; i < n_copies; i++) {
        PyObject *copy = Py_BuildValue("(iii)", copies[i].dst, copies[i].src, copies[i].rows);
        if (copy == NULL || PyList_Append(list, copy) < 0) {
            /* the blocks are taken; without the copy the caller cannot fill the new block */
            Py_XDECREF(copy);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(copy);
    }
    return list;
}

static PyObject *blocks_commit(BlocksObject *self, PyObject *args) {
    PyObject *handle, *tokens_obj;
    if (!PyArg_ParseTuple(args, "OO", &handle, &tokens_obj)) return NULL;
    if (is_pool(self)) return refuse_rows_of_a_pool();
    int seq = ready_slot(self, handle);
    if (seq < 0) return NULL;
    PyArrayObject *tokens = kv_py_array(tokens_obj, &token_ids);
    if (tokens == NULL) return NULL;
    int n = (int)PyArray_DIM(tokens, 0);
    kv_status status = kv_blocks_commit(self->blocks, seq, (const int32_t *)PyArray_DATA(tokens),
                                        n);
    if (status == KV_OK) Py_RETURN_NONE;
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "commit of %d tokens: reserve() made room for %d (commit "
                           "follows reserve, with as many tokens)", n,
                           self->blocks->seqs[seq].reserved);
    return kv_py_blocks_refused(self, status, n);
}

static PyObject *blocks_cancel(BlocksObject *self, PyObject *handle) {
    if (is_pool(self)) return refuse_rows_of_a_pool();
    int seq = ready_slot(self, handle);
    if (seq < 0) return NULL;
    kv_blocks_cancel(self->blocks, seq);       /* a live sequence: cannot fail */
    Py_RETURN_NONE;
}

static PyObject *blocks_truncate(BlocksObject *self, PyObject *args) {
    PyObject *handle, *length_obj;
    long long length;
    if (!PyArg_ParseTuple(args, "OO", &handle, &length_obj)) return NULL;
    if (kv_py_length_arg(length_obj, "truncate(seq, length): length", &length) < 0) return NULL;
    int seq = ready_slot(self, handle);
    if (seq < 0) return NULL;
    /* the core takes an int: a length beyond one is refused all the same, never wrapped */
    int n = length > INT_MAX ? INT_MAX : length < INT_MIN ? INT_MIN : (int)length;
    kv_status status = is_pool(self) ? kv_pool_truncate(&((PoolObject *)self)->pool, seq, n)
                                     : kv_blocks_truncate(self->blocks, seq, n);
    if (status == KV_OK) Py_RETURN_NONE;
    int current = self->blocks->seqs[seq].length;
    if (status == KV_ERR_INVALID_ARG && length >= 0 && length <= current &&
        self->blocks->seqs[seq].compacted)
        return kv_py_raise(status, "truncate(seq, %lld): the rows past %lld do not hold the "
                           "newest positions (rows were dropped since they came), so they "
                           "cannot be taken back", length, length);
    if (status == KV_ERR_INVALID_ARG && length >= 0 && length <= current)
        return kv_py_raise(status, "truncate(seq, %lld): a pool with a residual window can only "
                           "truncate to 0: the full-precision rows of the positions before "
                           "the cut are gone", length);
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "truncate(seq, %lld): length must be between 0 and the "
                           "sequence's length %d", length, current);
    return kv_py_blocks_refused(self, status, 0);
}

static PyObject *blocks_stats(BlocksObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    kv_pool_stats st;
    kv_blocks_stats(self->blocks, &st);
    return Py_BuildValue("{s:i,s:i,s:i,s:L,s:L,s:i,s:L,s:L}", "blocks_used", st.blocks_used,
                         "blocks_free", st.blocks_free, "blocks_cached", st.blocks_cached,
                         "tokens_stored", (long long)st.tokens_stored, "slots_unused",
                         (long long)st.slots_unused, "n_sequences", st.n_sequences,
                         "prefix_hits", (long long)st.prefix_hits, "prefix_misses",
                         (long long)st.prefix_misses);
}

static PyObject *blocks_check(BlocksObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    char message[256];
    kv_status status = kv_blocks_check(self->blocks, message, sizeof message);
    if (status == KV_ERR_CORRUPT)
        return kv_py_raise(status, "pool invariant broken: %s", message);
    if (status != KV_OK) return kv_py_raise(status, NULL);
    Py_RETURN_NONE;
}

static PyObject *blocks_sequences(BlocksObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    PyObject *list = PyList_New(0);
    for (int s = 0; list != NULL && s < self->blocks->max_seqs; s++) {
        if (!self->blocks->seqs[s].alive) continue;
        PyObject *handle = kv_py_new_sequence_handle(self, s);
        if (handle == NULL || PyList_Append(list, handle) < 0) Py_CLEAR(list);
        Py_XDECREF(handle);
    }
    return list;
}

/* One recorded event as the engine's trace writes it (see kvlab/engine.py). */
static PyObject *event_dict(const kv_block_event *e) {
    static const char *const names[] = {[KV_EVENT_ALLOCATED] = "allocated",
                                        [KV_EVENT_EVICTED] = "evicted",
                                        [KV_EVENT_SHARED] = "shared",
                                        [KV_EVENT_COPIED] = "copied",
                                        [KV_EVENT_RELEASED] = "released",
                                        [KV_EVENT_FREED] = "freed"};
    PyObject *d = Py_BuildValue("{s:s,s:i}", "event", names[e->kind], "block", e->block);
    int failed = d == NULL;
    #define PUT(key, value)                                                    \
        do {                                                                   \
            PyObject *v = (value);                                             \
            failed = failed || v == NULL || PyDict_SetItemString(d, key, v) < 0; \
            Py_XDECREF(v);                                                     \
        } while (0)
    if (!failed && e->kind != KV_EVENT_EVICTED && e->kind != KV_EVENT_FREED)
        PUT("refs", PyLong_FromLong(e->refs));
    if (!failed && e->kind == KV_EVENT_FREED)
        PUT("to", PyUnicode_FromString(e->cached ? "cached" : "free"));
    if (!failed && e->kind == KV_EVENT_COPIED) PUT("from", PyLong_FromLong(e->other));
    if (!failed && e->kind == KV_EVENT_SHARED && e->other >= 0)
        PUT("replaces", PyLong_FromLong(e->other));
    if (!failed && e->prefix_hit) PUT("prefix_hit", Py_NewRef(Py_True));
    if (!failed && e->seq >= 0) {
        PUT("seq", PyLong_FromLong(e->seq));
        PUT("index", PyLong_FromLong(e->index));
    }
    #undef PUT
    if (failed) Py_CLEAR(d);
    return d;
}

static PyObject *blocks_take_events(BlocksObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_blocks_ready(self) < 0) return NULL;
    kv_blocks *p = self->blocks;
    if (p->events_lost) {
        p->events_lost = 0;
        p->n_events = 0;
        PyErr_SetString(PyExc_MemoryError, "the pool ran out of memory recording block events: "
                        "some are missing, so the ones recorded were dropped too");
        return NULL;
    }
    PyObject *list = PyList_New((Py_ssize_t)p->n_events);
    for (size_t i = 0; list != NULL && i < p->n_events; i++) {
        PyObject *event = event_dict(&p->events[i]);
        if (event == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, event);
    }
    if (list != NULL) p->n_events = 0;       /* taken only once they are all in the list */
    return list;
}

static PyGetSetDef blocks_getset[] = {
    {"ref_counts", (getter)blocks_get_ref_counts, NULL, "Block-table references per block (view).", NULL},
    {"fill", (getter)blocks_get_fill, NULL, "Rows written per block (view).", NULL},
    {"block_tokens", (getter)blocks_get_block_tokens, NULL,
     "Token id of every written row, (num_blocks, block_size) (view).", NULL},
    {"prefix_parents", (getter)blocks_get_prefix_parents, NULL,
     "Per block, what the prefix cache finds by tokens: the block before it in its chain\n"
     "(-1: a chain's first), or -2 if the cache cannot find it (a new array).", NULL},
    {"free_blocks", (getter)blocks_get_free_blocks, NULL, "Free block ids, next to be used last.", NULL},
    {"cached_blocks", (getter)blocks_get_cached_blocks, NULL,
     "Unreferenced blocks kept for prefix reuse, least recently used first.", NULL},
    {"num_blocks", (getter)blocks_get_num_blocks, NULL, NULL, NULL},
    {"block_size", (getter)blocks_get_block_size, NULL, NULL, NULL},
    {"max_seqs", (getter)blocks_get_max_seqs, NULL, NULL, NULL},
    {"max_blocks_per_seq", (getter)blocks_get_max_blocks_per_seq, NULL, NULL, NULL},
    {"live_sequences", (getter)blocks_get_live_sequences, NULL,
     "Sequences alive in the pool (at most max_seqs).", NULL},
    {"available_blocks", (getter)blocks_get_available_blocks, NULL,
     "Blocks that can be handed out now: free ones and cached ones (evicted if needed).", NULL},
    {"record_events", (getter)blocks_get_record_events, (setter)blocks_set_record_events,
     "True while every block event is recorded for take_events() (the engine's trace).\n"
     "Setting it False drops the events not taken.", NULL},
    {NULL}
};

static PyMethodDef blocks_methods[] = {
    {"new_sequence", (PyCFunction)blocks_new_sequence, METH_NOARGS, "A new, empty sequence."},
    {"fork", (PyCFunction)blocks_fork, METH_O,
     "fork(seq): a child sharing all of seq's blocks (copy-on-write on the next write)."},
    {"free", (PyCFunction)blocks_free_sequence, METH_O,
     "free(seq): drop seq's blocks (full ones stay cached for prefix reuse)."},
    {"reuse_prefix", (PyCFunction)blocks_reuse_prefix, METH_VARARGS,
     "reuse_prefix(seq, tokens, max_tokens=len(tokens)) -> tokens reused: attach the cached\n"
     "full blocks holding the longest prefix of tokens[:max_tokens] to an empty seq."},
    {"blocks_needed", (PyCFunction)blocks_blocks_needed, METH_VARARGS,
     "blocks_needed(seq, n_tokens) -> blocks that appending n_tokens to seq would take\n"
     "(new blocks, plus one if its last block is shared and partly filled: copy-on-write)."},
    {"reserve", (PyCFunction)blocks_reserve, METH_VARARGS,
     "reserve(seq, n_tokens) -> [(dst, src, rows), ...]: blocks for n_tokens more positions\n"
     "of seq (seq.block_table grows; seq.length does not until commit). The caller copies\n"
     "rows [0, rows) of block src into block dst in its K/V storage (copy-on-write) before\n"
     "writing the new rows. Raises OutOfBlocks or CacheFullError, changing nothing."},
    {"commit", (PyCFunction)blocks_commit, METH_VARARGS,
     "commit(seq, tokens): the rows reserve() made room for are written: records their\n"
     "tokens, advances seq.length, and offers full blocks to the prefix cache."},
    {"cancel", (PyCFunction)blocks_cancel, METH_O,
     "cancel(seq): instead of commit, when the rows reserve() made room for were not written:\n"
     "the blocks it took go back and a copy-on-write is undone (seq reads the shared block\n"
     "again, the copy is freed), so seq and the pool are as before the reserve; unless the\n"
     "shared block changed since (freed and taken again, or cut and rewritten by its other\n"
     "reader), when seq keeps the copy. Does nothing if no reservation is pending."},
    {"truncate", (PyCFunction)blocks_truncate, METH_VARARGS,
     "truncate(seq, length): forget seq's positions from length on (its blocks past the new\n"
     "end are released; a block cut in two keeps the rows before the cut). The rollback of\n"
     "speculative decoding's refused drafts, as KVCache.truncate is."},
    {"stats", (PyCFunction)blocks_stats, METH_NOARGS, "Counts of blocks, rows and prefix hits."},
    {"check", (PyCFunction)blocks_check, METH_NOARGS,
     "Verify every invariant; raises PoolInvariantError if one is broken."},
    {"sequences", (PyCFunction)blocks_sequences, METH_NOARGS, "Handles of every live sequence."},
    {"take_events", (PyCFunction)blocks_take_events, METH_NOARGS,
     "The block events recorded since the last call (record_events), oldest first, as\n"
     "dicts: {'event': 'allocated'|'evicted'|'shared'|'copied'|'released'|'freed',\n"
     "'block': id, 'refs': references after it, ...}; see kvlab.engine's trace."},
    {NULL}
};

PyTypeObject kv_py_blocks_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.BlockManager",
    .tp_doc = PyDoc_STR("BlockManager(num_blocks, block_size, max_seqs=256,\n"
                        "             max_blocks_per_seq=num_blocks, hash_bits=64,\n"
                        "             prefix_cache=True)\n\n"
                        "A paged pool's bookkeeping alone: block tables, reference counts,\n"
                        "the free stack and the prefix cache, and no K or V. reserve() says\n"
                        "which rows to copy; the owner of the rows copies them. PagedPool is\n"
                        "one with the C core's K/V stores."),
    .tp_basicsize = sizeof(BlocksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = blocks_new,
    .tp_init = (initproc)blocks_init,
    .tp_dealloc = (destructor)blocks_dealloc,
    .tp_methods = blocks_methods,
    .tp_getset = blocks_getset,
};

/* ---- PagedSequence ----------------------------------------------------------------- */

/* Handles take part in garbage collection: a pool subclass that keeps handles in its own
 * attributes makes a cycle (pool -> handle -> pool), which the collector must see to free
 * (the pool's __dict__ is cleared to break it, so a handle needs no tp_clear). */
static int sequence_traverse(SequenceObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->owner);
    return 0;
}

static void sequence_dealloc(SequenceObject *self) {
    PyObject_GC_UnTrack(self);
    Py_XDECREF(self->owner);
    PyObject_GC_Del(self);
}

static int sequence_alive(const SequenceObject *self) {
    const kv_seq *q = &self->owner->blocks->seqs[self->seq];
    return q->alive && q->serial == self->serial;
}

static PyObject *sequence_get_alive(SequenceObject *self, void *closure) {
    return PyBool_FromLong(sequence_alive(self));
}

static PyObject *sequence_get_length(SequenceObject *self, void *closure) {
    if (kv_py_sequence_slot(self->owner, (PyObject *)self) < 0) return NULL;
    return PyLong_FromLong(self->owner->blocks->seqs[self->seq].length);
}

static PyObject *sequence_get_next_position(SequenceObject *self, void *closure) {
    if (kv_py_sequence_slot(self->owner, (PyObject *)self) < 0) return NULL;
    return PyLong_FromLong(self->owner->blocks->seqs[self->seq].next_position);
}

static PyObject *sequence_get_start(SequenceObject *self, void *closure) {
    if (kv_py_sequence_slot(self->owner, (PyObject *)self) < 0) return NULL;
    return PyLong_FromLong(self->owner->blocks->seqs[self->seq].start);
}

static PyObject *sequence_get_id(SequenceObject *self, void *closure) {
    return PyLong_FromLong(self->seq);
}

static PyObject *sequence_get_serial(SequenceObject *self, void *closure) {
    return PyLong_FromUnsignedLong(self->serial);
}

static PyObject *sequence_get_pool(SequenceObject *self, void *closure) {
    return Py_NewRef((PyObject *)self->owner);
}

static PyObject *sequence_get_block_table(SequenceObject *self, void *closure) {
    if (kv_py_sequence_slot(self->owner, (PyObject *)self) < 0) return NULL;
    const kv_seq *q = &self->owner->blocks->seqs[self->seq];
    npy_intp dims[1] = {q->n_blocks};
    return blocks_view(self->owner, q->block_table, NPY_INT32, 1, dims);
}

static PyObject *sequence_repr(SequenceObject *self) {
    if (!sequence_alive(self)) return PyUnicode_FromFormat("PagedSequence(id=%d, freed)", self->seq);
    const kv_seq *q = &self->owner->blocks->seqs[self->seq];
    return PyUnicode_FromFormat("PagedSequence(id=%d, length=%d, blocks=%d)", self->seq,
                                q->length, q->n_blocks);
}

static PyGetSetDef sequence_getset[] = {
    {"length", (getter)sequence_get_length, NULL, "Rows filled (positions, unless the pool's "
     "keep() dropped some).", NULL},
    {"next_position", (getter)sequence_get_next_position, NULL,
     "Position of the next token (its RoPE angle): length, plus every row keep() dropped.", NULL},
    {"block_table", (getter)sequence_get_block_table, NULL,
     "Physical block id of each logical block, an int32 read-only view. Row i (position i\n"
     "until keep() drops rows) lives in row (start + i) % block_size of block\n"
     "block_table[(start + i) // block_size].", NULL},
    {"start", (getter)sequence_get_start, NULL,
     "Rows of its first block before its row 0: the rows keep() dropped from its front\n"
     "without moving the rest (a sliding window), below block_size; 0 until then.", NULL},
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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)sequence_traverse,
    .tp_dealloc = (destructor)sequence_dealloc,
    .tp_repr = (reprfunc)sequence_repr,
    .tp_getset = sequence_getset,
};
