/* model.c: Model, the forward pass over weights borrowed from NumPy arrays.
 *
 * The weights are never copied: the model keeps a reference to each array and the core
 * reads their memory. Each call copies the caller's token ids (and sampling numbers) while
 * it holds the GIL, then releases the GIL for the core's work, so another thread may
 * change or drop the caller's arrays meanwhile without harm. A cache or pool being written
 * is marked busy for that time; every other use of it raises.
 */
#include "binding.h"

#include <math.h>
#include <string.h>

#include "model_args.h"

typedef struct {
    PyObject_HEAD
    kv_model model;
    PyObject *arrays[N_WEIGHTS];  /* the NumPy arrays whose memory the model reads */
} ModelObject;

/* ---- weights ----------------------------------------------------------------------- */

/* The format `formats` (None or a dict of format names) gives weight `spec`: float32 unless
 * named there, and only a matrix may be named. */
static int weight_format(PyObject *formats, const weight_spec *spec, kv_weight_format *format) {
    *format = KV_WEIGHT_F32;
    if (formats == Py_None) return 0;
    PyObject *name = PyDict_GetItemString(formats, spec->name);   /* borrowed */
    if (name == NULL) return 0;
    if (!PyUnicode_Check(name)) {
        PyErr_Format(kv_py_error.weights, "the format of weight %s must be a str", spec->name);
        return -1;
    }
    if (kv_py_parse_weight_format(PyUnicode_AsUTF8(name), format) < 0) return -1;
    if (spec->format == NULL && *format != KV_WEIGHT_F32) {
        PyErr_Format(kv_py_error.weights, "weight %s is a vector: always fp32", spec->name);
        return -1;
    }
    return 0;
}

/* Checks one weight array and borrows its data pointer; keeps a reference in *keep. A
 * float32 array has the spec's shape; a matrix in another format is uint8, its last axis
 * the bytes of a row (kvlab.weight_formats.quantize). */
static int take_weight(PyObject *weights, PyObject *formats, const weight_spec *spec,
                       PyObject **keep) {
    PyObject *obj = PyDict_GetItemString(weights, spec->name);  /* borrowed */
    if (obj == NULL) {
        PyErr_Format(kv_py_error.weights, "weights are missing %s", spec->name);
        return -1;
    }
    kv_weight_format format;
    if (weight_format(formats, spec, &format) < 0) return -1;
    char name[64];
    PyOS_snprintf(name, sizeof name, "weight %s", spec->name);
    kv_py_array_spec want = {.name = name, .type = NPY_FLOAT32, .ndim = spec->ndim,
                             .error = kv_py_error.weights};
    for (int i = 0; i < spec->ndim; i++) want.shape[i] = spec->shape[i];
    if (format != KV_WEIGHT_F32) {
        int in_dim = (int)spec->shape[spec->ndim - 1];
        size_t row_bytes = kv_weight_row_bytes(format, in_dim);
        if (row_bytes == 0) {
            PyErr_Format(kv_py_error.weights, "weight %s: rows of %d values do not suit %s "
                         "(q8_0, q4_0 and q4_1 need a multiple of 32)", spec->name, in_dim,
                         kv_py_weight_format_names[format]);
            return -1;
        }
        want.type = NPY_UINT8;
        want.shape[spec->ndim - 1] = (npy_intp)row_bytes;
    }
    PyArrayObject *array = kv_py_array(obj, &want);
    if (array == NULL) return -1;
    Py_INCREF(obj);
    *keep = obj;
    *spec->data = PyArray_DATA(array);
    if (spec->format != NULL) *spec->format = format;
    return 0;
}

/* Every key of `formats` names one of the model's weights: a misspelt or unknown name
 * would otherwise be passed over, and its matrix read as float32 without a word. */
static int check_format_names(PyObject *formats, const weight_spec table[N_WEIGHTS]) {
    if (formats == Py_None) return 0;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(formats, &pos, &key, &value)) {
        int known = 0;
        for (int i = 0; i < N_WEIGHTS && PyUnicode_Check(key); i++)
            known |= PyUnicode_CompareWithASCIIString(key, table[i].name) == 0;
        if (!known) {
            PyErr_Format(kv_py_error.weights, "formats names %R, which is not one of the "
                         "model's weights", key);
            return -1;
        }
    }
    return 0;
}

