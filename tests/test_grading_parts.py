"""The parts of grading one at a time: values on the wire between judge and worker (what a
hostile worker can send), the lab policy (what a submission may import and name), and the
worker process (time, output, garbage)."""
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from kvlab.grading import wire
from kvlab.grading.policy import Policy, check_source, import_refusal
from kvlab.grading.process import OutputCapture, WorkerProcess, WorkerTimeout
from kvlab.grading.remote import RemoteError, ServedObject, Session

INSTRUCTOR = Path(__file__).resolve().parents[1] / "instructor"


# ---- wire ------------------------------------------------------------------------------------

def round_trip(value):
    return wire.decode(wire.encode(value))


def test_values_travel_with_their_types():
    value = {"a": [1, 2.5, None, True, "text", b"\x00\xff"], 3: (np.int64(7), np.float32(0.5)),
             ("k", 1): {1, 2}, "f": frozenset({3}), "nan": float("nan"),
             "arrays": [np.arange(6, dtype=np.int8).reshape(2, 3), np.zeros((0, 4), np.float16),
                        np.array([[True, False]]), np.ones(3, ">f8")]}
    back = round_trip(value)
    assert back["a"] == value["a"] and back["f"] == frozenset({3}) and back[("k", 1)] == {1, 2}
    assert type(back[3]) is tuple and type(back[3][0]) is np.int64 and back[3][0] == 7
    assert type(back[3][1]) is np.float32 and np.isnan(back["nan"])
    for got, want in zip(back["arrays"], value["arrays"]):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert got.flags.writeable
    record = round_trip(wire.Record("ModelConfig", {"n_layers": 2, "dim": 8}))
    assert isinstance(record, types.SimpleNamespace) and record.n_layers == 2
    served = wire.Served(3, "Model", ("forward", "new_cache"), ("config",))
    assert round_trip([served]) == [served]


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("value", [object(), np.array([object()]), lambda: 0,
                                   np.zeros(2, dtype=[("a", "i4")]), nested(wire.MAX_DEPTH + 2)])
def test_what_has_no_by_value_form_is_refused_when_sent(value):
    with pytest.raises(wire.NotEncodable):
        wire.encode(value)


@pytest.mark.parametrize("payload", [
    b"\xff\xfe", b"not json", b"{\"$nope\": 1}", b"{\"a\": 1, \"b\": 2}", b"{\"plain\": 1}",
    b"{\"$array\": [\"|O8\", [1], \"AAAAAAAAAAA=\"]}",                 # object dtype
    b"{\"$array\": [\"<f4\", [3], \"AAAAAA==\"]}",                    # 4 bytes for 3 floats
    b"{\"$array\": [\"<f4\", [-1], \"\"]}", b"{\"$array\": [\"<f4\", [1.5], \"\"]}",
    b"{\"$array\": [\"<f4\", [1], \"***\"]}",                          # not base64
    b"{\"$scalar\": [\"<i8\"]}", b"{\"$dict\": [[1]]}", b"{\"$dict\": [[[1], 2]]}",
    b"{\"$record\": [\"x\", {\"not a name\": 1}]}", b"{\"$handle\": [\"1\", \"x\"]}",
    b"{\"$set\": [[1]]}", b"[" * 100000 + b"]" * 100000,
    b"{\"$served\": [1, \"Model\", [\"not a name\"], []]}", b"{\"$served\": [1, \"Model\", []]}",
    b"{\"$served\": [\"1\", \"Model\", [], []]}",
    b"{\"$served\": [1, \"Model\", " + json.dumps(["m%d" % i for i in range(65)]).encode() + b", []]}",
])
def test_anything_a_worker_could_send_that_is_not_a_value_is_refused(payload):
    with pytest.raises(wire.WireError):
        wire.decode(payload)


def test_a_message_cannot_make_the_judge_hash_for_minutes_or_build_gigabytes():
    # ints equal mod 2**61 - 1 share a hash: a set of them costs quadratic time to build
    colliding = {"$set": [1 + k * (2 ** 61 - 1) for k in range(wire.MAX_KEYS + 1)]}
    started = time.monotonic()
    with pytest.raises(wire.WireError, match="set members and dict keys"):
        wire.decode(json.dumps(colliding).encode())
    assert time.monotonic() - started < 5
    with pytest.raises(wire.WireError, match="values"):      # 3 bytes a list, 64 in memory
        wire.decode(b"[" + b"[]," * wire.MAX_NODES + b"[]]")
    with pytest.raises(wire.WireError):                       # 0 bytes, but no such array
        wire.decode(json.dumps({"$array": ["<f8", [0, 10 ** 20], ""]}).encode())


