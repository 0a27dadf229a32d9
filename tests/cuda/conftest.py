"""Fixtures of the CUDA tests. `fake_store`: a NumPy stand-in for kvlab._cuda.KVStore, so that
the GPU caches' bookkeeping (which slots a call writes, copy-on-write, block tables, swapping)
can be tested on machines without a GPU: a GPU pool is the C core's pool with its rows in such
a store, and the core calls the stand-in's methods as it calls the real one's.

It keeps codes and scales in the device layout, (n_layers, n_kv_heads, slots, ...), and
quantizes with kvlab.quant, whose codes the GPU's (and the CPU core's) equal bit for bit.
"""
import numpy as np
import pytest

from kvlab import quant

CODE_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8}


class FakeStore:
    def __init__(self, n_layers, n_kv_heads, head_dim, slots, fmt):
        self.n_layers, self.n_kv_heads, self.head_dim, self.slots = n_layers, n_kv_heads, head_dim, slots
        self.fmt = fmt
        width = head_dim * np.dtype(CODE_DTYPES[fmt.key]).itemsize
        groups = head_dim // fmt.key_group if fmt.key == "int8" else 0
        self.codes = [np.zeros((n_layers, n_kv_heads, slots, width), np.uint8) for _ in range(2)]
        self.scales = [np.zeros((n_layers, n_kv_heads, slots, groups), np.float32) if groups else None
                       for _ in range(2)]
        self.writes = 0

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.codes + self.scales if a is not None)

    def write(self, slots, keys, values):
        assert slots.dtype == np.int64 and keys.dtype == values.dtype == np.float32
        assert ((slots >= -1) & (slots < self.slots)).all()
        for part, rows in enumerate((keys, values)):
            for t, slot in enumerate(slots):
                if slot < 0:
                    continue
                q = quant.quantize(rows[t], self.fmt.key, self.fmt.key_group or None)  # (L, H, hd)
                self.codes[part][:, :, slot] = np.ascontiguousarray(q.codes).view(np.uint8)
                if q.scales is not None:
                    self.scales[part][:, :, slot] = q.scales
        self.writes += 1

    def read(self, slots):
        assert len(slots) >= 1 and ((slots >= 0) & (slots < self.slots)).all()
        out = []
        for part in range(2):
            out.append(np.ascontiguousarray(self.codes[part][:, :, slots].transpose(0, 2, 1, 3)))
            scales = self.scales[part]
            out.append(None if scales is None else
                       np.ascontiguousarray(scales[:, :, slots].transpose(0, 2, 1, 3)))
        return tuple(out)

    def put(self, slots, key_codes, key_scales, value_codes, value_scales):
        """read() backwards: rows (n_layers, n, n_kv_heads, ...) stored as they are."""
        assert len(slots) >= 1 and ((slots >= 0) & (slots < self.slots)).all()
        for part, (codes, scales) in enumerate(((key_codes, key_scales), (value_codes, value_scales))):
            assert codes.dtype == np.uint8 and codes.shape[1] == len(slots)
            self.codes[part][:, :, slots] = codes.transpose(0, 2, 1, 3)
            assert (scales is None) == (self.scales[part] is None)
            if scales is not None:
                self.scales[part][:, :, slots] = scales.transpose(0, 2, 1, 3)

    def copy_rows(self, dst, src, n):
        assert 0 <= dst and dst + n <= self.slots and 0 <= src and src + n <= self.slots
        for arrays in (self.codes, self.scales):
            for a in arrays:
                if a is not None:
                    a[:, :, dst:dst + n] = a[:, :, src:src + n].copy()


@pytest.fixture
def fake_store():
    """The FakeStore class (a conftest's names cannot be imported by the tests)."""
    return FakeStore
