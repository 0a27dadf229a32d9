/* row_store.c: a PagedPool whose rows live in a Python object: the GPU's memory, through
 * kvlab._cuda.KVStore (kvlab.cuda.CudaPagedPool), or a NumPy stand-in in the tests.
 *
 * The core keeps such a pool's books exactly as it keeps the CPU pool's (csrc/paged.c,
 * swap.c: which slots, which copies, what a refusal leaves unchanged) and asks a
 * kv_row_store to move the rows. The kv_row_store made here calls the object's methods:
 *   copy_rows(dst, src, n)            copy-on-write: n rows, every layer and KV head, K and V
 *   write(slots, keys, values)        rows (n, n_layers, n_kv_heads, head_dim) float32,
 *                                     quantized into slots (int64 (n,))
 *   read(slots) -> (key_codes, key_scales, value_codes, value_scales)    as stored:
 *                                     codes uint8 (n_layers, n, n_kv_heads, head_bytes),
 *                                     scales float32 (n_layers, n, n_kv_heads, groups) or None
 *   put(slots, key_codes, key_scales, value_codes, value_scales)         and back
 * Each array the object returns is checked before its bytes are used. An exception it
 * raises stays set, and the core's call returns KV_ERR_STORE, which kv_py_raise leaves
 * alone. The store's functions may run with the GIL released (a swap): each takes it.
 *
 * Here too: the pool's side of a forward pass that the GPU runs (_reserve_batch,
 * _commit_batch, _cancel_batch, see kvlab/cuda.py) and the views of its rows (copies).
 */
#include "binding.h"

#include <limits.h>
#include <stdarg.h>
#include <string.h>

#include "common.h"     /* kv_ceil_div */
#include "paged.h"
#include "store.h"

/* ---- the kv_row_store over a Python object ---------------------------------------------- */

static const kv_pool *pool_of(void *ctx) { return &((PoolObject *)ctx)->pool; }

/* A new int64 array holding slots[0 .. n - 1] (the object may keep it: a copy). */
static PyObject *slot_array(const int64_t *slots, int n) {
    npy_intp dims[1] = {n};
    PyObject *array = PyArray_SimpleNew(1, dims, NPY_INT64);
    if (array != NULL) memcpy(PyArray_DATA((PyArrayObject *)array), slots, (size_t)n * 8);
    return array;
}

/* A new float32 array (n, n_layers, n_kv_heads, head_dim) holding rows. */
static PyObject *row_array(const kv_pool *p, const float *rows, int n) {
    npy_intp dims[4] = {n, p->n_layers, p->n_kv_heads, p->head_dim};
    PyObject *array = PyArray_SimpleNew(4, dims, NPY_FLOAT32);
    if (array != NULL)
        memcpy(PyArray_DATA((PyArrayObject *)array), rows, (size_t)PyArray_NBYTES((PyArrayObject *)array));
    return array;
}

/* store.name(format, ...), its result dropped: KV_OK, or KV_ERR_STORE with its exception
 * set. The pool is marked busy meanwhile: the GPU's methods let go of the GIL while the
 * device works, and another thread must not use the pool in between (one thread at a
 * time, as for the CPU pool, whose calls hold the GIL or mark it busy). */
static kv_status call_store(void *ctx, const char *name, const char *format, ...) {
    PoolObject *self = ctx;
    va_list args;
    va_start(args, format);
    PyObject *method = PyObject_GetAttrString(self->store, name);
    PyObject *arguments = method ? Py_VaBuildValue(format, args) : NULL;
    va_end(args);
    int was_busy = self->base.busy;
    self->base.busy = 1;
    PyObject *result = arguments ? PyObject_CallObject(method, arguments) : NULL;
    self->base.busy = was_busy;
    Py_XDECREF(method);
    Py_XDECREF(arguments);
    Py_XDECREF(result);
    return result != NULL ? KV_OK : KV_ERR_STORE;
}

static kv_status py_copy(void *ctx, size_t dst, size_t src, size_t n_rows) {
    PyGILState_STATE gil = PyGILState_Ensure();
    kv_status status = call_store(ctx, "copy_rows", "(nnn)", (Py_ssize_t)dst, (Py_ssize_t)src,
                                  (Py_ssize_t)n_rows);
    PyGILState_Release(gil);
    return status;
}