def test_what_the_worker_says_about_an_exception_is_cut_to_size():
    from kvlab.grading.remote import MESSAGE_CAP, _answer
    error = _answer({"raised": {"types": ["X" * 10 ** 6] * 10 ** 4, "message": "m" * 10 ** 7,
                                "where": "w" * 10 ** 6}})
    assert len(error.message) == MESSAGE_CAP and len(error.where) <= 300
    assert len(error.types) <= 50 and all(len(t) <= 100 for t in error.types)


def test_frames_have_a_size_limit_both_ways():
    with pytest.raises(wire.WireError):
        wire.frame_length((wire.MAX_FRAME + 1).to_bytes(4, "big"))
    assert wire.frame_length(wire.frame(b"abc")[:4]) == 3


# ---- policy ----------------------------------------------------------------------------------

MEASURE = Policy("the cache-size arithmetic", ("kvlab.measure.resident_bytes",
                                               "kvlab.measure.release_freed_memory"))
NOTHING = Policy("attention")


@pytest.mark.parametrize("source", [
    "import numpy as np\nimport math, collections, dataclasses\nx = np.zeros(3).sum()\n",
    "from collections import deque\nimport os.path\nimport sys\neps = sys.float_info.epsilon\n",
    "import kvlab.measure\nkvlab.measure.release_freed_memory()\nb = kvlab.measure.resident_bytes()\n",
    "from kvlab.measure import resident_bytes as rb\nx = rb()\n",
    "import numpy\ny = numpy.testing\n",
])
def test_what_a_lab_allows_passes(source):
    policy = MEASURE if "kvlab" in source else NOTHING
    assert check_source(source, policy) == []


@pytest.mark.parametrize("source, policy, says", [
    ("import kvlab\n", NOTHING, "`kvlab` is not allowed here: this lab is about writing attention"),
    ("from kvlab import quant\n", MEASURE, "`kvlab.quant`"),
    ("import kvlab.measure\nx = kvlab.measure.kv_cache_bytes(1)\n", MEASURE, "kvlab.measure.kv_cache_bytes"),
    ("import kvlab.measure\nm = kvlab.measure\n", MEASURE, "`kvlab.measure` is not allowed"),
    ("import kvlab.measure as m\nf = m.kv_bytes_per_token\n", MEASURE, "kvlab.measure.kv_bytes_per_token"),
    ("from kvlab.measure import *\n", MEASURE, "import *"),
    ("from instructor.solutions import attention\n", NOTHING, "instructor"),
    ("import torch\n", NOTHING, "numpy, math and Python's standard library"),
    ("import subprocess\n", NOTHING, "starts processes"),
    ("import os\nos.system('ls')\n", NOTHING, "os.system"),
    ("from os import fork\n", NOTHING, "from os import fork"),
    ("import os\nf = os\n", NOTHING, "may only be used as"),
    ("import sys\nm = sys.modules\n", NOTHING, "sys.modules"),
    ("x = eval('1')\n", NOTHING, "`eval`"),
    ("f = (lambda: 0).__globals__\n", NOTHING, "__globals__"),
    ("f = getattr(len, '__self__')\n", NOTHING, "`getattr` is not allowed in a lab submission: it looks"),
    ("name = '__globals__'\n", NOTHING, "the string '__globals__' is not allowed"),
    ("import operator\nf = operator.attrgetter('x')\n", NOTHING, "operator.attrgetter"),
    ("from operator import methodcaller\n", NOTHING, "methodcaller"),
    ("from . import x\n", NOTHING, "relative imports"),
])
def test_what_a_lab_refuses_is_named_with_its_line(source, policy, says):
    found = check_source(source, policy)
    assert found and says in str(found[0]), found
    assert str(found[0]).startswith(f"line {found[0].line}: ")


def test_the_import_hook_and_the_source_check_share_one_rule():
    assert import_refusal(MEASURE, "kvlab") is None
    assert import_refusal(MEASURE, "kvlab.measure", ["resident_bytes"]) is None
    assert "kvlab.measure.kv_cache_bytes" in import_refusal(MEASURE, "kvlab.measure", ["kv_cache_bytes"])
    assert import_refusal(NOTHING, "numpy.linalg") is None
    assert "relative" in import_refusal(NOTHING, "x", level=1)


