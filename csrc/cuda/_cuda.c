/* _cuda.c: the Python binding of kvlab's CUDA backend; the only CUDA-side file that includes
 * Python.h.
 *
 * It defines Model (the weights copied to the GPU, and the forward pass) and KVStore (the K
 * and V storage of a cache or a pool, in GPU memory), plus functions that say what GPU is
 * there and time things on it. Which positions a call writes and reads (slots, block
 * tables) is decided elsewhere: a paged pool's by the C core's pool (csrc/paged.c, which
 * asks a KVStore to copy, write and read rows), a contiguous cache's in kvlab/cuda.py.
 * Every array is checked here all the same (dtype, shape, contiguity, and every slot and
 * block id against the store) before a pointer reaches the device, because a wrong index
 * on a GPU is not an exception but a corrupted cache or a crashed context. The GIL is
 * released around device work; CUDA errors become kvlab.errors.CudaError naming the
 * cudaError. Built by plain C compilers: the CUDA code it calls is behind kvcuda.h.
 *
 * Arrays are checked, and formats named, by the CPU binding's own helpers (csrc/python/
 * arrays.c and formats.c, compiled into this extension too: setup.py), so that both
 * bindings word a refusal the same way.
 */
#define KV_PY_IMPORTS_NUMPY   /* this file calls import_array() for the extension */
#include "binding.h"

#include <math.h>
#include <string.h>

#include "kvcuda.h"
#include "model_args.h"

#ifndef KV_CUDA_SOURCES
#define KV_CUDA_SOURCES ""
#endif
#ifndef KV_CUDA_ARCHS
#define KV_CUDA_ARCHS ""
#endif

static PyObject *CudaError;   /* kvlab.errors.CudaError, looked up at import */

static PyObject *raise_cuda(kv_cuda_err err, const char *what) {
    PyErr_Format(CudaError, "%s failed: %s (%s)", what, kv_cuda_error_name(err),
                 kv_cuda_error_string(err));
    return NULL;
}

/* ---- argument checks ------------------------------------------------------------------- */

/* A format the GPU stores (fp32, fp16, bf16, int8) by name, or ValueError. */
static int parse_format(const char *name, const char *what, kv_format *format) {
    if (kv_py_parse_format(name, what, format) < 0) return -1;
    if (*format == KV_FMT_I4 || *format == KV_FMT_FP8) {
        PyErr_Format(PyExc_ValueError, "the CUDA backend stores K and V as fp32, fp16, bf16 or "
                     "int8, not '%s'", name);
        return -1;
    }
    return 0;
}

/* A device copy of host memory, or NULL with an exception set (bytes may be 0). */
static void *device_copy(const void *host, size_t bytes, const char *what) {
    void *device = NULL;
    kv_cuda_err err = kv_cuda_alloc(&device, bytes);
    if (err == 0) err = kv_cuda_to_device(device, host, bytes);
    if (err != 0) {
        kv_cuda_free(device);
        raise_cuda(err, what);
        return NULL;
    }
    return device;
}

/* ================================ KVStore ======================================== */

typedef struct {
    PyObject_HEAD
    kv_store key, value;   /* codes and scales in device memory */
    int busy;              /* device work on it is running with the GIL released */
} StoreObject;

static PyTypeObject StoreType;

static int store_ready(StoreObject *self) {
    if (self->key.codes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KVStore was not initialized");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this cache is in use by a call in another thread; "
                        "one thread at a time may use a GPU cache or pool");
        return -1;
    }
    return 0;
}

static int store_init(StoreObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "slots", "key_format",
                             "value_format", "key_group", "value_group", NULL};
    int n_layers, n_kv_heads, head_dim, key_group = 0, value_group = 0;
    long long slots;
    const char *key_name = "fp32", *value_name = "fp32";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiiL|ssii", kwlist, &n_layers, &n_kv_heads,
                                     &head_dim, &slots, &key_name, &value_name, &key_group,
                                     &value_group))
        return -1;
    if (self->key.codes != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KVStore is already initialized");
        return -1;
    }
    kv_format key_format, value_format;
    if (parse_format(key_name, "key", &key_format) < 0 ||
        parse_format(value_name, "value", &value_format) < 0)
        return -1;
    if (n_layers <= 0 || n_kv_heads <= 0 || slots <= 0 || slots > (1LL << 32) ||
        n_layers > 4096 || (long)n_kv_heads * head_dim > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "KVStore sizes must be positive (and not absurdly large)");
        return -1;
    }
    if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > KV_CUDA_MAX_HEAD_DIM) {
        PyErr_Format(PyExc_ValueError, "the CUDA backend needs head_dim a multiple of 8 up to %d, "
                     "got %d", KV_CUDA_MAX_HEAD_DIM, head_dim);
        return -1;
    }
    int groups[2] = {key_group, value_group};
    kv_format formats[2] = {key_format, value_format};
    for (int i = 0; i < 2; i++) {
        int ok = formats[i] == KV_FMT_I8
                     ? groups[i] >= 8 && groups[i] % 8 == 0 && head_dim % groups[i] == 0
                     : groups[i] == 0;
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "group %d does not suit %s on the GPU: int8 groups must "
                         "be a multiple of 8 dividing head_dim (%d); other formats have none",
                         groups[i], kv_py_format_names[formats[i]], head_dim);
            return -1;
        }
    }
    kv_cuda_err err;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_store_init(&self->key, key_format, key_group, n_layers, (size_t)slots,
                             n_kv_heads, head_dim);
    if (err == 0)
        err = kv_cuda_store_init(&self->value, value_format, value_group, n_layers,
                                 (size_t)slots, n_kv_heads, head_dim);
    if (err != 0) kv_cuda_store_free(&self->key);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        raise_cuda(err, "allocating the cache on the GPU");
        return -1;
    }
    return 0;
}

static void store_dealloc(StoreObject *self) {
    kv_cuda_store_free(&self->key);
    kv_cuda_store_free(&self->value);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* slots: int64 (n,), every one in [low, store slots); n >= 1. NULL with an exception. */
static PyArrayObject *checked_slots(StoreObject *self, PyObject *obj, int64_t low) {
    PyArrayObject *a = kv_py_array(obj, &(kv_py_array_spec){
        .name = "slots", .type = NPY_INT64, .ndim = 1, .shape = {KV_PY_ANY}, .axes = "n"});
    if (a == NULL) return NULL;
    npy_intp n = PyArray_DIM(a, 0);
    if (n < 1 || n > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "slots must hold at least one slot");
        return NULL;
    }
    const int64_t *s = (const int64_t *)PyArray_DATA(a);
    for (npy_intp i = 0; i < n; i++) {
        if (s[i] < low || s[i] >= (int64_t)self->key.slots) {
            PyErr_Format(PyExc_IndexError, "slot %lld at index %zd is outside [%lld, %zu)",
                         (long long)s[i], (Py_ssize_t)i, (long long)low, self->key.slots);
            return NULL;
        }
    }
    return a;
}

