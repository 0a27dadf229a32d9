"""The labs, in the order of the chapters they go with, and copying a starter out for a student."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Dict, Union

LABS_DIR = Path(__file__).resolve().parents[1] / "labs"


@dataclasses.dataclass(frozen=True)
class Lab:
    name: str
    number: int
    title: str
    chapter: str          # the chapter it goes with, chapters/<chapter>.md

    @property
    def folder(self) -> Path:
        return LABS_DIR / self.name

    @property
    def starter(self) -> Path:
        return self.folder / "starter.py"

    @property
    def grader(self) -> Path:
        return self.folder / f"test_{self.name}.py"

    @property
    def instructions(self) -> Path:
        return self.folder / "README.md"


LABS: Dict[str, Lab] = {lab.name: lab for lab in (
    Lab("attention", 1, "Attention with a KV cache in NumPy", "01_kv_cache"),
    Lab("cache_size", 2, "Cache size by hand and measured", "02_cache_size"),
    Lab("block_allocator", 3, "A block allocator with fork and copy-on-write", "04_paged"),
    Lab("scheduler", 4, "A batching scheduler with preemption", "05_batching"),
    Lab("int8_cache", 5, "int8 cache quantization with an error bound", "06_quantization"),
)}


def get_lab(name: str) -> Lab:
    try:
        return LABS[name]
    except KeyError:
        raise ValueError(f"no lab named {name!r}; the labs are: {', '.join(LABS)}") from None


def start_lab(name: str, dest: Union[str, Path] = ".", overwrite: bool = False) -> Path:
    """Copy lab `name`'s starter to dest/<name>.py and its instructions to
    dest/<name>.md; returns the starter's new path. Refuses to overwrite a student's
    work unless told to."""
    lab = get_lab(name)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    starter, instructions = dest / f"{lab.name}.py", dest / f"{lab.name}.md"
    for path in (starter, instructions):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} already exists (pass overwrite=True, or --force, "
                                  f"to replace it)")
    shutil.copyfile(lab.starter, starter)
    shutil.copyfile(lab.instructions, instructions)
    return starter
