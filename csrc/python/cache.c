/* cache.c: KVCache, one sequence's contiguous cache (kv_cache), owned by the core.
 *
 * Its keys, values, codes and scales are zero-copy read-only views whose base is the
 * cache object, so the memory lives as long as any view of it; that is also why a cache
 * cannot be initialized twice (the memory under existing views would be freed). They show
 * rows in order, oldest first: once keep() has turned the cache's ring of rows (kvcache.c),
 * reading one turns it back first. The per-row copies (positions, attention weights,
 * dequantized) read rows in the same order through the ring, turning nothing.
 */
#include "binding.h"

#include <limits.h>

static int require_initialized(const CacheObject *self) {
    if (self->cache.key.codes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KVCache was not initialized");
        return -1;
    }
    return 0;
}

int kv_py_cache_ready(CacheObject *self) {
    if (require_initialized(self) < 0) return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this KVCache is in use by a forward pass in another thread; "
                        "give each thread its own cache");
        return -1;
    }
    return 0;
}

PyObject *kv_py_cache_refused(const CacheObject *cache, kv_status status, int n_positions,
                              const kv_config *model) {
    const kv_cache *c = &cache->cache;
    if (status == KV_ERR_CACHE_FULL)
        return kv_py_raise(status, "the KV cache is full: it holds %d of %d positions and "
                           "cannot take %d more (make it with a larger max_seq_len, or "
                           "truncate/reset it)", c->length, c->capacity, n_positions);
    if (status == KV_ERR_CACHE_MISMATCH && model != NULL)
        return kv_py_raise(status, "this cache holds %d layers x %d KV heads x %d, but the "
                           "model needs %d x %d x %d", c->n_layers, c->n_kv_heads, c->head_dim,
                           model->n_layers, model->n_kv_heads, model->head_dim);
    return kv_py_raise(status, NULL);
}

/* ---- life -------------------------------------------------------------------------- */

static int cache_init(CacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "capacity", "key_format",
                             "value_format", "key_group", "value_group", "window", NULL};
    int n_layers, n_kv_heads, head_dim, capacity, key_group = 0, value_group = 0, window = 0;
    const char *key_name = "fp32", *value_name = "fp32";
    if (kv_py_int_arguments(args, kwds, "iiii|ssiii", kwlist) < 0) return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiii|ssiii", kwlist, &n_layers, &n_kv_heads,
                                     &head_dim, &capacity, &key_name, &value_name, &key_group,
                                     &value_group, &window))
        return -1;
    if (self->cache.key.codes != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KVCache is already initialized");
        return -1;
    }
    kv_cache_format format;
    if (kv_py_make_format(&format, key_name, value_name, key_group, value_group, window) < 0)
        return -1;
    /* the core checks every number; on refusal it leaves the cache zeroed */
    kv_status status = kv_cache_init(&self->cache, n_layers, n_kv_heads, head_dim, capacity,
                                     &format);
    if (status == KV_OK) return 0;
    if (status != KV_ERR_INVALID_ARG)
        kv_py_raise(status, NULL);
    else if (!kv_py_group_refused(&format, head_dim))
        kv_py_raise(status, "KVCache(n_layers=%d, n_kv_heads=%d, head_dim=%d, capacity=%d, "
                    "window=%d) is refused: sizes must be positive (" KV_PY_STORE_LIMITS
                    ", capacity up to 2**28) and the window "
                    "between 0 and capacity", n_layers, n_kv_heads, head_dim, capacity, window);
    return -1;
}

