"""The worker: the process that runs a student's code, and nothing else, for the judge.

The judge (kvlab/grading/judge.py) starts one worker per test as

    python -I -B worker.py READ_FD WRITE_FD [--user UID:GID] [--max-processes N]

in an empty folder, with a clean environment, in a session of its own. On the Gradescope
autograder it starts as root and becomes an unprivileged user (--user) before it reads a
line of the student's code. It never sees the tests, their points, the results file or the
judge's files, and it never loads kvlab: of kvlab's files it reads only wire.py (the
values it sends and receives), policy.py (what the submission may import) and
process_limits.py (a worker that may start nothing), by path.
Whatever a lab lends the student's code (a model, its caches, kvlab.measure's functions)
stays in the judge and is reached through proxies, so nothing in this process is worth
stealing: no reference answer, no log the grader reads, no secret. It reads requests from READ_FD and answers on WRITE_FD,
one frame each way at a time (kvlab/grading/wire.py):

    {"op": "load", "path": P, "policy": {...}}   import the submission from P
    {"op": "call", "target": handle or None, "name": N, "args": [...], "kwargs": {...},
     "numpy_errors": {"divide": "raise", ...} or None,
     "replace": {name: served function, ...} or None}   the submission's own functions of
                                      those names are the judge's during the call
    {"op": "get", "target": handle or None, "names": [N, ...]}
    {"op": "calls", "target": handle, "calls": [[N, [args]], ...], "attrs": [A, ...] or None}
                                      several calls at once (and attributes of their results)
    {"op": "build", "command": [...], "timeout": s}   a C lab's file compiled, here, in this
                                      worker's folder (kvlab/grading/cbuild.py); answers the
                                      compiler's warnings, or raises NotCompiled with its errors
    {"op": "load_library", "library": P, "harness": H}   a C lab's built library loaded
                                      (its constructors run here), behind the lab's harness
                                      module H, whose functions the tests then call

and answers {"ok": value} (plus "callable" for "get"), or {"raised": {"types", "message",
"where"}} when the student's code raised. Values that cannot travel by value (the student's
own objects) stay here in a table and travel as handles.

An object the judge lends (a model that stays in the judge's process, say) arrives as a
served reference and reaches the student's code as a JudgeObject: each of its method calls
and attribute reads is a frame to the judge, {"judge": {"id", "name", "args", "kwargs",
"get"}}, sent while the judge waits for the request in progress, and answered {"ok": value}
or {"raised": ...} (raised here again as an exception of the same name). The kvlab
functions a lab lends (`from kvlab.measure import resident_bytes`) are stand-ins that call
the judge the same way, at the served id wire.LENT_FUNCTIONS_ID.

Everything here runs beside the student's code and can be changed by it: the worker is
not trusted. What makes grading safe is that the judge computes every expected value, and
the score, in its own process from its own copy of the tests.
"""
import builtins
import contextlib
import ctypes
import faulthandler
import importlib.util
import os
import signal
import subprocess
import sys
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBMISSION = "submission"
OUTPUT_LIMIT = 256 << 20          # bytes of files the student's code may write

try:                              # POSIX only: the judge refuses to start a worker elsewhere
    import resource
except ImportError:
    resource = None


def _load_sibling(path):
    """wire.py and policy.py, by path: the worker imports nothing of kvlab's as kvlab (the
    package is refused to the submission; see KvlabFinder)."""
    spec = importlib.util.spec_from_file_location(f"kvlab_worker_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


import numpy  # noqa: E402  (after sys.path is as -I left it; wire needs it too)

wire = _load_sibling(HERE / "wire.py")
policy = _load_sibling(HERE / "policy.py")
process_limits = _load_sibling(HERE / "process_limits.py")


def _become(uid, gid):
    """Drop root for good: from here on the worker is the student's user, who cannot read
    the installed kvlab (the autograder's setup.sh closes it), the tests or the results."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid:
        raise SystemExit("the worker could not give up root")


def _limit_resources(max_processes, own_user):
    """Limits the student's code cannot raise again: no core files, bounded files, (when
    the worker runs as a user of its own) a bounded number of processes, and, where the lab
    allows the worker no other process (max_processes 1), no process or thread started,
    whatever user it runs as (process_limits). The worker dies with the judge (set after
    any change of user, which clears it; Linux only)."""
    if resource is None:
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT, OUTPUT_LIMIT))
    if max_processes and own_user:      # the limit counts every process of the user
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    if max_processes == 1:
        process_limits.forbid_new_tasks()
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)     # PR_SET_PDEATHSIG, SIGKILL


def _first_out():
    """A memory hog is the first thing the out-of-memory killer takes."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _where(error, path):
    """The line of the student's file where `error` happened (the deepest one), or ''."""
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename == path:
            text = (frame.line or "").strip()
            found = f"line {frame.lineno} of your file, in {frame.name}" + (f": {text}" if text else "")
    return found