static void model_release_arrays(ModelObject *self) {
    for (int i = 0; i < N_WEIGHTS; i++) Py_CLEAR(self->arrays[i]);
    memset(&self->model, 0, sizeof self->model);
}

static int model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"config", "weights", "formats", "int8_activations", NULL};
    PyObject *config, *weights, *formats = Py_None;
    int int8_activations = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!|Op", kwlist, &PyDict_Type, &config,
                                     &PyDict_Type, &weights, &formats, &int8_activations))
        return -1;
    if (formats != Py_None && !PyDict_Check(formats)) {
        PyErr_SetString(PyExc_TypeError, "formats must be a dict of weight names to format "
                        "names, or None");
        return -1;
    }
    if (self->model.weights.token_embedding.data != NULL) {
        /* another thread may be running a forward pass on the current weights */
        PyErr_SetString(PyExc_RuntimeError, "Model is already initialized");
        return -1;
    }
    kv_config *c = &self->model.config;
    if (read_config(config, kv_py_error.config, c) < 0) goto fail;
    /* Checked here although kv_model_check checks it again below: the core judges config
     * and weights together, and a config that does not fit must be told (ConfigError)
     * before the weights shaped by it are. */
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0 || !(c->norm_eps > 0.0f) ||
        !isfinite(c->norm_eps)) {
        PyErr_Format(kv_py_error.config, "config does not fit: n_kv_heads (%d) must divide "
                     "n_heads (%d), head_dim (%d) must be even, norm_eps must be finite and > 0",
                     c->n_kv_heads, c->n_heads, c->head_dim);
        goto fail;
    }
    weight_spec table[N_WEIGHTS];
    weight_specs(c, &self->model.weights, table);
    if (check_format_names(formats, table) < 0) goto fail;
    for (int i = 0; i < N_WEIGHTS; i++)
        if (take_weight(weights, formats, &table[i], &self->arrays[i]) < 0) goto fail;
    self->model.int8_activations = int8_activations;
    if (kv_model_check(&self->model) != KV_OK) {   /* what is left: the core's size limits */
        PyErr_SetString(kv_py_error.config, "model sizes exceed what kvlab supports (widths up "
                        "to 65536, vocab up to 2**24, layers up to 4096)");
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

/* ---- what every call takes ----------------------------------------------------------- */

/* A model ready to run, and counters: None, or a writable int64 array of len(COUNTERS)
 * entries, exactly a kv_counters struct, to which the call's counts are added. */
static int model_ready(const ModelObject *self, PyObject *counters) {
    if (counters != Py_None &&
        kv_py_array(counters, &(kv_py_array_spec){
            .name = "counters", .type = NPY_INT64, .ndim = 1, .shape = {KV_PY_N_COUNTERS},
            .axes = "len(COUNTERS)", .flags = KV_PY_WRITABLE, .error = PyExc_TypeError}) == NULL)
        return -1;
    if (self->model.weights.token_embedding.data == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Model was not initialized");
        return -1;
    }
    return 0;
}

static void add_to_counters(PyObject *counters, const kv_counters *call) {
    if (counters != Py_None)
        kv_counters_add((kv_counters *)PyArray_DATA((PyArrayObject *)counters), call);
}

/* The token ids of a call: 1-D int32. Their values are the core's to check; their number
 * is bounded here as well as there, since the binding allocates the logits and a copy of
 * the ids by it before the core runs. */
static PyArrayObject *call_tokens(PyObject *obj) {
    PyArrayObject *tokens = kv_py_array(obj, &(kv_py_array_spec){
        .name = "tokens", .type = NPY_INT32, .ndim = 1, .shape = {KV_PY_ANY}, .axes = "n_tokens"});
    if (tokens != NULL && PyArray_DIM(tokens, 0) > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "too many tokens in one call (at most 65536); "
                        "prefill a long prompt in chunks");
        return NULL;
    }
    return tokens;
}

/* A private copy of n token ids, taken while the GIL is held: once it is let go, another
 * thread could change the caller's array. */
