/* _kvlab.c: the Python binding of the kvlab core; the ONLY file that includes Python.h.
 *
 * It defines two types, Model (weights borrowed from NumPy arrays it keeps alive) and
 * KVCache (memory owned by the C core), plus thread-count functions. Every argument is
 * checked here (dtype, shape, contiguity, ranges) before the core sees a pointer, the
 * GIL is released around forward passes, and each kv_status becomes a Python exception
 * from kvlab.errors. Nothing here does arithmetic: that is the core's job.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include "kvlab.h"

/* kvlab.errors classes, looked up once at import. */
static PyObject *CacheFullError;
static PyObject *ConfigError;
static PyObject *WeightsError;

/* Raises the Python exception that matches a failed kv_status. */
static PyObject *raise_status(kv_status status) {
    switch (status) {
        case KV_ERR_NOMEM: return PyErr_NoMemory();
        case KV_ERR_CACHE_FULL: PyErr_SetString(CacheFullError, kv_strerror(status)); break;
        default: PyErr_SetString(PyExc_ValueError, kv_strerror(status)); break;
    }
    return NULL;
}

/* ================================ KVCache ======================================== */

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
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "capacity", NULL};
    int n_layers, n_kv_heads, head_dim, capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiii", kwlist, &n_layers, &n_kv_heads,
                                     &head_dim, &capacity))
        return -1;
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || capacity <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "KVCache sizes must be positive, got n_layers=%d n_kv_heads=%d "
                     "head_dim=%d capacity=%d", n_layers, n_kv_heads, head_dim, capacity);
        return -1;
    }
    if (self->cache.key != NULL) {
        /* re-initializing would free memory that existing keys/values views still show */
        PyErr_SetString(PyExc_RuntimeError, "KVCache is already initialized");
        return -1;
    }
    kv_status status = kv_cache_init(&self->cache, n_layers, n_kv_heads, head_dim, capacity);
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
    if (self->cache.key == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KVCache was not initialized");
        return -1;
    }
    return 0;
}

/* A read-only view (n_layers, length, n_kv_heads, head_dim) of K or V. Its base is the
 * cache object, so the memory stays alive as long as any view of it does. */
static PyObject *cache_view(CacheObject *self, float *data) {
    if (require_initialized(self) < 0) return NULL;
    const kv_cache *c = &self->cache;
    npy_intp item = sizeof(float);
    npy_intp dims[4] = {c->n_layers, c->length, c->n_kv_heads, c->head_dim};
    npy_intp strides[4] = {(npy_intp)c->capacity * c->n_kv_heads * c->head_dim * item,
                           (npy_intp)c->n_kv_heads * c->head_dim * item,
                           (npy_intp)c->head_dim * item, item};
    /* flags without NPY_ARRAY_WRITEABLE: students may look, never poke */
    PyObject *view = PyArray_New(&PyArray_Type, 4, dims, NPY_FLOAT32, strides, data, 0,
                                 NPY_ARRAY_ALIGNED, NULL);
    if (view == NULL) return NULL;
    Py_INCREF(self);
    /* PyArray_SetBaseObject steals the reference, even when it fails */
    if (PyArray_SetBaseObject((PyArrayObject *)view, (PyObject *)self) < 0) {
        Py_DECREF(view);
        return NULL;
    }
    return view;
}

static PyObject *cache_get_keys(CacheObject *self, void *closure) {
    (void)closure;
    return cache_view(self, self->cache.key);
}

static PyObject *cache_get_values(CacheObject *self, void *closure) {
    (void)closure;
    return cache_view(self, self->cache.value);
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
    return PyLong_FromSize_t(self->cache.key ? kv_cache_nbytes(&self->cache) : 0);
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
    kv_cache_truncate(&self->cache, (int)length);
    Py_RETURN_NONE;
}

static PyObject *cache_repr(CacheObject *self) {
    const kv_cache *c = &self->cache;
    return PyUnicode_FromFormat(
        "KVCache(length=%d, capacity=%d, n_layers=%d, n_kv_heads=%d, head_dim=%d, "
        "dtype=fp32, nbytes=%zu)", c->length, c->capacity, c->n_layers, c->n_kv_heads,
        c->head_dim, c->key ? kv_cache_nbytes(c) : (size_t)0);
}

static PyGetSetDef cache_getset[] = {
    {"keys", (getter)cache_get_keys, NULL,
     "Cached keys of the filled positions, a read-only zero-copy ndarray\n"
     "(n_layers, length, n_kv_heads, head_dim), after RoPE.", NULL},
    {"values", (getter)cache_get_values, NULL,
     "Cached values of the filled positions, a read-only zero-copy ndarray\n"
     "(n_layers, length, n_kv_heads, head_dim).", NULL},
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
    {NULL}
};

