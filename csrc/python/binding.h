/* binding.h: what the files of the Python binding (csrc/python/) share.
 *
 * The binding is the only layer above the C core (the .c files of csrc/, which never
 * include Python.h). It turns Python arguments into what the core takes, releases the GIL
 * around long core calls, and turns each kv_status into an exception of kvlab.errors.
 * Ranges and room are the core's to check: the binding checks what the core cannot see
 * (Python types, the arrays behind its pointers, objects in use by another thread) and
 * words the core's refusals so that they name the argument at fault. The few ranges it
 * checks as well say why where they are (most bound what the binding allocates).
 *
 * One file per object: errors.c, arrays.c (every array argument), formats.c (cache formats
 * by name), stores.c (K/V views), cache.c (KVCache), blocks.c (BlockManager,
 * PagedSequence), pool.c (PagedPool: a BlockManager with K/V stores), row_store.c (a
 * PagedPool whose rows a Python object holds: the GPU's), model.c (Model), module.c
 * (module functions and PyInit__kvlab). arrays.c and formats.c are compiled into the GPU
 * binding (csrc/cuda/_cuda.c) too.
 */
#ifndef KVLAB_PY_BINDING_H
#define KVLAB_PY_BINDING_H

/* Every file includes this header first: Python.h must come before any system header
 * (it sets feature macros such as _POSIX_C_SOURCE). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
/* The oldest NumPy whose C API the binding may use: 1.25's, which 1.26 has too, so that
 * an extension built against NumPy 2 runs on NumPy 1.26 as pyproject.toml promises, and a
 * newer call fails to compile here instead of failing at import on a student's machine. */
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION

/* NumPy's C API is a table of function pointers that import_array() fills in. Every file
 * must use the same table: PY_ARRAY_UNIQUE_SYMBOL names it, module.c (which defines
 * KV_PY_IMPORTS_NUMPY before including this header) defines it and calls import_array(),
 * and every other file declares it extern (NO_IMPORT_ARRAY). The GPU extension, which
 * shares arrays.c and formats.c, names a table of its own (setup.py defines
 * PY_ARRAY_UNIQUE_SYMBOL for it) and fills it in cuda/_cuda.c. */
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#ifndef PY_ARRAY_UNIQUE_SYMBOL
#define PY_ARRAY_UNIQUE_SYMBOL kvlab_PyArray_API
#endif
#ifndef KV_PY_IMPORTS_NUMPY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "kvlab.h"

/* ---- errors.c: exceptions --------------------------------------------------------- */

/* kvlab.errors' classes, looked up once at import (kv_py_fetch_errors). */
typedef struct {
    PyObject *cache_full, *config, *weights, *out_of_blocks, *out_of_sequences,
        *pool_invariant;
} kv_py_errors;
extern kv_py_errors kv_py_error;

int kv_py_fetch_errors(void);

/* Raises the exception for a failed kv_status and returns NULL. The class follows from
 * the status (CacheFullError, OutOfBlocks, MemoryError, ValueError ...); the message is
 * the printf-style `format` (PyUnicode_FromFormat's directives), or the core's own
 * sentence when format is NULL. Every refusal of the core goes through here (but for
 * KVCache.attend's layer, an index: IndexError). */
PyObject *kv_py_raise(kv_status status, const char *format, ...);

/* The core refused a batch's arguments (KV_ERR_INVALID_ARG): says which sequence came
 * twice or has no new token, else raises with `otherwise` (the core's sentence if NULL).
 * Shared by the model's forward_batch and a row store's batch reservation. NULL. */
PyObject *kv_py_batch_refused(kv_status status, const int *slots, const int *counts,
                              Py_ssize_t n_seqs, const char *otherwise);

/* ValueError "<before><value><after>": PyErr_Format cannot print a double. */
PyObject *kv_py_raise_with_number(const char *before, double value, const char *after);
/* A length argument given from Python: an int or NumPy integer, not a bool or a float (a
 * TypeError naming `what`), nor one beyond a long long (a ValueError, not an OverflowError
 * in C's words). 0 on success, -1 with the exception set. */
