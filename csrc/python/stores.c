/* stores.c: how K/V storage meets Python, for KVCache and PagedPool alike: the formats
 * by name, and zero-copy read-only views of a store's codes, scales and zero points.
 */
#include "binding.h"

#include <string.h>

#include "store.h"

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

int kv_py_group_refused(const kv_cache_format *format, int head_dim) {
    if (head_dim <= 0) return 0;   /* no group suits a head of no values: a size is wrong */
    kv_format formats[2] = {format->key_format, format->value_format};
    int groups[2] = {format->key_group, format->value_group};
    for (int i = 0; i < 2; i++) {
        const char *name = kv_py_format_names[formats[i]], *side = i ? "value" : "key";
        if (kv_store_group(formats[i], groups[i], head_dim) >= 0) continue;
        if (formats[i] <= KV_FMT_BF16)
            PyErr_Format(PyExc_ValueError, "%s has no groups: leave the %s group at 0 "
                         "(got %d)", name, side, groups[i]);
        else
            PyErr_Format(PyExc_ValueError, "group size %d does not suit %s with head_dim "
                         "%d: it must divide head_dim%s", groups[i], name, head_dim,
                         formats[i] == KV_FMT_I4 ? " and be even (two codes per byte)" : "");
        return 1;
    }
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

/* n_lead leading axes with strides counted in head rows (see kv_store: one head row is
 * head_bytes of codes, or groups_per_head scales), then (n_kv_heads, per head). None for
 * scales or zero points a format does not have. */
PyObject *kv_py_store_view(PyObject *owner, const kv_store *store, int part, int n_lead,
                           const npy_intp *lead_dims, const npy_intp *lead_strides) {
    npy_intp dims[6], strides[6], head_row_bytes, item;
    void *data;
    int type;
    if (part == KV_PY_CODES) {
        type = kv_py_code_type(store->format);
        item = store->format == KV_FMT_F32 ? 4 : store->format <= KV_FMT_BF16 ? 2 : 1;
        head_row_bytes = (npy_intp)store->head_bytes;
        dims[n_lead + 1] = store->format == KV_FMT_I4 ? store->head_dim / 2 : store->head_dim;
        data = store->codes;
    } else {
        float *params = part == KV_PY_SCALES ? store->scales : store->zeros;
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
    return kv_py_readonly_view(owner, data, type, n_lead + 2, dims, strides);
}
