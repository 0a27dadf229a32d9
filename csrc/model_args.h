/* model_args.h: a model's config dict and its weight arrays as the Python bindings read
 * them. Shared by the CPU binding (python/model.c) and the GPU one (cuda/_cuda.c), which check
 * the same config and expect the same thirteen arrays; each then keeps the weights its
 * own way (borrowed in place, or copied to the GPU). Include after Python.h and NumPy's
 * arrayobject.h. */
#ifndef KVLAB_MODEL_ARGS_H
#define KVLAB_MODEL_ARGS_H

#include "kvlab.h"

/* config[key] as an int in 1 .. 2**30; raises error_type naming the key otherwise */
static int config_int(PyObject *config, const char *key, PyObject *error_type, int *out) {
    PyObject *value = PyDict_GetItemString(config, key);   /* borrowed */
    if (value == NULL) {
        PyErr_Format(error_type, "model config is missing %s", key);
        return -1;
    }
    long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v <= 0 || v > (1L << 30)) {
        PyErr_Format(error_type, "config %s must be an integer in 1..2**30, got %ld", key, v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The config dict's fields into *c (the sizes, norm_eps and rope_interleaved). Each
 * borrowed value is converted before the next lookup: a conversion may run Python code
 * (__float__, __bool__) that changes the dict under our feet. What fits which backend is
 * left to the caller. */
static int read_config(PyObject *config, PyObject *error_type, kv_config *c) {
    if (config_int(config, "dim", error_type, &c->dim) < 0 ||
        config_int(config, "hidden_dim", error_type, &c->hidden_dim) < 0 ||
        config_int(config, "n_layers", error_type, &c->n_layers) < 0 ||
        config_int(config, "n_heads", error_type, &c->n_heads) < 0 ||
        config_int(config, "n_kv_heads", error_type, &c->n_kv_heads) < 0 ||
        config_int(config, "head_dim", error_type, &c->head_dim) < 0 ||
        config_int(config, "vocab_size", error_type, &c->vocab_size) < 0 ||
        config_int(config, "max_seq_len", error_type, &c->max_seq_len) < 0)
        return -1;
    PyObject *eps = PyDict_GetItemString(config, "norm_eps");
    if (eps == NULL) {
        PyErr_SetString(error_type, "model config needs norm_eps");
        return -1;
    }
    c->norm_eps = (float)PyFloat_AsDouble(eps);
    if (PyErr_Occurred()) return -1;
    PyObject *interleaved = PyDict_GetItemString(config, "rope_interleaved");
    if (interleaved == NULL) {
        PyErr_SetString(error_type, "model config needs rope_interleaved");
        return -1;
    }
    c->rope_interleaved = PyObject_IsTrue(interleaved);
    return c->rope_interleaved < 0 ? -1 : 0;
}

#define N_WEIGHTS 13

/* One weight array the model expects: its name in the weights dict, its shape as float32
 * values, and the kv_weights fields that will hold its data and, for a matrix, its format
 * (NULL for the vectors, always float32). */
typedef struct {
    const char *name;
    int ndim;
    npy_intp shape[3];
    const void **data;
    kv_weight_format *format;
} weight_spec;

/* The thirteen arrays of a model of config c, each aimed at its fields of w. */
static void weight_specs(const kv_config *c, kv_weights *w, weight_spec table[N_WEIGHTS]) {
    npy_intp L = c->n_layers, D = c->dim, H = c->hidden_dim, V = c->vocab_size;
    npy_intp Q = (npy_intp)c->n_heads * c->head_dim, KV = (npy_intp)c->n_kv_heads * c->head_dim;
#define MATRIX(field) (const void **)&w->field.data, &w->field.format
#define VECTOR(field) (const void **)&w->field, NULL
    const weight_spec specs[N_WEIGHTS] = {
        {"token_embedding", 2, {V, D}, MATRIX(token_embedding)},
        {"attn_norm", 2, {L, D}, VECTOR(attn_norm)},
        {"wq", 3, {L, Q, D}, MATRIX(wq)},
        {"wk", 3, {L, KV, D}, MATRIX(wk)},
        {"wv", 3, {L, KV, D}, MATRIX(wv)},
        {"wo", 3, {L, D, Q}, MATRIX(wo)},
        {"ffn_norm", 2, {L, D}, VECTOR(ffn_norm)},
        {"w1", 3, {L, H, D}, MATRIX(w1)},
        {"w2", 3, {L, D, H}, MATRIX(w2)},
        {"w3", 3, {L, H, D}, MATRIX(w3)},
        {"final_norm", 1, {D}, VECTOR(final_norm)},
        {"classifier", 2, {V, D}, MATRIX(classifier)},
        {"rope_inv_freq", 1, {c->head_dim / 2}, VECTOR(rope_inv_freq)},
    };
#undef MATRIX
#undef VECTOR
    memcpy(table, specs, sizeof specs);
}

#endif /* KVLAB_MODEL_ARGS_H */
