"""The GPU edition of lab 14's side of the worker: what the grader's tests call, around the
student's CUDA kernel.

The judge builds the student's decode_kernel_cuda.cu with this folder's harness.cu into one
shared library (in a worker of its own, kvlab/grading/cbuild.py), and each test's worker
loads this file by path and binds it to that library (bind). The tests then call these
functions as they call lab 14's: the arrays arrive by value, are copied to the GPU by
harness.cu, and the result comes back by value. The timed chain of calls runs on the device
(harness.cu's lab_chain), and its outputs stay there until the judge asks for some (outputs).

This runs beside the student's code, in its process, after its library is loaded: it is no
more trusted than the student's code is. Nothing here decides a grade; the judge checks
every output it asks for and times every chain from its own process. Standard library and
NumPy only, nothing relative: the worker loads it by path, and never loads kvlab.
"""
import ctypes

import numpy as np

MAX_KV_MUL = 32
_library = None


class NotInYourFile(AttributeError):
    """The library lacks the function the lab asks for."""


def bind(library):
    """Use this library (ctypes.CDLL of the student's build with harness.cu) from now on."""
    global _library
    try:
        library.decode_attention
    except AttributeError:
        raise NotInYourFile("your file defines no `decode_attention` (is it the file for this "
                            "lab, declared extern \"C\" as the header declares it?)") from None
    p, i, f, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
    for name, restype, argtypes in (
            ("lab_error", ctypes.c_char_p, []),
            ("lab_pool_new", p, [i, i, i, i, i]),
            ("lab_pool_free", None, [p]),
            ("lab_pool_put", i, [p, i, s, p, s]),
            ("lab_attend", i, [p, p, p, i, i, f, i, p]),
            ("lab_chain", i, [p, p, p, p, i, i, f, i, i]),
            ("lab_outputs", i, [p, p, i, i, p])):
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    _library = library


def _array(value, dtype, ndim, what):
    array = np.ascontiguousarray(value, dtype=dtype)
    if array.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got {array.ndim}")
    return array


def _check(status, what):
    """A harness call's status: NotImplementedError for the starter, RuntimeError with the
    CUDA runtime's words for a CUDA error (an illegal address, a bad launch ...)."""
    if status == 1 and what == "decode_attention":
        raise NotImplementedError("decode_attention")
    if status != 0:
        said = _library.lab_error().decode("utf-8", "replace")
        raise RuntimeError(f"CUDA error in {said}" if said else f"{what} failed")


ARRAYS = ("key_codes", "key_scales", "value_codes", "value_scales")