static int32_t *copy_ids(PyArrayObject *tokens, npy_intp n) {
    int32_t *ids = PyMem_Malloc((size_t)n * sizeof(int32_t) + 1);   /* + 1: never malloc(0) */
    if (ids == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(ids, PyArray_DATA(tokens), (size_t)n * sizeof(int32_t));
    return ids;
}

/* The core refused ids (KV_ERR_TOKEN_RANGE): names the first id out of range. */
static PyObject *token_out_of_range(const int32_t *ids, npy_intp n, int vocab_size) {
    for (npy_intp i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab_size)
            return kv_py_raise(KV_ERR_TOKEN_RANGE, "token id %d at index %zd is out of range "
                               "[0, %d)", (int)ids[i], (Py_ssize_t)i, vocab_size);
    return kv_py_raise(KV_ERR_TOKEN_RANGE, NULL);
}

/* ---- forward ----------------------------------------------------------------------- */

/* The exception for a forward call that failed: the core's refusal named by the argument
 * at fault, or the interrupt (the chunks before it are in the cache). */
static PyObject *forward_failed(const ModelObject *self, kv_status status, const int32_t *ids,
                                int n_tokens, const CacheObject *cache, const PoolObject *pool) {
    const kv_config *c = &self->model.config;
    if (status == KV_ERR_TOKEN_RANGE) return token_out_of_range(ids, n_tokens, c->vocab_size);
    if (status == KV_ERR_INVALID_ARG && n_tokens == 0)
        return kv_py_raise(status, "tokens must be a non-empty 1-D array");
    if (cache != NULL) return kv_py_cache_refused(cache, status, n_tokens, c);
    if (pool != NULL) return kv_py_pool_refused(pool, status, n_tokens, c);
    return kv_py_raise(status, NULL);
}

static PyObject *model_forward(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tokens", "cache", "all_logits", "counters", "one_layer_kv", NULL};
    PyObject *tokens_obj, *cache_obj = Py_None, *counters = Py_None;
    int all_logits = 0, one_layer_kv = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OpOp", kwlist, &tokens_obj, &cache_obj,
                                     &all_logits, &counters, &one_layer_kv))
        return NULL;
    if (one_layer_kv && cache_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "one_layer_kv is a way to run without a cache: "
                        "give cache=None");
        return NULL;
    }
    if (model_ready(self, counters) < 0) return NULL;
    PyArrayObject *tokens = call_tokens(tokens_obj);
    if (tokens == NULL) return NULL;
    int n_tokens = (int)PyArray_DIM(tokens, 0);
    const kv_config *c = &self->model.config;

    CacheObject *cache = NULL;
    PoolObject *pool = NULL;
    int seq = -1;
    if (PyObject_TypeCheck(cache_obj, &kv_py_sequence_type)) {
        if ((pool = kv_py_pool_of(cache_obj, &seq)) == NULL) return NULL;
    } else if (cache_obj != Py_None) {
        if (!PyObject_TypeCheck(cache_obj, &kv_py_cache_type)) {
            PyErr_Format(PyExc_TypeError, "cache must be a KVCache, a PagedSequence or None, "
                         "got %s", Py_TYPE(cache_obj)->tp_name);
            return NULL;
        }
        cache = (CacheObject *)cache_obj;
        if (kv_py_cache_ready(cache) < 0) return NULL;
    }

    npy_intp dims[2] = {n_tokens, c->vocab_size};
    PyObject *logits = all_logits ? PyArray_SimpleNew(2, dims, NPY_FLOAT32)
                                  : PyArray_SimpleNew(1, &dims[1], NPY_FLOAT32);
    if (logits == NULL) return NULL;
    float *out = (float *)PyArray_DATA((PyArrayObject *)logits);
    int32_t *ids = copy_ids(tokens, n_tokens);
    if (ids == NULL) {
        Py_DECREF(logits);
        return NULL;
    }

    /* The cache is kept alive by this call's reference; the busy flag stops another
     * thread from resizing or reusing it meanwhile. */
    kv_status status;
    kv_counters count = {0};
    if (cache != NULL) cache->busy = 1;
    if (pool != NULL) pool->base.busy = 1;
    Py_BEGIN_ALLOW_THREADS
    kv_set_interrupt_check(kv_py_signals_pending, &_save);
    if (cache != NULL)
        status = kv_model_forward(&self->model, &cache->cache, ids, n_tokens, out, all_logits,
                                  &count);
    else if (pool != NULL)
        status = kv_model_forward_paged(&self->model, &pool->pool, seq, ids, n_tokens, out,
                                        all_logits, &count);
    else
        status = kv_model_forward_uncached(&self->model, ids, n_tokens, out, all_logits,
                                           one_layer_kv ? KV_UNCACHED_ONE_LAYER
                                                        : KV_UNCACHED_ALL_LAYERS, &count);
    kv_set_interrupt_check(NULL, NULL);
    Py_END_ALLOW_THREADS
    if (cache != NULL) cache->busy = 0;
    if (pool != NULL) pool->base.busy = 0;
    /* what ran, even if interrupted between chunks; a refused call ran nothing */
    add_to_counters(counters, &count);
    if (status != KV_OK) {
        Py_CLEAR(logits);
        forward_failed(self, status, ids, n_tokens, cache, pool);
    }
    PyMem_Free(ids);
    return logits;
}

