"""The labs, in the order of the chapters they go with; where each one's files are.

A lab ships in kvlab/labs/<name>/ as README.md (the instructions), starter.py (what the
student edits) and checks.py (public self-checks). Its grading tests, with their hidden
randomized cases, live in the repository's instructor/graders/<name>.py and never in the
package, with a reference solution and planted mistakes beside them.

A lab in C (language "c": the kernel lab) has starter.c instead, the header its files are
built against and a harness.py through which the tests call the built code
(kvlab/grading/cbuild.py builds it, in a worker). Its GPU edition (language "cuda") has
starter.cu, built by nvcc with the lab's harness.cu; it needs an NVIDIA GPU and nvcc, so it
is listed apart (GPU_LABS), where the tests that grade every lab of LABS on any machine do
not reach it, and grading it anywhere else is refused in words (require_gpu).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

from ..errors import CudaError
from .policy import Policy, refused_text

LABS_DIR = Path(__file__).resolve().parents[1] / "labs"
# Where a chapter can be opened: the copy installed with kvlab (pyproject.toml ships the
# repository's chapters/ as kvlab/chapters), else a clone's own chapters/ (running from the
# source tree, or an editable install).
CHAPTER_DIRS = (LABS_DIR.parent / "chapters", LABS_DIR.parents[1] / "chapters")
# How a lab's README.md names a chapter: "(`chapters/06_quantization.md` of the course)".
CHAPTER_REFERENCE = re.compile(r"`chapters/(?P<file>[\w.-]+\.md)` of the course")
TEST_TIMEOUT = 60.0          # seconds a test may take, its worker's start included


@dataclasses.dataclass(frozen=True)
class Lab:
    name: str
    number: int
    title: str
    chapter: str          # the chapter it goes with, chapters/<chapter>.md
    points: int           # what the hidden grading tests are worth in all
    topic: str            # what the student writes ("a KV cache"), for refusals
    kvlab: Tuple[str, ...] = ()   # the kvlab names a submission may use
    models: Tuple[str, ...] = ()  # named models its hidden tests load (kvlab fetch NAME)
    language: str = "python"      # or "c": the submission is a C file, built in a worker
    extra_files: Tuple[str, ...] = ()   # what `kvlab lab start` copies beside the starter
    # processes and threads the worker's user may have, where the worker becomes one (the
    # autograder's): 1 where the worker's CPU time is what is graded (a child process that
    # is reaped unwaited takes its CPU time with it)
    max_processes: int = 256
    build_files: Tuple[str, ...] = ()   # what the grader builds with it (the lab's own copies)

    @property
    def compiled(self) -> bool:
        """A lab whose submission is built into a library (C, CUDA), not imported."""
        return self.language in ("c", "cuda")

    @property
    def requires_gpu(self) -> bool:
        return self.language == "cuda"

    @property
    def folder(self) -> Path:
        return LABS_DIR / self.name

    @property
    def suffix(self) -> str:
        """The submission's file name ends with this: ".py", ".c" for a C lab, ".cu" for CUDA."""
        return {"c": ".c", "cuda": ".cu"}.get(self.language, ".py")

    @property
    def starter(self) -> Path:
        return self.folder / f"starter{self.suffix}"

    @property
    def checks(self) -> Path:
        return self.folder / "checks.py"

    @property
    def instructions(self) -> Path:
        return self.folder / "README.md"

    def instructions_text(self) -> str:
        """The instructions, each chapter they name given as a link to a file the student
        can open: the README's own `chapters/NAME.md` is relative to the course's
        repository, which means nothing next to a copy in the student's folder."""
        text = self.instructions.read_text(encoding="utf-8")
        if self.language == "c":
            from .cbuild import refused_text as refused
        elif self.language == "cuda":
            from .cbuild import cuda_refused_text as refused
        else:
            refused = refused_text
        return CHAPTER_REFERENCE.sub(_link_to_chapter, text).rstrip("\n") + "\n\n" + refused()

    @property
    def policy(self) -> Policy:
        return Policy(self.topic, self.kvlab)


