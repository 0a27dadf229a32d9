/* _kvlab.c: the Python binding of the kvlab core; the ONLY file that includes Python.h.
 *
 * It defines Model (weights borrowed from NumPy arrays it keeps alive), KVCache (a
 * contiguous cache owned by the C core), PagedPool and PagedSequence (the paged cache and
 * handles to its sequences), plus thread-count functions. Every argument is
 * checked here (dtype, shape, contiguity, ranges) before the core sees a pointer, the
 * GIL is released around forward passes, and each kv_status becomes a Python exception
 * from kvlab.errors. Nothing here does arithmetic: that is the core's job.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <math.h>
#include <string.h>

#include "kvlab.h"
#include "model_args.h"
#include "quant.h"
#include "sampling.h"
#include "store.h"

/* kvlab.errors classes, looked up once at import. */
static PyObject *CacheFullError;
static PyObject *ConfigError;
static PyObject *WeightsError;
static PyObject *OutOfBlocks;
static PyObject *OutOfSequences;
static PyObject *PoolInvariantError;

/* Raises the Python exception that matches a failed kv_status. */
/* PyErr_Format knows no floating-point conversions (it would print the directive as is):
 * messages that show a double format it here first. */
static void raise_value_error_with_number(const char *before, double value, const char *after) {
    char number[64];
    PyOS_snprintf(number, sizeof number, "%.17g", value);
    PyErr_Format(PyExc_ValueError, "%s%s%s", before, number, after);
}

/* A long call over the model asks this between chunks and steps (kv_set_interrupt_check),
 * with the GIL released: it takes the GIL back for a moment and runs Python's signal
 * handlers, so Ctrl-C raises KeyboardInterrupt within a fraction of a second. `arg` is the
 * thread state Py_BEGIN_ALLOW_THREADS saved (its _save), which it updates. Whatever a
 * handler raises stays set for the caller to return. */
static int python_signals_pending(void *arg) {
    PyThreadState **saved = arg;
    PyEval_RestoreThread(*saved);
    int raised = PyErr_CheckSignals() < 0;
    *saved = PyEval_SaveThread();
    return raised;
}

/* The exception for a call that stopped because a signal handler raised: the one it
 * raised (normally KeyboardInterrupt). */
static PyObject *raise_interrupted(void) {
    if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
    return NULL;
}

static PyObject *raise_status(kv_status status) {
    switch (status) {
        case KV_ERR_NOMEM: return PyErr_NoMemory();
        case KV_ERR_CACHE_FULL:
        case KV_ERR_TABLE_FULL: PyErr_SetString(CacheFullError, kv_strerror(status)); break;
        case KV_ERR_OUT_OF_BLOCKS: PyErr_SetString(OutOfBlocks, kv_strerror(status)); break;
        case KV_ERR_TOO_MANY_SEQUENCES: PyErr_SetString(OutOfSequences, kv_strerror(status)); break;
        default: PyErr_SetString(PyExc_ValueError, kv_strerror(status)); break;
    }
    return NULL;
}

/* A read-only ndarray over memory that `owner` holds. Its base is the owner, so the
 * memory lives as long as any view of it. strides NULL means C order. */
static PyObject *readonly_view(PyObject *owner, void *data, int type, int ndim,
                               npy_intp *dims, npy_intp *strides) {
    /* flags without NPY_ARRAY_WRITEABLE: students may look, never poke */
    PyObject *view = PyArray_New(&PyArray_Type, ndim, dims, type, strides, data, 0,
                                 NPY_ARRAY_ALIGNED, NULL);
    if (view == NULL) return NULL;
    Py_INCREF(owner);
    /* PyArray_SetBaseObject steals the reference, even when it fails */
    if (PyArray_SetBaseObject((PyArrayObject *)view, owner) < 0) {
        Py_DECREF(view);
        return NULL;
    }
    return view;
}

/* ============================== cache formats ===================================== */

static const char *const format_names[] = {"fp32", "fp16", "bf16", "int8", "int4", "fp8"};
#define N_FORMATS ((int)(sizeof format_names / sizeof format_names[0]))

static int parse_format(const char *name, const char *what, kv_format *format) {
    for (int i = 0; i < N_FORMATS; i++) {
        if (strcmp(name, format_names[i]) == 0) {
            *format = (kv_format)i;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown %s format '%s'; known: fp32, fp16, bf16, int8, "
                 "int4, fp8", what, name);
    return -1;
}

/* Fills *format from the constructor's arguments, checking each against head_dim and
 * max_window (the most positions a window may hold); -1 with ValueError if one is wrong. */
static int make_format(kv_cache_format *format, const char *key_name, const char *value_name,
                       int key_group, int value_group, int window, int head_dim,
                       int max_window) {
    if (parse_format(key_name, "key", &format->key_format) < 0 ||
        parse_format(value_name, "value", &format->value_format) < 0)
        return -1;
    const char *names[2] = {key_name, value_name};
    int groups[2] = {key_group, value_group};
    kv_format formats[2] = {format->key_format, format->value_format};
    for (int i = 0; i < 2; i++) {
        if (kv_store_group(formats[i], groups[i], head_dim) < 0) {
            if (formats[i] <= KV_FMT_BF16)
                PyErr_Format(PyExc_ValueError, "%s has no groups: leave the %s group at 0 "
                             "(got %d)", names[i], i ? "value" : "key", groups[i]);
            else
                PyErr_Format(PyExc_ValueError, "group size %d does not suit %s with head_dim "
                             "%d: it must divide head_dim%s", groups[i], names[i], head_dim,
                             formats[i] == KV_FMT_I4 ? " and be even (two codes per byte)" : "");
            return -1;
        }
    }
    if (window < 0 || window > max_window) {
        PyErr_Format(PyExc_ValueError, "window must be between 0 and %d positions, got %d",
                     max_window, window);
        return -1;
    }
    format->key_group = key_group;
    format->value_group = value_group;
    format->window = window;
    return 0;
}

/* The NumPy type of a format's codes: float16 is NumPy's own; bf16 has no NumPy type, so
 * its codes show as the raw uint16 bits; int4 and fp8 codes are bytes. */
static int code_type(kv_format format) {
    switch (format) {
        case KV_FMT_F32: return NPY_FLOAT32;
        case KV_FMT_F16: return NPY_FLOAT16;
        case KV_FMT_BF16: return NPY_UINT16;
        case KV_FMT_I8: return NPY_INT8;
        case KV_FMT_I4:
        case KV_FMT_FP8: return NPY_UINT8;
    }
    return NPY_UINT8;
}

enum { STORE_CODES, STORE_SCALES, STORE_ZEROS };

/* A read-only zero-copy view of one part of a store (codes, scales or zero points):
 * n_lead leading axes with strides counted in head rows (see kv_store: one head row is
 * head_bytes of codes, or groups_per_head scales), then (n_kv_heads, per head).
 * None for scales or zero points a format does not have. */
static PyObject *store_view(PyObject *owner, const kv_store *store, int part, int n_lead,
                            const npy_intp *lead_dims, const npy_intp *lead_strides) {
    npy_intp dims[6], strides[6], head_row_bytes, item;
    void *data;
    int type;
    if (part == STORE_CODES) {
        type = code_type(store->format);
        item = store->format == KV_FMT_F32 ? 4 : store->format <= KV_FMT_BF16 ? 2 : 1;
        head_row_bytes = (npy_intp)store->head_bytes;
        dims[n_lead + 1] = store->format == KV_FMT_I4 ? store->head_dim / 2 : store->head_dim;
        data = store->codes;
    } else {
        float *params = part == STORE_SCALES ? store->scales : store->zeros;
        if (params == NULL) Py_RETURN_NONE;
        type = NPY_FLOAT32;
        item = sizeof(float);
        head_row_bytes = (npy_intp)store->groups_per_head * item;
        dims[n_lead + 1] = store->groups_per_head;
        data = params;
    }
    for (int i = 0; i < n_lead; i++) {
        dims[i] = lead_dims[i];
        strides[i] = lead_strides[i] * head_row_bytes;
    }
    dims[n_lead] = store->n_kv_heads;
    strides[n_lead] = (npy_intp)store->slots * head_row_bytes;   /* the next KV head */
    strides[n_lead + 1] = item;
    return readonly_view(owner, data, type, n_lead + 2, dims, strides);
}

static PyObject *format_name(kv_format format) { return PyUnicode_FromString(format_names[format]); }

/* ================================ KVCache ======================================== */

/* keys/values for append: float32 (n_tokens, n_layers, n_kv_heads, head_dim), C order */
static int check_rows(int n_layers, int n_kv_heads, int head_dim, PyObject *obj,
                      const char *what, int n_tokens) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_FLOAT32 ||
        !PyArray_ISNOTSWAPPED((PyArrayObject *)obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a float32 numpy array", what);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    npy_intp want[4] = {n_tokens, n_layers, n_kv_heads, head_dim};
    int ok = PyArray_NDIM(a) == 4;
    for (int i = 0; ok && i < 4; i++) ok = PyArray_DIM(a, i) == want[i];
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must have shape (n_tokens=%d, n_layers=%d, "
                     "n_kv_heads=%d, head_dim=%d)", what, n_tokens, n_layers, n_kv_heads,
                     head_dim);
        return -1;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous and aligned (np.require(a, requirements=[\"C\", \"A\"]) makes such a copy)", what);
        return -1;
    }
    return 0;
}


typedef struct {
    PyObject_HEAD
    kv_cache cache;
    int busy;  /* a forward pass is writing this cache with the GIL released */
} CacheObject;

static PyTypeObject CacheType;

static int refuse_if_busy(CacheObject *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this KVCache is in use by a forward pass in another thread; "
                        "give each thread its own cache");
        return -1;
    }
    return 0;
}

static int cache_init(CacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "capacity", "key_format",
                             "value_format", "key_group", "value_group", "window", NULL};
    int n_layers, n_kv_heads, head_dim, capacity, key_group = 0, value_group = 0, window = 0;
    const char *key_name = "fp32", *value_name = "fp32";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiii|ssiii", kwlist, &n_layers, &n_kv_heads,
                                     &head_dim, &capacity, &key_name, &value_name, &key_group,
                                     &value_group, &window))
        return -1;
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || capacity <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "KVCache sizes must be positive, got n_layers=%d n_kv_heads=%d "
                     "head_dim=%d capacity=%d", n_layers, n_kv_heads, head_dim, capacity);
        return -1;
    }
    if (self->cache.key.codes != NULL) {
        /* re-initializing would free memory that existing keys/values views still show */
        PyErr_SetString(PyExc_RuntimeError, "KVCache is already initialized");
        return -1;
    }
    kv_cache_format format;
    if (make_format(&format, key_name, value_name, key_group, value_group, window, head_dim,
                    capacity) < 0)
        return -1;
    kv_status status = kv_cache_init(&self->cache, n_layers, n_kv_heads, head_dim, capacity,
                                     &format);
    if (status != KV_OK) {
        raise_status(status);
        return -1;
    }
    return 0;
}

