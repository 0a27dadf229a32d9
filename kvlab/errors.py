"""Every exception kvlab raises on purpose, in one place.

Each one subclasses a built-in (ValueError, RuntimeError ...) so that code written
against the built-ins still catches them, and KVLabError so that `except KVLabError`
catches them all. The C extension raises these same classes (it looks them up here at
import time), so a student sees one set of names whichever layer found the problem.
"""


class KVLabError(Exception):
    """Base class of kvlab's own exceptions."""


class ConfigError(KVLabError, ValueError):
    """A model configuration whose sizes do not fit together."""


class WeightsError(KVLabError, ValueError):
    """Weights whose names, shapes or dtypes do not match the configuration."""


class CheckpointError(KVLabError, ValueError):
    """A checkpoint file that is missing, truncated, corrupt or of an unknown format."""


class TokenizerError(KVLabError, ValueError):
    """A tokenizer file that cannot be read, or text/ids it cannot handle."""


class CacheFullError(KVLabError, ValueError):
    """Appending would go past the cache's capacity (max_seq_len)."""


class ContextLengthError(CacheFullError):
    """A request is too long for the model: prompt + max_new_tokens (or an uncached
    forward's tokens) exceed config.max_seq_len. The one "too long" error of generate,
    Engine.add_request and Model.forward; a CacheFullError (and so a ValueError) too, so
    code that caught either before still catches it."""


class OutOfBlocks(KVLabError, RuntimeError):
    """The paged pool has no free block left (nor a cached one to evict)."""


class OutOfSequences(KVLabError, RuntimeError):
    """Every sequence slot of the paged pool is taken (max_seqs)."""


class PoolInvariantError(KVLabError, RuntimeError):
    """pool.check() found a broken invariant: this is a bug in kvlab."""


class CudaError(KVLabError, RuntimeError):
    """The GPU backend cannot run here (no CUDA extension, driver or GPU: see
    kvlab.cuda.why_not()), or the CUDA runtime reported an error, named in the message."""


class FetchError(KVLabError, RuntimeError):
    """A named model could not be fetched (no network, pip refused, a hash that does not
    match the one kvlab pins): the message names the command to run by hand and how to
    pass a local file instead."""
