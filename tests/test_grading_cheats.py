"""What a submission cannot do to its own grade. First the cheats of instructor/cheats/ (issue
34): for every graded test, a submission that skips exactly the work the test names earns
0 on it. Then one regression test per trick that used to work (issue 16), each scoring the cheat as the work it really contains and the honest
solution full marks (test_grading.py).

Most tricks are written here the way a determined student would write them past the source
check (kvlab/grading/policy.py): modules reached through another module's attributes,
built-up names, getattr taken from builtins (EVADE below), and so on. That check only turns
the easy ways into a clear refusal; these tests show that the judge holds without it: the score is computed in another process from the judge's
own tests, time limits are enforced from outside, and no process the submission starts
outlives its test.
"""
import ast
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from c_edits import apply_edit, declared
from grader_tests import grader_tests

pytest.importorskip("kvlab._kvlab")
from kvlab.grading import LABS, grade  # noqa: E402
from kvlab.grading.labs import get_lab  # noqa: E402
from kvlab.grading.process import WorkerProcess  # noqa: E402
from kvlab.grading.remote import RemoteError, Session  # noqa: E402
from named_models import require_named_models  # noqa: E402
from trimmed_graders import slow_tests, without_tests  # noqa: E402

INSTRUCTOR = Path(__file__).resolve().parents[1] / "instructor"
SOLUTION = (INSTRUCTOR / "solutions" / "cache_size.py").read_text()
STARTER = LABS["cache_size"].starter.read_text()

# a forged report, as the runner and Gradescope read them: a million points
FORGED = json.dumps({"lab": "cache_size", "submission": "x", "output": "", "execution_time": 0,
                     "graded_with": "hidden tests", "seed": 0, "score": 1e6,
                     "tests": [{"name": "forged", "score": 1e6, "max_score": 1.0,
                                "output": "", "visibility": "visible", "status": "passed"}]})


# os, sys, signal and getattr, reached past the source check (it refuses `x.os.fork`,
# `x.sys.modules`, `x.signal` and the name getattr)
EVADE = '''
import shutil as _ue
_os, _sys = _ue.os, _ue.sys
_signal = _sys.modules["sig" + "nal"]
_getattr = _sys.modules["buil" + "tins"].getattr
'''


CHEATS = sorted((INSTRUCTOR / "cheats").glob("*/*.py"))
C_CHEATS = sorted((INSTRUCTOR / "cheats").glob("*/*.edit"))     # a C lab's (c_edits.py)


def graders(lab):
    return INSTRUCTOR / "graders" / f"{lab}.py"


def graders_for(lab: str, aimed: set, tmp_path: Path) -> Path:
    """The lab's hidden tests for grading a cheat: all of them, but for the tests marked slow
    (@points(..., slow=N): lab 13's searches on SmolLM2, up to 35 s of CPU a grading) that
    the cheat does not aim at. What this file checks of a cheat is its aimed tests and that
    the rest of the solution still scores; a slow test it leaves alone only costs CI time."""
    return without_tests(graders(lab), slow_tests(graders(lab)) - aimed, tmp_path)