static void cache_dealloc(CacheObject *self) {
    kv_cache_free(&self->cache);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int require_initialized(CacheObject *self) {
    if (self->cache.key.codes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KVCache was not initialized");
        return -1;
    }
    return 0;
}

/* A read-only zero-copy view of one part of the K or V store, (n_layers, length,
 * n_kv_heads, per head). Its base is the cache object, so the memory stays alive as long
 * as any view of it does. */
static PyObject *cache_store_view(CacheObject *self, const kv_store *store, int part) {
    if (require_initialized(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    npy_intp lead_dims[2] = {c->n_layers, c->length};
    npy_intp lead_strides[2] = {(npy_intp)c->n_kv_heads * c->capacity, 1};  /* layer, position */
    return store_view((PyObject *)self, store, part, 2, lead_dims, lead_strides);
}

/* keys and values as numbers: the stored floats themselves for fp32 and fp16 */
static PyObject *cache_float_view(CacheObject *self, const kv_store *store, const char *what) {
    if (require_initialized(self) < 0) return NULL;
    if (store->format != KV_FMT_F32 && store->format != KV_FMT_F16) {
        PyErr_Format(PyExc_TypeError, "this cache stores its %s as %s codes, not floats: "
                     "see %s_codes and %s_scales, or dequantized() for float32 copies",
                     what, format_names[store->format], what[0] == 'k' ? "key" : "value",
                     what[0] == 'k' ? "key" : "value");
        return NULL;
    }
    return cache_store_view(self, store, STORE_CODES);
}

static PyObject *cache_get_keys(CacheObject *self, void *closure) {
    (void)closure;
    return cache_float_view(self, &self->cache.key, "keys");
}

static PyObject *cache_get_values(CacheObject *self, void *closure) {
    (void)closure;
    return cache_float_view(self, &self->cache.value, "values");
}

/* key_codes, key_scales, ... value_zeros: closure = (is_value << 2) | part */
static PyObject *cache_get_part(CacheObject *self, void *closure) {
    int which = (int)(intptr_t)closure;
    return cache_store_view(self, (which >> 2) ? &self->cache.value : &self->cache.key,
                            which & 3);
}

static PyObject *cache_get_format(CacheObject *self, void *closure) {
    if (require_initialized(self) < 0) return NULL;
    const kv_store *store = closure ? &self->cache.value : &self->cache.key;
    return format_name(store->format);
}

static PyObject *cache_get_group(CacheObject *self, void *closure) {
    const kv_store *store = closure ? &self->cache.value : &self->cache.key;
    return PyLong_FromLong(store->group);
}

static PyObject *cache_get_window(CacheObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->cache.window);
}

static PyObject *cache_dequantized(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (require_initialized(self) < 0 || refuse_if_busy(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    npy_intp dims[4] = {c->n_layers, c->length, c->n_kv_heads, c->head_dim};
    PyObject *keys = PyArray_SimpleNew(4, dims, NPY_FLOAT32);
    PyObject *values = keys ? PyArray_SimpleNew(4, dims, NPY_FLOAT32) : NULL;
    if (values == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    kv_cache_read(c, (float *)PyArray_DATA((PyArrayObject *)keys),
                  (float *)PyArray_DATA((PyArrayObject *)values));
    return Py_BuildValue("(NN)", keys, values);
}

static PyObject *cache_attend(CacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"q", "layer", NULL};
    PyObject *q_obj;
    int layer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|i", kwlist, &q_obj, &layer)) return NULL;
    if (require_initialized(self) < 0 || refuse_if_busy(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    if (!PyArray_Check(q_obj) || PyArray_TYPE((PyArrayObject *)q_obj) != NPY_FLOAT32 ||
        !PyArray_ISNOTSWAPPED((PyArrayObject *)q_obj)) {
        PyErr_SetString(PyExc_TypeError, "q must be a float32 numpy array (n_heads, head_dim)");
        return NULL;
    }
    PyArrayObject *q = (PyArrayObject *)q_obj;
    if (PyArray_NDIM(q) != 2 || PyArray_DIM(q, 1) != c->head_dim || PyArray_DIM(q, 0) < 1 ||
        PyArray_DIM(q, 0) % c->n_kv_heads != 0 ||
        (long long)PyArray_DIM(q, 0) * c->head_dim > (1 << 16)) {
        PyErr_Format(PyExc_ValueError, "q must have shape (n_heads, head_dim=%d) with n_heads "
                     "a multiple of n_kv_heads=%d", c->head_dim, c->n_kv_heads);
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(q) || !PyArray_ISALIGNED(q)) {
        PyErr_SetString(PyExc_ValueError, "q must be C-contiguous");
        return NULL;
    }
    if (layer < 0 || layer >= c->n_layers) {
        PyErr_Format(PyExc_IndexError, "layer %d out of range [0, %d)", layer, c->n_layers);
        return NULL;
    }
    if (c->length == 0) {
        PyErr_SetString(PyExc_ValueError, "the cache is empty: nothing to attend to");
        return NULL;
    }
    int n_heads = (int)PyArray_DIM(q, 0);
    PyObject *out = PyArray_SimpleNew(2, PyArray_DIMS(q), NPY_FLOAT32);
    if (out == NULL) return NULL;
    /* q is only read; a private copy keeps another thread from changing it under us */
    PyObject *q_copy = PyArray_NewCopy(q, NPY_CORDER);
    if (q_copy == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    kv_status status;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    status = kv_cache_attend(c, layer, (const float *)PyArray_DATA((PyArrayObject *)q_copy),
                             n_heads, (float *)PyArray_DATA((PyArrayObject *)out));
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(q_copy);
    if (status != KV_OK) {
        Py_DECREF(out);
        return raise_status(status);
    }
    return out;
}

static PyObject *cache_get_length(CacheObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->cache.length);
}

static PyObject *cache_get_capacity(CacheObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->cache.capacity);
}

static PyObject *cache_get_nbytes(CacheObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->cache.key.codes ? kv_cache_nbytes(&self->cache) : 0);
}

static PyObject *cache_get_shape(CacheObject *self, void *closure) {
    (void)closure;
    const kv_cache *c = &self->cache;
    return Py_BuildValue("(iiii)", c->n_layers, c->capacity, c->n_kv_heads, c->head_dim);
}

static PyObject *cache_reset(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (require_initialized(self) < 0 || refuse_if_busy(self) < 0) return NULL;
    kv_cache_truncate(&self->cache, 0);
    Py_RETURN_NONE;
}

static PyObject *cache_truncate(CacheObject *self, PyObject *arg) {
    if (require_initialized(self) < 0 || refuse_if_busy(self) < 0) return NULL;
    long length = PyLong_AsLong(arg);
    if (length == -1 && PyErr_Occurred()) return NULL;
    if (length < 0 || length > self->cache.length) {
        PyErr_Format(PyExc_ValueError,
                     "truncate(%ld): length must be between 0 and the current length %d",
                     length, self->cache.length);
        return NULL;
    }
    if (self->cache.window > 0 && length != 0 && length != self->cache.length) {
        PyErr_Format(PyExc_ValueError,
                     "truncate(%ld): a cache with a residual window can only be reset: the "
                     "full-precision rows of the positions before the cut are gone", length);
        return NULL;
    }
    kv_cache_truncate(&self->cache, (int)length);
    Py_RETURN_NONE;
}

static PyObject *cache_append(CacheObject *self, PyObject *args) {
    PyObject *keys, *values;
    if (!PyArg_ParseTuple(args, "OO", &keys, &values)) return NULL;
    if (require_initialized(self) < 0 || refuse_if_busy(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    if (!PyArray_Check(keys) || PyArray_NDIM((PyArrayObject *)keys) != 4) {
        PyErr_SetString(PyExc_ValueError, "keys must be a 4-D float32 array "
                        "(n_tokens, n_layers, n_kv_heads, head_dim)");
        return NULL;
    }
    npy_intp n = PyArray_DIM((PyArrayObject *)keys, 0);
    if (n < 1 || n > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "append needs at least one row");
        return NULL;
    }
    if (check_rows(c->n_layers, c->n_kv_heads, c->head_dim, keys, "keys", (int)n) < 0 ||
        check_rows(c->n_layers, c->n_kv_heads, c->head_dim, values, "values", (int)n) < 0)
        return NULL;
    if (n > c->capacity - c->length) {
        PyErr_Format(CacheFullError, "the KV cache is full: it holds %d of %d positions and "
                     "cannot take %zd more", c->length, c->capacity, (Py_ssize_t)n);
        return NULL;
    }
    kv_status status = kv_cache_append(&self->cache, (int)n,
                                       (const float *)PyArray_DATA((PyArrayObject *)keys),
                                       (const float *)PyArray_DATA((PyArrayObject *)values));
    if (status != KV_OK) return raise_status(status);
    Py_RETURN_NONE;
}

static PyObject *cache_repr(CacheObject *self) {
    const kv_cache *c = &self->cache;
    if (c->key.codes == NULL) return PyUnicode_FromString("KVCache(uninitialized)");
    char window[32] = "";
    if (c->window > 0) PyOS_snprintf(window, sizeof window, ", window=%d", c->window);
    if (c->key.format == c->value.format && c->key.group == c->value.group)
        return PyUnicode_FromFormat(
            "KVCache(length=%d, capacity=%d, n_layers=%d, n_kv_heads=%d, head_dim=%d, "
            "dtype=%s%s, nbytes=%zu)", c->length, c->capacity, c->n_layers, c->n_kv_heads,
            c->head_dim, format_names[c->key.format], window, kv_cache_nbytes(c));
    return PyUnicode_FromFormat(
        "KVCache(length=%d, capacity=%d, n_layers=%d, n_kv_heads=%d, head_dim=%d, "
        "key_dtype=%s, value_dtype=%s%s, nbytes=%zu)", c->length, c->capacity, c->n_layers,
        c->n_kv_heads, c->head_dim, format_names[c->key.format], format_names[c->value.format],
        window, kv_cache_nbytes(c));
}

#define PART(is_value, part) ((void *)(intptr_t)(((is_value) << 2) | (part)))
static PyGetSetDef cache_getset[] = {
    {"keys", (getter)cache_get_keys, NULL,
     "Cached keys of the filled positions, a read-only zero-copy ndarray\n"
     "(n_layers, length, n_kv_heads, head_dim), after RoPE: float32, or float16 in an fp16\n"
     "cache. Other formats store codes: see key_codes, or dequantized().", NULL},
    {"values", (getter)cache_get_values, NULL,
     "Cached values of the filled positions, a read-only zero-copy ndarray\n"
     "(n_layers, length, n_kv_heads, head_dim), as for keys.", NULL},
    {"key_codes", (getter)cache_get_part, NULL,
     "The stored key codes, zero-copy, (n_layers, length, n_kv_heads, per head): float32,\n"
     "float16, bf16 bits as uint16, int8, int4 packed two per uint8 (head_dim / 2 per head),\n"
     "or fp8 e4m3 bits as uint8.", PART(0, STORE_CODES)},
    {"key_scales", (getter)cache_get_part, NULL,
     "Scales of the key groups, zero-copy, (n_layers, length, n_kv_heads, head_dim / group);\n"
     "None for fp32, fp16 and bf16.", PART(0, STORE_SCALES)},
    {"key_zeros", (getter)cache_get_part, NULL,
     "Zero points of the key groups (int4 only, else None).", PART(0, STORE_ZEROS)},
    {"value_codes", (getter)cache_get_part, NULL, "As key_codes, for V.", PART(1, STORE_CODES)},
    {"value_scales", (getter)cache_get_part, NULL, "As key_scales, for V.", PART(1, STORE_SCALES)},
    {"value_zeros", (getter)cache_get_part, NULL, "As key_zeros, for V.", PART(1, STORE_ZEROS)},
    {"key_dtype", (getter)cache_get_format, NULL, "Element format of the keys.", NULL},
    {"value_dtype", (getter)cache_get_format, NULL, "Element format of the values.", (void *)1},
    {"key_group", (getter)cache_get_group, NULL, "Key values per scale (0: no scales).", NULL},
    {"value_group", (getter)cache_get_group, NULL, "Value values per scale.", (void *)1},
    {"window", (getter)cache_get_window, NULL,
     "Residual window: each query reads this many most recent positions (itself included)\n"
     "in float32.", NULL},
    {"length", (getter)cache_get_length, NULL, "Positions filled so far.", NULL},
    {"capacity", (getter)cache_get_capacity, NULL, "Positions reserved (max_seq_len).", NULL},
    {"nbytes", (getter)cache_get_nbytes, NULL,
     "Bytes this cache allocated for K and V (the full capacity).", NULL},
    {"shape", (getter)cache_get_shape, NULL,
     "(n_layers, capacity, n_kv_heads, head_dim) of the K (or V) buffer.", NULL},
    {NULL}
};

static PyMethodDef cache_methods[] = {
    {"reset", (PyCFunction)cache_reset, METH_NOARGS, "Forget every cached token (length = 0)."},
    {"truncate", (PyCFunction)cache_truncate, METH_O,
     "truncate(n): roll back to the first n tokens, as if the rest never came."},
    {"append", (PyCFunction)cache_append, METH_VARARGS,
     "append(keys, values): write given K/V rows, each (n_tokens, n_layers, n_kv_heads,\n"
     "head_dim) float32, without a model (for exercises and benchmarks); quantized as the\n"
     "cache stores them."},
    {"dequantized", (PyCFunction)cache_dequantized, METH_NOARGS,
     "dequantized() -> (keys, values): float32 copies, (n_layers, length, n_kv_heads,\n"
     "head_dim), of what the most recent token's attention read: the codes decoded, and the\n"
     "residual window's rows in full precision."},
    {"attend", (PyCFunction)(void (*)(void))cache_attend, METH_VARARGS | METH_KEYWORDS,
     "attend(q, layer=0) -> out: the attention of one token's queries q, float32\n"
     "(n_heads, head_dim), over every cached position of a layer, as the last cached token\n"
     "would attend (the cache is not changed). Decode attention on its own."},
    {NULL}
};

static PyTypeObject CacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.KVCache",
    .tp_doc = PyDoc_STR("KVCache(n_layers, n_kv_heads, head_dim, capacity, key_format='fp32',\n"
                        "        value_format='fp32', key_group=0, value_group=0, window=0)\n\n"
                        "A contiguous KV cache for one sequence, K and V each stored as fp32,\n"
                        "fp16, bf16, int8, int4 or fp8. Usually made with model.new_cache()."),
    .tp_basicsize = sizeof(CacheObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cache_init,
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_repr = (reprfunc)cache_repr,
    .tp_methods = cache_methods,
    .tp_getset = cache_getset,
};

/* ============================== PagedPool ======================================== */

typedef struct {
    PyObject_HEAD
    kv_pool pool;
    int busy;  /* a forward pass is writing this pool with the GIL released */
} PoolObject;

typedef struct {
    PyObject_HEAD
    PoolObject *pool;   /* strong reference: a handle keeps its pool alive */
    int seq;            /* slot in pool->seqs */
    uint32_t serial;    /* the slot's serial when this handle was made */
} SequenceObject;

static PyTypeObject PoolType;
static PyTypeObject SequenceType;

static int pool_refuse_if_busy(PoolObject *self) {
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
        PyErr_SetString(PyExc_RuntimeError, "PagedPool is already initialized");
        return -1;
    }
    if (block_size < 1 || block_size > 256) {
        PyErr_Format(PyExc_ValueError, "block_size must be between 1 and 256, got %d", block_size);
        return -1;
    }
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || num_blocks <= 0 || max_seqs <= 0 ||
        max_blocks_per_seq < 0 || hash_bits < 1 || hash_bits > 64) {
        PyErr_Format(PyExc_ValueError, "PagedPool sizes must be positive (num_blocks=%d, "
                     "max_seqs=%d, max_blocks_per_seq=%d, hash_bits=%d)", num_blocks, max_seqs,
                     max_blocks_per_seq, hash_bits);
        return -1;
    }
    if (max_blocks_per_seq == 0) max_blocks_per_seq = num_blocks;
    kv_cache_format format;
    if (make_format(&format, key_name, value_name, key_group, value_group, window, head_dim,
                    1 << 20) < 0)
        return -1;
    kv_status status = kv_pool_init(&self->pool, n_layers, n_kv_heads, head_dim, num_blocks,
                                    block_size, max_seqs, max_blocks_per_seq, &format);
    if (status != KV_OK) {
        if (status == KV_ERR_INVALID_ARG)
            PyErr_SetString(PyExc_ValueError, "PagedPool sizes are too large");
        else
            raise_status(status);
        return -1;
    }
    if (hash_bits < 64) self->pool.hash_mask = ((uint64_t)1 << hash_bits) - 1;
    self->pool.prefix_cache = prefix_cache;
    return 0;
}

static void pool_dealloc(PoolObject *self) {
    kv_pool_free(&self->pool);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A read-only zero-copy view of pool memory; its base is the pool. */
static PyObject *pool_view(PoolObject *self, void *data, int type, int ndim, npy_intp *dims) {
    if (self->pool.key.codes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PagedPool was not initialized");
        return NULL;
    }
    return readonly_view((PyObject *)self, data, type, ndim, dims, NULL);
}

/* key_codes, key_scales, ... value_zeros of the whole pool: closure = (is_value << 2) | part.
 * The memory is head-major (n_layers, n_kv_heads, num_blocks, block_size, ...); shown block-first, so
 * that key_codes[b] is everything block b holds. */
static PyObject *pool_get_part(PoolObject *self, void *closure) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int which = (int)(intptr_t)closure;
    const kv_pool *p = &self->pool;
    npy_intp lead_dims[3] = {p->num_blocks, p->n_layers, p->block_size};
    npy_intp slots = (npy_intp)p->num_blocks * p->block_size;
    npy_intp lead_strides[3] = {p->block_size, (npy_intp)p->n_kv_heads * slots, 1};
    return store_view((PyObject *)self, (which >> 2) ? &p->value : &p->key, which & 3, 3,
                      lead_dims, lead_strides);
}

static PyObject *pool_get_format(PoolObject *self, void *closure) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
    return format_name((closure ? &self->pool.value : &self->pool.key)->format);
}

static PyObject *pool_get_group(PoolObject *self, void *closure) {
    return PyLong_FromLong((closure ? &self->pool.value : &self->pool.key)->group);
}

static PyObject *pool_get_ref_counts(PoolObject *self, void *closure) {
    (void)closure;
    npy_intp dims[1] = {self->pool.num_blocks};
    return pool_view(self, self->pool.ref_count, NPY_INT32, 1, dims);
}

static PyObject *pool_get_fill(PoolObject *self, void *closure) {
    (void)closure;
    npy_intp dims[1] = {self->pool.num_blocks};
    return pool_view(self, self->pool.fill, NPY_INT32, 1, dims);
}

static PyObject *pool_get_block_tokens(PoolObject *self, void *closure) {
    (void)closure;
    npy_intp dims[2] = {self->pool.num_blocks, self->pool.block_size};
    return pool_view(self, self->pool.tokens, NPY_INT32, 2, dims);
}

static PyObject *int_list(const int32_t *values, int n) {
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *item = PyLong_FromLong(values[i]);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *pool_get_free_blocks(PoolObject *self, void *closure) {
    (void)closure;
    return int_list(self->pool.free_stack, self->pool.n_free);
}

static PyObject *pool_get_cached_blocks(PoolObject *self, void *closure) {
    (void)closure;
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
        (void)closure;                                                     \
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
    (void)closure;
    long live = 0;
    for (int s = 0; self->pool.seqs != NULL && s < self->pool.max_seqs; s++)
        live += self->pool.seqs[s].alive;
    return PyLong_FromLong(live);
}

static PyObject *new_handle(PoolObject *pool, int seq) {
    SequenceObject *handle = PyObject_New(SequenceObject, &SequenceType);
    if (handle == NULL) return NULL;
    Py_INCREF(pool);
    handle->pool = pool;
    handle->seq = seq;
    handle->serial = pool->pool.seqs[seq].serial;
    return (PyObject *)handle;
}

/* The slot of a live sequence of this pool, or -1 with an exception set. */
static int resolve_sequence(PoolObject *pool, PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &SequenceType)) {
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

static PyObject *raise_pool_status(PoolObject *self, kv_status status, int n_tokens) {
    const kv_pool *p = &self->pool;
    if (status == KV_ERR_OUT_OF_BLOCKS) {
        PyErr_Format(OutOfBlocks, "out of blocks: appending %d tokens needs more blocks than "
                     "the pool has free (%d) or cached (%d) of %d; the pool is unchanged",
                     n_tokens, p->n_free, p->n_cached, p->num_blocks);
        return NULL;
    }
    if (status == KV_ERR_TABLE_FULL) {
        PyErr_Format(CacheFullError, "the sequence's block table is full (%d blocks of %d "
                     "tokens); the pool is unchanged", p->max_blocks_per_seq, p->block_size);
        return NULL;
    }
    if (status == KV_ERR_TOO_MANY_SEQUENCES) {
        PyErr_Format(OutOfSequences, "the pool already holds max_seqs=%d sequences; free one",
                     p->max_seqs);
        return NULL;
    }
    return raise_status(status);
}

static PyObject *pool_new_sequence(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq;
    kv_status status = kv_pool_seq_new(&self->pool, &seq);
    if (status != KV_OK) return raise_pool_status(self, status, 0);
    return new_handle(self, seq);
}

static PyObject *pool_fork(PoolObject *self, PyObject *arg) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq = resolve_sequence(self, arg);
    if (seq < 0) return NULL;
    int child;
    kv_status status = kv_pool_seq_fork(&self->pool, seq, &child);
    if (status != KV_OK) return raise_pool_status(self, status, 0);
    return new_handle(self, child);
}

static PyObject *pool_free_sequence(PoolObject *self, PyObject *arg) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq = resolve_sequence(self, arg);
    if (seq < 0) return NULL;
    kv_pool_seq_free(&self->pool, seq);
    Py_RETURN_NONE;
}

/* A 1-D int32 C-contiguous array, possibly empty; TypeError/ValueError otherwise. */
static PyArrayObject *as_int32_vector(PyObject *obj, const char *what) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_INT32 ||
        !PyArray_ISNOTSWAPPED((PyArrayObject *)obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy int32 array", what);
        return NULL;
    }
    PyArrayObject *array = (PyArrayObject *)obj;
    if (PyArray_NDIM(array) != 1 || !PyArray_IS_C_CONTIGUOUS(array) || !PyArray_ISALIGNED(array)) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D C-contiguous, aligned array", what);
        return NULL;
    }
    if (PyArray_DIM(array, 0) > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "%s is too long", what);
        return NULL;
    }
    return array;
}