static kv_status py_write(void *ctx, const int64_t *slots, int n, const float *keys,
                          const float *values) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *s = slot_array(slots, n), *k = row_array(pool_of(ctx), keys, n);
    PyObject *v = row_array(pool_of(ctx), values, n);
    kv_status status = s && k && v ? call_store(ctx, "write", "(OOO)", s, k, v) : KV_ERR_STORE;
    Py_XDECREF(s);
    Py_XDECREF(k);
    Py_XDECREF(v);
    PyGILState_Release(gil);
    return status;
}

/* One part (codes, or scales) of n rows between a host kv_store's layout (n_layers,
 * n_kv_heads, n, width bytes) and the object's arrays' (n_layers, n, n_kv_heads, width).
 * memcpy throughout: a host store may lie unaligned in a swap buffer. */
static void transpose_part(uint8_t *host, uint8_t *array, int n_layers, int n_heads, int n,
                           size_t width, int to_array) {
    for (int layer = 0; layer < n_layers; layer++)
        for (int head = 0; head < n_heads; head++)
            for (int t = 0; t < n; t++) {
                uint8_t *h = host + (((size_t)layer * n_heads + head) * n + t) * width;
                uint8_t *a = array + (((size_t)layer * n + t) * n_heads + head) * width;
                memcpy(to_array ? a : h, to_array ? h : a, width);
            }
}

/* Checks one part the object's read() returned: codes (scales 0) or scales of `s`'s
 * format for n rows; None where the format has no scales. NULL with an exception. */
static PyArrayObject *returned_part(PyObject *obj, const kv_store *s, int n, int scales,
                                    const char *name) {
    if (scales && s->groups_per_head == 0) {
        if (obj == Py_None) return (PyArrayObject *)obj;
        PyErr_Format(PyExc_TypeError, "the pool's store returned %s for a format without "
                     "scales (None expected)", name);
        return NULL;
    }
    return kv_py_array(obj, &(kv_py_array_spec){
        .name = name, .type = scales ? NPY_FLOAT32 : NPY_UINT8, .ndim = 4,
        .shape = {s->n_layers, n, s->n_kv_heads,
                  scales ? s->groups_per_head : (npy_intp)s->head_bytes},
        .axes = scales ? "n_layers,n,n_kv_heads,groups" : "n_layers,n,n_kv_heads,head_bytes"});
}

static kv_status py_read(void *ctx, const int64_t *slots, int n, const kv_store *key,
                         const kv_store *value) {
    static const char *const names[4] = {"read()'s key codes", "read()'s key scales",
                                         "read()'s value codes", "read()'s value scales"};
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *s = slot_array(slots, n);
    PoolObject *self = ctx;
    int was_busy = self->base.busy;   /* (as call_store) */
    self->base.busy = 1;
    PyObject *parts = s ? PyObject_CallMethod(self->store, "read", "O", s) : NULL;
    self->base.busy = was_busy;
    kv_status status = KV_ERR_STORE;
    if (parts != NULL && (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) != 4)) {
        PyErr_SetString(PyExc_TypeError, "the pool's store's read() must return a tuple of "
                        "four: key codes, key scales, value codes, value scales");
    } else if (parts != NULL) {
        PyArrayObject *arrays[4];
        const kv_store *stores[2] = {key, value};
        int ok = 1;
        for (int i = 0; i < 4 && ok; i++)
            ok = (arrays[i] = returned_part(PyTuple_GET_ITEM(parts, i), stores[i / 2], n, i % 2,
                                            names[i])) != NULL;
        for (int i = 0; i < 4 && ok; i++) {
            const kv_store *h = stores[i / 2];
            if ((PyObject *)arrays[i] == Py_None) continue;
            transpose_part(i % 2 ? (uint8_t *)h->scales : h->codes,
                           (uint8_t *)PyArray_DATA(arrays[i]), h->n_layers, h->n_kv_heads, n,
                           i % 2 ? h->groups_per_head * sizeof(float) : h->head_bytes, 0);
        }
        if (ok) status = KV_OK;
    }
    Py_XDECREF(parts);
    Py_XDECREF(s);
    PyGILState_Release(gil);
    return status;
}

