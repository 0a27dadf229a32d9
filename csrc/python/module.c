/* module.c: the module kvlab._kvlab itself: its functions (sampling one row, the
 * quantization formats on their own, threads, kernel tiers, bandwidth measurements), its
 * constants (MAX_BLOCK_SIZE, TOKEN_CHUNK, the COUNTERS names, HAS_OPENMP,
 * FUSED_MULTIPLY_ADD, BUILD, and VARIANT, VARIANTS, VARIANT_REASON: the kernel variant that
 * runs, the KVLAB_VARIANT variable choosing another), and
 * PyInit__kvlab, which imports NumPy's C API for every file and adds the five types the
 * other files define (cache.c, model.c, blocks.c, pool.c).
 */
#define KV_PY_IMPORTS_NUMPY   /* this file defines NumPy's API table: see binding.h */
#include "binding.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "ops.h"        /* KV_TOKEN_CHUNK */
#include "sampling.h"
#include "store.h"

/* ---- sampling ---------------------------------------------------------------------- */

/* sample(logits, temperature=0, top_k=0, top_p=1, u=0) -> token: kv_sample on one row. */
static PyObject *py_sample(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"logits", "temperature", "top_k", "top_p", "u", NULL};
    PyObject *logits_obj;
    double temperature = 0.0, top_p = 1.0, u = 0.0;
    int top_k = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|didd", kwlist, &logits_obj, &temperature,
                                     &top_k, &top_p, &u))
        return NULL;
    kv_sampling how;
    if (kv_py_parse_sampling(temperature, top_k, top_p, &how) < 0) return NULL;
    if (!(u >= 0.0 && u < 1.0))
        return kv_py_raise_with_number("u must be in [0, 1), got ", u, "");
    /* The one argument converted rather than checked: any row of numbers is rounded to
     * float32, as the model's logits are (kvlab.sampling.sample takes lists too). */
    PyArrayObject *logits = (PyArrayObject *)PyArray_FROMANY(
        logits_obj, NPY_FLOAT32, 1, 1, NPY_ARRAY_CARRAY_RO | NPY_ARRAY_FORCECAST);
    if (logits == NULL) return NULL;
    npy_intp n = PyArray_DIM(logits, 0);
    /* the scratch kv_sample needs grows with n: bounded so that its size fits an int */
    int most = (int)(INT32_MAX / kv_sample_scratch_bytes(1));
    if (kv_py_int_in("len(logits)", n, 1, most, NULL) < 0) {
        Py_DECREF(logits);
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
    if (chosen < 0) return kv_py_raise(KV_ERR_NOT_A_NUMBER, NULL);
    return PyLong_FromLong(chosen);
}

/* ---- quantization ------------------------------------------------------------------ */

/* Rows x (rows, d) written into a one-layer store of `rows` slots, as a cache would store
 * them: the C side of kvlab.quant, for checking the two agree. *x_out: x (borrowed).
 * 0 with the store filled, or -1 with an exception set. */
static int store_rows(PyObject *x_obj, const char *name, int group, kv_store *store,
                      PyArrayObject **x_out) {
    PyArrayObject *x = kv_py_array(x_obj, &(kv_py_array_spec){
        .name = "x", .type = NPY_FLOAT32, .ndim = 2, .shape = {KV_PY_ANY, KV_PY_ANY},
        .axes = "rows,d", .error = PyExc_TypeError});
    if (x == NULL) return -1;
    kv_format format;
    if (kv_py_parse_format(name, "cache", &format) < 0) return -1;
    npy_intp rows = PyArray_DIM(x, 0), d = PyArray_DIM(x, 1);
    /* one layer and one KV head: a row of x is a head row; the core checks the sizes */
    kv_status status = kv_store_init(store, format, group, 1, (size_t)rows, 1, (int)d);
    if (status == KV_ERR_INVALID_ARG) {
        kv_py_raise(status, "x (%zd rows of %zd values) cannot be stored as %s with group %d: "
                    "x needs at least one row, rows of 1 to 65536 values (an even number for "
                    "int4), and the group must divide the row length (and be even for int4; "
                    "0 for float formats)", (Py_ssize_t)rows, (Py_ssize_t)d, name, group);
        return -1;
    }
    if (status != KV_OK) {
        kv_py_raise(status, NULL);
        return -1;
    }
    for (npy_intp r = 0; r < rows; r++)
        kv_store_write(store, 0, (size_t)r, (const float *)PyArray_DATA(x) + r * d);
    *x_out = x;
    return 0;
}

