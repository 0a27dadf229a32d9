"""The GPU pool presents the CPU pool's interface (runs without a GPU).

kvlab.cuda.CudaPagedPool is kvlab.PagedPool with its rows in GPU memory, so that code over
a pool (the Engine, the cache policies, a notebook) never asks which one it holds: the same
public names, the same methods (the very same functions, not look-alikes), the same
constructor, the same return types and the same errors. Here the GPU's memory is
conftest.py's NumPy stand-in.
"""
import ast
import inspect
import re

import numpy as np
import pytest

import kvlab
from kvlab.cuda import CudaPagedPool
from kvlab.quant import CacheFormat

L, H, D = 2, 2, 16


def public(obj):
    return {name for name in dir(obj) if not name.startswith("_")}


def cpu_constructor():
    """(name, default) of the C PagedPool's arguments, from the first lines of its doc
    (a C type's __init__ has no inspectable signature)."""
    text = kvlab._kvlab.PagedPool.__doc__.split("\n\n")[0]
    inside = re.search(r"\((.*)\)", " ".join(text.split()), re.S).group(1)
    arguments = []
    for part in inside.split(","):
        name, _, default = part.strip().partition("=")
        try:
            default = ast.literal_eval(default) if default else inspect.Parameter.empty
        except ValueError:
            default = default          # "num_blocks": said in words
        arguments.append((name, default))
    return arguments


def pools(fake_store, fmt_name="int8", num_blocks=6, block_size=4, max_blocks_per_seq=3):
    fmt = CacheFormat.make(D, fmt_name)
    sizes = (L, H, D, num_blocks, block_size, 4, max_blocks_per_seq)
    return (kvlab.PagedPool(*sizes, **fmt.core_arguments()),
            CudaPagedPool(*sizes, **fmt.core_arguments(),
                          store=fake_store(L, H, D, num_blocks * block_size, fmt)))


def rows(n, seed=0):
    keys = np.random.default_rng(seed).standard_normal((n, L, H, D)).astype(np.float32)
    return keys, keys * np.float32(-0.5)


def test_the_same_public_names_and_methods():
    assert public(CudaPagedPool) == public(kvlab.PagedPool)
    for name in public(kvlab.PagedPool):
        assert getattr(CudaPagedPool, name) is getattr(kvlab.PagedPool, name), name
    # what engine.py and model.py read off any pool
    for name in ("n_layers", "n_kv_heads", "head_dim", "key_format", "value_format", "window",
                 "swap_out", "swap_in", "swap_nbytes", "keep", "positions", "gather", "append"):
        assert name in public(kvlab.PagedPool), name


def test_the_same_constructor():
    gpu = inspect.signature(CudaPagedPool.__init__).parameters
    names = [name for name in gpu if name != "self"]
    cpu = cpu_constructor()
    assert names == [name for name, _ in cpu], "CudaPagedPool takes PagedPool's arguments"
    for name, default in cpu:
        if name == "max_blocks_per_seq":     # "num_blocks" in the doc: 0 means it in C
            assert gpu[name].default == 0
        else:
            assert gpu[name].default == default, name


def test_the_same_instance_attributes_and_return_types(fake_store):
    cpu, gpu = pools(fake_store)
    assert public(cpu) == public(gpu)
    assert (cpu.device, gpu.device) == ("cpu", "cuda")
    results = []
    for pool in (cpu, gpu):
        seq = pool.new_sequence()
        pool.append(seq, np.arange(5, dtype=np.int32), *rows(5))
        child = pool.fork(seq)
        host = pool.swap_out(child)
        back = pool.swap_in(host)
        results.append([seq, pool.gather(seq), pool.positions(seq), pool.stats(), host, back,
                        pool.swap_nbytes(seq), pool.key_codes, pool.key_scales, pool.key_zeros,
                        pool.blocks_needed(seq, 3), pool.reuse_prefix(pool.new_sequence(), [1]),
                        pool.render(), pool.nbytes, pool.key_format, pool.n_layers])
    for want, got in zip(*results):
        assert type(got) is type(want)
        if isinstance(want, tuple):
            assert [type(g) for g in got] == [type(w) for w in want]
        if isinstance(want, np.ndarray):
            assert (got.shape, got.dtype) == (want.shape, want.dtype)