/* write(slots, keys, values): rows (n, n_layers, n_kv_heads, head_dim) float32 quantized
 * into the given slots (-1: skip the row), as the forward pass writes them. */
static PyObject *store_write(StoreObject *self, PyObject *args) {
    PyObject *slots_obj, *keys_obj, *values_obj;
    if (!PyArg_ParseTuple(args, "OOO", &slots_obj, &keys_obj, &values_obj)) return NULL;
    if (store_ready(self) < 0) return NULL;
    PyArrayObject *slots = checked_slots(self, slots_obj, -1);
    if (slots == NULL) return NULL;
    npy_intp n = PyArray_DIM(slots, 0);
    const kv_store *k = &self->key;
    kv_py_array_spec rows = {.name = "keys", .type = NPY_FLOAT32, .ndim = 4,
                             .shape = {n, k->n_layers, k->n_kv_heads, k->head_dim},
                             .axes = "n,n_layers,n_kv_heads,head_dim"};
    PyArrayObject *keys = kv_py_array(keys_obj, &rows);
    rows.name = "values";
    PyArrayObject *values = keys ? kv_py_array(values_obj, &rows) : NULL;
    if (values == NULL) return NULL;
    size_t row = (size_t)k->n_layers * k->n_kv_heads * k->head_dim;   /* floats per token */
    size_t kv_dim = (size_t)k->n_kv_heads * k->head_dim;
    int64_t *d_slots = device_copy(PyArray_DATA(slots), (size_t)n * sizeof(int64_t), "copying slots");
    float *d_keys = d_slots ? device_copy(PyArray_DATA(keys), (size_t)n * row * sizeof(float), "copying keys") : NULL;
    float *d_values = d_keys ? device_copy(PyArray_DATA(values), (size_t)n * row * sizeof(float), "copying values") : NULL;
    kv_cuda_err err = 0;
    if (d_values != NULL) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        for (int layer = 0; err == 0 && layer < k->n_layers; layer++) {
            /* token t's row of this layer is at t * row + layer * kv_dim */
            err = kv_cuda_store_write(&self->key, layer, d_keys + layer * kv_dim, row, d_slots, (int)n);
            if (err == 0)
                err = kv_cuda_store_write(&self->value, layer, d_values + layer * kv_dim, row,
                                          d_slots, (int)n);
        }
        if (err == 0) err = kv_cuda_synchronize();
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    kv_cuda_free(d_slots);
    kv_cuda_free(d_keys);
    kv_cuda_free(d_values);
    if (d_values == NULL) return NULL;
    if (err != 0) return raise_cuda(err, "writing K and V rows");
    Py_RETURN_NONE;
}

/* The codes (uint8 bytes) and scales of one store at the given slots, copied to the host:
 * codes (n_layers, n, n_kv_heads, head_bytes), scales (n_layers, n, n_kv_heads, groups) or None. */
static int read_store(const kv_store *s, const int64_t *d_slots, npy_intp n, PyObject **codes,
                      PyObject **scales) {
    npy_intp code_dims[4] = {s->n_layers, n, s->n_kv_heads, (npy_intp)s->head_bytes};
    npy_intp scale_dims[4] = {s->n_layers, n, s->n_kv_heads, s->groups_per_head};
    *codes = PyArray_SimpleNew(4, code_dims, NPY_UINT8);
    *scales = s->scales ? PyArray_SimpleNew(4, scale_dims, NPY_FLOAT32) : Py_NewRef(Py_None);
    if (*codes == NULL || *scales == NULL) return -1;
    size_t code_bytes = (size_t)s->n_layers * n * s->n_kv_heads * s->head_bytes;
    size_t scale_bytes = (size_t)s->n_layers * n * s->n_kv_heads * s->groups_per_head * sizeof(float);
    uint8_t *d_codes = NULL;
    float *d_scales = NULL;
    kv_cuda_err err;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_alloc((void **)&d_codes, code_bytes);
    if (err == 0) err = kv_cuda_alloc((void **)&d_scales, scale_bytes);
    if (err == 0) err = kv_cuda_store_read(s, d_slots, (int)n, d_codes, d_scales);
    if (err == 0) err = kv_cuda_to_host(PyArray_DATA((PyArrayObject *)*codes), d_codes, code_bytes);
    if (err == 0 && s->scales)
        err = kv_cuda_to_host(PyArray_DATA((PyArrayObject *)*scales), d_scales, scale_bytes);
    kv_cuda_free(d_codes);
    kv_cuda_free(d_scales);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        raise_cuda(err, "reading the cache");
        return -1;
    }
    return 0;
}

/* read(slots) -> (key_codes, key_scales, value_codes, value_scales), host copies */
static PyObject *store_read(StoreObject *self, PyObject *arg) {
    if (store_ready(self) < 0) return NULL;
    PyArrayObject *slots = checked_slots(self, arg, 0);
    if (slots == NULL) return NULL;
    npy_intp n = PyArray_DIM(slots, 0);
    int64_t *d_slots = device_copy(PyArray_DATA(slots), (size_t)n * sizeof(int64_t), "copying slots");
    if (d_slots == NULL) return NULL;
    PyObject *kc = NULL, *ks = NULL, *vc = NULL, *vs = NULL, *result = NULL;
    self->busy = 1;
    if (read_store(&self->key, d_slots, n, &kc, &ks) == 0 &&
        read_store(&self->value, d_slots, n, &vc, &vs) == 0)
        result = PyTuple_Pack(4, kc, ks, vc, vs);
    self->busy = 0;
    kv_cuda_free(d_slots);
    Py_XDECREF(kc);
    Py_XDECREF(ks);
    Py_XDECREF(vc);
    Py_XDECREF(vs);
    return result;
}

/* One store's rows as read() gives them, checked for put(): codes uint8 (n_layers, n,
 * n_kv_heads, head_bytes), scales float32 (n_layers, n, n_kv_heads, groups), or None for a
 * format without scales (*scales NULL then). -1 with an exception. */
static int checked_rows(const kv_store *s, npy_intp n, PyObject *codes_obj, PyObject *scales_obj,
                        const char *side, PyArrayObject **codes, PyArrayObject **scales) {
    char name[32];
    PyOS_snprintf(name, sizeof name, "%s_codes", side);
    *codes = kv_py_array(codes_obj, &(kv_py_array_spec){
        .name = name, .type = NPY_UINT8, .ndim = 4,
        .shape = {s->n_layers, n, s->n_kv_heads, (npy_intp)s->head_bytes},
        .axes = "n_layers,n,n_kv_heads,head_bytes"});
    *scales = NULL;
    if (*codes == NULL) return -1;
    if (s->scales == NULL) {
        if (scales_obj == Py_None) return 0;
        PyErr_Format(PyExc_TypeError, "%s_scales must be None: %s has no scales", side,
                     kv_py_format_names[s->format]);
        return -1;
    }
    PyOS_snprintf(name, sizeof name, "%s_scales", side);
    *scales = kv_py_array(scales_obj, &(kv_py_array_spec){
        .name = name, .type = NPY_FLOAT32, .ndim = 4,
        .shape = {s->n_layers, n, s->n_kv_heads, s->groups_per_head},
        .axes = "n_layers,n,n_kv_heads,groups"});
    return *scales == NULL ? -1 : 0;
}