LABS: Dict[str, Lab] = {lab.name: lab for lab in (
    Lab("attention", 1, "Attention with a KV cache in NumPy", "01_kv_cache", 19,
        "attention and its cache"),
    Lab("own_cache", 2, "Your own KV cache: same tokens, timed", "01_kv_cache", 17,
        "a KV cache and the forward pass over it"),
    Lab("cache_size", 3, "Cache size by hand and measured", "02_cache_size", 16,
        "the cache-size arithmetic and its measurement",
        ("kvlab.measure.resident_bytes", "kvlab.measure.release_freed_memory")),
    Lab("gqa", 4, "GQA: attention that shares heads, and an MHA model converted", "03_gqa", 19,
        "grouped-query attention and the conversion",
        ("kvlab.accuracy.perplexity", "kvlab.accuracy.kl_divergence")),
    Lab("block_allocator", 5, "A block allocator with fork and copy-on-write", "04_paged", 19,
        "a block allocator"),
    Lab("paged_attention", 6, "Attention through a block table", "04_paged", 14,
        "attention over a paged pool"),
    Lab("prefix_caching", 7, "Prefix caching: chained block hashes and LRU eviction",
        "04_paged", 18, "a prefix cache"),
    Lab("scheduler", 8, "A batching scheduler with preemption", "05_batching", 18,
        "a scheduler"),
    Lab("int8_cache", 9, "int8 cache quantization with an error bound", "06_quantization", 18,
        "int8 quantization"),
    Lab("flash_decoding", 10, "Flash-decoding: pieces, a merge, any split", "07_gpu_kernels", 14,
        "split attention and its merge"),
    Lab("cache_eviction", 11, "Cache eviction: attention sinks, heavy hitters, re-rotated "
        "positions", "08_fewer_positions", 16, "cache policies and their re-rotation",
        models=("smollm2-135m",)),
    Lab("speculative_decoding", 12, "Speculative decoding: prompt lookup, one-pass verification, "
        "rollback, the sampling rejection rule", "09_speculative", 22, "speculative decoding"),
    Lab("weight_quantization", 13, "4-bit weights chosen by their activations: AWQ's scale "
        "search", "10_weight_quantization", 21, "weight quantization",
        models=("smollm2-135m",)),
    Lab("decode_kernel", 14, "A decode-attention kernel in C over a paged int8 cache, at the "
        "memory's speed", "07_gpu_kernels", 20, "a decode-attention kernel", language="c",
        extra_files=("decode_kernel.h",)),
    Lab("serving_capstone", 15, "The capstone: your scheduler, drafter, block allocator and "
        "prefix cache in kvlab's Engine, scored by goodput under an SLO", "11_serving_at_scale", 23,
        "the plug-ins of a serving engine", max_processes=1),
)}


# Labs that need an NVIDIA GPU and nvcc to be graded: apart from LABS, whose every lab the
# test suite grades on any machine (a GPU lab's tests are tests/cuda/test_decode_kernel_cuda_lab.py).
GPU_LABS: Dict[str, Lab] = {lab.name: lab for lab in (
    Lab("decode_kernel_cuda", 14, "Lab 14 on a GPU: the decode-attention kernel in CUDA, "
        "bit for bit, at the memory's speed", "07_gpu_kernels", 20,
        "a decode-attention kernel", language="cuda",
        extra_files=("decode_kernel_cuda.cuh",), build_files=("harness.cu",)),
)}


class GpuRequired(CudaError):
    """The lab needs an NVIDIA GPU and nvcc, and this machine lacks one of them."""


def gpu_missing() -> Optional[str]:
    """Why this machine cannot build and run a GPU lab's kernels, or None when it can."""
    from .cbuild import find_nvcc
    if find_nvcc() is None:
        return "no nvcc found (CUDA_HOME, CUDA_PATH or the PATH)"
    from .. import cuda
    return cuda.why_not()


def require_gpu(lab: Lab) -> None:
    """GpuRequired, in words, where `lab` needs a GPU this machine does not have."""
    if lab.requires_gpu:
        why = gpu_missing()
        if why is not None:
            raise GpuRequired(f"lab {lab.name} needs an NVIDIA GPU and nvcc, and this machine "
                              f"cannot run it: {why}. Lab 14 in C (decode_kernel) is the same "
                              f"lab on a CPU.")


def chapter_file(file_name: str) -> Optional[Path]:
    """The chapter chapters/<file_name> as this kvlab can open it, or None."""
    for folder in CHAPTER_DIRS:
        path = folder / file_name
        if path.is_file():
            return path
    return None


