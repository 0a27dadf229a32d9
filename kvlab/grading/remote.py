"""The submission as a test sees it: proxies that call into the worker process.

A test calls `sub.attend(q, keys, values)` and gets back a NumPy array, or
`cache = sub.KVCache(2, 5, 2, 4)` and gets a RemoteObject whose methods and attributes
are the student's object's, in the worker. Arguments and results travel by value
(kvlab/grading/wire.py); what comes back is plain data the judge owns, so nothing the
student's code returns can run code in the judge, override __eq__ or change later.

When the student's code raises, the call raises RemoteError with the exception's type
names, message and the line of the student's file; `raises("CacheFullError")` in
kvlab.grading.testkit checks for one.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from . import wire
from .process import WorkerGarbled, WorkerProcess

MESSAGE_CAP = 2000           # characters of a student's exception message kept


class RemoteError(Exception):
    """The student's code raised. types: the class names of its exception, most
    specific first; message; where: the line of the student's file, when known."""

    def __init__(self, types: List[str], message: str, where: str):
        super().__init__(message)
        self.types, self.message, self.where = types, message, where

    @property
    def type_name(self) -> str:
        return self.types[0] if self.types else "an exception"

    def is_a(self, name: str) -> bool:
        return name in self.types

    def describe(self) -> str:
        if self.is_a("NotInYourFile"):
            return self.message
        if self.is_a("NotImplementedError"):
            what = f" ({self.message})" if self.message else ""
            return f"not written yet{what}: it raises NotImplementedError"
        text = f"your code raised {self.type_name}"
        if self.message:
            text += f": {self.message}"
        return text + (f"\n  at {self.where}" if self.where else "")


def _text(value: Any, limit: int) -> str:
    """A student's string as the judge keeps it: cut to `limit` characters, and only
    characters UTF-8 can write (a lone surrogate would break the summary and results.json)."""
    return str(value)[:limit].encode("utf-8", "replace").decode("utf-8")


def _answer(answer: dict) -> Any:
    if "raised" in answer:
        raised = answer["raised"]
        if type(raised) is not dict:
            raise WorkerGarbled("the worker process sent a malformed exception")
        types = raised.get("types")
        types = [_text(t, 100) for t in types[:50]] if type(types) is list else []
        return RemoteError(types, _text(raised.get("message", ""), MESSAGE_CAP),
                           _text(raised.get("where", ""), 300))
    if "ok" not in answer:
        raise WorkerGarbled("the worker process sent an answer without a result")
    return answer["ok"]


class Session:
    """One worker and the deadline of the test it serves."""

    def __init__(self, worker: WorkerProcess, deadline: float):
        self.worker, self.deadline = worker, deadline

    def ask(self, message: dict) -> Tuple[Any, dict]:
        """(result, the whole answer); raises RemoteError when the student's code raised."""
        answer = self.worker.request(message, self.deadline)
        result = _answer(answer)
        if isinstance(result, RemoteError):
            raise result
        return self.wrap(result), answer

    def wrap(self, value: Any) -> Any:
        """Handles become RemoteObjects, inside containers too."""
        if isinstance(value, wire.Handle):
            return RemoteObject(self, value)
        if type(value) is list:
            return [self.wrap(v) for v in value]
        if type(value) is tuple:
            return tuple(self.wrap(v) for v in value)
        return value


def _unwrap(value: Any) -> Any:
    """RemoteObjects back to handles, so that the worker passes the student's own object."""
    if isinstance(value, RemoteObject):
        return object.__getattribute__(value, "_handle")
    if type(value) is list:
        return [_unwrap(v) for v in value]
    if type(value) is tuple:
        return tuple(_unwrap(v) for v in value)
    if type(value) is dict:
        return {k: _unwrap(v) for k, v in value.items()}
    return value


class RemoteCallable:
    """A function, class or method of the student's, called in the worker."""

    def __init__(self, session: Session, target: Optional[wire.Handle], name: str):
        self._session, self._target, self._name = session, target, name

    def __call__(self, *args, **kwargs):
        return self.call(args, kwargs)

    def call(self, args: tuple, kwargs: dict, numpy_errors: Optional[dict] = None):
        """The call, with NumPy's floating-point error handling set to `numpy_errors` (as
        numpy.errstate takes it) around it, e.g. {"divide": "raise"}."""
        result, _ = self._session.ask({"op": "call", "target": self._target, "name": self._name,
                                       "args": _unwrap(list(args)), "kwargs": _unwrap(kwargs),
                                       "numpy_errors": numpy_errors})
        return result

    def __repr__(self) -> str:
        return f"<your {self._name}>"


class RemoteObject:
    """An object of the student's that stays in the worker. Attribute reads and method
    calls go there; attrs(a, b) reads several attributes, calls((m, arg), ...) makes
    several calls, in one round trip."""

    def __init__(self, session: Session, handle: wire.Handle):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_methods", set())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        session, handle = self._session, self._handle
        if name in self._methods:
            return RemoteCallable(session, handle, name)
        (value,), answer = session.ask({"op": "get", "target": handle, "names": [name]})
        if answer.get("callable") == [True]:
            self._methods.add(name)
            return RemoteCallable(session, handle, name)
        return value

    def attrs(self, *names: str) -> tuple:
        values, _ = self._session.ask({"op": "get", "target": self._handle, "names": list(names)})
        return tuple(values)

    def calls(self, *calls: tuple, attrs: Optional[Tuple[str, ...]] = None) -> list:
        """[self.name(*args) for (name, *args) in calls], in one round trip; with attrs,
        each result is the tuple of those attributes of what the call returned."""
        results, _ = self._session.ask({"op": "calls", "target": self._handle,
                                        "calls": [[c[0], _unwrap(list(c[1:]))] for c in calls],
                                        "attrs": list(attrs) if attrs else None})
        return results

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the grader does not change the student's objects")

    def __repr__(self) -> str:
        return f"<your {self._handle.type_name} object>"


class Submission:
    """The student's module: `sub.name(...)` calls a function or class of theirs;
    `sub.handout(name, **kwargs)` asks the worker for an object the lab lends them."""

    def __init__(self, session: Session):
        object.__setattr__(self, "_session", session)

    def __getattr__(self, name: str) -> RemoteCallable:
        if name.startswith("__"):
            raise AttributeError(name)
        return RemoteCallable(self._session, None, name)

    def handout(self, name: str, **kwargs) -> Any:
        result, _ = self._session.ask({"op": "handout", "name": name, "kwargs": _unwrap(kwargs)})
        return result
