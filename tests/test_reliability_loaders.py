"""Fuzzing the loaders' files, paths and JSON values: every file kvlab reads is either read
as what it should be or refused with a kvlab error naming it, quickly and in bounded memory.

Two kinds of input, beside the byte mutations of tests/test_reliability.py:
  * paths that are not regular files (a named pipe, /dev/zero, /dev/urandom, a folder, a
    socket, each directly or through a symlink) in every place a loader opens a file: the
    checkpoint, a GGUF file, the tokenizer argument, a llama2.c sidecar and the tokenizer it
    names, the tokenizer found beside a .bin, an HF folder's config.json, safetensors file,
    shard index, shard named by the index, tokenizer.json and tokenizer_config.json.
    Before issue 18 a pipe hung the load for ever and a device was read without end;
  * any JSON value (null, booleans, huge or negative integers, NaN, infinities, 1e-300,
    strings, lists, objects) in every field a loader reads from config.json, a sidecar, a
    shard index or tokenizer_config.json, and whole files that are not JSON objects. What
    loads must run to finite logits (RoPE settings that made every logit NaN are refused);
    a value of the wrong type must be refused by a kvlab error that names the field
    (before, TypeError, KeyError, AttributeError or ZeroDivisionError escaped), and
    `kvlab info` must report it in one line.
CI replays fixed examples (see conftest.py); KVLAB_HYPOTHESIS_PROFILE=explore searches more.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import socket
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import cli
from kvlab.loaders import load_checkpoint, save_hf_llama, save_llama2c_v1
from kvlab.tokenizer import HFTokenizer
from time_limit import time_limit  # noqa: E402

LOAD_ERRORS = (kvlab.CheckpointError, kvlab.WeightsError, kvlab.ConfigError,
               kvlab.TokenizerError)
SMALL = kvlab.ModelConfig(dim=16, hidden_dim=24, n_layers=2, n_heads=2, n_kv_heads=1,
                          vocab_size=20, max_seq_len=8)
HF_SMALL = SMALL.replace(rope_interleaved=False)
try:
    import tokenizers  # noqa: F401
    HAS_TOKENIZERS = True
except ImportError:
    HAS_TOKENIZERS = False


@contextlib.contextmanager
def memory_cap(headroom: int = 2 << 30):
    """While the block runs, the process may map at most `headroom` more bytes: a loader that
    reads a device without end gets a MemoryError in a moment instead of taking the machine's
    memory. (Linux; elsewhere no cap.)"""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        cap = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, OSError, ValueError, StopIteration):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def guarded_load(load: Callable[[], Any]) -> Tuple[Any, Optional[BaseException]]:
    """(result, None) or (None, the kvlab error), within 10 s and 64 MB of Python
    allocations; anything else fails the test."""
    tracemalloc.start()
    try:
        with time_limit(10), memory_cap():
            return load(), None
    except LOAD_ERRORS as error:
        return None, error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 * 2**20, f"loading allocated {peak:,} bytes"


def runs_to_finite_logits(config: kvlab.ModelConfig, weights: kvlab.Weights) -> None:
    weights.check(config)
    logits = kvlab.Model(config, weights).forward([0, 1])
    assert logits.shape == (config.vocab_size,) and np.isfinite(logits).all(), config


# ---- paths that are not regular files ----------------------------------------------------------
@functools.lru_cache(maxsize=None)
def socket_path() -> str:
    """A Unix socket in a short temporary folder (socket paths are limited to ~100 bytes);
    tests link to it. Kept (with its folder) for the whole session."""
    folder = tempfile.mkdtemp(prefix="kvs")
    path = os.path.join(folder, "s")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    socket_path.sock = sock  # type: ignore[attr-defined]  (keep it open)
    return path


def make_special(path: Path, kind: str) -> Path:
    """Replace whatever is at `path` by a file that is not a regular file."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "fifo link":
        os.mkfifo(path.with_name(path.name + ".pipe"))
        path.symlink_to(path.name + ".pipe")
    elif kind == "folder":
        path.mkdir()
    elif kind == "socket":
        path.symlink_to(socket_path())
    else:
        path.symlink_to({"zero": "/dev/zero", "urandom": "/dev/urandom"}[kind])
    return path


KINDS = ["fifo", "fifo link", "zero", "urandom", "folder", "socket"]


def llama2c_site(folder: Path, site: str) -> Tuple[Callable[[], Any], Path]:
    """(a load, the path made special) for the llama2.c places."""
    model = folder / "m.bin"
    save_llama2c_v1(model, SMALL, kvlab.Weights.random(SMALL))
    if site == "checkpoint":
        return lambda: load_checkpoint(folder / "x.bin"), folder / "x.bin"
    if site == "gguf":
        return lambda: load_checkpoint(folder / "x.gguf"), folder / "x.gguf"
    if site == "tokenizer argument":
        return lambda: load_checkpoint(model, tokenizer_path=folder / "t.bin"), folder / "t.bin"
    if site == "tokenizer.json argument":
        return lambda: load_checkpoint(model, tokenizer_path=folder / "t.json"), folder / "t.json"
    if site == "sidecar":
        return lambda: load_checkpoint(model), folder / "m.json"
    if site == "sidecar tokenizer":
        (folder / "m.json").write_text(json.dumps({"tokenizer": "t.bin"}))
        return lambda: load_checkpoint(model), folder / "t.bin"
    if site == "nearby tokenizer":
        return lambda: load_checkpoint(model), folder / "tokenizer.bin"
    raise AssertionError(site)