/* ---- generate ---------------------------------------------------------------------- */

int kv_py_parse_sampling(double temperature, int top_k, double top_p, kv_sampling *how) {
    if (!(temperature >= 0.0 && temperature < INFINITY)) {
        kv_py_raise_with_number("temperature must be a finite number >= 0, got ", temperature,
                                "");
        return -1;
    }
    if (top_k < 0) {
        PyErr_Format(PyExc_ValueError, "top_k must be >= 0 (0: no cut), got %d", top_k);
        return -1;
    }
    if (!(top_p > 0.0 && top_p <= 1.0)) {
        kv_py_raise_with_number("top_p must be in (0, 1], got ", top_p, "");
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

/* What a generate call was asked, checked (generate_arguments). */
typedef struct {
    int token, max_steps, stop_token;
    kv_sampling how;
    CacheObject *cache;         /* borrowed, as the call's arguments are */
    PyArrayObject *uniforms;    /* a sampled step's numbers, (>= max_steps,); NULL if greedy */
    PyObject *counters;
} generate_args;

/* The numbers a sampled generate draws with, one per step: 1-D float64, at least max_steps
 * of them. */
static PyArrayObject *check_uniforms(PyObject *uniforms_obj, int max_steps) {
    if (uniforms_obj == Py_None) {
        PyErr_Format(PyExc_ValueError, "sampling (temperature > 0) needs uniforms: a 1-D "
                     "float64 array of at least max_steps = %d numbers in [0, 1)", max_steps);
        return NULL;
    }
    PyArrayObject *uniforms = kv_py_array(uniforms_obj, &(kv_py_array_spec){
        .name = "uniforms", .type = NPY_FLOAT64, .ndim = 1, .shape = {KV_PY_ANY},
        .axes = "n", .error = PyExc_ValueError});
    if (uniforms != NULL && PyArray_DIM(uniforms, 0) < max_steps) {
        PyErr_Format(PyExc_ValueError, "uniforms holds %zd numbers, but sampling takes one "
                     "per step: at least max_steps = %d",
                     (Py_ssize_t)PyArray_DIM(uniforms, 0), max_steps);
        return NULL;
    }
    return uniforms;
}

/* generate's arguments, parsed and checked before anything is allocated: -1 with an
 * exception for the first that is wrong. */
static int generate_arguments(ModelObject *self, PyObject *args, PyObject *kwds,
                              generate_args *a) {
    static char *kwlist[] = {"token", "cache", "max_steps", "temperature", "top_k", "top_p",
                             "uniforms", "stop_token", "counters", NULL};
    int top_k = 0;
    double temperature = 0.0, top_p = 1.0;
    PyObject *cache_obj, *uniforms_obj = Py_None;
    *a = (generate_args){.stop_token = -1, .counters = Py_None};
    if (kv_py_int_arguments(args, kwds, "iOi|didOiO", kwlist) < 0) return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOi|didOiO", kwlist, &a->token, &cache_obj,
                                     &a->max_steps, &temperature, &top_k, &top_p,
                                     &uniforms_obj, &a->stop_token, &a->counters))
        return -1;
    if (model_ready(self, a->counters) < 0 ||
        kv_py_parse_sampling(temperature, top_k, top_p, &a->how) < 0)
        return -1;
    if (!PyObject_TypeCheck(cache_obj, &kv_py_cache_type)) {
        PyErr_Format(PyExc_TypeError, "generate needs a KVCache, got %s",
                     Py_TYPE(cache_obj)->tp_name);
        return -1;
    }
    a->cache = (CacheObject *)cache_obj;
    /* max_steps sizes what is allocated below, so it is bounded before: at least one step,
     * and no more than the cache has room for (the core checks the room too) */
    if (a->max_steps < 1) {
        PyErr_Format(PyExc_ValueError, "max_steps must be at least 1, got %d", a->max_steps);
        return -1;
    }
    if (temperature > 0.0) {   /* a sampled step draws with the next of these numbers */
        a->uniforms = check_uniforms(uniforms_obj, a->max_steps);
        if (a->uniforms == NULL) return -1;
    }
    if (kv_py_cache_ready(a->cache) < 0) return -1;
    if (a->max_steps > a->cache->cache.capacity - a->cache->cache.length) {
        kv_py_cache_refused(a->cache, KV_ERR_CACHE_FULL, a->max_steps, &self->model.config);
        return -1;
    }
    return 0;
}