def refusal(call):
    with pytest.raises(Exception) as caught:
        call()
    return type(caught.value), str(caught.value)


def test_the_same_errors(fake_store):
    """Each misuse raises the same exception, in the same words, on both pools."""
    cpu, gpu = pools(fake_store, num_blocks=5)
    other = kvlab.PagedPool(L, H, D, 4, 4)
    cases = []
    for pool in (cpu, gpu):
        filler, seq, freed = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
        pool.append(filler, np.arange(12, dtype=np.int32), *rows(12))   # 2 blocks left
        pool.free(freed)
        keys, values = rows(20)
        cases.append([
            refusal(lambda: pool.append(seq, np.arange(13, dtype=np.int32), *rows(13))),
            refusal(lambda: pool.append(seq, np.arange(12, dtype=np.int32), *rows(12))),
            refusal(lambda: pool.append(freed, np.arange(2, dtype=np.int32), *rows(2))),
            refusal(lambda: pool.append(other.new_sequence(), np.arange(2, dtype=np.int32),
                                        *rows(2))),
            refusal(lambda: pool.append(seq, np.arange(2), *rows(2))),
            refusal(lambda: pool.append(seq, np.arange(2, dtype=np.int32), keys, values)),
            refusal(lambda: pool.reserve(seq, 1)),
            refusal(lambda: pool.commit(seq, np.arange(1, dtype=np.int32))),
            refusal(lambda: pool.truncate(seq, 3)),
            refusal(lambda: pool.gather(freed)),
            refusal(lambda: pool.swap_out(freed)),
            refusal(lambda: pool.swap_in(np.zeros(8, np.uint8))),
        ])
        pool.check()
        assert seq.length == 0
    for want, got in zip(*cases):
        assert got == want
    assert cases[0][0][0] is kvlab.CacheFullError and cases[0][1][0] is kvlab.OutOfBlocks


def test_what_only_a_gpu_pool_refuses_is_refused_as_the_cpu_refuses_a_window(fake_store):
    """keep() moves rows to other positions, which the GPU's forward pass cannot read: the
    GPU pool refuses it with the ValueError a CPU pool with a residual window gives."""
    fmt = CacheFormat.make(D, "fp32", window=4)
    windowed = kvlab.PagedPool(L, H, D, 6, 4, **fmt.core_arguments())
    _, gpu = pools(fake_store)
    for pool in (windowed, gpu):
        seq = pool.new_sequence()
        pool.append(seq, np.arange(3, dtype=np.int32), *rows(3))
        with pytest.raises(ValueError, match="keep"):
            pool.keep(seq, np.zeros((L, 1, H), np.int32))
        np.testing.assert_array_equal(pool.positions(seq)[:, :, 0], [[0, 1, 2]] * L)
    with pytest.raises(ValueError, match="window"):
        CudaPagedPool(L, H, D, 6, 4, **fmt.core_arguments(),
                      store=fake_store(L, H, D, 24, CacheFormat.make(D, "fp32")))


def test_cache_formats_are_read_back_by_their_names(fake_store):
    cpu, gpu = pools(fake_store, "bf16")
    for pool in (cpu, gpu):
        assert (pool.key_format, pool.value_format, pool.key_group) == ("bf16", "bf16", 0)
    cache = kvlab.cuda.CudaCache(L, H, D, 8, CacheFormat.make(D, "int8"),
                                 store=fake_store(L, H, D, 8, CacheFormat.make(D, "int8")))
    assert (cache.key_format, cache.value_format, cache.key_group) == ("int8", "int8", D)
    with pytest.warns(DeprecationWarning, match="key_format"):
        assert cache.key_dtype == "int8"