/* A new array of one part of a host store's n rows in the object's layout, or None. */
static PyObject *part_array(const kv_store *h, int n, int scales) {
    if (scales && h->groups_per_head == 0) Py_RETURN_NONE;
    size_t width = scales ? h->groups_per_head * sizeof(float) : h->head_bytes;
    npy_intp dims[4] = {h->n_layers, n, h->n_kv_heads,
                        scales ? h->groups_per_head : (npy_intp)h->head_bytes};
    PyObject *array = PyArray_SimpleNew(4, dims, scales ? NPY_FLOAT32 : NPY_UINT8);
    if (array != NULL)
        transpose_part(scales ? (uint8_t *)h->scales : h->codes,
                       (uint8_t *)PyArray_DATA((PyArrayObject *)array), h->n_layers,
                       h->n_kv_heads, n, width, 1);
    return array;
}

static kv_status py_put(void *ctx, const int64_t *slots, int n, const kv_store *key,
                        const kv_store *value) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *s = slot_array(slots, n);
    PyObject *kc = part_array(key, n, 0), *ks = part_array(key, n, 1);
    PyObject *vc = part_array(value, n, 0), *vs = part_array(value, n, 1);
    kv_status status = s && kc && ks && vc && vs
                           ? call_store(ctx, "put", "(OOOOO)", s, kc, ks, vc, vs)
                           : KV_ERR_STORE;
    Py_XDECREF(s);
    Py_XDECREF(kc);
    Py_XDECREF(ks);
    Py_XDECREF(vc);
    Py_XDECREF(vs);
    PyGILState_Release(gil);
    return status;
}

int kv_py_row_store_init(PoolObject *self, PyObject *store, const kv_cache_format *format) {
    if (format->window != 0 || format->key_format == KV_FMT_I4 ||
        format->value_format == KV_FMT_I4) {
        PyErr_SetString(PyExc_ValueError, "a PagedPool whose rows live in a store (store=...) "
                        "has no residual window and no int4 (a store keeps codes and scales "
                        "only): give window=0 and another format");
        return -1;
    }
    static const char *const methods[] = {"copy_rows", "write", "read", "put"};
    for (int i = 0; i < 4; i++) {
        PyObject *method = PyObject_GetAttrString(store, methods[i]);
        if (method == NULL || !PyCallable_Check(method)) {
            Py_XDECREF(method);
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "store must have the methods copy_rows, write, read "
                         "and put (a kvlab._cuda.KVStore), got a %s without %s",
                         Py_TYPE(store)->tp_name, methods[i]);
            return -1;
        }
        Py_DECREF(method);
    }
    Py_XSETREF(self->store, Py_NewRef(store));
    self->row_store = (kv_row_store){self, py_copy, py_write, py_read, py_put};
    return 0;
}

/* ---- views: the rows copied out of the store -------------------------------------------- */

PyObject *kv_py_row_store_copy(PoolObject *self, kv_store *key, kv_store *value) {
    const kv_pool *p = &self->pool;
    size_t slots = p->key.slots;
    if (slots > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "this pool's %zu rows are too many to copy at once",
                     slots);
        return NULL;
    }
    npy_intp dims[1] = {(npy_intp)kv_pool_host_rows(p, (int)slots, NULL, NULL, NULL)};
    PyObject *rows = PyArray_SimpleNew(1, dims, NPY_UINT8);
    int64_t *all = PyMem_Malloc(slots * sizeof(int64_t));
    if (rows == NULL || all == NULL) {
        Py_XDECREF(rows);
        PyMem_Free(all);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < slots; i++) all[i] = (int64_t)i;
    kv_pool_host_rows(p, (int)slots, PyArray_DATA((PyArrayObject *)rows), key, value);
    kv_status status = p->row_store->read(p->row_store->ctx, all, (int)slots, key, value);
    PyMem_Free(all);
    if (status == KV_OK) return rows;
    Py_DECREF(rows);
    return kv_py_raise(status, NULL);
}

/* ---- a forward pass run by the GPU: reserve, (its forward), commit or cancel ------------ */

/* A batch's arguments: the slots of seqs (PagedSequence handles of this pool) and their
 * counts (int32 (len(seqs),)), into PyMem buffers *slots and *counts. -1 with an exception. */
