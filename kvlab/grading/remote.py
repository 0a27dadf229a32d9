"""The submission as a test sees it: proxies that call into the worker process.

A test calls `sub.attend(q, keys, values)` and gets back a NumPy array, or
`cache = sub.KVCache(2, 5, 2, 4)` and gets a RemoteObject whose methods and attributes
are the student's object's, in the worker. Arguments and results travel by value
(kvlab/grading/wire.py); what comes back is plain data the judge owns, so nothing the
student's code returns can run code in the judge, override __eq__ or change later.

When the student's code raises, the call raises RemoteError with the exception's type
names, message and the line of the student's file; `raises("CacheFullError")` in
kvlab.grading.testkit checks for one.

The other way round, a test can lend the student's code an object of the judge's by
reference (a ServedObject, passed as an argument): it never leaves the judge's process, and
the worker gets a proxy whose method calls and attribute reads come back here as requests
({"judge": {...}} frames, answered while the judge waits for the call that made them).
Only the methods and attributes the object's class names can be reached, with arguments
that travel by value; whatever they do (a forward pass, say) is done, and can be counted,
where the student's code cannot reach.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import wire
from .process import WorkerGarbled, WorkerProcess, WorkerTimeout

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


class ServedObject:
    """An object of the judge's that a test lends the student's code by reference: pass it
    as an argument to the student's function and the worker gets a proxy. The student's
    code may call the methods named in `served_methods` and read the attributes named in
    `served_attributes` (the class's, or the object's own where it sets them), nothing else; each call runs here, in the judge, with arguments
    that came by value (ServedObjects among them come back as themselves). What a method
    raises reaches the student's code as an exception of the same name."""
    served_methods: Tuple[str, ...] = ()
    served_attributes: Tuple[str, ...] = ()

    @property
    def served_type_name(self) -> str:
        return type(self).__name__


class ServedFunction(ServedObject):
    """A function of the judge's, put in place of one of the submission's own for a call
    (RemoteCallable.call(..., replace={"partial": ServedFunction(...)})). Every call the
    student's code makes to it runs here and is kept in `calls` (args, kwargs, result)."""
    served_methods = ("call",)
    served_type_name = "function"

    def __init__(self, function):
        self.function = function
        self.calls: List[tuple] = []

    def call(self, *args, **kwargs):
        result = self.function(*args, **kwargs)
        self.calls.append((args, kwargs, result))
        return result


class NotServed(LookupError):
    """The worker named an object, method or attribute the judge does not serve it."""