/* put(slots, key_codes, key_scales, value_codes, value_scales): read() backwards, the rows
 * stored as they are (a sequence swapped back in) */
static PyObject *store_put(StoreObject *self, PyObject *args) {
    PyObject *slots_obj, *parts[4];
    if (!PyArg_ParseTuple(args, "OOOOO", &slots_obj, &parts[0], &parts[1], &parts[2], &parts[3]))
        return NULL;
    if (store_ready(self) < 0) return NULL;
    PyArrayObject *slots = checked_slots(self, slots_obj, 0);
    if (slots == NULL) return NULL;
    npy_intp n = PyArray_DIM(slots, 0);
    PyArrayObject *rows[4];
    if (checked_rows(&self->key, n, parts[0], parts[1], "key", &rows[0], &rows[1]) < 0 ||
        checked_rows(&self->value, n, parts[2], parts[3], "value", &rows[2], &rows[3]) < 0)
        return NULL;
    /* device copies made holding the GIL: the arrays are the caller's */
    void *device[5] = {NULL, NULL, NULL, NULL, NULL};
    int copied = (device[0] = device_copy(PyArray_DATA(slots), (size_t)n * sizeof(int64_t),
                                          "copying slots")) != NULL;
    for (int i = 0; i < 4 && copied; i++)
        if (rows[i] != NULL)
            copied = (device[i + 1] = device_copy(PyArray_DATA(rows[i]),
                                                  (size_t)PyArray_NBYTES(rows[i]),
                                                  "copying rows")) != NULL;
    kv_cuda_err err = 0;
    if (copied) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        err = kv_cuda_store_put(&self->key, device[0], (int)n, device[1], device[2]);
        if (err == 0) err = kv_cuda_store_put(&self->value, device[0], (int)n, device[3], device[4]);
        if (err == 0) err = kv_cuda_synchronize();
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    for (int i = 0; i < 5; i++) kv_cuda_free(device[i]);
    if (!copied) return NULL;
    if (err != 0) return raise_cuda(err, "putting K and V rows back");
    Py_RETURN_NONE;
}

/* copy_rows(dst, src, n): slots src .. src+n-1 copied to dst .. dst+n-1 (copy-on-write) */
static PyObject *store_copy_rows(StoreObject *self, PyObject *args) {
    long long dst, src, n;
    if (!PyArg_ParseTuple(args, "LLL", &dst, &src, &n)) return NULL;
    if (store_ready(self) < 0) return NULL;
    long long slots = (long long)self->key.slots;
    if (n < 0 || dst < 0 || src < 0 || dst + n > slots || src + n > slots) {
        PyErr_Format(PyExc_IndexError, "copy_rows(%lld, %lld, %lld) goes outside the %lld slots",
                     dst, src, n, slots);
        return NULL;
    }
    kv_cuda_err err;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_store_copy(&self->key, (size_t)dst, (size_t)src, (size_t)n);
    if (err == 0) err = kv_cuda_store_copy(&self->value, (size_t)dst, (size_t)src, (size_t)n);
    if (err == 0) err = kv_cuda_synchronize();
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (err != 0) return raise_cuda(err, "copying cache rows");
    Py_RETURN_NONE;
}

static PyObject *store_fill_random(StoreObject *self, PyObject *arg) {
    unsigned long long seed = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    if (store_ready(self) < 0) return NULL;
    kv_cuda_err err;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_store_fill_random(&self->key, seed);
    if (err == 0) err = kv_cuda_store_fill_random(&self->value, seed ^ 0x5bd1e995ULL);
    if (err == 0) err = kv_cuda_synchronize();
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (err != 0) return raise_cuda(err, "filling the cache");
    Py_RETURN_NONE;
}

/* The arguments of an attention call, checked: q (n_q, n_heads, head_dim) float32; tables
 * (..., n_tables, max_blocks) int32 (ndim 2, or 3 with rotations first); query_table and
 * seen (n_q,) int32. Every block a query reads must lie inside the store. */
typedef struct {
    PyArrayObject *q, *tables, *query_table, *seen;
    int n_q, n_heads, n_tables, max_blocks, n_rotations, max_seen;
} attention_args;

static int check_attention(StoreObject *self, PyObject *q_obj, PyObject *tables_obj,
                           int block_size, PyObject *table_obj, PyObject *seen_obj,
                           int rotations, attention_args *a) {
    const kv_store *k = &self->key;
    if (k->format != self->value.format || k->group != self->value.group) {
        PyErr_SetString(PyExc_ValueError, "attention on the GPU needs K and V in one format");
        return -1;
    }
    a->q = kv_py_array(q_obj, &(kv_py_array_spec){
        .name = "q", .type = NPY_FLOAT32, .ndim = 3, .shape = {KV_PY_ANY, KV_PY_ANY, k->head_dim},
        .axes = "n_queries,n_heads,head_dim"});
    if (a->q == NULL) return -1;
    a->n_q = (int)PyArray_DIM(a->q, 0);
    a->n_heads = (int)PyArray_DIM(a->q, 1);
    if (a->n_q < 1 || a->n_q > (1 << 16) || a->n_heads < 1 || a->n_heads % k->n_kv_heads != 0 ||
        (long)a->n_heads * k->head_dim > (1 << 16)) {
        PyErr_Format(PyExc_ValueError, "q must be (n_queries, n_heads, head_dim) with n_heads a "
                     "multiple of n_kv_heads=%d", k->n_kv_heads);
        return -1;
    }
    a->tables = kv_py_array(tables_obj, &(kv_py_array_spec){
        .name = "tables", .type = NPY_INT32, .ndim = rotations ? 3 : 2,
        .shape = {KV_PY_ANY, KV_PY_ANY, KV_PY_ANY},
        .axes = rotations ? "n_rotations,n_tables,max_blocks" : "n_tables,max_blocks"});
    if (a->tables == NULL) return -1;
    a->n_rotations = rotations ? (int)PyArray_DIM(a->tables, 0) : 1;
    a->n_tables = (int)PyArray_DIM(a->tables, rotations ? 1 : 0);
    a->max_blocks = (int)PyArray_DIM(a->tables, rotations ? 2 : 1);
    kv_py_array_spec per_query = {.name = "query_table", .type = NPY_INT32, .ndim = 1,
                                  .shape = {a->n_q}, .axes = "n_queries"};
    if ((a->query_table = kv_py_array(table_obj, &per_query)) == NULL) return -1;
    per_query.name = "seen";
    if ((a->seen = kv_py_array(seen_obj, &per_query)) == NULL) return -1;
    if (block_size < 1 || a->n_rotations < 1 || a->n_tables < 1 || a->max_blocks < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size and the tables' sizes must be positive");
        return -1;
    }
    const int32_t *rows = (const int32_t *)PyArray_DATA(a->query_table);
    const int32_t *seen = (const int32_t *)PyArray_DATA(a->seen);
    const int32_t *tables = (const int32_t *)PyArray_DATA(a->tables);
    long long n_blocks = (long long)(k->slots / (size_t)block_size);   /* whole blocks in the store */
    a->max_seen = 0;
    for (int i = 0; i < a->n_q; i++) {
        if (rows[i] < 0 || rows[i] >= a->n_tables || seen[i] < 1 ||
            seen[i] > KV_CUDA_MAX_POSITIONS ||
            (seen[i] + (long long)block_size - 1) / block_size > a->max_blocks) {
            PyErr_Format(PyExc_ValueError, "query %d: table row %d or positions %d do not fit "
                         "the tables (%d rows of %d blocks of %d)", i, rows[i], seen[i],
                         a->n_tables, a->max_blocks, block_size);
            return -1;
        }
        if (seen[i] > a->max_seen) a->max_seen = seen[i];
        int used = (int)((seen[i] + (long long)block_size - 1) / block_size);
        for (int r = 0; r < a->n_rotations; r++) {
            const int32_t *row = tables + ((size_t)r * a->n_tables + rows[i]) * a->max_blocks;
            for (int j = 0; j < used; j++) {
                if (row[j] < 0 || row[j] >= n_blocks) {
                    PyErr_Format(PyExc_IndexError, "block id %d (query %d, entry %d) is outside "
                                 "the store's %lld blocks of %d", row[j], i, j, n_blocks, block_size);
                    return -1;
                }
            }
        }
    }
    return 0;
}