static int batch_arguments(PoolObject *self, PyObject *seqs_obj, PyObject *counts_obj,
                           int **slots, int **counts, Py_ssize_t *n_seqs) {
    *slots = *counts = NULL;
    PyObject *seqs = PySequence_Fast(seqs_obj, "seqs must be a list of PagedSequence handles");
    if (seqs == NULL) return -1;
    *n_seqs = PySequence_Fast_GET_SIZE(seqs);
    int status = -1;
    PyArrayObject *count_array = NULL;   /* none for a cancel */
    if (*n_seqs < 1 || *n_seqs > self->pool.blocks.max_seqs) {
        PyErr_Format(PyExc_ValueError, "seqs must hold 1 to max_seqs=%d sequences, got %zd",
                     self->pool.blocks.max_seqs, *n_seqs);
        goto done;
    }
    if (counts_obj != NULL) {
        count_array = kv_py_array(counts_obj, &(kv_py_array_spec){
            .name = "n_tokens", .type = NPY_INT32, .ndim = 1, .shape = {*n_seqs},
            .axes = "len(seqs)"});
        if (count_array == NULL) goto done;
    }
    *slots = PyMem_Malloc((size_t)*n_seqs * sizeof(int));
    *counts = PyMem_Malloc((size_t)*n_seqs * sizeof(int));
    if (*slots == NULL || *counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < *n_seqs; i++) {
        (*slots)[i] = kv_py_sequence_slot(&self->base, PySequence_Fast_GET_ITEM(seqs, i));
        if ((*slots)[i] < 0) goto done;
        (*counts)[i] = count_array ? ((const int32_t *)PyArray_DATA(count_array))[i] : 0;
    }
    status = 0;
done:
    Py_DECREF(seqs);
    if (status < 0) {
        PyMem_Free(*slots);
        PyMem_Free(*counts);
        *slots = *counts = NULL;
    }
    return status;
}

/* The core refused a batch: which sequence, or the pool's own words. NULL. */
static PyObject *batch_refused(PoolObject *self, kv_status status, const int *slots,
                               const int *counts, Py_ssize_t n_seqs) {
    long long total = 0;
    for (Py_ssize_t i = 0; i < n_seqs; i++) total += counts[i];
    if (status != KV_ERR_INVALID_ARG)   /* (pool.c's words for these: the block manager's) */
        return kv_py_blocks_refused(&self->base, status, total > INT_MAX ? INT_MAX : (int)total);
    char too_many[64];                  /* (no % left in it: it is kv_py_raise's format) */
    snprintf(too_many, sizeof too_many, "a batch holds at most %d tokens, got %lld",
             KV_MAX_TOKENS_PER_CALL, total);
    return kv_py_batch_refused(status, slots, counts, n_seqs, too_many);
}

/* The reservation's arrays, made before it (so that nothing fails after it): starts int32
 * (n,), tables int32 (n, max_blocks), slots int64 (sum of counts,). */
static PyObject *batch_arrays(const kv_pool *p, const int *seqs, const int *counts,
                              Py_ssize_t n_seqs) {
    npy_intp total = 0, max_blocks = 1, bs = p->blocks.block_size;
    for (Py_ssize_t i = 0; i < n_seqs; i++) {
        const kv_seq *q = &p->blocks.seqs[seqs[i]];   /* (its start is 0: it drops no row) */
        npy_intp blocks = (npy_intp)kv_ceil_div((int64_t)q->start + q->length + counts[i], bs);
        total += counts[i];
        if (blocks > max_blocks) max_blocks = blocks;
    }
    npy_intp run_dims[1] = {n_seqs}, table_dims[2] = {n_seqs, max_blocks}, slot_dims[1] = {total};
    return Py_BuildValue("(NNN)", PyArray_SimpleNew(1, run_dims, NPY_INT32),
                         PyArray_SimpleNew(2, table_dims, NPY_INT32),
                         PyArray_SimpleNew(1, slot_dims, NPY_INT64));
}

static int held(PoolObject *self) { return self->base.busy; }

/* Rows reserved and not committed, over every sequence of the pool: while a batch is held
 * these are exactly that batch's, so a commit must name all of them, not some. */
static long long reserved_rows(const kv_blocks *blocks) {
    long long total = 0;
    for (int s = 0; s < blocks->max_seqs; s++)
        if (blocks->seqs[s].alive) total += blocks->seqs[s].reserved;
    return total;
}

/* Gives back every reservation the pool holds: the held batch is the pool's one batch,
 * whichever sequences a failing caller still knows of. */
static void cancel_every_reservation(kv_pool *pool) {
    for (int s = 0; s < pool->blocks.max_seqs; s++)
        if (pool->blocks.seqs[s].alive && pool->blocks.seqs[s].reserved > 0)
            kv_pool_cancel_batch(pool, 1, &s);
}