static PyObject *pool_reuse_prefix(PoolObject *self, PyObject *args) {
    PyObject *seq_obj, *tokens_obj, *max_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O", &seq_obj, &tokens_obj, &max_obj)) return NULL;
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq = resolve_sequence(self, seq_obj);
    if (seq < 0) return NULL;
    PyArrayObject *tokens = as_int32_vector(tokens_obj, "tokens");
    if (tokens == NULL) return NULL;
    int n = (int)PyArray_DIM(tokens, 0), max_tokens = n;
    if (max_obj != Py_None) {
        long requested = PyLong_AsLong(max_obj);
        if (requested == -1 && PyErr_Occurred()) return NULL;
        if (requested < 0) {
            PyErr_Format(PyExc_ValueError, "max_tokens must be >= 0, got %ld", requested);
            return NULL;
        }
        if (requested < n) max_tokens = (int)requested;
    }
    if (self->pool.seqs[seq].length != 0) {
        PyErr_SetString(PyExc_ValueError, "reuse_prefix needs an empty sequence");
        return NULL;
    }
    int reused = 0;
    kv_status status = kv_pool_reuse_prefix(&self->pool, seq,
                                            (const int32_t *)PyArray_DATA(tokens), max_tokens,
                                            &reused);
    if (status != KV_OK) return raise_pool_status(self, status, 0);
    return PyLong_FromLong(reused);
}

