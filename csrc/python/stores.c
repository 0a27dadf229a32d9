/* stores.c: how K/V storage meets Python, for KVCache and PagedPool alike: a group size's
 * refusal in words, and zero-copy read-only views of a store's codes, scales and zero points.
 * (The formats by name are formats.c's, which the GPU binding shares.)
 */
#include "binding.h"

#include "store.h"

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