def cheat_list(path: Path, name: str) -> list:
    """The list `name` (TARGETS, BUILT_ON) a cheat file declares (read without running
    it), or None."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return list(ast.literal_eval(node.value))
    return None


def cheat_targets(path: Path) -> set:
    """The TARGETS list a cheat file declares."""
    targets = cheat_list(path, "TARGETS")
    assert targets is not None, f"{path} declares no TARGETS"
    return set(targets)


def cheat_submission(path: Path) -> str:
    """The reference solution, then the cheats of the same lab that `path` is BUILT_ON (in
    that order, each replacing what the one before defined), then `path` itself."""
    parts = [INSTRUCTOR / "solutions" / f"{path.parent.name}.py"]
    parts += [path.parent / f"{base}.py" for base in cheat_list(path, "BUILT_ON") or []]
    return "\n\n".join(part.read_text() for part in parts + [path])


@pytest.mark.parametrize("cheat", CHEATS, ids=[f"{p.parent.name}/{p.stem}" for p in CHEATS])
def test_a_cheat_earns_nothing_on_the_tests_whose_work_it_skips(cheat, tmp_path):
    """instructor/cheats/<lab>/<cheat>.py replaces some of the reference solution's functions
    with code that skips the work its TARGETS tests name (a table of the worked examples,
    recomputing instead of caching, counts without the thing counted ...): graded past the
    source check, it earns 0 on each of them, whatever the draw."""
    lab = cheat.parent.name
    require_named_models(get_lab(lab).models)
    submission = tmp_path / f"{lab}.py"
    submission.write_text(cheat_submission(cheat))
    aimed = cheat_targets(cheat)
    report = grade(lab, submission, tests=graders_for(lab, aimed, tmp_path),
                   seed=zlib.crc32(cheat.stem.encode()))
    assert aimed and aimed <= {t.function for t in report.tests}, "unknown test names"
    # graded, not refused: the cheat is the judge's to catch, not the source check's
    assert not report.refused and report.graded_with == "hidden tests", report.summary()
    earned = {t.function: t.score for t in report.tests if t.function in aimed and t.score > 0}
    assert not earned, f"{cheat.name} earned {earned}\n{report.summary()}"
    # and the rest of the solution still runs: the cheat fails for what it skips
    assert report.score > 0, report.summary()


@pytest.mark.parametrize("cheat", C_CHEATS, ids=[f"{p.parent.name}/{p.stem}" for p in C_CHEATS])
def test_a_cheat_in_c_earns_nothing_on_the_tests_whose_work_it_skips(cheat, tmp_path):
    """A C lab's cheats are edits of its reference solution that skip the work of their
    TARGETS (answers without reading the cache, calls skipped while timed): each earns 0 on
    them, and the rest of the solution still runs."""
    lab = cheat.parent.name
    submission = tmp_path / f"{lab}.c"
    submission.write_text(apply_edit(cheat, INSTRUCTOR / "solutions"))
    report = grade(lab, submission, tests=graders(lab), seed=zlib.crc32(cheat.stem.encode()))
    aimed = declared(cheat, "TARGETS")
    assert aimed and aimed <= {t.function for t in report.tests}, "unknown test names"
    assert not report.refused and report.graded_with == "hidden tests", report.summary()
    earned = {t.function: t.score for t in report.tests if t.function in aimed and t.score > 0}
    assert not earned, f"{cheat.name} earned {earned}\n{report.summary()}"
    untimed = {t.__name__ for t in grader_tests(graders(lab)) if not getattr(t, "timed", False)}
    assert any(t.passed for t in report.tests if t.function in untimed - aimed) or \
        untimed <= aimed, report.summary()


@pytest.mark.parametrize("lab", list(LABS))
def test_every_graded_test_has_a_cheat_that_it_catches(lab):
    tests = {t.__name__ for t in grader_tests(graders(lab))}
    aimed = set().union(*[cheat_targets(p) for p in CHEATS if p.parent.name == lab],
                        *[declared(p, "TARGETS") for p in C_CHEATS if p.parent.name == lab])
    assert aimed <= tests, f"cheats name tests {lab} does not have: {sorted(aimed - tests)}"
    assert tests <= aimed, f"no cheat in instructor/cheats/{lab}/ targets {sorted(tests - aimed)}"


def hidden(submission, lab="cache_size", **options):
    require_named_models(get_lab(lab).models)
    return grade(lab, submission, tests=INSTRUCTOR / "graders" / f"{lab}.py", seed=3, **options)


def forge_code(results: Path) -> str:
    """Code that writes the forged report over every report the judge or runner might read
    (and leaves forged.txt beside `results`, to show that it ran)."""
    return f'''
import glob, json
def forge():
    with open({str(results.parent / "forged.txt")!r}, "a") as f:
        f.write("forged\\n")
    for path in glob.glob("/tmp/kvlab-grade-*/report.json") + [{str(results)!r}]:
        try:
            with open(path, "w") as f:
                f.write({FORGED!r})
        except OSError:
            pass
'''


# ---- the submission delegates to kvlab -------------------------------------------------------

DELEGATES = {
    "attention": "from kvlab import reference\n\ndef attend(q, keys, values):\n"
                 "    return reference.attention(q[None], keys, values, [len(keys) - 1])[0]\n",
    "own_cache": "from kvlab import reference\n\ndef forward(model, tokens, cache=None):\n"
                 "    return reference.forward(model._c, model._w, tokens)\n",
    "cache_size": "import kvlab\n\ndef kv_cache_bytes(config, seq_len, batch=1, dtype='fp16'):\n"
                  "    return kvlab.kv_cache_bytes(config, seq_len, batch, dtype)\n",
    "block_allocator": "import kvlab\n\nclass BlockAllocator(kvlab.PagedPool):\n    pass\n",
    "paged_attention": "import kvlab\n\ndef paged_attend(q, kb, vb, table, length):\n"
                       "    return kvlab.PagedPool\n",
    "scheduler": "from kvlab.scheduler import Scheduler as Theirs\n",
    "flash_decoding": "from kvlab.reference import attention\n\ndef split_attend(q, k, v, n):\n"
                      "    return attention(q[None], k, v, [len(k) - 1])[0]\n",
    "int8_cache": "import kvlab.quant\n\ndef quantize_int8(x, group):\n"
                  "    q = kvlab.quant.quantize(x, 'int8', group)\n    return q.codes, q.scales\n",
    "gqa": "from kvlab.accuracy import perplexity\nfrom kvlab import reference\n\n"
           "def forward(model, tokens):\n    return reference.forward(model._c, model._w, tokens)\n",
    "prefix_caching": "import kvlab\n\nclass PrefixCache(kvlab.PagedPool):\n    pass\n",
    "speculative_decoding": "from kvlab.speculative import PromptLookup\n\n"
                            "def propose(tokens, k, max_ngram=3):\n"
                            "    return PromptLookup(max_ngram).propose(tokens, k)\n",
    "cache_eviction": "from kvlab.cache_policy import AttentionSinks, HeavyHitters\n\n"
                      "def sink_rows(length, n_keep, sinks):\n"
                      "    return AttentionSinks(sinks, n_keep - sinks).keep(None, n_keep)\n",
    "weight_quantization": "from kvlab import weight_quantization as wq\n\n"
                           "def channel_scales(magnitude, alpha):\n"
                           "    return wq.awq_scales(magnitude, alpha)\n",
}


@pytest.mark.parametrize("lab", list(DELEGATES))
def test_delegating_to_kvlab_scores_zero_with_a_clear_reason(lab, tmp_path):
    solution = (INSTRUCTOR / "solutions" / f"{lab}.py").read_text()
    submission = tmp_path / f"{lab}.py"
    submission.write_text(solution + "\n\n" + DELEGATES[lab])
    report = hidden(submission, lab)
    assert report.score == 0, report.summary()
    assert "yourself" in report.output and "is not allowed here" in report.output, report.output
    assert f"this lab is about writing {get_lab(lab).topic}" in report.output


def test_the_worker_refuses_kvlab_and_instructor_even_past_the_source_check(tmp_path):
    """The import guard in the worker, driven directly (no source check in front of it)."""
    rules = get_lab("cache_size").policy.to_dict()
    cases = {
        "b = __builtins__['__im' + 'port__']('kvlab.quant')\n": "kvlab.quant",
        "import kvlab.measure\nfrom kvlab.measure import kv_cache_bytes\n": "kvlab.measure.kv_cache_bytes",
        "import importlib\n": "importlib",
        EVADE + "_sys.modules['importlib'].import_module('instructor.solutions')\n": "instructor",
        # kvlab is not even importable by the standard library on the submission's behalf
        EVADE + "_sys.modules['importlib'].import_module('kvlab.quant')\n": "not available",
        "import pydoc\n": "pydoc",
        "import kvlab.measure\nimport kvlab.measure as m\n": None,        # allowed
    }
    for code, refused in cases.items():
        path = tmp_path / "submission.py"
        path.write_text(code)
        worker = WorkerProcess(tmp_path)
        try:
            session = Session(worker, time.monotonic() + 30)
            if refused is None:
                session.ask({"op": "load", "path": str(path), "policy": rules})
                continue
            with pytest.raises(RemoteError) as raised:
                session.ask({"op": "load", "path": str(path), "policy": rules})
            assert raised.value.is_a("ImportError") and refused in raised.value.message, code
        finally:
            worker.stop()


def test_kvlabs_own_code_named_in_a_string_is_refused(tmp_path):
    """pydoc.locate (and pickle, timeit, unittest.mock ...) import a module named in a string,
    from their own code rather than the submission's."""
    submission = tmp_path / "int8_cache.py"
    submission.write_text((INSTRUCTOR / "solutions" / "int8_cache.py").read_text() + '''
import pydoc
_quantize = pydoc.locate("kvlab.quant.quantize")
''')
    report = hidden(submission, "int8_cache")
    assert report.score == 0 and "`pydoc` is not allowed" in report.output