/* The device side of an attention call: the arrays copied over, scratch and output. */
typedef struct {
    float *q, *out;
    int32_t *tables, *query_table, *seen;
    void *scratch;
    size_t scratch_bytes;
} attention_buffers;

static void free_buffers(attention_buffers *d) {
    kv_cuda_free(d->q);
    kv_cuda_free(d->out);
    kv_cuda_free(d->tables);
    kv_cuda_free(d->query_table);
    kv_cuda_free(d->seen);
    kv_cuda_free(d->scratch);
    memset(d, 0, sizeof *d);
}

static int upload_attention(StoreObject *self, const attention_args *a, attention_buffers *d) {
    memset(d, 0, sizeof *d);
    size_t q_bytes = (size_t)a->n_q * a->n_heads * self->key.head_dim * sizeof(float);
    size_t per_query = kv_cuda_attention_query_bytes(a->n_heads, self->key.head_dim, a->max_seen);
    /* split results for up to 256 MiB of queries at a time; more queries run in turns */
    size_t fit = ((size_t)256 << 20) / per_query;
    if (fit < 1) fit = 1;
    if (fit > (size_t)a->n_q) fit = (size_t)a->n_q;
    d->scratch_bytes = fit * per_query;
    kv_cuda_err err = kv_cuda_alloc((void **)&d->out, q_bytes);
    if (err == 0) err = kv_cuda_alloc(&d->scratch, d->scratch_bytes);
    if (err != 0) {
        free_buffers(d);
        raise_cuda(err, "allocating attention scratch");
        return -1;
    }
    if ((d->q = device_copy(PyArray_DATA(a->q), q_bytes, "copying q")) == NULL ||
        (d->tables = device_copy(PyArray_DATA(a->tables), (size_t)PyArray_NBYTES(a->tables),
                                 "copying block tables")) == NULL ||
        (d->query_table = device_copy(PyArray_DATA(a->query_table), (size_t)a->n_q * 4,
                                      "copying query tables")) == NULL ||
        (d->seen = device_copy(PyArray_DATA(a->seen), (size_t)a->n_q * 4, "copying lengths")) == NULL) {
        free_buffers(d);
        return -1;
    }
    return 0;
}

/* attend(layer, q, tables, block_size, query_table, seen) -> out (n_q, n_heads, head_dim) */
static PyObject *store_attend(StoreObject *self, PyObject *args) {
    int layer, block_size;
    PyObject *q_obj, *tables_obj, *table_obj, *seen_obj;
    if (!PyArg_ParseTuple(args, "iOOiOO", &layer, &q_obj, &tables_obj, &block_size, &table_obj,
                          &seen_obj))
        return NULL;
    if (store_ready(self) < 0) return NULL;
    if (layer < 0 || layer >= self->key.n_layers) {
        PyErr_Format(PyExc_IndexError, "layer %d out of range [0, %d)", layer, self->key.n_layers);
        return NULL;
    }
    attention_args a;
    attention_buffers d;
    if (check_attention(self, q_obj, tables_obj, block_size, table_obj, seen_obj, 0, &a) < 0 ||
        upload_attention(self, &a, &d) < 0)
        return NULL;
    PyObject *out = PyArray_SimpleNew(3, PyArray_DIMS(a.q), NPY_FLOAT32);
    if (out == NULL) {
        free_buffers(&d);
        return NULL;
    }
    kv_cuda_view view = {&self->key, &self->value, layer, d.tables, a.max_blocks, block_size,
                         d.query_table, d.seen};
    size_t stride = (size_t)a.n_heads * self->key.head_dim;
    kv_cuda_err err;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_attention(d.out, stride, d.q, stride, &view, a.n_q, a.n_heads, a.max_seen,
                            d.scratch, d.scratch_bytes);
    if (err == 0)
        err = kv_cuda_to_host(PyArray_DATA((PyArrayObject *)out), d.out,
                              (size_t)a.n_q * stride * sizeof(float));
    Py_END_ALLOW_THREADS
    self->busy = 0;
    free_buffers(&d);
    if (err != 0) {
        Py_DECREF(out);
        return raise_cuda(err, "attention");
    }
    return out;
}

/* time_attention(q, tables (n_rotations, n_tables, max_blocks), block_size, query_table,
 * seen, inner, repeats) -> seconds per call of layer 0's attention, one per repeat */