static void cache_dealloc(CacheObject *self) {
    kv_cache_free(&self->cache);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- views ------------------------------------------------------------------------- */

/* Puts the ring of rows back in order (row i in slot i), so that a view of the memory
 * shows rows in order; a cache whose ring never turned is left alone. */
static int straighten(CacheObject *self) {
    if (self->cache.ring_start == 0) return 0;
    if (kv_py_cache_ready(self) < 0) return -1;   /* a forward in another thread reads it */
    kv_status status;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    status = kv_cache_straighten(&self->cache);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (status == KV_OK) return 0;
    kv_py_raise(status, NULL);
    return -1;
}

/* One part of the K or V store, (n_layers, length, n_kv_heads, per head). */
static PyObject *cache_store_view(CacheObject *self, const kv_store *store, int part) {
    if (require_initialized(self) < 0 || straighten(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    npy_intp lead_dims[2] = {c->n_layers, c->length};
    npy_intp lead_strides[2] = {(npy_intp)c->n_kv_heads * c->capacity, 1};  /* layer, position */
    return kv_py_store_view((PyObject *)self, store, part, 2, lead_dims, lead_strides);
}

/* keys and values as numbers: the stored floats themselves for fp32 and fp16 */
static PyObject *cache_float_view(CacheObject *self, const kv_store *store, const char *what) {
    if (require_initialized(self) < 0) return NULL;
    if (store->format != KV_FMT_F32 && store->format != KV_FMT_F16) {
        const char *side = what[0] == 'k' ? "key" : "value";
        PyErr_Format(PyExc_TypeError, "this cache stores its %s as %s codes, not floats: "
                     "see %s_codes and %s_scales, or dequantized() for float32 copies",
                     what, kv_py_format_names[store->format], side, side);
        return NULL;
    }
    return cache_store_view(self, store, KV_PY_CODES);
}

static PyObject *cache_get_keys(CacheObject *self, void *closure) {
    return cache_float_view(self, &self->cache.key, "keys");
}

static PyObject *cache_get_values(CacheObject *self, void *closure) {
    return cache_float_view(self, &self->cache.value, "values");
}

/* key_codes, key_scales, ... value_zeros: closure = KV_PY_PART(is_value, part) */
static PyObject *cache_get_part(CacheObject *self, void *closure) {
    int which = (int)(intptr_t)closure;
    return cache_store_view(self, (which >> 2) ? &self->cache.value : &self->cache.key,
                            which & 3);
}

/* ---- attributes -------------------------------------------------------------------- */

/* closure NULL: the keys' attribute; non-NULL: the values' */
static PyObject *cache_get_format(CacheObject *self, void *closure) {
    if (require_initialized(self) < 0) return NULL;
    return kv_py_format_name((closure ? &self->cache.value : &self->cache.key)->format);
}

/* key_dtype and value_dtype: the old names of key_format and value_format, one release */
static PyObject *cache_get_old_format(CacheObject *self, void *closure) {
    if (kv_py_warn_renamed(closure ? "KVCache.value_dtype" : "KVCache.key_dtype",
                           closure ? "KVCache.value_format" : "KVCache.key_format") < 0)
        return NULL;
    return cache_get_format(self, closure);
}

static PyObject *cache_get_group(CacheObject *self, void *closure) {
    return PyLong_FromLong((closure ? &self->cache.value : &self->cache.key)->group);
}

static PyObject *cache_get_window(CacheObject *self, void *closure) {
    return PyLong_FromLong(self->cache.window);
}

static PyObject *cache_get_length(CacheObject *self, void *closure) {
    return PyLong_FromLong(self->cache.length);
}

static PyObject *cache_get_capacity(CacheObject *self, void *closure) {
    return PyLong_FromLong(self->cache.capacity);
}

static PyObject *cache_get_next_position(CacheObject *self, void *closure) {
    return PyLong_FromLong(self->cache.next_position);
}

static PyObject *cache_get_tracks_attention(CacheObject *self, void *closure) {
    return PyBool_FromLong(self->cache.attention != NULL);
}

/* A copy (n_layers, length, n_kv_heads) of per-row bookkeeping kept (n_layers, n_kv_heads,
 * capacity) in the core, one value per slot, rows in order: copies, because the core may
 * free or move it under a view. */
static PyObject *per_row_copy(const kv_cache *c, const void *source, int type) {
    npy_intp dims[3] = {c->n_layers, c->length, c->n_kv_heads};
    PyObject *array = PyArray_ZEROS(3, dims, type, 0);
    if (array == NULL) return NULL;
    for (int layer = 0; layer < c->n_layers; layer++)
        for (int row = 0; row < c->length; row++)
            for (int head = 0; head < c->n_kv_heads; head++) {
                size_t from = ((size_t)layer * c->n_kv_heads + head) * c->capacity +
                              kv_cache_slot(c, row);
                void *to = PyArray_GETPTR3((PyArrayObject *)array, layer, row, head);
                if (type == NPY_INT32)
                    *(int32_t *)to = source ? ((const int32_t *)source)[from] : row;
                else
                    *(float *)to = ((const float *)source)[from];
            }
    return array;
}

static PyObject *cache_get_positions(CacheObject *self, void *closure) {
    if (kv_py_cache_ready(self) < 0) return NULL;   /* a forward in another thread moves length */
    return per_row_copy(&self->cache, self->cache.positions, NPY_INT32);
}

static PyObject *cache_get_attention_weights(CacheObject *self, void *closure) {
    if (kv_py_cache_ready(self) < 0) return NULL;
    if (self->cache.attention == NULL) Py_RETURN_NONE;
    return per_row_copy(&self->cache, self->cache.attention, NPY_FLOAT32);
}

static PyObject *cache_get_nbytes(CacheObject *self, void *closure) {
    return PyLong_FromSize_t(self->cache.key.codes ? kv_cache_nbytes(&self->cache) : 0);
}

static PyObject *cache_get_shape(CacheObject *self, void *closure) {
    const kv_cache *c = &self->cache;
    return Py_BuildValue("(iiii)", c->n_layers, c->capacity, c->n_kv_heads, c->head_dim);
}

static PyObject *cache_repr(CacheObject *self) {
    const kv_cache *c = &self->cache;
    if (c->key.codes == NULL) return PyUnicode_FromString("KVCache(uninitialized)");
    char window[32] = "";
    if (c->window > 0) PyOS_snprintf(window, sizeof window, ", window=%d", c->window);
    const char *key = kv_py_format_names[c->key.format];
    const char *value = kv_py_format_names[c->value.format];
    if (c->key.format == c->value.format && c->key.group == c->value.group)
        return PyUnicode_FromFormat(
            "KVCache(length=%d, capacity=%d, n_layers=%d, n_kv_heads=%d, head_dim=%d, "
            "dtype=%s%s, nbytes=%zu)", c->length, c->capacity, c->n_layers, c->n_kv_heads,
            c->head_dim, key, window, kv_cache_nbytes(c));
    return PyUnicode_FromFormat(
        "KVCache(length=%d, capacity=%d, n_layers=%d, n_kv_heads=%d, head_dim=%d, "
        "key_format=%s, value_format=%s%s, nbytes=%zu)", c->length, c->capacity, c->n_layers,
        c->n_kv_heads, c->head_dim, key, value, window, kv_cache_nbytes(c));
}

/* ---- methods ----------------------------------------------------------------------- */

static PyObject *cache_dequantized(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_cache_ready(self) < 0) return NULL;
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
    if (kv_py_int_arguments(args, kwds, "O|i", kwlist) < 0) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|i", kwlist, &q_obj, &layer)) return NULL;
    if (kv_py_cache_ready(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    /* head_dim is the binding's to check: the core reads n_heads rows of head_dim */
    PyArrayObject *q = kv_py_array(q_obj, &(kv_py_array_spec){
        .name = "q", .type = NPY_FLOAT32, .ndim = 2, .shape = {KV_PY_ANY, c->head_dim},
        .axes = "n_heads,head_dim"});
    if (q == NULL) return NULL;
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
    if (status == KV_OK) return out;
    Py_DECREF(out);
    if (status != KV_ERR_INVALID_ARG) return kv_py_raise(status, NULL);
    /* the core refused the layer, an empty cache or the heads: say which */
    if (layer < 0 || layer >= c->n_layers) {
        PyErr_Format(PyExc_IndexError, "layer %d out of range [0, %d)", layer, c->n_layers);
        return NULL;
    }
    if (c->length == 0)
        return kv_py_raise(status, "the cache is empty: nothing to attend to");
    return kv_py_raise(status, "q must have shape (n_heads, head_dim=%d) with n_heads a "
                       "multiple of n_kv_heads=%d, at most %d heads, got %d heads",
                       c->head_dim, c->n_kv_heads, 65536 / c->head_dim, n_heads);
}

static PyObject *cache_reset(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (kv_py_cache_ready(self) < 0) return NULL;
    kv_cache_truncate(&self->cache, 0);
    Py_RETURN_NONE;
}

static PyObject *cache_truncate(CacheObject *self, PyObject *arg) {
    if (kv_py_cache_ready(self) < 0) return NULL;
    long long length;
    if (kv_py_length_arg(arg, "truncate(n): n", &length) < 0) return NULL;
    /* the core takes an int: a length beyond one is refused all the same, never wrapped */
    int n = length > INT_MAX ? INT_MAX : length < INT_MIN ? INT_MIN : (int)length;
    kv_status status = kv_cache_truncate(&self->cache, n);
    if (status == KV_OK) Py_RETURN_NONE;
    const kv_cache *c = &self->cache;
    if (c->window > 0 && length >= 0 && length <= c->length)
        return kv_py_raise(status, "truncate(%lld): a cache with a residual window can only be "
                           "reset: the full-precision rows of the positions before the cut "
                           "are gone", length);
    if (c->positions != NULL && length >= 0 && length <= c->length)
        return kv_py_raise(status, "truncate(%lld): the rows past %lld do not hold the newest "
                           "positions (rows were dropped since they came), so they cannot "
                           "be taken back", length, length);
    return kv_py_raise(status, "truncate(%lld): length must be between 0 and the current "
                       "length %d", length, c->length);
}

static PyObject *cache_keep(CacheObject *self, PyObject *arg) {
    if (kv_py_cache_ready(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    if (c->window > 0)
        return kv_py_raise(KV_ERR_INVALID_ARG, "keep(): a cache with a residual window "
                           "cannot drop rows: its full-precision rows are kept by position");
    PyArrayObject *rows = kv_py_rows_to_keep(arg, c->n_layers, c->n_kv_heads);
    if (rows == NULL) return NULL;
    int n_keep = (int)PyArray_DIM(rows, 1);
    kv_status status = kv_cache_keep(&self->cache, n_keep, (const int32_t *)PyArray_DATA(rows));
    if (status == KV_OK) Py_RETURN_NONE;
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "keep(rows): rows[layer, :, head] must be strictly "
                           "increasing row numbers below the length %d (got %d rows to keep)",
                           c->length, n_keep);
    return kv_py_raise(status, NULL);
}

static PyObject *cache_track_attention(CacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"on", NULL};
    int on = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &on)) return NULL;
    if (kv_py_cache_ready(self) < 0) return NULL;
    kv_status status = kv_cache_track_attention(&self->cache, on);
    if (status == KV_OK) Py_RETURN_NONE;
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "track_attention(): a cache with a residual window reads "
                           "its newest rows in full precision; its weights are not tracked");
    return kv_py_raise(status, NULL);
}

/* Whether obj is laid out as cache.keys gives rows, (n_layers, length, n_kv_heads, head_dim),
 * rather than append's (n_tokens, n_layers, ...): the natural mistake of copying one cache
 * into another, worth its own message. (When length == n_layers the two cannot be told
 * apart by shape.) */
static int layer_major(PyObject *obj, const kv_cache *c) {
    if (!PyArray_Check(obj) || PyArray_NDIM((PyArrayObject *)obj) != 4) return 0;
    const npy_intp *d = PyArray_DIMS((PyArrayObject *)obj);
    return d[0] == c->n_layers && d[1] != c->n_layers && d[2] == c->n_kv_heads &&
           d[3] == c->head_dim;
}

static PyObject *cache_append(CacheObject *self, PyObject *args) {
    PyObject *keys_obj, *values_obj;
    if (!PyArg_ParseTuple(args, "OO", &keys_obj, &values_obj)) return NULL;
    if (kv_py_cache_ready(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    if (layer_major(keys_obj, c) || layer_major(values_obj, c)) {
        PyErr_SetString(PyExc_ValueError,
                        "append takes rows token by token, (n_tokens, n_layers, n_kv_heads, "
                        "head_dim); these are laid out as cache.keys and cache.values give "
                        "them, (n_layers, length, n_kv_heads, head_dim): pass "
                        "np.ascontiguousarray(keys.transpose(1, 0, 2, 3)), and the same for "
                        "the values");
        return NULL;
    }
    kv_py_array_spec rows = {.name = "keys", .type = NPY_FLOAT32, .ndim = 4,
                             .shape = {KV_PY_ANY, c->n_layers, c->n_kv_heads, c->head_dim},
                             .axes = "n_tokens,n_layers,n_kv_heads,head_dim"};
    PyArrayObject *keys = kv_py_array(keys_obj, &rows);
    if (keys == NULL) return NULL;
    rows.name = "values";
    rows.shape[0] = PyArray_DIM(keys, 0);   /* as many as the keys */
    PyArrayObject *values = kv_py_array(values_obj, &rows);
    if (values == NULL) return NULL;
    int n = (int)PyArray_DIM(keys, 0);
    kv_status status = kv_cache_append(&self->cache, n, (const float *)PyArray_DATA(keys),
                                       (const float *)PyArray_DATA(values));
    if (status == KV_OK) Py_RETURN_NONE;
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "append needs at least one row: keys and values of shape "
                           "(n_tokens >= 1, n_layers, n_kv_heads, head_dim)");
    return kv_py_cache_refused(self, status, n, NULL);
}

/* ---- the type ---------------------------------------------------------------------- */

static PyGetSetDef cache_getset[] = {
    {"keys", (getter)cache_get_keys, NULL,
     "Cached keys of the filled positions, a read-only zero-copy ndarray\n"
     "(n_layers, length, n_kv_heads, head_dim), after RoPE: float32, or float16 in an fp16\n"
     "cache. Other formats store codes: see key_codes, or dequantized(). Rows in order,\n"
     "row i holding position positions[:, i]: after keep() turned the ring of rows, reading\n"
     "this turns it back first (moving every row once), and views read before then show\n"
     "the memory as it is now.", NULL},
    {"values", (getter)cache_get_values, NULL,
     "Cached values of the filled positions, a read-only zero-copy ndarray\n"
     "(n_layers, length, n_kv_heads, head_dim), as for keys.", NULL},
    {"key_codes", (getter)cache_get_part, NULL,
     "The stored key codes, zero-copy, (n_layers, length, n_kv_heads, per head): float32,\n"
     "float16, bf16 bits as uint16, int8, int4 packed two per uint8 (head_dim / 2 per head),\n"
     "or fp8 e4m3 bits as uint8.", KV_PY_PART(0, KV_PY_CODES)},
    {"key_scales", (getter)cache_get_part, NULL,
     "Scales of the key groups, zero-copy, (n_layers, length, n_kv_heads, head_dim / group);\n"
     "None for fp32, fp16 and bf16.", KV_PY_PART(0, KV_PY_SCALES)},
    {"key_zeros", (getter)cache_get_part, NULL,
     "Zero points of the key groups (int4 only, else None).", KV_PY_PART(0, KV_PY_ZEROS)},
    {"value_codes", (getter)cache_get_part, NULL, "As key_codes, for V.",
     KV_PY_PART(1, KV_PY_CODES)},
    {"value_scales", (getter)cache_get_part, NULL, "As key_scales, for V.",
     KV_PY_PART(1, KV_PY_SCALES)},
    {"value_zeros", (getter)cache_get_part, NULL, "As key_zeros, for V.",
     KV_PY_PART(1, KV_PY_ZEROS)},
    {"key_format", (getter)cache_get_format, NULL,
     "Element format of the keys: fp32, fp16, bf16, int8, int4 or fp8 (with key_group and\n"
     "window, the cache format).", NULL},
    {"value_format", (getter)cache_get_format, NULL, "Element format of the values.", (void *)1},
    {"key_dtype", (getter)cache_get_old_format, NULL,
     "Deprecated: the old name of key_format (warns; goes in the next release).", NULL},
    {"value_dtype", (getter)cache_get_old_format, NULL,
     "Deprecated: the old name of value_format (warns; goes in the next release).", (void *)1},
    {"key_group", (getter)cache_get_group, NULL, "Key values per scale (0: no scales).", NULL},
    {"value_group", (getter)cache_get_group, NULL, "Value values per scale.", (void *)1},
    {"window", (getter)cache_get_window, NULL,
     "Residual window: each query reads this many most recent positions (itself included)\n"
     "in float32.", NULL},
    {"length", (getter)cache_get_length, NULL, "Positions filled so far.", NULL},
    {"capacity", (getter)cache_get_capacity, NULL, "Positions reserved (max_seq_len).", NULL},
    {"next_position", (getter)cache_get_next_position, NULL,
     "Position of the next token (its RoPE angle): length, plus every row keep() dropped.",
     NULL},
    {"positions", (getter)cache_get_positions, NULL,
     "The position each kept row holds, int32 (n_layers, length, n_kv_heads), indexed as\n"
     "keys are, oldest row first (a copy): arange(length) until keep() drops rows; after,\n"
     "each layer and head may hold different positions.", NULL},
    {"tracks_attention", (getter)cache_get_tracks_attention, NULL,
     "Whether forward calls add up the attention weight each row receives.", NULL},
    {"attention_weights", (getter)cache_get_attention_weights, NULL,
     "The attention weight each row has received since it was written, summed over the\n"
     "queries of forward calls and the query heads of its KV head, float32\n"
     "(n_layers, length, n_kv_heads) (a copy); None unless track_attention() is on.", NULL},
    {"nbytes", (getter)cache_get_nbytes, NULL,
     "Bytes this cache allocated for K and V (the full capacity).", NULL},
    {"shape", (getter)cache_get_shape, NULL,
     "(n_layers, capacity, n_kv_heads, head_dim) of the K (or V) buffer.", NULL},
    {NULL}
};

static PyMethodDef cache_methods[] = {
    {"reset", (PyCFunction)cache_reset, METH_NOARGS,
     "Forget every cached token (length = 0, next_position = 0)."},
    {"truncate", (PyCFunction)cache_truncate, METH_O,
     "truncate(n): roll back to the first n rows, as if the newest tokens never came\n"
     "(next_position goes back by as many; rows keep() dropped meanwhile stay dropped)."},
    {"keep", (PyCFunction)cache_keep, METH_O,
     "keep(rows): keep only these rows, int32 (n_layers, n_keep, n_kv_heads), strictly\n"
     "increasing along n_keep, and drop the rest: the kept rows become rows 0 .. n_keep - 1\n"
     "in order, length becomes n_keep, and next_position stays (see positions). Each layer\n"
     "and head may keep different rows. The memory holds the rows as a ring: keeping the\n"
     "newest rows turns it past the dropped ones and moves no row (a sliding window);\n"
     "otherwise the fewer rows move, those before the dropped ones or those after.\n"
     "kvlab.cache_policy decides which rows to keep."},
    {"track_attention", (PyCFunction)(void (*)(void))cache_track_attention,
     METH_VARARGS | METH_KEYWORDS,
     "track_attention(on=True): start (from zero) or stop adding up the attention weight\n"
     "each row receives in later forward calls (see attention_weights)."},
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

PyTypeObject kv_py_cache_type = {
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