static PyTypeObject CacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.KVCache",
    .tp_doc = PyDoc_STR("KVCache(n_layers, n_kv_heads, head_dim, capacity)\n\n"
                        "A contiguous fp32 KV cache for one sequence. Usually made with\n"
                        "model.new_cache(max_seq_len)."),
    .tp_basicsize = sizeof(CacheObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cache_init,
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_repr = (reprfunc)cache_repr,
    .tp_methods = cache_methods,
    .tp_getset = cache_getset,
};

/* ================================= Model ========================================= */

#define N_WEIGHTS 13

typedef struct {
    PyObject_HEAD
    kv_model model;
    PyObject *arrays[N_WEIGHTS];  /* the NumPy arrays whose memory the model reads */
} ModelObject;

static int read_int(PyObject *config, const char *key, int *out) {
    PyObject *value = PyDict_GetItemString(config, key);  /* borrowed */
    if (value == NULL) {
        PyErr_Format(ConfigError, "model config is missing %s", key);
        return -1;
    }
    long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v <= 0 || v > (1L << 30)) {
        PyErr_Format(ConfigError, "config %s must be a positive integer, got %ld", key, v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

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
    if (read_int(config, "dim", &c->dim) < 0 || read_int(config, "hidden_dim", &c->hidden_dim) < 0 ||
        read_int(config, "n_layers", &c->n_layers) < 0 || read_int(config, "n_heads", &c->n_heads) < 0 ||
        read_int(config, "n_kv_heads", &c->n_kv_heads) < 0 ||
        read_int(config, "head_dim", &c->head_dim) < 0 ||
        read_int(config, "vocab_size", &c->vocab_size) < 0 ||
        read_int(config, "max_seq_len", &c->max_seq_len) < 0)
        goto fail;
    PyObject *eps = PyDict_GetItemString(config, "norm_eps");
    PyObject *interleaved = PyDict_GetItemString(config, "rope_interleaved");
    if (eps == NULL || interleaved == NULL) {
        PyErr_SetString(ConfigError, "model config needs norm_eps and rope_interleaved");
        goto fail;
    }
    c->norm_eps = (float)PyFloat_AsDouble(eps);
    if (PyErr_Occurred()) goto fail;
    c->rope_interleaved = PyObject_IsTrue(interleaved);
    if (c->rope_interleaved < 0) goto fail;
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0 || !(c->norm_eps > 0.0f)) {
        PyErr_Format(ConfigError, "config does not fit: n_kv_heads (%d) must divide n_heads "
                     "(%d), head_dim (%d) must be even, norm_eps must be > 0",
                     c->n_kv_heads, c->n_heads, c->head_dim);
        goto fail;
    }

    npy_intp L = c->n_layers, D = c->dim, H = c->hidden_dim, V = c->vocab_size;
    npy_intp Q = (npy_intp)c->n_heads * c->head_dim, KV = (npy_intp)c->n_kv_heads * c->head_dim;
    kv_weights *w = &self->model.weights;
    struct { const char *name; int ndim; npy_intp shape[3]; const float **data; } table[N_WEIGHTS] = {
        {"token_embedding", 2, {V, D}, &w->token_embedding},
        {"attn_norm", 2, {L, D}, &w->attn_norm},
        {"wq", 3, {L, Q, D}, &w->wq},
        {"wk", 3, {L, KV, D}, &w->wk},
        {"wv", 3, {L, KV, D}, &w->wv},
        {"wo", 3, {L, D, Q}, &w->wo},
        {"ffn_norm", 2, {L, D}, &w->ffn_norm},
        {"w1", 3, {L, H, D}, &w->w1},
        {"w2", 3, {L, D, H}, &w->w2},
        {"w3", 3, {L, H, D}, &w->w3},
        {"final_norm", 1, {D}, &w->final_norm},
        {"classifier", 2, {V, D}, &w->classifier},
        {"rope_inv_freq", 1, {c->head_dim / 2}, &w->rope_inv_freq},
    };
    for (int i = 0; i < N_WEIGHTS; i++)
        if (take_weight(weights, table[i].name, table[i].ndim, table[i].shape,
                        &self->arrays[i], table[i].data) < 0)
            goto fail;
    if (kv_model_check(&self->model) != KV_OK) {
        PyErr_SetString(ConfigError, "model config or weights are inconsistent");
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
        PyErr_SetString(PyExc_ValueError, "tokens must be C-contiguous");
        return -1;
    }
    if (PyArray_DIM(tokens, 0) > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "too many tokens in one call");
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

static PyObject *model_forward(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tokens", "cache", "all_logits", NULL};
    PyObject *tokens_obj, *cache_obj = Py_None;
    int all_logits = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Op", kwlist, &tokens_obj, &cache_obj,
                                     &all_logits))
        return NULL;
    if (self->model.weights.token_embedding == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Model was not initialized");
        return NULL;
    }
    if (check_tokens(self, tokens_obj) < 0) return NULL;
    PyArrayObject *tokens = (PyArrayObject *)tokens_obj;
    int n_tokens = (int)PyArray_DIM(tokens, 0);
    const kv_config *c = &self->model.config;

    CacheObject *cache = NULL;
    if (cache_obj != Py_None) {
        if (!PyObject_TypeCheck(cache_obj, &CacheType)) {
            PyErr_Format(PyExc_TypeError, "cache must be a KVCache or None, got %s",
                         Py_TYPE(cache_obj)->tp_name);
            return NULL;
        }
        cache = (CacheObject *)cache_obj;
        if (require_initialized(cache) < 0 || refuse_if_busy(cache) < 0) return NULL;
        if (kv_cache_check_fits(&cache->cache, c) != KV_OK) {
            PyErr_Format(PyExc_ValueError, "this cache holds %d layers x %d KV heads x %d, "
                         "but the model needs %d x %d x %d", cache->cache.n_layers,
                         cache->cache.n_kv_heads, cache->cache.head_dim, c->n_layers,
                         c->n_kv_heads, c->head_dim);
            return NULL;
        }
        int free_slots = cache->cache.capacity - cache->cache.length;
        if (n_tokens > free_slots) {
            PyErr_Format(CacheFullError, "the KV cache is full: it holds %d of %d positions "
                         "and cannot take %d more (make it with a larger max_seq_len, or "
                         "truncate/reset it)", cache->cache.length, cache->cache.capacity,
                         n_tokens);
            return NULL;
        }
    }

    npy_intp dims[2] = {n_tokens, c->vocab_size};
    PyObject *logits = all_logits ? PyArray_SimpleNew(2, dims, NPY_FLOAT32)
                                  : PyArray_SimpleNew(1, &dims[1], NPY_FLOAT32);
    if (logits == NULL) return NULL;
    float *out = (float *)PyArray_DATA((PyArrayObject *)logits);
    const int32_t *ids = (const int32_t *)PyArray_DATA(tokens);

    /* The token array and the cache are kept alive by this call's references; the busy
     * flag stops another thread from resizing or reusing the cache meanwhile. */
    kv_status status;
    if (cache != NULL) cache->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (cache != NULL)
        status = kv_model_forward(&self->model, &cache->cache, ids, n_tokens, out, all_logits);
    else
        status = kv_model_forward_uncached(&self->model, ids, n_tokens, out, all_logits);
    Py_END_ALLOW_THREADS
    if (cache != NULL) cache->busy = 0;
    if (status != KV_OK) {
        Py_DECREF(logits);
        return raise_status(status);
    }
    return logits;
}