int kv_py_length_arg(PyObject *arg, const char *what, long long *out);
/* Before PyArg_ParseTupleAndKeywords(args, kwds, format, kwlist, ...): every argument the
 * format reads as a C int ('i') must be an integer (not a bool, a float or a string: a
 * TypeError) that fits one (else a ValueError), each named by its keyword, so that a size
 * never arrives as True or as an OverflowError in C's words. 0 if all are, else -1. */
int kv_py_int_arguments(PyObject *args, PyObject *kwds, const char *format, char **kwlist);

/* An integer argument already read as a C int or long long (kv_py_int_arguments checked
 * its type): 0 if it lies in [low, high], else -1 with the ValueError kvlab.arguments
 * raises, in its words ("NAME must be at least LOW, got VALUE", or "at most HIGH"), with
 * `why` in parentheses after the bound when not NULL. The binding's one range check. */
int kv_py_int_in(const char *name, long long value, long long low, long long high,
                 const char *why);
/* A DeprecationWarning that `old` is now spelled `new_name`, in kvlab.deprecation.renamed's
 * words, pointing at the caller's line: 0, or -1 if the warning was turned into an error. */
int kv_py_warn_renamed(const char *old, const char *new_name);

/* The core's interrupt check (kv_set_interrupt_check) during a call that released the
 * GIL: arg is the PyThreadState * that Py_BEGIN_ALLOW_THREADS saved (&_save). */
int kv_py_signals_pending(void *arg);

/* The core's size limits, stated once for the constructors' refusals (KVCache, BlockManager,
 * PagedPool), so that a bound changed in the core is changed in one sentence here
 * (KV_MAX_BLOCK_SIZE, a plain number in kvlab.h, is written into the string as it is). */
#define KV_PY_STRINGIFY(x) #x
#define KV_PY_STRING(x) KV_PY_STRINGIFY(x)
#define KV_PY_STORE_LIMITS "n_layers up to 4096, n_kv_heads * head_dim up to 65536"
#define KV_PY_BLOCKS_LIMITS                                                                  \
    "block_size at most " KV_PY_STRING(KV_MAX_BLOCK_SIZE) ", num_blocks at most 2**24 (and " \
    "num_blocks * block_size at most 2**32), max_seqs at most 2**20 and max_seqs * "          \
    "max_blocks_per_seq at most 2**28"

/* ---- arrays.c: NumPy arrays in and out (shared with the GPU binding, kvlab._cuda) ---- */

#define KV_PY_ANY (-1)      /* a size kv_py_array takes whatever it is */
#define KV_PY_MAX_DIMS 4
#define KV_PY_WRITABLE 1    /* flags: the core writes into the array */
#define KV_PY_SIZE_T_AXES 2 /* flags: the core takes the axes as size_t: no INT_MAX limit */

/* What one array argument must be. Designated initializers read best at a call site:
 *   kv_py_array(obj, &(kv_py_array_spec){.name = "q", .type = NPY_FLOAT32, .ndim = 2,
 *                                        .shape = {KV_PY_ANY, head_dim},
 *                                        .axes = "n_heads,head_dim"}) */
typedef struct {
    const char *name;                 /* the argument, as messages name it */
    int type;                         /* NPY_FLOAT32, NPY_INT32 ... */
    int ndim;
    npy_intp shape[KV_PY_MAX_DIMS];   /* each axis' size, or KV_PY_ANY */
    const char *axes;                 /* for messages: the axes' names, comma-separated,
                                         or NULL to show sizes only */
    int flags;                        /* KV_PY_WRITABLE, KV_PY_SIZE_T_AXES */
    PyObject *error;                  /* raise this for every refusal; NULL: TypeError for
                                         type and byte order, ValueError for the rest */
} kv_py_array_spec;

