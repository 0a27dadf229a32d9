"""Writes the new positions one at a time and only notices the cache is full when it gets
there: the refused append has already written (and counted) the positions that fitted."""
EXPECTED_FAILURES = ["test_kv_cache_refuses_what_does_not_fit_and_changes_nothing"]


class KVCache(KVCache):           # the solution's cache, with this append instead
    def append(self, layer, k, v):
        k = np.asarray(k, dtype=np.float32)
        v = np.asarray(v, dtype=np.float32)
        if k.ndim == 2:
            k, v = k[None], v[None]
        for i in range(len(k)):
            position = self.lengths[layer]
            if position == self.max_len:
                raise CacheFullError(f"layer {layer} is full ({self.max_len} positions)")
            self.k[layer, position] = k[i]
            self.v[layer, position] = v[i]
            self.lengths[layer] += 1