static PyObject *pool_append(PoolObject *self, PyObject *args) {
    PyObject *seq_obj, *tokens_obj, *keys, *values;
    if (!PyArg_ParseTuple(args, "OOOO", &seq_obj, &tokens_obj, &keys, &values)) return NULL;
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq = resolve_sequence(self, seq_obj);
    if (seq < 0) return NULL;
    PyArrayObject *tokens = as_int32_vector(tokens_obj, "tokens");
    if (tokens == NULL) return NULL;
    int n = (int)PyArray_DIM(tokens, 0);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "tokens must not be empty");
        return NULL;
    }
    const kv_pool *p = &self->pool;
    if (check_rows(p->n_layers, p->n_kv_heads, p->head_dim, keys, "keys", n) < 0 ||
        check_rows(p->n_layers, p->n_kv_heads, p->head_dim, values, "values", n) < 0)
        return NULL;
    kv_status status = kv_pool_append(&self->pool, seq, (const int32_t *)PyArray_DATA(tokens), n,
                                      (const float *)PyArray_DATA((PyArrayObject *)keys),
                                      (const float *)PyArray_DATA((PyArrayObject *)values));
    if (status != KV_OK) return raise_pool_status(self, status, n);
    Py_RETURN_NONE;
}

static PyObject *pool_blocks_needed(PoolObject *self, PyObject *args) {
    PyObject *handle;
    int n_tokens;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &n_tokens)) return NULL;
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq = resolve_sequence(self, handle);
    if (seq < 0) return NULL;
    if (n_tokens < 1) {
        PyErr_Format(PyExc_ValueError, "n_tokens must be at least 1, got %d", n_tokens);
        return NULL;
    }
    int needed;
    kv_status status = kv_pool_blocks_needed(&self->pool, seq, n_tokens, &needed);
    if (status != KV_OK) return raise_pool_status(self, status, n_tokens);
    return PyLong_FromLong(needed);
}

static PyObject *pool_gather(PoolObject *self, PyObject *arg) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
    int seq = resolve_sequence(self, arg);
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
    if (pool_refuse_if_busy(self) < 0) return NULL;
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
    if (pool_refuse_if_busy(self) < 0) return NULL;
    char message[256];
    kv_status status = kv_pool_check(&self->pool, message, sizeof message);
    if (status == KV_ERR_CORRUPT) {
        PyErr_Format(PoolInvariantError, "pool invariant broken: %s", message);
        return NULL;
    }
    if (status != KV_OK) return raise_status(status);
    Py_RETURN_NONE;
}

static PyObject *pool_sequences(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    if (pool_refuse_if_busy(self) < 0) return NULL;
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
     "num_blocks, block_size, ...), so this view is strided.", PART(0, STORE_CODES)},
    {"key_scales", (getter)pool_get_part, NULL,
     "Scales of the key groups, (num_blocks, n_layers, block_size, n_kv_heads,\n"
     "head_dim / group), or None.", PART(0, STORE_SCALES)},
    {"key_zeros", (getter)pool_get_part, NULL, "Zero points of int4 keys, or None.",
     PART(0, STORE_ZEROS)},
    {"value_codes", (getter)pool_get_part, NULL, "As key_codes, for V.", PART(1, STORE_CODES)},
    {"value_scales", (getter)pool_get_part, NULL, "As key_scales, for V.", PART(1, STORE_SCALES)},
    {"value_zeros", (getter)pool_get_part, NULL, "As key_zeros, for V.", PART(1, STORE_ZEROS)},
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

static PyTypeObject PoolType = {
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

/* ============================= PagedSequence ======================================= */

static void sequence_dealloc(SequenceObject *self) {
    Py_XDECREF(self->pool);
    PyObject_Free(self);
}

static int sequence_alive(SequenceObject *self) {
    const kv_seq *q = &self->pool->pool.seqs[self->seq];
    return q->alive && q->serial == self->serial;
}

static PyObject *sequence_get_alive(SequenceObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(sequence_alive(self));
}

static PyObject *sequence_get_length(SequenceObject *self, void *closure) {
    (void)closure;
    if (resolve_sequence(self->pool, (PyObject *)self) < 0) return NULL;
    return PyLong_FromLong(self->pool->pool.seqs[self->seq].length);
}

static PyObject *sequence_get_id(SequenceObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->seq);
}

static PyObject *sequence_get_pool(SequenceObject *self, void *closure) {
    (void)closure;
    Py_INCREF(self->pool);
    return (PyObject *)self->pool;
}