/* obj as an array the core may read through its data pointer: that dtype in native byte
 * order, that rank and shape, C-contiguous, aligned, every axis at most INT_MAX (so that
 * sizes fit the core's ints) unless KV_PY_SIZE_T_AXES, writable if asked. A borrowed reference (obj itself, which
 * the caller holds), or NULL with an exception that names the argument. */
PyArrayObject *kv_py_array(PyObject *obj, const kv_py_array_spec *spec);

/* The rows argument of KVCache.keep and PagedPool.keep: int32 (n_layers, n_keep,
 * n_kv_heads), checked as kv_py_array checks (the core checks the row numbers). */
PyArrayObject *kv_py_rows_to_keep(PyObject *obj, int n_layers, int n_kv_heads);

/* A read-only ndarray over memory that owner holds, which it keeps alive (its base).
 * strides NULL means C order. */
PyObject *kv_py_readonly_view(PyObject *owner, void *data, int type, int ndim,
                              npy_intp *dims, npy_intp *strides);

/* ---- weight_formats.c: weight matrices' formats ------------------------------------ */

extern const char *const kv_py_weight_format_names[];

/* A weight format's name ('fp32', 'fp16', 'bf16', 'q8_0') into *format; ValueError otherwise. */
int kv_py_parse_weight_format(const char *name, kv_weight_format *format);

/* matmul(x, w, format, activations='fp32'): the module's function (see module.c's table) */
PyObject *kv_py_matmul(PyObject *module, PyObject *args);

/* ---- formats.c: cache formats by name (shared with the GPU binding, kvlab._cuda) ---- */

extern const char *const kv_py_format_names[];

/* The constructor's format arguments into *format: names parsed (ValueError for an unknown
 * one), groups and window as given; the core checks the numbers. */
int kv_py_make_format(kv_cache_format *format, const char *key_name, const char *value_name,
                      int key_group, int value_group, int window);
/* A format's name into *format; ValueError naming `what` ("key", "cache" ...) otherwise. */
int kv_py_parse_format(const char *name, const char *what, kv_format *format);
int kv_py_code_type(kv_format format);
PyObject *kv_py_format_name(kv_format format);

/* ---- stores.c: views of K/V storage --------------------------------------------------- */

/* After the core refused a cache or pool with KV_ERR_INVALID_ARG: raises the message for a
 * group that does not suit its format and head_dim and returns 1, or returns 0 (the fault
 * is elsewhere). */
int kv_py_group_refused(const kv_cache_format *format, int head_dim);

enum { KV_PY_CODES, KV_PY_SCALES, KV_PY_ZEROS };   /* the parts of a store */
/* getset closures of key_codes ... value_zeros: (is_value << 2) | part */
#define KV_PY_PART(is_value, part) ((void *)(intptr_t)(((is_value) << 2) | (part)))

/* A read-only zero-copy view of one part of a store; see stores.c. */
PyObject *kv_py_store_view(PyObject *owner, const kv_store *store, int part, int n_lead,
                           const npy_intp *lead_dims, const npy_intp *lead_strides);

/* ---- the objects -------------------------------------------------------------------- */

/* busy: a forward pass is writing the cache or pool with the GIL released; every other
 * use is refused meanwhile (RuntimeError), from any thread. */
typedef struct {
    PyObject_HEAD
    kv_cache cache;
    int busy;
} CacheObject;

/* A paged pool's block manager (kv_blocks): a BlockManager alone (its own, `own`), or the
 * one inside a PagedPool (the base of PoolObject; blocks points into its kv_pool). busy is
 * as for a cache: set while a forward pass writes the pool. */
typedef struct {
    PyObject_HEAD
    kv_blocks *blocks;
    kv_blocks own;
    int busy;
} BlocksObject;

/* store: the Python object a pool's rows live in (row_store.c), or NULL for the CPU's
 * own stores; row_store reaches it for the core (pool.row_store points at it). */
typedef struct {
    BlocksObject base;
    kv_pool pool;
    PyObject *store;
    kv_row_store row_store;
} PoolObject;