def _describe(error, path):
    try:
        message = str(error)
    except BaseException:               # an exception whose __str__ raises
        message = "(its message could not be read)"
    names = []
    for cls in type(error).__mro__:
        name = getattr(cls, "__name__", "?")
        if isinstance(name, str):
            names.append(name[:200])
    return {"types": names, "message": message[:2000], "where": _where(error, path)[:500]}


class KvlabFinder:
    """Refuses kvlab and instructor/: however a module is imported (importlib, pydoc.locate,
    unpickling), the import system asks this finder first. What a lab lends from kvlab the
    submission gets from lent_modules()."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top == "instructor":
            raise ImportError("`instructor` is the course's own material: it is not yours to import")
        if top == "kvlab":
            raise ImportError(f"`{name}` is not available to a lab submission")
        return None


def lent_function(worker, dotted, served, method=None):
    """The stand-in for a function the judge serves (a kvlab function a lab lends: its
    method of that name; with `method`, that method): each call is a request to the judge."""
    name = dotted.rpartition(".")[2]

    def function(*args, **kwargs):
        return worker.call_judge(served, method or name, args, kwargs)
    function.__name__ = function.__qualname__ = name
    function.__module__ = dotted.rpartition(".")[0]
    return function


def lent_modules(worker, allowed):
    """Stand-ins for the kvlab modules a lab lends: {"kvlab": ..., "kvlab.measure": ...},
    each holding only the lent names, whose calls run in the judge."""
    served = wire.Served(wire.LENT_FUNCTIONS_ID, "kvlab",
                         tuple(d.rpartition(".")[2] for d in allowed), ())
    modules = {}
    for dotted in allowed:
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            name = ".".join(parts[:i])
            if name not in modules:
                modules[name] = types.ModuleType(name, "lent to a lab submission by the grader")
                if i > 1:
                    setattr(modules[".".join(parts[:i - 1])], parts[i - 1], modules[name])
        setattr(modules[".".join(parts[:-1])], parts[-1], lent_function(worker, dotted, served))
    return modules


class NotInYourFile(AttributeError):
    """The test asked for a function or class the submission does not define."""


class NotCompiled(Exception):
    """A C submission the compiler refused; the message is what the compiler said."""


COMPILER_OUTPUT_KEPT = 20_000      # characters of a compiler's messages sent back


def build(command, timeout):
    """Run a C lab's compiler command here (the worker's folder, the student's user): the
    compiler's warnings, or NotCompiled with its errors. No code of the student's runs."""
    try:
        run = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NotCompiled(f"the compiler ran past {timeout:g} s on your file") from None
    except OSError as error:
        raise NotCompiled(f"the compiler could not be started: {error}") from None
    said = run.stdout.decode("utf-8", "replace")[-COMPILER_OUTPUT_KEPT:]
    if run.returncode != 0:
        raise NotCompiled(said.strip() or f"the compiler failed (exit status {run.returncode})")
    return said


# What an exception raised by the judge's side of a served call becomes here: the most
# specific of these among its classes (its own name is kept: CacheFullError stays one).
JUDGE_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "IndexError": IndexError,
                "KeyError": KeyError, "AttributeError": AttributeError,
                "LookupError": LookupError}


def _judge_error(raised):
    """The exception to raise in the student's code for what a served call raised."""
    types = raised.get("types") if type(raised) is dict else None
    types = [t for t in types if type(t) is str] if type(types) is list else []
    message = raised.get("message", "") if type(raised) is dict else ""
    base = next((JUDGE_ERRORS[t] for t in types if t in JUDGE_ERRORS), RuntimeError)
    name = types[0] if types and types[0].isidentifier() else base.__name__
    cls = base if name == base.__name__ else type(name, (base,), {"__module__": "grader"})
    return cls(str(message))


class JudgeObject:
    """An object of the grader's, lent by reference: it stays in the judge's process, and
    every method call or attribute read on it here is a request to the judge."""
    __slots__ = ("_worker", "_served")

    def __init__(self, worker, served):
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_served", served)

    def __getattr__(self, name):
        served, worker = self._served, self._worker
        if name in served.methods:
            def method(*args, **kwargs):
                return worker.call_judge(served, name, args, kwargs)
            method.__name__ = method.__qualname__ = name
            return method
        if name in served.attributes:
            return worker.call_judge(served, name, get=True)
        offered = ", ".join(sorted(served.methods + served.attributes))
        raise AttributeError(f"the grader's {served.type_name} has no attribute {name!r} "
                             f"(it has: {offered})")

    def __setattr__(self, name, value):
        raise AttributeError(f"the grader's {self._served.type_name} cannot be changed")

    def __dir__(self):
        return sorted(self._served.methods + self._served.attributes)

    def __repr__(self):
        return f"<the grader's {self._served.type_name}>"