static PyObject *sequence_get_block_table(SequenceObject *self, void *closure) {
    (void)closure;
    if (resolve_sequence(self->pool, (PyObject *)self) < 0) return NULL;
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

static PyObject *sequence_get_serial(SequenceObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLong(self->serial);
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

static PyTypeObject SequenceType = {
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

/* ================================= Model ========================================= */

typedef struct {
    PyObject_HEAD
    kv_model model;
    PyObject *arrays[N_WEIGHTS];  /* the NumPy arrays whose memory the model reads */
} ModelObject;

/* Checks one weight array and borrows its data pointer; keeps a reference in *keep. */
static int take_weight(PyObject *weights, const char *name, int ndim, const npy_intp *shape,
                       PyObject **keep, const float **data) {
    PyObject *obj = PyDict_GetItemString(weights, name);  /* borrowed */
    if (obj == NULL) {
        PyErr_Format(WeightsError, "weights are missing %s", name);
        return -1;
    }
    if (!PyArray_Check(obj)) {
        PyErr_Format(WeightsError, "weight %s must be a numpy array, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *array = (PyArrayObject *)obj;
    if (PyArray_TYPE(array) != NPY_FLOAT32 || !PyArray_ISNOTSWAPPED(array)) {
        PyErr_Format(WeightsError, "weight %s must be native float32, got %R", name,
                     (PyObject *)PyArray_DESCR(array));
        return -1;
    }
    if (PyArray_NDIM(array) != ndim) {
        PyErr_Format(WeightsError, "weight %s must have %d dimensions, got %d", name, ndim,
                     PyArray_NDIM(array));
        return -1;
    }
    for (int i = 0; i < ndim; i++) {
        if (PyArray_DIM(array, i) != shape[i]) {
            PyErr_Format(WeightsError, "weight %s has size %zd on axis %d, expected %zd",
                         name, (Py_ssize_t)PyArray_DIM(array, i), i, (Py_ssize_t)shape[i]);
            return -1;
        }
    }
    if (!PyArray_IS_C_CONTIGUOUS(array) || !PyArray_ISALIGNED(array)) {
        PyErr_Format(WeightsError, "weight %s must be C-contiguous and aligned "
                     "(use np.ascontiguousarray)", name);
        return -1;
    }
    Py_INCREF(obj);
    *keep = obj;
    *data = (const float *)PyArray_DATA(array);
    return 0;
}

static void model_release_arrays(ModelObject *self) {
    for (int i = 0; i < N_WEIGHTS; i++) Py_CLEAR(self->arrays[i]);
    memset(&self->model, 0, sizeof self->model);
}

static int model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"config", "weights", NULL};
    PyObject *config, *weights;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!", kwlist, &PyDict_Type, &config,
                                     &PyDict_Type, &weights))
        return -1;
    if (self->model.weights.token_embedding != NULL) {
        /* another thread may be running a forward pass on the current weights */
        PyErr_SetString(PyExc_RuntimeError, "Model is already initialized");
        return -1;
    }
    kv_config *c = &self->model.config;
    if (read_config(config, ConfigError, c) < 0) goto fail;
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0 || !(c->norm_eps > 0.0f) ||
        !isfinite(c->norm_eps)) {
        PyErr_Format(ConfigError, "config does not fit: n_kv_heads (%d) must divide n_heads "
                     "(%d), head_dim (%d) must be even, norm_eps must be finite and > 0",
                     c->n_kv_heads, c->n_heads, c->head_dim);
        goto fail;
    }

    weight_spec table[N_WEIGHTS];
    weight_specs(c, &self->model.weights, table);
    for (int i = 0; i < N_WEIGHTS; i++)
        if (take_weight(weights, table[i].name, table[i].ndim, table[i].shape,
                        &self->arrays[i], table[i].data) < 0)
            goto fail;
    if (kv_model_check(&self->model) != KV_OK) {
        PyErr_SetString(ConfigError, "model sizes exceed what kvlab supports (widths up to "
                        "65536, vocab up to 2**24, layers up to 4096)");
        goto fail;
    }
    return 0;
fail:
    model_release_arrays(self);
    return -1;
}

static void model_dealloc(ModelObject *self) {
    model_release_arrays(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Checks the token array: int32, 1-D, C-contiguous, non-empty, every id in range. */
static int check_tokens(ModelObject *self, PyObject *obj) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "tokens must be a numpy int32 array, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *tokens = (PyArrayObject *)obj;
    if (PyArray_TYPE(tokens) != NPY_INT32 || !PyArray_ISNOTSWAPPED(tokens)) {
        PyErr_Format(PyExc_TypeError, "tokens must be int32, got %R", (PyObject *)PyArray_DESCR(tokens));
        return -1;
    }
    if (PyArray_NDIM(tokens) != 1 || PyArray_DIM(tokens, 0) == 0) {
        PyErr_SetString(PyExc_ValueError, "tokens must be a non-empty 1-D array");
        return -1;
    }
    if (!PyArray_IS_C_CONTIGUOUS(tokens) || !PyArray_ISALIGNED(tokens)) {
        PyErr_SetString(PyExc_ValueError, "tokens must be C-contiguous and aligned");
        return -1;
    }
    if (PyArray_DIM(tokens, 0) > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "too many tokens in one call (at most 65536); "
                        "prefill a long prompt in chunks");
        return -1;
    }
    const int32_t *ids = (const int32_t *)PyArray_DATA(tokens);
    for (npy_intp i = 0; i < PyArray_DIM(tokens, 0); i++) {
        if (ids[i] < 0 || ids[i] >= self->model.config.vocab_size) {
            PyErr_Format(PyExc_ValueError, "token id %d at index %zd is out of range "
                         "[0, %d)", (int)ids[i], (Py_ssize_t)i, self->model.config.vocab_size);
            return -1;
        }
    }
    return 0;
}

/* The kv_counters fields, in order: the names of a counters array's entries. */
static const char *counter_names[] = {"flops_projections", "flops_attention", "flops_mlp",
                                      "flops_logits", "weight_bytes", "kv_read_bytes",
                                      "kv_write_bytes", "scratch_bytes", "tokens", "calls"};
#define N_COUNTERS ((int)(sizeof counter_names / sizeof counter_names[0]))
_Static_assert(sizeof(kv_counters) == sizeof(int64_t) * (sizeof counter_names / sizeof counter_names[0]),
               "counter_names must name every kv_counters field");

static int check_counters(PyObject *obj) {
    if (obj == Py_None) return 0;
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_INT64 ||
        PyArray_NDIM((PyArrayObject *)obj) != 1 || PyArray_DIM((PyArrayObject *)obj, 0) != N_COUNTERS ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)obj) || !PyArray_ISWRITEABLE((PyArrayObject *)obj) ||
        !PyArray_ISALIGNED((PyArrayObject *)obj) || !PyArray_ISNOTSWAPPED((PyArrayObject *)obj)) {
        PyErr_Format(PyExc_TypeError, "counters must be a writable int64 array of %d entries "
                     "(see kvlab._kvlab.COUNTERS)", N_COUNTERS);
        return -1;
    }
    return 0;
}

/* Adds one call's counts into a counters array: its int64 entries are exactly a
 * kv_counters struct (the _Static_assert above and check_counters make sure). */
static void add_to_counters(PyObject *obj, const kv_counters *call) {
    if (obj != Py_None) kv_counters_add((kv_counters *)PyArray_DATA((PyArrayObject *)obj), call);
}

/* What every forward call checks first: the counters array, an initialized model, and
 * the token ids. 0, or -1 with an exception set. */
/* A model ready to run, and a counters array (or None) to add a call's counts to. */
static int check_model_call(ModelObject *self, PyObject *counters_obj) {
    if (check_counters(counters_obj) < 0) return -1;
    if (self->model.weights.token_embedding == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Model was not initialized");
        return -1;
    }
    return 0;
}

static int check_call(ModelObject *self, PyObject *tokens_obj, PyObject *counters_obj) {
    if (check_model_call(self, counters_obj) < 0) return -1;
    return check_tokens(self, tokens_obj);
}

/* A KVCache that this model can run n_positions more tokens over: ready, not in use by
 * another thread, shaped for the model, with room. Raises and returns -1 otherwise. */
static int check_cache_for(CacheObject *cache, const kv_config *c, int n_positions) {
    if (require_initialized(cache) < 0 || refuse_if_busy(cache) < 0) return -1;
    if (kv_cache_check_fits(&cache->cache, c) != KV_OK) {
        PyErr_Format(PyExc_ValueError, "this cache holds %d layers x %d KV heads x %d, "
                     "but the model needs %d x %d x %d", cache->cache.n_layers,
                     cache->cache.n_kv_heads, cache->cache.head_dim, c->n_layers,
                     c->n_kv_heads, c->head_dim);
        return -1;
    }
    int free_slots = cache->cache.capacity - cache->cache.length;
    if (n_positions > free_slots) {
        PyErr_Format(CacheFullError, "the KV cache is full: it holds %d of %d positions "
                     "and cannot take %d more (make it with a larger max_seq_len, or "
                     "truncate/reset it)", cache->cache.length, cache->cache.capacity,
                     n_positions);
        return -1;
    }
    return 0;
}

static PyObject *model_forward(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tokens", "cache", "all_logits", "counters", NULL};
    PyObject *tokens_obj, *cache_obj = Py_None, *counters_obj = Py_None;
    int all_logits = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OpO", kwlist, &tokens_obj, &cache_obj,
                                     &all_logits, &counters_obj))
        return NULL;
    if (check_call(self, tokens_obj, counters_obj) < 0) return NULL;
    PyArrayObject *tokens = (PyArrayObject *)tokens_obj;
    int n_tokens = (int)PyArray_DIM(tokens, 0);
    const kv_config *c = &self->model.config;

    CacheObject *cache = NULL;
    PoolObject *pool = NULL;
    int seq = -1;
    if (PyObject_TypeCheck(cache_obj, &SequenceType)) {
        pool = ((SequenceObject *)cache_obj)->pool;
        if (pool_refuse_if_busy(pool) < 0) return NULL;
        seq = resolve_sequence(pool, cache_obj);
        if (seq < 0) return NULL;
        if (kv_pool_check_fits(&pool->pool, c) != KV_OK) {
            PyErr_Format(PyExc_ValueError, "this pool holds %d layers x %d KV heads x %d, "
                         "but the model needs %d x %d x %d", pool->pool.n_layers,
                         pool->pool.n_kv_heads, pool->pool.head_dim, c->n_layers,
                         c->n_kv_heads, c->head_dim);
            return NULL;
        }
    } else if (cache_obj != Py_None) {
        if (!PyObject_TypeCheck(cache_obj, &CacheType)) {
            PyErr_Format(PyExc_TypeError, "cache must be a KVCache, a PagedSequence or None, "
                         "got %s", Py_TYPE(cache_obj)->tp_name);
            return NULL;
        }
        cache = (CacheObject *)cache_obj;
        if (check_cache_for(cache, c, n_tokens) < 0) return NULL;
    }

    npy_intp dims[2] = {n_tokens, c->vocab_size};
    PyObject *logits = all_logits ? PyArray_SimpleNew(2, dims, NPY_FLOAT32)
                                  : PyArray_SimpleNew(1, &dims[1], NPY_FLOAT32);
    if (logits == NULL) return NULL;
    float *out = (float *)PyArray_DATA((PyArrayObject *)logits);
    /* A private copy of the ids, taken (and checked again by the core) while we hold the
     * GIL: the caller's array could be changed by another thread once we let go of it. */
    int32_t *ids = PyMem_Malloc((size_t)n_tokens * sizeof(int32_t));
    if (ids == NULL) {
        Py_DECREF(logits);
        return PyErr_NoMemory();
    }
    memcpy(ids, PyArray_DATA(tokens), (size_t)n_tokens * sizeof(int32_t));

    /* The cache is kept alive by this call's reference; the busy flag stops another
     * thread from resizing or reusing it meanwhile. */
    kv_status status;
    kv_counters count = {0};
    if (cache != NULL) cache->busy = 1;
    if (pool != NULL) pool->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    kv_set_interrupt_check(python_signals_pending, &_save);
    if (cache != NULL)
        status = kv_model_forward(&self->model, &cache->cache, ids, n_tokens, out, all_logits,
                                  &count);
    else if (pool != NULL)
        status = kv_model_forward_paged(&self->model, &pool->pool, seq, ids, n_tokens, out,
                                        all_logits, &count);
    else
        status = kv_model_forward_uncached(&self->model, ids, n_tokens, out, all_logits, &count);
    kv_set_interrupt_check(NULL, NULL);
    Py_END_ALLOW_THREADS
    if (cache != NULL) cache->busy = 0;
    if (pool != NULL) pool->busy = 0;
    PyMem_Free(ids);
    if (status != KV_OK) {
        Py_DECREF(logits);
        if (status == KV_ERR_INTERRUPTED) {      /* the chunks before it are in the cache */
            add_to_counters(counters_obj, &count);
            return raise_interrupted();
        }
        return pool != NULL ? raise_pool_status(pool, status, n_tokens) : raise_status(status);
    }
    add_to_counters(counters_obj, &count);
    return logits;
}