class Session:
    """One worker and the deadline of the test it serves, and the judge's objects lent to
    its code by reference."""
    # A folder of the judge's the worker can read and not write, where a test may leave
    # data too large to send as a value (testkit.handout_file); None outside a judge.
    handouts: Optional[Path] = None

    def __init__(self, worker: WorkerProcess, deadline: float,
                 lent_functions: Optional[ServedObject] = None):
        self.worker, self.deadline = worker, deadline
        self.served: Dict[int, ServedObject] = {}       # id sent to the worker -> object
        self._served_ids: Dict[int, int] = {}           # id(object) -> that id
        if lent_functions is not None:     # what the lab lends from kvlab, at its known id
            self.served[wire.LENT_FUNCTIONS_ID] = lent_functions
            self._served_ids[id(lent_functions)] = wire.LENT_FUNCTIONS_ID

    def ask(self, message: dict) -> Tuple[Any, dict]:
        """(result, the whole answer); raises RemoteError when the student's code raised.
        Calls the student's code makes meanwhile to objects served to it are answered."""
        self.worker.send(message, self.deadline)
        while True:
            answer = self.worker.receive(self.deadline)
            if "judge" not in answer:
                break
            if time.monotonic() > self.deadline:    # no served call starts past the deadline
                raise WorkerTimeout("time is up")
            self.worker.send(self.serve(answer["judge"]), self.deadline)
        result = _answer(answer)
        if isinstance(result, RemoteError):
            raise result
        return self.wrap(result), answer

    def wrap(self, value: Any) -> Any:
        """Handles become RemoteObjects and served references the judge's own objects,
        inside containers too."""
        if isinstance(value, wire.Handle):
            return RemoteObject(self, value)
        if isinstance(value, wire.Served):
            if value.id not in self.served:
                raise WorkerGarbled("the worker process named an object the grader never lent it")
            return self.served[value.id]
        if type(value) is list:
            return [self.wrap(v) for v in value]
        if type(value) is tuple:
            return tuple(self.wrap(v) for v in value)
        if type(value) is dict:
            return {k: self.wrap(v) for k, v in value.items()}
        return value

    def unwrap(self, value: Any) -> Any:
        """What a value is sent as: RemoteObjects as their handles (the worker passes the
        student's own object), ServedObjects as references to them (lent from now on)."""
        if isinstance(value, RemoteObject):
            return object.__getattribute__(value, "_handle")
        if isinstance(value, ServedObject):
            key = id(value)
            if key not in self._served_ids:
                self._served_ids[key] = max(self.served, default=wire.LENT_FUNCTIONS_ID) + 1
                self.served[self._served_ids[key]] = value
            return wire.Served(self._served_ids[key], value.served_type_name,
                               tuple(value.served_methods), tuple(value.served_attributes))
        if type(value) is list:
            return [self.unwrap(v) for v in value]
        if type(value) is tuple:
            return tuple(self.unwrap(v) for v in value)
        if type(value) is dict:
            return {k: self.unwrap(v) for k, v in value.items()}
        return value

    def _served_arguments(self, value: Any) -> Any:
        """A call's arguments as a served method takes them: references to served objects
        become the objects; a handle to one of the student's objects is refused (a served
        method takes values, and must not call back into the worker)."""
        if isinstance(value, wire.Handle):
            raise TypeError("the grader's objects take numbers, strings, lists and arrays, "
                            "and the grader's own objects, not objects of yours")
        if isinstance(value, wire.Served):
            if value.id not in self.served:
                raise NotServed("that is not an object the grader lent your code")
            return self.served[value.id]
        if type(value) is list:
            return [self._served_arguments(v) for v in value]
        if type(value) is tuple:
            return tuple(self._served_arguments(v) for v in value)
        if type(value) is dict:
            return {k: self._served_arguments(v) for k, v in value.items()}
        return value

    def serve(self, request: Any) -> dict:
        """Run one call the student's code made to a served object, here; its result (or
        what it raised) as the frame to send back. The request is the worker's, so it is
        checked: a known object, a name its class serves, arguments by value."""
        try:
            if type(request) is not dict:
                raise NotServed("a call to the grader's objects must be a dict")
            target = self.served.get(request.get("id")) if type(request.get("id")) is int else None
            name, args, kwargs = request.get("name"), request.get("args", []), request.get("kwargs", {})
            if target is None:
                raise NotServed("that is not an object the grader lent your code")
            if type(args) is not list or type(kwargs) is not dict or \
                    any(type(k) is not str for k in kwargs):
                raise NotServed("a call's arguments must be a list and a dict of named ones")
            args, kwargs = self._served_arguments(args), self._served_arguments(kwargs)
            if request.get("get") is True:
                if name not in target.served_attributes:
                    raise AttributeError(f"the grader's {target.served_type_name} has no "
                                         f"attribute {name!r} to read")
                result = getattr(target, name)
            else:
                if name not in target.served_methods:
                    raise AttributeError(f"the grader's {target.served_type_name} has no "
                                         f"method {name!r}")
                result = getattr(target, name)(*args, **kwargs)
            return {"ok": wire.Encoded(wire.to_json(self.unwrap(result)))}
        except Exception as error:       # what the student's call did wrong, for them to see
            return {"raised": {"types": [c.__name__ for c in type(error).__mro__],
                               "message": str(error)[:MESSAGE_CAP], "where": ""}}


class RemoteCallable:
    """A function, class or method of the student's, called in the worker."""

    def __init__(self, session: Session, target: Optional[wire.Handle], name: str):
        self._session, self._target, self._name = session, target, name

    def __call__(self, *args, **kwargs):
        return self.call(args, kwargs)

    def call(self, args: tuple, kwargs: dict, numpy_errors: Optional[dict] = None,
             replace: Optional[Dict[str, "ServedFunction"]] = None):
        """The call, with NumPy's floating-point error handling set to `numpy_errors` (as
        numpy.errstate takes it) around it, e.g. {"divide": "raise"}, and the submission's
        module-level functions named in `replace` swapped for these judge-side ones while
        it runs (so a test sees, and chooses, what the student's function gets from them)."""
        session = self._session
        result, _ = session.ask({"op": "call", "target": self._target, "name": self._name,
                                 "args": session.unwrap(list(args)), "kwargs": session.unwrap(kwargs),
                                 "numpy_errors": numpy_errors,
                                 "replace": session.unwrap(dict(replace)) if replace else None})
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
                                        "calls": [[c[0], self._session.unwrap(list(c[1:]))] for c in calls],
                                        "attrs": list(attrs) if attrs else None})
        return results

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the grader does not change the student's objects")

    def __repr__(self) -> str:
        return f"<your {self._handle.type_name} object>"


class Submission:
    """The student's module: `sub.name(...)` calls a function or class of theirs (the
    judge's objects lent to it are passed as arguments: kvlab/grading/handouts.py)."""

    def __init__(self, session: Session):
        object.__setattr__(self, "_session", session)

    def __getattr__(self, name: str) -> RemoteCallable:
        if name.startswith("__"):
            raise AttributeError(name)
        return RemoteCallable(self._session, None, name)
