"""What the own-cache, cache-size and GQA labs lend the student's code, served from the judge.

These objects never leave the judge's process. A test makes one and passes it to the
student's function; the worker gets a proxy (kvlab/grading/remote.py, ServedObject) whose
method calls and attribute reads come back here and run here. So what a lent object keeps
for the grader (the cache-size lab's secret block size, the own-cache lab's log of calls)
is out of the student's reach, and kvlab itself is never loaded in a worker.

- LabModel: the bundled model as the cache-size lab lends it. Each cache it fills takes an
  extra block of memory of a size the test draws at grading time, so only resident memory
  measured around real, filled caches gives the right answer, and the model knows exactly
  which caches were filled, which bounds any measurement from above.
- ReferenceModel: the NumPy reference's building blocks of a forward pass (everything but
  attention and the cache, which the student writes), with a log of every call.
- LentFunctions: the few kvlab functions a lab lets a submission import
  (`kvlab.measure.resident_bytes`, `kvlab.accuracy.perplexity`, ...). The worker's stand-in
  modules forward each call here: resident memory is that of this process, where the lent
  model and its caches live.

A student can build the same objects to try their code outside the grader
(`kvlab.grading.handouts.ReferenceModel(checkpoint="mha")`); they then run in the student's
own process, and `kvlab.measure` measures that one.
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import time
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

import kvlab
from kvlab import arguments, measure, next_token_metrics, reference
from kvlab.model import as_token_array
from kvlab.config import ModelConfig
from kvlab.weights import Weights

from .remote import ServedObject
from .wire import Record

PAGE = mmap.PAGESIZE
MAX_CACHES = 64           # caches one lent model makes (each holds at most the context)
MAX_CONVERSIONS = 32      # models one ReferenceModel makes with new K/V weights (GQA lab: a few)
MAX_CALLS = 100_000       # calls one ReferenceModel logs (a test makes a few thousand)
MAX_TEXT = 1 << 16        # characters a lent model encodes at once (a prompt; 64 MB of text,
                          # a frame's worth, made the judge build 64 million ints)


def text_to_encode(text) -> str:
    """What a lent model's encode takes: a str of at most MAX_TEXT characters."""
    if not isinstance(text, str):
        raise TypeError("encode takes a str")
    if len(text) > MAX_TEXT:
        raise ValueError(f"encode takes at most {MAX_TEXT:,} characters at once, got {len(text):,}")
    return text


def config_fields(config) -> dict:
    """A model's shape as plain numbers (what the labs' functions receive)."""
    return {"dim": config.dim, "hidden_dim": config.hidden_dim, "n_layers": config.n_layers,
            "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "kv_dim": config.kv_dim,
            "vocab_size": config.vocab_size, "max_seq_len": config.max_seq_len,
            "n_params": config.n_params()}


def _token_ids(tokens, vocab_size: int, context: int) -> np.ndarray:
    """Token ids as forward takes them (kvlab.model.as_token_array), and at most `context`
    of them: what a call can ask the judge to compute is bounded by the model's context."""
    ids = as_token_array(tokens, vocab_size)
    if len(ids) > context:
        raise ValueError(f"{len(ids)} token ids are more than the model's context, {context}")
    return ids


# ---- the cache-size lab ------------------------------------------------------------------

class LabCache(ServedObject):
    """A cache the lab's model made: a real kvlab KV cache and the extra block."""
    served_attributes = ("length", "capacity")
    served_type_name = "KVCache"

    def __init__(self, maker: object, cache, extra_bytes: int):
        # the model's token, not the model: no cycle, so a cache's memory goes the moment
        # its model does, not at some later garbage collection inside another measurement
        self._maker, self._cache, self._extra_bytes = maker, cache, extra_bytes
        self._extra = None
        self.filled = False

    @property
    def length(self) -> int:
        return self._cache.length

    @property
    def capacity(self) -> int:
        return self._cache.capacity

    @property
    def held_bytes(self) -> int:
        """What this cache holds in memory once filled: its K and V, and the extra block."""
        return self._cache.nbytes + (self._extra_bytes if self.filled else 0)

    def _fill_extra(self) -> None:
        if not self.filled:
            if self._extra_bytes:
                self._extra = mmap.mmap(-1, self._extra_bytes)
                np.frombuffer(self._extra, dtype=np.uint8)[::PAGE] = 1   # one write a page
            self.filled = True