typedef struct {
    PyObject_HEAD
    BlocksObject *owner; /* strong reference: a handle keeps its pool alive */
    int seq;             /* slot in owner->blocks->seqs */
    uint32_t serial;     /* the slot's serial when this handle was made */
} SequenceObject;

extern PyTypeObject kv_py_cache_type, kv_py_blocks_type, kv_py_pool_type, kv_py_sequence_type,
    kv_py_model_type;

/* cache.c. 0 if the cache is initialized and not in use, else -1 with RuntimeError. */
int kv_py_cache_ready(CacheObject *cache);
/* The exception for a call over this cache that the core refused: the cache full
 * (n_positions more did not fit), or shaped for another model (model's config); any other
 * status in the core's words. Returns NULL. */
PyObject *kv_py_cache_refused(const CacheObject *cache, kv_status status, int n_positions,
                              const kv_config *model);

/* blocks.c. 0 if the block manager is initialized and not in use, else -1 with
 * RuntimeError. */
int kv_py_blocks_ready(BlocksObject *blocks);
/* The slot of obj, a live PagedSequence of this block manager, or -1 with an exception. */
int kv_py_sequence_slot(BlocksObject *blocks, PyObject *obj);
/* The exception for a refusal of the block manager: out of blocks or sequence slots, or a
 * full block table (appending n_tokens); any other status in the core's words. NULL. */
PyObject *kv_py_blocks_refused(const BlocksObject *blocks, kv_status status, int n_tokens);
/* A new handle to slot seq. */
PyObject *kv_py_new_sequence_handle(BlocksObject *blocks, int seq);

/* pool.c. 0 if the pool is initialized and not in use, else -1 with RuntimeError. */
int kv_py_pool_ready(PoolObject *pool);
/* The PagedPool that holds the sequence obj (a PagedSequence), ready for a forward pass,
 * and its slot in *seq; NULL with TypeError if its pool keeps no K and V here (a GPU
 * pool's block manager), or another exception as kv_py_sequence_slot. */
PoolObject *kv_py_pool_of(PyObject *obj, int *seq);
/* As kv_py_blocks_refused, and a pool shaped for another model (model's config). */
PyObject *kv_py_pool_refused(const PoolObject *pool, kv_status status, int n_tokens,
                             const kv_config *model);

/* row_store.c. Makes self's row store call `store`'s methods (copy_rows, write, read,
 * put), keeping a reference to it; refuses (ValueError) a format such a pool cannot keep
 * (a window, int4) and an object without those methods (TypeError). 0, or -1. */
int kv_py_row_store_init(PoolObject *self, PyObject *store, const kv_cache_format *format);
/* Every row of a row-store pool copied to the host, into *key and *value (host stores of
 * all its slots, in the pool's layout) whose memory is the returned uint8 array (a new
 * reference, the views' owner), or NULL with an exception. */
PyObject *kv_py_row_store_copy(PoolObject *self, kv_store *key, kv_store *value);
/* PagedPool's _reserve_batch(seqs, n_tokens) -> (starts, tables, slots),
 * _commit_batch(seqs, tokens, n_tokens) and _cancel_batch(seqs): a forward pass over a
 * row-store pool run elsewhere (kvlab/cuda.py), holding the pool (busy) in between. */
PyObject *kv_py_pool_reserve_batch(PoolObject *self, PyObject *args);
PyObject *kv_py_pool_commit_batch(PoolObject *self, PyObject *args);
PyObject *kv_py_pool_cancel_batch(PoolObject *self, PyObject *seqs);

/* model.c. How to choose tokens (temperature, top_k, top_p) into *how, each checked:
 * 0, or -1 with ValueError naming the argument. */
int kv_py_parse_sampling(double temperature, int top_k, double top_p, kv_sampling *how);

/* The kv_counters fields, in order: a counters array has this many int64 entries. */
#define KV_PY_N_COUNTERS ((npy_intp)(sizeof(kv_counters) / sizeof(int64_t)))

#endif /* KVLAB_PY_BINDING_H */