/* forward_batch(seqs, tokens, n_tokens, counters=None): one engine step (see
 * kv_model_forward_batch). seqs: PagedSequence handles of one pool; tokens: int32, the
 * sequences' new tokens one after another; n_tokens: how many belong to each. */
/* Reads how to choose tokens (temperature, top_k, top_p) into *how, checked. */
static int parse_sampling(double temperature, int top_k, double top_p, kv_sampling *how) {
    if (!(temperature >= 0.0 && temperature < INFINITY)) {
        raise_value_error_with_number("temperature must be a finite number >= 0, got ", temperature, "");
        return -1;
    }
    if (top_k < 0) {
        PyErr_Format(PyExc_ValueError, "top_k must be >= 0 (0: no cut), got %d", top_k);
        return -1;
    }
    if (!(top_p > 0.0 && top_p <= 1.0)) {
        raise_value_error_with_number("top_p must be in (0, 1], got ", top_p, "");
        return -1;
    }
    *how = (kv_sampling){temperature, top_k, top_p};
    return 0;
}

/* A multi-step call that fails keeps what it completed (the cache holds those steps); the
 * exception being raised gets them as .completed = (tokens, seconds), the first n_steps
 * entries, so a caller loses no chosen token. */
static void attach_completed(PyObject *tokens, PyObject *seconds, int n_steps) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject *done_tokens = PySequence_GetSlice(tokens, 0, n_steps);
    PyObject *done_seconds = PySequence_GetSlice(seconds, 0, n_steps);
    PyObject *pair = NULL;
    if (done_tokens != NULL && done_seconds != NULL) {
        PyObject *tokens_copy = PyArray_NewCopy((PyArrayObject *)done_tokens, NPY_CORDER);
        PyObject *seconds_copy = PyArray_NewCopy((PyArrayObject *)done_seconds, NPY_CORDER);
        if (tokens_copy != NULL && seconds_copy != NULL) pair = PyTuple_Pack(2, tokens_copy, seconds_copy);
        Py_XDECREF(tokens_copy);
        Py_XDECREF(seconds_copy);
    }
    if (pair == NULL || value == NULL || PyObject_SetAttrString(value, "completed", pair) < 0)
        PyErr_Clear();   /* the original exception matters more than this extra */
    Py_XDECREF(pair);
    Py_XDECREF(done_tokens);
    Py_XDECREF(done_seconds);
    PyErr_Restore(type, value, traceback);
}

/* generate(token, cache, max_steps, temperature=0, top_k=0, top_p=1, uniforms=None,
 * stop_token=-1, counters=None): the generation loop of kv_model_generate, run with the
 * GIL released from the first token to the last. */
static PyObject *model_generate(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"token", "cache", "max_steps", "temperature", "top_k", "top_p",
                             "uniforms", "stop_token", "counters", NULL};
    int token, max_steps, top_k = 0, stop_token = -1;
    double temperature = 0.0, top_p = 1.0;
    PyObject *cache_obj, *uniforms_obj = Py_None, *counters_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOi|didOiO", kwlist, &token, &cache_obj,
                                     &max_steps, &temperature, &top_k, &top_p, &uniforms_obj,
                                     &stop_token, &counters_obj))
        return NULL;
    kv_sampling how;
    if (check_model_call(self, counters_obj) < 0 ||
        parse_sampling(temperature, top_k, top_p, &how) < 0)
        return NULL;
    const kv_config *c = &self->model.config;
    if (!PyObject_TypeCheck(cache_obj, &CacheType)) {
        PyErr_Format(PyExc_TypeError, "generate needs a KVCache, got %s",
                     Py_TYPE(cache_obj)->tp_name);
        return NULL;
    }
    CacheObject *cache = (CacheObject *)cache_obj;
    if (token < 0 || token >= c->vocab_size) {
        PyErr_Format(PyExc_ValueError, "token id %d is out of range [0, %d)", token, c->vocab_size);
        return NULL;
    }
    if (stop_token >= c->vocab_size) {
        PyErr_Format(PyExc_ValueError, "stop_token %d is out of range [0, %d) (or -1 for none)",
                     stop_token, c->vocab_size);
        return NULL;
    }
    if (max_steps < 1) {
        PyErr_Format(PyExc_ValueError, "max_steps must be at least 1, got %d", max_steps);
        return NULL;
    }
    PyArrayObject *uniforms = NULL;
    if (temperature > 0.0) {   /* a sampled step draws with the next of these numbers */
        if (!PyArray_Check(uniforms_obj) || PyArray_TYPE((PyArrayObject *)uniforms_obj) != NPY_FLOAT64 ||
            PyArray_NDIM((PyArrayObject *)uniforms_obj) != 1 ||
            PyArray_DIM((PyArrayObject *)uniforms_obj, 0) < max_steps ||
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)uniforms_obj)) {
            PyErr_Format(PyExc_ValueError, "sampling (temperature > 0) needs uniforms: a "
                         "contiguous 1-D float64 array of at least max_steps = %d numbers in [0, 1)",
                         max_steps);
            return NULL;
        }
        uniforms = (PyArrayObject *)uniforms_obj;
    }
    if (check_cache_for(cache, c, max_steps) < 0) return NULL;   /* one position per step */
    npy_intp dims[1] = {max_steps};
    PyObject *tokens = PyArray_SimpleNew(1, dims, NPY_INT32);
    PyObject *seconds = PyArray_SimpleNew(1, dims, NPY_FLOAT64);
    /* a private copy of the numbers: the caller's array could change once the GIL is let go */
    double *draws = uniforms ? PyMem_Malloc((size_t)max_steps * sizeof(double)) : NULL;
    if (tokens == NULL || seconds == NULL || (uniforms != NULL && draws == NULL)) {
        Py_XDECREF(tokens);
        Py_XDECREF(seconds);
        PyMem_Free(draws);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    if (draws != NULL) memcpy(draws, PyArray_DATA(uniforms), (size_t)max_steps * sizeof(double));
    kv_status status;
    kv_counters count = {0};
    int n_steps = 0;
    cache->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    kv_set_interrupt_check(python_signals_pending, &_save);
    status = kv_model_generate(&self->model, &cache->cache, token, max_steps, stop_token, &how,
                               draws, (int32_t *)PyArray_DATA((PyArrayObject *)tokens),
                               (double *)PyArray_DATA((PyArrayObject *)seconds), &n_steps,
                               &count);
    kv_set_interrupt_check(NULL, NULL);
    Py_END_ALLOW_THREADS
    cache->busy = 0;
    PyMem_Free(draws);
    add_to_counters(counters_obj, &count);   /* what ran, even if a step then failed */
    if (status != KV_OK) {
        if (status == KV_ERR_INTERRUPTED)
            raise_interrupted();
        else if (status == KV_ERR_NOT_A_NUMBER)
            PyErr_Format(PyExc_ValueError, "decode step %d (position %d): the logits hold NaN "
                         "(or are all -inf), so no token can be chosen; the cache keeps that "
                         "step's token and the %d steps before", n_steps, cache->cache.length - 1,
                         n_steps);
        else
            raise_status(status);
        attach_completed(tokens, seconds, n_steps);
        Py_DECREF(tokens);
        Py_DECREF(seconds);
        return NULL;
    }
    /* the steps that ran: the first n_steps entries (copies, not views of the longer) */
    dims[0] = n_steps;
    PyArray_Dims shape = {dims, 1};
    PyObject *ran_tokens = PyArray_Resize((PyArrayObject *)tokens, &shape, 0, NPY_CORDER);
    PyObject *ran_seconds = ran_tokens == NULL ? NULL
                            : PyArray_Resize((PyArrayObject *)seconds, &shape, 0, NPY_CORDER);
    PyObject *result = ran_seconds == NULL ? NULL : PyTuple_Pack(2, tokens, seconds);
    Py_XDECREF(ran_tokens);
    Py_XDECREF(ran_seconds);
    Py_DECREF(tokens);
    Py_DECREF(seconds);
    return result;
}

/* sample(logits, temperature=0, top_k=0, top_p=1, u=0) -> token: kv_sample on one row. */
static PyObject *py_sample(PyObject *module, PyObject *args, PyObject *kwds) {
    (void)module;
    static char *kwlist[] = {"logits", "temperature", "top_k", "top_p", "u", NULL};
    PyObject *logits_obj;
    double temperature = 0.0, top_p = 1.0, u = 0.0;
    int top_k = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|didd", kwlist, &logits_obj, &temperature,
                                     &top_k, &top_p, &u))
        return NULL;
    kv_sampling how;
    if (parse_sampling(temperature, top_k, top_p, &how) < 0) return NULL;
    if (!(u >= 0.0 && u < 1.0)) {
        raise_value_error_with_number("u must be in [0, 1), got ", u, "");
        return NULL;
    }
    /* float32, as the model's logits are; other numbers are rounded to it (forced cast) */
    PyArrayObject *logits = (PyArrayObject *)PyArray_FROMANY(
        logits_obj, NPY_FLOAT32, 1, 1, NPY_ARRAY_CARRAY_RO | NPY_ARRAY_FORCECAST);
    if (logits == NULL) return NULL;
    npy_intp n = PyArray_DIM(logits, 0);
    if (n < 1 || n > INT32_MAX / (npy_intp)kv_sample_scratch_bytes(1)) {
        Py_DECREF(logits);
        PyErr_Format(PyExc_ValueError, "logits must hold 1 to %d values, got %zd",
                     (int)(INT32_MAX / kv_sample_scratch_bytes(1)), (Py_ssize_t)n);
        return NULL;
    }
    void *scratch = PyMem_Malloc(kv_sample_scratch_bytes((int)n));
    if (scratch == NULL) {
        Py_DECREF(logits);
        return PyErr_NoMemory();
    }
    int chosen = kv_sample((const float *)PyArray_DATA(logits), (int)n, &how, u, scratch);
    PyMem_Free(scratch);
    Py_DECREF(logits);
    if (chosen < 0) return raise_status(KV_ERR_NOT_A_NUMBER);
    return PyLong_FromLong(chosen);
}

