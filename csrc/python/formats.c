/* formats.c: the cache formats by name ("fp32" ... "fp8") and the NumPy type of their codes.
 *
 * Shared by both bindings: kvlab._kvlab and the GPU's kvlab._cuda are built from this one
 * source (setup.py), so a format has one name and one spelling of its refusal everywhere.
 * It needs nothing from the C core but kvlab.h's kv_format.
 */
#include "binding.h"

#include <string.h>

const char *const kv_py_format_names[] = {"fp32", "fp16", "bf16", "int8", "int4", "fp8"};
#define N_FORMATS ((int)(sizeof kv_py_format_names / sizeof kv_py_format_names[0]))

int kv_py_parse_format(const char *name, const char *what, kv_format *format) {
    for (int i = 0; i < N_FORMATS; i++) {
        if (strcmp(name, kv_py_format_names[i]) == 0) {
            *format = (kv_format)i;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown %s format '%s'; known: fp32, fp16, bf16, int8, "
                 "int4, fp8", what, name);
    return -1;
}

int kv_py_make_format(kv_cache_format *format, const char *key_name, const char *value_name,
                      int key_group, int value_group, int window) {
    if (kv_py_parse_format(key_name, "key", &format->key_format) < 0 ||
        kv_py_parse_format(value_name, "value", &format->value_format) < 0)
        return -1;
    format->key_group = key_group;
    format->value_group = value_group;
    format->window = window;
    return 0;
}

/* The NumPy type of a format's codes: float16 is NumPy's own; bf16 has no NumPy type, so
 * its codes show as the raw uint16 bits; int4 and fp8 codes are bytes. */
int kv_py_code_type(kv_format format) {
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

PyObject *kv_py_format_name(kv_format format) {
    return PyUnicode_FromString(kv_py_format_names[format]);
}