static PyObject *store_time_attention(StoreObject *self, PyObject *args) {
    int block_size, inner, repeats;
    PyObject *q_obj, *tables_obj, *table_obj, *seen_obj;
    if (!PyArg_ParseTuple(args, "OOiOOii", &q_obj, &tables_obj, &block_size, &table_obj,
                          &seen_obj, &inner, &repeats))
        return NULL;
    if (store_ready(self) < 0) return NULL;
    if (inner < 1 || repeats < 1 || repeats > 10000) {
        PyErr_SetString(PyExc_ValueError, "inner and repeats must be positive");
        return NULL;
    }
    attention_args a;
    attention_buffers d;
    if (check_attention(self, q_obj, tables_obj, block_size, table_obj, seen_obj, 1, &a) < 0 ||
        upload_attention(self, &a, &d) < 0)
        return NULL;
    npy_intp dims[1] = {repeats};
    PyObject *seconds = PyArray_SimpleNew(1, dims, NPY_FLOAT64);
    if (seconds == NULL) {
        free_buffers(&d);
        return NULL;
    }
    kv_cuda_view view = {&self->key, &self->value, 0, d.tables, a.max_blocks, block_size,
                         d.query_table, d.seen};
    kv_cuda_err err;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_time_attention(&view, (size_t)a.n_tables * a.max_blocks, a.n_rotations, d.out,
                                 d.q, a.n_q, a.n_heads, a.max_seen, d.scratch, d.scratch_bytes,
                                 inner, repeats, (double *)PyArray_DATA((PyArrayObject *)seconds));
    Py_END_ALLOW_THREADS
    self->busy = 0;
    free_buffers(&d);
    if (err != 0) {
        Py_DECREF(seconds);
        return raise_cuda(err, "timing attention");
    }
    return seconds;
}

#define STORE_INT_GETTER(name, expr)                                        \
    static PyObject *store_get_##name(StoreObject *self, void *closure) {   \
        (void)closure;                                                      \
        return PyLong_FromLongLong((long long)(expr));                      \
    }
STORE_INT_GETTER(n_layers, self->key.n_layers)
STORE_INT_GETTER(n_kv_heads, self->key.n_kv_heads)
STORE_INT_GETTER(head_dim, self->key.head_dim)
STORE_INT_GETTER(slots, self->key.slots)
STORE_INT_GETTER(key_group, self->key.group)
STORE_INT_GETTER(value_group, self->value.group)
STORE_INT_GETTER(nbytes, self->key.codes ? kv_cuda_store_nbytes(&self->key) +
                                               kv_cuda_store_nbytes(&self->value) : 0)

static PyObject *store_get_format(StoreObject *self, void *closure) {
    return kv_py_format_name((closure ? &self->value : &self->key)->format);
}

static PyGetSetDef store_getset[] = {
    {"n_layers", (getter)store_get_n_layers, NULL, NULL, NULL},
    {"n_kv_heads", (getter)store_get_n_kv_heads, NULL, NULL, NULL},
    {"head_dim", (getter)store_get_head_dim, NULL, NULL, NULL},
    {"slots", (getter)store_get_slots, NULL, "Rows per (layer, KV head).", NULL},
    {"key_format", (getter)store_get_format, NULL, NULL, NULL},
    {"value_format", (getter)store_get_format, NULL, NULL, (void *)1},
    {"key_group", (getter)store_get_key_group, NULL, NULL, NULL},
    {"value_group", (getter)store_get_value_group, NULL, NULL, NULL},
    {"nbytes", (getter)store_get_nbytes, NULL, "Bytes of GPU memory: codes and scales of K and V.", NULL},
    {NULL}
};

static PyMethodDef store_methods[] = {
    {"write", (PyCFunction)store_write, METH_VARARGS,
     "write(slots, keys, values): rows (n, n_layers, n_kv_heads, head_dim) float32 quantized\n"
     "into slots (int64 (n,); -1 skips a row)."},
    {"read", (PyCFunction)store_read, METH_O,
     "read(slots) -> (key_codes, key_scales, value_codes, value_scales): host copies of the\n"
     "stored bytes, (n_layers, n, n_kv_heads, head_bytes) uint8, and scales or None."},
    {"put", (PyCFunction)store_put, METH_VARARGS,
     "put(slots, key_codes, key_scales, value_codes, value_scales): read() backwards: rows\n"
     "as read() gives them stored, as they are, into slots."},
    {"copy_rows", (PyCFunction)store_copy_rows, METH_VARARGS,
     "copy_rows(dst, src, n): copy n slots' rows, every layer and head (copy-on-write)."},
    {"fill_random", (PyCFunction)store_fill_random, METH_O,
     "fill_random(seed): pseudo-random rows in every slot (for benchmarks)."},
    {"attend", (PyCFunction)store_attend, METH_VARARGS,
     "attend(layer, q, tables, block_size, query_table, seen) -> out: decode attention of\n"
     "q (n_q, n_heads, head_dim) float32, query i over positions 0 .. seen[i]-1 of block table\n"
     "tables[query_table[i]]."},
    {"time_attention", (PyCFunction)store_time_attention, METH_VARARGS,
     "time_attention(q, tables, block_size, query_table, seen, inner, repeats) -> seconds:\n"
     "layer 0's attention timed with CUDA events; tables (n_rotations, n_tables, max_blocks),\n"
     "call j using tables[j % n_rotations]."},
    {NULL}
};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._cuda.KVStore",
    .tp_doc = PyDoc_STR("KVStore(n_layers, n_kv_heads, head_dim, slots, key_format='fp32',\n"
                        "        value_format='fp32', key_group=0, value_group=0)\n\n"
                        "K and V of a cache or pool in GPU memory, (n_layers, n_kv_heads, slots,\n"
                        "head_dim) each. Made by kvlab.cuda's CudaCache and CudaPagedPool."),
    .tp_basicsize = sizeof(StoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)store_init,
    .tp_dealloc = (destructor)store_dealloc,
    .tp_methods = store_methods,
    .tp_getset = store_getset,
};

/* ================================= Model ========================================= */

typedef struct {
    PyObject_HEAD
    kv_cuda_model model;
    int busy;
} ModelObject;

static int model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"config", "weights", NULL};
    PyObject *config, *weights;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!", kwlist, &PyDict_Type, &config,
                                     &PyDict_Type, &weights))
        return -1;
    if (self->model.token_embedding != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Model is already initialized");
        return -1;
    }
    kv_model host;
    memset(&host, 0, sizeof host);
    kv_config *c = &host.config;
    if (read_config(config, PyExc_ValueError, c) < 0) return -1;
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 8 != 0 ||
        c->head_dim > KV_CUDA_MAX_HEAD_DIM || !(c->norm_eps > 0.0f) || !isfinite(c->norm_eps) ||
        c->dim > (1 << 16) || c->hidden_dim > (1 << 16) || (long)c->n_heads * c->head_dim > (1 << 16) ||
        c->n_layers > 4096 || c->vocab_size > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "config does not fit the CUDA backend: n_kv_heads must divide "
                     "n_heads, head_dim must be a multiple of 8 up to %d", KV_CUDA_MAX_HEAD_DIM);
        return -1;
    }
    weight_spec table[N_WEIGHTS];
    weight_specs(c, &host.weights, table);
    for (int i = 0; i < N_WEIGHTS; i++) {
        PyObject *obj = PyDict_GetItemString(weights, table[i].name);   /* borrowed */
        if (obj == NULL) {
            PyErr_Format(PyExc_ValueError, "weights are missing %s", table[i].name);
            return -1;
        }
        kv_py_array_spec want = {.name = table[i].name, .type = NPY_FLOAT32,
                                 .ndim = table[i].ndim};
        memcpy(want.shape, table[i].shape, (size_t)table[i].ndim * sizeof(npy_intp));
        PyArrayObject *a = kv_py_array(obj, &want);
        if (a == NULL) return -1;
        *table[i].data = PyArray_DATA(a);   /* float32: the formats stay zero */
    }
    /* The copy holds the GIL: the arrays are the dict's, and another thread could drop
     * them from it while the copy ran. */
    kv_cuda_err err = kv_cuda_model_init(&self->model, &host);
    if (err != 0) {
        raise_cuda(err, "copying the weights to the GPU");
        return -1;
    }
    return 0;
}

