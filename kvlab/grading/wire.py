"""The values that pass between the judge and the worker, and the frames that carry them.

The worker runs a student's code, so everything it sends is untrusted input to the judge.
That rules out pickle (unpickling runs whatever code the bytes name). Values travel as
JSON in which every JSON object is a tagged container this module made:

    None, bool, int, float, str      themselves (floats may be NaN or infinite)
    list                             a JSON array
    {"$tuple": [...]}, {"$set": [...]}, {"$frozenset": [...]}
    {"$dict": [[key, value], ...]}   any keys this module can encode, in order
    {"$bytes": "base64"}
    {"$array": [dtype, shape, "base64"]}   numeric NumPy arrays only (no object dtype)
    {"$scalar": [dtype, "base64"]}         a NumPy number, kept as one (np.int64, ...)
    {"$record": [type name, {field: value}]}   a plain record, read back as a SimpleNamespace
    {"$handle": [id, type name]}     an object that stays in the worker (see Handle)
    {"$served": [id, type name, [methods], [attributes]]}   an object that stays in the
                                     judge, lent to the student's code by reference (Served)

Decoding checks every tag, dtype, shape and size, and refuses anything else with
WireError: a hostile worker can make a call fail, never make the judge run its code.
A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON.

This file imports only the standard library and NumPy, and nothing relative: the worker
loads it by path before it may import anything else.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import struct
import types
from typing import Any

import numpy as np

MAX_FRAME = 64 << 20         # bytes in one message, either way
MAX_DEPTH = 64               # containers inside containers
MAX_NODES = 1_000_000        # JSON values in one message (each is a Python object once read)
MAX_KEYS = 10_000            # set members and dict keys in one message (each is hashed, and
                             # ints that collide make hashing quadratic)

_SCALARS = frozenset({type(None), bool, int, float, str})   # values that are themselves
_DTYPE = re.compile(r"^[<>|=][biufc](1|2|4|8|16)$")
_HEADER = struct.Struct(">I")


class WireError(ValueError):
    """A message that is not a value this module could have written."""


class NotEncodable(TypeError):
    """A value with no by-value form (the worker then keeps it and sends a handle)."""


@dataclasses.dataclass(frozen=True)
class Handle:
    """An object that lives in the worker: its id there, and its type's name."""
    id: int
    type_name: str


@dataclasses.dataclass(frozen=True)
class Served:
    """An object that lives in the judge and is lent to the worker by reference: its id
    there, its type's name, and the methods the student's code may call on it and the
    attributes it may read (each call or read is a request back to the judge)."""
    id: int
    type_name: str
    methods: tuple = ()
    attributes: tuple = ()


# The id of the kvlab functions a lab lends (kvlab.measure.resident_bytes, ...), served by
# the judge to every worker of that lab: the worker's stand-in modules call them by it.
LENT_FUNCTIONS_ID = 0

