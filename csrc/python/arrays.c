/* arrays.c: NumPy arrays in and out of the binding.
 *
 * In: the core reads and writes through raw pointers and trusts that each array holds
 * exactly what it expects: that element type in this machine's byte order, that shape,
 * C order, aligned. kv_py_array checks all of it, for every array argument of the module,
 * and says which argument was wrong, what it should be and what came. It converts
 * nothing: a silent copy would hide a cost from the caller (and a copy of an output would
 * lose what the core writes); the Python layer makes the copies it means to make.
 * Out: read-only views of memory an object owns, which keep the object alive.
 */
#include "binding.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Text appended into a fixed buffer, cut short (never overrun) if it does not fit. */
typedef struct {
    char *buf;
    size_t size, used;
} text;

static void put(text *t, const char *format, ...) {
    if (t->used + 1 >= t->size) return;
    va_list args;
    va_start(args, format);
    int n = vsnprintf(t->buf + t->used, t->size - t->used, format, args);
    va_end(args);
    if (n > 0) t->used = t->used + (size_t)n < t->size ? t->used + (size_t)n : t->size - 1;
}

/* The shape an argument must have, Python style: "(n_tokens, n_layers=2, head_dim=8)" with
 * axis names, "(*, 8)" without; a 1-D shape keeps its comma, "(10,)". */
static void expected_shape(text *t, const kv_py_array_spec *spec) {
    const char *axis = spec->axes;
    put(t, "(");
    for (int i = 0; i < spec->ndim; i++) {
        const char *end = axis ? strchr(axis, ',') : NULL;
        int name_length = axis ? (int)(end ? (size_t)(end - axis) : strlen(axis)) : 0;
        npy_intp size = spec->shape[i];
        if (i > 0) put(t, ", ");
        if (name_length > 0 && size != KV_PY_ANY)
            put(t, "%.*s=%zd", name_length, axis, (Py_ssize_t)size);
        else if (name_length > 0) put(t, "%.*s", name_length, axis);
        else if (size == KV_PY_ANY) put(t, "*");
        else put(t, "%zd", (Py_ssize_t)size);
        axis = end ? end + 1 : NULL;
    }
    put(t, spec->ndim == 1 ? ",)" : ")");
}

static void actual_shape(text *t, PyArrayObject *array) {
    int ndim = PyArray_NDIM(array);
    put(t, "(");
    for (int i = 0; i < ndim; i++)
        put(t, i > 0 ? ", %zd" : "%zd", (Py_ssize_t)PyArray_DIM(array, i));
    put(t, ndim == 1 ? ",)" : ")");
}

static int shape_matches(PyArrayObject *array, const kv_py_array_spec *spec) {
    if (PyArray_NDIM(array) != spec->ndim) return 0;
    for (int i = 0; i < spec->ndim; i++)
        if (spec->shape[i] != KV_PY_ANY && PyArray_DIM(array, i) != spec->shape[i]) return 0;
    return 1;
}

PyArrayObject *kv_py_array(PyObject *obj, const kv_py_array_spec *spec) {
    PyObject *type_error = spec->error ? spec->error : PyExc_TypeError;
    PyObject *value_error = spec->error ? spec->error : PyExc_ValueError;
    const char *name = spec->name;
    /* the dtype as NumPy prints it ("float32"), for the messages about types */
    PyObject *want = (PyObject *)PyArray_DescrFromType(spec->type);
    if (want == NULL) return NULL;
    PyArrayObject *array = NULL;
    if (!PyArray_Check(obj)) {
        PyErr_Format(type_error, "%s must be a numpy array of %S, got %s", name, want,
                     Py_TYPE(obj)->tp_name);
        goto done;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != spec->type) {
        PyErr_Format(type_error, "%s must be %S, got %S", name, want,
                     (PyObject *)PyArray_DESCR(a));
        goto done;
    }
    if (!PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(type_error, "%s must be %S in this machine's byte order, got %S "
                     "(a.astype(np.%S) makes such a copy)", name, want,
                     (PyObject *)PyArray_DESCR(a), want);
        goto done;
    }
    if (!shape_matches(a, spec)) {
        char expected[200], actual[200];
        text e = {expected, sizeof expected, 0}, g = {actual, sizeof actual, 0};
        expected[0] = actual[0] = '\0';
        expected_shape(&e, spec);
        actual_shape(&g, a);
        PyErr_Format(value_error, "%s must be a %d-D array of shape %s, got shape %s", name,
                     spec->ndim, expected, actual);
        goto done;
    }
    for (int i = 0; i < spec->ndim && !(spec->flags & KV_PY_SIZE_T_AXES); i++) {
        /* the core counts in ints: a larger axis would wrap round when passed to it */
        if (PyArray_DIM(a, i) > INT_MAX) {
            PyErr_Format(value_error, "%s is too large: %zd entries on axis %d, at most %d",
                         name, (Py_ssize_t)PyArray_DIM(a, i), i, INT_MAX);
            goto done;
        }
    }
    if (!PyArray_IS_C_CONTIGUOUS(a)) {
        PyErr_Format(value_error, "%s must be C-contiguous, got a strided view "
                     "(np.ascontiguousarray makes such a copy)", name);
        goto done;
    }
    if (!PyArray_ISALIGNED(a)) {
        PyErr_Format(value_error, "%s must be aligned to its %d-byte items "
                     "(np.require(a, requirements=\"CA\") makes such a copy)", name,
                     (int)PyArray_ITEMSIZE(a));
        goto done;
    }
    if ((spec->flags & KV_PY_WRITABLE) && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(value_error, "%s must be writable: the call writes into it", name);
        goto done;
    }
    array = a;
done:
    Py_DECREF(want);
    return array;
}

PyObject *kv_py_readonly_view(PyObject *owner, void *data, int type, int ndim,
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

PyArrayObject *kv_py_rows_to_keep(PyObject *obj, int n_layers, int n_kv_heads) {
    return kv_py_array(obj, &(kv_py_array_spec){
        .name = "rows", .type = NPY_INT32, .ndim = 3, .shape = {n_layers, KV_PY_ANY, n_kv_heads},
        .axes = "n_layers,n_keep,n_kv_heads"});
}