PyObject *kv_py_pool_reserve_batch(PoolObject *self, PyObject *args) {
    PyObject *seqs_obj, *counts_obj;
    if (!PyArg_ParseTuple(args, "OO", &seqs_obj, &counts_obj)) return NULL;
    if (kv_py_blocks_ready(&self->base) < 0) return NULL;   /* (initialized: seqs exist) */
    if (self->pool.row_store == NULL) {
        PyErr_SetString(PyExc_TypeError, "_reserve_batch is for a pool whose rows a store holds "
                        "(the GPU's); the CPU's forward_batch reserves its own");
        return NULL;
    }
    int *slots, *counts;
    Py_ssize_t n;
    if (batch_arguments(self, seqs_obj, counts_obj, &slots, &counts, &n) < 0) return NULL;
    PyObject *result = NULL;
    kv_status status = kv_pool_check_batch(&self->pool, (int)n, slots, counts);
    if (status != KV_OK) {
        batch_refused(self, status, slots, counts, n);
        goto done;
    }
    if ((result = batch_arrays(&self->pool, slots, counts, n)) == NULL) goto done;
    PyArrayObject *tables = (PyArrayObject *)PyTuple_GET_ITEM(result, 1);
    status = kv_pool_reserve_batch(
        &self->pool, (int)n, slots, counts, (int)PyArray_DIM(tables, 1),
        (int32_t *)PyArray_DATA((PyArrayObject *)PyTuple_GET_ITEM(result, 0)),
        (int32_t *)PyArray_DATA(tables),
        (int64_t *)PyArray_DATA((PyArrayObject *)PyTuple_GET_ITEM(result, 2)));
    if (status != KV_OK) {   /* a row store's copy-on-write failed (checked before) */
        Py_CLEAR(result);
        batch_refused(self, status, slots, counts, n);
        goto done;
    }
    self->base.busy = 1;   /* held by this forward pass until its commit or cancel */
done:
    PyMem_Free(slots);
    PyMem_Free(counts);
    return result;
}

PyObject *kv_py_pool_commit_batch(PoolObject *self, PyObject *args) {
    PyObject *seqs_obj, *tokens_obj, *counts_obj;
    if (!PyArg_ParseTuple(args, "OOO", &seqs_obj, &tokens_obj, &counts_obj)) return NULL;
    if (!held(self)) {
        PyErr_SetString(PyExc_RuntimeError, "_commit_batch: no batch was reserved");
        return NULL;
    }
    int *slots, *counts;
    Py_ssize_t n;
    if (batch_arguments(self, seqs_obj, counts_obj, &slots, &counts, &n) < 0) return NULL;
    long long total = 0;
    int reserved = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        total += counts[i];
        reserved &= counts[i] >= 1 && self->pool.blocks.seqs[slots[i]].reserved == counts[i];
    }
    PyArrayObject *tokens = kv_py_array(tokens_obj, &(kv_py_array_spec){
        .name = "tokens", .type = NPY_INT32, .ndim = 1, .shape = {(npy_intp)total},
        .axes = "sum(n_tokens)"});
    reserved &= total == reserved_rows(&self->pool.blocks);   /* and no sequence left out */
    if (tokens != NULL && !reserved)
        PyErr_SetString(PyExc_ValueError, "_commit_batch: these are not the sequences and "
                        "counts that _reserve_batch reserved");
    if (tokens != NULL && reserved) {
        kv_pool_commit_batch(&self->pool, (int)n, slots, counts,
                             (const int32_t *)PyArray_DATA(tokens));
        self->base.busy = 0;
    }
    PyMem_Free(slots);
    PyMem_Free(counts);
    if (tokens == NULL || !reserved) return NULL;
    Py_RETURN_NONE;
}

PyObject *kv_py_pool_cancel_batch(PoolObject *self, PyObject *seqs_obj) {
    if (!held(self)) Py_RETURN_NONE;   /* committed already, or never reserved: nothing held */
    int *slots, *counts;
    Py_ssize_t n;
    if (batch_arguments(self, seqs_obj, NULL, &slots, &counts, &n) < 0) return NULL;
    cancel_every_reservation(&self->pool);
    self->base.busy = 0;
    PyMem_Free(slots);
    PyMem_Free(counts);
    Py_RETURN_NONE;
}