static void model_dealloc(ModelObject *self) {
    kv_cuda_model_free(&self->model);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int model_ready(ModelObject *self) {
    if (self->model.token_embedding == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Model was not initialized");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this GPU model is running a call in another thread");
        return -1;
    }
    return 0;
}

/* reserve(n_tokens, n_runs, max_blocks, max_seen, n_logits): device scratch for a call this
 * large, n_logits of whose rows of logits are wanted (n_runs, or n_tokens with all_logits),
 * so that a forward call that follows allocates nothing (kvlab/cuda.py makes the paged
 * pool's bookkeeping changes only after this has succeeded). */
static PyObject *model_reserve(ModelObject *self, PyObject *args) {
    int n_tokens, n_runs, max_blocks, max_seen, n_logits;
    if (!PyArg_ParseTuple(args, "iiiii", &n_tokens, &n_runs, &max_blocks, &max_seen, &n_logits))
        return NULL;
    if (model_ready(self) < 0) return NULL;
    if (n_tokens < 1 || n_tokens > (1 << 16) || n_runs < 1 || n_runs > n_tokens ||
        max_blocks < 1 || max_seen < 1 || max_seen > KV_CUDA_MAX_POSITIONS || n_logits < 1 ||
        n_logits > n_tokens) {
        PyErr_SetString(PyExc_ValueError, "reserve: sizes out of range");
        return NULL;
    }
    kv_cuda_err err;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_model_reserve(&self->model, n_tokens, n_runs, max_blocks, max_seen, n_logits);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (err != 0) return raise_cuda(err, "allocating activation scratch on the GPU");
    Py_RETURN_NONE;
}

/* ---- forward: the arguments checked piece by piece, then the call ---------------------- */

/* A forward call's arguments (see model_forward), each array checked for type and shape. */
typedef struct {
    PyArrayObject *tokens;   /* int32 (n_tokens,) */
    PyArrayObject *counts;   /* int32 (n_runs,): run_tokens */
    PyArrayObject *starts;   /* int32 (n_runs,): run_start */
    PyArrayObject *tables;   /* int32 (n_runs, max_blocks) */
    PyArrayObject *slots;    /* int64 (n_tokens,): write_slots */
    npy_intp n_tokens, n_runs;
    int max_blocks, block_size, all_logits;
} forward_args;

/* The store holds K and V for this model (its layers and KV heads), in one format. */
static int check_store_fits(const kv_config *c, const StoreObject *store) {
    const kv_store *k = &store->key;
    if (k->n_layers != c->n_layers || k->n_kv_heads != c->n_kv_heads || k->head_dim != c->head_dim) {
        PyErr_Format(PyExc_ValueError, "this cache holds %d layers x %d KV heads x %d, but the "
                     "model needs %d x %d x %d", k->n_layers, k->n_kv_heads, k->head_dim,
                     c->n_layers, c->n_kv_heads, c->head_dim);
        return -1;
    }
    if (k->format != store->value.format || k->group != store->value.group) {
        PyErr_SetString(PyExc_ValueError, "the GPU forward pass needs K and V in one format");
        return -1;
    }
    return 0;
}

/* The five arrays' types and shapes into *a: one token id and one write slot per token,
 * one count, start and block-table row per run. */
static int check_forward_arrays(PyObject *tokens, PyObject *counts, PyObject *starts,
                                PyObject *tables, PyObject *slots, forward_args *a) {
    kv_py_array_spec spec = {.name = "tokens", .type = NPY_INT32, .ndim = 1,
                             .shape = {KV_PY_ANY}, .axes = "n_tokens"};
    if ((a->tokens = kv_py_array(tokens, &spec)) == NULL) return -1;
    a->n_tokens = PyArray_DIM(a->tokens, 0);
    if (a->n_tokens < 1 || a->n_tokens > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "tokens must hold 1 to 65536 ids");
        return -1;
    }
    spec.name = "run_tokens", spec.axes = "n_runs";
    if ((a->counts = kv_py_array(counts, &spec)) == NULL) return -1;
    a->n_runs = PyArray_DIM(a->counts, 0);
    spec.name = "run_start", spec.shape[0] = a->n_runs;
    if ((a->starts = kv_py_array(starts, &spec)) == NULL) return -1;
    a->tables = kv_py_array(tables, &(kv_py_array_spec){
        .name = "tables", .type = NPY_INT32, .ndim = 2, .shape = {KV_PY_ANY, KV_PY_ANY},
        .axes = "n_runs,max_blocks"});
    if (a->tables == NULL) return -1;
    a->slots = kv_py_array(slots, &(kv_py_array_spec){
        .name = "write_slots", .type = NPY_INT64, .ndim = 1, .shape = {a->n_tokens},
        .axes = "n_tokens"});
    if (a->slots == NULL) return -1;
    a->max_blocks = (int)PyArray_DIM(a->tables, 1);
    if (a->n_runs < 1 || a->n_runs > a->n_tokens || PyArray_DIM(a->tables, 0) != a->n_runs ||
        a->max_blocks < 1 || a->block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "run_tokens, run_start and tables need one entry (row) "
                        "per run, at least one run, and a positive block_size");
        return -1;
    }
    return 0;
}

static int check_token_ids(const forward_args *a, int vocab_size) {
    const int32_t *ids = (const int32_t *)PyArray_DATA(a->tokens);
    for (npy_intp i = 0; i < a->n_tokens; i++) {
        if (ids[i] < 0 || ids[i] >= vocab_size) {
            PyErr_Format(PyExc_ValueError, "token id %d at index %zd is out of range [0, %d)",
                         (int)ids[i], (Py_ssize_t)i, vocab_size);
            return -1;
        }
    }
    return 0;
}

/* Run r's block table covers its positions, and every block it reads is in the store
 * (n_blocks whole blocks). */