/* quantize(x, format, group=0) -> (codes, scales, zeros) */
static PyObject *py_quantize(PyObject *module, PyObject *args) {
    PyObject *x_obj, *result = NULL;
    PyArrayObject *x;
    const char *name;
    int group = 0;
    kv_store store;
    if (!PyArg_ParseTuple(args, "Os|i", &x_obj, &name, &group)) return NULL;
    if (store_rows(x_obj, name, group, &store, &x) < 0) return NULL;
    npy_intp rows = (npy_intp)store.slots;   /* one KV head: head rows are whole rows */
    npy_intp code_dims[2] = {rows, (npy_intp)store.head_bytes / (store.format == KV_FMT_F32 ? 4 :
                                   store.format <= KV_FMT_BF16 ? 2 : 1)};
    npy_intp group_dims[2] = {rows, store.groups_per_head};
    PyObject *codes = PyArray_SimpleNew(2, code_dims, kv_py_code_type(store.format));
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
    PyObject *x_obj;
    PyArrayObject *x;
    const char *name;
    int group = 0;
    kv_store store;
    if (!PyArg_ParseTuple(args, "Os|i", &x_obj, &name, &group)) return NULL;
    if (store_rows(x_obj, name, group, &store, &x) < 0) return NULL;
    PyObject *out = PyArray_SimpleNew(2, PyArray_DIMS(x), NPY_FLOAT32);
    if (out != NULL)
        for (size_t r = 0; r < store.slots; r++)
            kv_store_read(&store, 0, r, (float *)PyArray_DATA((PyArrayObject *)out) + r * store.head_dim);
    kv_store_free(&store);
    return out;
}

/* ---- threads and kernels ----------------------------------------------------------- */

static PyObject *py_set_num_threads(PyObject *module, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    /* More threads than a few per core only slow a call down, and OpenMP may end the whole
     * process when it cannot create them: refuse them here, with the bound. */
    long cores = kv_available_cores();
    char why[64];
    PyOS_snprintf(why, sizeof why, "4 per core, %ld cores here", cores);
    if (kv_py_int_in("number of threads", n, 1, 4 * cores, why) < 0) return NULL;
    kv_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *module, PyObject *Py_UNUSED(ignored)) {
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
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (name == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kernels must be a str");
        return NULL;
    }
    if (set_kernels_named(name, "kernels") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_get_kernels(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_FromString(kernel_names[kv_get_kernels()]);
}

/* module.<attribute> = a tuple of the count strings in names (COUNTERS, VARIANTS) */
static int add_name_tuple(PyObject *module, const char *attribute, const char *const *names,
                          int count) {
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL) return -1;
    for (int i = 0; i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == NULL) {
            Py_DECREF(tuple);
            return -1;
        }
        PyTuple_SET_ITEM(tuple, i, name);
    }
    int result = PyModule_AddObjectRef(module, attribute, tuple);
    Py_DECREF(tuple);
    return result;
}

/* ---- kernel variants (dispatch.h) ---------------------------------------------------- */

/* KVLAB_VARIANT=name runs the process on that kernel variant instead of the best one this
 * CPU has: for the tests that compare the variants' bits, and for timing one against
 * another. 1 if it chose one, 0 if unset, -1 with ValueError for a name this build lacks or
 * a variant this CPU cannot run (which would die of an illegal instruction). */