def test_code_under_main_is_not_read():
    source = ("import numpy\n\nif __name__ == '__main__':\n    import kvlab\n"
              "    print(kvlab.kv_cache_bytes)\n")
    assert check_source(source, NOTHING) == []
    # only that exact block: an else branch, or another condition, is read
    assert check_source(source.replace("'__main__'", "'other'"), NOTHING)
    assert check_source(source + "else:\n    import kvlab\n", NOTHING)


def test_code_under_main_is_read_when_the_file_sets_its_own_name():
    """A file that binds __name__ (to "__main__", say) runs its main block when the grader
    imports it, so that block is read like the rest."""
    main = "if __name__ == '__main__':\n    import kvlab\n    print(kvlab.kv_cache_bytes)\n"
    for binds in ("__name__ = '__main__'", "(__name__ := '__main__')", "import os as __name__",
                  "for __name__ in ['__main__']:\n    pass", "class __name__:\n    pass",
                  "def f():\n    global __name__\n    __name__ = '__main__'",
                  "try:\n    pass\nexcept ValueError as __name__:\n    pass",
                  "with open('x') as __name__:\n    pass"):
        found = check_source(binds + "\n" + main, NOTHING)
        assert any("kvlab" in v.why for v in found), binds
    # reading it, or setting another object's (a decorator's wrapper), does not
    for reads in ("print(__name__)", "def f(x):\n    return x.__name__",
                  "def wrap(f):\n    def g():\n        return f()\n    g.__name__ = f.__name__\n"
                  "    return g"):
        assert check_source(reads + "\n" + main, NOTHING) == [], reads


def test_a_syntax_error_is_the_callers_to_report():
    with pytest.raises(SyntaxError):
        check_source("def f(:\n", NOTHING)


# ---- the worker process ------------------------------------------------------------------------

def start(tmp_path, code, seconds=30.0):
    path = tmp_path / "submission.py"
    path.write_text(code)
    worker = WorkerProcess(tmp_path)
    session = Session(worker, time.monotonic() + seconds)
    session.ask({"op": "load", "path": str(path), "policy": NOTHING.to_dict()})
    return worker, session


def test_calls_objects_and_exceptions_cross_the_process_boundary(tmp_path):
    worker, session = start(tmp_path, '''
import numpy as np

class Box:
    def __init__(self, n):
        self.n = n
    def grow(self, by):
        self.n += by
        return np.arange(self.n)

class Refused(ValueError):
    pass

def fails():
    raise Refused("no room")
''')
    try:
        from kvlab.grading.remote import Submission
        sub = Submission(session)
        box = sub.Box(2)
        assert repr(box) == "<your Box object>" and box.n == 2
        assert np.array_equal(box.grow(3), np.arange(5)) and box.attrs("n") == (5,)
        assert box.calls(("grow", 1), ("grow", 1))[1].tolist() == list(range(7))
        with pytest.raises(RemoteError) as raised:
            sub.fails()
        assert raised.value.types[:3] == ["Refused", "ValueError", "Exception"]
        assert "line 15 of your file, in fails" in raised.value.where
        with pytest.raises(RemoteError, match="your file defines no `missing`"):
            sub.missing()
    finally:
        worker.stop()