static PyObject *model_forward_batch(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seqs", "tokens", "n_tokens", "counters", NULL};
    PyObject *seqs_obj, *tokens_obj, *counts_obj, *counters_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O", kwlist, &seqs_obj, &tokens_obj,
                                     &counts_obj, &counters_obj))
        return NULL;
    if (check_call(self, tokens_obj, counters_obj) < 0) return NULL;
    PyObject *seqs = PySequence_Fast(seqs_obj, "seqs must be a list of PagedSequence handles");
    if (seqs == NULL) return NULL;
    PyObject *result = NULL, *logits = NULL;
    int *slots = NULL, *counts = NULL;
    int32_t *ids = NULL;
    Py_ssize_t n_seqs = PySequence_Fast_GET_SIZE(seqs);
    PyArrayObject *tokens = (PyArrayObject *)tokens_obj;
    const kv_config *c = &self->model.config;
    PoolObject *pool = NULL;
    if (n_seqs < 1 || n_seqs > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "seqs must hold at least one sequence");
        goto done;
    }
    if (!PyArray_Check(counts_obj) || PyArray_TYPE((PyArrayObject *)counts_obj) != NPY_INT32 ||
        PyArray_NDIM((PyArrayObject *)counts_obj) != 1 ||
        PyArray_DIM((PyArrayObject *)counts_obj, 0) != n_seqs ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)counts_obj) ||
        !PyArray_ISALIGNED((PyArrayObject *)counts_obj) ||
        !PyArray_ISNOTSWAPPED((PyArrayObject *)counts_obj)) {
        PyErr_Format(PyExc_TypeError, "n_tokens must be a 1-D int32 array with one count per "
                     "sequence (%zd)", n_seqs);
        goto done;
    }
    slots = PyMem_Malloc((size_t)n_seqs * sizeof(int));
    counts = PyMem_Malloc((size_t)n_seqs * sizeof(int));
    if (slots == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    long total = 0;
    for (Py_ssize_t i = 0; i < n_seqs; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seqs, i);
        if (!PyObject_TypeCheck(item, &SequenceType)) {
            PyErr_Format(PyExc_TypeError, "seqs[%zd] is a %s, not a PagedSequence", i,
                         Py_TYPE(item)->tp_name);
            goto done;
        }
        PoolObject *owner = ((SequenceObject *)item)->pool;
        if (pool == NULL) pool = owner;
        if (owner != pool) {
            PyErr_SetString(PyExc_ValueError, "every sequence of a batch must come from one pool");
            goto done;
        }
        if ((slots[i] = resolve_sequence(pool, item)) < 0) goto done;
        for (Py_ssize_t j = 0; j < i; j++) {
            if (slots[j] == slots[i]) {
                PyErr_Format(PyExc_ValueError, "seqs[%zd] and seqs[%zd] are the same sequence", j, i);
                goto done;
            }
        }
        counts[i] = ((const int32_t *)PyArray_DATA((PyArrayObject *)counts_obj))[i];
        if (counts[i] < 1) {
            PyErr_Format(PyExc_ValueError, "n_tokens[%zd] is %d: every sequence needs at least "
                         "one new token", i, counts[i]);
            goto done;
        }
        total += counts[i];
    }
    if (total != PyArray_DIM(tokens, 0)) {
        PyErr_Format(PyExc_ValueError, "n_tokens adds up to %ld but tokens holds %zd", total,
                     (Py_ssize_t)PyArray_DIM(tokens, 0));
        goto done;
    }
    if (pool_refuse_if_busy(pool) < 0) goto done;
    if (kv_pool_check_fits(&pool->pool, c) != KV_OK) {
        PyErr_SetString(PyExc_ValueError, "this pool was made for a different model shape");
        goto done;
    }
    npy_intp dims[2] = {n_seqs, c->vocab_size};
    logits = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    ids = PyMem_Malloc((size_t)total * sizeof(int32_t));
    if (logits == NULL || ids == NULL) {
        if (ids == NULL) PyErr_NoMemory();
        goto done;
    }
    memcpy(ids, PyArray_DATA(tokens), (size_t)total * sizeof(int32_t));
    kv_status status;
    kv_counters count = {0};
    pool->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    status = kv_model_forward_batch(&self->model, &pool->pool, (int)n_seqs, slots, counts, ids,
                                    (float *)PyArray_DATA((PyArrayObject *)logits), &count);
    Py_END_ALLOW_THREADS
    pool->busy = 0;
    if (status != KV_OK) {
        raise_pool_status(pool, status, (int)total);
        goto done;
    }
    add_to_counters(counters_obj, &count);
    result = logits;
    logits = NULL;
done:
    Py_XDECREF(logits);
    Py_DECREF(seqs);
    PyMem_Free(slots);
    PyMem_Free(counts);
    PyMem_Free(ids);
    return result;
}

static PyMethodDef model_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))model_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(tokens, cache=None, all_logits=False, counters=None) -> logits\n\n"
     "tokens: 1-D int32 array. With a cache, runs the tokens at positions\n"
     "cache.length.. and appends their K and V; without one, runs the whole sequence\n"
     "from position 0 in throw-away scratch (the no-cache path). Returns float32 logits\n"
     "(len(tokens), vocab) if all_logits else the last row (vocab,). counters: an int64\n"
     "array named by COUNTERS that gets what the call did (FLOPs, bytes) added to it."},
    {"generate", (PyCFunction)(void (*)(void))model_generate, METH_VARARGS | METH_KEYWORDS,
     "generate(token, cache, max_steps, temperature=0, top_k=0, top_p=1, uniforms=None,\n"
     "         stop_token=-1, counters=None) -> (tokens int32, step_seconds float64)\n\n"
     "Generation with the whole loop in C and the GIL released: from token (chosen, not\n"
     "yet in the KVCache), up to max_steps decode steps, each appending the newest token's\n"
     "K and V and choosing the next (arg-max at temperature 0, else a draw with\n"
     "uniforms[step]); stops after choosing stop_token. Returns each step's choice and\n"
     "wall time. The cache needs room for max_steps more."},
    {"forward_batch", (PyCFunction)(void (*)(void))model_forward_batch,
     METH_VARARGS | METH_KEYWORDS,
     "forward_batch(seqs, tokens, n_tokens, counters=None) -> logits (len(seqs), vocab)\n\n"
     "One step of a batching engine: seqs are PagedSequences of one pool; tokens (int32)\n"
     "holds their new tokens one sequence after another, n_tokens (int32) how many each.\n"
     "Every weight matrix is streamed once per 48 tokens of the batch; each row of logits is its\n"
     "sequence's last new token's, bit-identical to running that sequence alone."},
    {NULL}
};

static PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.Model",
    .tp_doc = PyDoc_STR("Model(config: dict, weights: dict)\n\n"
                        "The C forward pass over float32 weights borrowed from NumPy arrays.\n"
                        "Usually made by kvlab.load()."),
    .tp_basicsize = sizeof(ModelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)model_init,
    .tp_dealloc = (destructor)model_dealloc,
    .tp_methods = model_methods,
};

/* ============================ quantization ======================================== */

/* Rows x (rows, d) written into a one-layer store of `rows` slots, as a cache would store
 * them: the C side of kvlab.quant, for checking the two agree. 0 with the store filled,
 * or -1 with an exception set. */
static int store_rows(PyObject *x_obj, const char *name, int group, kv_store *store) {
    if (!PyArray_Check(x_obj) || PyArray_TYPE((PyArrayObject *)x_obj) != NPY_FLOAT32 ||
        PyArray_NDIM((PyArrayObject *)x_obj) != 2 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)x_obj) ||
        !PyArray_ISALIGNED((PyArrayObject *)x_obj) || !PyArray_ISNOTSWAPPED((PyArrayObject *)x_obj)) {
        PyErr_SetString(PyExc_TypeError, "x must be a C-contiguous 2-D float32 array");
        return -1;
    }
    PyArrayObject *x = (PyArrayObject *)x_obj;
    npy_intp rows = PyArray_DIM(x, 0), d = PyArray_DIM(x, 1);
    kv_format format;
    if (parse_format(name, "cache", &format) < 0) return -1;
    if (rows < 1 || d < 1 || d > (1 << 16) || (format == KV_FMT_I4 && d % 2 != 0)) {
        PyErr_SetString(PyExc_ValueError, "x must have at least one row, and rows of 1 to "
                        "65536 values (an even number for int4)");
        return -1;
    }
    if (kv_store_group(format, group, (int)d) < 0) {
        PyErr_Format(PyExc_ValueError, "group %d does not suit %s with rows of %zd values: it "
                     "must divide the row length (and be even for int4; 0 for float formats)",
                     group, name, (Py_ssize_t)d);
        return -1;
    }
    kv_status status = kv_store_init(store, format, group, 1, (size_t)rows, 1, (int)d);
    if (status != KV_OK) {
        raise_status(status);
        return -1;
    }
    for (npy_intp r = 0; r < rows; r++)
        kv_store_write(store, 0, (size_t)r, (const float *)PyArray_DATA(x) + r * d);
    return 0;
}

/* quantize(x, format, group=0) -> (codes, scales, zeros) */
static PyObject *py_quantize(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *x_obj, *result = NULL;
    const char *name;
    int group = 0;
    kv_store store;
    if (!PyArg_ParseTuple(args, "Os|i", &x_obj, &name, &group)) return NULL;
    if (store_rows(x_obj, name, group, &store) < 0) return NULL;
    npy_intp rows = (npy_intp)store.slots;   /* one KV head: head rows are whole rows */
    npy_intp code_dims[2] = {rows, (npy_intp)store.head_bytes / (store.format == KV_FMT_F32 ? 4 :
                                   store.format <= KV_FMT_BF16 ? 2 : 1)};
    npy_intp group_dims[2] = {rows, store.groups_per_head};
    PyObject *codes = PyArray_SimpleNew(2, code_dims, code_type(store.format));
    PyObject *scales = store.scales ? PyArray_SimpleNew(2, group_dims, NPY_FLOAT32) : Py_NewRef(Py_None);
    PyObject *zeros = store.zeros ? PyArray_SimpleNew(2, group_dims, NPY_FLOAT32) : Py_NewRef(Py_None);
    if (codes != NULL && scales != NULL && zeros != NULL) {
        memcpy(PyArray_DATA((PyArrayObject *)codes), store.codes, (size_t)rows * store.head_bytes);
        size_t param_bytes = (size_t)rows * store.groups_per_head * sizeof(float);
        if (store.scales) memcpy(PyArray_DATA((PyArrayObject *)scales), store.scales, param_bytes);
        if (store.zeros) memcpy(PyArray_DATA((PyArrayObject *)zeros), store.zeros, param_bytes);
        result = PyTuple_Pack(3, codes, scales, zeros);
    }
    Py_XDECREF(codes);
    Py_XDECREF(scales);
    Py_XDECREF(zeros);
    kv_store_free(&store);
    return result;
}