static int check_run_blocks(const forward_args *a, npy_intp r, int seen, long long n_blocks) {
    int used = (int)(((long long)seen + a->block_size - 1) / a->block_size);
    if (used > a->max_blocks) {
        PyErr_Format(PyExc_ValueError, "run %zd reaches position %d: its block table needs %d "
                     "blocks of %d, it has %d", (Py_ssize_t)r, seen - 1, used, a->block_size,
                     a->max_blocks);
        return -1;
    }
    const int32_t *table = (const int32_t *)PyArray_DATA(a->tables) + r * a->max_blocks;
    for (int j = 0; j < used; j++) {
        if (table[j] < 0 || table[j] >= n_blocks) {
            PyErr_Format(PyExc_IndexError, "block id %d (run %zd, entry %d) is outside the "
                         "cache's %lld blocks of %d", table[j], (Py_ssize_t)r, j, n_blocks,
                         a->block_size);
            return -1;
        }
    }
    return 0;
}

/* Each run: a positive count at a position the GPU can reach, its blocks inside the store;
 * and the runs' counts add up to the tokens. */
static int check_runs(const forward_args *a, size_t store_slots) {
    const int32_t *n = (const int32_t *)PyArray_DATA(a->counts);
    const int32_t *start = (const int32_t *)PyArray_DATA(a->starts);
    long long n_blocks = (long long)(store_slots / (size_t)a->block_size), total = 0;
    for (npy_intp r = 0; r < a->n_runs; r++) {
        if (n[r] < 1 || start[r] < 0 || (long long)start[r] + n[r] > KV_CUDA_MAX_POSITIONS) {
            PyErr_Format(PyExc_ValueError, "run %zd: %d tokens at position %d", (Py_ssize_t)r,
                         n[r], start[r]);
            return -1;
        }
        total += n[r];
        if (check_run_blocks(a, r, start[r] + n[r], n_blocks) < 0) return -1;
    }
    if (total != a->n_tokens) {
        PyErr_Format(PyExc_ValueError, "run_tokens add up to %lld but tokens holds %zd", total,
                     (Py_ssize_t)a->n_tokens);
        return -1;
    }
    return 0;
}

/* Every new row goes to a slot of the store, or -1 (leave it). */
static int check_write_slots(const forward_args *a, size_t store_slots) {
    const int64_t *write = (const int64_t *)PyArray_DATA(a->slots);
    for (npy_intp i = 0; i < a->n_tokens; i++) {
        if (write[i] < -1 || write[i] >= (int64_t)store_slots) {
            PyErr_Format(PyExc_IndexError, "write slot %lld at index %zd is outside the cache",
                         (long long)write[i], (Py_ssize_t)i);
            return -1;
        }
    }
    return 0;
}

/* The checked call: logits (n_tokens or n_runs rows), or NULL with an exception. The
 * arguments are copied first, while we hold the GIL: the caller's arrays could change
 * under us once we let go of it. */
static PyObject *run_forward(ModelObject *self, StoreObject *store, const forward_args *a) {
    npy_intp T = a->n_tokens, R = a->n_runs;
    npy_intp dims[2] = {a->all_logits ? T : R, self->model.config.vocab_size};
    PyObject *logits = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    size_t bytes = (size_t)T * (sizeof(int32_t) + sizeof(int64_t)) +
                   (size_t)R * (2 + a->max_blocks) * sizeof(int32_t);
    uint8_t *copy = PyMem_Malloc(bytes);
    if (logits == NULL || copy == NULL) {
        Py_XDECREF(logits);
        PyMem_Free(copy);
        return PyErr_NoMemory();
    }
    int64_t *c_slots = (int64_t *)copy;
    int32_t *c_tokens = (int32_t *)(c_slots + T);
    int32_t *c_counts = c_tokens + T, *c_starts = c_counts + R, *c_tables = c_starts + R;
    memcpy(c_slots, PyArray_DATA(a->slots), (size_t)T * sizeof(int64_t));
    memcpy(c_tokens, PyArray_DATA(a->tokens), (size_t)T * sizeof(int32_t));
    memcpy(c_counts, PyArray_DATA(a->counts), (size_t)R * sizeof(int32_t));
    memcpy(c_starts, PyArray_DATA(a->starts), (size_t)R * sizeof(int32_t));
    memcpy(c_tables, PyArray_DATA(a->tables), (size_t)R * a->max_blocks * sizeof(int32_t));
    kv_cuda_batch batch = {(int)T, c_tokens, (int)R, c_counts, c_starts, c_tables, a->max_blocks,
                           a->block_size, c_slots, a->all_logits};
    kv_cuda_err err;
    self->busy = store->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_forward(&self->model, &store->key, &store->value, &batch,
                          (float *)PyArray_DATA((PyArrayObject *)logits));
    Py_END_ALLOW_THREADS
    self->busy = store->busy = 0;
    PyMem_Free(copy);
    if (err != 0) {
        Py_DECREF(logits);
        return raise_cuda(err, "the forward pass");
    }
    return logits;
}

/* forward(tokens, store, run_tokens, run_start, tables, block_size, write_slots,
 *         all_logits=False) -> logits */
static PyObject *model_forward(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tokens", "store", "run_tokens", "run_start", "tables",
                             "block_size", "write_slots", "all_logits", NULL};
    PyObject *tokens, *store_obj, *counts, *starts, *tables, *slots;
    forward_args a = {.all_logits = 0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OOOiO|p", kwlist, &tokens, &StoreType,
                                     &store_obj, &counts, &starts, &tables, &a.block_size,
                                     &slots, &a.all_logits))
        return NULL;
    StoreObject *store = (StoreObject *)store_obj;
    const kv_config *c = &self->model.config;
    if (model_ready(self) < 0 || store_ready(store) < 0 || check_store_fits(c, store) < 0 ||
        check_forward_arrays(tokens, counts, starts, tables, slots, &a) < 0 ||
        check_token_ids(&a, c->vocab_size) < 0 || check_runs(&a, store->key.slots) < 0 ||
        check_write_slots(&a, store->key.slots) < 0)
        return NULL;
    return run_forward(self, store, &a);
}

static PyObject *model_get_weight_bytes(ModelObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->model.weight_bytes);
}

static PyObject *model_get_scratch_bytes(ModelObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->model.work_bytes);
}

static PyGetSetDef model_getset[] = {
    {"weight_bytes", (getter)model_get_weight_bytes, NULL, "Bytes of weights on the GPU.", NULL},
    {"scratch_bytes", (getter)model_get_scratch_bytes, NULL,
     "Bytes of activation scratch on the GPU (grown as calls need).", NULL},
    {NULL}
};