def test_the_students_numpy_runs_on_one_blas_thread(tmp_path, monkeypatch):
    """A timed step measures the student's code, not BLAS threads fighting over the cores."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    worker, session = start(tmp_path, '''
import os

def blas_threads():
    return [os.environ.get(name) for name in
            ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")]
''')
    try:
        from kvlab.grading.remote import Submission
        assert Submission(session).blas_threads() == ["1", "1", "1"]
    finally:
        worker.stop()


def test_a_worker_past_its_deadline_is_stopped_from_outside(tmp_path):
    worker, session = start(tmp_path, "def spin():\n    while True:\n        pass\n")
    session.deadline = time.monotonic() + 0.5
    try:
        with pytest.raises(WorkerTimeout):
            session.ask({"op": "call", "target": None, "name": "spin", "args": [], "kwargs": {}})
    finally:
        worker.stop()
    assert worker.process.returncode is not None


def test_output_is_kept_up_to_a_cap():
    import os
    read, write = os.pipe()
    capture = OutputCapture(read, cap=100)
    capture.start()
    os.write(write, b"a" * 60)
    os.write(write, b"b" * 1000)
    os.close(write)
    capture.join(5)
    assert capture.kept == b"a" * 60 + b"b" * 40 and capture.dropped == 960
    assert "960 more bytes" in capture.text()


def answering(tmp_path, payload: str):
    """A submission that, at import, writes the bytes the expression `payload` makes as a
    frame on every pipe it can."""
    path = tmp_path / "cache_size.py"
    path.write_text(f'''
import shutil as ue, json, time
_os = ue.os
payload = {payload}
frame = len(payload).to_bytes(4, "big") + payload
for fd in range(3, 20):
    try:
        _os.write(fd, frame)
    except OSError:
        pass
time.sleep(30)
''')
    return path


@pytest.mark.parametrize("payload, says", [
    ('b"abc"', "unreadable"),
    ('json.dumps({"$dict": [["ok", {"$array": ["<f8", [0, 10 ** 20], ""]}]]}).encode()', "unreadable"),
    ('json.dumps({"$dict": [["ok", {"$set": [1 + k * (2 ** 61 - 1) for k in range(60000)]}]]})'
     '.encode()', "unreadable"),
    ('json.dumps({"$dict": [["raised", {"$dict": [["types", ["X"]], '
     '["message", "FULL MARKS " * 10 ** 6], ["where", ""]]}]]}).encode()', "FULL MARKS"),
])
def test_a_worker_that_answers_garbage_fails_the_submission_plainly(tmp_path, payload, says):
    from kvlab.grading import grade
    report = grade("cache_size", answering(tmp_path, payload),
                   tests=INSTRUCTOR / "graders" / "cache_size.py", seed=1)
    assert report.score == 0 and says in report.output, report.output[:500]
    assert len(json.dumps(report.gradescope())) < 100_000


def test_a_submission_that_is_a_link_is_not_read(tmp_path):
    from kvlab.grading import grade
    secret = tmp_path / "secret.txt"
    secret.write_text("secret-token: hunter2\n")
    link = tmp_path / "cache_size.py"
    link.symlink_to(secret)
    report = grade("cache_size", link.absolute(), tests=INSTRUCTOR / "graders" / "cache_size.py")
    assert report.score == 0 and "hunter2" not in report.summary()


def test_the_judge_will_not_run_with_asserts_stripped(tmp_path):
    run = subprocess.run([sys.executable, "-O", "-m", "kvlab.grading.judge", "--lab", "cache_size",
                          "--submission", "x.py", "--tests", "y.py", "--out", "z.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "without -O" in run.stderr
    assert not (tmp_path / "z.json").exists()


# ---- objects the judge serves by reference -------------------------------------------------------

class Counter(ServedObject):
    """A judge-side object as a lab would serve one: it counts the calls made to it."""
    served_methods = ("add", "child", "fail")
    served_attributes = ("total",)

    def __init__(self):
        self.total, self.calls, self.secret = 0, 0, "not for the worker"

    def add(self, n, times=1):
        if not isinstance(n, int):
            raise TypeError(f"add takes an int, got {n!r}")
        self.calls += 1
        self.total += n * times
        return np.arange(self.total)

    def child(self):
        if not hasattr(self, "kid"):
            self.kid = Counter()
        return self.kid

    def fail(self):
        class CacheFullError(ValueError):
            pass
        raise CacheFullError("no room")


def test_an_object_served_by_reference_stays_in_the_judge(tmp_path):
    worker, session = start(tmp_path, '''
def use(counter):
    got = counter.add(2).tolist() + counter.add(n=1, times=3).tolist()
    try:
        counter.fail()
    except ValueError as error:
        failed = (type(error).__name__, str(error))
    refused = []
    for name in ("secret", "calls", "__dict__"):
        try:
            getattr(counter, name)
        except AttributeError as error:
            refused.append(str(error))
    try:
        counter.total = 99
    except AttributeError as error:
        refused.append(str(error))
    try:
        counter.add(object())
    except TypeError as error:
        refused.append(str(error))
    return got, counter.total, failed, refused, repr(counter), counter.child(), counter
''')
    try:
        from kvlab.grading.remote import Submission
        counter = Counter()
        got, total, failed, refused, shown, child, same = Submission(session).use(counter)
        assert got == [0, 1] + [0, 1, 2, 3, 4] and total == 5 == counter.total
        assert counter.calls == 2                   # counted here, where the worker cannot reach
        assert failed == ("CacheFullError", "no room")
        assert "no attribute 'secret'" in refused[0] and "no attribute 'calls'" in refused[1]
        assert "'__dict__'" in refused[2] and "cannot be changed" in refused[3]
        assert "cannot take" in refused[4] and counter.total == 5
        assert shown == "<the grader's Counter>"
        assert same is counter and child is counter.kid       # the judge's own objects come back
    finally:
        worker.stop()


def test_forged_calls_to_the_judge_are_answered_with_an_error():
    """What a worker sends as a call is untrusted: only a served object's served names,
    with arguments by value."""
    session = Session(None, time.monotonic() + 30)
    counter = Counter()
    ref = session.unwrap(counter)
    assert session.unwrap([counter]) == [ref]              # one id per object
    for request, says in [
        ("not a dict", "must be a dict"),
        ({"id": 99, "name": "add", "args": [1]}, "not an object the grader lent"),
        ({"id": "1", "name": "add", "args": [1]}, "not an object the grader lent"),
        ({"id": ref.id, "name": "secret", "get": True}, "no attribute 'secret'"),
        ({"id": ref.id, "name": "__init__", "args": []}, "no method '__init__'"),
        ({"id": ref.id, "name": "add", "args": "1"}, "must be a list"),
        ({"id": ref.id, "name": "add", "args": [wire.Handle(1, "Box")]}, "not objects of yours"),
        ({"id": ref.id, "name": "add", "args": [wire.Served(7, "Counter")]}, "not an object"),
    ]:
        answer = session.serve(request)
        assert "raised" in answer and says in answer["raised"]["message"], (request, answer)
    assert counter.calls == 0
    assert session.serve({"id": ref.id, "name": "total", "get": True}) == {"ok": wire.Encoded(0)}


def test_a_call_can_run_with_the_graders_function_in_place_of_the_students(tmp_path):
    """RemoteCallable.call(replace=...): the submission's module-level function of that name
    is the judge's for one call (every call of it recorded here), and is its own again
    afterwards, also when the call raised."""
    worker, session = start(tmp_path, '''
def square(x):
    return x * x

def total(xs):
    return sum(square(x) for x in xs)

def broken(xs):
    square(xs[0])
    raise ValueError("after one call")
''')
    try:
        from kvlab.grading.remote import ServedFunction, Submission
        sub = Submission(session)
        cube = ServedFunction(lambda x: x ** 3)
        assert sub.total.call(([1, 2, 3],), {}, replace={"square": cube}) == 36
        assert [call[0] for call in cube.calls] == [(1,), (2,), (3,)]
        assert sub.total([1, 2, 3]) == 14                         # its own square again
        with pytest.raises(RemoteError, match="after one call"):
            sub.broken.call(([5],), {}, replace={"square": cube})
        assert cube.calls[-1][2] == 125 and sub.total([2]) == 4
        assert sub.total.call(([2],), {}, replace={"missing": cube}) == 4
        assert sub.square(3) == 9
    finally:
        worker.stop()


def test_no_served_call_runs_past_the_tests_deadline(tmp_path):
    """The judge serves the worker's calls while it waits; past the test's deadline it stops
    serving, however fast the calls come."""
    worker, session = start(tmp_path, '''
def spin(counter):
    while True:
        counter.add(1)
''', seconds=1.0)
    try:
        from kvlab.grading.process import WorkerTimeout
        from kvlab.grading.remote import Submission
        counter = Counter()
        started = time.monotonic()
        with pytest.raises(WorkerTimeout):
            Submission(session).spin(counter)
        assert counter.calls > 0 and time.monotonic() - started < 5
    finally:
        worker.stop()


# ---- a lab in C: built in a worker, loaded in each test's worker, never in the judge -------------

C_TESTS = '''
import numpy as np
from kvlab.grading.kernel_cases import make_case
from kvlab.grading.testkit import as_array, points


@points(1)
def test_a_small_case(sub, rng):
    """one small case, bit for bit"""
    case = make_case(rng, 2, 2, 32, 40, 16)
    got = as_array(sub.decode_attention(*case.arguments(2)), "out", shape=case.q.shape)
    assert np.array_equal(got.view(np.uint32), case.want().view(np.uint32)), "bits differ"


@points(1)
def test_another_small_case(sub, rng):
    """MQA in blocks of 3"""
    case = make_case(rng, 1, 4, 16, 20, 3)
    got = as_array(sub.decode_attention(*case.arguments(1)), "out", shape=case.q.shape)
    assert np.array_equal(got.view(np.uint32), case.want().view(np.uint32)), "bits differ"
'''

C_SIGNATURE = ("void decode_attention(float *out, const float *q, const kv_cache_view *view, "
               "int n_heads, int n_threads)")


def grade_c(tmp_path, source, name="decode_kernel.c"):
    from kvlab.grading import grade
    tests = tmp_path / "c_tests.py"
    tests.write_text(C_TESTS)
    submission = tmp_path / name
    submission.write_text(source)
    return grade("decode_kernel", submission, tests=tests, seed=5)


def test_a_c_submission_is_built_and_loaded_only_in_workers(tmp_path):
    """Its code runs once per test, each time in a worker whose parent is the judge, never
    in the judge (whose parent is this process) nor in the build's worker (the compiler runs
    no code of the student's). It marks its first call: code that runs at load
    (.init_array, a constructor), which this test used to mark, is refused by the source
    check now (test_grading.py), and the judge never loads the library anyway."""
    marks = tmp_path / "loaded"
    solution = (INSTRUCTOR / "solutions" / "decode_kernel.c").read_text()
    report = grade_c(tmp_path, solution.replace("#include \"decode_kernel.h\"", f'''
#include "decode_kernel.h"
#include <stdio.h>
int getppid(void);
static void mark(void) {{
    FILE *f = fopen("{marks}", "a");
    if (f) {{ fprintf(f, "%d\\n", getppid()); fclose(f); }}
}}
''', 1).replace("    int kv_mul = n_heads / view->n_kv_heads;\n",
                 "    static int marked;\n    if (!marked++) mark();\n"
                 "    int kv_mul = n_heads / view->n_kv_heads;\n", 1))
    assert report.score == 2, report.summary()
    parents = marks.read_text().split()
    assert len(parents) == 2 and len(set(parents)) == 1, parents      # one judge, two tests
    import os
    assert int(parents[0]) != os.getpid()


def test_a_c_file_that_does_not_compile_is_told_what_the_compiler_said(tmp_path):
    report = grade_c(tmp_path, '#include "decode_kernel.h"\n' + C_SIGNATURE + " { oops; }\n")
    assert report.score == 0 and "did not compile" in report.output, report.summary()
    assert "decode_kernel.c:2:" in report.output and "oops" in report.output    # no temp path
    assert "Traceback" not in report.output
    assert all("did not compile" in t.output for t in report.tests)


def test_a_c_file_reaching_around_the_grader_is_not_graded(tmp_path):
    report = grade_c(tmp_path, '#include "decode_kernel.h"\n#include <dlfcn.h>\n'
                               '__attribute__((constructor)) static void early(void) {}\n'
                     + C_SIGNATURE + ' { dlopen("libkvlab.so", 1); }\n')
    assert report.score == 0 and "not graded" in report.output, report.summary()
    for said in ("line 2: `#include <dlfcn.h>`", "line 3: `constructor`", "line 4: `dlopen`"):
        assert said in report.output, report.output


def test_a_c_kernel_that_crashes_or_hangs_loses_that_test_and_grading_goes_on(tmp_path):
    """A crash on MQA (n_kv_heads 1) ends its worker; the next test's worker is new. A
    kernel that never returns is stopped from outside at the test's deadline."""
    solution = (INSTRUCTOR / "solutions" / "decode_kernel.c").read_text()
    crash = solution.replace("    int kv_mul = n_heads / view->n_kv_heads;",
                             "    if (view->n_kv_heads == 1) *(volatile int *)0 = 1;\n"
                             "    int kv_mul = n_heads / view->n_kv_heads;")
    report = grade_c(tmp_path, crash)
    assert report.failed() == ["test_another_small_case"], report.summary()
    assert "SIGSEGV" in report.tests[1].output
    from kvlab.grading import grade
    hang = tmp_path / "hang" / "decode_kernel.c"
    hang.parent.mkdir()
    hang.write_text('#include "decode_kernel.h"\n' + C_SIGNATURE + " { for (;;) {} }\n")
    report = grade("decode_kernel", hang, tests=tmp_path / "c_tests.py", seed=5, test_timeout=3)
    assert report.score == 0 and all("ran too long" in t.output for t in report.tests)