def test_a_lent_model_holds_nothing_in_the_worker(tmp_path):
    """What the cache-size lab's model keeps for the grader (its secret block size, which
    caches were filled) and the GQA lab's reference functions were once attributes of an
    object in the worker. Now every lent object stays in the judge: the proxy the student's
    code holds answers only the names the object serves, and nothing else is behind it."""
    submission = tmp_path / "cache_size.py"
    found = tmp_path / "found.txt"
    submission.write_text(SOLUTION + EVADE + f'''

def measure_resident_growth(model, seq_len, batch):
    reached = []
    for name in ("_extra" + "_bytes", "_model", "caches", "__di" + "ct__", "log"):
        try:
            reached.append((name, repr(_getattr(model, name))[:200]))
        except AttributeError:
            pass
    _inside = _getattr(object, "__getattri" + "bute__")
    served, worker = _inside(model, "_served"), _inside(model, "_worker")
    reached += [("kvlab module", n) for n in _sys.modules if n.partition(".")[0] == "kvlab"]
    fields = _getattr(worker, "__di" + "ct__")
    reached += [("worker", n) for n in fields if "module 'kvlab" in repr(fields[n])]
    with open({str(found)!r}, "w") as f:
        f.write(repr((served, reached)))
    return 0
''')
    report = hidden(submission)
    text = found.read_text()
    assert "Served(" in text and text.endswith(", [])"), text
    assert report.failed() == ["test_measured_growth_matches_the_formula"], report.summary()


