"""Recomputes the whole sequence every step on a copy of the lent model (made with its own
key/value weights), whose calls no log shows, and runs on the lent model only what a cached
step would (one embedding, one row of q, k and v a layer); its cache is stored, never read.
(A reviewer's attack: the own-cache lab's model no longer offers the GQA lab's conversion.)"""
TARGETS = ["test_prefill_then_decode_matches_the_uncached_run",
           "test_greedy_tokens_are_the_same_with_and_without_the_cache",
           "test_step_times_are_measured"]


_clones = {}


def _clone(model):
    key = id(model)
    if key not in _clones:
        n = model.config.n_layers
        pairs = [model.key_value_weights(l) for l in range(n)]
        _clones[key] = (model, model.with_key_value_weights([p[0] for p in pairs],
                                                             [p[1] for p in pairs]))
    return _clones[key][1]


class KVCache:
    """Keeps the tokens (to recompute from) and, for show, the K/V the dummy calls give."""
    def __init__(self, n_layers):
        self.tokens = []
        self.k = [None] * n_layers
        self.v = [None] * n_layers

    def append(self, layer, k, v):
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k.copy(), v.copy()
        else:
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])

    def keys(self, layer):
        return self.k[layer]

    def values(self, layer):
        return self.v[layer]

    @property
    def length(self):
        last = self.k[-1]
        return 0 if last is None else len(last)

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.k + self.v if a is not None)


def _full(model, tokens):
    """uncached forward, returning each layer's input rows too"""
    x = model.embed(tokens)
    positions = np.arange(len(tokens))
    inputs = []
    for layer in range(model.config.n_layers):
        inputs.append(x)
        q, k, v = model.qkv(layer, x, positions)
        x = model.attention_output(layer, x, attention(q, k, v, positions))
        x = model.mlp(layer, x)
    return inputs, x


def forward(model, tokens, cache=None):
    tokens = [int(t) for t in tokens]
    if cache is None:
        return _full(model, tokens)[1] if False else model.logits(_full(model, tokens)[1])
    everything = cache.tokens + tokens
    n, start = len(tokens), len(cache.tokens)
    inputs, x = _full(_clone(model), everything)      # ALL the work, on the clone, unlogged
    positions = np.arange(start, start + n)
    model.embed(tokens)                               # what the log expects of a cached step
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, inputs[layer][-n:], positions)
        cache.append(layer, k, v)                     # stored, never read
    cache.tokens = everything
    return model.logits(x[-n:])


def step_seconds(model, prompt, n_new, use_cache):
    tokens, seconds = list(prompt), []
    cache = KVCache(model.config.n_layers) if use_cache else None
    clone = _clone(model)
    for i in range(n_new):
        if cache is None:
            started = time.perf_counter()
            logits = forward(model, tokens)[-1]
            seconds.append(time.perf_counter() - started)
        else:
            new = tokens if i == 0 else tokens[-1:]
            everything = cache.tokens + new
            n, start = len(new), len(cache.tokens)
            inputs, x = _full(clone, everything)      # untimed, unlogged recompute
            started = time.perf_counter()             # time only the lent model's calls
            model.embed(new)
            for layer in range(model.config.n_layers):
                q, k, v = model.qkv(layer, inputs[layer][-n:], np.arange(start, start + n))
                cache.append(layer, k, v)
            cache.tokens = everything
            logits = model.logits(x[-n:])[-1]
            seconds.append(time.perf_counter() - started)
        tokens.append(int(np.argmax(logits)))
    return seconds