static int use_variant_from_environment(void) {
    const char *name = getenv("KVLAB_VARIANT");
    if (name == NULL || name[0] == '\0') return 0;
    if (kv_use_variant(name) == KV_OK) return 1;
    int count;
    const kv_variant *variants = kv_variants(&count);
    char names[256] = "";
    for (int i = 0; i < count; i++) {
        if (strcmp(name, variants[i].kernels->name) == 0) {
            PyErr_Format(PyExc_ValueError, "KVLAB_VARIANT=%s: this CPU cannot run it (it "
                         "lacks %s)", name, variants[i].needs);
            return -1;
        }
        size_t used = strlen(names);
        PyOS_snprintf(names + used, sizeof names - used, "%s'%s'", i ? ", " : "",
                      variants[i].kernels->name);
    }
    PyErr_Format(PyExc_ValueError, "KVLAB_VARIANT must be one of this build's kernel "
                 "variants (%s), got '%s'", names, name);
    return -1;
}

/* Why the running variant runs, in one sentence (VARIANT_REASON, for kvlab info). */
static PyObject *variant_reason(int asked) {
    int count;
    const kv_variant *variants = kv_variants(&count), *current = kv_current_variant();
    if (asked)
        return PyUnicode_FromFormat("KVLAB_VARIANT=%s asked for it", current->kernels->name);
    if (count == 1)
        return PyUnicode_FromString("the one variant of this build (its flags: BUILD)");
    if (current == &variants[0])
        return PyUnicode_FromFormat("the best of this build's %d variants: this CPU has %s",
                                    count, current->needs);
    return PyUnicode_FromFormat("the best of this build's %d variants that this CPU runs: it "
                                "lacks %s", count, (current - 1)->needs);
}

/* VARIANT, VARIANTS (this build's, best first), VARIANT_REASON, FUSED_MULTIPLY_ADD
 * (whether the running variant's multiply-adds round once: tests/test_bits.py's digests)
 * and PACKED_INPUTS (which of its products pack their input: measure.scratch_bytes) */
static int add_variant_constants(PyObject *module, int asked) {
    int count;
    const kv_variant *variants = kv_variants(&count), *current = kv_current_variant();
    const char *names[KV_MAX_VARIANTS];
    for (int i = 0; i < count; i++) names[i] = variants[i].kernels->name;
    if (add_name_tuple(module, "VARIANTS", names, count) < 0) return -1;
    PyObject *reason = variant_reason(asked);
    if (reason == NULL) return -1;
    int result = PyModule_AddObjectRef(module, "VARIANT_REASON", reason);
    Py_DECREF(reason);
    if (result < 0 || PyModule_AddStringConstant(module, "VARIANT", current->kernels->name) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "PACKED_INPUTS", current->kernels->packed_inputs) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "FUSED_MULTIPLY_ADD",
                                   current->kernels->fused_multiply_add);
}

/* ---- bandwidth --------------------------------------------------------------------- */

/* Both measurements take at most 1000 repeats (a call should end) and memory_bandwidth
 * arrays of at least 4 KiB: the binding's own bounds. The rest of the ranges are the core's. */

static PyObject *py_memory_bandwidth(PyObject *module, PyObject *args) {
    Py_ssize_t n_bytes = 1 << 29;
    int repeats = 5;
    if (!PyArg_ParseTuple(args, "|ni", &n_bytes, &repeats)) return NULL;
    double read = 0, triad = 0;
    float checksum = 0;
    kv_status status = KV_ERR_INVALID_ARG;
    if (n_bytes >= 4096 && repeats <= 1000) {
        Py_BEGIN_ALLOW_THREADS
        status = kv_measure_bandwidth((size_t)n_bytes / sizeof(float), repeats, &read, &triad,
                                      &checksum);
        Py_END_ALLOW_THREADS
    }
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "n_bytes must be 4096 to 2**34 (16 GiB), repeats 1..1000, "
                           "got %zd and %d", n_bytes, repeats);
    if (status != KV_OK) return kv_py_raise(status, NULL);
    return Py_BuildValue("{s:d,s:d}", "read_bytes_per_s", read, "triad_bytes_per_s", triad);
}