OWN_CACHE = (INSTRUCTOR / "solutions" / "own_cache.py").read_text()

OWN_CACHE_FAKES = {     # (made-up step times, a cache never read: instructor/cheats/own_cache/)
    # kvlab's own forward pass, imported by name past the source check: the model is lent
    # from the judge, kvlab is never loaded in the worker, and the finder refuses to load it
    "kvlab imported by name past the check": (EVADE + """
def forward(model, tokens, cache=None):
    reference = _sys.modules["importlib"].import_module("kvlab.reference")
    return reference.forward(model._c, model._w, tokens)
""", {"test_forward_without_a_cache_matches_the_reference",
      "test_prefill_then_decode_matches_the_uncached_run",
      "test_greedy_tokens_are_the_same_with_and_without_the_cache",
      "test_the_cache_holds_what_the_formula_says", "test_step_times_are_measured"}),
}


@pytest.mark.parametrize("fake", list(OWN_CACHE_FAKES))
def test_own_cache_cannot_fake_its_cache_or_its_timing(fake, tmp_path):
    """The lent model's log shows how many tokens each step ran, and when."""
    code, loses = OWN_CACHE_FAKES[fake]
    submission = tmp_path / "own_cache.py"
    submission.write_text(OWN_CACHE + code)
    report = hidden(submission, "own_cache")
    assert set(report.failed()) == loses, report.summary()


SPECULATIVE = (INSTRUCTOR / "solutions" / "speculative_decoding.py").read_text()

SPECULATIVE_FAKES = {     # (the skipped-work ones are instructor/cheats/speculative_decoding/)
    # the count and the model behind the proxy, reached for: the proxy has neither
    "the grader's count and model reached through the proxy": ("""
def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):
    for reach in (lambda: model.passes.clear(), lambda: model._model, lambda: model._cache):
        try:
            reach()
        except AttributeError:
            pass
    return generate_plain(model, prompt, n_new), {"passes": 1, "drafted": 0, "accepted": 0}
""", {"test_speculation_takes_fewer_passes_than_tokens", "test_measurement_reports_what_ran",
      "test_speculative_generation_keeps_the_greedy_tokens",
      "test_drafts_never_pass_the_tokens_still_wanted"}),
}


@pytest.mark.parametrize("fake", list(SPECULATIVE_FAKES))
def test_speculative_decoding_cannot_fake_its_passes_or_its_measurement(fake, tmp_path):
    """The model stays in the judge, which counts and times every pass it runs."""
    code, loses = SPECULATIVE_FAKES[fake]
    submission = tmp_path / "speculative_decoding.py"
    submission.write_text(SPECULATIVE + code)
    report = hidden(submission, "speculative_decoding")
    assert set(report.failed()) == loses, report.summary()