class Worker:
    def __init__(self, read_fd, write_fd):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.finder = KvlabFinder()
        sys.meta_path.insert(0, self.finder)
        self.objects = {}                # handle id -> object kept for the judge
        self.module = None
        self.path = None
        self.rules = None
        self.judge_objects = {}          # served id -> its JudgeObject (one per object)

    # ---- frames ------------------------------------------------------------------------
    def _read_exactly(self, n):
        chunks, left = [], n
        while left:
            chunk = os.read(self.read_fd, min(left, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def receive(self):
        header = self._read_exactly(wire.HEADER_SIZE)
        if header is None:
            return None
        payload = self._read_exactly(wire.frame_length(header))
        return None if payload is None else wire.decode(payload)

    def send(self, message):
        self.send_frame(wire.frame(wire.encode(message)))

    def send_frame(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view):]

    # ---- values ------------------------------------------------------------------------
    def resolve(self, value):
        """Arguments as the student's code should see them: handles become their objects,
        and references to the judge's objects JudgeObjects."""
        if isinstance(value, wire.Handle):
            if value.id not in self.objects:
                raise LookupError(f"no object {value.id} in this worker")
            return self.objects[value.id]
        if isinstance(value, wire.Served):
            if value.id not in self.judge_objects:
                self.judge_objects[value.id] = JudgeObject(self, value)
            return self.judge_objects[value.id]
        if type(value) is list:
            return [self.resolve(v) for v in value]
        if type(value) is tuple:
            return tuple(self.resolve(v) for v in value)
        if type(value) is dict:
            return {k: self.resolve(v) for k, v in value.items()}
        return value

    def outgoing(self, value):
        """`value` as it is sent: JudgeObjects as the references they stand for."""
        if type(value) is JudgeObject:
            return object.__getattribute__(value, "_served")
        if type(value) is list:
            return [self.outgoing(v) for v in value]
        if type(value) is tuple:
            return tuple(self.outgoing(v) for v in value)
        if type(value) is dict:
            return {k: self.outgoing(v) for k, v in value.items()}
        return value

    def call_judge(self, served, name, args=(), kwargs=None, get=False):
        """A method call (or, with get, an attribute read) on an object the judge lent by
        reference: sent to the judge, which runs it and answers."""
        try:
            frame = wire.frame(wire.encode({"judge": {
                "id": served.id, "name": name, "get": bool(get),
                "args": self.outgoing(list(args)), "kwargs": self.outgoing(dict(kwargs or {}))}}))
        except (wire.NotEncodable, RecursionError) as error:
            raise TypeError(f"the grader's {served.type_name}.{name} takes numbers, strings, "
                            f"lists and arrays of them, and the grader's own objects "
                            f"(it cannot take {error})") from None
        self.send_frame(frame)
        answer = self.receive()
        if type(answer) is not dict:           # the judge is gone: grading is over
            raise SystemExit(0)
        if "raised" in answer:
            raise _judge_error(answer["raised"])
        return self.resolve(answer.get("ok"))

    def by_value_or_handle(self, value):
        """`value`, encoded, if it can travel; else a handle to it (kept in this worker)."""
        try:
            return wire.Encoded(wire.to_json(self.outgoing(value)))
        except (wire.NotEncodable, RecursionError):
            handle = wire.Handle(len(self.objects) + 1, type(value).__name__)
            self.objects[handle.id] = value
            return handle

    def target(self, handle, name):
        """What `name` is read from: the student's module, or one of their objects."""
        if handle is not None:
            return self.resolve(handle)
        if not hasattr(self.module, name):
            raise NotInYourFile(f"your file defines no `{name}` (is it the file for this lab?)")
        return self.module

    # ---- requests ----------------------------------------------------------------------
    def guard_imports(self):
        """Refuse, at import time, what the lab's policy refuses in the submission's own
        code: imports written in its file, or called from it (the modules it imports may
        import what they need). instructor/ is refused to everyone."""
        real_import = builtins.__import__
        module_globals = self.module.__dict__
        rules = self.rules

        lent = lent_modules(self, rules.kvlab)

        def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
            if not isinstance(name, str):
                return real_import(name, globals, locals, fromlist, level)
            caller = sys._getframe(1).f_globals
            if globals is module_globals or caller is module_globals:
                why = policy.import_refusal(rules, name, fromlist or (), level)
                if why:
                    raise ImportError(why)
                if name.partition(".")[0] == "kvlab":     # what the lab lends, and no more
                    if name not in lent:
                        raise ImportError(f"`{name}` is not a module this lab lends")
                    return lent[name] if fromlist else lent["kvlab"]
            return real_import(name, globals, locals, fromlist, level)

        builtins.__import__ = guarded_import

    def load_library(self, library, harness):
        """A C lab: its harness module (the lab's glue, loaded by path) bound to the library
        built from the student's file. Loading the library runs its code; from here on this
        process is the student's as much as a Python lab's worker is after its import."""
        self.path = library
        module = _load_sibling(Path(harness))
        module.bind(ctypes.CDLL(library))
        self.module = module
        return None

    def load(self, path, rules):
        self.path, self.rules = path, policy.Policy.from_dict(rules)
        spec = importlib.util.spec_from_file_location(SUBMISSION, path)
        self.module = importlib.util.module_from_spec(spec)
        sys.modules[SUBMISSION] = self.module
        self.guard_imports()
        # Compiled from the text the judge checked, not loaded as a file: a file's bytes are
        # decoded as its coding line says (CPython finds one even after a lone \r, where
        # tokenize.detect_encoding does not), a str is taken as it is. So the code that runs
        # is the code check_source parsed, whatever the bytes declare.
        with open(path, encoding="utf-8", newline="") as f:
            code = compile(f.read(), str(path), "exec")
        exec(code, self.module.__dict__)
        return None

    @contextlib.contextmanager
    def replaced(self, functions):
        """The submission's module-level functions of these names replaced, for one call, by
        functions the judge serves (a test of split_attend that hands it the grader's own
        partial, say: what the student's code does with what it returns is then checked)."""
        module, missing = self.module.__dict__, object()
        saved = {name: module.get(name, missing) for name in functions}
        for name, served in functions.items():
            if not isinstance(served, wire.Served):
                raise RuntimeError(f"the grader's {name} is not a served function")
            module[name] = lent_function(self, name, served, method="call")
        try:
            yield
        finally:
            for name, old in saved.items():
                if old is missing:
                    module.pop(name, None)
                else:
                    module[name] = old

    def handle(self, request):
        op = request.get("op")
        if op == "load":
            return {"ok": self.load(request["path"], request["policy"])}
        if op == "build":
            return {"ok": build(list(request["command"]), float(request["timeout"]))}
        if op == "load_library":
            return {"ok": self.load_library(request["library"], request["harness"])}
        if self.module is None:
            raise RuntimeError("no submission loaded")
        if op == "call":
            function = getattr(self.target(request["target"], request["name"]), request["name"])
            args, kwargs = self.resolve(request["args"]), self.resolve(request["kwargs"])
            with numpy.errstate(**(request.get("numpy_errors") or {})), \
                    self.replaced(request.get("replace") or {}):
                result = function(*args, **kwargs)
            return {"ok": self.by_value_or_handle(result)}
        if op == "calls":                 # several method calls on one object, in order
            target, attrs = self.resolve(request["target"]), request.get("attrs")
            results = []
            for name, args in request["calls"]:
                result = getattr(target, name)(*self.resolve(args))
                if attrs:                     # then read these attributes of each result
                    result = tuple(getattr(result, a) for a in attrs)
                results.append(self.by_value_or_handle(result))
            return {"ok": results}
        if op == "get":
            values, callables = [], []
            for name in request["names"]:
                target = self.target(request["target"], name)
                value = getattr(target, name)
                callables.append(callable(value))
                values.append(None if callable(value) else self.by_value_or_handle(value))
            return {"ok": values, "callable": callables}
        raise RuntimeError(f"unknown request {op!r}")

    def serve(self):
        while True:
            request = self.receive()
            if request is None:          # the judge closed the pipe: grading is over
                return
            try:
                answer = self.handle(request)
                self.send(answer)
            except BaseException as error:   # the student's code raised (SystemExit too)
                self.send({"raised": _describe(error, self.path)})


def main(argv):
    """worker.py READ_FD WRITE_FD [--user UID:GID] [--max-processes N]"""
    read_fd, write_fd = int(argv[1]), int(argv[2])
    options = {"--user": None, "--max-processes": "0"}
    for flag, value in zip(argv[3::2], argv[4::2]):
        options[flag] = value
    worker = Worker(read_fd, write_fd)
    _first_out()
    # where the student's code is when the judge's time runs out: the judge asks, then kills
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=False)
    if options["--user"]:
        uid, gid = (int(n) for n in options["--user"].split(":"))
        _become(uid, gid)
    _limit_resources(int(options["--max-processes"]), own_user=bool(options["--user"]))
    sys.argv = [SUBMISSION]
    worker.serve()


if __name__ == "__main__":
    main(sys.argv)
