/* errors.c: the core's kv_status codes as Python exceptions, and Ctrl-C during a call.
 *
 * The classes are kvlab.errors', looked up at import, so that a student sees the same
 * names whichever layer (Python or C) found the problem. One function, kv_py_raise, picks
 * the class for every status; callers only choose the words.
 */
#include "binding.h"

#include <limits.h>
#include <stdarg.h>

kv_py_errors kv_py_error;

int kv_py_fetch_errors(void) {
    PyObject *errors = PyImport_ImportModule("kvlab.errors");
    if (errors == NULL) return -1;
    kv_py_error.cache_full = PyObject_GetAttrString(errors, "CacheFullError");
    kv_py_error.config = PyObject_GetAttrString(errors, "ConfigError");
    kv_py_error.weights = PyObject_GetAttrString(errors, "WeightsError");
    kv_py_error.out_of_blocks = PyObject_GetAttrString(errors, "OutOfBlocks");
    kv_py_error.out_of_sequences = PyObject_GetAttrString(errors, "OutOfSequences");
    kv_py_error.pool_invariant = PyObject_GetAttrString(errors, "PoolInvariantError");
    Py_DECREF(errors);
    kv_py_errors *e = &kv_py_error;
    if (e->cache_full && e->config && e->weights && e->out_of_blocks && e->out_of_sequences &&
        e->pool_invariant)
        return 0;
    Py_CLEAR(e->cache_full); Py_CLEAR(e->config); Py_CLEAR(e->weights);
    Py_CLEAR(e->out_of_blocks); Py_CLEAR(e->out_of_sequences); Py_CLEAR(e->pool_invariant);
    return -1;
}

PyObject *kv_py_raise(kv_status status, const char *format, ...) {
    PyObject *type;
    switch (status) {
        case KV_ERR_NOMEM: return PyErr_NoMemory();
        case KV_ERR_INTERRUPTED:
            /* the signal handler's own exception (normally KeyboardInterrupt) is set */
            if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
            return NULL;
        case KV_ERR_STORE:
            /* a pool's row store (row_store.c) raised: its own exception says why */
            if (PyErr_Occurred()) return NULL;
            type = PyExc_RuntimeError;
            break;
        case KV_ERR_CACHE_FULL:
        case KV_ERR_TABLE_FULL: type = kv_py_error.cache_full; break;
        case KV_ERR_OUT_OF_BLOCKS: type = kv_py_error.out_of_blocks; break;
        case KV_ERR_TOO_MANY_SEQUENCES: type = kv_py_error.out_of_sequences; break;
        case KV_ERR_CORRUPT: type = kv_py_error.pool_invariant; break;
        case KV_ERR_PENDING: type = PyExc_RuntimeError; break;   /* a call out of order */
        default: type = PyExc_ValueError; break;
    }
    if (format == NULL) {
        PyErr_SetString(type, kv_strerror(status));
        return NULL;
    }
    va_list args;
    va_start(args, format);
    PyErr_FormatV(type, format, args);
    va_end(args);
    return NULL;
}

int kv_py_length_arg(PyObject *arg, const char *what, long long *out) {
    if (PyBool_Check(arg) || !PyIndex_Check(arg) || PyFloat_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s must be an integer, got %.80R (%s)", what, arg,
                     Py_TYPE(arg)->tp_name);
        return -1;
    }
    PyObject *value = PyNumber_Index(arg);
    if (value == NULL) return -1;
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(value, &overflow);
    Py_DECREF(value);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (overflow) {
        PyErr_Format(PyExc_ValueError, "%s is %.80R, beyond any length", what, arg);
        return -1;
    }
    *out = n;
    return 0;
}

int kv_py_int_arguments(PyObject *args, PyObject *kwds, const char *format, char **kwlist) {
    Py_ssize_t given = PyTuple_GET_SIZE(args), position = 0;
    for (const char *f = format; *f != '\0' && *f != ':' && *f != ';'; f++) {
        if (*f == '|' || *f == '$') continue;
        const char *name = kwlist[position];
        PyObject *value = position < given ? PyTuple_GET_ITEM(args, position)
                        : kwds != NULL ? PyDict_GetItemString(kwds, name) : NULL;
        position++;
        if (*f != 'i' || value == NULL) continue;
        long long n;
        if (kv_py_length_arg(value, name, &n) < 0) return -1;
        if (kv_py_int_in(name, n, INT_MIN, INT_MAX, NULL) < 0) return -1;
    }
    return 0;
}

int kv_py_int_in(const char *name, long long value, long long low, long long high,
                 const char *why) {
    if (value >= low && value <= high) return 0;
    const char *side = value < low ? "least" : "most";
    long long bound = value < low ? low : high;
    if (why != NULL)
        PyErr_Format(PyExc_ValueError, "%s must be at %s %lld (%s), got %lld", name, side, bound,
                     why, value);
    else
        PyErr_Format(PyExc_ValueError, "%s must be at %s %lld, got %lld", name, side, bound,
                     value);
    return -1;
}

int kv_py_warn_renamed(const char *old, const char *new_name) {
    /* kvlab.deprecation.renamed's words, so that the same filters catch both */
    return PyErr_WarnFormat(PyExc_DeprecationWarning, 1, "%s is deprecated and goes in the "
                            "next release: use %s", old, new_name);
}

PyObject *kv_py_raise_with_number(const char *before, double value, const char *after) {
    char number[64];
    PyOS_snprintf(number, sizeof number, "%.17g", value);
    PyErr_Format(PyExc_ValueError, "%s%s%s", before, number, after);
    return NULL;
}

/* A long call over the model asks this between chunks and steps, with the GIL released:
 * it takes the GIL back for a moment and runs Python's signal handlers, so Ctrl-C raises
 * KeyboardInterrupt within a fraction of a second. It updates the saved thread state,
 * which PyEval_SaveThread gives anew. Whatever a handler raises stays set for the caller
 * to return (kv_py_raise(KV_ERR_INTERRUPTED, ...)). */
int kv_py_signals_pending(void *arg) {
    PyThreadState **saved = arg;
    PyEval_RestoreThread(*saved);
    int raised = PyErr_CheckSignals() < 0;
    *saved = PyEval_SaveThread();
    return raised;
}

PyObject *kv_py_batch_refused(kv_status status, const int *slots, const int *counts,
                              Py_ssize_t n_seqs, const char *otherwise) {
    for (Py_ssize_t i = 0; i < n_seqs; i++)
        for (Py_ssize_t j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return kv_py_raise(status, "seqs[%zd] and seqs[%zd] are the same sequence", j, i);
    for (Py_ssize_t i = 0; i < n_seqs; i++)
        if (counts[i] < 1)
            return kv_py_raise(status, "n_tokens[%zd] is %d: every sequence needs at least "
                               "one new token", i, counts[i]);
    return kv_py_raise(status, otherwise);
}
