"""Lab 14's side of the worker: what the grader's tests call, around the student's C kernel.

The judge builds the student's decode_kernel.c into a shared library (in a worker of its
own, kvlab/grading/cbuild.py), and each test's worker loads this file by path and binds
it to that library (bind). The tests then call these functions as they call a Python lab's
(`sub.decode_attention(...)`): the arrays arrive by value, are laid out as the C view
wants them, and the result goes back by value.

This runs beside the student's code, in its process, after its library is loaded: it is no
more trusted than the student's code is. Nothing here decides a grade; the judge checks
every result it gets back and times every call from its own process. Standard library and
NumPy only, nothing relative: the worker loads it by path, and never loads kvlab.
"""
import ctypes

import numpy as np

MAX_KV_MUL = 32
_library = None


class View(ctypes.Structure):
    """kv_cache_view of decode_kernel.h, field for field."""
    _fields_ = [("key_codes", ctypes.c_void_p), ("key_scales", ctypes.c_void_p),
                ("value_codes", ctypes.c_void_p), ("value_scales", ctypes.c_void_p),
                ("block_table", ctypes.c_void_p), ("length", ctypes.c_int),
                ("block_size", ctypes.c_int), ("n_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("group", ctypes.c_int), ("scale", ctypes.c_float)]


class NotInYourFile(AttributeError):
    """The library lacks the function the lab asks for."""


def bind(library):
    """Use this library (ctypes.CDLL of the student's build) from now on."""
    global _library
    try:
        function = library.decode_attention
    except AttributeError:
        raise NotInYourFile("your file defines no `decode_attention` (is it the file for "
                            "this lab, and is the function static by mistake?)") from None
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(View), ctypes.c_int,
                         ctypes.c_int]
    _library = library


def _array(value, dtype, ndim, what):
    array = np.ascontiguousarray(value, dtype=dtype)
    if array.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got {array.ndim}")
    return array


class Pool:
    """One layer of a paged int8 pool, kept in this process between calls: what the
    timing tests fill once (a part at a time: a frame has a size limit) and then run the
    kernel over again and again, so that what is timed is the kernel and not the transfer."""

    def __init__(self, num_blocks, n_kv_heads, block_size, head_dim, group):
        shape = (int(num_blocks), int(n_kv_heads), int(block_size), int(head_dim))
        if min(shape) < 1 or int(group) < 1 or shape[3] % int(group):
            raise ValueError(f"no pool of shape {shape} with groups of {group}")
        self.group = int(group)
        scales = shape[:3] + (shape[3] // self.group,)
        self.arrays = {"key_codes": np.zeros(shape, np.int8), "value_codes": np.zeros(shape, np.int8),
                       "key_scales": np.zeros(scales, np.float32),
                       "value_scales": np.zeros(scales, np.float32)}

    def put(self, name, first_block, blocks):
        """blocks[i] becomes block first_block + i of the array `name`."""
        target = self.arrays[name]
        blocks = np.asarray(blocks, dtype=target.dtype)
        if blocks.shape[1:] != target.shape[1:] or not 0 <= first_block <= len(target) - len(blocks):
            raise ValueError(f"{name}: blocks of shape {blocks.shape} do not fit at {first_block}")
        target[first_block:first_block + len(blocks)] = blocks
        return None

    def load(self, name, path):
        """The array `name` whole, from a .npy file the judge handed over (kvlab's
        testkit.handout_file): a pool is too large to send as a value in good time."""
        self.put(name, 0, np.load(path, allow_pickle=False))
        return None

    def view(self, block_table, length, scale):
        a = self.arrays
        table = _array(block_table, np.int32, 1, "block_table")
        block_size = a["key_codes"].shape[2]
        if not 1 <= int(length) <= len(table) * block_size or \
                np.any(table < 0) or np.any(table >= len(a["key_codes"])):
            raise ValueError("the block table does not cover the length inside the pool")
        view = View(a["key_codes"].ctypes.data, a["key_scales"].ctypes.data,
                    a["value_codes"].ctypes.data, a["value_scales"].ctypes.data,
                    table.ctypes.data, int(length), block_size, a["key_codes"].shape[1],
                    a["key_codes"].shape[3], self.group, float(scale))
        return view, table          # the table must outlive the call

    def attend(self, q, block_table, length, scale, n_threads):
        """decode_attention of q (n_heads, head_dim) over the sequence the table names."""
        q = _array(q, np.float32, 2, "q")
        n_kv_heads, head_dim = self.arrays["key_codes"].shape[1], self.arrays["key_codes"].shape[3]
        if q.shape[1] != head_dim or q.shape[0] % n_kv_heads or q.shape[0] // n_kv_heads > MAX_KV_MUL:
            raise ValueError(f"q of shape {q.shape} for {n_kv_heads} KV heads of {head_dim}")
        view, table = self.view(block_table, length, scale)
        out = np.full_like(q, np.nan)
        library = _library
        flag = ctypes.c_int.in_dll(library, "decode_kernel_not_written")
        flag.value = 0
        library.decode_attention(out.ctypes.data, q.ctypes.data, ctypes.byref(view),
                                 q.shape[0], int(n_threads))
        if flag.value:
            raise NotImplementedError("decode_attention")
        return out

    def chain(self, q, q_base, block_table, length, scale, n_runs, n_threads):
        """n_runs calls, each one's query q_base + the output before (the first's q): no
        call can start before the one before it has ended, nor skip it. All the outputs,
        (n_runs, n_heads, head_dim), for the judge to check."""
        q_base = _array(q_base, np.float32, 2, "q_base")
        outputs = []
        for _ in range(int(n_runs)):
            out = self.attend(q, block_table, length, scale, n_threads)
            outputs.append(out)
            q = q_base + out
        return np.stack(outputs)


def decode_attention(q, key_codes, key_scales, value_codes, value_scales, block_table, length,
                     scale, n_threads=1):
    """One call on a pool given whole: (num_blocks, n_kv_heads, block_size, head_dim) codes
    and (num_blocks, n_kv_heads, block_size, head_dim / group) scales."""
    key_codes = _array(key_codes, np.int8, 4, "key_codes")
    key_scales = _array(key_scales, np.float32, 4, "key_scales")
    num_blocks, n_kv_heads, block_size, head_dim = key_codes.shape
    groups = key_scales.shape[3]
    if groups < 1 or head_dim % groups:
        raise ValueError(f"scales of shape {key_scales.shape} for heads of {head_dim}")
    pool = Pool(num_blocks, n_kv_heads, block_size, head_dim, head_dim // groups)
    for name, array in (("key_codes", key_codes), ("key_scales", key_scales),
                        ("value_codes", value_codes), ("value_scales", value_scales)):
        pool.put(name, 0, array)
    return pool.attend(q, block_table, length, scale, n_threads)