def test_the_c_lab_builds_with_kvlabs_own_flags():
    from kvlab.grading import cbuild
    built = "gcc 12; -std=c11 -O3 -Wall -fno-math-errno -ffp-contract=off -march=native -fopenmp"
    assert cbuild.kit_flags(built) == ["-std=c11", "-O3", "-Wall", "-fno-math-errno",
                                       "-ffp-contract=off", "-march=native", "-fopenmp"]
    sanitized = built + " -fsanitize=address,undefined -fno-omit-frame-pointer -g -O1"
    assert "-fsanitize=address,undefined" not in cbuild.kit_flags(sanitized)
    assert "-ffp-contract=off" in cbuild.kit_flags("an unreadable record")     # kvlab's defaults
    mac = built.replace("-fopenmp", "-Xpreprocessor -fopenmp -I/opt/homebrew/opt/libomp/include")
    assert cbuild.kit_flags(mac)[-2:] == ["-L/opt/homebrew/opt/libomp/lib", "-lomp"]
    # a dispatching build: the flags of the variant whose bits the kernel is compared with
    dispatching = ("gcc 12; -std=c11 -O3 -ffp-contract=off -fopenmp; kernel variants avx512 "
                   "(-mavx2 -mfma -mavx512f), avx2 (-mavx2 -mfma), baseline (the default target)")
    assert cbuild.variant_flags(dispatching, "avx2") == ["-mavx2", "-mfma"]
    assert cbuild.variant_flags(dispatching, "avx512") == ["-mavx2", "-mfma", "-mavx512f"]
    assert cbuild.variant_flags(dispatching, "baseline") == []