def test_importing_the_instructors_solution_scores_zero(tmp_path):
    submission = tmp_path / "cache_size.py"
    submission.write_text("from instructor.solutions.cache_size import *\n")
    report = hidden(submission)
    assert report.score == 0 and "instructor" in report.output
    # past the source check, the worker refuses it at import time
    submission.write_text("i = __builtins__['__im' + 'port__']\n"
                          "sol = i('instructor.solutions.cache_size', fromlist=['*'])\n"
                          "kv_bytes_per_token = sol.kv_bytes_per_token\n")
    report = hidden(submission)
    assert report.score == 0


# ---- the submission forges the results -----------------------------------------------------

def test_forged_results_written_at_exit_or_from_a_thread_change_nothing(tmp_path):
    results = tmp_path / "results.json"
    submission = tmp_path / "cache_size.py"
    submission.write_text(STARTER + forge_code(results) + EVADE + '''
import threading, time, weakref

class Keeper:
    pass

keeper = Keeper()
_sys.modules["buil" + "tins"].setattr(weakref.finalize(keeper, forge), "ate" + "xit", True)   # atexit by another name

def keep_forging():
    for _ in range(200):
        forge()
        time.sleep(0.01)

threading.Thread(target=keep_forging, daemon=False).start()
''')
    report = hidden(submission, results=results)
    assert (tmp_path / "forged.txt").is_file(), "the forger never ran: the test proves nothing"
    assert report.score == 0, report.summary()
    written = json.loads(results.read_text())
    assert written["score"] == 0 and len(written["tests"]) == 10, written
    assert sum(t["max_score"] for t in written["tests"]) == 16


def test_forged_results_and_os_exit_change_nothing(tmp_path):
    results = tmp_path / "results.json"
    submission = tmp_path / "cache_size.py"
    submission.write_text(STARTER + forge_code(results) + EVADE + '''
def kv_bytes_per_token(*args):
    forge()
    _os._exit(0)
''')
    report = hidden(submission, results=results)
    assert (tmp_path / "forged.txt").is_file(), "the forger never ran: the test proves nothing"
    assert report.score == 0 and report.max_score == 16, report.summary()
    assert json.loads(results.read_text())["score"] == 0
    ended = [t for t in report.tests if t.function.startswith("test_bytes_per_token")]
    assert ended and all("exit status 0" in t.output for t in ended)


def test_changing_the_tests_file_costs_the_whole_grade(tmp_path):
    tests = tmp_path / "graders.py"
    tests.write_text((INSTRUCTOR / "graders" / "cache_size.py").read_text())
    submission = tmp_path / "cache_size.py"
    submission.write_text(SOLUTION + f'''
with open({str(tests)!r}, "a") as f:
    f.write("\\n# touched\\n")
''')
    report = grade("cache_size", submission, tests=tests, seed=3)
    assert report.score == 0 and "grading refused" in report.output
    assert "NOT GRADED" in report.summary().splitlines()[0]
    assert str(tests) in report.output


# ---- the submission runs longer, louder or wider than it may -----------------------------------

def test_ignoring_signals_does_not_stop_the_time_limit(tmp_path):
    submission = tmp_path / "cache_size.py"
    submission.write_text(SOLUTION + EVADE + '''
ignore = _getattr(_signal, "sig" + "nal")
for name in ("SIGALRM", "SIGTERM", "SIGINT", "SIGHUP", "SIGVTALRM", "SIGPROF"):
    ignore(_getattr(_signal, name), _signal.SIG_IGN)

def max_requests(*args, **kwargs):
    while True:
        pass
''')
    # 6 s: every test of this grading has the limit, and the honest ones (filling real caches
    # through the lent model, many round trips) must finish within it on a CI machine that
    # runs the other half of the tests beside this one (.ci/run)
    report = hidden(submission, test_timeout=6.0)
    assert set(report.failed()) == {"test_max_requests", "test_max_requests_returns_a_whole_number"}
    assert all("ran too long" in t.output for t in report.tests if not t.passed)