def _link_to_chapter(reference: "re.Match[str]") -> str:
    path = chapter_file(reference["file"])
    if path is None:        # a kvlab without its chapters: the course's own name for it
        return reference[0]
    return f"{reference[0]}: [`{path}`]({path.as_uri()})"


def get_lab(name: str) -> Lab:
    """The lab of that name, of LABS or GPU_LABS."""
    found = LABS.get(name) or GPU_LABS.get(name)
    if found is None:
        raise ValueError(f"no lab named {name!r}; the labs are: "
                         f"{', '.join([*LABS, *GPU_LABS])}")
    return found


def find_instructor(explicit: Optional[Union[str, Path]] = None,
                    from_clone_here: bool = False) -> Optional[Path]:
    """The instructor/ folder with the hidden tests: the one given, else $KVLAB_INSTRUCTOR,
    else the one beside the package when kvlab runs from its source tree (an editable
    install, pip install -e, or PYTHONPATH pointing at the clone); with from_clone_here,
    else the current directory's when it is the root of a clone (an instructor building a
    Gradescope package after a plain pip install). After a plain `pip install .` the
    package lives in site-packages, so grading finds no instructor/ unless it is named:
    never the current directory's, which could be a student's folder, and a TA grading
    there must not take hidden tests planted in it (instructor_hint() says where one is).
    None when there is none."""
    here = Path.cwd()
    clone_here = from_clone_here and (here / "kvlab" / "grading").is_dir()
    for candidate in (explicit, os.environ.get("KVLAB_INSTRUCTOR"),
                      _source_tree() / "instructor" if _source_tree() else None,
                      here / "instructor" if clone_here else None):
        if candidate and (Path(candidate) / "graders").is_dir():
            return Path(candidate).resolve()
        if explicit is not None and candidate is explicit:
            raise FileNotFoundError(f"{explicit} has no graders/ folder: it is not the "
                                    f"instructor/ folder of a kvlab clone")
    return None


def _source_tree() -> Optional[Path]:
    """The clone this kvlab runs from, or None for an installed copy (site-packages)."""
    root = LABS_DIR.parents[1]
    return root if (root / "pyproject.toml").is_file() else None


HOW_TO_NAME_INSTRUCTOR = (
    "kvlab grade takes the hidden tests from --instructor DIR, else $KVLAB_INSTRUCTOR, else "
    "the clone's instructor/ when kvlab runs from its source tree (pip install -e .); after "
    "a plain pip install . name it: --instructor path/to/kvlab/instructor")


def instructor_hint() -> str:
    """What to do when no instructor/ was found: the sentence above, and the instructor/
    folder of a clone in the current directory or one of its parents, where there is one
    (named, never used: the current directory could be a student's)."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        candidate = folder / "instructor"
        if (candidate / "graders").is_dir() and (folder / "kvlab" / "grading").is_dir():
            return (f"{HOW_TO_NAME_INSTRUCTOR} (there is one at {candidate}: if it is yours, "
                    f"pass --instructor {candidate})")
    return HOW_TO_NAME_INSTRUCTOR


def hidden_tests(lab: Lab, instructor: Optional[Path]) -> Optional[Path]:
    if instructor is None:
        return None
    path = instructor / "graders" / f"{lab.name}.py"
    return path if path.is_file() else None


def start_lab(name: str, dest: Union[str, Path] = ".", overwrite: bool = False) -> Path:
    """Copy lab `name`'s starter to dest/<name>.py (.c for a C lab, with the header it is
    built against) and its instructions to dest/<name>.md, with links to the chapters that
    work from there (Lab.instructions_text); returns the starter's new path. Refuses to
    overwrite a student's work unless told to."""
    lab = get_lab(name)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    starter, instructions = dest / f"{lab.name}{lab.suffix}", dest / f"{lab.name}.md"
    extras = [dest / extra for extra in lab.extra_files]
    for path in (starter, instructions, *extras):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} already exists (pass overwrite=True, or --force, "
                                  f"to replace it)")
    shutil.copyfile(lab.starter, starter)
    for extra in lab.extra_files:
        shutil.copyfile(lab.folder / extra, dest / extra)
    instructions.write_text(lab.instructions_text(), encoding="utf-8")
    return starter