def test_the_judges_probe_runs_while_every_thread_of_the_c_code_is_stopped(tmp_path):
    """The kernel lab's bandwidth probe runs inside process.paused(): a thread the library
    starts on its first call (at load, through .init_array, until the source check refused
    that) to slow the probe down, and so make its kernel's share look larger, marks the
    time every 5 ms, and leaves no mark inside the paused window."""
    marks = tmp_path / "marks"
    window = tmp_path / "window"
    tests = tmp_path / "c_tests.py"
    tests.write_text(f'''
import time
from kvlab.grading.kernel_cases import make_case
from kvlab.grading.process import paused
from kvlab.grading.testkit import points


@points(1)
def test_paused(sub, rng):
    """the library's thread is stopped while the judge measures"""
    case = make_case(rng, 1, 1, 8, 5, 16)
    sub.decode_attention(*case.arguments())
    time.sleep(0.3)
    with paused() as stopped:
        assert stopped
        started = time.time()
        time.sleep(0.5)
        ended = time.time()
    time.sleep(0.3)
    with open({str(window)!r}, "w") as f:
        f.write(f"{{started}} {{ended}}")
''')
    solution = (INSTRUCTOR / "solutions" / "decode_kernel.c").read_text()
    submission = tmp_path / "decode_kernel.c"
    submission.write_text(solution.replace('#include "decode_kernel.h"', f'''
#include "decode_kernel.h"
#include <pthread.h>
#include <stdio.h>
#include <time.h>
static void *hog(void *unused) {{
    for (;;) {{
        struct timespec now, pause = {{0, 5000000}};
        clock_gettime(CLOCK_REALTIME, &now);
        FILE *f = fopen("{marks}", "a");
        if (f) {{ fprintf(f, "%.6f\\n", now.tv_sec + now.tv_nsec * 1e-9); fclose(f); }}
        nanosleep(&pause, NULL);
    }}
    return unused;
}}
static void start_hog(void) {{
    pthread_t thread;
    pthread_create(&thread, NULL, hog, NULL);
}}
''', 1).replace("    int kv_mul = n_heads / view->n_kv_heads;\n",
                 "    static int started;\n    if (!started++) start_hog();\n"
                 "    int kv_mul = n_heads / view->n_kv_heads;\n", 1))
    from kvlab.grading import grade
    report = grade("decode_kernel", submission, tests=tests, seed=1)
    assert report.score == 1, report.summary()
    started, ended = (float(x) for x in window.read_text().split())
    times = [float(x) for x in marks.read_text().split()]
    assert sum(t < started for t in times) > 20 and sum(t > ended for t in times) > 20, \
        "the thread did not run around the window: the test proves nothing"
    inside = [t for t in times if started + 0.02 < t < ended - 0.02]
    assert not inside, f"{len(inside)} marks while the judge's probe would run"