def hf_site(folder: Path, site: str) -> Tuple[Callable[[], Any], Path]:
    """(a load, the path made special) for the Hugging Face places."""
    weights = kvlab.Weights.random(HF_SMALL)
    save_hf_llama(folder, HF_SMALL, weights)
    if site in ("index", "indexed shard"):
        names = json.loads((folder / "model.safetensors")
                           .read_bytes()[8:8 + int.from_bytes((folder / "model.safetensors")
                                                             .read_bytes()[:8], "little")])
        shard = "model.safetensors" if site == "index" else "other.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {name: shard for name in names if name != "__metadata__"}}))
        special = "model.safetensors.index.json" if site == "index" else shard
        return lambda: load_checkpoint(folder), folder / special
    if site in ("tokenizer.json", "tokenizer_config.json"):
        write_tokenizer(folder)
    return lambda: load_checkpoint(folder), folder / site


def write_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')


LLAMA2C_SITES = ["checkpoint", "gguf", "tokenizer argument", "tokenizer.json argument",
                 "sidecar", "sidecar tokenizer", "nearby tokenizer"]
HF_SITES = ["config.json", "model.safetensors", "index", "indexed shard", "tokenizer.json",
            "tokenizer_config.json"]
NEEDS_TOKENIZERS = {"tokenizer.json argument", "tokenizer.json", "tokenizer_config.json"}


@pytest.mark.skipif(not hasattr(os, "mkfifo") or sys.platform == "win32",
                    reason="needs named pipes, sockets and /dev")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("site", LLAMA2C_SITES + HF_SITES)
def test_paths_that_are_not_regular_files(tmp_path: Path, site: str, kind: str) -> None:
    if site in NEEDS_TOKENIZERS and not HAS_TOKENIZERS:
        pytest.skip("needs the tokenizers package")
    load, path = (llama2c_site if site in LLAMA2C_SITES else hf_site)(tmp_path, site)
    make_special(path, kind)
    result, error = guarded_load(load)
    assert error is not None, f"{site} as a {kind} loaded"
    # named, with what it is
    assert str(path) in str(error), str(error)
    what = {"folder": "folder", "socket": "socket", "zero": "character device",
            "urandom": "character device"}.get(kind, "named pipe")
    assert what in str(error), str(error)