/* kv_model_generate with the GIL released from the first token to the last, the cache
 * marked busy meanwhile: each step's token and seconds into the arrays. */
static kv_status generate_without_gil(ModelObject *self, const generate_args *a,
                                      const double *draws, PyObject *tokens, PyObject *seconds,
                                      int *n_steps, kv_counters *count) {
    kv_status status;
    a->cache->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    kv_set_interrupt_check(kv_py_signals_pending, &_save);
    status = kv_model_generate(&self->model, &a->cache->cache, a->token, a->max_steps,
                               a->stop_token, &a->how, draws,
                               (int32_t *)PyArray_DATA((PyArrayObject *)tokens),
                               (double *)PyArray_DATA((PyArrayObject *)seconds), n_steps,
                               count);
    kv_set_interrupt_check(NULL, NULL);
    Py_END_ALLOW_THREADS
    a->cache->busy = 0;
    return status;
}

/* The exception for a generate call that failed after n_steps steps, with those steps as
 * its .completed unless the core refused the arguments (then nothing ran). */
static void generate_failed(const ModelObject *self, const generate_args *a, kv_status status,
                            int n_steps, PyObject *tokens, PyObject *seconds) {
    const kv_config *c = &self->model.config;
    if (status == KV_ERR_NOT_A_NUMBER)
        PyErr_Format(PyExc_ValueError, "decode step %d (position %d): the logits hold NaN "
                     "(or are all -inf), so no token can be chosen; the cache keeps that "
                     "step's token and the %d steps before", n_steps,
                     a->cache->cache.length - 1, n_steps);
    else if (status == KV_ERR_TOKEN_RANGE && a->token >= 0 && a->token < c->vocab_size)
        PyErr_Format(PyExc_ValueError, "stop_token %d is out of range [0, %d) (or -1 for "
                     "none)", a->stop_token, c->vocab_size);
    else if (status == KV_ERR_TOKEN_RANGE)
        PyErr_Format(PyExc_ValueError, "token id %d is out of range [0, %d)", a->token,
                     c->vocab_size);
    else
        kv_py_cache_refused(a->cache, status, a->max_steps, c);
    /* a call the core refused for its arguments ran nothing and completed nothing */
    if (status != KV_ERR_TOKEN_RANGE && status != KV_ERR_CACHE_MISMATCH)
        attach_completed(tokens, seconds, n_steps);
}

/* (tokens, seconds) of the steps that ran: the first n_steps entries (copies, not views of
 * the longer). Takes over the caller's references to both arrays. */