class Pool:
    """One layer of a paged int8 pool, kept in GPU memory between calls: what the timing
    tests fill once and then run the kernel over again and again, so that what is timed is
    the kernel and not the transfer."""

    def __init__(self, num_blocks, n_kv_heads, block_size, head_dim, group):
        shape = (int(num_blocks), int(n_kv_heads), int(block_size), int(head_dim))
        if min(shape) < 1 or int(group) < 1 or shape[3] % int(group):
            raise ValueError(f"no pool of shape {shape} with groups of {group}")
        self.group, self.shape = int(group), shape
        self.scales_shape = shape[:3] + (shape[3] // self.group,)
        self.handle = _library.lab_pool_new(*shape, self.group)
        if not self.handle:
            raise MemoryError(_library.lab_error().decode("utf-8", "replace"))

    def __del__(self):
        if getattr(self, "handle", None) and _library is not None:
            _library.lab_pool_free(self.handle)
            self.handle = None

    def put(self, name, first_block, blocks):
        """blocks[i] becomes block first_block + i of the array `name`."""
        codes = name.endswith("codes")
        blocks = np.ascontiguousarray(blocks, dtype=np.int8 if codes else np.float32)
        inner = self.shape[1:] if codes else self.scales_shape[1:]
        if blocks.shape[1:] != inner or not 0 <= first_block <= self.shape[0] - len(blocks):
            raise ValueError(f"{name}: blocks of shape {blocks.shape} do not fit at {first_block}")
        per_block = int(np.prod(inner)) * blocks.itemsize
        _check(_library.lab_pool_put(self.handle, ARRAYS.index(name), int(first_block) * per_block,
                                     blocks.ctypes.data, blocks.nbytes), "copying rows in")
        return None

    def load(self, name, path):
        """The array `name` whole, from a .npy file the judge handed over."""
        self.put(name, 0, np.load(path, allow_pickle=False))
        return None

    def _table(self, block_table, length):
        table = _array(block_table, np.int32, 1, "block_table")
        if not 1 <= int(length) <= len(table) * self.shape[2] or \
                np.any(table < 0) or np.any(table >= self.shape[0]):
            raise ValueError("the block table does not cover the length inside the pool")
        return table

    def _query(self, q):
        q = _array(q, np.float32, 2, "q")
        n_kv_heads, head_dim = self.shape[1], self.shape[3]
        if q.shape[1] != head_dim or q.shape[0] % n_kv_heads or q.shape[0] // n_kv_heads > MAX_KV_MUL:
            raise ValueError(f"q of shape {q.shape} for {n_kv_heads} KV heads of {head_dim}")
        return q

    def attend(self, q, block_table, length, scale, n_threads=1):
        """decode_attention of q (n_heads, head_dim) over the sequence the table names
        (n_threads is lab 14's, and means nothing on a GPU)."""
        q, table = self._query(q), self._table(block_table, length)
        out = np.full_like(q, np.nan)
        _check(_library.lab_attend(self.handle, q.ctypes.data, table.ctypes.data, len(table),
                                   int(length), float(scale), q.shape[0], out.ctypes.data),
               "decode_attention")
        return out

    def chain(self, q, q_base, block_table, length, scale, n_runs):
        """n_runs calls on the device, each one's query q_base + the output before (the
        first's q). The outputs stay on the device: outputs() hands back the ones asked for."""
        q, q_base, table = self._query(q), self._query(q_base), self._table(block_table, length)
        if q.shape != q_base.shape or int(n_runs) < 1:
            raise ValueError("a chain takes q and q_base of one shape, and at least one run")
        self.n_heads = q.shape[0]
        _check(_library.lab_chain(self.handle, q.ctypes.data, q_base.ctypes.data, table.ctypes.data,
                                  len(table), int(length), float(scale), q.shape[0], int(n_runs)),
               "decode_attention")
        return None

    def outputs(self, indices):
        """Outputs `indices` of the last chain, (len(indices), n_heads, head_dim)."""
        indices = _array(indices, np.int32, 1, "indices")
        out = np.full((len(indices), self.n_heads, self.shape[3]), np.nan, np.float32)
        _check(_library.lab_outputs(self.handle, indices.ctypes.data, len(indices), self.n_heads,
                                    out.ctypes.data), "copying outputs back")
        return out


def decode_attention(q, key_codes, key_scales, value_codes, value_scales, block_table, length,
                     scale, n_threads=1):
    """One call on a pool given whole, as lab 14's harness takes it: (num_blocks,
    n_kv_heads, block_size, head_dim) codes and (..., head_dim / group) scales."""
    key_codes = _array(key_codes, np.int8, 4, "key_codes")
    key_scales = _array(key_scales, np.float32, 4, "key_scales")
    num_blocks, n_kv_heads, block_size, head_dim = key_codes.shape
    groups = key_scales.shape[3]
    if groups < 1 or head_dim % groups:
        raise ValueError(f"scales of shape {key_scales.shape} for heads of {head_dim}")
    pool = Pool(num_blocks, n_kv_heads, block_size, head_dim, head_dim // groups)
    for name, array in zip(ARRAYS, (key_codes, key_scales, value_codes, value_scales)):
        pool.put(name, 0, array)
    return pool.attend(q, block_table, length, scale, n_threads)