def test_lab_15s_work_between_plug_in_calls_is_charged_to_the_clock(tmp_path):
    """Lab 15 charges the worker's CPU time past an allowance a call (kvlab.grading.plugin_cpu).
    Work the worker does while it waits for the next question (a signal handler, which needs
    no thread: the autograder refuses threads) is charged at that next call: 12 bursts of
    20 ms from the first call on put 0.1 s or more on the clock (each burst less at most 9
    allowances of 1 ms, the most the slowness factor and the carried credit free). What the
    import left of the startup's allowance (0.3 s, times the slowness) used to take 70 ms
    of them at the most, and often all."""
    submission = tmp_path / "serving_capstone.py"
    submission.write_text((INSTRUCTOR / "solutions" / "serving_capstone.py").read_text() + EVADE + f'''
_time = _sys.modules["ti" + "me"]
_bursts = []

def _arm():                         # one SIGALRM in 10 ms of wall time
    _getattr(_signal, "setitimer")(_getattr(_signal, "ITIMER_REAL"), 0.01)

def _burst(signum, frame):          # runs while the worker waits for the next question
    start = _time.process_time()
    while _time.process_time() - start < 0.020:
        pass
    _bursts.append(_time.process_time() - start)
    with open({str(tmp_path / "bursts.txt")!r}, "a") as f:
        f.write("%d %.3f\\n" % (_os.getpid(), _time.process_time()))
    if len(_bursts) < 12:
        _arm()

class Drafter(Drafter):
    armed = False

    def propose(self, tokens, k):       # from the first call on: the run's own calls
        if not Drafter.armed:
            Drafter.armed = True
            _getattr(_signal, "sig" + "nal")(_getattr(_signal, "SIGALRM"), _burst)
            _arm()
        return super().propose(tokens, k)
''')
    report = hidden(submission, "serving_capstone")
    assert (tmp_path / "bursts.txt").is_file(), "no burst ran: the test proves nothing"
    tier = next(t for t in report.tests if t.function == "test_goodput_reaches_kvlabs_default_engine")
    charged = re.search(r"([0-9.]+) ms of your plug-ins' CPU time charged", tier.output)
    assert charged and float(charged.group(1)) >= 100, tier.output
    gate = next(t for t in report.tests if t.function.startswith("test_the_capstone_run"))
    assert gate.passed, report.summary()     # the tokens are still generate's: only time moved


def test_an_output_flood_is_capped_and_costs_the_judge_no_memory(tmp_path):
    submission = tmp_path / "cache_size.py"
    submission.write_text(SOLUTION + '''
import sys
_chunk = "x" * (1 << 20)
_flooded = []

def kv_bytes_per_token(n_layers, n_kv_heads, head_dim, bytes_per_element):
    if not _flooded:                        # 300 MiB on stdout, once in each worker
        _flooded.append(True)
        for _ in range(300):
            sys.stdout.write(_chunk)
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_element
''')
    script = (f"import resource, json\nfrom kvlab.grading import grade\n"
              f"r = grade('cache_size', {str(submission)!r}, "
              f"tests={str(INSTRUCTOR / 'graders' / 'cache_size.py')!r}, seed=3)\n"
              f"print(json.dumps([r.score, max(len(t.output) for t in r.tests), "
              f"resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr
    score, longest, peak_kib = json.loads(run.stdout.strip().splitlines()[-1])
    assert score == 16 and longest < 4000
    # the judge and the workers, the largest of them: far below the 300 MiB printed
    assert peak_kib < 200 * 1024, peak_kib


def test_processes_the_submission_starts_do_not_outlive_grading(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    os.chmod(marks, 0o777)
    submission = tmp_path / "cache_size.py"
    submission.write_text(SOLUTION + EVADE + f'''
import time
if _os.fork() == 0:                          # a detached grandchild, as daemons are made
    _os.setsid()
    if _os.fork() == 0:
        pid = _os.getpid()
        while True:
            with open({str(marks)!r} + "/" + str(pid), "w") as f:
                f.write(str(time.time()))
            time.sleep(0.02)
    _os._exit(0)
''')
    report = hidden(submission)
    assert report.score == report.max_score, report.summary()
    time.sleep(0.3)
    pids = [int(p.name) for p in marks.iterdir()]
    assert pids, "the submission's processes never ran: the test proves nothing"
    for pid in pids:
        assert not _alive_forked_worker(pid), f"process {pid} started by the submission is alive"
    before = {p.name: p.stat().st_mtime for p in marks.iterdir()}
    time.sleep(0.3)
    assert {p.name: p.stat().st_mtime for p in marks.iterdir()} == before, "still writing"


def _alive_forked_worker(pid: int) -> bool:
    """pid is a live process forked from a worker (not gone, not a zombie, not reused)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return state != "Z" and "worker.py" in command
