"""The Gradescope package's setup.sh, run as Gradescope runs it, for test_autograder.py's
test_setup_sh_and_the_unprivileged_student_as_on_gradescope (as root with
KVLAB_TEST_GRADESCOPE_SETUP=1, as CI runs it); and `unpack`, the zip laid out as Gradescope
lays it out.

setup.sh is started as soon as pytest has collected that test (tests/conftest.py), at the
lowest priority: its apt-get and its build of kvlab (about 65 s of CPU, two compilers at
once) then run beside the gradings before the test, not between them, in CI's gradings half
(.ci/run), its long pole. It grades nothing: the test waits for it, checks it as before,
and grades with what it installed. Nothing else in the suite uses its user or its folder.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import zipfile
from pathlib import Path

INSTRUCTOR = Path(__file__).resolve().parents[2] / "instructor"
TEST = "test_autograder.py::test_setup_sh_and_the_unprivileged_student_as_on_gradescope"


def wanted() -> bool:
    """Whether the test runs setup.sh here (else it skips)."""
    return os.environ.get("KVLAB_TEST_GRADESCOPE_SETUP") == "1" and os.geteuid() == 0


def unpack(package, root):
    (root / "source").mkdir(parents=True)
    (root / "submission").mkdir()
    with zipfile.ZipFile(package) as archive:
        archive.extractall(root / "source")
        for info in archive.infolist():              # zipfile drops the modes: put them back
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(root / "source" / info.filename, mode)
    return root


class Setup:
    """cache_size's package unpacked in a folder of /tmp (top/autograder) and its setup.sh
    running, its venv top/venv; its output goes to a file outside top."""

    def __init__(self):
        from kvlab.grading.autograder import build
        self.top = Path(tempfile.mkdtemp(prefix="kvlab-gradescope-", dir="/tmp"))
        os.chmod(self.top, 0o755)
        self.root = unpack(build("cache_size", self.top / "cache_size.zip", INSTRUCTOR),
                           self.top / "autograder")
        self.venv = self.top / "venv"
        # as on Gradescope, whose image has no nvcc: CI's KVLAB_CUDA=1 (its own install
        # compiles every GPU kernel) would have this build compile them all again, minutes
        gradescope = {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_CUDA")}
        self.output = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            ["nice", "-n", "19", "bash", str(self.root / "source" / "setup.sh")],
            cwd=self.root / "source", env={**gradescope, "KVLAB_VENV": str(self.venv)},
            stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float):
        """(setup.sh's exit status, the end of what it printed)."""
        status = self.process.wait(timeout=timeout)
        self.output.seek(0)
        return status, self.output.read()[-6000:]

    def remove(self):
        if self.process.poll() is None:                 # apt-get and pip included
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.output.close()
        shutil.rmtree(self.top, ignore_errors=True)


_started = None


def start() -> Setup:
    """The setup started for this session (started now if it was not)."""
    global _started
    if _started is None:
        _started = Setup()
    return _started


def remove():
    global _started
    if _started is not None:
        _started.remove()
        _started = None