static PyObject *py_attention_walk_bandwidth(PyObject *module, PyObject *args) {
    int n_kv_heads, head_dim, context, repeats = 3;
    if (!PyArg_ParseTuple(args, "iii|i", &n_kv_heads, &head_dim, &context, &repeats)) return NULL;
    double bytes_per_s = 0;
    float checksum = 0;
    kv_status status = KV_ERR_INVALID_ARG;
    if (repeats <= 1000) {
        Py_BEGIN_ALLOW_THREADS
        status = kv_measure_attention_walk(n_kv_heads, head_dim, context, repeats, &bytes_per_s,
                                           &checksum);
        Py_END_ALLOW_THREADS
    }
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "attention_walk_bandwidth needs 1..1024 KV heads, head_dim "
                           "a multiple of 8 up to 1024, a context of 16..%d and repeats 1..1000 "
                           "(got %d, %d, %d, %d)", 1 << 22, n_kv_heads, head_dim, context, repeats);
    if (status != KV_OK) return kv_py_raise(status, NULL);
    return PyFloat_FromDouble(bytes_per_s);
}

/* The compute roof on one thread and on the core's threads (kv_measure_compute) */
static PyObject *py_compute_roof(PyObject *module, PyObject *args) {
    int repeats = 3;
    if (!PyArg_ParseTuple(args, "|i", &repeats)) return NULL;
    int n_threads = kv_get_num_threads();
    kv_compute_roof one = {0}, all = {0};
    kv_status status = KV_ERR_INVALID_ARG;
    if (repeats >= 1 && repeats <= 1000) {
        Py_BEGIN_ALLOW_THREADS
        status = kv_measure_compute(1, repeats, &one);
        if (status == KV_OK) status = kv_measure_compute(n_threads, repeats, &all);
        Py_END_ALLOW_THREADS
    }
    if (status == KV_ERR_INVALID_ARG)
        return kv_py_raise(status, "compute_roof takes repeats 1..1000, got %d", repeats);
    if (status != KV_OK) return kv_py_raise(status, NULL);
    return Py_BuildValue("{s:i,s:d,s:d,s:d,s:d,s:d,s:d,s:s,s:s}", "threads", n_threads,
                         "f32_flops_per_s_1_thread", one.f32_flops,
                         "f32_flops_per_s", all.f32_flops,
                         "int8_ops_per_s_1_thread", one.int8_ops, "int8_ops_per_s", all.int8_ops,
                         "int8_product_ops_per_s_1_thread", one.int8_product_ops,
                         "int8_product_ops_per_s", all.int8_product_ops,
                         "f32_instruction", one.f32_instruction,
                         "int8_instruction", one.int8_instruction);
}