# ---- JSON values of every type ---------------------------------------------------------------------
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.sampled_from([0, 1, -1, 2, 4, 8, 16, 24, 2**24, 2**30, 2**31, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1e-300, 1e-50, 1e-40, 5e-324, 1e39, 1e300, 8.0, 4.0]),
    st.text(max_size=8), st.sampled_from(["", "8", "1e-5", "llama", "llama3", "silu", "bytes"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_bool_or_null(v: Any) -> bool:
    return v is None or isinstance(v, bool)


def is_dict_or_null(v: Any) -> bool:
    return v is None or isinstance(v, dict)


# config.json key (a dotted one lives in rope_scaling) -> what type it may have. A value of
# any other type must be refused by an error that names the key.
HF_FIELDS: Dict[str, Callable[[Any], bool]] = {
    "model_type": lambda v: isinstance(v, str),
    "hidden_size": is_int, "intermediate_size": is_int, "num_hidden_layers": is_int,
    "num_attention_heads": is_int, "vocab_size": is_int, "max_position_embeddings": is_int,
    "num_key_value_heads": lambda v: v is None or is_int(v),
    "head_dim": lambda v: v is None or is_int(v),
    "sliding_window": lambda v: v is None or is_int(v),
    "rms_norm_eps": is_number, "rope_theta": is_number, "partial_rotary_factor": is_number,
    "tie_word_embeddings": is_bool_or_null, "attention_bias": is_bool_or_null,
    "mlp_bias": is_bool_or_null, "hidden_act": lambda v: isinstance(v, str),
    "rope_scaling": is_dict_or_null, "rope_parameters": is_dict_or_null,
    "rope_scaling.rope_type": lambda v: isinstance(v, str),
    "rope_scaling.factor": is_number,
    "rope_scaling.low_freq_factor": lambda v: v is None or is_number(v),
    "rope_scaling.high_freq_factor": lambda v: v is None or is_number(v),
    "rope_scaling.original_max_position_embeddings": lambda v: v is None or is_number(v),
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 4}


@functools.lru_cache(maxsize=None)
def small_hf() -> Tuple[Dict[str, Any], bytes]:
    """A good config.json (with Llama 3 rope scaling) and its model.safetensors."""
    with tempfile.TemporaryDirectory() as folder:
        save_hf_llama(folder, HF_SMALL, kvlab.Weights.random(HF_SMALL))
        hf = json.loads((Path(folder) / "config.json").read_text())
        return {**hf, "rope_scaling": LLAMA3}, (Path(folder) / "model.safetensors").read_bytes()


def names_the_field(error: BaseException, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    return repr(leaf) in str(error) or bool(parent) and repr(parent) in str(error)


def info_in_one_line(folder: Path) -> None:
    """`kvlab info` on the folder: the model, or one line of error and exit status 2."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["info", "--model", str(folder)])
    assert status in (0, 2) and "Traceback" not in err.getvalue()
    if status == 2:
        assert err.getvalue().count("\n") == 1 and out.getvalue() == "", err.getvalue()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(HF_FIELDS)), value=JSON_VALUES)
def test_config_json_fields_of_any_type(tmp_path_factory, key: str, value: Any) -> None:
    hf, tensors = small_hf()
    hf = json.loads(json.dumps(hf))
    if key.startswith("rope_scaling."):
        hf["rope_scaling"][key.split(".", 1)[1]] = value
    else:
        hf[key] = value
    folder = tmp_path_factory.mktemp("hf")
    (folder / "config.json").write_text(json.dumps(hf))
    (folder / "model.safetensors").write_bytes(tensors)
    result, error = guarded_load(lambda: load_checkpoint(folder))
    if error is None:
        runs_to_finite_logits(*result[:2])
        assert HF_FIELDS[key](value), f"{key}={value!r} was accepted"
    elif not HF_FIELDS[key](value):
        assert names_the_field(error, key), f"{key}={value!r}: {error}"
    if error is not None:
        assert str(folder) in str(error), str(error)   # config.json, or a safetensors file
    info_in_one_line(folder)


SIDECAR_FIELDS: Dict[str, Callable[[Any], bool]] = {
    "norm_eps": is_number, "rope_theta": is_number,
    "rope_interleaved": lambda v: isinstance(v, bool), "name": lambda v: isinstance(v, str),
    "tokenizer": lambda v: isinstance(v, str) and v != "",
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(SIDECAR_FIELDS)), value=JSON_VALUES)
def test_sidecar_fields_of_any_type(tmp_path_factory, key: str, value: Any) -> None:
    folder = tmp_path_factory.mktemp("sidecar")
    save_llama2c_v1(folder / "m.bin", SMALL, kvlab.Weights.random(SMALL))
    (folder / "m.json").write_text(json.dumps({key: value}))
    result, error = guarded_load(lambda: load_checkpoint(folder / "m.bin"))
    if error is None:
        runs_to_finite_logits(*result[:2])
        assert SIDECAR_FIELDS[key](value), f"{key}={value!r} was accepted"
    elif not SIDECAR_FIELDS[key](value):
        assert repr(key) in str(error) and "m.json" in str(error), f"{key}={value!r}: {error}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(["config.json", "sidecar", "index", "index entry", "weight_map"]),
       value=JSON_VALUES)
def test_json_files_of_any_shape(tmp_path_factory, which: str, value: Any) -> None:
    """Whole files (or the shard index's weight_map) that are any JSON value."""
    folder = tmp_path_factory.mktemp("json")
    if which == "sidecar":
        save_llama2c_v1(folder / "m.bin", SMALL, kvlab.Weights.random(SMALL))
        (folder / "m.json").write_text(json.dumps(value))
        target, path = folder / "m.bin", folder / "m.json"
    else:
        hf, tensors = small_hf()
        (folder / "config.json").write_text(json.dumps(value if which == "config.json" else hf))
        (folder / "model.safetensors").write_bytes(tensors)
        index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
        if which == "index":
            index = value
        elif which == "index entry":
            index["weight_map"]["model.norm.weight"] = value
        elif which == "weight_map":
            index["weight_map"] = value
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        target = folder
        path = folder / ("config.json" if which == "config.json"
                         else "model.safetensors.index.json")
    result, error = guarded_load(lambda: load_checkpoint(target))
    if error is None:
        runs_to_finite_logits(*result[:2])
    else:
        assert str(path) in str(error) or "lacks tensor" in str(error), str(error)


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="needs the tokenizers package")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["bos_token", "eos_token", None]), value=JSON_VALUES)
def test_tokenizer_config_fields_of_any_type(tmp_path_factory, key: Optional[str],
                                            value: Any) -> None:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(value if key is None
                                                             else {key: value}))
    result, error = guarded_load(lambda: HFTokenizer(folder / "tokenizer.json"))
    if error is None:
        return
    assert isinstance(error, kvlab.TokenizerError) and "tokenizer_config.json" in str(error)
    if key is not None:
        assert repr(key) in str(error), str(error)