MAX_SERVED_NAMES = 64        # methods and attributes of one served object


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A value to_json has already turned into its tree (the sender encodes each value once)."""
    tree: Any


@dataclasses.dataclass(frozen=True)
class Record:
    """A plain record to send by value (the receiver reads it as a SimpleNamespace); its
    fields read as attributes here too (record.n_layers)."""
    type_name: str
    fields: dict

    def __getattr__(self, name):
        fields = self.__dict__.get("fields")
        if type(fields) is dict and name in fields:
            return fields[name]
        raise AttributeError(f"{self.__dict__.get('type_name', 'record')} has no field {name!r}")


# ---- values to JSON and back -----------------------------------------------------------

def _array_tag(value: np.ndarray) -> dict:
    if not _DTYPE.match(value.dtype.str):
        raise NotEncodable(f"a NumPy array of dtype {value.dtype} (only numbers and bools)")
    data = np.ascontiguousarray(value).tobytes()
    return {"$array": [value.dtype.str, list(value.shape), base64.b64encode(data).decode()]}


def to_json(value: Any, depth: int = 0) -> Any:
    """The tagged JSON tree of `value`; NotEncodable for what has no by-value form.
    Types are matched exactly, so a subclass with its own __iter__ or __eq__ is never
    mistaken for a plain container."""
    if depth > MAX_DEPTH:
        raise NotEncodable(f"containers nested more than {MAX_DEPTH} deep")
    kind = type(value)
    if value is None or kind in (bool, int, str, float):
        return value
    if kind is Encoded:
        return value.tree
    if kind is list:
        if all(type(item) in _SCALARS for item in value):    # a list of token ids, say:
            return value                                     # already JSON, as it is
        return [to_json(item, depth + 1) for item in value]
    if kind in (tuple, set, frozenset):
        return {"$" + kind.__name__: [to_json(item, depth + 1) for item in value]}
    if kind is dict:
        return {"$dict": [[to_json(k, depth + 1), to_json(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"$bytes": base64.b64encode(value).decode()}
    if kind is np.ndarray:
        return _array_tag(value)
    if isinstance(value, np.generic) and kind.__module__ == "numpy":
        tag = _array_tag(np.asarray(value))["$array"]
        return {"$scalar": [tag[0], tag[2]]}
    if kind is types.SimpleNamespace:
        return {"$record": ["namespace", {str(k): to_json(v, depth + 1)
                                          for k, v in vars(value).items()}]}
    if kind is Record:
        return {"$record": [value.type_name, {k: to_json(v, depth + 1)
                                              for k, v in value.fields.items()}]}
    if kind is Handle:
        return {"$handle": [value.id, value.type_name]}
    if kind is Served:
        return {"$served": [value.id, value.type_name, list(value.methods), list(value.attributes)]}
    raise NotEncodable(f"a {kind.__name__} object")


def _b64(text: Any, what: str) -> bytes:
    if type(text) is not str:
        raise WireError(f"{what}: expected base64 text")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise WireError(f"{what}: not base64") from None


def _dtype(text: Any) -> np.dtype:
    if type(text) is not str or not _DTYPE.match(text):
        raise WireError(f"unsupported dtype {text!r}")
    return np.dtype(text)


def _array(dtype_text: Any, shape: Any, data_text: Any) -> np.ndarray:
    dtype = _dtype(dtype_text)
    if type(shape) is not list or len(shape) > 32 or \
            any(type(n) is not int or not 0 <= n <= MAX_FRAME for n in shape):
        raise WireError(f"bad array shape {shape!r}")
    data = _b64(data_text, "array data")
    count = math.prod(shape)
    if count * dtype.itemsize != len(data):
        raise WireError(f"array of shape {shape} and dtype {dtype} with {len(data)} bytes")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    except (ValueError, MemoryError, OverflowError) as error:
        raise WireError(f"array of shape {shape}: {error}") from None


class _Budget:
    """What one message may still make the decoder hash."""

    def __init__(self):
        self.keys = MAX_KEYS

    def spend(self, n: int) -> None:
        self.keys -= n
        if self.keys < 0:
            raise WireError(f"more than {MAX_KEYS} set members and dict keys in one message")


def from_json(tree: Any, depth: int = 0, budget: Any = None) -> Any:
    """The value a to_json tree stands for; WireError for anything to_json cannot write."""
    budget = budget or _Budget()
    if depth > MAX_DEPTH:
        raise WireError(f"containers nested more than {MAX_DEPTH} deep")
    kind = type(tree)
    if tree is None or kind in (bool, int, float, str):
        return tree
    if kind is list:
        if all(type(item) in _SCALARS for item in tree):     # nothing in it to check further
            return tree
        return [from_json(item, depth + 1, budget) for item in tree]
    if kind is not dict or len(tree) != 1:
        raise WireError(f"unexpected {kind.__name__} in a message")
    (tag, body), = tree.items()
    if tag in ("$tuple", "$set", "$frozenset"):
        if type(body) is not list:
            raise WireError(f"{tag} without a list")
        if tag != "$tuple":
            budget.spend(len(body))
        items = [from_json(item, depth + 1, budget) for item in body]
        try:
            return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](items)
        except TypeError:
            raise WireError(f"{tag} of unhashable items") from None
    if tag == "$dict":
        if type(body) is not list or any(type(p) is not list or len(p) != 2 for p in body):
            raise WireError("$dict without [key, value] pairs")
        budget.spend(len(body))
        try:
            return {from_json(k, depth + 1, budget): from_json(v, depth + 1, budget)
                    for k, v in body}
        except TypeError:
            raise WireError("$dict with an unhashable key") from None
    if tag == "$bytes":
        return _b64(body, "bytes")
    if tag == "$array":
        if type(body) is not list or len(body) != 3:
            raise WireError("$array needs [dtype, shape, data]")
        return _array(*body)
    if tag == "$scalar":
        if type(body) is not list or len(body) != 2:
            raise WireError("$scalar needs [dtype, data]")
        return _array(body[0], [], body[1])[()]
    if tag == "$record":
        if type(body) is not list or len(body) != 2 or type(body[0]) is not str \
                or type(body[1]) is not dict:
            raise WireError("$record needs [type name, {fields}]")
        fields = {}
        for name, value in body[1].items():
            if not name.isidentifier():
                raise WireError(f"record field {name!r} is not a name")
            fields[name] = from_json(value, depth + 1, budget)
        return types.SimpleNamespace(**fields)
    if tag == "$handle":
        if type(body) is not list or len(body) != 2 or type(body[0]) is not int \
                or type(body[1]) is not str:
            raise WireError("$handle needs [id, type name]")
        return Handle(body[0], body[1][:200])
    if tag == "$served":
        if type(body) is not list or len(body) != 4 or type(body[0]) is not int \
                or type(body[1]) is not str or any(
                    type(names) is not list or len(names) > MAX_SERVED_NAMES
                    or any(type(n) is not str or not n.isidentifier() for n in names)
                    for names in body[2:]):
            raise WireError("$served needs [id, type name, [method names], [attribute names]]")
        return Served(body[0], body[1][:200], tuple(body[2]), tuple(body[3]))
    raise WireError(f"unknown tag {tag!r}")


def encode(value: Any) -> bytes:
    """A frame's payload for `value` (NotEncodable if some part has no by-value form)."""
    return json.dumps(to_json(value), separators=(",", ":")).encode()


def decode(payload: bytes) -> Any:
    # Every JSON value but the first follows a "[", a "{" or a ",": counting them bounds
    # the objects json.loads would make, before it makes them.
    nodes = payload.count(b"[") + payload.count(b"{") + payload.count(b",")
    if nodes > MAX_NODES:
        raise WireError(f"a message of more than {MAX_NODES:,} values")
    try:
        tree = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as error:
        raise WireError(f"not a message: {type(error).__name__}") from None
    return from_json(tree)


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise NotEncodable(f"a message of {len(payload):,} bytes (the limit is {MAX_FRAME:,})")
    return _HEADER.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME:
        raise WireError(f"a message of {length:,} bytes (the limit is {MAX_FRAME:,})")
    return length


HEADER_SIZE = _HEADER.size