/* ---- the module -------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"matmul", kv_py_matmul, METH_VARARGS,
     "matmul(x, w, format) -> x @ dequantize(w).T: x float32 (n_tokens, in_dim), w float32\n"
     "(out_dim, in_dim) for 'fp32', else uint8 (out_dim, row bytes) as\n"
     "kvlab.weight_formats.quantize writes it ('fp16', 'bf16', 'q8_0', 'q4_0', 'q4_1'); on\n"
     "the kernel tier set by set_kernels. Equal bit for bit to the fp32 product over the\n"
     "dequantized matrix. matmul(x, w, 'q8_0' | 'q4_0' | 'q4_1', 'int8') quantizes x to int8\n"
     "per block of 32 and sums integer products instead (kvlab.weight_formats.matmul_int8\n"
     "is its NumPy twin)."},
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
    {"compute_roof", py_compute_roof, METH_VARARGS,
     "compute_roof(repeats=3) -> dict: the rates of the widest float32 multiply-add and int8\n"
     "dot-product instructions, and of the int8 product's own sequence, on one thread and on\n"
     "the core's threads (operations per second, a multiply and an add counted as two)."},
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
    .m_doc = "kvlab's C core: its five types, Model, KVCache (one sequence's contiguous cache),\n"
             "BlockManager (a paged pool's bookkeeping, no K or V), PagedPool (a BlockManager\n"
             "with K/V stores in host memory, or in a row store: the GPU's) and PagedSequence (a handle to one of a pool's\n"
             "sequences), the module functions below, and the constants MAX_BLOCK_SIZE,\n"
             "TOKEN_CHUNK, COUNTERS, HAS_OPENMP, FUSED_MULTIPLY_ADD (whether the kernels'\n"
             "dot products fuse their multiply-adds: a variant built for CPUs with FMA), BUILD\n"
             "(the compiler, flags, kernel variants and KVLAB_* options that built this\n"
             "module), VARIANTS (this build's kernel variants, best first), VARIANT (the one\n"
             "that runs: the best this CPU has, or KVLAB_VARIANT's at import),\n"
             "VARIANT_REASON (why) and PACKED_INPUTS (which of the variant's products pack\n"
             "their input, counted in scratch bytes). Use the kvlab package rather than this module.",
    .m_size = -1,
    .m_methods = module_methods,
};

/* The kv_counters fields, in order: what each entry of a counters array counts. */
static const char *const counter_names[] = {"flops_projections", "flops_attention", "flops_mlp",
                                            "flops_logits", "weight_bytes", "kv_read_bytes",
                                            "kv_write_bytes", "scratch_bytes", "tokens", "calls"};
_Static_assert(sizeof counter_names / sizeof counter_names[0] == (size_t)KV_PY_N_COUNTERS,
               "counter_names must name every kv_counters field");

/* What built this module, in kvlab_build.describe's words (setup.py defines it; a build
 * by other means, such as tests/c's Makefile, has none). */
#ifndef KV_BUILD
#define KV_BUILD "unknown (not built by setup.py)"
#endif

PyMODINIT_FUNC PyInit__kvlab(void) {
    import_array();
    if (kv_py_fetch_errors() < 0) return NULL;
    /* KVLAB_KERNELS=plain runs every model of the process on the plain kernels */
    const char *kernels = getenv("KVLAB_KERNELS");
    if (kernels != NULL && kernels[0] != '\0' && set_kernels_named(kernels, "KVLAB_KERNELS") < 0)
        return NULL;
    int variant_asked = use_variant_from_environment();
    if (variant_asked < 0) return NULL;
    if (PyType_Ready(&kv_py_cache_type) < 0 || PyType_Ready(&kv_py_model_type) < 0 ||
        PyType_Ready(&kv_py_blocks_type) < 0 || PyType_Ready(&kv_py_pool_type) < 0 || PyType_Ready(&kv_py_sequence_type) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&kvlab_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "KVCache", (PyObject *)&kv_py_cache_type) < 0 ||
        PyModule_AddObjectRef(module, "Model", (PyObject *)&kv_py_model_type) < 0 ||
        PyModule_AddObjectRef(module, "BlockManager", (PyObject *)&kv_py_blocks_type) < 0 ||
        PyModule_AddObjectRef(module, "PagedPool", (PyObject *)&kv_py_pool_type) < 0 ||
        PyModule_AddIntConstant(module, "MAX_BLOCK_SIZE", KV_MAX_BLOCK_SIZE) < 0 ||
        PyModule_AddIntConstant(module, "TOKEN_CHUNK", KV_TOKEN_CHUNK) < 0 ||
        PyModule_AddObjectRef(module, "PagedSequence", (PyObject *)&kv_py_sequence_type) < 0 ||
        add_name_tuple(module, "COUNTERS", counter_names, KV_PY_N_COUNTERS) < 0 ||
        PyModule_AddStringConstant(module, "BUILD", KV_BUILD) < 0 ||
        add_variant_constants(module, variant_asked) < 0 ||
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