static PyMethodDef model_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))model_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(tokens, cache=None, all_logits=False) -> logits\n\n"
     "tokens: 1-D int32 array. With a cache, runs the tokens at positions\n"
     "cache.length.. and appends their K and V; without one, runs the whole sequence\n"
     "from position 0 in throw-away scratch (the no-cache path). Returns float32 logits\n"
     "(len(tokens), vocab) if all_logits else the last row (vocab,)."},
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

/* ================================ module ========================================= */

static PyObject *py_set_num_threads(PyObject *module, PyObject *arg) {
    (void)module;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 1024) {
        PyErr_Format(PyExc_ValueError, "number of threads must be 1..1024, got %ld", n);
        return NULL;
    }
    kv_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    return PyLong_FromLong(kv_get_num_threads());
}

static PyMethodDef module_methods[] = {
    {"set_num_threads", py_set_num_threads, METH_O, "Threads used by the C core."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads used by the C core."},
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
    Py_DECREF(errors);
    return (CacheFullError && ConfigError && WeightsError) ? 0 : -1;
}

PyMODINIT_FUNC PyInit__kvlab(void) {
    import_array();
    if (fetch_errors() < 0) return NULL;
    if (PyType_Ready(&CacheType) < 0 || PyType_Ready(&ModelType) < 0) return NULL;
    PyObject *module = PyModule_Create(&kvlab_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "KVCache", (PyObject *)&CacheType) < 0 ||
        PyModule_AddObjectRef(module, "Model", (PyObject *)&ModelType) < 0 ||
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
