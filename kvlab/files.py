"""Reading checkpoint and tokenizer files safely: helpers the readers share (not a reader).

Three kinds: plausibility limits for the sizes a file chooses; opening and reading files
safely (regular files only, every read bounded by what the format allows); and
`MappedFile`, which notices when a memory-mapped checkpoint changes on disk after loading.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Dict, Optional, Tuple, Type

from .errors import CheckpointError, ConfigError, KVLabError

# Far above any model this kit will meet, far below sizes that would wrap an int32
# or make the size arithmetic meaningless. They exist to reject garbage headers early
# (llama2.c's seven header ints, GGUF's llama.* metadata, HF config.json).
LIMITS = {"dim": 65536, "hidden_dim": 1 << 20, "n_layers": 4096, "n_heads": 4096,
          "n_kv_heads": 4096, "vocab_size": 1 << 24, "max_seq_len": 1 << 24}

# config.json, a llama2.c sidecar, model.safetensors.index.json, tokenizer_config.json: a
# few kilobytes in real models (a 405B model's index is under 100 KB).
MAX_JSON_BYTES = 16 << 20

_KINDS = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


# ---- opening and reading ------------------------------------------------------------------
def open_regular(path: "str | os.PathLike[str]", what: str,
                 error: Type[KVLabError] = CheckpointError) -> BinaryIO:
    """`path` opened for binary reading, or `error` naming it when it is missing, unreadable
    or not a regular file. A named pipe would block the open (or the read) until some
    writer came, a device such as /dev/zero reads without end: both are refused before a
    byte is read. The open itself does not block (O_NONBLOCK), and the type is checked again
    on the opened descriptor, so a path swapped in between cannot slip through."""
    path = Path(path)
    try:
        _check_regular(path, os.stat(path).st_mode, what, error)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise error(f"{what} not found: {path} (no such file)") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise error(f"cannot open {what} {str(path)!r}: "
                    f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        _check_regular(path, os.fstat(fd).st_mode, what, error)
        if hasattr(os, "O_NONBLOCK"):  # reads of a regular file never wait anyway
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _check_regular(path: Path, mode: int, what: str, error: Type[KVLabError]) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
        raise error(f"{what} {path} is {kind}, not a regular file: kvlab reads models and "
                    "tokenizers from regular files only")


def read_bounded(f: BinaryIO, path: "str | os.PathLike[str]", limit: int, what: str,
                 error: Type[KVLabError] = CheckpointError) -> bytes:
    """The whole of an open regular file, refusing one larger than `limit` bytes (what its
    format allows) before reading it, and one that grows or shrinks while it is read."""
    size = os.fstat(f.fileno()).st_size
    if size > limit:
        raise error(f"{what} {path} is {size:,} bytes, more than the {limit:,} bytes such a "
                    "file can take; it is not what its name says")
    f.seek(0)
    data = f.read(size + 1)
    if len(data) != size:
        raise error(f"{what} {path} changed while it was being read "
                    f"({size:,} bytes expected, {len(data):,} read)")
    return data


def read_json_object(path: "str | os.PathLike[str]", what: str = "JSON file",
                     error: Type[KVLabError] = CheckpointError) -> Dict[str, Any]:
    """The JSON object in a file, or `error` saying why there is none."""
    with open_regular(path, what, error) as f:
        raw = read_bounded(f, path, MAX_JSON_BYTES, what, error)
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{what} {path} must hold a JSON object, found {type(value).__name__}")
    return value


# ---- values from JSON, checked by type ---------------------------------------------------------
def is_int(value: Any) -> bool:
    """An integer, not a bool (JSON's true would otherwise count as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def short(value: Any) -> str:
    """A value for an error message: a corrupt one can be a 10,000-item array or a string
    thousands of bytes long."""
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return f"a{'n array' if isinstance(value, list) else ' JSON object'} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_error_in(exc: ConfigError, source: str, names: Dict[str, str]) -> ConfigError:
    """A ModelConfig's ConfigError, told in terms of the file the values came from: its
    path and, where known, the file's own name for the field (ModelConfig names its field
    in exc.field)."""
    field = getattr(exc, "field", None)
    where = f" {names[field]!r}:" if field in names else ""
    error = ConfigError(f"{source}:{where} {exc}")
    error.field = field  # type: ignore[attr-defined]
    return error


# ---- memory-mapped checkpoints ------------------------------------------------------------------
Signature = Tuple[int, int, int, int]


def signature(st: os.stat_result) -> Signature:
    """What tells one version of a file from another without reading it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class MappedFile:
    """A checkpoint file that weights are memory-mapped from, as it was when mapped.

    A map reads the file itself, not a copy: if the file is truncated afterwards, touching
    the missing pages kills the process with SIGBUS; if it is rewritten in place, the
    weights change under the model. check() compares the mapped file's size and
    modification time with the ones it was mapped with and raises CheckpointError when they
    differ, before any weight is read. It asks the file itself, through a descriptor of its
    own (one os.fstat), not its path: a file deleted or renamed over after loading stays
    mapped, unchanged, and the model goes on with it; and a process that has since given up
    the right to open the path (the grading worker drops privileges) can still check."""

    def __init__(self, path: "str | os.PathLike[str]", f: Any) -> None:
        self.path = Path(os.path.abspath(path))  # for messages
        self._fd = os.dup(f.fileno())             # the mapped file, whatever its path becomes
        self.signature = signature(os.fstat(self._fd))

    def check(self) -> None:
        try:
            now: Optional[Signature] = signature(os.fstat(self._fd))
        except OSError:
            now = None
        if now != self.signature:
            raise CheckpointError(self._what_changed(now))

    def _what_changed(self, now: Optional[Signature]) -> str:
        if now is None:
            change = "can no longer be read"
        elif now[2] != self.signature[2]:
            change = f"changed size from {self.signature[2]:,} to {now[2]:,} bytes"
        else:
            change = "was rewritten (its modification time changed)"
        return (f"checkpoint {self.path} {change} after it was loaded; its weights are "
                "memory-mapped, so the model would read the new bytes (or crash on missing "
                "ones): load it again (kvlab.load(..., mmap=False) copies the weights instead)")

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __deepcopy__(self, memo: dict) -> "MappedFile":
        return self          # one descriptor per mapping: copies of weights share it

    def __repr__(self) -> str:
        return f"MappedFile({str(self.path)!r})"


# The attribute of a np.memmap that holds its MappedFile, found by walking an array's .base.
GUARD_ATTRIBUTE = "_kvlab_mapped_file"


def mapped_files(arrays: Any) -> Tuple[MappedFile, ...]:
    """The distinct MappedFiles that these arrays' memory comes from (walking each array's
    chain of .base objects to the memory map it views, if any)."""
    found: Dict[int, MappedFile] = {}
    for array in arrays:
        base = array
        while base is not None:
            guard = getattr(base, GUARD_ATTRIBUTE, None)
            if guard is not None:
                found.setdefault(id(guard), guard)
                break
            base = getattr(base, "base", None)
    return tuple(found.values())