static PyObject *generate_result(PyObject *tokens, PyObject *seconds, int n_steps) {
    npy_intp dims[1] = {n_steps};
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

/* generate(token, cache, max_steps, temperature=0, top_k=0, top_p=1, uniforms=None,
 * stop_token=-1, counters=None): the generation loop of kv_model_generate, run with the
 * GIL released from the first token to the last. */
static PyObject *model_generate(ModelObject *self, PyObject *args, PyObject *kwds) {
    generate_args a;
    if (generate_arguments(self, args, kwds, &a) < 0) return NULL;
    npy_intp dims[1] = {a.max_steps};
    PyObject *tokens = PyArray_SimpleNew(1, dims, NPY_INT32);
    PyObject *seconds = PyArray_SimpleNew(1, dims, NPY_FLOAT64);
    /* a private copy of the numbers: the caller's array could change once the GIL is let go */
    double *draws = a.uniforms ? PyMem_Malloc((size_t)a.max_steps * sizeof(double)) : NULL;
    if (tokens == NULL || seconds == NULL || (a.uniforms != NULL && draws == NULL)) {
        Py_XDECREF(tokens);
        Py_XDECREF(seconds);
        PyMem_Free(draws);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    if (draws != NULL)
        memcpy(draws, PyArray_DATA(a.uniforms), (size_t)a.max_steps * sizeof(double));
    kv_counters count = {0};
    int n_steps = 0;
    kv_status status = generate_without_gil(self, &a, draws, tokens, seconds, &n_steps, &count);
    PyMem_Free(draws);
    add_to_counters(a.counters, &count);   /* what ran, even if a step then failed */
    if (status != KV_OK) {
        generate_failed(self, &a, status, n_steps, tokens, seconds);
        Py_DECREF(tokens);
        Py_DECREF(seconds);
        return NULL;
    }
    return generate_result(tokens, seconds, n_steps);
}

/* ---- forward_batch ----------------------------------------------------------------- */

/* The sequences of a batch: for each, its slot in the pool and its count from n_tokens
 * (count_array, checked by the caller), all of one pool (*pool, the first's), and the
 * counts' sum in *total. -1 with an exception for the first that is wrong. */
static int batch_sequences(PyObject *seqs, PyArrayObject *count_array, int *slots, int *counts,
                           PoolObject **pool, long long *total) {
    Py_ssize_t n_seqs = PySequence_Fast_GET_SIZE(seqs);
    *pool = NULL;
    *total = 0;
    for (Py_ssize_t i = 0; i < n_seqs; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seqs, i);
        if (!PyObject_TypeCheck(item, &kv_py_sequence_type)) {
            PyErr_Format(PyExc_TypeError, "seqs[%zd] is a %s, not a PagedSequence", i,
                         Py_TYPE(item)->tp_name);
            return -1;
        }
        PoolObject *owner = kv_py_pool_of(item, &slots[i]);
        if (owner == NULL) return -1;
        if (*pool == NULL) *pool = owner;
        if (owner != *pool) {
            PyErr_SetString(PyExc_ValueError, "every sequence of a batch must come from one pool");
            return -1;
        }
        counts[i] = ((const int32_t *)PyArray_DATA(count_array))[i];
        *total += counts[i];
    }
    return 0;
}

/* kv_model_forward_batch with the GIL released, the pool marked busy meanwhile, and the
 * exception for what it refused: the argument at fault named where the binding can. */
static kv_status batch_without_gil(ModelObject *self, PoolObject *pool, int n_seqs,
                                   const int *slots, const int *counts, const int32_t *ids,
                                   int total, float *logits, int all_logits,
                                   kv_counters *count) {
    const kv_config *c = &self->model.config;
    kv_status status;
    pool->base.busy = 1;
    Py_BEGIN_ALLOW_THREADS
    kv_set_interrupt_check(kv_py_signals_pending, &_save);   /* a long call looks, and a
                                                               stopped one changes nothing */
    status = kv_model_forward_batch(&self->model, &pool->pool, n_seqs, slots, counts, ids,
                                    logits, all_logits, count);
    kv_set_interrupt_check(NULL, NULL);
    Py_END_ALLOW_THREADS
    pool->base.busy = 0;
    if (status == KV_ERR_INVALID_ARG)
        kv_py_batch_refused(status, slots, counts, n_seqs, NULL);
    else if (status == KV_ERR_TOKEN_RANGE)
        token_out_of_range(ids, total, c->vocab_size);
    else if (status != KV_OK)
        kv_py_pool_refused(pool, status, total, c);
    return status;
}

/* forward_batch(seqs, tokens, n_tokens, counters=None, all_logits=False): one engine step
 * (see kv_model_forward_batch). seqs: PagedSequence handles of one pool; tokens: int32, the
 * sequences' new tokens one after another; n_tokens: how many belong to each. */
static PyObject *model_forward_batch(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seqs", "tokens", "n_tokens", "counters", "all_logits", NULL};
    PyObject *seqs_obj, *tokens_obj, *counts_obj, *counters = Py_None;
    int all_logits = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|Op", kwlist, &seqs_obj, &tokens_obj,
                                     &counts_obj, &counters, &all_logits))
        return NULL;
    if (model_ready(self, counters) < 0) return NULL;
    PyArrayObject *tokens = call_tokens(tokens_obj);
    if (tokens == NULL) return NULL;
    PyObject *seqs = PySequence_Fast(seqs_obj, "seqs must be a list of PagedSequence handles");
    if (seqs == NULL) return NULL;
    PyObject *result = NULL, *logits = NULL;
    int *slots = NULL, *counts = NULL;
    int32_t *ids = NULL;
    Py_ssize_t n_seqs = PySequence_Fast_GET_SIZE(seqs);
    PoolObject *pool = NULL;
    long long total = 0;
    /* the pool is the first sequence's; the bound keeps the count an int */
    if (n_seqs < 1 || n_seqs > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "seqs must hold 1 to 2**20 sequences, got %zd", n_seqs);
        goto done;
    }
    PyArrayObject *count_array = kv_py_array(counts_obj, &(kv_py_array_spec){
        .name = "n_tokens", .type = NPY_INT32, .ndim = 1, .shape = {n_seqs},
        .axes = "len(seqs)", .error = PyExc_TypeError});
    if (count_array == NULL) goto done;
    slots = PyMem_Malloc((size_t)n_seqs * sizeof(int));
    counts = PyMem_Malloc((size_t)n_seqs * sizeof(int));
    if (slots == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (batch_sequences(seqs, count_array, slots, counts, &pool, &total) < 0) goto done;
    /* the core reads total ids: the binding's to match with the array (the core checks
     * each count) */
    if (total != PyArray_DIM(tokens, 0)) {
        PyErr_Format(PyExc_ValueError, "n_tokens adds up to %lld but tokens holds %zd", total,
                     (Py_ssize_t)PyArray_DIM(tokens, 0));
        goto done;
    }
    npy_intp dims[2] = {all_logits ? (npy_intp)total : n_seqs, self->model.config.vocab_size};
    logits = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (logits == NULL || (ids = copy_ids(tokens, (npy_intp)total)) == NULL) goto done;
    kv_counters count = {0};
    if (batch_without_gil(self, pool, (int)n_seqs, slots, counts, ids, (int)total,
                          (float *)PyArray_DATA((PyArrayObject *)logits), all_logits,
                          &count) != KV_OK)
        goto done;
    add_to_counters(counters, &count);
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
     "forward(tokens, cache=None, all_logits=False, counters=None, one_layer_kv=False)\n"
     "    -> logits\n\n"
     "tokens: 1-D int32 array. With a cache, runs the tokens at positions\n"
     "cache.length.. and appends their K and V; without one, runs the whole sequence\n"
     "from position 0 in throw-away scratch (the no-cache path), holding every layer's\n"
     "K and V, or one layer's at a time with one_layer_kv. Returns float32 logits\n"
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
     "forward_batch(seqs, tokens, n_tokens, counters=None, all_logits=False) -> logits\n"
     "(len(seqs), vocab), or (len(tokens), vocab) with all_logits\n\n"
     "One step of a batching engine: seqs are PagedSequences of one pool; tokens (int32)\n"
     "holds their new tokens one sequence after another, n_tokens (int32) how many each.\n"
     "Every weight matrix is streamed once per TOKEN_CHUNK (96) tokens of the batch; each row of\n"
     "logits is its sequence's last new token's, bit-identical to running that sequence alone.\n"
     "A call of more than KV_CHUNK_FLOPS stops for Ctrl-C between layers, changing nothing."},
    {NULL}
};

PyTypeObject kv_py_model_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._kvlab.Model",
    .tp_doc = PyDoc_STR("Model(config: dict, weights: dict, formats=None, int8_activations=False)\n\n"
                        "The C forward pass over weights borrowed from NumPy arrays: float32,\n"
                        "or for a matrix named in formats ('fp16', 'bf16', 'q8_0', 'q4_0', 'q4_1')\n"
                        "uint8 rows as kvlab.weight_formats.quantize writes them.\n"
                        "int8_activations: products with q8_0, q4_0 and q4_1 matrices quantize\n"
                        "the activations to int8 too.\n"
                        "Usually made by kvlab.load()."),
    .tp_basicsize = sizeof(ModelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)model_init,
    .tp_dealloc = (destructor)model_dealloc,
    .tp_methods = model_methods,
};