class LabModel(ServedObject):
    """The bundled model, lent to a submission: config (plain numbers), new_cache, prefill,
    forward and encode. extra_bytes: the block each cache takes when first filled."""
    served_methods = ("new_cache", "prefill", "forward", "encode")
    served_attributes = ("config",)
    served_type_name = "Model"

    def __init__(self, extra_bytes: int = 0):
        if isinstance(extra_bytes, bool) or not isinstance(extra_bytes, int) or extra_bytes < 0:
            raise ValueError("extra_bytes must be a non-negative int")
        self._model = bundled_model()
        self._extra_bytes = -(-extra_bytes // PAGE) * PAGE
        self.config = Record("ModelConfig", config_fields(self._model.config))
        self.caches: List[LabCache] = []
        self._token = object()

    def new_cache(self, max_seq_len, dtype: str = "fp32") -> LabCache:
        context = self._model.config.max_seq_len
        max_seq_len = arguments.integer(max_seq_len, "max_seq_len", 1, context)
        if dtype not in ("fp32", "fp16", "int8"):
            raise ValueError(f"dtype must be 'fp32', 'fp16' or 'int8', got {dtype!r}")
        if len(self.caches) >= MAX_CACHES:
            raise ValueError(f"this model has made {MAX_CACHES} caches already")
        cache = LabCache(self._token, self._model.new_cache(max_seq_len, dtype), self._extra_bytes)
        self.caches.append(cache)
        return cache

    def prefill(self, tokens, cache):
        """Run `tokens` into `cache` (made by this model); the last row of logits."""
        if not isinstance(cache, LabCache) or cache._maker is not self._token:
            raise TypeError("prefill(tokens, cache) needs a cache made by this model's new_cache")
        c = self._model.config
        logits = self._model.prefill(_token_ids(tokens, c.vocab_size, c.max_seq_len), cache._cache)
        cache._fill_extra()
        return logits

    def forward(self, tokens, cache=None):
        if cache is not None:
            return self.prefill(tokens, cache)
        c = self._model.config
        return self._model.forward(_token_ids(tokens, c.vocab_size, c.max_seq_len))

    def encode(self, text) -> list:
        return [int(t) for t in self._model.encode(text_to_encode(text))]

    def filled_bytes(self) -> int:
        """What the caches this model has filled hold, extra blocks included (the judge
        keeps every cache alive until the test ends, so this is also the most they held)."""
        return sum(c.held_bytes for c in self.caches if c.filled)


# ---- the own-cache and GQA labs ----------------------------------------------------------

class Call(NamedTuple):
    """One call the student's code made to a ReferenceModel, as the judge saw it."""
    name: str             # embed, qkv, attention_output, mlp or logits
    layer: Optional[int]  # the layer, for qkv, attention_output and mlp
    rows: int             # how many token rows it ran
    started: float        # time.perf_counter() when it began and ended (the same clock in
    ended: float          # every process of the machine)


CHECKPOINTS = ("default", "mha", "default_as_mha")


class ReferenceModel(ServedObject):
    """A model's weights behind the NumPy reference's building blocks: everything a forward
    pass needs except attention and the KV cache, which the student writes (the own-cache
    and GQA labs). Arrays in and out are float32. The weights are:
      - shape (ModelConfig's fields) given: random weights of that shape drawn from `seed`;
      - else checkpoint "default": the bundled model (GQA, 8 query heads on 2 KV heads);
        "mha": the bundled MHA model (kvlab.MHA_MODEL, 8 KV heads, trained alike);
        "default_as_mha": the bundled model with each KV head repeated for its 4 query heads,
        an MHA model whose grouped heads are equal (mean-pooling it back loses nothing).

    The GQA lab converts a model (convertible=True): key_value_weights(layer) gives a layer's
    wk and wv, and with_key_value_weights(keys, values) a model with fewer KV heads, all
    else shared. Other labs' models offer neither: a copy of the model would be a second
    model whose calls the lab's log never sees.

    `log` holds a Call for every embed, qkv, attention_output, mlp and logits: how many
    rows each step really ran through the model, and when (a cached decode step embeds one
    token and computes one row of q, k and v a layer). Models made from this one write into
    the same log."""
    LAYERS = ("embed", "qkv", "attention_output", "mlp", "logits", "encode")
    CONVERSION = ("key_value_weights", "with_key_value_weights")
    served_attributes = ("config",)
    served_type_name = "Model"

    def __init__(self, shape: Optional[dict] = None, seed: int = 0, checkpoint: str = "default",
                 convertible: bool = False):
        if shape is not None:
            config = ModelConfig(**shape)
            weights = Weights.random(config, seed=seed)
        elif checkpoint == "mha":
            model = mha_model()
            config, weights = model.config, model.weights
        elif checkpoint in ("default", "default_as_mha"):
            model = bundled_model()
            config, weights = model.config, model.weights
            if checkpoint == "default_as_mha":
                config, weights = _repeat_kv_heads(config, weights)
        else:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
        self.served_methods = self.LAYERS + (self.CONVERSION if convertible else ())
        self._set_weights(config, weights, log=[], conversions=[0])

    def _set_weights(self, config, weights, log: list, conversions: list) -> None:
        self._c, self._w = config, weights
        self._inv_freq = config.rope_inv_freq()
        self.log: List[Call] = log
        self._conversions = conversions           # shared with the models made from this one
        self.config = Record("ModelConfig", config_fields(config))

    def _logged(self, name: str, layer: Optional[int], rows: int, started: float) -> None:
        if len(self.log) >= MAX_CALLS:
            raise ValueError(f"this model has been called {MAX_CALLS:,} times, far more than "
                             f"the test needs")
        self.log.append(Call(name, layer, rows, started, time.perf_counter()))

    def _layer(self, layer) -> int:
        return arguments.integer(layer, "layer", 0, self._c.n_layers - 1)

    def _rows(self, x, what: str, width: int) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != width or not 0 < x.shape[0] <= self._c.max_seq_len \
                or x.dtype.kind not in "fiu":
            raise ValueError(f"{what} must be a numeric array of shape (n, {width}), n from 1 "
                             f"to the context, {self._c.max_seq_len}; got {x.dtype} {x.shape}")
        return x.astype(np.float32)

    def key_value_weights(self, layer) -> Tuple[np.ndarray, np.ndarray]:
        """(wk, wv) of a layer, copies, each (n_kv_heads * head_dim, dim): rows
        h * head_dim .. (h + 1) * head_dim - 1 make KV head h."""
        layer = self._layer(layer)
        return self._w.wk[layer].copy(), self._w.wv[layer].copy()

    def with_key_value_weights(self, keys, values) -> "ReferenceModel":
        """A model with these wk and wv (one (n_kv_heads * head_dim, dim) array per layer
        in each list) and this model's other weights: n_kv_heads follows from their rows."""
        c = self._c
        if self._conversions[0] >= MAX_CONVERSIONS:
            raise ValueError(f"this model has made {MAX_CONVERSIONS} converted models already, "
                             f"more than the lab needs")
        stacked = []
        for name, arrays in (("keys", keys), ("values", values)):
            if not isinstance(arrays, (list, tuple)) or len(arrays) != c.n_layers:
                raise ValueError(f"{name} must be a list of {c.n_layers} arrays, one per layer")
            arrays = [np.asarray(a) for a in arrays]
            rows = arrays[0].shape[0] if arrays[0].ndim == 2 else -1
            for layer, a in enumerate(arrays):
                if a.ndim != 2 or a.shape != (rows, c.dim) or a.dtype.kind != "f":
                    raise ValueError(f"{name}[{layer}] must be a float array of shape (n_kv_heads * "
                                     f"{c.head_dim}, {c.dim}) like every layer's; got {a.dtype} {a.shape}")
                if not np.isfinite(a).all():
                    raise ValueError(f"{name}[{layer}] holds inf or nan")
            if rows <= 0 or rows % c.head_dim or c.n_heads % (rows // c.head_dim):
                raise ValueError(f"{name} have {rows} rows: n_kv_heads * {c.head_dim} rows are needed, "
                                 f"with n_kv_heads dividing the {c.n_heads} query heads")
            stacked.append(np.stack(arrays).astype(np.float32))
        if stacked[0].shape != stacked[1].shape:
            raise ValueError(f"keys and values give different head counts: {stacked[0].shape[1]} "
                             f"and {stacked[1].shape[1]} rows")
        config = c.replace(n_kv_heads=stacked[0].shape[1] // c.head_dim)
        weights = dataclasses.replace(self._w, wk=stacked[0], wv=stacked[1])
        weights.check(config)
        self._conversions[0] += 1
        converted = ReferenceModel.__new__(ReferenceModel)
        converted.served_methods = self.served_methods
        converted._set_weights(config, weights, self.log, self._conversions)
        return converted

    def encode(self, text) -> list:
        """The bundled models' tokens: the text's UTF-8 bytes."""
        return list(text_to_encode(text).encode("utf-8"))

    def embed(self, tokens) -> np.ndarray:
        """(n, dim): the token embeddings."""
        started = time.perf_counter()
        ids = _token_ids(tokens, self._c.vocab_size, self._c.max_seq_len)
        out = self._w.token_embedding[ids].astype(np.float32)
        self._logged("embed", None, len(ids), started)
        return out

    def qkv(self, layer, x, positions) -> tuple:
        """q (n, n_heads, head_dim), k and v (n, n_kv_heads, head_dim) of the residual
        stream x (n, dim) at `positions` (n,): RMSNorm, the projections, RoPE on q and k."""
        started = time.perf_counter()
        c, w, layer = self._c, self._w, self._layer(layer)
        x = self._rows(x, "x", c.dim)
        n = len(x)
        positions = np.asarray(positions)
        if positions.shape != (n,) or positions.dtype.kind not in "iu" or positions.min() < 0:
            raise ValueError(f"positions must be {n} non-negative ints, one per row of x")
        h = reference.rmsnorm(x, w.attn_norm[layer], c.norm_eps)
        q = (h @ w.wq[layer].T).reshape(n, c.n_heads, c.head_dim)
        k = (h @ w.wk[layer].T).reshape(n, c.n_kv_heads, c.head_dim)
        v = (h @ w.wv[layer].T).reshape(n, c.n_kv_heads, c.head_dim)
        out = (reference.rope(q, positions, self._inv_freq, c.rope_interleaved),
               reference.rope(k, positions, self._inv_freq, c.rope_interleaved), v)
        self._logged("qkv", layer, n, started)
        return out

    def attention_output(self, layer, x, out) -> np.ndarray:
        """x + attention's output (n, n_heads, head_dim) projected back to (n, dim)."""
        started = time.perf_counter()
        c, layer = self._c, self._layer(layer)
        x = self._rows(x, "x", c.dim)
        out = np.asarray(out)
        if out.shape != (len(x), c.n_heads, c.head_dim) or out.dtype.kind not in "fiu":
            raise ValueError(f"out must be attention's output, shape ({len(x)}, {c.n_heads}, "
                             f"{c.head_dim}), got {out.dtype} {out.shape}")
        result = x + out.astype(np.float32).reshape(len(x), -1) @ self._w.wo[layer].T
        self._logged("attention_output", layer, len(x), started)
        return result

    def mlp(self, layer, x) -> np.ndarray:
        """x + the SwiGLU MLP of RMSNorm(x)."""
        started = time.perf_counter()
        w, layer = self._w, self._layer(layer)
        x = self._rows(x, "x", self._c.dim)
        h = reference.rmsnorm(x, w.ffn_norm[layer], self._c.norm_eps)
        result = x + (reference.silu(h @ w.w1[layer].T) * (h @ w.w3[layer].T)) @ w.w2[layer].T
        self._logged("mlp", layer, len(x), started)
        return result

    def logits(self, x) -> np.ndarray:
        """(n, vocab_size): the final RMSNorm and the classifier."""
        started = time.perf_counter()
        x = self._rows(x, "x", self._c.dim)
        h = reference.rmsnorm(x, self._w.final_norm, self._c.norm_eps)
        out = h @ self._w.classifier.T
        self._logged("logits", None, len(out), started)
        return out


def _repeat_kv_heads(config, weights):
    """The same model as MHA: each KV head's rows of wk and wv repeated for every query
    head that reads it, so query head h has KV head h and the logits do not change."""
    def repeated(w):           # (n_layers, n_kv_heads * head_dim, dim) -> n_heads heads
        n_layers, _, dim = w.shape
        heads = w.reshape(n_layers, config.n_kv_heads, config.head_dim, dim)
        return np.repeat(heads, config.kv_mul, axis=1).reshape(n_layers, -1, dim)
    mha = config.replace(n_kv_heads=config.n_heads)
    return mha, dataclasses.replace(weights, wk=repeated(weights.wk), wv=repeated(weights.wv))


@functools.lru_cache(maxsize=None)
def bundled_model():
    """The bundled model, loaded once in this process."""
    return kvlab.load()


@functools.lru_cache(maxsize=None)
def mha_model():
    """The bundled MHA model (kvlab.MHA_MODEL), loaded once in this process."""
    return kvlab.load(kvlab.MHA_MODEL)


# ---- kvlab functions a lab lends ---------------------------------------------------------

# What a lab may lend a submission from kvlab, by the name the submission imports it as
# (Lab.kvlab in labs.py); the worker's stand-in for each forwards its calls here.
LENDABLE = {"kvlab.measure.resident_bytes": measure.resident_bytes,
            "kvlab.measure.release_freed_memory": measure.release_freed_memory,
            "kvlab.accuracy.perplexity": next_token_metrics.perplexity,
            "kvlab.accuracy.kl_divergence": next_token_metrics.kl_divergence}


def lent_name(dotted: str) -> str:
    """The method name a lent function is served under: its own name."""
    return dotted.rpartition(".")[2]


class LentFunctions(ServedObject):
    """The kvlab functions one lab lends, run in the judge for the worker's stand-ins."""
    served_type_name = "kvlab"

    def __init__(self, dotted_names):
        unknown = [name for name in dotted_names if name not in LENDABLE]
        if unknown:
            raise LookupError(f"the grader cannot lend {unknown}")
        self.functions = {lent_name(name): LENDABLE[name] for name in dotted_names}
        self.served_methods = tuple(self.functions)

    def __getattr__(self, name):
        functions = self.__dict__.get("functions", {})
        if name not in functions:
            raise AttributeError(name)
        return functions[name]