static PyMethodDef model_methods[] = {
    {"reserve", (PyCFunction)model_reserve, METH_VARARGS,
     "reserve(n_tokens, n_runs, max_blocks, max_seen, n_logits): scratch for a call of this\n"
     "size whose logits are n_logits rows (n_runs, or n_tokens with all_logits)."},
    {"forward", (PyCFunction)(void (*)(void))model_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(tokens, store, run_tokens, run_start, tables, block_size, write_slots,\n"
     "        all_logits=False) -> logits\n\n"
     "One forward call over a batch of runs (sequences): run r has run_tokens[r] new tokens\n"
     "at positions run_start[r].., reads block table tables[r] (int32, blocks of block_size\n"
     "slots), and its K/V rows go to write_slots (int64, -1: already there). Returns float32\n"
     "logits, every token's with all_logits, else each run's last token's."},
    {NULL}
};

static PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._cuda.Model",
    .tp_doc = PyDoc_STR("Model(config: dict, weights: dict)\n\n"
                        "A Llama-family model's float32 weights copied to the GPU, and its forward\n"
                        "pass. Made by kvlab.cuda.CudaModel (model.to('cuda'))."),
    .tp_basicsize = sizeof(ModelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)model_init,
    .tp_dealloc = (destructor)model_dealloc,
    .tp_methods = model_methods,
    .tp_getset = model_getset,
};

/* ================================ module ========================================= */

/* device_count() -> n; raises CudaError when the runtime cannot even ask (no driver) */
static PyObject *py_device_count(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    int count = 0;
    kv_cuda_err err = kv_cuda_device_count(&count);
    if (err != 0) return raise_cuda(err, "looking for a GPU");
    return PyLong_FromLong(count);
}

static PyObject *py_device_info(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    char name[256];
    int major, minor, sms, runtime, driver;
    size_t memory;
    kv_cuda_err err = kv_cuda_device_info(name, sizeof name, &major, &minor, &memory, &sms,
                                          &runtime, &driver);
    if (err != 0) return raise_cuda(err, "asking what GPU this is");
    return Py_BuildValue("{s:s,s:(ii),s:n,s:i,s:i,s:i}", "name", name, "capability", major, minor,
                         "memory_bytes", (Py_ssize_t)memory, "multiprocessors", sms,
                         "runtime_version", runtime, "driver_version", driver);
}

static PyObject *py_synchronize(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    kv_cuda_err err;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_synchronize();
    Py_END_ALLOW_THREADS
    if (err != 0) return raise_cuda(err, "waiting for the GPU");
    Py_RETURN_NONE;
}

/* time_copy(nbytes, repeats) -> seconds of each device-to-device copy */
static PyObject *py_time_copy(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t nbytes;
    int repeats;
    if (!PyArg_ParseTuple(args, "ni", &nbytes, &repeats)) return NULL;
    if (nbytes < 1 || repeats < 1 || repeats > 10000) {
        PyErr_SetString(PyExc_ValueError, "nbytes and repeats must be positive");
        return NULL;
    }
    npy_intp dims[1] = {repeats};
    PyObject *seconds = PyArray_SimpleNew(1, dims, NPY_FLOAT64);
    if (seconds == NULL) return NULL;
    kv_cuda_err err;
    Py_BEGIN_ALLOW_THREADS
    err = kv_cuda_time_copy((size_t)nbytes, repeats, (double *)PyArray_DATA((PyArrayObject *)seconds));
    Py_END_ALLOW_THREADS
    if (err != 0) {
        Py_DECREF(seconds);
        return raise_cuda(err, "timing a device-to-device copy");
    }
    return seconds;
}

static PyObject *py_error_name(PyObject *module, PyObject *arg) {
    (void)module;
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    return Py_BuildValue("(ss)", kv_cuda_error_name((kv_cuda_err)code),
                         kv_cuda_error_string((kv_cuda_err)code));
}

/* the error number of looking for a GPU (0: fine), without raising: for why_not() */
static PyObject *py_probe(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    int count = 0;
    kv_cuda_err err = kv_cuda_device_count(&count);
    return Py_BuildValue("(iiss)", (int)err, count, kv_cuda_error_name(err), kv_cuda_error_string(err));
}

static PyMethodDef module_methods[] = {
    {"device_count", py_device_count, METH_NOARGS, "Number of CUDA GPUs (raises CudaError without a driver)."},
    {"device_info", py_device_info, METH_NOARGS, "The current GPU: name, capability, memory, versions."},
    {"probe", py_probe, METH_NOARGS, "probe() -> (cuda error number, device count, error name, error text)."},
    {"synchronize", py_synchronize, METH_NOARGS, "Wait for all GPU work."},
    {"time_copy", py_time_copy, METH_VARARGS,
     "time_copy(nbytes, repeats) -> seconds of each device-to-device copy of nbytes bytes."},
    {"error_name", py_error_name, METH_O, "error_name(code) -> (name, description) of a cudaError."},
    {NULL}
};

static struct PyModuleDef cuda_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cuda",
    .m_doc = "kvlab's CUDA backend: Model and KVStore on the GPU. Use kvlab.cuda rather than this module.",
    .m_size = -1,
    .m_methods = module_methods,
};

/* SOURCES: the .cu files this extension was built from (setup.py passes their names) */
static PyObject *source_names(void) {
    PyObject *text = PyUnicode_FromString(KV_CUDA_SOURCES);
    if (text == NULL) return NULL;
    PyObject *names = PyUnicode_Split(text, NULL, -1);
    Py_DECREF(text);
    if (names == NULL) return NULL;
    PyObject *tuple = PyList_AsTuple(names);
    Py_DECREF(names);
    return tuple;
}

PyMODINIT_FUNC PyInit__cuda(void) {
    import_array();
    PyObject *errors = PyImport_ImportModule("kvlab.errors");
    if (errors == NULL) return NULL;
    CudaError = PyObject_GetAttrString(errors, "CudaError");
    Py_DECREF(errors);
    if (CudaError == NULL) return NULL;
    if (PyType_Ready(&StoreType) < 0 || PyType_Ready(&ModelType) < 0) return NULL;
    PyObject *module = PyModule_Create(&cuda_module);
    if (module == NULL) return NULL;
    PyObject *sources = source_names();
    if (sources == NULL || PyModule_AddObjectRef(module, "SOURCES", sources) < 0 ||
        PyModule_AddObjectRef(module, "KVStore", (PyObject *)&StoreType) < 0 ||
        PyModule_AddObjectRef(module, "Model", (PyObject *)&ModelType) < 0 ||
        PyModule_AddStringConstant(module, "ARCHS", KV_CUDA_ARCHS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_SPLIT", KV_CUDA_MAX_SPLIT) < 0 ||
        PyModule_AddIntConstant(module, "MAX_HEAD_DIM", KV_CUDA_MAX_HEAD_DIM) < 0 ||
        PyModule_AddIntConstant(module, "MATVEC_MAX_TOKENS", KV_CUDA_MATVEC_MAX_TOKENS) < 0) {
        Py_XDECREF(sources);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(sources);
    return module;
}
