/* weight_formats.c: the names of the weight matrices' formats, for the Model's formats=
 * argument (model.c), and matmul, the core's product over one matrix stored in any of them
 * (module.c lists it among the module's functions).
 */
#include "binding.h"

#include <string.h>

const char *const kv_py_weight_format_names[] = {[KV_WEIGHT_F32] = "fp32", [KV_WEIGHT_F16] = "fp16",
                                                  [KV_WEIGHT_BF16] = "bf16", [KV_WEIGHT_Q8_0] = "q8_0",
                                                  [KV_WEIGHT_Q4_0] = "q4_0", [KV_WEIGHT_Q4_1] = "q4_1"};

int kv_py_parse_weight_format(const char *name, kv_weight_format *format) {
    for (int f = KV_WEIGHT_F32; f <= KV_WEIGHT_LAST; f++)
        if (name != NULL && strcmp(name, kv_py_weight_format_names[f]) == 0) {
            *format = (kv_weight_format)f;
            return 0;
        }
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "weight format must be fp32, fp16, bf16, q8_0, q4_0 or q4_1, "
                     "got '%s'",
                     name);
    return -1;
}

PyObject *kv_py_matmul(PyObject *module, PyObject *args) {
    PyObject *x_obj, *w_obj;
    const char *name, *activations = "fp32";
    if (!PyArg_ParseTuple(args, "OOs|s", &x_obj, &w_obj, &name, &activations)) return NULL;
    int int8 = strcmp(activations, "int8") == 0;
    if (!int8 && strcmp(activations, "fp32") != 0) {
        PyErr_Format(PyExc_ValueError, "activations must be 'fp32' or 'int8', got '%s'",
                     activations);
        return NULL;
    }
    kv_weight_format format;
    if (kv_py_parse_weight_format(name, &format) < 0) return NULL;
    if (int8 && format != KV_WEIGHT_Q8_0 && format != KV_WEIGHT_Q4_0 && format != KV_WEIGHT_Q4_1) {
        PyErr_Format(PyExc_ValueError, "int8 activations go with q8_0, q4_0 or q4_1 weights, "
                     "not '%s'", name);
        return NULL;
    }
    PyArrayObject *x = kv_py_array(x_obj, &(kv_py_array_spec){
        .name = "x", .type = NPY_FLOAT32, .ndim = 2, .shape = {KV_PY_ANY, KV_PY_ANY},
        .axes = "n_tokens,in_dim"});
    if (x == NULL) return NULL;
    int n_tokens = (int)PyArray_DIM(x, 0), in_dim = (int)PyArray_DIM(x, 1);
    size_t row_bytes = kv_weight_row_bytes((kv_weight_format)format, in_dim);
    if (row_bytes == 0)
        return kv_py_raise(KV_ERR_INVALID_ARG, "in_dim %d does not suit %s (q8_0, q4_0 and q4_1 need a "
                           "multiple of 32)", in_dim, name);
    PyArrayObject *w = kv_py_array(w_obj, &(kv_py_array_spec){
        .name = "w", .type = format == KV_WEIGHT_F32 ? NPY_FLOAT32 : NPY_UINT8, .ndim = 2,
        .shape = {KV_PY_ANY, format == KV_WEIGHT_F32 ? in_dim : (npy_intp)row_bytes},
        .axes = "out_dim,row"});
    if (w == NULL) return NULL;
    npy_intp dims[2] = {n_tokens, PyArray_DIM(w, 0)};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (out == NULL) return NULL;
    kv_status status;
    Py_BEGIN_ALLOW_THREADS
    if (int8)
        status = kv_weights_matmul_int8((float *)PyArray_DATA((PyArrayObject *)out),
                                        (const float *)PyArray_DATA(x),
                                        (const uint8_t *)PyArray_DATA(w), format, n_tokens,
                                        in_dim, (int)dims[1]);
    else
        status = kv_weights_matmul((float *)PyArray_DATA((PyArrayObject *)out),
                                   (const float *)PyArray_DATA(x), (const uint8_t *)PyArray_DATA(w),
                                   (kv_weight_format)format, n_tokens, in_dim, (int)dims[1]);
    Py_END_ALLOW_THREADS
    if (status == KV_OK) return out;
    Py_DECREF(out);
    return kv_py_raise(status, "matmul: x must have at least one token and w one row");
}

