"""No capacity check: the rows are written into the slice that is left, and NumPy's shape
error (too many rows for the slice) is passed on as CacheFullError. One row into a full layer
broadcasts into the empty slice: nothing is written, nothing is raised, and the length grows."""
TARGETS = ["test_kv_cache_refuses_what_does_not_fit_and_changes_nothing"]


class KVCache(KVCache):
    def append(self, layer, k, v):
        k = np.asarray(k, dtype=np.float32)
        v = np.asarray(v, dtype=np.float32)
        if k.ndim == 2:
            k, v = k[None], v[None]
        start, n = self.lengths[layer], len(k)
        try:
            self.k[layer, start:start + n] = k
            self.v[layer, start:start + n] = v
        except ValueError:
            raise CacheFullError(f"layer {layer}: {n} positions do not fit") from None
        self.lengths[layer] = start + n