/* round_trip(x, format, group=0) -> the float32 values the stored codes decode to */
static PyObject *py_round_trip(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *x_obj;
    const char *name;
    int group = 0;
    kv_store store;
    if (!PyArg_ParseTuple(args, "Os|i", &x_obj, &name, &group)) return NULL;
    if (store_rows(x_obj, name, group, &store) < 0) return NULL;
    PyObject *out = PyArray_SimpleNew(2, PyArray_DIMS((PyArrayObject *)x_obj), NPY_FLOAT32);
    if (out != NULL)
        for (size_t r = 0; r < store.slots; r++)
            kv_store_read(&store, 0, r, (float *)PyArray_DATA((PyArrayObject *)out) + r * store.head_dim);
    kv_store_free(&store);
    return out;
}

/* ================================ module ========================================= */

static PyObject *py_set_num_threads(PyObject *module, PyObject *arg) {
    (void)module;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    /* More threads than a few per core only slow a call down, and OpenMP may end the whole
     * process when it cannot create them: refuse them here, with the bound. */
    long cores = kv_available_cores(), most = 4 * cores;
    if (n < 1 || n > most) {
        PyErr_Format(PyExc_ValueError, "number of threads must be 1..%ld (4 per core, %ld "
                     "cores here), got %ld", most, cores, n);
        return NULL;
    }
    kv_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    return PyLong_FromLong(kv_get_num_threads());
}

/* The kernel tiers by name, as set_kernels and KVLAB_KERNELS take them. */
static const char *const kernel_names[] = {[KV_KERNELS_FAST] = "fast",
                                           [KV_KERNELS_PLAIN] = "plain"};

/* kv_set_kernels by name; ValueError naming `source` (the argument or the variable) else */
static int set_kernels_named(const char *name, const char *source) {
    for (int k = KV_KERNELS_FAST; k <= KV_KERNELS_PLAIN; k++) {
        if (strcmp(name, kernel_names[k]) == 0) {
            kv_set_kernels((kv_kernels)k);
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "%s must be 'fast' or 'plain', got '%s'", source, name);
    return -1;
}

static PyObject *py_set_kernels(PyObject *module, PyObject *arg) {
    (void)module;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (name == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kernels must be a str");
        return NULL;
    }
    if (set_kernels_named(name, "kernels") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_get_kernels(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    return PyUnicode_FromString(kernel_names[kv_get_kernels()]);
}

static PyObject *py_memory_bandwidth(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t n_bytes = 1 << 29;
    int repeats = 5;
    if (!PyArg_ParseTuple(args, "|ni", &n_bytes, &repeats)) return NULL;
    if (n_bytes < 4096 || repeats < 1 || repeats > 1000) {
        PyErr_SetString(PyExc_ValueError, "n_bytes must be at least 4096, repeats 1..1000");
        return NULL;
    }
    double read = 0, triad = 0;
    float checksum = 0;
    kv_status status;
    Py_BEGIN_ALLOW_THREADS
    status = kv_measure_bandwidth((size_t)n_bytes / sizeof(float), repeats, &read, &triad,
                                  &checksum);
    Py_END_ALLOW_THREADS
    if (status != KV_OK) return raise_status(status);
    return Py_BuildValue("{s:d,s:d}", "read_bytes_per_s", read, "triad_bytes_per_s", triad);
}

static PyObject *py_attention_walk_bandwidth(PyObject *module, PyObject *args) {
    (void)module;
    int n_kv_heads, head_dim, context, repeats = 3;
    if (!PyArg_ParseTuple(args, "iii|i", &n_kv_heads, &head_dim, &context, &repeats)) return NULL;
    if (n_kv_heads < 1 || n_kv_heads > 1024 || head_dim < 8 || head_dim % 8 != 0 ||
        head_dim > 1024 || context < 16 || context > (1 << 22) || repeats < 1 || repeats > 1000) {
        PyErr_Format(PyExc_ValueError, "attention_walk_bandwidth needs 1..1024 KV heads, head_dim "
                     "a multiple of 8 up to 1024, a context of 16..%d and repeats 1..1000 (got %d, "
                     "%d, %d, %d)", 1 << 22, n_kv_heads, head_dim, context, repeats);
        return NULL;
    }
    double bytes_per_s = 0;
    float checksum = 0;
    kv_status status;
    Py_BEGIN_ALLOW_THREADS
    status = kv_measure_attention_walk(n_kv_heads, head_dim, context, repeats, &bytes_per_s,
                                       &checksum);
    Py_END_ALLOW_THREADS
    if (status != KV_OK) return raise_status(status);
    return PyFloat_FromDouble(bytes_per_s);
}

static PyMethodDef module_methods[] = {
    {"set_num_threads", py_set_num_threads, METH_O, "Threads used by the C core."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads used by the C core."},
    {"set_kernels", py_set_kernels, METH_O,
     "set_kernels('fast' | 'plain'): the kernels the C core runs (the same bits either way)."},
    {"get_kernels", py_get_kernels, METH_NOARGS, "The kernels the C core runs: 'fast' or 'plain'."},
    {"memory_bandwidth", py_memory_bandwidth, METH_VARARGS,
     "memory_bandwidth(n_bytes=512 MiB, repeats=5) -> {'read_bytes_per_s', 'triad_bytes_per_s'}:\n"
     "memory bandwidth measured with the core's threads, reading only and STREAM's triad\n"
     "(each array n_bytes; three are allocated)."},
    {"attention_walk_bandwidth", py_attention_walk_bandwidth, METH_VARARGS,
     "attention_walk_bandwidth(n_kv_heads, head_dim, context, repeats=3) -> bytes/s: decode\n"
     "attention's walk through an fp32 cache (each head's keys and values a tile of 16 rows\n"
     "at a time, the next tile fetched ahead) with no arithmetic, read from memory."},
    {"sample", (PyCFunction)(void (*)(void))py_sample, METH_VARARGS | METH_KEYWORDS,
     "sample(logits, temperature=0, top_k=0, top_p=1, u=0) -> token id: the choice the\n"
     "generation loop makes from one row of logits (arg-max at temperature 0; otherwise\n"
     "temperature, top-k, top-p, then the first token whose cumulative probability exceeds\n"
     "the uniform number u)."},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(x, format, group=0) -> (codes, scales, zeros): float32 rows (rows, d) stored\n"
     "as a cache stores them (fp32, fp16, bf16, int8, int4 or fp8), as kvlab.quant defines."},
    {"round_trip", py_round_trip, METH_VARARGS,
     "round_trip(x, format, group=0) -> float32: x stored as a cache stores it and read back."},
    {NULL}
};

static struct PyModuleDef kvlab_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kvlab",
    .m_doc = "kvlab's C core: Model and KVCache. Use the kvlab package rather than this module.",
    .m_size = -1,
    .m_methods = module_methods,
};

static int fetch_errors(void) {
    PyObject *errors = PyImport_ImportModule("kvlab.errors");
    if (errors == NULL) return -1;
    CacheFullError = PyObject_GetAttrString(errors, "CacheFullError");
    ConfigError = PyObject_GetAttrString(errors, "ConfigError");
    WeightsError = PyObject_GetAttrString(errors, "WeightsError");
    OutOfBlocks = PyObject_GetAttrString(errors, "OutOfBlocks");
    OutOfSequences = PyObject_GetAttrString(errors, "OutOfSequences");
    PoolInvariantError = PyObject_GetAttrString(errors, "PoolInvariantError");
    Py_DECREF(errors);
    if (CacheFullError && ConfigError && WeightsError && OutOfBlocks && OutOfSequences &&
        PoolInvariantError)
        return 0;
    Py_CLEAR(CacheFullError); Py_CLEAR(ConfigError); Py_CLEAR(WeightsError);
    Py_CLEAR(OutOfBlocks); Py_CLEAR(OutOfSequences); Py_CLEAR(PoolInvariantError);
    return -1;
}

static int add_counter_names(PyObject *module) {
    PyObject *names = PyTuple_New(N_COUNTERS);
    if (names == NULL) return -1;
    for (int i = 0; i < N_COUNTERS; i++) {
        PyObject *name = PyUnicode_FromString(counter_names[i]);
        if (name == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    int result = PyModule_AddObjectRef(module, "COUNTERS", names);
    Py_DECREF(names);
    return result;
}

PyMODINIT_FUNC PyInit__kvlab(void) {
    import_array();
    if (fetch_errors() < 0) return NULL;
    /* KVLAB_KERNELS=plain runs every model of the process on the plain kernels */
    const char *kernels = getenv("KVLAB_KERNELS");
    if (kernels != NULL && kernels[0] != '\0' && set_kernels_named(kernels, "KVLAB_KERNELS") < 0)
        return NULL;
    if (PyType_Ready(&CacheType) < 0 || PyType_Ready(&ModelType) < 0 ||
        PyType_Ready(&PoolType) < 0 || PyType_Ready(&SequenceType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&kvlab_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "KVCache", (PyObject *)&CacheType) < 0 ||
        PyModule_AddObjectRef(module, "Model", (PyObject *)&ModelType) < 0 ||
        PyModule_AddObjectRef(module, "PagedPool", (PyObject *)&PoolType) < 0 ||
        PyModule_AddObjectRef(module, "PagedSequence", (PyObject *)&SequenceType) < 0 ||
        add_counter_names(module) < 0 ||
#ifdef _OPENMP
        PyModule_AddIntConstant(module, "HAS_OPENMP", 1) < 0
#else
        PyModule_AddIntConstant(module, "HAS_OPENMP", 0) < 0
#endif
    ) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
